"""Attention: paged decode / chunked prefill over a (possibly quantized) paged KV cache, and prefill attention.

Conventions (token-major, varlen batches):

* `q` `[Tq, Hq, Dk]`: the new query tokens of all sequences, concatenated; `cu_seqlens_q` `[B+1]` int32 gives each
  sequence's slice (None: one query per sequence, i.e. decode).
* Paged cache per layer: `k_cache` `[pages, page_size, Hkv, Dk]` fp16, `v_cache` `[pages, page_size, Hkv, Dv]`
  fp16, or for a quantized cache the packed uint8 rows plus fp16 scales `[pages, page_size, Hkv, D/32]`
  (`exl2.kernels.kv_quant`). `block_table` `[B, max_pages]` int32 maps a sequence's page i to a cache page;
  `seq_lens` `[B]` int32 counts the cached tokens of each sequence *including* the new ones, which the caller has
  already written (`write_kv`). The `n` queries of a sequence of length `L` sit at positions `L−n … L−1` and
  attend causally to cache positions `[0, L)`: decode, speculative verification and chunked prefill with a cached
  prefix are the same call.
* Options: GQA (`Hq` a multiple of `Hkv`), `scale` (default `Dk^−½`), `sliding_window` w > 0 (key j visible to
  query i iff `i − w < j ≤ i`, Hugging Face's convention), `softcap` c > 0 (`c·tanh(s/c)` on scaled logits),
  `Dk ≠ Dv` allowed, `sinks` (fp32 `[Hq]`, gpt-oss): a logit per query head that joins each softmax with no
  value, so the weights of the keys sum to less than one. MLA models reach these kernels in the absorbed form
  (`MLAttention`): every query head over one latent "KV head", Dk = kv_lora_rank + rope, Dv = kv_lora_rank.

Kernel: one program per (sequence, block of query tokens × the GQA group's heads, KV head, split of the key
range). With split-K ("flash-decoding") each program writes a partial output and its log-sum-exp, and a merge
kernel combines them. A quantized cache is read as codes, never un-rotated: the query is rotated once (a 32×32
Hadamard product per 64-element block), so q·k needs no inverse rotation of the keys, and since attention is
linear in the values, the merge kernel un-rotates the merged output row once.
"""
from __future__ import annotations

import torch

from exl2.kernels import kv_quant
from exl2.kernels.backend import (COUNTER_POOL, PREFETCH_ROWS, counters, next_pow2, pdl_args, pdl_sync, prefetch_l2,
                                  env_choice, sm_count, tl, triton, use_triton)
from exl2.kernels.kv_quant import h32_tl, kv_rows_rotated

# Whether the last-arriving split merges (else a separate merge launch), and whether a key block's values are
# loaded before its first dot; module attributes so benchmarks/kernels.py can A/B them (H200, benchmarks/RESULTS.md).
# The fused merge doubled the decode attention (session 5: batch 1, ctx 2048, fp16: 9.6 → 18.4 µs; batch 16,
# ctx 128: 10.7 → 11.9). Early value loads are free for an fp16 cache and hide the q4 value decode behind the key
# dot (session 10: batch 1, ctx 2048, q4: 16.1 → 13.5 µs).
FUSED_MERGE = False
V_EARLY = True
# Decode launches (one query a sequence) skip the query-offset loads; False restores them (an A/B switch).
ONE_Q = True
# Upper bound on the decode key splits the kernel picks itself (EXL2_ATTN_MAX_SPLITS): with one split a batch's
# attention needs no merge launch, at the price of one program per (sequence, KV head) walking the whole context.
MAX_SPLITS = env_choice("EXL2_ATTN_MAX_SPLITS", 32, range(1, 33))
# (key block, warps, pipelining stages) per (phase, cache kind); set from H200 measurements (benchmarks/RESULTS.md).
# "short": decode asked for one split over fp16 values, which the short-context graphs do (at most
# graphs.SHORT_CONTEXT keys, one or two blocks a program, so nothing to pipeline): batch 16, ctx 128, the output in
# o_proj's order, 9.2 → 7.6 µs (session 15). Quantized rows: one stage (pipelined, their word loads lost the gain:
# batch 1, ctx 2048, q4, 13.78 against 9.09 µs; session 27; q8 and q3 are best there too, q6 within 4 %, session
# 28). A chunked prefill (256 queries over 2,048 cached tokens, H200, session 28): 128-key blocks, q4 one stage
# 224 → 149 µs, fp16 two stages 77 µs (one: 86; 32 keys, one stage: 115); "prefill_wide" keeps the old 32-key
# blocks for head dims above 128 (Gemma's 256, MLA's 192), not measured with 128 keys.
TUNING = {("decode", "fp16"): (64, 4, 2), ("decode", "quant"): (64, 4, 1), ("short", "fp16"): (128, 4, 1),
          ("prefill", "fp16"): (128, 4, 2), ("prefill", "quant"): (128, 4, 1),
          ("prefill_wide", "fp16"): (32, 4, 2), ("prefill_wide", "quant"): (32, 4, 1)}


def tuning_key(max_q_len: int, group: int, dk: int, dv: int, k_bits: int, v_bits: int,
               num_splits: int | None) -> tuple[str, str]:
    """The `TUNING` entry of a launch: decode-like (at most 16 query rows a KV head) or prefill, by cache kind."""
    quant = k_bits != 16 or v_bits != 16
    if max_q_len * group <= 16:
        phase = "short" if num_splits == 1 and not quant else "decode"
    else:
        phase = "prefill" if max(dk, dv) <= 128 else "prefill_wide"
    return phase, "quant" if quant else "fp16"


def decode_splits(programs: int, device: torch.device) -> int:
    """The key splits decode attention takes when not told: enough for two programs per SM, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sm_count(device), programs)))


@triton.jit
def _load_v(v_ptr, vs_ptr, slot, nmask, dv, kvh, stride_vt, stride_vh, stride_vst, stride_vsh, DV, BDV: tl.constexpr,
            BN: tl.constexpr, V_BITS: tl.constexpr, VZERO: tl.constexpr):
    """Values [BN, BDV] of the cache rows `slot` (rotated codes decoded for a quantized cache)."""
    # if/else, not an early return: the compiler also builds the code after a constexpr-true return, and the
    # quantized decoder has no rows for a head narrower than 64.
    if V_BITS == 16:
        vmask = nmask[:, None] & (dv[None, :] < DV)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + dv[None, :], mask=vmask, other=0.0)
    else:
        v = kv_rows_rotated(v_ptr + slot * stride_vt + kvh * stride_vh, vs_ptr + slot * stride_vst + kvh * stride_vsh,
                            nmask, V_BITS, VZERO, DV // 64, BDV // 64, BN)
    return v


@triton.jit
def _kv_slots(bt_ptr, b, stride_bt, page_size, kv_base, offs, ok, PAGED: tl.constexpr):
    """Cache rows of sequence b's positions `offs` (through its block table when PAGED)."""
    if PAGED:
        page = tl.load(bt_ptr + b * stride_bt + offs // page_size, mask=ok, other=0)
        return page.to(tl.int64) * page_size + offs % page_size
    return (kv_base + offs).to(tl.int64)


@triton.jit
def _line_offsets(D: tl.constexpr):
    """Element offsets of the 128-byte lines of an fp16 row of D elements (a power-of-two count; the spare lanes
    repeat line 0)."""
    LINES: tl.constexpr = (D + 63) // 64
    i = tl.arange(0, triton.next_power_of_2(LINES))
    return tl.where(i < LINES, i * 64, 0)


@triton.jit
def _prefetch_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, b, stride_bt, page_size, kv_base, start, end, kvh,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh,
                 DK: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, PAGED: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr):
    """L2 prefetch of the key and value rows (and their scales) of the first BN positions of [start, end): fp16
    rows one address per 128 bytes, quantized rows (at most 128 bytes a head) one per row."""
    offs = start + tl.arange(0, BN)
    ok = offs < end
    slot = tl.where(ok, _kv_slots(bt_ptr, b, stride_bt, page_size, kv_base, offs, ok, PAGED), 0)
    if K_BITS == 16:
        prefetch_l2(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + _line_offsets(DK)[None, :])
    else:
        prefetch_l2(k_ptr + slot * stride_kt + kvh * stride_kh)
        prefetch_l2(ks_ptr + slot * stride_kst + kvh * stride_ksh)
    if V_BITS == 16:
        prefetch_l2(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + _line_offsets(DV)[None, :])
    else:
        prefetch_l2(v_ptr + slot * stride_vt + kvh * stride_vh)
        prefetch_l2(vs_ptr + slot * stride_vst + kvh * stride_vsh)


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_ptr, cuq_ptr, cuk_ptr,
                 o_ptr, lse_ptr, out_ptr, perm_ptr, cnt_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_kst, stride_ksh, stride_vst, stride_vsh, stride_bt,
                 stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, stride_xt, stride_xh,
                 scale, softcap, window, page_size, Q_BLOCKS,
                 GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, KZERO: tl.constexpr, VZERO: tl.constexpr, SPLIT: tl.constexpr,
                 PARTIAL: tl.constexpr, MERGE: tl.constexpr = False, MR: tl.constexpr = 16,
                 MCH: tl.constexpr = 1, PERM: tl.constexpr = False, V_EARLY: tl.constexpr = True,
                 Q_ROT: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                 ONE_Q: tl.constexpr = False, sink_ptr=None, SINK: tl.constexpr = False):
    """One (query block, KV head, key split) program; with MERGE the split arriving last at its counter also
    merges the partials of its rows (no separate merge launch); with PERM outputs go to the columns `perm_ptr`
    gives (the permuted input of a quantized o_proj).

    With PDL the program reads the block table and lengths (written before the step) and, with PREFETCH, asks L2
    for its first key/value block before waiting for the previous kernel (which writes q and the newest cache
    row: a prefetch only warms L2, the point of coherence, so it cannot read that row stale)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    TQ: tl.constexpr = BM // GROUP
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_q // Q_BLOCKS
    t0 = (pid_q % Q_BLOCKS) * TQ
    if ONE_Q:
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(cuq_ptr + b)
        q_len = tl.load(cuq_ptr + b + 1) - q_start
    if t0 < q_len:
        seq_len = tl.load(seq_ptr + b)
        if PAGED:
            kv_base = 0
        else:
            kv_base = tl.load(cuk_ptr + b)
        offs_m = tl.arange(0, BM)
        tok = t0 + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < TQ * GROUP) & (tok < q_len)
        qpos = seq_len - q_len + tok
        dk = tl.arange(0, BDK)
        dv = tl.arange(0, BDV)
        q_rows = (q_start + tok).to(tl.int64)
        last = tl.minimum(t0 + TQ, q_len) - 1
        if CAUSAL:
            hi = seq_len - q_len + last + 1
        else:
            hi = seq_len
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(seq_len - q_len + t0 - window + 1, 0)
        per = tl.cdiv(tl.cdiv(hi - lo, SPLIT), BN) * BN
        start = lo + pid_s * per
        end = tl.minimum(hi, start + per)
        omask = row_ok[:, None] & (dv[None, :] < DV)
        if PERM and not PARTIAL:
            # o_proj's column order is fixed (no kernel writes it): loaded now, its latency hides behind the keys'
            cols = tl.load(perm_ptr + head[:, None] * DV + dv[None, :], mask=omask, other=0)
        if PDL:
            if PREFETCH:
                _prefetch_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, b, stride_bt, page_size, kv_base, start, end, kvh,
                             stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst,
                             stride_vsh, DK, DV, BN, PAGED, K_BITS, V_BITS)
            pdl_sync()
        # Quantized rows are stored rotated (per 64-block, H32 on even and odd elements). Work in the basis
        # d' = 64·blk + 32·par + j (element e = 64·blk + 2j + par), where the rotation is block-diagonal H32.
        # With Q_ROT the caller stored q in that basis already (the RoPE + cache-write launch does).
        if K_BITS < 16 and not Q_ROT:
            RQ: tl.constexpr = BM * (BDK // 32)
            rr = tl.arange(0, RQ)
            rm = rr // (BDK // 32)
            r_tok = t0 + rm // GROUP
            r_ok = (rm < TQ * GROUP) & (r_tok < q_len)
            e = ((rr // 2) % (BDK // 64))[:, None] * 64 + 2 * tl.arange(0, 32)[None, :] + (rr % 2)[:, None]
            qt = tl.load(q_ptr + (q_start + r_tok).to(tl.int64)[:, None] * stride_qt
                         + (kvh * GROUP + rm % GROUP)[:, None] * stride_qh + e, mask=r_ok[:, None] & (e < DK),
                         other=0.0).to(tl.float16)
            q = tl.reshape(tl.dot(qt, h32_tl()) * 0.03125, [BM, BDK]).to(tl.float16)
        else:
            q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :],
                        mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float16)

        m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BDV], dtype=tl.float32)
        for n0 in range(start, end, BN):
            offs_n = n0 + tl.arange(0, BN)
            nmask = offs_n < end
            slot = _kv_slots(bt_ptr, b, stride_bt, page_size, kv_base, offs_n, nmask, PAGED)
            kmask = nmask[None, :] & (dk[:, None] < DK)
            if K_BITS == 16:
                kt = tl.load(k_ptr + slot[None, :] * stride_kt + kvh * stride_kh + dk[:, None], mask=kmask, other=0.0)
            else:
                kt = tl.trans(kv_rows_rotated(k_ptr + slot * stride_kt + kvh * stride_kh,
                                              ks_ptr + slot * stride_kst + kvh * stride_ksh, nmask, K_BITS, KZERO,
                                              DK // 64, BDK // 64, BN))
            if V_EARLY:  # both loads in flight at once
                v = _load_v(v_ptr, vs_ptr, slot, nmask, dv, kvh, stride_vt, stride_vh, stride_vst, stride_vsh, DV,
                            BDV, BN, V_BITS, VZERO)
            s = tl.dot(q, kt.to(tl.float16))
            if HAS_SOFTCAP:
                u = s * (scale / softcap)
                s = (softcap * LOG2E) * (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
            else:
                s = s * (scale * LOG2E)
            vis = nmask[None, :] & row_ok[:, None]
            if CAUSAL:
                vis = vis & (offs_n[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                vis = vis & (offs_n[None, :] > qpos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if not V_EARLY:
                v = _load_v(v_ptr, vs_ptr, slot, nmask, dv, kvh, stride_vt, stride_vh, stride_vst, stride_vsh, DV,
                            BDV, BN, V_BITS, VZERO)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
            m_i = m_new

        has = l_i > 0.0
        if SINK and not PARTIAL:   # the sink joins the denominator (partials stay plain: the merge adds it)
            sk = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            o = acc / (l_i + tl.exp2(tl.minimum(sk - m_i, 126.0)))[:, None]   # a row without keys: 0, not 0/inf
        else:
            o = acc / tl.where(has, l_i, 1.0)[:, None]
        o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        if PARTIAL:
            tl.store(o_ptr + pid_s * stride_os + o_off, o, mask=omask)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + pid_s * stride_ls + q_rows * stride_lt + head * stride_lh, lse, mask=row_ok)
            if MERGE:
                tl.debug_barrier()  # this program's partials are written before its arrival is counted
                count = tl.atomic_add(cnt_ptr + pid_q * tl.num_programs(1) + kvh, 1)
                if count == SPLIT - 1:
                    m_rows = tl.minimum(q_len - t0, TQ) * GROUP
                    out_off, out_mask = _merge_out(perm_ptr, q_start + t0, kvh * GROUP, GROUP, m_rows, stride_xt,
                                                   stride_xh, DV, MR, BDV, V_BITS != 16, PERM)
                    _merge_rows(o_ptr, lse_ptr, out_ptr, out_off, out_mask, q_start + t0, kvh * GROUP, GROUP,
                                m_rows, SPLIT, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, DV,
                                MR, BDV, MCH, V_BITS != 16, sink_ptr, SINK)
                    tl.atomic_xchg(cnt_ptr + pid_q * tl.num_programs(1) + kvh, 0)
        elif PERM:
            tl.store(out_ptr + q_rows[:, None] * stride_xt + cols, o.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _merge_out(perm_ptr, t_base, h_base, G, rows, stride_xt, stride_xh, DV, R: tl.constexpr, BDV: tl.constexpr,
               V_ROT: tl.constexpr, PERM: tl.constexpr):
    """(offsets, mask) of the merged rows' outputs in `out` (see `_merge_rows`): data-independent, and with PERM
    the column order is a fixed load, so callers issue it before waiting on anything."""
    if V_ROT:
        NB: tl.constexpr = R * BDV // 32
        r = tl.arange(0, NB)
        blk = r % (BDV // 32)
        ri = r // (BDV // 32)
        e = (blk // 2)[:, None] * 64 + 2 * tl.arange(0, 32)[None, :] + (blk % 2)[:, None]
        tok = (t_base + ri // G).to(tl.int64)[:, None]
        col = (h_base + ri % G)[:, None] * stride_xh + e
        mask = (ri < rows)[:, None] & (e < DV)
    else:
        i = tl.arange(0, R)
        dv = tl.arange(0, BDV)
        tok = (t_base + i // G).to(tl.int64)[:, None]
        col = (h_base + i % G)[:, None] * stride_xh + dv[None, :]
        mask = (i < rows)[:, None] & (dv < DV)[None, :]
    if PERM:
        col = tl.load(perm_ptr + col, mask=mask, other=0)
    return tok * stride_xt + col, mask


@triton.jit
def _merge_rows(o_ptr, lse_ptr, out_ptr, out_off, out_mask, t_base, h_base, G, rows, SPLIT, stride_os, stride_ot,
                stride_oh, stride_ls, stride_lt, stride_lh, DV, R: tl.constexpr, BDV: tl.constexpr,
                CH: tl.constexpr, V_ROT: tl.constexpr, sink_ptr=None, SINK: tl.constexpr = False):
    """Combine the SPLIT partial outputs (normalised, with their log2-sum-exp) of `rows` (< R) output rows, row i
    being token t_base + i // G, head h_base + i % G; CH splits per load; stored at `out_off` (`_merge_out`).
    Rotated values (basis d' = 64·blk + 32·par + j) are un-rotated once, on the merged rows."""
    i = tl.arange(0, R)
    tok = (t_base + i // G).to(tl.int64)
    head = h_base + i % G
    r_ok = i < rows
    dv = tl.arange(0, BDV)
    c = tl.arange(0, CH)
    m = tl.full([R], float("-inf"), dtype=tl.float32)
    tot = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, BDV], dtype=tl.float32)
    row_off = tok * stride_ot + head * stride_oh
    for s0 in range(0, SPLIT, CH):
        s = s0 + c
        ok = (s < SPLIT)[:, None] & r_ok[None, :]
        lse = tl.load(lse_ptr + s[:, None] * stride_ls + (tok * stride_lt + head * stride_lh)[None, :], mask=ok,
                      other=float("-inf"))
        o = tl.load(o_ptr + s[:, None, None] * stride_os + row_off[None, :, None] + dv[None, None, :],
                    mask=ok[:, :, None] & (dv < DV)[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - ref[None, :]))
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp2(m - ref))
        tot = tot * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=0)
        m = m_new
    if SINK:   # 2^(sink·log2 e) in the units of `tot` (relative to the last reference max)
        sk = tl.load(sink_ptr + head, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        res = acc / (tot + tl.exp2(tl.minimum(sk - tl.where(m == float("-inf"), 0.0, m), 126.0)))[:, None]
    else:
        res = acc / tl.where(tot > 0, tot, 1.0)[:, None]
    if V_ROT:
        NB: tl.constexpr = R * BDV // 32
        r2 = tl.reshape(res, [NB, 32])
        if NB >= 16:
            res = tl.dot(r2, h32_tl().to(tl.float32), input_precision="ieee") * 0.03125
        else:
            res = tl.sum(r2[:, :, None] * h32_tl().to(tl.float32)[None, :, :], axis=1) * 0.03125
    tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, perm_ptr, SPLIT, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                  stride_lh, stride_xt, stride_xh, DV: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr,
                  V_ROT: tl.constexpr, PERM: tl.constexpr = False, PDL: tl.constexpr = False, sink_ptr=None,
                  SINK: tl.constexpr = False):
    """The merge as its own launch, one (token, head) per program (where the fused merge does not apply)."""
    t, h = tl.program_id(0), tl.program_id(1)
    out_off, out_mask = _merge_out(perm_ptr, t, h, 1, 1, stride_xt, stride_xh, DV, 1, BDV, V_ROT, PERM)
    if PDL:
        pdl_sync()
    _merge_rows(o_ptr, lse_ptr, out_ptr, out_off, out_mask, t, h, 1, 1, SPLIT, stride_os, stride_ot, stride_oh,
                stride_ls, stride_lt, stride_lh, DV, 1, BDV, BS, V_ROT, sink_ptr, SINK)


# --------------------------------------------------------------------------------------------------- helpers
def _cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """`[pages, page_size, H, X]` (or `[slots, H, X]`) → `[slots, H, X]` view."""
    return cache.view(-1, cache.shape[-2], cache.shape[-1])


def _head_dim(cache: torch.Tensor, bits: int) -> int:
    return cache.shape[-1] if bits == 16 else cache.shape[-1] * 8 // bits


def _check(q, k_cache, v_cache, k_bits, v_bits, k_scales, v_scales):
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {list(q.shape)}.")
    hq, hkv = q.shape[1], k_cache.shape[-2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads.")
    if _head_dim(k_cache, k_bits) != q.shape[-1]:
        raise ValueError(f"key head dim {_head_dim(k_cache, k_bits)} differs from the query's {q.shape[-1]}.")
    for bits, sc, name in ((k_bits, k_scales, "k"), (v_bits, v_scales, "v")):
        if bits != 16 and sc is None:
            raise ValueError(f"a {bits}-bit {name} cache needs {name}_scales.")


def slot_mapping(block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """Cache slot (`page·page_size + offset`) of every new token, in `q` order (int64 `[Tq]`)."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    b = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens.long())
    i = torch.arange(b.numel(), device=b.device) - cu_seqlens_q[:-1].long()[b]
    pos = seq_lens.long()[b] - q_lens.long()[b] + i
    page = block_table.long()[b, pos // page_size]
    return page * page_size + pos % page_size


@triton.jit
def _copy_row(src_row, dst_row, W, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for o in range(0, W, BLOCK):
        m = o + offs < W
        tl.store(dst_row + o + offs, tl.load(src_row + o + offs, mask=m).to(dst_row.dtype.element_ty), mask=m)


@triton.jit
def _write_rows_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, KW, VW, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Row t of k (axis 1 = 0) or v (axis 1 = 1) into cache row slots[t]."""
    if PDL:
        pdl_sync()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if tl.program_id(1) == 0:
        _copy_row(k_ptr + t * stride_k, kc_ptr + slot * KW, KW, BLOCK)
    else:
        _copy_row(v_ptr + t * stride_v, vc_ptr + slot * VW, VW, BLOCK)


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(x.shape[0], -1)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k_bits: int = 16, v_bits: int = 16, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Store new keys/values `[T, Hkv, D]` into the cache rows `slots` (quantizing for a quantized cache). An
    fp16 or fully quantized cache takes both in one launch."""
    if k_bits == 16 and v_bits == 16 and use_triton(k) and k.shape[0]:
        k2, v2 = _rows2d(k), _rows2d(v)
        kc, vc = _cache_rows(k_cache), _cache_rows(v_cache)
        kw, vw = k2.shape[1], v2.shape[1]
        if kc.shape[1] * kc.shape[2] != kw or vc.shape[1] * vc.shape[2] != vw:
            raise ValueError("new keys/values do not match the cache's row width.")
        block = min(1024, next_pow2(max(kw, vw)))
        _write_rows_kernel[(k2.shape[0], 2)](k2, v2, kc, vc, slots.reshape(-1), k2.stride(0), v2.stride(0), kw, vw,
                                            BLOCK=block, num_warps=4, **pdl_args(k2.device, k2.shape[0], small=True))
        return
    if k_bits != 16 and v_bits != 16:
        kv_quant.write_kv_quant_pair(k, v, (k_cache, k_scales), (v_cache, v_scales), slots.reshape(-1), k_bits,
                                     v_bits)
        return
    for x, cache, bits, sc in ((k, k_cache, k_bits, k_scales), (v, v_cache, v_bits, v_scales)):
        if bits == 16:
            _cache_rows(cache).index_copy_(0, slots.reshape(-1).long(), x.to(cache.dtype))
        else:
            kv_quant.write_kv_quant(x, cache, sc, slots.reshape(-1), bits)


def _attend_torch(q, k, v, qpos, scale, causal, window, softcap, sinks=None):
    """Reference attention for one sequence: q `[n, Hq, Dk]`, k/v `[L, Hkv, ·]` (fp32 math); `sinks` [Hq]."""
    hq, hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(hq // hkv, dim=1)
    vf = v.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0], device=q.device)
    vis = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        vis &= kpos[None, :] <= qpos[:, None]
    if window > 0:
        vis &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vf)


_DECODE_CU: dict[tuple[int, torch.device], torch.Tensor] = {}


def _decode_cu(cu_seqlens_q, b, device):
    """Query offsets of b one-token sequences; made once per (b, device), not once per layer and step."""
    if cu_seqlens_q is not None:
        return cu_seqlens_q
    key = (b, torch.device(device))
    cu = _DECODE_CU.get(key)
    if cu is None:
        cu = torch.arange(b + 1, dtype=torch.int32, device=device)
        # A tensor made while a CUDA graph is being captured holds its values only once the graph runs.
        if not (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
            _DECODE_CU[key] = cu
    return cu


# --------------------------------------------------------------------------------------------------- paged
def paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, max_q_len=1, *,
                          scale=None, sliding_window=0, softcap=0.0, k_bits=16, v_bits=16, k_scales=None,
                          v_scales=None, causal=True, num_splits=None, sinks=None):
    """The twin of `paged_attention` (dequantizes the used cache rows, then plain attention per sequence)."""
    _check(q, k_cache, v_cache, k_bits, v_bits, k_scales, v_scales)
    dk, dv = q.shape[-1], _head_dim(v_cache, v_bits)
    scale = dk ** -0.5 if scale is None else scale
    ps = k_cache.shape[1]
    cu = _decode_cu(cu_seqlens_q, block_table.shape[0], q.device).tolist()
    lens = seq_lens.tolist()
    out = torch.zeros((q.shape[0], q.shape[1], dv), dtype=q.dtype, device=q.device)
    for b, length in enumerate(lens):
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        pages = block_table[b, : -(-length // ps)].long()
        slots = (pages[:, None] * ps + torch.arange(ps, device=q.device)).reshape(-1)[:length]

        def rows(cache, bits, sc, d):
            r = _cache_rows(cache).index_select(0, slots)
            if bits == 16:
                return r
            return kv_quant.dequantize_kv_torch(r, _cache_rows(sc).index_select(0, slots), bits, d)

        k = rows(k_cache, k_bits, k_scales, dk)
        v = rows(v_cache, v_bits, v_scales, dv)
        qpos = torch.arange(length - n, length, device=q.device)
        out[cu[b]:cu[b + 1]] = _attend_torch(q[cu[b]:cu[b + 1]], k, v, qpos, scale, causal, sliding_window,
                                             softcap, sinks).to(q.dtype)
    return out


def _launch(q, k_rows, v_rows, ks_rows, vs_rows, block_table, seq_lens, cu_q, cu_k, max_q_len, scale,
            sliding_window, softcap, k_bits, v_bits, causal, num_splits, paged, page_size, out_index=None,
            q_rotated=False, one_q=False, sinks=None):
    tq, hq, dk = q.shape
    hkv = k_rows.shape[1]
    dv = _head_dim(v_rows, v_bits)
    group = hq // hkv
    b = cu_q.numel() - 1
    if out_index is not None:
        out = torch.empty((tq, hq * dv), dtype=q.dtype, device=q.device)
        out_strides, perm = (out.stride(0), dv), out_index
    else:
        out = torch.empty((tq, hq, dv), dtype=q.dtype, device=q.device)
        out_strides, perm = (out.stride(0), out.stride(1)), cu_q
    if tq == 0 or b == 0:
        return out
    decode_like = max_q_len * group <= 16
    bm = max(16, next_pow2(group)) if decode_like else max(64, next_pow2(group))
    bn, warps, stages = TUNING[tuning_key(max_q_len, group, dk, dv, k_bits, v_bits, num_splits)]
    bm = max(bm, next_pow2(group) * min(next_pow2(max_q_len), max(1, bm // next_pow2(group))))
    tq_per = bm // group
    q_blocks = triton.cdiv(max_q_len, tq_per)
    if num_splits is None:
        num_splits = decode_splits(b * q_blocks * hkv, q.device) if decode_like else 1
    split = int(num_splits)
    ks_rows = ks_rows if ks_rows is not None else q
    vs_rows = vs_rows if vs_rows is not None else q
    partial = split > 1 or v_bits != 16
    # the last-arriving split merges its rows: one counter per (query block, KV head)
    merge = FUSED_MERGE and partial and b * q_blocks * hkv <= COUNTER_POOL
    mr = next_pow2(min(tq_per, max_q_len) * group)
    if partial:
        o_part = torch.empty((split, tq, hq, dv), dtype=torch.float32, device=q.device)
        lse = torch.empty((split, tq, hq), dtype=torch.float32, device=q.device)
        o_dst, os_ = o_part, o_part.stride()
        ls_ = lse.stride()
    else:
        o_dst, lse = out, out
        os_ = (0, out.stride(0), dv if out_index is not None else out.stride(1))
        ls_ = (0, 0, 0)
    bt = block_table if paged else cu_q
    sink = None if sinks is None else sinks.float().contiguous()
    _attn_kernel[(b * q_blocks, hkv, split)](
        q, k_rows, v_rows, ks_rows, vs_rows, bt, seq_lens, cu_q, cu_k if cu_k is not None else cu_q,
        o_dst, lse, out, perm, counters(q.device),
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        ks_rows.stride(0) if ks_rows.dim() == 3 else 0, ks_rows.stride(1) if ks_rows.dim() == 3 else 0,
        vs_rows.stride(0) if vs_rows.dim() == 3 else 0, vs_rows.stride(1) if vs_rows.dim() == 3 else 0,
        bt.stride(0), os_[0], os_[1], os_[2], ls_[0], ls_[1], ls_[2], *out_strides,
        float(scale), float(softcap) if softcap else 1.0, int(sliding_window), int(page_size), q_blocks,
        GROUP=group, DK=dk, DV=dv, BDK=next_pow2(dk), BDV=next_pow2(dv), BM=bm, BN=bn, PAGED=paged,
        CAUSAL=causal, HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=softcap > 0, K_BITS=k_bits, V_BITS=v_bits,
        KZERO=kv_quant._zero(k_bits) if k_bits != 16 else 0.0, VZERO=kv_quant._zero(v_bits) if v_bits != 16 else 0.0,
        SPLIT=split, PARTIAL=partial, MERGE=merge, MR=mr,
        MCH=max(1, min(next_pow2(split), 8192 // (mr * next_pow2(dv)))), PERM=out_index is not None,
        V_EARLY=V_EARLY, Q_ROT=q_rotated, ONE_Q=one_q and ONE_Q, sink_ptr=sink, SINK=sink is not None,
        num_warps=warps, num_stages=stages, **pdl_args(q.device, tq, prefetch=PREFETCH_ROWS > 0, small=True,
                                                     split=partial))
    if partial and not merge:
        _merge_kernel[(tq, hq)](o_part, lse, out, perm, split, *o_part.stride()[:3], *lse.stride(), *out_strides,
                                DV=dv, BS=next_pow2(split), BDV=next_pow2(dv), V_ROT=v_bits != 16,
                                PERM=out_index is not None, sink_ptr=sink, SINK=sink is not None, num_warps=4,
                                **pdl_args(o_part.device, tq, small=True, split=True))
    return out


def scatter_columns(o: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
    """`[T, H·D]` rows of o `[T, H, D]` with natural column c moved to `out_index[c]`: the twin of the kernels'
    permuted output (`out_index` a permutation, e.g. the inverse of a quantized o_proj's input order)."""
    flat = o.reshape(o.shape[0], -1)
    out = torch.empty_like(flat)
    out[:, out_index.long()] = flat
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None, max_q_len: int = 1, *,
                    scale: float | None = None, sliding_window: int = 0, softcap: float = 0.0, k_bits: int = 16,
                    v_bits: int = 16, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                    causal: bool = True, num_splits: int | None = None,
                    out_index: torch.Tensor | None = None, q_rotated: bool = False,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of new queries over the paged cache (see the module docstring); returns `[Tq, Hq, Dv]`.

    `max_q_len` bounds the query tokens of any one sequence (1 for decode). `num_splits` fixes the number of
    key-range splits (None: enough programs to fill the GPU); fix it when capturing CUDA graphs. `out_index`
    (int32 `[Hq·Dv]`, a permutation) returns `[Tq, Hq·Dv]` rows with natural column c at `out_index[c]`
    instead (`scatter_columns`): the kernel then writes o_proj's permuted input, and no gather is needed.
    `q_rotated`: q is already in a quantized key cache's rotated basis (`kv_quant.write_kv_quant_pair` with
    `hadamard_q`; Triton path only). `sinks` (`[Hq]`): gpt-oss's per-head sink logits.
    """
    _check(q, k_cache, v_cache, k_bits, v_bits, k_scales, v_scales)
    if out_index is not None and out_index.numel() != q.shape[1] * _head_dim(v_cache, v_bits):
        raise ValueError("out_index must have one entry per output column (heads x value dim).")
    if q_rotated and (k_bits == 16 or not use_triton(q)):
        raise ValueError("a query in the rotated basis needs a quantized key cache and the Triton path.")
    if not use_triton(q):
        out = paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_q_len,
                                    scale=scale, sliding_window=sliding_window, softcap=softcap, k_bits=k_bits,
                                    v_bits=v_bits, k_scales=k_scales, v_scales=v_scales, causal=causal, sinks=sinks)
        return out if out_index is None else scatter_columns(out, out_index)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cu_q = _decode_cu(cu_seqlens_q, block_table.shape[0], q.device)
    return _launch(q, _cache_rows(k_cache), _cache_rows(v_cache),
                   _cache_rows(k_scales) if k_scales is not None else None,
                   _cache_rows(v_scales) if v_scales is not None else None,
                   block_table, seq_lens, cu_q, None, max_q_len, scale, sliding_window, softcap, k_bits, v_bits,
                   causal, num_splits, True, k_cache.shape[1], out_index, q_rotated, cu_seqlens_q is None, sinks)


# --------------------------------------------------------------------------------------------------- prefill
def varlen_attention_torch(q, k, v, cu_seqlens=None, max_seqlen=None, *, scale=None, causal=True,
                           sliding_window=0, softcap=0.0):
    """The twin of `varlen_attention`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cu = [0, q.shape[0]] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype, device=q.device)
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        qpos = torch.arange(e - s, device=q.device)
        out[s:e] = _attend_torch(q[s:e], k[s:e], v[s:e], qpos, scale, causal, sliding_window, softcap).to(q.dtype)
    return out


def _flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
        return flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def _sdpa(q, k, v, cu, scale, causal):
    hq, hkv = q.shape[1], k.shape[1]
    outs = []
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        qb, kb, vb = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        # enable_gqa instead of repeating k/v per query head: the two copies took 1.5 ms of a 2,047-token prefill
        ob = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale,
                                                              enable_gqa=hq != hkv)
        outs.append(ob[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | list | None = None,
                     max_seqlen: int | None = None, *, scale: float | None = None, causal: bool = True,
                     sliding_window: int = 0, softcap: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """Prefill attention among new tokens only (no cached prefix): q `[T, Hq, Dk]`, k `[T, Hkv, Dk]`, v `[T, Hkv, Dv]`.

    `cu_seqlens` (list or tensor `[B+1]`; None: one sequence) delimits the sequences. Backends: "sdpa" (PyTorch's
    flash/cuDNN attention; plain causal or full only; the sequence list is read on the host), "flash_attn" (if
    installed), "triton" (any option), "auto" (sdpa for plain masks, else flash_attn, else triton).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q):
        return varlen_attention_torch(q, k, v, cu_seqlens, max_seqlen, scale=scale, causal=causal,
                                      sliding_window=sliding_window, softcap=softcap)
    plain = sliding_window <= 0 and softcap <= 0
    if backend == "auto":
        backend = "sdpa" if plain and q.is_cuda else ("flash_attn" if _flash_attn() and q.is_cuda else "triton")
    if backend == "sdpa":
        if not plain:
            raise ValueError("the sdpa backend supports neither sliding windows nor soft-capping.")
        cu = [0, q.shape[0]] if cu_seqlens is None else [int(c) for c in cu_seqlens]
        return _sdpa(q, k, v, cu, scale, causal)
    cu_t = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device) if cu_seqlens is None else \
        torch.as_tensor(cu_seqlens, dtype=torch.int32, device=q.device)
    if max_seqlen is None:
        max_seqlen = int((cu_t[1:] - cu_t[:-1]).max())
    if backend == "flash_attn":
        fa = _flash_attn()
        window = (sliding_window - 1, 0 if causal else -1) if sliding_window > 0 else (-1, -1)
        return fa(q, k, v, cu_t, cu_t, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal,
                  window_size=window, softcap=softcap)
    seq_lens = cu_t[1:] - cu_t[:-1]
    return _launch(q, k, v, None, None, cu_t, seq_lens, cu_t, cu_t, max_seqlen, scale, sliding_window, softcap,
                   16, 16, causal, 1, False, 1)
