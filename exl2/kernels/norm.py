"""RMSNorm (plain and Gemma's `1 + w`) and LayerNorm, each optionally fused with the residual add.

With `residual` given, the sum `x + residual` is rounded to the residual's dtype, written back into `residual`
(in place, so the residual stream needs no new buffer) and normalized; the call returns `(normed, residual)`.
Statistics are computed in fp32 and the output is rounded once, to `x.dtype`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import next_pow2, pdl_args, pdl_sync, tl, triton, use_triton
from exl2.kernels.permute import take_columns
from exl2.kernels.split_sum import SplitSum


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, D, stride_x, stride_r, stride_o, eps,
                 HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, GEMMA: tl.constexpr,
                 LAYER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        pdl_sync()
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


@triton.jit
def _sum_parts(row_ptr, cols, mask, stride_s, NPART: tl.constexpr):
    """Columns `cols` of a row in fp32: the row itself (NPART 0) or the sum of its NPART partial rows."""
    if NPART == 0:
        v = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(row_ptr + cols, mask=mask, other=0.0)
        for i in tl.static_range(1, NPART):
            v += tl.load(row_ptr + i * stride_s + cols, mask=mask, other=0.0)
    return v


@triton.jit
def _norm_gather_kernel(x_ptr, res_ptr, w_ptr, out_ptr, xp_ptr, ro_ptr, D, stride_x, stride_r, stride_o,
                        stride_xp, stride_ro, eps, i0, o1, i1, o2, i2, TOTAL, HAS_RES: tl.constexpr,
                        HAS_W: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, GBLOCK: tl.constexpr,
                        PDL: tl.constexpr = False, stride_xs=0, NPART: tl.constexpr = 0):
    """RMSNorm of one row spread over 1 + ceil(TOTAL / GBLOCK) programs (grid axis 1), so the permuted copies
    (gathers, one GBLOCK chunk of the concatenated copies per program) run on several SMs at once. Each program
    reduces the whole row itself (two coalesced loads); program 0 writes the normed row and, with a residual, the
    new residual into a buffer of its own (`ro_ptr`): every program reads the old one, so writing it in place
    would need an arrival counter and a last-program store on every launch's tail. NPART > 0: x is that many fp32
    partial sums (a K-split matmul's, `SplitSum`), `stride_xs` apart, added here. The index vectors and the norm
    weight, which no kernel writes, are read before the PDL wait, so with PDL their latency overlaps the previous
    kernel's tail and only the row's loads follow it."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    # position p of the concatenated copies reads index vector g at p - o_g (o_0 = 0 <= o1 <= o2); the index and
    # gathered loads are issued before the row reduction, so their latency overlaps the row's
    p = (part - 1) * GBLOCK + tl.arange(0, GBLOCK)
    live = (part > 0) & (p < TOTAL)
    idx = tl.load(i0 + p, mask=live & (p < o1), other=-1)
    idx = tl.where(p < o1, idx, tl.load(i1 + (p - o1), mask=live & (p >= o1) & (p < o2), other=-1))
    idx = tl.where(p < o2, idx, tl.load(i2 + (p - o2), mask=live & (p >= o2), other=-1))
    ok = idx >= 0
    if HAS_W:  # this program's weights
        w_row = tl.load(w_ptr + offs, mask=mask & (part == 0), other=0.0).to(tl.float32)
        w_idx = tl.load(w_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        if GEMMA:
            w_row += 1.0
            w_idx += 1.0
    if PDL:
        pdl_sync()
    v = _sum_parts(x_row, idx, ok, stride_xs, NPART)
    if HAS_RES:
        v = (v + tl.load(r_row + idx, mask=ok, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        v = v.to(tl.float32)
    x = _sum_parts(x_row, offs, mask, stride_xs, NPART)
    if HAS_RES:
        s = (x + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    if part == 0:
        y_row = x * rstd
        if HAS_W:
            y_row = y_row * w_row
        tl.store(out_ptr + row * stride_o + offs, y_row.to(out_ptr.dtype.element_ty), mask=mask)
        if HAS_RES:
            tl.store(ro_ptr + row * stride_ro + offs, s, mask=mask)
    else:
        y_copy = v * rstd
        if HAS_W:
            y_copy = y_copy * w_idx
        tl.store(xp_ptr + row * stride_xp + p, tl.where(ok, y_copy, 0.0).to(xp_ptr.dtype.element_ty), mask=live)


def rms_norm_gather(x: torch.Tensor | SplitSum, weight: torch.Tensor | None, eps: float, indices,
                    residual: torch.Tensor | None = None, gemma: bool = False, gblock: int = 1024,
                    num_warps: int | None = None) -> tuple[torch.Tensor, ...]:
    """`rms_norm` that also returns the normed rows gathered by each of 1–3 index vectors (`QuantWeight.x_index`:
    -1 gives 0) side by side, `[rows, Σ len(index)]` — the permuted inputs of the quantized projections that read
    this norm, without a separate gather launch. Pass each distinct vector once (`runtime.linear.permuted_indices`,
    laid out as `permute.input_layout`). Returns `(normed, permuted)`, or with `residual`
    `(norm(x + residual), permuted, x + residual)`: the sum in a new tensor, `residual` only read. `x` may be a
    `SplitSum` (with a residual): the kernel adds its fp32 partial sums itself, so the matmul that made them
    skipped its own sum. `gblock` (positions of the copies a program) and `num_warps` are launch settings, for
    benchmarks/kernels.py's sweep."""
    parts = None
    if isinstance(x, SplitSum):
        if residual is None:
            raise ValueError("a SplitSum input needs the residual it is added to.")
        if use_triton(x.parts) and x.parts.shape[1:] == (residual.numel() // residual.shape[-1], residual.shape[-1]):
            parts, x = x.parts, residual  # x: the shape and dtype of the result from here on
        else:
            x = x.total(residual.dtype).view(residual.shape)
    _check(x, residual)
    if not 0 < len(indices) <= 3:
        raise ValueError("rms_norm_gather takes one to three index vectors.")
    if gblock < 16 or gblock & (gblock - 1):
        raise ValueError(f"gblock must be a power of two of at least 16, got {gblock}.")
    if not use_triton(x):
        new = residual.clone() if residual is not None else None  # the twin sums into it in place
        normed = _norm_torch(x, weight, None, eps, new, gemma, False)
        normed = normed[0] if new is not None else normed
        rows = normed.reshape(-1, normed.shape[-1])
        xp = torch.cat([take_columns(rows, idx) for idx in indices], dim=1)
        return (normed, xp, new) if new is not None else (normed, xp)
    d = x.shape[-1]
    x2 = _rows(x) if parts is None else parts[0]
    m = x2.shape[0]
    sizes = [int(i.numel()) for i in indices]
    offs = [sum(sizes[:k]) for k in range(len(sizes))] + [sum(sizes)] * (3 - len(sizes))
    ptrs = list(indices) + [indices[-1]] * (3 - len(indices))
    total = sum(sizes)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    xp = torch.empty((m, total), dtype=x.dtype, device=x.device)
    r2 = residual.view(-1, d) if residual is not None else x2
    ro = torch.empty_like(residual) if residual is not None else None
    ro2 = ro.view(-1, d) if ro is not None else x2
    if m:
        block = next_pow2(d)
        _norm_gather_kernel[(m, 1 + triton.cdiv(total, gblock))](
            x2, r2, weight if weight is not None else x2, out, xp, ro2, d, x2.stride(0), r2.stride(0),
            out.stride(0), xp.stride(0), ro2.stride(0), float(eps), ptrs[0], offs[1], ptrs[1],
            offs[2], ptrs[2], total, HAS_RES=residual is not None, HAS_W=weight is not None, GEMMA=gemma,
            BLOCK=block, GBLOCK=gblock, num_warps=num_warps or min(16, max(4, block // 256)),
            stride_xs=parts.stride(0) if parts is not None else 0, NPART=parts.shape[0] if parts is not None else 0,
            **pdl_args(x2.device, x2.shape[0], small=True))
    return (out.view(x.shape), xp, ro) if ro is not None else (out.view(x.shape), xp)


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
            BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl_args(x2.device, x2.shape[0], small=True))
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


@triton.jit
def _norm_pair_kernel(a_ptr, wa_ptr, oa_ptr, ROWS_A, b_ptr, wb_ptr, ob_ptr, D, eps, GEMMA: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """RMSNorm of the contiguous D-wide rows of two tensors, each with its weight, in one launch: program r < ROWS_A
    normalizes a's row r, the others b's row r - ROWS_A."""
    if PDL:
        pdl_sync()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    if row < ROWS_A:
        _norm_row(a_ptr + row.to(tl.int64) * D, wa_ptr, oa_ptr + row.to(tl.int64) * D, offs, mask, D, eps, GEMMA)
    else:
        r = (row - ROWS_A).to(tl.int64)
        _norm_row(b_ptr + r * D, wb_ptr, ob_ptr + r * D, offs, mask, D, eps, GEMMA)


@triton.jit
def _norm_row(x_row, w_ptr, o_row, offs, mask, D, eps, GEMMA: tl.constexpr):
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)) * w
    tl.store(o_row + offs, y.to(o_row.dtype.element_ty), mask=mask)


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float,
                  gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` of a and b (each over its last dim, of one width, with its own weight) in one launch: the
    per-head q and k norms of Qwen3, Gemma 3 and the like, a launch a layer fewer."""
    if a.shape[-1] != b.shape[-1] or not use_triton(a):
        return rms_norm(a.contiguous(), wa, eps, gemma=gemma), rms_norm(b.contiguous(), wb, eps, gemma=gemma)
    a, b = a.contiguous(), b.contiguous()
    d = a.shape[-1]
    oa, ob = torch.empty_like(a), torch.empty_like(b)
    rows_a, rows_b = a.numel() // d, b.numel() // d
    if rows_a + rows_b:
        _norm_pair_kernel[(rows_a + rows_b,)](a, wa, oa, rows_a, b, wb, ob, d, eps, GEMMA=gemma,
                                              BLOCK=next_pow2(d), num_warps=min(16, max(1, next_pow2(d) // 256)),
                                              **pdl_args(a.device, rows_a + rows_b, small=True))
    return oa, ob


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
