"""Stream-K gemv: the small-batch quantized matmul of 1–3 weights that share an input, with every SM given an
equal share of the weight words whatever the shapes.

A fixed-split gemv leaves SMs idle or runs short-lived programs: gate/up of Llama-3-8B is 112 column tiles on
132 SMs, and more K splits made each program too short to keep its loads in flight (benchmarks/RESULTS.md, run 8).
Here the packed words of all the weights, tile by tile (a tile = BN columns × all of K), form one line of work
units (one unit = one int32 row of a tile); program p takes units [p·U, (p+1)·U). A program walks its range
segment by segment (a segment = its part of one tile), runs the per-width decoders of `quant_matmul` over the
steps whose first word lies in the segment, and either writes the tile (it covered it alone) or stores a partial
sum in the tile's slot for it; the last program to arrive at a tile (a per-tile counter) adds the slots in order,
adds the bias and writes the fp16 output. The sum order is fixed, so results are deterministic.

Opt-in (`EXL2_GEMV_STREAM=1`): on the H200 it lost to the fixed-split kernels on every Llama-3-8B shape, since
each segment refills the pipeline and balance was not the limit (benchmarks/RESULTS.md, session 4, run 11).
"""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels.backend import COUNTER_POOL, counters, pdl_args, pdl_sync, sm_count, tl, triton
from exl2.kernels.quant_matmul import _class_args, _gemv_widths, _pairs_view, buffer_offsets, input_layout, width_mask
from exl2.kernels.qweight import QuantWeight


@triton.jit
def _seg(o, e, fs, ns, fw, BITS: tl.constexpr):
    """(first step, steps, first word) of the steps of one width class whose first word lies in [o, e)."""
    a = tl.minimum((tl.maximum(o - fw, 0) + BITS - 1) // BITS, ns)
    b = tl.minimum((tl.maximum(e - fw, 0) + BITS - 1) // BITS, ns)
    return fs + a, b - a, fw + a * BITS


@triton.jit
def _segment(x_ptr, x32_ptr, stride_xm, meta, part_ptr, cnt_ptr, pid, pid_m, g, hi, U, TOTAL_TILES, MAXC,
             out_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, WIDTH_MASK: tl.constexpr, HAS_ZEROS: tl.constexpr,
             HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, FAST4: tl.constexpr,
             STAGES: tl.constexpr):
    """Process the segment of this program that starts at unit g (inside the weight of metadata row `meta`);
    return the unit after it."""
    N = tl.multiple_of(tl.load(meta + 18), 16)
    W = tl.load(meta + 20)
    base = tl.load(meta + 21)
    t = (g - base) // W
    t0 = base + t * W
    o = g - t0
    e = tl.minimum(hi, t0 + W) - t0
    xoff = tl.multiple_of(tl.load(meta + 23), 32)
    xr = x_ptr + pid_m.to(tl.int64) * stride_xm + xoff
    x32r = x32_ptr + pid_m.to(tl.int64) * (stride_xm // 2) + xoff // 2
    offs_n = t * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    fs8, ns8, fw8 = _seg(o, e, tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2), 8)
    fs6, ns6, fw6 = _seg(o, e, tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5), 6)
    fs5, ns5, fw5 = _seg(o, e, tl.load(meta + 6), tl.load(meta + 7), tl.load(meta + 8), 5)
    fs4, ns4, fw4 = _seg(o, e, tl.load(meta + 9), tl.load(meta + 10), tl.load(meta + 11), 4)
    fs3, ns3, fw3 = _seg(o, e, tl.load(meta + 12), tl.load(meta + 13), tl.load(meta + 14), 3)
    fs2, ns2, fw2 = _seg(o, e, tl.load(meta + 15), tl.load(meta + 16), tl.load(meta + 17), 2)
    res = _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5,
                       fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2, 0, 1, offs_n, mask_n,
                       WIDTH_MASK, True, HAS_ZEROS, BS, BN, FAST4, 0, STAGES)
    first = t0 // U
    n_contrib = (t0 + W - 1) // U - first + 1
    o_ptrs = out_ptr + pid_m.to(tl.int64) * N + offs_n
    if n_contrib == 1:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tile = pid_m * TOTAL_TILES + tl.load(meta + 22) + t
        slots = part_ptr + (tile.to(tl.int64) * MAXC) * BN + tl.arange(0, BN)
        tl.store(slots + (pid - first) * BN, res)
        tl.debug_barrier()
        count = tl.atomic_add(cnt_ptr + tile, 1)
        if count == n_contrib - 1:
            tot = tl.zeros([BN], dtype=tl.float32)
            for j in range(0, n_contrib):
                tot += tl.load(slots + j * BN, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(cnt_ptr + tile, 0)
    return t0 + e


@triton.jit
def _stream_kernel(x_ptr, x32_ptr, stride_xm, meta_ptr, part_ptr, cnt_ptr, U, TOTAL_U, TOTAL_TILES, MAXC,
                   out0, bias0, qw0, sc0, zr0, sg0, out1, bias1, qw1, sc1, zr1, sg1,
                   out2, bias2, qw2, sc2, zr2, sg2, G: tl.constexpr, WIDTH_MASK: tl.constexpr,
                   HAS_ZEROS: tl.constexpr,
                   B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                   FAST4: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (programs, 1, input rows): program p covers work units [p·U, (p+1)·U) of every input row."""
    if PDL:
        pdl_sync()
    pid = tl.program_id(0)
    pid_m = tl.program_id(2)
    g = pid * U
    hi = tl.minimum(g + U, TOTAL_U)
    while g < hi:
        if G > 2 and g >= tl.load(meta_ptr + 2 * 24 + 21):
            g = _segment(x_ptr, x32_ptr, stride_xm, meta_ptr + 2 * 24, part_ptr, cnt_ptr, pid, pid_m, g, hi, U,
                         TOTAL_TILES, MAXC, out2, bias2, qw2, sc2, zr2, sg2, WIDTH_MASK, HAS_ZEROS, B2, BS, BN,
                         FAST4, STAGES)
        elif G > 1 and g >= tl.load(meta_ptr + 24 + 21):
            g = _segment(x_ptr, x32_ptr, stride_xm, meta_ptr + 24, part_ptr, cnt_ptr, pid, pid_m, g, hi, U,
                         TOTAL_TILES, MAXC, out1, bias1, qw1, sc1, zr1, sg1, WIDTH_MASK, HAS_ZEROS, B1, BS, BN,
                         FAST4, STAGES)
        else:
            g = _segment(x_ptr, x32_ptr, stride_xm, meta_ptr, part_ptr, cnt_ptr, pid, pid_m, g, hi, U,
                         TOTAL_TILES, MAXC, out0, bias0, qw0, sc0, zr0, sg0, WIDTH_MASK, HAS_ZEROS, B0, BS, BN,
                         FAST4, STAGES)


class StreamGemv:
    """Launch plan of `_stream_kernel` for 1–3 weights sharing an input (permuted as `gather_input` makes it).

    Metadata row per weight (24 int32): (first step, steps, first word) of the 8/6/5/4/3/2-bit classes, N, column
    tiles, words per tile (qweight rows), first work unit, first tile (over all weights), offset of its permuted
    input."""

    MAX = 3

    def __init__(self, ws: Sequence[QuantWeight], programs_per_sm: int = 2, bs: int = 8, bn: int = 128,
                 stages: int = 3):
        if not self.accepts(ws):
            raise ValueError("a stream gemv needs 1-3 weights with the same input size and zero-point kind and "
                             "outputs a multiple of 16 wide.")
        self.ws = list(ws)
        self.programs_per_sm, self.bs, self.bn, self.stages = programs_per_sm, bs, bn, stages
        self._plan: tuple | None = None
        self.width_mask = width_mask(self.ws)  # only these widths' decoders are compiled

    @classmethod
    def accepts(cls, ws: Sequence[QuantWeight]) -> bool:
        return (0 < len(ws) <= cls.MAX and len({w.k for w in ws}) == 1 and len({w.zeros is None for w in ws}) == 1
                and all(w.n % 16 == 0 for w in ws))

    def plan(self, device: torch.device) -> tuple[torch.Tensor, int, int, int, int, int]:
        """(metadata, programs, units per program, total units, total tiles, slots per tile), cached."""
        if self._plan is not None:
            return self._plan
        rows, unit, tile = [], 0, 0
        for w, xoff in zip(self.ws, input_layout(self.ws)[1]):
            cls, _ = _class_args(w)
            tiles = triton.cdiv(w.n, self.bn)
            words = w.qweight.shape[0]
            rows.append(cls + [w.n, tiles, words, unit, tile, xoff])
            unit += tiles * words
            tile += tiles
        programs = max(1, min(self.programs_per_sm * sm_count(device), unit))
        per = triton.cdiv(unit, programs)
        programs = triton.cdiv(unit, per)
        maxc = max(triton.cdiv(w.qweight.shape[0], per) + 1 for w in self.ws)
        meta = torch.tensor(rows, dtype=torch.int32, device=device).contiguous()
        self._plan = (meta, programs, per, unit, tile, maxc)
        return self._plan

    def __call__(self, xp: torch.Tensor, fast4: bool | None = None) -> list[torch.Tensor]:
        """Outputs `[M, N_i]` for permuted inputs `xp` `[M, total]` laid out by `input_layout` (the buffer
        `gather_input(whole=True)` returns, or one weight's permuted input)."""
        buffer_offsets(xp, self.ws)
        m = xp.shape[0]
        outs = [torch.empty((m, w.n), dtype=xp.dtype, device=xp.device) for w in self.ws]
        if m == 0:
            return outs
        meta, programs, per, unit, tiles, maxc = self.plan(xp.device)
        if m * tiles > COUNTER_POOL:
            raise ValueError("too many output tiles for the split-K counters.")
        fast4, x32 = _pairs_view(xp, fast4)
        part = torch.empty(m * tiles * maxc * self.bn, dtype=torch.float32, device=xp.device)
        args = []
        for i in range(self.MAX):
            j = min(i, len(self.ws) - 1)
            w = self.ws[j]
            args += [outs[j], w.bias if w.bias is not None else w.scales, w.qweight, w.scales,
                     w.zeros if w.zeros is not None else w.scales, w.step_group]
        has_bias = [w.bias is not None for w in self.ws] + [False] * (self.MAX - len(self.ws))
        _stream_kernel[(programs, 1, m)](
            xp, x32, xp.stride(0), meta, part, counters(xp.device), per, unit, tiles, maxc, *args,
            G=len(self.ws), WIDTH_MASK=self.width_mask, HAS_ZEROS=self.ws[0].zeros is not None, B0=has_bias[0],
            B1=has_bias[1], B2=has_bias[2], BS=self.bs, BN=self.bn, FAST4=fast4, STAGES=self.stages, num_warps=4,
            num_stages=self.stages, **pdl_args(xp.device, m))
        return outs
