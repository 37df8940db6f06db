"""RMSNorm (plain and Gemma's `1 + w`) and LayerNorm, each optionally fused with the residual add.

With `residual` given, the sum `x + residual` is rounded to the residual's dtype, written back into `residual`
(in place, so the residual stream needs no new buffer) and normalized; the call returns `(normed, residual)`.
Statistics are computed in fp32 and the output is rounded once, to `x.dtype`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import next_pow2, tl, triton, use_triton
from exl2.kernels.permute import take_columns


@triton.jit
def _gather_in(x_row, res_row, idx_ptr, n, offs, HAS_RES: tl.constexpr):
    """One consumer's index vector and the input (+ residual) entries it picks, loaded before any store."""
    idx = tl.load(idx_ptr + offs, mask=offs < n, other=-1)
    gx = tl.load(x_row + idx, mask=idx >= 0, other=0.0)
    if HAS_RES:
        gr = tl.load(res_row + idx, mask=idx >= 0, other=0.0)
    else:
        gr = gx
    return idx, gx, gr


@triton.jit
def _gather_out(idx, gx, gr, dst_row, n, offs, w_ptr, mean, rstd, res_dtype, HAS_RES: tl.constexpr,
                HAS_W: tl.constexpr, GEMMA: tl.constexpr, LAYER: tl.constexpr):
    """dst[p] = normed[idx[p]] (0 where idx[p] < 0), computed the way the main row is."""
    v = gx.to(tl.float32)
    if HAS_RES:
        v = (v + gr.to(tl.float32)).to(res_dtype).to(tl.float32)
    if LAYER:
        v = v - mean
    y = v * rstd
    if HAS_W:
        w = tl.load(w_ptr + idx, mask=idx >= 0, other=0.0).to(tl.float32)
        if GEMMA:
            w = w + 1.0
        y = y * w
    tl.store(dst_row + offs, tl.where(idx >= 0, y, 0.0).to(dst_row.dtype.element_ty), mask=offs < n)


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, D, stride_x, stride_r, stride_o, eps,
                 HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, GEMMA: tl.constexpr,
                 LAYER: tl.constexpr, BLOCK: tl.constexpr, xp_ptr=None, stride_xp=0, i0=None, o0=0, n0=0, i1=None,
                 o1=0, n1=0, i2=None, o2=0, n2=0, G: tl.constexpr = 0):
    """One row per program. With G > 0 the program also writes G permuted copies of its normed row (the
    consumers' `quant_matmul.gather_input` order), computed from gathered inputs that are all loaded up front,
    so the copies cost one memory latency, not a dependent chain after the row is written."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if G > 0:
        idx0, gx0, gr0 = _gather_in(x_row, r_row, i0, n0, offs, HAS_RES)
        if G > 1:
            idx1, gx1, gr1 = _gather_in(x_row, r_row, i1, n1, offs, HAS_RES)
        if G > 2:
            idx2, gx2, gr2 = _gather_in(x_row, r_row, i2, n2, offs, HAS_RES)
    mean = 0.0
    if HAS_RES:
        r_ptrs = r_row + offs
        s = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        if G > 0:
            tl.debug_barrier()  # every thread's gathered residual loads happen before any residual store
        tl.store(r_ptrs, s, mask=mask)
        x = s.to(tl.float32)
    if LAYER:
        mean = tl.sum(x, axis=0) / D
        x = tl.where(mask, x - mean, 0.0)
    var = tl.sum(x * x, axis=0) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    y = x * rstd
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:
            w = w + 1.0
        y = y * w
    if HAS_B:
        y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    if G > 0:
        xp_row = xp_ptr + row * stride_xp
        _gather_out(idx0, gx0, gr0, xp_row + o0, n0, offs, w_ptr, mean, rstd, res_ptr.dtype.element_ty, HAS_RES,
                    HAS_W, GEMMA, LAYER)
        if G > 1:
            _gather_out(idx1, gx1, gr1, xp_row + o1, n1, offs, w_ptr, mean, rstd, res_ptr.dtype.element_ty,
                        HAS_RES, HAS_W, GEMMA, LAYER)
        if G > 2:
            _gather_out(idx2, gx2, gr2, xp_row + o2, n2, offs, w_ptr, mean, rstd, res_ptr.dtype.element_ty,
                        HAS_RES, HAS_W, GEMMA, LAYER)


def rms_norm_gather(x: torch.Tensor, weight: torch.Tensor | None, eps: float, indices, residual=None,
                    gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` (with the residual update if `residual` is given) that also returns the normed rows gathered by
    each of 1–3 index vectors (`QuantWeight.x_index`: -1 gives 0) side by side, `[rows, Σ len(index)]` — the
    permuted inputs of the quantized projections that read this norm, without a separate gather launch."""
    _check(x, residual)
    if not 0 < len(indices) <= 3:
        raise ValueError("rms_norm_gather takes one to three index vectors.")
    if not use_triton(x):
        out = _norm_torch(x, weight, None, eps, residual, gemma, False)
        normed = out[0] if residual is not None else out
        rows = normed.reshape(-1, normed.shape[-1])
        return normed, torch.cat([take_columns(rows, idx) for idx in indices], dim=1)
    sizes = [int(i.numel()) for i in indices]
    if max(sizes) > next_pow2(x.shape[-1]):
        raise ValueError("an index vector is longer than the padded row it gathers from.")
    xp = torch.empty((x.numel() // x.shape[-1], sum(sizes)), dtype=x.dtype, device=x.device)
    g = {}
    for k in range(3):  # unused slots repeat the last index vector (G tells the kernel how many are real)
        j = min(k, len(indices) - 1)
        g.update({f"i{k}": indices[j], f"o{k}": sum(sizes[:j]), f"n{k}": sizes[j]})
    out = _norm_triton(x, weight, None, eps, residual, gemma, False, xp_ptr=xp, stride_xp=xp.stride(0),
                       G=len(indices), **g)
    return (out[0] if residual is not None else out), xp


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _norm_triton(x, weight, bias, eps, residual, gemma, layer, **gather):
    """`gather`: the permuted-copy arguments of `_norm_kernel` (see `rms_norm_gather`)."""
    d = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = None
    if residual is not None:
        r2 = residual.view(-1, d)  # must be a view: the kernel updates the caller's residual in place
    if x2.shape[0]:
        block = next_pow2(d)
        _norm_kernel[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight if weight is not None else x2, bias if bias is not None else x2,
            out, d, x2.stride(0), r2.stride(0) if r2 is not None else 0, out.stride(0), float(eps),
            HAS_RES=r2 is not None, HAS_W=weight is not None, HAS_B=bias is not None, GEMMA=gemma, LAYER=layer,
            BLOCK=block, num_warps=min(16, max(1, block // 256)), **gather)
    out = out.view(x.shape)
    return (out, residual) if residual is not None else out


def _norm_torch(x, weight, bias, eps, residual, gemma, layer):
    xf = x.float()
    if residual is not None:
        residual.copy_((xf + residual.float()).to(residual.dtype))
        xf = residual.float()
    if layer:
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + 1.0 if gemma else weight.float())
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return (y, residual) if residual is not None else y


def _check(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {list(residual.shape)} differs from x shape {list(x.shape)}.")
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous (it is updated in place).")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             gemma: bool = False):
    """RMSNorm over the last dim: `x / rms(x) * w` (`* (1 + w)` with `gemma=True`).

    Returns the normed tensor, or `(normed, residual)` when `residual` is given (see the module docstring).
    """
    _check(x, residual)
    impl = _norm_triton if use_triton(x) else _norm_torch
    return impl(x, weight, None, eps, residual, gemma, False)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None):
    """LayerNorm over the last dim, same residual convention as `rms_norm`."""
    _check(x, residual)
    impl = _norm_triton if use_triton(x) else _norm_torch
    return impl(x, weight, bias, eps, residual, False, True)


def rms_norm_torch(x, weight, eps, residual=None, gemma=False):
    """The twin of `rms_norm`."""
    _check(x, residual)
    return _norm_torch(x, weight, None, eps, residual, gemma, False)


def layer_norm_torch(x, weight, bias, eps, residual=None):
    """The twin of `layer_norm`."""
    _check(x, residual)
    return _norm_torch(x, weight, bias, eps, residual, False, True)
