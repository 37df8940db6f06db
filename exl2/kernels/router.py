"""The softmax router of a mixture-of-experts block for decode-sized batches in two launches: the router logits in
fp32 from the fp16 input and weight (products of fp16 values are exact in fp32, as in the reference's upcast
matmul), then per token the softmax over the experts, the top k and their renormalisation. PyTorch's route
took seven (two upcasts, a GEMV, the softmax, top-k's select and sort, the renormalisation): about a quarter of
a Qwen3-30B-A3B-shaped layer's decode time (H100, benchmarks/RESULTS.md session 37)."""
from __future__ import annotations

import torch

from exl2.kernels.backend import next_pow2, tl, triton


@triton.jit
def _logits_kernel(x_ptr, stride_x, w_ptr, b_ptr, out_ptr, H, E, HAS_BIAS: tl.constexpr, BE: tl.constexpr,
                   BH: tl.constexpr):
    """out[t, e] = Σ_h x[t, h]·w[e, h] (+ b[e]) in fp32, BE experts a program (grid: tokens, expert blocks)."""
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BE + tl.arange(0, BE)
    mask_e = offs_e < E
    acc = tl.zeros([BE], dtype=tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + tl.arange(0, BH)
        mask_h = offs_h < H
        xv = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * H + offs_h[None, :],
                     mask=mask_e[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * E + offs_e, acc, mask=mask_e)


@triton.jit
def _softmax_topk_kernel(logits_ptr, idx_ptr, w_ptr, E, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                         NORM: tl.constexpr):
    """Token t's k most probable experts (ties: the lower index) and their probabilities, renormalised to sum
    to 1 with NORM."""
    t = tl.program_id(0)
    offs = tl.arange(0, BE)
    mask = offs < E
    logit = tl.load(logits_ptr + t.to(tl.int64) * E + offs, mask=mask, other=float("-inf"))
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(mask, p, -1.0)
    slots = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    ws = tl.zeros([KP], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(left, axis=0)
        at = tl.min(tl.where(left == best, offs, BE), axis=0)
        ids = tl.where(slots == j, at.to(tl.int64), ids)
        ws = tl.where(slots == j, best, ws)
        left = tl.where(offs == at, -2.0, left)
    if NORM:
        ws = ws / tl.sum(ws, axis=0)
    tl.store(idx_ptr + t.to(tl.int64) * K + slots, ids, mask=slots < K)
    tl.store(w_ptr + t.to(tl.int64) * K + slots, ws, mask=slots < K)


def softmax_topk_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, norm: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int64 [N, k], fp32 weights [N, k]) of x `[N, H]` routed by softmax(x·Wᵀ + b) over the `[E, H]`
    router weight: top k, renormalised when `norm`. The kernels' form of `MoE.route`'s softmax router."""
    n, h = x.shape
    e = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = weight.contiguous()
    logits = torch.empty((n, e), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, k), dtype=torch.int64, device=x.device)
    wts = torch.empty((n, k), dtype=torch.float32, device=x.device)
    if n:
        # at least ~256 programs (one token: one expert a program; a whole 2,048-wide row in one load), so the
        # router weight streams from every SM: 16 experts a program left one token's 128 experts to 8 SMs
        # (11.7 µs a layer on an H100, RESULTS.md session 38)
        be = max(1, min(16, next_pow2(n * e) // 256))
        _logits_kernel[(n, triton.cdiv(e, be))](x, x.stride(0), w, bias if bias is not None else w, logits, h, e,
                                               HAS_BIAS=bias is not None, BE=be, BH=min(next_pow2(h), 4096 // be),
                                               num_warps=4)
        _softmax_topk_kernel[(n,)](logits, idx, wts, e, K=k, KP=next_pow2(k), BE=next_pow2(e), NORM=norm,
                                   num_warps=4)
    return idx, wts
