"""The gate/up gemv with the GLU in its epilogue: one launch computes a column tile of gate and the same tile of
up, applies `act(gate) * up` and stores the result where the down projection's permuted input wants each column
(`QuantWeight.scatter_index` of down). At batch 1 it replaces the grouped gate/up gemv and the gathering GLU
kernel (`activation.glu(index=...)`), one kernel boundary a layer fewer. Gate and up keep their own width
classes; each program runs the two gemvs one after the other over BN columns (32: as many programs as the grouped
gemv's 64-column tiles of the two matrices). Bit-identical to the two launches it replaces: the same per-column
sums, each rounded to the output dtype before the activation, as the GLU kernel reads them.
"""
from __future__ import annotations

import torch

from exl2.kernels.activation import ACTIVATIONS, act_tl
from exl2.kernels.backend import PREFETCH_ROWS, env_choice, pdl_args, pdl_sync, tl, triton
from exl2.kernels.gemv import GEMV_STAGES, _gemv_widths, _prefetch_widths, fast4_available
from exl2.kernels.matmul_launch import class_args, pairs_view, width_mask
from exl2.kernels.permute import buffer_offsets, input_layout
from exl2.kernels.qweight import QuantWeight

# Columns per program (EXL2_GLU_BN): 32 gives the fused launch as many programs as the grouped gemv's 64-column
# tiles of gate and up together (the H200 sweeps found 32- and 64-column gemv tiles equally fast, session 11).
GLU_BN = env_choice("EXL2_GLU_BN", 32, (16, 32, 64))
# Whether batch-1..4 MLPs take the fused launch (EXL2_GLU_GEMV; 0 keeps the grouped gemv + GLU kernel).
GLU_GEMV = env_choice("EXL2_GLU_GEMV", 1, range(0, 2)) == 1


@triton.jit
def _member_sum(xr, x32r, meta, qw_ptr, sc_ptr, zr_ptr, sg_ptr, offs_n, mask_n, MASK: tl.constexpr,
                HAS_ZEROS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, FAST4: tl.constexpr,
                STAGES: tl.constexpr):
    """The unsplit gemv of the matrix whose metadata row is `meta` over the columns `offs_n`: [BN] fp32."""
    N = tl.multiple_of(tl.load(meta + 18), 16)
    xoff = tl.multiple_of(tl.load(meta + 23), 32)
    return _gemv_widths(xr + xoff, x32r + xoff // 2, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, tl.load(meta + 0),
                        tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3), tl.load(meta + 4),
                        tl.load(meta + 5), tl.load(meta + 6), tl.load(meta + 7), tl.load(meta + 8),
                        tl.load(meta + 9), tl.load(meta + 10), tl.load(meta + 11), tl.load(meta + 12),
                        tl.load(meta + 13), tl.load(meta + 14), tl.load(meta + 15), tl.load(meta + 16),
                        tl.load(meta + 17), 0, 1, offs_n, mask_n, MASK, True, HAS_ZEROS, BS, BN, FAST4, STAGES)


@triton.jit
def _member_prefetch(meta, qw_ptr, col0, MASK: tl.constexpr, BN: tl.constexpr, PREFETCH: tl.constexpr):
    N = tl.load(meta + 18)
    _prefetch_widths(qw_ptr, N, tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3),
                     tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6), tl.load(meta + 7), tl.load(meta + 8),
                     tl.load(meta + 9), tl.load(meta + 10), tl.load(meta + 11), tl.load(meta + 12),
                     tl.load(meta + 13), tl.load(meta + 14), tl.load(meta + 15), tl.load(meta + 16),
                     tl.load(meta + 17), 0, 1, col0, MASK, BN, PREFETCH)


@triton.jit
def _gemv_glu_kernel(x_ptr, x32_ptr, stride_xm, meta_ptr, out_ptr, stride_om, pos_ptr, N,
                     qw0, sc0, zr0, sg0, qw1, sc1, zr1, sg1, ACT: tl.constexpr, MASK: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, FAST4: tl.constexpr,
                     STAGES: tl.constexpr = 2, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    """Program (column tile, -, input row): gate and up over BN columns, then act(gate)·up stored at the columns'
    positions `pos` in the next matmul's permuted input. The positions, metadata and weights are not written by
    the previous kernel: read (and PREFETCH word rows prefetched) before the PDL wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    pos = tl.load(pos_ptr + offs_n, mask=mask_n, other=0)
    if PDL:
        if PREFETCH > 0:
            _member_prefetch(meta_ptr, qw0, pid_n * BN, MASK, BN, PREFETCH)
            _member_prefetch(meta_ptr + 25, qw1, pid_n * BN, MASK, BN, PREFETCH)
        pdl_sync()
    xr = x_ptr + pid_m.to(tl.int64) * stride_xm
    x32r = x32_ptr + pid_m.to(tl.int64) * (stride_xm // 2)
    g = _member_sum(xr, x32r, meta_ptr, qw0, sc0, zr0, sg0, offs_n, mask_n, MASK, HAS_ZEROS, BS, BN, FAST4, STAGES)
    u = _member_sum(xr, x32r, meta_ptr + 25, qw1, sc1, zr1, sg1, offs_n, mask_n, MASK, HAS_ZEROS, BS, BN, FAST4,
                    STAGES)
    dt = out_ptr.dtype.element_ty
    y = act_tl(g.to(dt).to(tl.float32), ACT) * u.to(dt).to(tl.float32)
    tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + pos, y.to(dt), mask=mask_n)


class GemvGlu:
    """Launch plan of `_gemv_glu_kernel` for a gate and an up weight (EXL2 or GPTQ, no bias, same input and N)
    feeding a down weight whose permuted input is a permutation of their N columns (`accepts`). Metadata: per
    matrix the 25-int row of `gemv.GemvGroup` (its class table, N and the offset of its permuted input; the
    split fields are unused)."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight, activation: str,
                 bn: int | None = None, bs: int = 8, stages: int | None = None, num_warps: int = 4):
        if not self.accepts(gate, up, down):
            raise ValueError("a fused gate/up GLU gemv needs bias-free gate and up of one input and width whose "
                             "columns the down weight's input order permutes.")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}.")
        self.ws = [gate, up]
        self.act = ACTIVATIONS.index(activation)
        self.pos = down.scatter_index()
        self.BN = GLU_BN if bn is None else bn
        self.BS, self.num_warps = bs, num_warps
        self.stages = GEMV_STAGES if stages is None else stages
        self.mask = width_mask(self.ws)
        self._meta: torch.Tensor | None = None

    @staticmethod
    def accepts(gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> bool:
        return (gate.k == up.k and gate.n == up.n == down.k and gate.bias is None and up.bias is None
                and (gate.zeros is None) == (up.zeros is None) and gate.n % 16 == 0
                and down.scatter_index() is not None)

    def meta(self, device: torch.device) -> torch.Tensor:
        if self._meta is None:
            rows = []
            for w, xoff in zip(self.ws, input_layout(self.ws)[1]):
                rows.append(class_args(w)[0] + [w.n, 0, 1, 0, 0, xoff, 0])
            self._meta = torch.tensor(rows, dtype=torch.int32, device=device).contiguous()
        return self._meta

    def __call__(self, xp: torch.Tensor, fast4: bool | int | None = None) -> torch.Tensor:
        """The down projection's permuted input `[M, N]` from gate/up's permuted inputs `xp` `[M, total]` (laid
        out by `input_layout`, as `GemvGroup` takes them)."""
        buffer_offsets(xp, self.ws)
        m, n = xp.shape[0], self.ws[0].n
        out = torch.empty((m, n), dtype=xp.dtype, device=xp.device)
        if m == 0:
            return out
        fast4, x32 = pairs_view(xp, fast4_available(xp.device) if fast4 is None else fast4)
        g, u = self.ws
        _gemv_glu_kernel[(triton.cdiv(n, self.BN), 1, m)](
            xp, x32, xp.stride(0), self.meta(xp.device), out, out.stride(0), self.pos, n,
            g.qweight, g.scales, g.zeros if g.zeros is not None else g.scales, g.step_group,
            u.qweight, u.scales, u.zeros if u.zeros is not None else u.scales, u.step_group,
            ACT=self.act, MASK=self.mask, HAS_ZEROS=g.zeros is not None, BS=self.BS, BN=self.BN, FAST4=fast4,
            STAGES=self.stages, num_warps=self.num_warps, num_stages=self.stages,
            **pdl_args(xp.device, m, prefetch=PREFETCH_ROWS))
        return out
