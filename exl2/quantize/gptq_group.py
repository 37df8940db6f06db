"""GPTQ's sequential loop over the rows of one group: one Triton launch on CUDA, a PyTorch loop elsewhere.

Each row is rounded, its error scaled by the inverse Cholesky diagonal and fed back into the group's later rows.
In PyTorch that is ~8 tiny ops per row, and a Llama-8B layer's measurement quantizes ~540 000 rows: on a GPU the
host cannot launch them fast enough (≈ 1 min per layer of pure launch overhead). Columns are independent, so the
kernel gives each program a tile of columns and keeps the group's rows in registers for the whole loop.

Both versions round half to even and divide exactly (IEEE), so their levels agree except where the feedback's
last-bit rounding (fused multiply-add on the GPU) tips a value across a rounding boundary.
"""
from __future__ import annotations

import warnings

import torch

from exl2.kernels.backend import HAVE_TRITON, next_pow2, tl, triton

MAX_KERNEL_ROWS = 256       # larger groups (none of the option tables has them) take the PyTorch loop


def group_loop_torch(wg: torch.Tensor, ug: torch.Tensor, rdiag: list[float], scale: torch.Tensor, z: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels, scaled errors), each [rows, N] fp32, for group rows `wg` [rows, N] (modified in place), the group's
    block `ug` [rows, rows] of the upper inverse-Hessian factor, its inverse diagonal and per-column scales."""
    rows = wg.shape[0]
    levels = torch.empty_like(wg)
    err = torch.empty_like(wg)
    w_rows, l_rows, e_rows = wg.unbind(0), levels.unbind(0), err.unbind(0)
    for j in range(rows):
        q = torch.div(w_rows[j], scale, out=l_rows[j]).round_().clamp_(-z, z - 1)
        # Error feedback uses q·S before its fp16 rounding (< 2^-11 relative); the stored values are exact.
        torch.sub(w_rows[j], q * scale, out=e_rows[j]).mul_(rdiag[j])
        if j + 1 < rows:
            wg[j + 1:].addr_(ug[j, j + 1:], e_rows[j], alpha=-1.0)
    return levels, err


@triton.jit
def _group_kernel(w_ptr, u_ptr, rd_ptr, s_ptr, lv_ptr, err_ptr, ROWS, N, stride_w, su0, su1, LO, HI,
                  BR: tl.constexpr, BN: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < N
    r = tl.arange(0, BR)
    rm = r < ROWS
    w = tl.load(w_ptr + r[:, None] * stride_w + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
    s = tl.load(s_ptr + cols, mask=cm, other=1.0)
    for j in range(0, ROWS):
        wj = tl.sum(tl.where(r[:, None] == j, w, 0.0), axis=0)
        t = tl.math.div_rn(wj, s)
        q = tl.floor(t)
        f = t - q                                      # exact: round half to even, as torch.round
        q = tl.where((f > 0.5) | ((f == 0.5) & ((q.to(tl.int32) & 1) == 1)), q + 1.0, q)
        q = tl.minimum(tl.maximum(q, LO), HI)
        e = (wj - q * s) * tl.load(rd_ptr + j)
        tl.store(lv_ptr + j * N + cols, q, mask=cm)
        tl.store(err_ptr + j * N + cols, e, mask=cm)
        u = tl.load(u_ptr + j * su0 + r * su1, mask=rm & (r > j), other=0.0)
        w = w - u[:, None] * e[None, :]


def group_loop_triton(wg: torch.Tensor, ug: torch.Tensor, rdiag: torch.Tensor, scale: torch.Tensor, z: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `group_loop_torch` in one launch (`wg` is left unchanged; `rdiag` is a tensor here)."""
    rows, n = wg.shape
    assert wg.stride(1) == 1 and rows <= MAX_KERNEL_ROWS
    levels = torch.empty((rows, n), dtype=torch.float32, device=wg.device)
    err = torch.empty_like(levels)
    br = max(16, next_pow2(rows))
    bn = 32 if br <= 128 else 16
    _group_kernel[(triton.cdiv(n, bn),)](wg, ug, rdiag.contiguous(), scale.contiguous(), levels, err, rows, n,
                                         wg.stride(0), ug.stride(0), ug.stride(1), float(-z), float(z - 1),
                                         BR=br, BN=bn, num_warps=4)
    return levels, err


def _self_check(device: torch.device) -> bool:
    """Once per process: the kernel compiles here and agrees with the PyTorch loop on a small random group."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=gen, dtype=torch.float64)
    u = torch.linalg.cholesky(a @ a.T / 64 + torch.eye(64, dtype=torch.float64), upper=True).float().to(device)
    w = (torch.randn(64, 96, generator=gen) * 0.02).to(device)
    scale = torch.full((96,), 0.004, device=device)
    rdiag = torch.diagonal(u).reciprocal()
    try:
        lv, err = group_loop_triton(w, u, rdiag, scale, 8)
    except Exception as e:  # noqa: BLE001 - any compile/launch failure: use the PyTorch loop instead
        warnings.warn(f"GPTQ group kernel unavailable ({type(e).__name__}: {e}); using the PyTorch loop")
        return False
    ref_lv, ref_err = group_loop_torch(w.clone(), u, rdiag.tolist(), scale, 8)
    ok = float((lv != ref_lv).float().mean()) < 0.01 and torch.allclose(err, ref_err, rtol=1e-3, atol=1e-5)
    if not ok:
        warnings.warn("GPTQ group kernel disagrees with the PyTorch loop; using the PyTorch loop")
    return ok


_checked: dict[torch.device, bool] = {}


def group_loop(wg: torch.Tensor, ug: torch.Tensor, rdiag: torch.Tensor, scale: torch.Tensor, z: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the kernel for CUDA tensors once it has passed its self-check (the converter's `force_torch`
    does not apply: this loop has no autograd or precision reason to stay in PyTorch), the PyTorch loop otherwise."""
    if HAVE_TRITON and wg.is_cuda and wg.shape[0] <= MAX_KERNEL_ROWS:
        if wg.device not in _checked:
            _checked[wg.device] = _self_check(wg.device)
        if _checked[wg.device]:
            return group_loop_triton(wg.contiguous(), ug, rdiag, scale, z)
    return group_loop_torch(wg, ug, rdiag.tolist(), scale, z)
