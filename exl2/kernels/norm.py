"""RMSNorm (plain and Gemma's `1 + w`) and LayerNorm, each optionally fused with the residual add.

With `residual` given, the sum `x + residual` is rounded to the residual's dtype, written back into `residual`
(in place, so the residual stream needs no new buffer) and normalized; the call returns `(normed, residual)`.
Statistics are computed in fp32 and the output is rounded once, to `x.dtype`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import next_pow2, tl, triton, use_triton


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, D, stride_x, stride_r, stride_o, eps,
                 HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, GEMMA: tl.constexpr,
                 LAYER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r_ptrs = res_ptr + row * stride_r + offs
        s = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(r_ptrs, s, mask=mask)
        x = s.to(tl.float32)
    if LAYER:
        mean = tl.sum(x, axis=0) / D
        x = tl.where(mask, x - mean, 0.0)
    var = tl.sum(x * x, axis=0) / D
    y = x * (1.0 / tl.sqrt(var + eps))
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:
            w = w + 1.0
        y = y * w
    if HAS_B:
        y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _norm_triton(x, weight, bias, eps, residual, gemma, layer):
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
            BLOCK=block, num_warps=min(16, max(1, block // 256)))
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
