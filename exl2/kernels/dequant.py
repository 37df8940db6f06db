"""The large-M path of `x · W + bias`: a Triton kernel writes W in fp16 and natural row order, then cuBLAS
multiplies. Weights sharing an input (q/k/v, gate/up) are dequantized side by side into one matrix (one launch per
width class when their class layouts agree) and multiplied in one cuBLAS call (`dequant_matmul_group`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels.backend import tl, triton
from exl2.kernels.packed_tiles import code3
from exl2.kernels.qweight import QuantWeight, split_bits


@triton.jit
def _decode_tile(qw_ptr, sc_ptr, zr_ptr, sg_ptr, offs_s, mask_s, first_step, first_word, offs_n, mask_n, N,
                 BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BS: tl.constexpr, BN: tl.constexpr):
    """fp16 [BS, 32, BN] tile of dequantized stored rows, bit-exact with the reference dequantizer."""
    PER: tl.constexpr = 32 // LB
    m2 = mask_s[:, None] & mask_n[None, :]
    m3 = mask_s[:, None, None] & mask_n[None, None, :]
    wrow = first_word + (offs_s - first_step) * BITS
    lo_rows = wrow[:, None] + tl.arange(0, LB)[None, :]
    w = tl.load(qw_ptr + lo_rows[:, :, None].to(tl.int64) * N + offs_n[None, None, :], mask=m3, other=0)
    sh = tl.arange(0, PER) * LB
    code = (w[:, :, None, :] >> sh[None, None, :, None]) & ((1 << LB) - 1)
    code = tl.reshape(code, [BS, 32, BN])
    if BITS == 3:
        w2 = tl.load(qw_ptr + (wrow + 2)[:, None].to(tl.int64) * N + offs_n[None, :], mask=m2, other=0)
        w0, w1 = tl.split(tl.permute(w, (0, 2, 1)))
        code = code3(w0[:, None, :], w1[:, None, :], w2[:, None, :], tl.arange(0, 32)[None, :, None])
    elif HB == 1:
        h = tl.load(qw_ptr + (wrow + LB)[:, None].to(tl.int64) * N + offs_n[None, :], mask=m2, other=0)
        code = code | (((h[:, None, :] >> tl.arange(0, 32)[None, :, None]) & 1) << LB)
    if HB == 2:
        hi_rows = wrow[:, None] + LB + tl.arange(0, 2)[None, :]
        h = tl.load(qw_ptr + hi_rows[:, :, None].to(tl.int64) * N + offs_n[None, None, :], mask=m3, other=0)
        hc = (h[:, :, None, :] >> (2 * tl.arange(0, 16))[None, None, :, None]) & 3
        code = code | (tl.reshape(hc, [BS, 32, BN]) << LB)
    # 0x6400 | code is the fp16 number 1024 + code: exact integer, no int->float conversion needed.
    cf = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    grp = tl.load(sg_ptr + offs_s, mask=mask_s, other=0)
    g_off = grp[:, None].to(tl.int64) * N + offs_n[None, :]
    sc = tl.load(sc_ptr + g_off, mask=m2, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zr_ptr + g_off, mask=m2, other=0.0) + 1024.0
        deq = (cf - z[:, None, :]) * sc[:, None, :]
    else:
        deq = (cf - (1024.0 + (1 << (BITS - 1)))) * sc[:, None, :]
    return deq


@triton.jit
def class_tile(pid_n, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, BITS: tl.constexpr,
               LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr):
    """`_decode_tile` of BS steps (program_id(0)) × BN columns (tile pid_n) of one class, with its step and column
    offsets and masks."""
    offs_s = first_step + tl.program_id(0) * BS + tl.arange(0, BS)
    mask_s = offs_s < first_step + n_steps
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    deq = _decode_tile(qw_ptr, sc_ptr, zr_ptr, sg_ptr, offs_s, mask_s, first_step, first_word, offs_n, mask_n, N,
                       BITS, LB, HB, HAS_ZEROS, BS, BN)
    return deq, offs_s, mask_s, offs_n, mask_n


@triton.jit
def _dequant_tile(pid_n, out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, ri_ptr, N, stride_o, first_step, n_steps,
                  first_word, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  BS: tl.constexpr, BN: tl.constexpr):
    """`class_tile`, stored at its natural rows of out."""
    deq, offs_s, mask_s, offs_n, mask_n = class_tile(pid_n, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps,
                                                     first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)
    ridx = tl.load(ri_ptr + offs_s[:, None] * 32 + tl.arange(0, 32)[None, :], mask=mask_s[:, None], other=-1)
    ptrs = out_ptr + ridx[:, :, None].to(tl.int64) * stride_o + offs_n[None, None, :]
    tl.store(ptrs, deq, mask=(ridx[:, :, None] >= 0) & mask_n[None, None, :])


@triton.jit
def _dequant_kernel(out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, ri_ptr, N, stride_o, first_step, n_steps, first_word,
                    BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BS: tl.constexpr, BN: tl.constexpr):
    _dequant_tile(tl.program_id(1), out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, ri_ptr, N, stride_o, first_step,
                  n_steps, first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)


@triton.jit
def _dequant_group_kernel(out_ptr, stride_o, first_step, n_steps, first_word,
                          qw0, sc0, zr0, sg0, ri0, N0, qw1, sc1, zr1, sg1, ri1, N1, qw2, sc2, zr2, sg2, ri2, N2,
                          T0, T1, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          BS: tl.constexpr, BN: tl.constexpr):
    """`_dequant_kernel` for one class of 2-3 weights with the same class layout, side by side in out (columns
    [0, N0), [N0, N0 + N1), then the third): column tiles [0, T0) are weight 0's, [T0, T0 + T1) weight 1's."""
    pid = tl.program_id(1)
    if pid < T0:
        _dequant_tile(pid, out_ptr, qw0, sc0, zr0, sg0, ri0, N0, stride_o, first_step, n_steps, first_word,
                      BITS, LB, HB, HAS_ZEROS, BS, BN)
    elif pid < T0 + T1:
        _dequant_tile(pid - T0, out_ptr + N0, qw1, sc1, zr1, sg1, ri1, N1, stride_o, first_step, n_steps,
                      first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)
    else:
        _dequant_tile(pid - T0 - T1, out_ptr + N0 + N1, qw2, sc2, zr2, sg2, ri2, N2, stride_o, first_step, n_steps,
                      first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)


def dequantize_triton(w: QuantWeight, bs: int = 4, bn: int = 128, out: torch.Tensor | None = None,
                      num_warps: int = 4) -> torch.Tensor:
    """fp16 `[K, N]` natural-order weight, bit-identical to `qweight.dequantize_torch`; into `out` (a `[K, N]`
    view with unit column stride, e.g. a column slice of a wider matrix) when given."""
    if out is None:
        # Every row is written when the stored rows are a permutation of the input features; clearing the buffer
        # first cost 4.3 ms of a 2,047-token prefill on the H200 (nearly as much as the dequantization itself).
        alloc = torch.empty if w.scatter_index() is not None else torch.zeros
        out = alloc((w.k, w.n), dtype=torch.float16, device=w.device)
    zeros = w.zeros if w.zeros is not None else w.scales
    for c in w.classes:
        lb, hb = split_bits(c.bits)
        grid = (triton.cdiv(c.n_steps, bs), triton.cdiv(w.n, bn))
        _dequant_kernel[grid](out, w.qweight, w.scales, zeros, w.step_group, w.row_index, w.n, out.stride(0),
                              c.first_step, c.n_steps, c.first_word, BITS=c.bits, LB=lb, HB=hb,
                              HAS_ZEROS=w.zeros is not None, BS=bs, BN=bn, num_warps=num_warps)
    return out


def _dequant_group(out: torch.Tensor, ws: Sequence[QuantWeight], bs: int = 4, bn: int = 128,
                   num_warps: int = 4) -> None:
    """`dequantize_triton` of 2-3 weights with the same class layout into `out` `[K, ΣN]` side by side, one
    launch per class (a prefill issues fewer launches: its host work was as long as the GPU's)."""
    members = list(ws) + [ws[-1]] * (3 - len(ws))
    args = []
    for w in members:
        args += [w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, w.step_group, w.row_index, w.n]
    tiles = [triton.cdiv(w.n, bn) for w in ws]
    for c in ws[0].classes:
        lb, hb = split_bits(c.bits)
        grid = (triton.cdiv(c.n_steps, bs), sum(tiles))
        _dequant_group_kernel[grid](out, out.stride(0), c.first_step, c.n_steps, c.first_word, *args, tiles[0],
                                    tiles[1], BITS=c.bits, LB=lb, HB=hb, HAS_ZEROS=ws[0].zeros is not None, BS=bs,
                                    BN=bn, num_warps=num_warps)


def dequant_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Large-M path: dequantize to fp16 with Triton, multiply with cuBLAS."""
    return dequant_matmul_group(x, [w])[0]


def dequant_matmul_group(x: torch.Tensor, ws: Sequence[QuantWeight]) -> list[torch.Tensor]:
    """`dequant_matmul` of weights sharing the input x `[M, K]` (q/k/v, gate/up): dequantized side by side into
    one fp16 matrix and multiplied in one cuBLAS call, so a prefill issues fewer, wider GEMMs (the host's launch
    work was as long as the GPU's). Returns column views `[M, N_i]` of one output."""
    if len({w.k for w in ws}) != 1 or x.shape[-1] != ws[0].k:
        raise ValueError("grouped weights must share the input width of x.")
    full = all(w.scatter_index() is not None for w in ws)
    wd = (torch.empty if full else torch.zeros)((ws[0].k, sum(w.n for w in ws)), dtype=torch.float16,
                                                device=ws[0].device)
    offs = [0]
    for w in ws:
        offs.append(offs[-1] + w.n)
    layouts = {tuple((c.bits, c.first_step, c.n_steps, c.first_word) for c in w.classes) for w in ws}
    if 2 <= len(ws) <= 3 and len(layouts) == 1 and len({w.zeros is None for w in ws}) == 1:
        _dequant_group(wd, ws)  # one launch per class for all of them
    else:
        for w, o in zip(ws, offs):
            dequantize_triton(w, out=wd[:, o:o + w.n])
    y = torch.matmul(x.to(torch.float16), wd) if x.is_cuda else (x.float() @ wd.float())
    return split_outputs(y, ws, x.dtype)


def split_outputs(y: torch.Tensor, ws: Sequence[QuantWeight], dtype: torch.dtype) -> list[torch.Tensor]:
    """The column views of one GEMM's output y `[M, ΣN]`, one a weight, each with its bias added (in y's type),
    in `dtype`."""
    outs, o = [], 0
    for w in ws:
        yi = y[:, o:o + w.n]
        if w.bias is not None:
            yi += w.bias.to(y.dtype)
        outs.append(yi.to(dtype))
        o += w.n
    return outs
