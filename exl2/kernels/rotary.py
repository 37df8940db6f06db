"""Rotary position embedding applied in place to q and k from precomputed cos/sin tables.

Every RoPE variant (plain, linear, NTK, Llama-3, YaRN, LongRoPE, …) differs only in its table, which the caller
builds: `cos`, `sin` are `[max_positions, rotary_dim // 2]` (any float dtype; fp32 recommended). The first
`rotary_dim` features of each head are rotated, the rest pass through (partial rotary). Layouts:
`interleaved=False` (GPT-NeoX / Llama "rotate half": pairs (i, i + rotary_dim/2)) and `interleaved=True`
(GPT-J: pairs (2i, 2i+1)). `q`, `k` are `[..., heads, head_dim]` whose leading dims flatten to one token axis of
length `positions.numel()`; any token/head strides are fine (e.g. views into a fused QKV output) as long as the
last dim is contiguous.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import next_pow2, pdl_args, pdl_sync, tl, triton, use_triton


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_cos, HALF, QBLOCKS, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_R: tl.constexpr, v_ptr=None, stride_vt=0, stride_vh=0, kc_ptr=None, vc_ptr=None,
                 slot_ptr=None, D=0, DV=0, KBLOCKS=0, STORE: tl.constexpr = False, BLOCK_D: tl.constexpr = 16,
                 PDL: tl.constexpr = False, KEEP_K: tl.constexpr = False):
    """Rotate q and k in place; with STORE, k is rotated into its cache row instead (slot_ptr, rows of HK·D
    fp16; with KEEP_K in place as well) and v copied into its own (HK·DV), so a decode step or a prefill needs one
    launch for RoPE and the cache write."""
    if PDL:
        pdl_sync()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = 0
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if STORE and hb >= QBLOCKS + KBLOCKS:  # values: a plain copy of this block of heads
        offs_h = (hb - QBLOCKS - KBLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        m = (offs_h < HK)[:, None] & (offs_d < DV)[None, :]
        val = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m)
        tl.store(vc_ptr + slot * (HK * DV) + offs_h[:, None] * DV + offs_d[None, :], val, mask=m)
    else:
        rotate_heads(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, t, hb, slot, HQ, HK, stride_qt, stride_qh, stride_kt,
                     stride_kh, stride_cos, HALF, QBLOCKS, kc_ptr, D, INTERLEAVED, BLOCK_H, BLOCK_R, STORE, BLOCK_D,
                     KEEP_K)


@triton.jit
def rotate_heads(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, t, hb, slot, HQ, HK, stride_qt, stride_qh, stride_kt,
                 stride_kh, stride_cos, HALF, QBLOCKS, kc_ptr, D, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_R: tl.constexpr, STORE: tl.constexpr, BLOCK_D: tl.constexpr, KEEP_K: tl.constexpr = False):
    """Block hb of the q heads, or (hb >= QBLOCKS) of the k heads: rotated in place, or for k with STORE into
    cache row `slot` (and with KEEP_K in place too)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    if hb < QBLOCKS:
        base = q_ptr + t * stride_qt
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < HQ
        hstride = stride_qh
    else:
        base = k_ptr + t * stride_kt
        offs_h = (hb - QBLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < HK
        hstride = stride_kh
    if INTERLEAVED:
        i1 = 2 * offs_r
        i2 = 2 * offs_r + 1
    else:
        i1 = offs_r
        i2 = offs_r + HALF
    p1 = base + offs_h[:, None] * hstride + i1[None, :]
    p2 = base + offs_h[:, None] * hstride + i2[None, :]
    m = hmask[:, None] & rmask[None, :]
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
    y1 = (x1 * c[None, :] - x2 * s[None, :]).to(p1.dtype.element_ty)
    y2 = (x2 * c[None, :] + x1 * s[None, :]).to(p2.dtype.element_ty)
    if STORE and hb >= QBLOCKS:
        row = kc_ptr + slot * (HK * D) + offs_h[:, None] * D
        tl.store(row + i1[None, :], y1, mask=m)
        tl.store(row + i2[None, :], y2, mask=m)
        offs_p = 2 * HALF + tl.arange(0, BLOCK_D)  # features past the rotary ones pass through
        mp = hmask[:, None] & (offs_p < D)[None, :]
        tl.store(row + offs_p[None, :], tl.load(base + offs_h[:, None] * hstride + offs_p[None, :], mask=mp), mask=mp)
        if KEEP_K:
            tl.store(p1, y1, mask=m)
            tl.store(p2, y2, mask=m)
    else:
        tl.store(p1, y1, mask=m)
        tl.store(p2, y2, mask=m)


def token_view(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """x as `[tokens, heads, head_dim]` (a view; the head dim must be contiguous)."""
    if x.dim() < 2:
        raise ValueError(f"expected [..., heads, head_dim], got shape {list(x.shape)}.")
    v = x.view(tokens, x.shape[-2], x.shape[-1]) if x.dim() != 3 else x
    if v.shape[0] != tokens:
        raise ValueError(f"{v.shape[0]} tokens but {tokens} positions.")
    if v.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous.")
    return v


def check_tables(q, k, cos, sin, positions, rotary_dim) -> int:
    """The rotary dim after checking it and the cos/sin tables against q and k."""
    rd = rotary_dim or q.shape[-1]
    if rd % 2 or rd > q.shape[-1] or (k is not None and rd > k.shape[-1]):
        raise ValueError(f"rotary_dim {rd} must be even and at most the head dim.")
    if cos.shape != sin.shape or cos.shape[-1] != rd // 2:
        raise ValueError(f"cos/sin tables must be [positions, {rd // 2}], got {list(cos.shape)}.")
    return rd


def apply_rotary(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False) -> None:
    """Rotate q and k (in place) by the angles of `positions` (see the module docstring)."""
    rd = check_tables(q, k, cos, sin, positions, rotary_dim)
    if not use_triton(q):
        return apply_rotary_torch(q, k, cos, sin, positions, rotary_dim, interleaved)
    t = positions.numel()
    if t == 0:
        return None
    q3 = token_view(q, t)
    k3 = token_view(k, t) if k is not None else q3
    hk = k3.shape[1] if k is not None else 0
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    block_h = min(16, next_pow2(max(q3.shape[1], hk, 1)))
    qblocks = triton.cdiv(q3.shape[1], block_h)
    grid = (t, qblocks + triton.cdiv(hk, block_h))
    _rope_kernel[grid](q3, k3, cos, sin, positions.reshape(-1), q3.shape[1], hk, q3.stride(0), q3.stride(1),
                       k3.stride(0), k3.stride(1), cos.stride(0), rd // 2, qblocks, INTERLEAVED=interleaved,
                       BLOCK_H=block_h, BLOCK_R=next_pow2(rd // 2), num_warps=2, **pdl_args(q3.device, t, small=True))
    return None


def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 rotary_dim: int | None = None, interleaved: bool = False, keep_k: bool = False) -> None:
    """`apply_rotary(q, k, ...)` and the fp16 cache write of k and v (`attention.write_kv`) in one launch: q is
    rotated in place, k is rotated into its cache rows (k itself is left as it was unless `keep_k`: a prefill
    attends to the new keys directly), v is copied into its rows.
    q, k, v `[T, H, D]`; caches `[pages, page_size, Hkv, D]` (or `[slots, Hkv, D]`); slots `[T]`."""
    rd = check_tables(q, k, cos, sin, positions, rotary_dim)
    t = positions.numel()
    q3, k3, v3 = token_view(q, t), token_view(k, t), token_view(v, t)
    hk, d, dv = k3.shape[1], k3.shape[2], v3.shape[2]
    if k_cache.shape[-2:] != (hk, d) or v_cache.shape[-2:] != (hk, dv):
        raise ValueError("new keys/values do not match the cache's row width.")
    if not use_triton(q):
        if not keep_k:
            k = k.clone()
            k3 = token_view(k, t)
        apply_rotary_torch(q, k, cos, sin, positions, rotary_dim, interleaved)
        idx = slots.reshape(-1).long()
        k_cache.view(-1, hk, d).index_copy_(0, idx, k3.to(k_cache.dtype))
        v_cache.view(-1, hk, dv).index_copy_(0, idx, v3.to(v_cache.dtype))
        return None
    if t == 0:
        return None
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    block_h = min(16, next_pow2(max(q3.shape[1], hk)))
    qblocks, kblocks = triton.cdiv(q3.shape[1], block_h), triton.cdiv(hk, block_h)
    _rope_kernel[(t, qblocks + 2 * kblocks)](
        q3, k3, cos, sin, positions.reshape(-1), q3.shape[1], hk, q3.stride(0), q3.stride(1), k3.stride(0),
        k3.stride(1), cos.stride(0), rd // 2, qblocks, INTERLEAVED=interleaved, BLOCK_H=block_h,
        BLOCK_R=next_pow2(rd // 2), v_ptr=v3, stride_vt=v3.stride(0), stride_vh=v3.stride(1), kc_ptr=k_cache,
        vc_ptr=v_cache, slot_ptr=slots.reshape(-1), D=d, DV=dv, KBLOCKS=kblocks, STORE=True,
        BLOCK_D=next_pow2(max(dv, d - rd, 1)), KEEP_K=keep_k, num_warps=2, **pdl_args(q3.device, t, small=True))
    return None


def apply_rotary_torch(q, k, cos, sin, positions, rotary_dim=None, interleaved=False) -> None:
    """The twin of `apply_rotary`."""
    rd = check_tables(q, k, cos, sin, positions, rotary_dim)
    pos = positions.reshape(-1).long()
    c = cos.index_select(0, pos).float()[:, None, :]
    s = sin.index_select(0, pos).float()[:, None, :]
    for x in (q, k):
        if x is None:
            continue
        x3 = token_view(x, pos.numel())
        r = x3[..., :rd]
        if interleaved:
            x1, x2 = r[..., 0::2], r[..., 1::2]
        else:
            x1, x2 = r[..., : rd // 2], r[..., rd // 2:]
        f1, f2 = x1.float(), x2.float()
        n1, n2 = f1 * c - f2 * s, f2 * c + f1 * s
        x1.copy_(n1.to(x.dtype))
        x2.copy_(n2.to(x.dtype))


def rotary_tables(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[max_positions, len(inv_freq)]` (fp32) for the given inverse frequencies."""
    inv = inv_freq.to(device=device, dtype=torch.float32)
    ang = torch.outer(torch.arange(max_positions, device=inv.device, dtype=torch.float32), inv)
    return (ang.cos() * attention_scaling), (ang.sin() * attention_scaling)
