"""What the small-batch quantized matmul kernels (`gemv`, `dot`) share: launch parameters, a weight's width-class
table, the K split, and the tile store.

Split-K partial sums go to an fp32 workspace; the last program of each output tile (counted with an atomic on a
per-device counter pool that every program resets) adds them up, adds the bias and writes the output, so a call
is one launch (CUDA-graph friendly). Counters are shared per device: calls on one stream never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from exl2.kernels.backend import COUNTER_POOL, counters, env_choice, next_pow2, pdl_args, sm_count, tl, triton
from exl2.kernels.qweight import WIDTHS, QuantWeight
from exl2.kernels.split_sum import SplitSum


@triton.jit
def store_tile(res, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, cnt_ptr, bias_ptr, tile_id, pid_k, SPLIT,
               HAS_BIAS: tl.constexpr, SPLIT_ON: tl.constexpr, RED: tl.constexpr, PART_ONLY: tl.constexpr = False):
    """Write the tile, or (split K) its partial; the last program of the tile sums the partials, RED at a time
    (independent loads, so the sum costs one memory latency per RED partials, not one per partial). PART_ONLY
    (no bias): only the partial, for a consumer that sums them (`SplitSum`)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if not SPLIT_ON:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        p_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + p_off, res, mask=mask)
        if not PART_ONLY:
            tl.debug_barrier()
            count = tl.atomic_add(cnt_ptr + tile_id, 1)
            if count == SPLIT - 1:
                tot = tl.zeros_like(res)
                offs_r = tl.arange(0, RED)
                for i in range(0, SPLIT, RED):
                    kk = i + offs_r
                    ptrs = part_ptr + (kk.to(tl.int64) * M * N)[:, None, None] + p_off[None, :, :]
                    chunk = tl.load(ptrs, mask=(kk < SPLIT)[:, None, None] & mask[None, :, :], other=0.0,
                                    cache_modifier=".cg")
                    tot += tl.sum(chunk, axis=0)
                if HAS_BIAS:
                    tot += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
                tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)


@dataclass(frozen=True)
class MatmulConfig:
    """Launch parameters of the gemv/dot kernels."""

    bm: int = 1
    bs: int = 8
    bn: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 2


def class_args(w: QuantWeight) -> tuple[list[int], dict[str, bool]]:
    """(first step, steps, first word) per width and the kernels' HAS flags. A matrix of one width gets a kernel
    for that width alone; every mixed matrix shares the one kernel with all widths (an absent width has 0 steps,
    so its loop is empty): real EXL2 models mix widths in many combinations, and compiling a kernel per
    combination took minutes on first use, and compiling a mixed matrix for its own widths alone (59 -> 31 KB of
    code for 5/4/3 bits) did not decode faster (H100, benchmarks/RESULTS.md session 33)."""
    cached = w._cache.get("class_args")
    if cached is None:
        args, flags = [], {}
        every = len(w.classes) > 1
        for bits in WIDTHS:
            c = w.class_of(bits)
            args += [c.first_step, c.n_steps, c.first_word] if c else [0, 0, 0]
            flags[f"HAS{bits}"] = every or c is not None
        cached = w._cache["class_args"] = (args, flags)
    return cached


def mixed_widths(mask: int) -> bool:
    """Whether a width mask (`width_mask`, or the Gluon kernels' `class_steps` order) holds more than one width."""
    return mask & (mask - 1) != 0


def width_mask(ws: Sequence[QuantWeight]) -> int:
    """The widths present in any of `ws` as a bit mask (8-bit = 32 … 2-bit = 1): kernels with runtime class tables
    compile the decoders of these widths only."""
    return sum(1 << (len(WIDTHS) - 1 - i) for i, b in enumerate(WIDTHS) if any(w.class_of(b) for w in ws))


def auto_split(w: QuantWeight, programs: int, device: torch.device, min_steps: int, per_sm: int = 2) -> int:
    """Largest power-of-two split of K with at most ~`per_sm` programs per SM and at least `min_steps` 32-row
    steps per program: the H200 sweeps (benchmarks/RESULTS.md) found every shape fastest there, since more splits
    add partial sums and short-lived programs, fewer leave SMs idle (2 per SM for the 64-column gemv, 1 for the
    128-column one)."""
    target = per_sm * sm_count(device)
    split = 1
    while split < 32 and programs * split * 2 <= target and w.n_steps // (split * 2) >= min_steps:
        split *= 2
    return split


# The kernels' FAST4 mask: the bit of each width whose packed decoder (inline PTX) they may use.
PACKED_FLAG = {4: 1, 6: 2, 5: 4, 3: 8, 2: 16, 8: 32}


def pairs_view(xp: torch.Tensor, fast4: bool | int) -> tuple[int, torch.Tensor]:
    """Which packed decoders run on xp, as the kernels' FAST4 mask (`PACKED_FLAG`; True: all of them; they need
    fp16 input with an even row stride), and the int32 view of xp they read."""
    mask = sum(PACKED_FLAG.values()) if fast4 is True else int(fast4 or 0)
    if xp.dtype != torch.float16 or xp.stride(0) % 2:
        mask = 0
    return mask, (xp.view(torch.int32) if mask else xp)


def launch(kernel, xp: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, fast4: bool | int, rows: int = 1,
           part_only: bool = False, prefetch: int | None = None, **extra) -> torch.Tensor | SplitSum:
    """Run a gemv/dot kernel (their shared signature) on the permuted input xp `[M, S·32]` (last dim contiguous),
    `rows` input rows a program, `fast4` the packed decoders to use (`pairs_view`). `part_only` (kernels with
    PART_ONLY, no bias): where K is split, return the partial sums as a `SplitSum` instead of adding them.
    `prefetch`: L2-prefetched word rows before a PDL wait (kernels with PREFETCH)."""
    m = xp.shape[0]
    grid_n, grid_m = triton.cdiv(w.n, cfg.bn), triton.cdiv(m, rows)
    split = cfg.split if grid_n * grid_m <= COUNTER_POOL else 1
    part_only = part_only and split > 1 and w.bias is None and m > 0
    if part_only:
        extra["PART_ONLY"] = True
        part = out = torch.empty((split, m, w.n), dtype=torch.float32, device=xp.device)
    else:
        out = torch.empty((m, w.n), dtype=xp.dtype, device=xp.device)
        if m == 0:
            return out
        part = torch.empty((split, m, w.n), dtype=torch.float32, device=xp.device) if split > 1 else out
    cls, flags = class_args(w)
    zeros = w.zeros if w.zeros is not None else w.scales
    bias = w.bias if w.bias is not None else w.scales
    fast4, x32 = pairs_view(xp, fast4)
    kernel[(grid_n, split, grid_m)](
        xp, x32, out, part, counters(xp.device), bias, w.qweight, w.scales, zeros, w.step_group,
        m, w.n, xp.stride(0), out.stride(0), split, *cls, **flags, HAS_ZEROS=w.zeros is not None,
        HAS_BIAS=w.bias is not None, SPLIT_ON=split > 1, BM=cfg.bm, BS=cfg.bs, BN=cfg.bn, FAST4=fast4,
        RED=min(next_pow2(split), max(1, 8192 // (cfg.bm * cfg.bn))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        **pdl_args(xp.device, m, prefetch=prefetch))
    return SplitSum(part, (m,)) if part_only else out
