"""The draw of a sampled token: Gumbel-max over counter-based noise, fused with the filters, for a whole batch.

Row b's noise for token v is a 32-bit hash of (key_b + v · 0x9E3779B9), turned into a uniform u in (0, 1); the
token is argmax(y_v − log(−log u_v)) over the row's filtered, temperature-scaled logits y, which is a draw from
softmax(y). Keys (`row_keys`) hash a job's seed with how many tokens it has drawn, so a job's tokens depend only on
its seed and position: not on the batch around it, nor on speculative decoding checking several positions at once.
The draw kernel reads y from the prep kernel (`cutoff.py`: the penalties and temperature applied once) or computes
it, applies min-p and the top-k/top-p cutoffs, each program drawing over a chunk of the row, and a last launch picks
among the chunks: what
took ~90 small tensor operations a step (1.6 ms at batch 1 on the H200) and later a sort of the logits.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from exl2.kernels.backend import tl, triton
from exl2.kernels.cutoff import Cutoffs, final_key, logit, order_key, row_max

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def hash32(x: int) -> int:
    """lowbias32: a 32-bit integer mix with uniform, decorrelated outputs (host side)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: Sequence[int], counters: Sequence[int]) -> list[int]:
    """The 32-bit noise key of each row: its seed (any 64-bit value) mixed with its draw counter."""
    return [hash32((int(s) & _M32) ^ hash32(((int(s) >> 32) & _M32) ^ hash32(int(c)))) for s, c in zip(seeds, counters)]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit halves of c)."""
    return ((x * (c & 0xFFFF)) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1) of the rows' keys ([B] int64 in [0, 2^32))."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _hash32_torch((keys.to(torch.int64)[:, None] + _mul32(idx, _GOLDEN)[None, :]) & _M32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_argmax_torch(y: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Twin of `draw`'s Gumbel-max over already filtered logits y [B, V] (-inf where a token is excluded)."""
    return (y.float() - torch.log(-torch.log(counter_uniform(keys, y.shape[-1])))).argmax(dim=-1)


@triton.jit
def _hash32_tl(x):
    """lowbias32 on values in [0, 2^32); the masks keep it exact whether the constants type as uint32 or int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _draw_kernel(x_ptr, seen_ptr, cnt_ptr, par_ptr, key_ptr, y_ptr, pmax_ptr, khist_ptr, ksti_ptr, kstf_ptr,
                 phist_ptr, psti_ptr, pstf_ptr, val_ptr, arg_ptr, cut_ptr, V, B, P, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, PP: tl.constexpr, HAS_SEEN: tl.constexpr, HAS_COUNTS: tl.constexpr,
                 PREPPED: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """Each program's best token of its chunk: max of y + Gumbel noise over the tokens the row's cutoffs keep
    (max of y for greedy rows); y read from the prep kernel's output (PREPPED) or computed from the logits."""
    row = tl.program_id(0)
    pid = tl.program_id(1)
    top_k = tl.load(par_ptr + row * 8 + 2)
    top_p = tl.load(par_ptr + row * 8 + 3)
    min_p = tl.load(par_ptr + row * 8 + 4)
    greedy = tl.load(par_ptr + row * 8 + 5) != 0.0
    key = tl.load(key_ptr + row).to(tl.uint32)
    cut = -2147483647 - 1
    if HAS_K:
        if top_k > 0.0:
            cut = final_key(khist_ptr, ksti_ptr, kstf_ptr, row, B, P, top_p, False, PP)
    if HAS_P:
        if top_p < 1.0:
            cut = tl.maximum(cut, final_key(phist_ptr, psti_ptr, pstf_ptr, row, B, P, top_p, True, PP))
    if pid == 0:
        tl.store(cut_ptr + row, cut)
    m = 0.0
    if HAS_MIN_P:
        m = row_max(pmax_ptr, row, P, PP)
    best_v = -float("inf")
    best_i = 0
    for start in range(pid * CHUNK, pid * CHUNK + CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        if PREPPED:
            y = tl.load(y_ptr + row.to(tl.int64) * V + idx, mask=ok, other=-float("inf"))
        else:
            y = logit(x_ptr, seen_ptr, cnt_ptr, par_ptr, row, idx, ok, V, HAS_SEEN, HAS_COUNTS)
        keep = ok & (order_key(y) >= cut)
        if HAS_MIN_P:
            keep = keep & (tl.exp(y - m) >= tl.where(min_p > 0.0, min_p, -1.0))
        x = _hash32_tl((key + ((idx.to(tl.uint32) * 0x9E3779B9) & 0xFFFFFFFF)) & 0xFFFFFFFF)
        u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        v = tl.where(greedy, tl.where(ok, y, -float("inf")), tl.where(keep, y - tl.log(-tl.log(u)), -float("inf")))
        bm = tl.max(v, axis=0)
        bi = tl.argmax(v, axis=0)
        better = bm > best_v
        best_i = tl.where(better, start + bi, best_i)
        best_v = tl.where(better, bm, best_v)
    tl.store(val_ptr + row * P + pid, best_v)
    tl.store(arg_ptr + row * P + pid, best_i)


@triton.jit
def _pick_kernel(val_ptr, arg_ptr, out_ptr, P, PP: tl.constexpr):
    row = tl.program_id(0)
    p_idx = tl.arange(0, PP)
    i = tl.argmax(tl.load(val_ptr + row * P + p_idx, mask=p_idx < P, other=-float("inf")), axis=0)
    tl.store(out_ptr + row, tl.load(arg_ptr + row * P + i).to(tl.int64))


def chunking(vocab: int) -> tuple[int, int]:
    """(chunk, block): tokens a program covers, and a loop step; at most 128 programs a row."""
    block = 512
    return max(4096, triton.cdiv(triton.cdiv(vocab, 128), block) * block), block


def draw(x: torch.Tensor, params: torch.Tensor, keys: torch.Tensor, seen: Optional[torch.Tensor] = None,
         counts: Optional[torch.Tensor] = None, has_k: bool = False, has_p: bool = False, has_min_p: bool = False,
         chunking_: Optional[tuple[int, int]] = None, cuts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [B]: row b's token from float32 logits x [B, V] through its settings in params (float32 [B, 8]:
    repetition penalty, temperature, top-k (0: off), top-p (1: off), min-p (0: off), greedy flag, frequency and
    presence penalties) and the noise of keys[b] (int64 [B], 32-bit values from `row_keys`); `seen` (bool [B, V])
    marks the tokens the repetition penalty applies to, `counts` (float32 [B, V]) how often the reply has each.
    Filters as `sampler.filter_rows`, draws as `gumbel_argmax_torch`; a few launches, no wait for them.
    `cuts` (int32 [B]), when given, receives each row's top-k/top-p cutoff as an `order_key` (tests)."""
    b, v = x.shape
    chunk, block = chunking_ or chunking(v)
    p = triton.cdiv(v, chunk)
    pp = triton.next_power_of_2(p)
    has_seen, has_counts = seen is not None, counts is not None
    seen_arg = seen.view(torch.uint8) if has_seen else x
    counts_arg = counts if has_counts else x
    ws = Cutoffs.for_shape(b, v, p, x.device)
    prepped = has_k or has_p or has_min_p
    if prepped:
        ws.run(x, seen_arg, counts_arg, params, chunk, block, pp, has_seen, has_counts, has_k, has_p)
    cuts = ws.cuts if cuts is None else cuts
    _draw_kernel[(b, p)](x, seen_arg, counts_arg, params, keys, ws.y, ws.pmax, ws.hist[0], ws.sti[0], ws.stf[0],
                         ws.hist[1], ws.sti[1], ws.stf[1], ws.val, ws.arg, cuts, v, b, p, CHUNK=chunk,
                         BLOCK=block, PP=pp, HAS_SEEN=has_seen, HAS_COUNTS=has_counts, PREPPED=prepped,
                         HAS_K=has_k, HAS_P=has_p, HAS_MIN_P=has_min_p, num_warps=4, enable_fp_fusion=False)
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    _pick_kernel[(b,)](ws.val, ws.arg, out, p, PP=pp, num_warps=1)
    return out
