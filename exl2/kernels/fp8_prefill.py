"""Opt-in FP8 prompt matmuls (`EngineConfig.prefill_fp8`): the large-M path in e4m3 instead of fp16.

A 2,047-token prefill is bound by its fp16 GEMMs' sustained throughput (benchmarks/RESULTS.md, session 14); e4m3
tensor cores do twice the work per cycle. Per call, the weight is decoded into e4m3 with one power-of-two scale a
column (from a bound on the column's magnitude by its group scales: no pass over the weight finds it), in its
stored row order and transposed (`[N, S·32]`, the column-major operand cuBLASLt takes); the input is gathered into
the same stored order (`row_index`, padding rows read zero) with one scale a row; `torch._scaled_mm` multiplies
with both scale vectors. The numerics change (e4m3 keeps 3 mantissa bits of each weight and input): a mode users
choose, never the default. Decoding (batches of up to 64 rows) keeps the exact kernels.

`fp8_twin` is the same computation in PyTorch (the reference of the tests).
"""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels.backend import tl, triton
from exl2.kernels.dequant import class_tile, split_outputs
from exl2.kernels.qweight import QuantWeight, split_bits, stored_weight

E4M3_MAX = 448.0


def pow2_scale(top: torch.Tensor) -> torch.Tensor:
    """The least power of two s with top ≤ 448·s (fp32, top > 0): scales by powers of two make the scaling
    exact (on any device, in any order), and e4m3 is as fine in every binade, so the top binade's unused part
    costs no precision. Twin of `_pow2_scale`."""
    mant, exp = torch.frexp(top)  # top = mant · 2^exp, mant in [0.5, 1)
    k = exp - 1 - 8 + (2 * mant > 1.75).to(exp.dtype)  # 448 = 1.75 · 2^8
    return torch.ldexp(torch.ones_like(top), k)


def column_scales(w: QuantWeight) -> torch.Tensor:
    """fp32 `[N]`: each column's dequantization scale (`pow2_scale` of a bound on |W[:, n]|: every group's scale
    times the largest |code − zero| its width allows). Cached on the weight."""
    cs = w._cache.get("fp8_scale")
    if cs is None:
        bound = torch.zeros(w.n, dtype=torch.float32, device=w.device)
        for c in w.classes:
            groups = w.step_group[c.first_step:c.first_step + c.n_steps].long().unique()
            sc = w.scales.index_select(0, groups).float().abs()
            if w.zeros is None:
                dev = sc * float(1 << (c.bits - 1))
            else:
                z = w.zeros.index_select(0, groups).float()
                dev = sc * torch.maximum(z.abs(), (float((1 << c.bits) - 1) - z).abs())
            bound = torch.maximum(bound, dev.amax(0))
        bound = bound * (1 + 2 ** -10)  # the fp16 product may round up past the exact one
        cs = w._cache["fp8_scale"] = pow2_scale(torch.where(bound > 0, bound, 1.0))
    return cs


def _inverse_scales(w: QuantWeight) -> torch.Tensor:
    """1 / `column_scales` (what the weight is multiplied by before its e4m3 rounding), cached."""
    inv = w._cache.get("fp8_inv")
    if inv is None:
        inv = w._cache["fp8_inv"] = (1.0 / column_scales(w)).contiguous()
    return inv


@triton.jit
def _e4m3(v):
    """v (fp32, |v| ≤ 448) as e4m3, rounded to nearest, ties to even, in fp32 arithmetic first: the conversion
    then only sees representable values (Triton's CPU interpreter rounds some ties and carries wrongly)."""
    b = v.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # subnormals: multiples of 2^-9
    return tl.where(tl.abs(v) < 0.015625, sub, normal).to(tl.float8e4nv)


@triton.jit
def _pow2_scale(top):
    """`pow2_scale` of a positive fp32 scalar, from its bits: (s, 1 / s)."""
    b = top.to(tl.int32, bitcast=True)
    k = ((b >> 23) & 0xFF) - 127 - 8 + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(pid_n, out_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, inv_ptr, N, stride_o, first_step, n_steps,
                 first_word, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BS: tl.constexpr, BN: tl.constexpr):
    """`class_tile` into out `[N, S·32]` (stored row order, transposed): e4m3 of the fp16 weight times the
    column's inverse scale."""
    deq, offs_s, mask_s, offs_n, mask_n = class_tile(pid_n, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps,
                                                     first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)
    inv = tl.load(inv_ptr + offs_n, mask=mask_n, other=0.0)
    v = tl.clamp(deq.to(tl.float32) * inv[None, None, :], -448.0, 448.0)
    rows = offs_s[:, None] * 32 + tl.arange(0, 32)[None, :]
    ptrs = out_ptr + offs_n[None, None, :].to(tl.int64) * stride_o + rows[:, :, None]
    tl.store(ptrs, _e4m3(v), mask=mask_s[:, None, None] & mask_n[None, None, :])


@triton.jit
def _weight_kernel(out_ptr, stride_o, first_step, n_steps, first_word,
                   qw0, sc0, zr0, sg0, inv0, N0, qw1, sc1, zr1, sg1, inv1, N1, qw2, sc2, zr2, sg2, inv2, N2,
                   T0, T1, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   BS: tl.constexpr, BN: tl.constexpr):
    """`_weight_tile` of one class of 1-3 weights with one class layout, stacked in out (rows [0, N0), then
    [N0, N0 + N1), then the third): column tiles [0, T0) are weight 0's, [T0, T0 + T1) weight 1's."""
    pid = tl.program_id(1)
    if pid < T0:
        _weight_tile(pid, out_ptr, qw0, sc0, zr0, sg0, inv0, N0, stride_o, first_step, n_steps, first_word,
                     BITS, LB, HB, HAS_ZEROS, BS, BN)
    elif pid < T0 + T1:
        _weight_tile(pid - T0, out_ptr + N0.to(tl.int64) * stride_o, qw1, sc1, zr1, sg1, inv1, N1, stride_o,
                     first_step, n_steps, first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)
    else:
        _weight_tile(pid - T0 - T1, out_ptr + (N0 + N1).to(tl.int64) * stride_o, qw2, sc2, zr2, sg2, inv2, N2,
                     stride_o, first_step, n_steps, first_word, BITS, LB, HB, HAS_ZEROS, BS, BN)


@triton.jit
def _input_kernel(x_ptr, stride_x, ri_ptr, out_ptr, scale_ptr, K, KS, BK: tl.constexpr):
    """One row of x as e4m3 over its scale (`pow2_scale` of its amax), gathered into stored order (`row_index`,
    −1 reads zero), and that scale. The row is read once, in order; the permutation is a gather from on-chip memory
    (`tl.gather`): gathering from global memory took 106 µs a call for 2,047 rows of 4,096 on the H100, 28 % of
    an FP8 prefill."""
    row = tl.program_id(0)
    offs = tl.arange(0, BK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < K, other=0.0)
    if x_ptr.dtype.element_ty != tl.float16:  # bf16 (past fp16's range) and fp32 are gathered as fp32
        x = x.to(tl.float32)
    scale, inv = _pow2_scale(tl.maximum(tl.max(tl.abs(x.to(tl.float32)), axis=0), 1e-12))
    tl.store(scale_ptr + row, scale)
    ri = tl.load(ri_ptr + offs, mask=offs < KS, other=-1)
    v = tl.gather(x, tl.maximum(ri, 0), 0).to(tl.float32)
    q = tl.clamp(tl.where(ri >= 0, v, 0.0) * inv, -448.0, 448.0)
    tl.store(out_ptr + row.to(tl.int64) * KS + offs, _e4m3(q), mask=offs < KS)


def fp8_weight(ws: Sequence[QuantWeight], bs: int = 4, bn: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[ΣN, S·32]`, fp32 `[ΣN]` column scales) of 1-3 weights with one class layout, stacked."""
    members = list(ws) + [ws[-1]] * (3 - len(ws))
    out = torch.empty((sum(w.n for w in ws), ws[0].n_steps * 32), dtype=torch.float8_e4m3fn, device=ws[0].device)
    args = []
    for w in members:
        args += [w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, w.step_group,
                 _inverse_scales(w), w.n]
    tiles = [triton.cdiv(w.n, bn) for w in ws] + [0, 0]
    for c in ws[0].classes:
        lb, hb = split_bits(c.bits)
        grid = (triton.cdiv(c.n_steps, bs), sum(tiles))
        _weight_kernel[grid](out, out.stride(0), c.first_step, c.n_steps, c.first_word, *args, tiles[0], tiles[1],
                             BITS=c.bits, LB=lb, HB=hb, HAS_ZEROS=ws[0].zeros is not None, BS=bs, BN=bn,
                             num_warps=4)
    key = ("fp8_scales",) + tuple(map(id, ws))
    if key not in ws[0]._cache:
        ws[0]._cache[key] = torch.cat([column_scales(w) for w in ws])
    return out, ws[0]._cache[key]


def fp8_input(x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, S·32]` of x `[M, K]` (fp16, bf16 or fp32) in w's stored row order, fp32 `[M]` row scales)."""
    m, ks = x.shape[0], w.row_index.numel()
    out = torch.empty((m, ks), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        bk = triton.next_power_of_2(max(w.k, ks))
        _input_kernel[(m,)](x, x.stride(0), w.row_index, out, scale, w.k, ks, BK=bk,
                            num_warps=min(16, max(4, bk // 1024)))
    return out, scale


_OUT_DTYPE: dict[torch.device, torch.dtype | None] = {}


def _out_dtype(device: torch.device) -> torch.dtype | None:
    """The output type this device's row-scaled e4m3 GEMM takes (fp16, else bf16, converted after), or None where
    it has none (before sm_89, or a PyTorch without it); probed once."""
    if device not in _OUT_DTYPE:
        _OUT_DTYPE[device] = None
        cuda = device.type == "cuda" and hasattr(torch, "_scaled_mm")
        if cuda and torch.cuda.get_device_capability(device) >= (8, 9):
            a = torch.ones((16, 32), device=device).to(torch.float8_e4m3fn)
            b = torch.ones((16, 32), device=device).to(torch.float8_e4m3fn)
            for dt in (torch.float16, torch.bfloat16):
                try:
                    y = torch._scaled_mm(a, b.t(), scale_a=torch.ones((16, 1), device=device),
                                         scale_b=torch.ones((1, 16), device=device), out_dtype=dt)
                    if bool((y == 32).all()):
                        _OUT_DTYPE[device] = dt
                        break
                except (RuntimeError, TypeError):
                    continue
    return _OUT_DTYPE[device]


def fp8_available(device: torch.device | str) -> bool:
    """Whether `fp8_matmul_group` runs on this device (CUDA, sm_89 or newer, a PyTorch with row-scaled e4m3)."""
    return _out_dtype(torch.device(device)) is not None


def fp8_applies(x: torch.Tensor, ws: Sequence[QuantWeight]) -> bool:
    """Whether the weights take the FP8 path for this input: all opted in (`prefill_fp8`), one class layout and
    one stored input order, outputs a multiple of 16 wide, a device that has it."""
    return (x.is_cuda and all(w.prefill_fp8 for w in ws) and len(ws) <= 3 and all(w.n % 16 == 0 for w in ws)
            and len({w.zeros is None for w in ws}) == 1 and _one_layout(ws) and fp8_available(x.device))


def _one_layout(ws: Sequence[QuantWeight]) -> bool:
    """Whether the weights share their class layout and stored input order, so one e4m3 input serves them all.
    Cached: comparing the orders reads a result back from the GPU, which must not happen every prompt."""
    key = ("fp8_layout",) + tuple(map(id, ws))
    same = ws[0]._cache.get(key)
    if same is None:
        w0 = ws[0]
        same = ws[0]._cache[key] = all(
            w.classes == w0.classes and (w.row_index is w0.row_index or torch.equal(w.row_index, w0.row_index))
            for w in ws[1:])
    return same


def fp8_matmul_group(x: torch.Tensor, ws: Sequence[QuantWeight]) -> list[torch.Tensor]:
    """`x · W_i + bias_i` for x `[M, K]` through one e4m3 GEMM (`fp8_applies` must hold): column views of one
    output, in x's dtype."""
    xq, xs = fp8_input(x, ws[0])
    wq, cs = fp8_weight(ws)
    dt = _out_dtype(x.device)
    # cuBLASLt's fast accumulation (use_fast_accum) ran this prefill at 29.5 k tok/s against 48.6 k without
    # (H100, benchmarks/RESULTS.md session 26): left off.
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=cs[None, :], out_dtype=dt)
    return split_outputs(y.to(x.dtype), ws, x.dtype)


def fp8_twin(x: torch.Tensor, ws: Sequence[QuantWeight]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """`fp8_matmul_group` in PyTorch (fp32 products of the e4m3 values), and its operands (`xq`, `xs`, `wq`, `cs`:
    what `fp8_input` and `fp8_weight` must write)."""
    ri = ws[0].row_index.long()
    xg = torch.where(ri >= 0, x.index_select(1, ri.clamp(min=0)).float(), 0.0)
    xs = pow2_scale(xg.abs().amax(1).clamp(min=1e-12))
    xq = (xg * (1.0 / xs)[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    wq = torch.cat([(stored_weight(w).float() * _inverse_scales(w)[None, :]).clamp(-E4M3_MAX, E4M3_MAX)
                    .to(torch.float8_e4m3fn).t() for w in ws])
    cs = torch.cat([column_scales(w) for w in ws])
    y = (xq.float() * xs[:, None]) @ (wq.float().t() * cs[None, :])
    return split_outputs(y.to(x.dtype), ws, x.dtype), {"xq": xq, "xs": xs, "wq": wq, "cs": cs}
