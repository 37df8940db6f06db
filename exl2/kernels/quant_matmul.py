"""Triton kernels for `y = x · W + bias` with W a `QuantWeight` (EXL2 or GPTQ), and the dispatcher.

Three paths, chosen per shape (`choose_config`):

* **gemv** (M ≤ 4): CUDA-core kernel, one input row per program. Each program owns BN output columns and a
  1/SPLIT share of the steps of every width class (so each split reads the same mix of widths). 4-bit classes
  decode two codes per instruction in packed fp16 (inline PTX, behind a one-time self-check); the others shift,
  mask and use the 2^23 exponent trick in fp32. The loop is a plain `tl.range` that Triton software-pipelines
  `num_stages` tiles deep through shared memory (cp.async).
* **dot** (M ≤ 64): decodes one row-in-word at a time, so each decoded [steps·words, BN] tile feeds `tl.dot` from
  its own register layout, bit-exact with the reference dequantizer (EXL2 4-bit: all eight rows of a word per
  packed-fp16 asm call).
* **dequant** (larger M): a Triton kernel writes the fp16 weight in natural order, then cuBLAS multiplies.
  Weights sharing an input (q/k/v, gate/up) are dequantized side by side into one matrix (one launch per class
  when their class layouts agree) and multiplied in one cuBLAS call (`dequant_matmul_group`).

The gemv and dot kernels read the input already permuted into the weight's stored row order (`x_index`): one
`gather_input` launch per input shared by several weights, or written directly by the kernel producing the input
(`rms_norm_gather`, `glu(index=...)`, consumed by `permuted_matmul`). `GemvGroup` runs the gemvs of 2–3 weights
sharing an input as one launch.

Split-K partial sums go to an fp32 workspace; the last program of each output tile (counted with an atomic on a
per-device counter pool that every program resets) adds them up, adds the bias and writes the output, so a
call is one launch (CUDA-graph friendly). Counters are shared per device: calls on one stream never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from exl2.kernels.backend import (COUNTER_POOL, PREFETCH_ROWS, counters, env_choice, next_pow2, pdl_args, pdl_sync,
                                  prefetch_l2, sm_count, tl, triton, use_triton)
from exl2.kernels import mma_dot
from exl2.kernels.permute import gather_block, take_columns
from exl2.kernels.qweight import WIDTHS, QuantWeight, matmul_torch, split_bits
from exl2.kernels.split_sum import SplitSum


# --------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _store_out(res, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, cnt_ptr, bias_ptr, tile_id, pid_k, SPLIT,
               HAS_BIAS: tl.constexpr, SPLIT_ON: tl.constexpr, RED: tl.constexpr, PART_ONLY: tl.constexpr = False):
    """Write the tile, or (split K) its partial; the last program of the tile sums the partials, RED at a time
    (independent loads, so the sum costs one memory latency per RED partials, not one per partial). PART_ONLY
    (no bias): only the partial, for a consumer that sums them (`SplitSum`)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if not SPLIT_ON:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        p_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + p_off, res, mask=mask)
        if not PART_ONLY:
            tl.debug_barrier()
            count = tl.atomic_add(cnt_ptr + tile_id, 1)
            if count == SPLIT - 1:
                tot = tl.zeros_like(res)
                offs_r = tl.arange(0, RED)
                for i in range(0, SPLIT, RED):
                    kk = i + offs_r
                    ptrs = part_ptr + (kk.to(tl.int64) * M * N)[:, None, None] + p_off[None, :, :]
                    chunk = tl.load(ptrs, mask=(kk < SPLIT)[:, None, None] & mask[None, :, :], other=0.0,
                                    cache_modifier=".cg")
                    tot += tl.sum(chunk, axis=0)
                if HAS_BIAS:
                    tot += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
                tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)


@triton.jit
def _gather_kernel(x_ptr, stride_xm, out_ptr, stride_om, i0, o0, n0, i1, o1, n1, i2, o2, n2, i3, o3, n3,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, o_w + p] = x[m, idx_w[p]] (0 where idx_w[p] < 0) for up to four weights w (grid axis 2)."""
    if PDL:
        pdl_sync()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1).to(tl.int64)
    which = tl.program_id(2)
    x_row = x_ptr + row * stride_xm
    out_row = out_ptr + row * stride_om
    if which == 0:
        gather_block(x_row, i0, out_row + o0, n0, offs)
    elif which == 1:
        gather_block(x_row, i1, out_row + o1, n1, offs)
    elif which == 2:
        gather_block(x_row, i2, out_row + o2, n2, offs)
    else:
        gather_block(x_row, i3, out_row + o3, n3, offs)


@triton.jit
def _load_class(qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, s0, s_hi, first_step, first_word, jj, offs_n, mask_n,
                BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr, BS: tl.constexpr):
    """Low words, high words (the low words again if HB = 0), scales and zeros (the scales again without zero
    tensors), each [BS, LB, BN] in one layout, of BS steps from s0; zeros past s_hi."""
    PER: tl.constexpr = 32 // LB
    HPER: tl.constexpr = 32 // HB if HB > 0 else 32
    offs_s = s0 + tl.arange(0, BS)
    mask_s = offs_s < s_hi
    m3 = mask_s[:, None, None] & mask_n[None, None, :]
    wrow = first_word + (offs_s - first_step) * BITS
    w = tl.load(qw_ptr + (wrow[:, None] + jj[None, :])[:, :, None].to(tl.int64) * N + offs_n[None, None, :],
                mask=m3, other=0)
    if HB > 0:
        hrow = wrow[:, None] + LB + (jj * PER // HPER)[None, :]
        h = tl.load(qw_ptr + hrow[:, :, None].to(tl.int64) * N + offs_n[None, None, :], mask=m3, other=0)
    else:
        h = w
    grp = tl.load(sg_ptr + offs_s, mask=mask_s, other=0)
    g_off = grp[:, None, None].to(tl.int64) * N + (jj * 0)[None, :, None] + offs_n[None, None, :]
    sc = tl.load(sc_ptr + g_off, mask=m3, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zr_ptr + g_off, mask=m3, other=0.0)
    else:
        z = sc
    return w, h, sc, z


@triton.jit
def _gemv_class(x_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT,
                offs_n, mask_n, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr = 2):
    """Partial x·W over this program's share of one width class's steps, for BN columns ([BN] fp32).

    x is the permuted input (`gather_input`). Tiles are [steps, low word j, row-in-word u, columns]; stored row
    of (s, j, u) is 32·s + PER·j + u, read from input position 32·s + `pos`; Triton pipelines the loop STAGES
    deep."""
    PER: tl.constexpr = 32 // LB
    HPER: tl.constexpr = 32 // HB if HB > 0 else 32
    MAGIC: tl.constexpr = 8388608.0 + (1 << (BITS - 1))
    jj = tl.arange(0, LB)
    uu = tl.arange(0, PER)
    row = jj[:, None] * PER + uu[None, :]  # [LB, PER]
    if BITS == 4:
        pos = jj[:, None] * 8 + (uu % 4)[None, :] * 2 + (uu // 4)[None, :]
    elif BITS == 6:
        pos = (jj % 2)[:, None] * 16 + 2 * uu[None, :] + (jj // 2)[:, None]
    else:
        pos = row
    lo_sh = (uu * LB)[None, None, :, None]
    hi_sh = (HB * (row % HPER))[None, :, :, None]
    s_lo = first_step + (n_steps * pid_k) // SPLIT
    s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT
    acc = tl.zeros([BS, LB, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        w, h, sc, z = _load_class(qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, s0, s_hi, first_step, first_word, jj, offs_n,
                                  mask_n, BITS, LB, HB, HAS_ZEROS, BS)
        offs_s = s0 + tl.arange(0, BS)
        code = (w[:, :, None, :] >> lo_sh) & ((1 << LB) - 1)
        if HB > 0:
            code = code | (((h[:, :, None, :] >> hi_sh) & ((1 << HB) - 1)) << LB)
        xv = tl.load(x_ptr + offs_s[:, None, None] * 32 + pos[None, :, :], mask=(offs_s < s_hi)[:, None, None],
                     other=0.0).to(tl.float32)
        if HAS_ZEROS:
            cf = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            cf = (code | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC
        t = tl.sum(xv[:, :, :, None] * cf, axis=2)
        if HAS_ZEROS:
            t = t - tl.sum(xv, axis=2)[:, :, None] * z.to(tl.float32)
        acc += t * sc.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


# The packed 4-bit decoder (`_gemv_class4_pipe`): one asm block takes the four words of a step for one column
# (32 codes under one scale) and 16 input pairs, which the permuted input holds side by side (PAIR_ORDER). lop3
# puts codes (u, u+4) of a word under the fp16 exponent of 1024, the odd ones (mask 0x00F000F0) 16x too large,
# which the fma by 1/16 that removes 1024 + the zero point (8) also undoes, so a word costs one shift, and packed
# FMAs multiply by the matching pairs of inputs. The packed products are summed in fp16 (a step's, or with
# EXL2_GEMV_ACC16=0 each word's) and added in fp32.
def _ptx_unpack4(word: str) -> str:
    """PTX that leaves a 4-bit word's codes minus 8 as exact fp16 pairs: q0 = (0, 4), q1 = (1, 5), q2 = (2, 6),
    q3 = (3, 7). Needs registers q0-q3, s and the constants z = 1032 (x2), c = 1/16 (x2), d = -72 (x2)."""
    return f"""
lop3.b32 q0, {word}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q1, {word}, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 s, {word}, 8;
lop3.b32 q2, s, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q3, s, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 q0, q0, z;
fma.rn.f16x2 q1, q1, c, d;
sub.f16x2 q2, q2, z;
fma.rn.f16x2 q3, q3, c, d;"""


_PTX_UNPACK4_CONSTANTS = """
mov.b32 z, 0x64086408;
mov.b32 c, 0x2C002C00;
mov.b32 d, 0xD480D480;"""
# The packed gemv decoders sum a whole step (32 products, two fp16x2 chains of 16) before converting to fp32,
# instead of every word (8): 12 of a 4-bit step's 68 instructions fewer, and the gemv is instruction-bound (H200,
# batch 1: 392 -> 415 tok/s at ctx 2048, benchmarks/RESULTS.md session 11). exllamav2's kernels sum at least as
# long in fp16. EXL2_GEMV_ACC16=0 restores the per-word sums.
GEMV_ACC16 = env_choice("EXL2_GEMV_ACC16", 1, range(0, 2)) == 1


def _ptx_add_f32(acc: str, first: bool) -> list[str]:
    """PTX adding both fp16 lanes of `acc` into the fp32 sum r (`first`: r is set instead)."""
    lines = [f"mov.b32 {{lo, hi}}, {acc};", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;"]
    return lines + (["add.f32 r, flo, fhi;"] if first else ["add.f32 r, r, flo;", "add.f32 r, r, fhi;"])


def _words4_asm(acc16: bool) -> str:
    """The 4-bit step decoder: $1-$4 the words, $5-$20 the input pairs (4 per word), $0 the fp32 sum."""
    lines = ["{", ".reg .b32 q0, q1, q2, q3, s, a, b, z, c, d;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi, r;",
             _PTX_UNPACK4_CONSTANTS, "mov.f32 r, 0f00000000;"]
    for j in range(4):
        acc = ("a" if j < 2 else "b") if acc16 else "a"
        first = j % 2 == 0 if acc16 else True
        lines.append(_ptx_unpack4(f"${1 + j}"))
        lines.append(f"mul.rn.f16x2 {acc}, q0, ${5 + 4 * j};" if first
                     else f"fma.rn.f16x2 {acc}, q0, ${5 + 4 * j}, {acc};")
        lines += [f"fma.rn.f16x2 {acc}, q{i}, ${5 + 4 * j + i}, {acc};" for i in (1, 2, 3)]
        if not acc16:
            lines += _ptx_add_f32("a", False)
    if acc16:
        lines += ["add.rn.f16x2 a, a, b;"] + _ptx_add_f32("a", True)
    lines += ["mov.f32 $0, r;", "}"]
    return "\n".join(lines)


_WORDS4_ASM = tl.constexpr(_words4_asm(GEMV_ACC16))
_WORDS4_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 20))


@triton.jit
def _by_word(t):
    """[BS, 2, 2] indexed (j // 2, j % 2) -> its four [BS, 1] slices for j = 0..3 (words, or quarters of a step's
    input pairs)."""
    even, odd = tl.split(t)
    j0, j2 = tl.split(even)
    j1, j3 = tl.split(odd)
    return j0[:, None], j1[:, None], j2[:, None], j3[:, None]


@triton.jit
def _step_pairs(x32_ptr, offs_s, mask_s):
    """Each step's 16 input pairs (int32 4j + k: word j, codes k and k+4), split by k: four [BS, 2, 2] tensors
    for `_by_word`."""
    BS: tl.constexpr = offs_s.shape[0]
    xw = tl.load(x32_ptr + offs_s[:, None] * 16 + tl.arange(0, 16)[None, :], mask=mask_s[:, None], other=0)
    k_even, k_odd = tl.split(tl.reshape(xw, [BS, 2, 2, 2, 2]))  # axes: step, j // 2, j % 2, k // 2, k % 2
    k0, k2 = tl.split(k_even)
    k1, k3 = tl.split(k_odd)
    return k0, k1, k2, k3


@triton.jit
def step_rows(qw_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n, BITS: tl.constexpr):
    """For the steps offs_s of a class of BITS words a step: pointers [BS, BN] to each step's first word row (word
    i is `+ i·N`) and the mask of those loads."""
    m2 = mask_s[:, None] & mask_n[None, :]
    return qw_ptr + (first_word + (offs_s - first_step) * BITS)[:, None].to(tl.int64) * N + offs_n[None, :], m2


@triton.jit
def step_scales(sc_ptr, sg_ptr, N, offs_s, mask_s, offs_n, m2):
    """The scales [BS, BN] of the steps offs_s (their groups' rows)."""
    grp = tl.load(sg_ptr + offs_s, mask=mask_s, other=0)
    return tl.load(sc_ptr + grp[:, None].to(tl.int64) * N + offs_n[None, :], mask=m2, other=0.0)


@triton.jit
def step_words4(qw_ptr, sc_ptr, sg_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n):
    """A 4-bit class's four words [BS, BN] of the steps offs_s (zeros past the masks) and their scales."""
    w_ptrs, m2 = step_rows(qw_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n, 4)
    w0, w1 = tl.load(w_ptrs, mask=m2, other=0), tl.load(w_ptrs + N, mask=m2, other=0)
    w2, w3 = tl.load(w_ptrs + 2 * N, mask=m2, other=0), tl.load(w_ptrs + 3 * N, mask=m2, other=0)
    return w0, w1, w2, w3, step_scales(sc_ptr, sg_ptr, N, offs_s, mask_s, offs_n, m2)


@triton.jit
def _gemv_class4_pipe(x32_ptr, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT,
                      offs_n, mask_n, BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """`_gemv_class` for a 4-bit class without zero tensors (EXL2), with packed fp16x2 arithmetic: x32 is the
    permuted fp16 input read as int32 pairs; a step's four words per asm call, each scale loaded once; Triton
    pipelines the loop STAGES deep."""
    s_lo = first_step + (n_steps * pid_k) // SPLIT
    s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT
    acc = tl.zeros([BS, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        offs_s = s0 + tl.arange(0, BS)
        mask_s = offs_s < s_hi
        w0, w1, w2, w3, sc = step_words4(qw_ptr, sc_ptr, sg_ptr, N, first_step, first_word, offs_s, mask_s, offs_n,
                                         mask_n)
        k0, k1, k2, k3 = _step_pairs(x32_ptr, offs_s, mask_s)
        x00, x10, x20, x30 = _by_word(k0)
        x01, x11, x21, x31 = _by_word(k1)
        x02, x12, x22, x32 = _by_word(k2)
        x03, x13, x23, x33 = _by_word(k3)
        part = tl.inline_asm_elementwise(
            _WORDS4_ASM, _WORDS4_CONSTRAINTS,
            [w0, w1, w2, w3, x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33],
            dtype=tl.float32, is_pure=True, pack=1)
        acc += part * sc.to(tl.float32)
    return tl.sum(acc, axis=0)


# 6-bit classes: the permuted input pairs rows r and r + 16 (`PAIR_ORDER6`), which sit at the same bits of low
# words j and j + 2 and of high words 0 and 1. One prmt per byte of a low-word pair puts both rows' nibbles in the
# two fp16 lanes (the odd row of the byte comes out 16x, as in the 4-bit decoder), one prmt per byte of the high
# words does the same for the top two bits, a shift and a lop3 merge them under the exponent of 1024, and one
# packed subtraction (or fma) removes 1024 + 32. ~3 instructions per weight instead of ~10.
def _ptx_words6(acc16: bool = False) -> str:
    lines = ["{", ".reg .b32 a, b, c, t, acc, acc2, z, q, d;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi, r;",
             "mov.b32 z, 0x64206420;", "mov.b32 q, 0x2C002C00;", "mov.b32 d, 0xD600D600;", "mov.f32 r, 0f00000000;"]
    for jp in range(2):
        for k in range(4):
            lines.append(f"prmt.b32 a, ${1 + jp}, ${3 + jp}, {((4 + k) << 8) | k:#x};")
            if k % 2 == 0:
                byte = 2 * jp + k // 2
                lines.append(f"prmt.b32 b, $5, $6, {((4 + byte) << 8) | byte:#x};")
            for e in range(2):
                pair = 8 * jp + 2 * k + e
                lo_mask, hi_mask = ("0x000F000F", "0x00300030") if e == 0 else ("0x00F000F0", "0x03000300")
                shift = (4 if e == 0 else 6) - 4 * (k % 2)
                lines.append(f"lop3.b32 t, a, {lo_mask}, 0x64006400, 0xEA;")
                lines.append(f"shl.b32 c, b, {shift};")
                lines.append(f"lop3.b32 t, c, {hi_mask}, t, 0xEA;")
                lines.append("sub.f16x2 t, t, z;" if e == 0 else "fma.rn.f16x2 t, t, q, d;")
                run = 8 if acc16 else 4  # products summed in fp16 before the conversion
                acc = "acc2" if acc16 and pair >= 8 else "acc"
                if pair % run == 0:
                    lines.append(f"mul.rn.f16x2 {acc}, t, ${7 + pair};")
                else:
                    lines.append(f"fma.rn.f16x2 {acc}, t, ${7 + pair}, {acc};")
                if pair % 4 == 3 and not acc16:
                    lines += _ptx_add_f32("acc", False)
    if acc16:
        lines += ["add.rn.f16x2 acc, acc, acc2;"] + _ptx_add_f32("acc", True)
    lines += ["mov.f32 $0, r;", "}"]
    return "\n".join(lines)


_WORDS6_ASM = tl.constexpr(_ptx_words6(GEMV_ACC16))
_WORDS6_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 22))


@triton.jit
def _gemv_class6_pipe(x32_ptr, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT,
                      offs_n, mask_n, BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """`_gemv_class4_pipe` for a 6-bit class without zero tensors (EXL2): a step's six words and 16 input pairs
    per asm call."""
    s_lo = first_step + (n_steps * pid_k) // SPLIT
    s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT
    acc = tl.zeros([BS, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        offs_s = s0 + tl.arange(0, BS)
        mask_s = offs_s < s_hi
        w_ptrs, m2 = step_rows(qw_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n, 6)
        w0, w1 = tl.load(w_ptrs, mask=m2, other=0), tl.load(w_ptrs + N, mask=m2, other=0)
        w2, w3 = tl.load(w_ptrs + 2 * N, mask=m2, other=0), tl.load(w_ptrs + 3 * N, mask=m2, other=0)
        h0, h1 = tl.load(w_ptrs + 4 * N, mask=m2, other=0), tl.load(w_ptrs + 5 * N, mask=m2, other=0)
        sc = step_scales(sc_ptr, sg_ptr, N, offs_s, mask_s, offs_n, m2)
        xw = tl.load(x32_ptr + offs_s[:, None] * 16 + tl.arange(0, 16)[None, :], mask=mask_s[:, None], other=0)
        d0, d1 = tl.split(tl.reshape(xw, [BS, 2, 2, 2, 2]))  # pair p = 8a + 4b + 2c + d
        c0d0, c1d0 = tl.split(d0)
        c0d1, c1d1 = tl.split(d1)
        x0, x4, x8, x12 = _by_word(c0d0)
        x1, x5, x9, x13 = _by_word(c0d1)
        x2, x6, x10, x14 = _by_word(c1d0)
        x3, x7, x11, x15 = _by_word(c1d1)
        part = tl.inline_asm_elementwise(
            _WORDS6_ASM, _WORDS6_CONSTRAINTS,
            [w0, w1, w2, w3, h0, h1, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
            dtype=tl.float32, is_pure=True, pack=1)
        acc += part * sc.to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT, offs_n,
                mask_n, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                FAST4: tl.constexpr, STAGES: tl.constexpr):
    """One width class's partial sums: the packed-fp16 decoder for EXL2 4-bit, the portable one otherwise (field
    widths as in `qweight.split_bits`). x32r is the permuted input row read as int32 pairs."""
    LB: tl.constexpr = 2 if BITS <= 3 else (8 if BITS == 8 else 4)
    if BITS == 4 and (FAST4 & 1) != 0 and not HAS_ZEROS:
        return _gemv_class4_pipe(x32r, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT,
                                 offs_n, mask_n, BS, BN, STAGES)
    elif BITS == 6 and (FAST4 & 2) != 0 and not HAS_ZEROS:
        return _gemv_class6_pipe(x32r, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT,
                                 offs_n, mask_n, BS, BN, STAGES)
    else:
        return _gemv_class(xr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT,
                           offs_n, mask_n, BITS, LB, BITS - LB, HAS_ZEROS, BS, BN, min(STAGES, 2))


@triton.jit
def _prefetch_class(qw_ptr, N, first_step, n_steps, first_word, pid_k, SPLIT, col0, BITS: tl.constexpr,
                    BN: tl.constexpr, ROWS: tl.constexpr):
    """L2 prefetch of the first ROWS word rows of this program's share of one width class (its BN columns)."""
    s_lo = first_step + (n_steps * pid_k) // SPLIT
    s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT
    w_lo = first_word + (s_lo - first_step) * BITS
    w_hi = first_word + (s_hi - first_step) * BITS
    rows = w_lo + tl.arange(0, ROWS)
    LINES: tl.constexpr = BN // 32 if BN >= 32 else 1
    cols = col0 + tl.arange(0, LINES) * 32  # one address per 128-byte line
    ok = (rows < w_hi)[:, None] & (cols < N)[None, :]
    off = tl.where(ok, rows[:, None].to(tl.int64) * N + cols[None, :], 0)
    prefetch_l2(qw_ptr + off)


@triton.jit
def _prefetch_widths(qw_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3,
                     fs2, ns2, fw2, pid_k, SPLIT, col0, MASK: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr):
    """`_prefetch_class` for each width class in MASK (classes of no steps prefetch nothing)."""
    if (MASK & 32) != 0:
        _prefetch_class(qw_ptr, N, fs8, ns8, fw8, pid_k, SPLIT, col0, 8, BN, ROWS)
    if (MASK & 16) != 0:
        _prefetch_class(qw_ptr, N, fs6, ns6, fw6, pid_k, SPLIT, col0, 6, BN, ROWS)
    if (MASK & 8) != 0:
        _prefetch_class(qw_ptr, N, fs5, ns5, fw5, pid_k, SPLIT, col0, 5, BN, ROWS)
    if (MASK & 4) != 0:
        _prefetch_class(qw_ptr, N, fs4, ns4, fw4, pid_k, SPLIT, col0, 4, BN, ROWS)
    if (MASK & 2) != 0:
        _prefetch_class(qw_ptr, N, fs3, ns3, fw3, pid_k, SPLIT, col0, 3, BN, ROWS)
    if (MASK & 1) != 0:
        _prefetch_class(qw_ptr, N, fs2, ns2, fw2, pid_k, SPLIT, col0, 2, BN, ROWS)


@triton.jit
def _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5,
                 fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2, pid_k, SPLIT, offs_n, mask_n,
                 MASK: tl.constexpr, SKIP_EMPTY: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BS: tl.constexpr, BN: tl.constexpr, FAST4: tl.constexpr, STAGES: tl.constexpr):
    """Sum of `_gemv_width` over the width classes in MASK (`width_mask`); with SKIP_EMPTY a class of 0 steps is
    also skipped at run time (kernels whose class table is runtime data)."""
    HAS8: tl.constexpr = (MASK & 32) != 0
    HAS6: tl.constexpr = (MASK & 16) != 0
    HAS5: tl.constexpr = (MASK & 8) != 0
    HAS4: tl.constexpr = (MASK & 4) != 0
    HAS3: tl.constexpr = (MASK & 2) != 0
    HAS2: tl.constexpr = (MASK & 1) != 0
    res = tl.zeros([BN], dtype=tl.float32)
    if HAS8 and (not SKIP_EMPTY or ns8 > 0):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, pid_k, SPLIT, offs_n, mask_n,
                           8, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS6 and (not SKIP_EMPTY or ns6 > 0):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs6, ns6, fw6, pid_k, SPLIT, offs_n, mask_n,
                           6, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS5 and (not SKIP_EMPTY or ns5 > 0):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs5, ns5, fw5, pid_k, SPLIT, offs_n, mask_n,
                           5, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS4 and (not SKIP_EMPTY or ns4 > 0):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs4, ns4, fw4, pid_k, SPLIT, offs_n, mask_n,
                           4, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS3 and (not SKIP_EMPTY or ns3 > 0):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs3, ns3, fw3, pid_k, SPLIT, offs_n, mask_n,
                           3, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS2 and (not SKIP_EMPTY or ns2 > 0):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs2, ns2, fw2, pid_k, SPLIT, offs_n, mask_n,
                           2, HAS_ZEROS, BS, BN, FAST4, STAGES)
    return res


@triton.jit
def _gemv_kernel(x_ptr, x32_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                 M, N, stride_xm, stride_om, SPLIT,
                 fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2,
                 HAS8: tl.constexpr, HAS6: tl.constexpr, HAS5: tl.constexpr, HAS4: tl.constexpr,
                 HAS3: tl.constexpr, HAS2: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT_ON: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                 RED: tl.constexpr, FAST4: tl.constexpr = False, STAGES: tl.constexpr = 2,
                 PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                 PART_ONLY: tl.constexpr = False):
    """One permuted input row per program (grid axis 2); rows beyond the first re-read the weights, mostly from
    L2. With PDL the first PREFETCH word rows of each class are requested before waiting for the input.
    PART_ONLY: split K, every program leaves its partial sum (`SplitSum`) and none adds them."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if PDL:
        if PREFETCH > 0:
            _prefetch_widths(qw_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3,
                             fs2, ns2, fw2, pid_k, SPLIT, pid_n * BN,
                             HAS8 * 32 + HAS6 * 16 + HAS5 * 8 + HAS4 * 4 + HAS3 * 2 + HAS2, BN, PREFETCH)
        pdl_sync()
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    xr = x_ptr + pid_m.to(tl.int64) * stride_xm
    x32r = x32_ptr + pid_m.to(tl.int64) * (stride_xm // 2)
    res = _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5,
                       fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2, pid_k, SPLIT, offs_n, mask_n,
                       HAS8 * 32 + HAS6 * 16 + HAS5 * 8 + HAS4 * 4 + HAS3 * 2 + HAS2, False, HAS_ZEROS, BS, BN,
                       FAST4, STAGES)
    offs_m = pid_m + tl.arange(0, 1)
    _store_out(res[None, :], offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, cnt_ptr, bias_ptr,
               pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT, HAS_BIAS, SPLIT_ON, RED, PART_ONLY)


@triton.jit
def _group_member(x_ptr, x32_ptr, stride_xm, meta, part_ptr, cnt_ptr, M, pid, pid_m, out_ptr, bias_ptr, qw_ptr,
                  sc_ptr, zr_ptr, sg_ptr, MASK: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BS: tl.constexpr, BN: tl.constexpr, RED: tl.constexpr, FAST4: tl.constexpr,
                  STAGES: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """One program of `_gemv_group_kernel` for the matrix whose metadata row is `meta` (see `GemvGroup`): the
    classes of the widths in MASK are runtime branches, so one compiled kernel serves every mix of them. The
    metadata and the weights are not written by the previous kernel, so they are read (and, PREFETCH rows of
    each class, prefetched) before waiting for it."""
    N = tl.multiple_of(tl.load(meta + 18), 16)  # GemvGroup only takes N % 16 == 0: keeps loads vectorized
    tiles = tl.load(meta + 19)
    split = tl.load(meta + 20)
    local = pid - tl.load(meta + 21)
    pid_n = local % tiles
    pid_k = local // tiles
    if PDL:
        if PREFETCH > 0:
            _prefetch_widths(qw_ptr, N, tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3),
                             tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6), tl.load(meta + 7),
                             tl.load(meta + 8), tl.load(meta + 9), tl.load(meta + 10), tl.load(meta + 11),
                             tl.load(meta + 12), tl.load(meta + 13), tl.load(meta + 14), tl.load(meta + 15),
                             tl.load(meta + 16), tl.load(meta + 17), pid_k, split, pid_n * BN, MASK, BN, PREFETCH)
        pdl_sync()
    xoff = tl.multiple_of(tl.load(meta + 23), 32)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    xr = x_ptr + pid_m.to(tl.int64) * stride_xm + xoff
    x32r = x32_ptr + pid_m.to(tl.int64) * (stride_xm // 2) + xoff // 2
    res = _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, tl.load(meta + 0), tl.load(meta + 1),
                       tl.load(meta + 2), tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6),
                       tl.load(meta + 7), tl.load(meta + 8), tl.load(meta + 9), tl.load(meta + 10),
                       tl.load(meta + 11), tl.load(meta + 12), tl.load(meta + 13), tl.load(meta + 14),
                       tl.load(meta + 15), tl.load(meta + 16), tl.load(meta + 17), pid_k, split, offs_n, mask_n,
                       MASK, True, HAS_ZEROS, BS, BN, FAST4, STAGES)
    offs_m = pid_m + tl.arange(0, 1)
    tile = tl.load(meta + 22) + pid_m * tiles + pid_n
    part = part_ptr + tl.multiple_of(tl.load(meta + 24), 16).to(tl.int64)
    if split > 1:
        _store_out(res[None, :], offs_m, offs_n, M, N, out_ptr, N, part, cnt_ptr, bias_ptr, tile, pid_k, split,
                   HAS_BIAS, True, RED)
    else:
        _store_out(res[None, :], offs_m, offs_n, M, N, out_ptr, N, part, cnt_ptr, bias_ptr, tile, pid_k, split,
                   HAS_BIAS, False, RED)


@triton.jit
def _gemv_group_kernel(x_ptr, x32_ptr, stride_xm, meta_ptr, part_ptr, cnt_ptr, M,
                       out0, bias0, qw0, sc0, zr0, sg0, out1, bias1, qw1, sc1, zr1, sg1,
                       out2, bias2, qw2, sc2, zr2, sg2, G: tl.constexpr, MASK: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                       RED: tl.constexpr, FAST4: tl.constexpr, STAGES: tl.constexpr = 2,
                       PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    """The gemv of up to three weights that read the same input (q/k/v, gate/up) in one launch: grid axis 0 runs
    over every (matrix, column tile, K split) program, axis 2 over the input rows."""
    pid = tl.program_id(0)
    pid_m = tl.program_id(2)
    if G > 2 and pid >= tl.load(meta_ptr + 2 * 25 + 21):
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr + 2 * 25, part_ptr, cnt_ptr, M, pid, pid_m, out2, bias2,
                      qw2, sc2, zr2, sg2, MASK, HAS_ZEROS, B2, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)
    elif G > 1 and pid >= tl.load(meta_ptr + 25 + 21):
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr + 25, part_ptr, cnt_ptr, M, pid, pid_m, out1, bias1,
                      qw1, sc1, zr1, sg1, MASK, HAS_ZEROS, B1, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)
    else:
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr, part_ptr, cnt_ptr, M, pid, pid_m, out0, bias0,
                      qw0, sc0, zr0, sg0, MASK, HAS_ZEROS, B0, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)


@triton.jit
def _decode_tile(qw_ptr, sc_ptr, zr_ptr, sg_ptr, offs_s, mask_s, first_step, first_word, offs_n, mask_n, N,
                 BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BS: tl.constexpr, BN: tl.constexpr):
    """fp16 [BS, 32, BN] tile of dequantized stored rows, bit-exact with the reference dequantizer."""
    PER: tl.constexpr = 32 // LB
    m2 = mask_s[:, None] & mask_n[None, :]
    m3 = mask_s[:, None, None] & mask_n[None, None, :]
    wrow = first_word + (offs_s - first_step) * BITS
    lo_rows = wrow[:, None] + tl.arange(0, LB)[None, :]
    w = tl.load(qw_ptr + lo_rows[:, :, None].to(tl.int64) * N + offs_n[None, None, :], mask=m3, other=0)
    sh = tl.arange(0, PER) * LB
    code = (w[:, :, None, :] >> sh[None, None, :, None]) & ((1 << LB) - 1)
    code = tl.reshape(code, [BS, 32, BN])
    if HB == 1:
        h = tl.load(qw_ptr + (wrow + LB)[:, None].to(tl.int64) * N + offs_n[None, :], mask=m2, other=0)
        code = code | (((h[:, None, :] >> tl.arange(0, 32)[None, :, None]) & 1) << LB)
    if HB == 2:
        hi_rows = wrow[:, None] + LB + tl.arange(0, 2)[None, :]
        h = tl.load(qw_ptr + hi_rows[:, :, None].to(tl.int64) * N + offs_n[None, None, :], mask=m3, other=0)
        hc = (h[:, :, None, :] >> (2 * tl.arange(0, 16))[None, None, :, None]) & 3
        code = code | (tl.reshape(hc, [BS, 32, BN]) << LB)
    # 0x6400 | code is the fp16 number 1024 + code: exact integer, no int->float conversion needed.
    cf = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    grp = tl.load(sg_ptr + offs_s, mask=mask_s, other=0)
    g_off = grp[:, None].to(tl.int64) * N + offs_n[None, :]
    sc = tl.load(sc_ptr + g_off, mask=m2, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zr_ptr + g_off, mask=m2, other=0.0) + 1024.0
        deq = (cf - z[:, None, :]) * sc[:, None, :]
    else:
        deq = (cf - (1024.0 + (1 << (BITS - 1)))) * sc[:, None, :]
    return deq


# The 4-bit EXL2 decoder of the tensor-core path: one word and its scale in, the word's 8 dequantized weights
# out (row-in-word order), 4 packed operations per pair of codes instead of ~6 scalar ones per code. Codes (u,
# u+4) come out as in `_WORDS4_ASM`; (code - 8) is exact in fp16, so the one rounding (the scale product) is
# the reference dequantizer's.
_DEQ4_ASM = tl.constexpr("""
{
.reg .b32 q0, q1, q2, q3, s, z, c, d, sc;""" + _PTX_UNPACK4_CONSTANTS + """
mov.b32 sc, {$9, $9};""" + _ptx_unpack4("$8") + """
mul.rn.f16x2 q0, q0, sc;
mul.rn.f16x2 q1, q1, sc;
mul.rn.f16x2 q2, q2, sc;
mul.rn.f16x2 q3, q3, sc;
mov.b32 {$0, $4}, q0;
mov.b32 {$1, $5}, q1;
mov.b32 {$2, $6}, q2;
mov.b32 {$3, $7}, q3;
}
""")


@triton.jit
def _dot_u(acc, deq, xt, u: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, K: tl.constexpr,
           BN: tl.constexpr):
    """acc + (the input columns of row-in-word u) · (the decoded [.., BN] rows of row-in-word u)."""
    pp = tl.arange(0, PER)
    if BITS == 4:
        sel = pp == (u % 4) * 2 + u // 4
    else:
        sel = pp == u
    xu = tl.sum(tl.where(sel[None, None, :], xt, 0.0), axis=2)
    return tl.dot(xu, tl.reshape(deq, [K, BN]), acc)


@triton.jit
def _dot_x(x_ptr, stride_xm, offs_m, mask_m, s0, s_hi, LB: tl.constexpr, PER: tl.constexpr, BSC: tl.constexpr,
           BITS: tl.constexpr = 0):
    """Input tile [BM, BSC·LB, PER] of BSC steps from s0, indexed (step·LB + low word, row-in-word): one contiguous
    run of PER positions per word, except for 6-bit classes (`PAIR_ORDER6`), whose word j, row u sits at position
    16·(j % 2) + 2u + j // 2."""
    offs = s0 * 32 + tl.arange(0, BSC * 32)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs[None, :]
    t = tl.load(ptrs, mask=mask_m[:, None] & (offs < s_hi * 32)[None, :], other=0.0).to(tl.float16)
    BM: tl.constexpr = offs_m.shape[0]
    if BITS == 6:
        t = tl.permute(tl.reshape(t, [BM, BSC, 2, PER, 2]), (0, 1, 4, 2, 3))  # (m, s, j // 2, j % 2, u)
    return tl.reshape(t, [BM, BSC * LB, PER])


@triton.jit
def _deq_row(w, h, row0, zero, sc, u: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr):
    """Row-in-word u of low words w, dequantized; its HB high bits sit in h at bit HB·((row0 + u) % (32 / HB)),
    row0 the word's first row (broadcast against w; 0 where h is already shifted to it). 0x6400 | code is the
    fp16 number 1024 + code, exact, so the one rounding (the scale product) is the reference dequantizer's;
    `zero` is 1024 + the zero point."""
    HPER: tl.constexpr = 32 // HB if HB > 0 else 32
    code = (w >> (u * LB)) & ((1 << LB) - 1)
    if HB > 0:
        code = code | (((h >> (HB * ((row0 + u) % HPER))) & ((1 << HB) - 1)) << LB)
    cf = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return (cf - zero) * sc


@triton.jit
def _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps,
               first_word, pid_k, offs_m, offs_n, mask_n, SPLIT, BITS: tl.constexpr,
               LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
               BN: tl.constexpr, FAST4: tl.constexpr = False):
    """acc + x·W over this program's share of one width class's steps.

    The codes are decoded one row-in-word u at a time: the rows (s, j, u) of all steps s and low words j form a
    [BS·LB, BN] tile in the words' own register layout (no reshuffling of the decoded tile), which feeds one
    tensor-core dot against the matching input columns. Those are picked out of the input tile, loaded once per
    iteration (and one iteration ahead) with one-hot sums over its last axis. EXL2 4-bit words (FAST4) are
    decoded by `_DEQ4_ASM`, all eight rows at once."""
    PER: tl.constexpr = 32 // LB
    BSC: tl.constexpr = BS if BS * LB >= 16 else 16 // LB
    s_lo = first_step + (n_steps * pid_k) // SPLIT
    s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT
    mask_m = offs_m < M
    jj = tl.arange(0, LB)
    row0 = (jj * PER)[None, :, None]
    zero: tl.constexpr = 1024.0 + (1 << (BITS - 1))
    xt_n = _dot_x(x_ptr, stride_xm, offs_m, mask_m, s_lo, s_hi, LB, PER, BSC, BITS)
    for s0 in range(s_lo, s_hi, BSC):
        xt = xt_n
        xt_n = _dot_x(x_ptr, stride_xm, offs_m, mask_m, s0 + BSC, s_hi, LB, PER, BSC, BITS)
        w, h, sc, z = _load_class(qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, s0, s_hi, first_step, first_word, jj, offs_n,
                                  mask_n, BITS, LB, HB, HAS_ZEROS, BSC)
        if BITS == 4 and (FAST4 & 1) != 0 and not HAS_ZEROS:
            d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
                _DEQ4_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, sc.to(tl.float16)], dtype=(tl.float16,) * 8,
                is_pure=True, pack=1)
            acc = _dot_u(acc, d0, xt, 0, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d1, xt, 1, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d2, xt, 2, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d3, xt, 3, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d4, xt, 4, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d5, xt, 5, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d6, xt, 6, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d7, xt, 7, BITS, PER, BSC * LB, BN)
        else:
            for u in tl.static_range(PER):
                deq = _deq_row(w, h, row0, zero if not HAS_ZEROS else z + 1024.0, sc, u, LB, HB)
                acc = _dot_u(acc, deq, xt, u, BITS, PER, BSC * LB, BN)
    return acc


@triton.jit
def _dot_kernel(x_ptr, x32_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                M, N, stride_xm, stride_om, SPLIT,
                fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2,
                HAS8: tl.constexpr, HAS6: tl.constexpr, HAS5: tl.constexpr, HAS4: tl.constexpr,
                HAS3: tl.constexpr, HAS2: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                SPLIT_ON: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                RED: tl.constexpr, FAST4: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:
        pdl_sync()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if HAS8:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 8, 8, 0, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS6:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs6, ns6, fw6,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 6, 4, 2, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS5:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs5, ns5, fw5,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 5, 4, 1, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS4:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs4, ns4, fw4,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 4, 4, 0, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS3:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs3, ns3, fw3,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 3, 2, 1, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS2:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs2, ns2, fw2,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 2, 2, 0, HAS_ZEROS, BM, BS, BN, FAST4)
    _store_out(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, cnt_ptr, bias_ptr,
               pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT, HAS_BIAS, SPLIT_ON, RED)


@triton.jit
def _dequant_tile(pid_n, out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, ri_ptr, N, stride_o, first_step, n_steps,
                  first_word, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  BS: tl.constexpr, BN: tl.constexpr):
    """BS steps (program_id(0)) × BN columns (tile pid_n) of one class, stored at their natural rows of out."""
    offs_s = first_step + tl.program_id(0) * BS + tl.arange(0, BS)
    mask_s = offs_s < first_step + n_steps
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    deq = _decode_tile(qw_ptr, sc_ptr, zr_ptr, sg_ptr, offs_s, mask_s, first_step, first_word, offs_n, mask_n, N,
                       BITS, LB, HB, HAS_ZEROS, BS, BN)
    ridx = tl.load(ri_ptr + offs_s[:, None] * 32 + tl.arange(0, 32)[None, :], mask=mask_s[:, None], other=-1)
    ptrs = out_ptr + ridx[:, :, None].to(tl.int64) * stride_o + offs_n[None, None, :]
    tl.store(ptrs, deq, mask=(ridx[:, :, None] >= 0) & mask_n[None, None, :])


@triton.jit
def _dequant_kernel(out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, ri_ptr, N, stride_o, first_step, n_steps, first_word,
                    BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BS: tl.constexpr, BN: tl.constexpr):
    _dequant_tile(tl.program_id(1), out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, ri_ptr, N, stride_o, first_step,
                  n_steps, first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)


@triton.jit
def _dequant_group_kernel(out_ptr, stride_o, first_step, n_steps, first_word,
                          qw0, sc0, zr0, sg0, ri0, N0, qw1, sc1, zr1, sg1, ri1, N1, qw2, sc2, zr2, sg2, ri2, N2,
                          T0, T1, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          BS: tl.constexpr, BN: tl.constexpr):
    """`_dequant_kernel` for one class of 2-3 weights with the same class layout, side by side in out (columns
    [0, N0), [N0, N0 + N1), then the third): column tiles [0, T0) are weight 0's, [T0, T0 + T1) weight 1's."""
    pid = tl.program_id(1)
    if pid < T0:
        _dequant_tile(pid, out_ptr, qw0, sc0, zr0, sg0, ri0, N0, stride_o, first_step, n_steps, first_word,
                      BITS, LB, HB, HAS_ZEROS, BS, BN)
    elif pid < T0 + T1:
        _dequant_tile(pid - T0, out_ptr + N0, qw1, sc1, zr1, sg1, ri1, N1, stride_o, first_step, n_steps,
                      first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)
    else:
        _dequant_tile(pid - T0 - T1, out_ptr + N0 + N1, qw2, sc2, zr2, sg2, ri2, N2, stride_o, first_step, n_steps,
                      first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)


# --------------------------------------------------------------------------------------------------- launch
@dataclass(frozen=True)
class MatmulConfig:
    """Launch parameters of the gemv/dot kernels."""

    bm: int = 1
    bs: int = 8
    bn: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 2


def _class_args(w: QuantWeight) -> tuple[list[int], dict[str, bool]]:
    """(first step, steps, first word) per width and the kernels' HAS flags. A matrix of one width gets a kernel
    for that width alone; every mixed matrix shares the one kernel with all widths (an absent width has 0 steps,
    so its loop is empty): real EXL2 models mix widths in many combinations, and compiling a kernel per
    combination took minutes on first use."""
    cached = w._cache.get("class_args")
    if cached is None:
        args, flags = [], {}
        mixed = len(w.classes) > 1
        for bits in WIDTHS:
            c = w.class_of(bits)
            args += [c.first_step, c.n_steps, c.first_word] if c else [0, 0, 0]
            flags[f"HAS{bits}"] = mixed or c is not None
        cached = w._cache["class_args"] = (args, flags)
    return cached


def width_mask(ws: Sequence[QuantWeight]) -> int:
    """The widths present in any of `ws` as a bit mask (8-bit = 32 … 2-bit = 1): kernels with runtime class tables
    compile the decoders of these widths only."""
    return sum(1 << (len(WIDTHS) - 1 - i) for i, b in enumerate(WIDTHS) if any(w.class_of(b) for w in ws))


def input_layout(ws: Sequence[QuantWeight]) -> tuple[list[torch.Tensor], list[int], int]:
    """Layout of the shared permuted-input buffer of weights that read one input: (the distinct `x_index`
    tensors in first-appearance order, each weight's column offset, the buffer width). Weights whose x_index is
    the same tensor object (aliased at load by `share_input_orders`) read one copy. Identity only: no device
    sync, so it is free and CUDA-graph safe."""
    unique: list[torch.Tensor] = []
    offsets: list[int] = []
    seen: dict[int, int] = {}
    total = 0
    for w in ws:
        off = seen.get(id(w.x_index))
        if off is None:
            off = seen[id(w.x_index)] = total
            unique.append(w.x_index)
            total += w.x_index.numel()
        offsets.append(off)
    return unique, offsets, total


def buffer_offsets(buf: torch.Tensor, ws: Sequence[QuantWeight]) -> list[int]:
    """Each weight's column offset in `buf`, a permuted-input buffer laid out by `input_layout`; a buffer of
    another width stops with one sentence."""
    _, offsets, total = input_layout(ws)
    if buf.shape[-1] != total:
        raise ValueError(f"the permuted-input buffer is {buf.shape[-1]} wide, the weights' layout {total}.")
    return offsets


def share_input_orders(ws: Sequence[QuantWeight]) -> int:
    """Point the `x_index` of each weight that equals (`torch.equal`) an earlier one's at that tensor, so the
    producers and consumers of their shared input (`input_layout`) write and read one permuted copy instead of
    one per weight. For weights reading one input (q/k/v, gate/up), once at load: the comparison syncs the
    device. Drops the cached launch plans that hold offsets into the buffer. Returns how many were aliased."""
    aliased = 0
    for i, w in enumerate(ws):
        for first in ws[:i]:
            if first.x_index is w.x_index:
                break
            a, b = first.x_index, w.x_index
            if a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b):
                w.x_index = a
                aliased += 1
                break
    if aliased:
        for w in ws:
            for key in [k for k in w._cache if isinstance(k, tuple) and k[0] == "group"]:
                del w._cache[key]
    return aliased


def gather_input(x: torch.Tensor, ws: Sequence[QuantWeight], whole: bool = False):
    """Each weight's permuted input (`QuantWeight.x_index` order) for x `[M, K]`, from one launch for up to four
    distinct input orders of weights that share x (q/k/v, gate/up): the small-batch kernels then read plain
    contiguous rows. Weights with one x_index tensor share one copy (`input_layout`). `whole=True` returns the
    one `[M, total]` buffer instead of the per-weight views."""
    if not ws:
        return []
    unique, _, total = input_layout(ws)
    if not use_triton(x):
        parts = {id(idx): take_columns(x, idx).contiguous() for idx in unique}
        return torch.cat(list(parts.values()), dim=1) if whole else [parts[id(w.x_index)] for w in ws]
    if len(unique) > 4:
        if whole:
            raise ValueError("one gather buffer holds at most four distinct input orders.")
        return gather_input(x, ws[:4]) + gather_input(x, ws[4:])
    sizes = [idx.numel() for idx in unique]
    offs = [sum(sizes[:i]) for i in range(len(unique))]
    m = x.shape[0]
    out = torch.empty((m, total), dtype=x.dtype, device=x.device)
    if m:
        args = []
        for i in range(4):
            j = min(i, len(unique) - 1)
            args += [unique[j], offs[j], sizes[j]]
        block = 1024
        _gather_kernel[(triton.cdiv(max(sizes), block), m, len(unique))](
            x, x.stride(0), out, out.stride(0), *args, BLOCK=block, num_warps=4, **pdl_args(x.device, m))
    return out if whole else split_permuted(out, ws)


def split_permuted(buf: torch.Tensor, ws: Sequence[QuantWeight]) -> list[torch.Tensor]:
    """Each weight's view of a `[M, total]` buffer of permuted inputs laid out by `input_layout` (from
    `gather_input(whole=True)` or a kernel that writes them, such as `rms_norm_gather`)."""
    return [buf[:, o:o + w.x_index.numel()] for w, o in zip(ws, buffer_offsets(buf, ws))]


def _pairs_view(xp: torch.Tensor, fast4: bool | int | None) -> tuple[int, torch.Tensor]:
    """Which packed decoders run on xp, as the kernels' FAST4 mask (1: 4-bit, 2: 6-bit; True: both, None: those
    whose self-check passed; they need fp16 input with an even row stride), and the int32 view of xp they read."""
    if fast4 is None:
        fast4 = fast4_available(xp.device)
    mask = (3 if fast4 is True else int(fast4 or 0)) if xp.dtype == torch.float16 and xp.stride(0) % 2 == 0 else 0
    return mask, (xp.view(torch.int32) if mask else xp)


def _launch(kernel, xp: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, part_only: bool = False,
            **extra) -> torch.Tensor | SplitSum:
    """Run a gemv/dot kernel on the permuted input xp `[M, S·32]` (last dim contiguous). `part_only` (the gemv,
    no bias): where K is split, return the partial sums as a `SplitSum` instead of adding them."""
    m = xp.shape[0]
    grid_n, grid_m = triton.cdiv(w.n, cfg.bn), triton.cdiv(m, cfg.bm if kernel is _dot_kernel else 1)
    split = cfg.split if grid_n * grid_m <= COUNTER_POOL else 1
    part_only = part_only and kernel is _gemv_kernel and split > 1 and w.bias is None and m > 0
    if part_only:
        extra["PART_ONLY"] = True
        part = out = torch.empty((split, m, w.n), dtype=torch.float32, device=xp.device)
    else:
        out = torch.empty((m, w.n), dtype=xp.dtype, device=xp.device)
        if m == 0:
            return out
        part = torch.empty((split, m, w.n), dtype=torch.float32, device=xp.device) if split > 1 else out
    cls, flags = _class_args(w)
    zeros = w.zeros if w.zeros is not None else w.scales
    bias = w.bias if w.bias is not None else w.scales
    fast4, x32 = _pairs_view(xp, extra.pop("FAST4", False))
    kernel[(grid_n, split, grid_m)](
        xp, x32, out, part, counters(xp.device), bias, w.qweight, w.scales, zeros, w.step_group,
        m, w.n, xp.stride(0), out.stride(0), split, *cls, **flags, HAS_ZEROS=w.zeros is not None,
        HAS_BIAS=w.bias is not None, SPLIT_ON=split > 1, BM=cfg.bm, BS=cfg.bs, BN=cfg.bn, FAST4=fast4,
        RED=min(next_pow2(split), max(1, 8192 // (cfg.bm * cfg.bn))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        **pdl_args(xp.device, m, prefetch=PREFETCH_ROWS if kernel is _gemv_kernel else None))
    return SplitSum(part, (m,)) if part_only else out


def _permuted(x: torch.Tensor, w: QuantWeight, xp: torch.Tensor | None) -> torch.Tensor:
    if xp is None:
        return gather_input(x, [w])[0]
    if xp.shape != (x.shape[0], w.x_index.numel()) or xp.stride(-1) != 1:
        raise ValueError("the permuted input does not match this weight (use gather_input).")
    return xp


def gemv(x: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, fast4: bool | None = None,
         xp: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA-core path (small M); x `[M, K]` with a contiguous last dim (or its permuted form `xp` from
    `gather_input`). `fast4` selects the packed-fp16 4-bit decoder (inline PTX; None: use it where the one-time
    self-check passed)."""
    return _launch(_gemv_kernel, _permuted(x, w, xp), w, cfg, FAST4=fast4, STAGES=cfg.num_stages)


class GemvGroup:
    """Launch plan of `_gemv_group_kernel` for 2–3 weights sharing an input: per matrix a 25-int metadata row —
    (first step, steps, first word) of the 8/6/5/4/3/2-bit classes, N, column tiles, K split, first program,
    first counter tile, offset of its permuted input, offset of its split-K partials (per input row count M)."""

    MAX = 3

    def __init__(self, ws: Sequence[QuantWeight], bn: int = 64, bs: int = 8, stages: int | None = None,
                 per_sm: int | None = None, num_warps: int = 4):
        """Defaults from the H200 sweeps (benchmarks/RESULTS.md, session 4 run 13 and session 11): 64-column tiles
        (q/k/v 12.4 → 10.2 µs, gate/up 24.4 → 21.5 µs against 128 columns), K split up to `GROUP_PER_SM`
        programs per SM."""
        if not self.accepts(ws):
            raise ValueError("a gemv group needs 2-3 weights with the same input size and zero-point kind and "
                             "outputs a multiple of 16 wide.")
        self.ws = list(ws)
        self.BN, self.BS, self.num_warps = bn, bs, num_warps
        self.stages = GEMV_STAGES if stages is None else stages
        self.per_sm = GROUP_PER_SM if per_sm is None else per_sm
        self.mask = width_mask(self.ws)
        self._plans: dict[int, tuple] = {}

    @classmethod
    def accepts(cls, ws: Sequence[QuantWeight]) -> bool:
        return (1 < len(ws) <= cls.MAX and len({w.k for w in ws}) == 1 and len({w.zeros is None for w in ws}) == 1
                and all(w.n % 16 == 0 for w in ws))

    def plan(self, m: int, device: torch.device) -> tuple[torch.Tensor, int, int, int]:
        """(metadata, programs, partial floats, RED) for m input rows, cached per m."""
        cached = self._plans.get(m)
        if cached is not None:
            return cached
        tiles = [triton.cdiv(w.n, self.BN) for w in self.ws]
        total = sum(tiles) * m
        rows, start, tile_base, part = [], 0, 0, 0
        max_split = 1
        for w, t, xoff in zip(self.ws, tiles, input_layout(self.ws)[1]):
            split = _auto_split(w, total, w.device, 8, self.per_sm)
            cls, _ = _class_args(w)
            rows.append(cls + [w.n, t, split, start, tile_base, xoff, part])
            start += t * split
            tile_base += t * m
            part += split * m * w.n if split > 1 else 0
            max_split = max(max_split, split)
        meta = torch.tensor(rows, dtype=torch.int32, device=device).contiguous()
        red = min(next_pow2(max_split), max(1, 8192 // self.BN))
        self._plans[m] = (meta, start, part, red)
        return self._plans[m]

    def __call__(self, xp: torch.Tensor, fast4: bool | None = None) -> list[torch.Tensor]:
        """Outputs `[M, N_i]` for the permuted inputs `xp` `[M, total]` laid out by `input_layout` (the buffer
        `gather_input` returns its views of)."""
        buffer_offsets(xp, self.ws)
        m = xp.shape[0]
        outs = [torch.empty((m, w.n), dtype=xp.dtype, device=xp.device) for w in self.ws]
        if m == 0:
            return outs
        meta, programs, part_n, red = self.plan(m, xp.device)
        fast4, x32 = _pairs_view(xp, fast4)
        part = torch.empty(max(1, part_n), dtype=torch.float32, device=xp.device)
        args = []
        for i in range(self.MAX):
            w = self.ws[min(i, len(self.ws) - 1)]
            out = outs[min(i, len(self.ws) - 1)]
            args += [out, w.bias if w.bias is not None else w.scales, w.qweight, w.scales,
                     w.zeros if w.zeros is not None else w.scales, w.step_group]
        has_bias = [w.bias is not None for w in self.ws] + [False] * (self.MAX - len(self.ws))
        _gemv_group_kernel[(programs, 1, m)](
            xp, x32, xp.stride(0), meta, part, counters(xp.device), m, *args,
            G=len(self.ws), MASK=self.mask, HAS_ZEROS=self.ws[0].zeros is not None, B0=has_bias[0],
            B1=has_bias[1], B2=has_bias[2], BS=self.BS, BN=self.BN, RED=red, FAST4=fast4,
            STAGES=self.stages, num_warps=self.num_warps, num_stages=self.stages,
            **pdl_args(xp.device, m, prefetch=PREFETCH_ROWS))
        return outs


def grouped_matmul(x: torch.Tensor, ws: Sequence[QuantWeight], xp: torch.Tensor | None = None
                   ) -> list[torch.Tensor] | None:
    """`[x · W_i + bias_i]` for 2–3 weights sharing x `[M, K]` in one gather and one gemv launch (small M on the
    GPU), or None where that path does not apply (the caller then runs them one by one). `xp`: the permuted
    inputs already gathered into one buffer."""
    if not (FUSE_SHARED_INPUT and use_triton(x) and 0 < x.shape[0] <= DOT_MAX_M):
        return None
    if x.shape[0] > GEMV_MAX_M or all(gemv_via_mma(w, x.shape[0], x.dtype) for w in ws):
        return _mma_group(x, ws, xp)
    if not GemvGroup.accepts(ws):
        return None
    group = ws[0]._cache.get(("group", tuple(map(id, ws))))
    if group is None:
        group = ws[0]._cache[("group", tuple(map(id, ws)))] = GemvGroup(ws)
    return group(gather_input(x, ws, whole=True) if xp is None else xp)


def _mma_group(x: torch.Tensor, ws: Sequence[QuantWeight], xp: torch.Tensor | None) -> list[torch.Tensor] | None:
    """`grouped_matmul` for 5-16 rows: one launch of the Gluon kernel where it takes every weight, else None. The
    K split is the one a single matrix as wide as all of them would get."""
    m = x.shape[0]
    if not (MMA4 and 1 < len(ws) <= 3 and x.dtype == torch.float16 and all(mma_dot.supports(w, m) for w in ws)
            and len({w.zeros is None for w in ws}) == 1 and len({w.bias is None for w in ws}) == 1):
        return None
    buf = gather_input(x, ws, whole=True) if xp is None else xp
    offsets = buffer_offsets(buf, ws)
    tiles = sum(triton.cdiv(w.n, 32 * MMA4_V) for w in ws)
    split = min(_auto_split(w, tiles, w.device, 4 * MMA4_BS, MMA4_PER_SM) for w in ws)
    return mma_dot.mma_group(buf, ws, offsets, MMA4_BS, MMA4_V, [split] * len(ws), MMA4_STAGES)


_FAST4: dict[torch.device, int] = {}


def _packed_check(device: torch.device, bits: int, flag: int) -> bool:
    """Whether the packed decoder of `bits`-bit classes compiles and agrees with the twin on a small random layer."""
    from exl2.kernels.qweight import build

    g = torch.Generator(device=device).manual_seed(bits)
    k, n = 512, 256
    codes = torch.randint(0, 1 << bits, (k, n), device=device, dtype=torch.uint8, generator=g)
    scales = (torch.rand(k // 128, n, device=device, generator=g) * 0.01 + 0.001).half()
    perm = torch.randperm(k, device=device, generator=g)
    w = build(codes, [(bits, 128)] * (k // 128), scales, None, perm)
    x = torch.randn(1, k, device=device, dtype=torch.float16, generator=g)
    ref = matmul_torch(x, w).float()
    got = _launch(_gemv_kernel, gather_input(x, [w])[0], w, MatmulConfig(bs=4, bn=128, split=2),
                  FAST4=flag, STAGES=2).float()
    return bool(torch.allclose(got, ref, atol=2e-3 * ref.abs().max().item() + 1e-4, rtol=0))


def fast4_available(device: torch.device) -> int:
    """The packed decoders (inline PTX) that compile and agree with the twin on this device, as the kernels'
    FAST4 mask (1: 4-bit, 2: 6-bit; checked once each, on a small random layer); the others use the portable
    decoder."""
    if device.type != "cuda" or triton.__class__.__name__ == "_Stub":
        return 0
    ok = _FAST4.get(device)
    if ok is None:
        _FAST4[device] = 0  # in case the check itself recurses or fails
        ok = 0
        for bits, flag in ((4, 1), (6, 2)):
            try:
                ok |= flag if _packed_check(device, bits, flag) else 0
            except Exception:  # noqa: BLE001 - any compile/launch failure means "use the portable path"
                pass
        _FAST4[device] = ok
    return ok


def dot(x: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, xp: torch.Tensor | None = None,
        fast4: bool | None = None) -> torch.Tensor:
    """Tensor-core path with in-register dequantization; cfg.bm ≥ 16 and cfg.bs ≥ 1. `fast4` as in `gemv`."""
    return _launch(_dot_kernel, _permuted(x, w, xp), w, cfg, FAST4=fast4)


def _dot_or_mma(xp: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, split_sum: bool = False
                ) -> torch.Tensor | SplitSum:
    """The dot path on a permuted input: the Gluon kernel (`mma_dot`) for up to 16 rows where it runs (EXL2 of any
    widths, 4-bit GPTQ), the Triton tensor-core kernel otherwise. `split_sum`: see `permuted_matmul`."""
    if MMA4 and xp.dtype == torch.float16 and mma_dot.supports(w, xp.shape[0]):
        grid = triton.cdiv(w.n, 32 * MMA4_V)
        split = _auto_split(w, grid, w.device, 4 * MMA4_BS, MMA4_PER_SM)
        return mma_dot.mma(xp, w, MMA4_BS, MMA4_V, split, MMA4_STAGES, part_only=split_sum)
    return _launch(_dot_kernel, xp, w, cfg, FAST4=None)


def gemv_via_mma(w: QuantWeight, m: int, dtype: torch.dtype) -> bool:
    """Whether m ≤ 4 rows take the Gluon tensor-core kernel instead of the gemv: for matrices with a class the
    gemv decodes with its portable loop (8, 5, 3, 2 bits; MMA_GEMV = 1), or always (2). The tensor-core kernel's
    cost hardly depends on the row count, and the portable loop ran a 5/4/3-bit body at a fifth of the 4-bit
    speed (benchmarks/RESULTS.md, session 8)."""
    if not (MMA4 and MMA_GEMV and dtype == torch.float16 and mma_dot.supports(w, m)):
        return False
    return MMA_GEMV == 2 or any(c.bits not in (4, 6) for c in w.classes)


def dequantize_triton(w: QuantWeight, bs: int = 4, bn: int = 128, out: torch.Tensor | None = None,
                      num_warps: int = 4) -> torch.Tensor:
    """fp16 `[K, N]` natural-order weight, bit-identical to `qweight.dequantize_torch`; into `out` (a `[K, N]`
    view with unit column stride, e.g. a column slice of a wider matrix) when given."""
    if out is None:
        # Every row is written when the stored rows are a permutation of the input features; clearing the buffer
        # first cost 4.3 ms of a 2,047-token prefill on the H200 (nearly as much as the dequantization itself).
        alloc = torch.empty if w.scatter_index() is not None else torch.zeros
        out = alloc((w.k, w.n), dtype=torch.float16, device=w.device)
    zeros = w.zeros if w.zeros is not None else w.scales
    for c in w.classes:
        lb, hb = split_bits(c.bits)
        grid = (triton.cdiv(c.n_steps, bs), triton.cdiv(w.n, bn))
        _dequant_kernel[grid](out, w.qweight, w.scales, zeros, w.step_group, w.row_index, w.n, out.stride(0),
                              c.first_step, c.n_steps, c.first_word, BITS=c.bits, LB=lb, HB=hb,
                              HAS_ZEROS=w.zeros is not None, BS=bs, BN=bn, num_warps=num_warps)
    return out


def _dequant_group(out: torch.Tensor, ws: Sequence[QuantWeight], bs: int = 4, bn: int = 128,
                   num_warps: int = 4) -> None:
    """`dequantize_triton` of 2-3 weights with the same class layout into `out` `[K, ΣN]` side by side, one
    launch per class (a prefill issues fewer launches: its host work was as long as the GPU's)."""
    members = list(ws) + [ws[-1]] * (3 - len(ws))
    args = []
    for w in members:
        args += [w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, w.step_group, w.row_index, w.n]
    tiles = [triton.cdiv(w.n, bn) for w in ws]
    for c in ws[0].classes:
        lb, hb = split_bits(c.bits)
        grid = (triton.cdiv(c.n_steps, bs), sum(tiles))
        _dequant_group_kernel[grid](out, out.stride(0), c.first_step, c.n_steps, c.first_word, *args, tiles[0],
                                    tiles[1], BITS=c.bits, LB=lb, HB=hb, HAS_ZEROS=ws[0].zeros is not None, BS=bs,
                                    BN=bn, num_warps=num_warps)


def dequant_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Large-M path: dequantize to fp16 with Triton, multiply with cuBLAS."""
    return dequant_matmul_group(x, [w])[0]


def dequant_matmul_group(x: torch.Tensor, ws: Sequence[QuantWeight]) -> list[torch.Tensor]:
    """`dequant_matmul` of weights sharing the input x `[M, K]` (q/k/v, gate/up): dequantized side by side into
    one fp16 matrix and multiplied in one cuBLAS call, so a prefill issues fewer, wider GEMMs (the host's launch
    work was as long as the GPU's). Returns column views `[M, N_i]` of one output."""
    if len({w.k for w in ws}) != 1 or x.shape[-1] != ws[0].k:
        raise ValueError("grouped weights must share the input width of x.")
    full = all(w.scatter_index() is not None for w in ws)
    wd = (torch.empty if full else torch.zeros)((ws[0].k, sum(w.n for w in ws)), dtype=torch.float16,
                                                device=ws[0].device)
    offs = [0]
    for w in ws:
        offs.append(offs[-1] + w.n)
    layouts = {tuple((c.bits, c.first_step, c.n_steps, c.first_word) for c in w.classes) for w in ws}
    if 2 <= len(ws) <= 3 and len(layouts) == 1 and len({w.zeros is None for w in ws}) == 1:
        _dequant_group(wd, ws)  # one launch per class for all of them
    else:
        for w, o in zip(ws, offs):
            dequantize_triton(w, out=wd[:, o:o + w.n])
    y = torch.matmul(x.to(torch.float16), wd) if x.is_cuda else (x.float() @ wd.float())
    outs = []
    for w, o in zip(ws, offs):
        yi = y[:, o:o + w.n]
        if w.bias is not None:
            yi += w.bias.to(y.dtype)
        outs.append(yi.to(x.dtype))
    return outs


# --------------------------------------------------------------------------------------------------- dispatch
GEMV_MAX_M = 4
DOT_MAX_M = 64
# One launch for the gemvs of q/k/v and of gate/up (`grouped_matmul`): on the H200 q/k/v took 15.4 µs grouped
# against 22.1 µs as three launches, gate/up the same either way (benchmarks/RESULTS.md, run 8).
# EXL2_FUSE_SHARED_INPUT=0 turns it off; correct either way (tests compare with the twin).
FUSE_SHARED_INPUT = env_choice("EXL2_FUSE_SHARED_INPUT", 1, range(0, 2)) == 1
# Weights reading one input whose input orders are equal (q/k/v and gate/up of exllamav2 files share one act-order
# permutation) get one x_index tensor at load (`share_input_orders`), so the small-batch path writes and reads one
# permuted copy for them instead of one each. EXL2_SHARED_INPUT=0 keeps a copy per weight (for A/B runs).
SHARED_INPUT = env_choice("EXL2_SHARED_INPUT", 1, range(0, 2)) == 1
# EXL2_SPLIT_SUM=1: up to 16 rows o and down, where the gemv or the Gluon kernel splits their K, leave the partial
# sums to the norm-gather that reads their output (`SplitSum`), so they end without the counter and the last
# program's sum (~1 µs a call predicted, ~+3 % at batch 1). Off until measured on a GPU (session 16 had no device
# time left for it).
SPLIT_SUM = env_choice("EXL2_SPLIT_SUM", 0, range(0, 2)) == 1

# Up to 16 rows: the Gluon kernel (`mma_dot`), MMA4_BS steps per iteration, 32·MMA4_V columns
# per program, a ring of MMA4_STAGES iterations, K split to about MMA4_PER_SM programs per SM. EXL2_MMA4=0 keeps
# the Triton kernel.
MMA4 = env_choice("EXL2_MMA4", 1, range(0, 2)) == 1
MMA4_BS = env_choice("EXL2_MMA4_BS", 4, (1, 2, 4, 8))
MMA4_V = env_choice("EXL2_MMA4_V", 2, (1, 2, 4))
MMA4_PER_SM = env_choice("EXL2_MMA4_PER_SM", 4, range(1, 9))
MMA4_STAGES = env_choice("EXL2_MMA4_STAGES", 4, range(2, 9))
# 1-4 rows: 1, matrices with 8/5/3/2-bit classes take the Gluon kernel (`gemv_via_mma`); 2, every matrix; 0, none.
MMA_GEMV = env_choice("EXL2_MMA_GEMV", 1, range(0, 3))

GEMV_STAGES = env_choice("EXL2_GEMV_STAGES", 3, range(1, 6))
# K splits of the grouped gemv (q/k/v, gate/up) up to about this many programs per SM (EXL2_GEMV_GROUP_PER_SM):
# 4 splits q/k/v 4 ways instead of 2 (9.1 -> 8.2 us on the H200) and leaves gate/up unsplit (session 11).
GROUP_PER_SM = env_choice("EXL2_GEMV_GROUP_PER_SM", 4, range(1, 9))


def _auto_split(w: QuantWeight, programs: int, device: torch.device, min_steps: int, per_sm: int = 2) -> int:
    """Largest power-of-two split of K with at most ~`per_sm` programs per SM and at least `min_steps` 32-row
    steps per program: the H200 sweeps (benchmarks/RESULTS.md) found every shape fastest there, since more splits
    add partial sums and short-lived programs, fewer leave SMs idle (2 per SM for the register-prefetching
    kernels and the 64-column pipelined gemv, 1 for the 128-column pipelined one)."""
    target = per_sm * sm_count(device)
    split = 1
    while split < 32 and programs * split * 2 <= target and w.n_steps // (split * 2) >= min_steps:
        split *= 2
    return split


def choose_config(m: int, w: QuantWeight, dtype: torch.dtype = torch.float16) -> tuple[str, MatmulConfig | None]:
    """Pick the path and launch parameters for an [m, K] input (from H200 measurements, benchmarks/RESULTS.md):
    the gemv up to 4 rows (one program per row) except for the matrices `gemv_via_mma` sends to the tensor-core
    kernel, which takes up to 64, dequantize + cuBLAS beyond."""
    if m <= GEMV_MAX_M and not gemv_via_mma(w, m, dtype):
        # Matrices of fewer 128-column tiles than SMs (o, down): 64-column tiles, K split to ~2 programs per SM
        # (o 8.4 → 6.8 µs, down 15.2 → 12.6 µs on the H200, run 13); wide ones (the head) keep 128 columns.
        bn = 64 if triton.cdiv(w.n, 128) < sm_count(w.device) else 128
        per_sm = 2 if bn == 64 else 1
        split = _auto_split(w, triton.cdiv(w.n, bn) * m, w.device, 8, per_sm)
        return "gemv", MatmulConfig(bm=1, bs=8, bn=bn, split=split, num_warps=4, num_stages=GEMV_STAGES)
    if m <= DOT_MAX_M:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        programs = triton.cdiv(w.n, 64) * triton.cdiv(m, bm)
        return "dot", MatmulConfig(bm=bm, bs=4 if bm == 16 else 2, bn=64,
                                   split=_auto_split(w, programs, w.device, 16), num_warps=4, num_stages=4)
    return "dequant", None


def uses_permuted_input(m: int, x: torch.Tensor) -> bool:
    """Whether `quant_matmul` on `m` rows would read a permuted input (so callers may share one `gather_input`)."""
    return use_triton(x) and 0 < m <= DOT_MAX_M


def uses_dequant(m: int, x: torch.Tensor) -> bool:
    """Whether `quant_matmul` on `m` rows dequantizes and calls cuBLAS (so callers may group weights that share
    the input through `dequant_matmul_group`)."""
    return use_triton(x) and m > DOT_MAX_M


def permuted_matmul(xp: torch.Tensor, w: QuantWeight, split_sum: bool = False) -> torch.Tensor | SplitSum:
    """`x · W + bias` from the permuted input alone, xp `[M, S·32]` with M ≤ DOT_MAX_M (a producer such as the GLU
    kernel wrote it in `w.x_index` order, so x itself never existed): `[M, N]`. `split_sum`: where the gemv or
    the Gluon kernel splits K, its partial sums as a `SplitSum` for a consumer that adds them
    (`norm.rms_norm_gather`)."""
    m = xp.shape[0]
    if not 0 < m <= DOT_MAX_M or xp.shape[1] != w.x_index.numel() or xp.stride(-1) != 1:
        raise ValueError("permuted_matmul takes 1 to 64 contiguous rows in the weight's input order.")
    if not use_triton(xp):
        # The twin: undo the permutation (padding positions hold zeros and map nowhere), then the plain matmul.
        idx = w.x_index.long()
        x = torch.zeros((m, w.k), dtype=xp.dtype, device=xp.device)
        keep = idx >= 0
        x[:, idx[keep]] = xp[:, keep]
        return matmul_torch(x, w)
    path, cfg = choose_config(m, w, xp.dtype)
    if path != "gemv":
        return _dot_or_mma(xp, w, cfg, split_sum)
    return _launch(_gemv_kernel, xp, w, cfg, split_sum, FAST4=None, STAGES=cfg.num_stages)


def quant_matmul(x: torch.Tensor, w: QuantWeight, xp: torch.Tensor | None = None) -> torch.Tensor:
    """`x · W + bias` for x `[..., K]` (fp16; bf16/fp32 accepted): output `[..., N]` in x's dtype.

    N is the stored width (EXL2 pads to a multiple of 32); slice to `w.out_features` if needed. `xp`, optional,
    is x already permuted for this weight by `gather_input` (small batches only).
    """
    if x.shape[-1] != w.k:
        raise ValueError(f"input has {x.shape[-1]} features but the weight expects {w.k}.")
    if not use_triton(x):
        return matmul_torch(x.reshape(-1, w.k), w).view(*x.shape[:-1], w.n)
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    path, cfg = choose_config(x2.shape[0], w, x2.dtype)
    if path == "gemv":
        y = gemv(x2, w, cfg, xp=xp)
    elif path == "dot":
        y = _dot_or_mma(_permuted(x2, w, xp), w, cfg)
    else:
        y = dequant_matmul(x2, w)
    return y.view(*x.shape[:-1], w.n)
