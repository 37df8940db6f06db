"""`routed_gemv` for experts kept in fp16 / bf16 (a checkpoint run unconverted, gpt-oss's MXFP4 experts read as
bf16): one projection of every expert stacked in one `[E, N, K]` tensor, each slot's rows picked on the device by
its router choice, so these MoE models decode through CUDA graphs too. Same interface as `RoutedWeights`; the
input needs no reordering, so `gather` only repeats each token's row for its slots. Triton and a PyTorch twin."""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels.activation import glu
from exl2.kernels.backend import tl, triton, use_triton
from exl2.kernels.routed_gemv import _expert


@triton.jit
def _routed_dense_kernel(x_ptr, stride_x, X_ROWS, w_ptr, b_ptr, out_ptr, sel_ptr, SEL_N, E_STEP, wt_ptr, N, K,
                         HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[s, n] = (Σ_k x[s % X_ROWS, k]·W_e[n, k] + b_e[n]) (· wt[s % SEL_N] with HAS_WEIGHT), e slot s's expert
    (`_expert`); BN outputs a program (grid: column blocks, slots)."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e = _expert(sel_ptr, s, SEL_N, E_STEP).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    x_row = x_ptr + (s % X_ROWS).to(tl.int64) * stride_x
    w_rows = w_ptr + e * N * K + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        xv = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        wv = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        acc *= tl.load(wt_ptr + s % SEL_N).to(tl.float32)
    tl.store(out_ptr + s.to(tl.int64) * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


class RoutedDense:
    """One projection of every expert as one `[E, N, K]` weight (and `[E, N]` bias); the experts' own tensors
    become views of it (`stack`), so it costs no memory of its own."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.n, self.k = weight.shape[1], weight.shape[2]

    @classmethod
    def stack(cls, linears: Sequence) -> "RoutedDense":
        """The stack of dense `Linear`s of one shape (an expert projection each), rebinding each one's weight and
        bias to its slice of the stack; linears stacked so before (tables rebuilt after a LoRA change) reuse it."""
        if cls._stacked_as(linears):
            weight, bias, _ = linears[0]._stacked
            return cls(weight, bias)
        weight = torch.stack([m.weight.data for m in linears])
        bias = torch.stack([m.bias.data for m in linears]) if linears[0].bias is not None else None
        for i, m in enumerate(linears):
            m.weight = torch.nn.Parameter(weight[i], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[i], requires_grad=False)
            m._stacked = (weight, bias, i)
        return cls(weight, bias)

    @staticmethod
    def _stacked_as(linears: Sequence) -> bool:
        """Whether `stack` made these linears' weights the slices of one stack, in this order, still in place."""
        first = getattr(linears[0], "_stacked", None)
        if first is None or first[0].shape[0] != len(linears):
            return False
        for i, m in enumerate(linears):
            mine = getattr(m, "_stacked", None)
            if mine is None or mine[0] is not first[0] or mine[2] != i or \
                    m.weight.data_ptr() != first[0][i].data_ptr():
                return False
        return True

    @staticmethod
    def problem(linears: Sequence) -> str | None:
        """Why these dense linears cannot be stacked, or None: one shape, dtype, device and bias kind."""
        w0 = linears[0]
        key = (w0.weight.shape, w0.weight.dtype, w0.weight.device, w0.bias is None)
        if any((m.weight.shape, m.weight.dtype, m.weight.device, m.bias is None) != key for m in linears):
            return "dense routed experts must agree on shape, dtype, device and bias."
        return None

    def gather(self, x: torch.Tensor, sel: torch.Tensor, row_div: int = 1, scale: torch.Tensor | None = None,
               copies: int = 1, e_step: int = 0) -> torch.Tensor:
        """Slot s's input: row (s % len(sel)) // row_div of x (`RoutedWeights.gather`'s slots; the order is the
        natural one), times `scale[s % len(sel)]` when given."""
        n, k = x.shape
        rows = x[:, None, :].expand(n, row_div, k).reshape(n * row_div, k)[: sel.numel()]   # no host read
        if scale is not None:
            rows = rows * scale.to(rows.dtype)[:, None]
        return rows.repeat(copies, 1) if copies > 1 else rows

    def __call__(self, xp: torch.Tensor, sel: torch.Tensor, split: int | None = None,
                 weight: torch.Tensor | None = None, copies: int = 1, e_step: int = 0) -> torch.Tensor:
        """`RoutedWeights.__call__` for the stacked weights (never split): `[S, N]` in xp's dtype."""
        n_sel = sel.numel()
        s = n_sel * copies
        if not use_triton(xp):
            experts = torch.cat([sel.reshape(-1) + c * e_step for c in range(copies)])
            rows = xp[torch.arange(s, device=xp.device) % xp.shape[0]]
            out = torch.einsum("sk,snk->sn", rows.float(), self.weight[experts].float())
            if self.bias is not None:
                out = out + self.bias[experts].float()
            if weight is not None:
                out = out * weight.reshape(-1).float().repeat(copies)[:, None]
            return out.to(xp.dtype)
        xp = xp if xp.stride(-1) == 1 else xp.contiguous()
        out = torch.empty((s, self.n), dtype=xp.dtype, device=xp.device)
        if s:
            bn = 16
            _routed_dense_kernel[(triton.cdiv(self.n, bn), s)](
                xp, xp.stride(0), xp.shape[0], self.weight, self.bias if self.bias is not None else self.weight,
                out, sel, n_sel, e_step, weight if weight is not None else sel, self.n, self.k,
                HAS_BIAS=self.bias is not None, HAS_WEIGHT=weight is not None, BN=bn, BK=256, num_warps=4)
        return out

    def glu_gather(self, gu: torch.Tensor, sel: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate)·up of each slot (rows s and S + s of gu), in the natural order the down weights read."""
        s = sel.numel()
        return glu(gu[:s, : self.k], gu[s:, : self.k], activation)
