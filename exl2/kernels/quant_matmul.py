"""`y = x · W + bias` with W a `QuantWeight` (EXL2 or GPTQ): the dispatcher over the kernels, per shape
(`choose_config`):

* **gemv** (M ≤ 4, `gemv.py`): CUDA-core kernel, one input row a program; q/k/v and gate/up as one launch each
  (`GemvGroup`).
* **Gluon tensor-core kernel** (M ≤ 16, `mma_dot.py`): weights decoded straight into mma fragments; also takes
  the gemv's rows past `GEMV_MAX_M` (1), and all of them for matrices with a class the gemv has no packed
  decoder for on this device (`gemv_via_mma`).
* **dot** (M ≤ 64, `dot.py`): the Triton tensor-core kernel, where the Gluon kernel does not run.
* **dequant** (larger M, `dequant.py`): fp16 weight from a Triton kernel, then cuBLAS; or, for weights opted
  in to it, e4m3 weight and input and a scaled FP8 GEMM (`fp8_prefill.py`).

The small-M paths read the input already permuted into the weight's stored row order (`permute.gather_input`, or
written by the kernel producing the input: `rms_norm_gather`, `glu(index=...)`, consumed by `permuted_matmul`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels import mma_dot
from exl2.kernels.backend import env_choice, sm_count, triton, use_triton
from exl2.kernels.dequant import dequant_matmul_group
from exl2.kernels.dot import permuted_dot
from exl2.kernels.fp8_prefill import fp8_applies, fp8_matmul_group
from exl2.kernels.gemv import (GEMV_BN, GEMV_BS, GEMV_GROUP_SELECT, GEMV_STAGES, GEMV_WARPS, GemvGroup,
                               fast4_available, gemv, permuted_gemv)
from exl2.kernels.matmul_launch import PACKED_FLAG, MatmulConfig, auto_split
from exl2.kernels.permute import buffer_offsets, gather_input, permuted_for
from exl2.kernels.qweight import QuantWeight, matmul_torch
from exl2.kernels.split_sum import SplitSum

GEMV_ROWS = 4  # the most rows the gemv takes
# Rows up to which the CUDA-core gemv runs where the Gluon tensor-core kernel, whose cost hardly depends on the row
# count, can take the matrix (the gemv runs one input row a program, and rows past the first re-read the weights
# from L2; EXL2_GEMV_MAX_M, 1-4). 1: batch 2 ran at 701 tok/s against 643 with 2 rows through the gemv, batch 4 at
# 1,379 against 740 with 4, batch 1 and 16 alike (H100, session 21, benchmarks/RESULTS.md).
GEMV_MAX_M = env_choice("EXL2_GEMV_MAX_M", 1, range(1, 5))
DOT_MAX_M = 64
# One launch for the gemvs of q/k/v and of gate/up (`grouped_matmul`): on the H200 q/k/v took 15.4 µs grouped
# against 22.1 µs as three launches, gate/up the same either way (benchmarks/RESULTS.md, run 8).
# EXL2_FUSE_SHARED_INPUT=0 turns it off; correct either way (tests compare with the twin).
FUSE_SHARED_INPUT = env_choice("EXL2_FUSE_SHARED_INPUT", 1, range(0, 2)) == 1
# Weights reading one input whose input orders are equal (q/k/v and gate/up of exllamav2 files share one act-order
# permutation) get one x_index tensor at load (`permute.share_input_orders`), so the small-batch path writes and
# reads one permuted copy for them instead of one each. EXL2_SHARED_INPUT=0 keeps a copy per weight (for A/B runs).
SHARED_INPUT = env_choice("EXL2_SHARED_INPUT", 1, range(0, 2)) == 1
# o and down, where the gemv splits their K, leave the partial sums to the norm-gather that reads their output
# (`SplitSum`), so they end without the arrival counter and the last program's sum: +4.2-4.3 % at batch 1 (H100,
# session 18). The Gluon kernel's partials (batches past the gemv) lost 18-19 % at batch 16, so they are off
# unless EXL2_SPLIT_SUM=2; 0 turns split sums off.
SPLIT_SUM_MODE = env_choice("EXL2_SPLIT_SUM", 1, range(0, 3))
SPLIT_SUM = SPLIT_SUM_MODE >= 1
# Up to 16 rows: the Gluon kernel (`mma_dot`), MMA4_BS steps per iteration, 32·MMA4_V columns
# per program, a ring of MMA4_STAGES iterations, K split to about MMA4_PER_SM programs per SM. EXL2_MMA4=0 keeps
# the Triton kernel.
MMA4 = env_choice("EXL2_MMA4", 1, range(0, 2)) == 1
MMA4_BS = env_choice("EXL2_MMA4_BS", 4, (1, 2, 4, 8))
MMA4_V = env_choice("EXL2_MMA4_V", 2, (1, 2, 4))
MMA4_PER_SM = env_choice("EXL2_MMA4_PER_SM", 4, range(1, 9))
MMA4_STAGES = env_choice("EXL2_MMA4_STAGES", 4, range(2, 9))
# 1-4 rows (besides those past GEMV_MAX_M): 1, matrices with a class lacking a packed gemv decoder take the Gluon
# kernel (`gemv_via_mma`); 2, every matrix; 0, none.
MMA_GEMV = env_choice("EXL2_MMA_GEMV", 1, range(0, 3))


def gemv_via_mma(w: QuantWeight, m: int, dtype: torch.dtype) -> bool:
    """Whether m ≤ 4 rows take the Gluon tensor-core kernel instead of the gemv: more than `GEMV_MAX_M` rows, or
    EXL2 matrices with a class the gemv would decode with its portable loop (its packed decoder failed the
    device's self-check; MMA_GEMV = 1), or always (2). The tensor-core kernel's cost hardly depends on the row
    count, and the portable loop ran a 5/4/3-bit body at a fifth of the 4-bit speed (benchmarks/RESULTS.md,
    session 8)."""
    if not (MMA4 and dtype == torch.float16 and mma_dot.supports(w, m)):
        return False
    if m > GEMV_MAX_M:
        return True
    if MMA_GEMV == 1:
        packed = fast4_available(w.device)
        return w.zeros is None and any(not packed & PACKED_FLAG[c.bits] for c in w.classes)
    return MMA_GEMV == 2


def choose_config(m: int, w: QuantWeight, dtype: torch.dtype = torch.float16) -> tuple[str, MatmulConfig | None]:
    """Pick the path and launch parameters for an [m, K] input (from H200 measurements, benchmarks/RESULTS.md):
    the gemv up to 4 rows (one program per row) except for the matrices `gemv_via_mma` sends to the tensor-core
    kernel, which takes up to 64, dequantize + cuBLAS beyond."""
    if m <= GEMV_ROWS and not gemv_via_mma(w, m, dtype):
        # Matrices of fewer 128-column tiles than SMs (o, down): `GEMV_BN` (64) columns, K split to ~2 programs an SM
        # (o 8.4 → 6.8 µs, down 15.2 → 12.6 µs on the H200, run 13); wide ones (the head) keep 128 columns.
        bn = GEMV_BN if triton.cdiv(w.n, 128) < sm_count(w.device) else 128
        per_sm = 2 if bn < 128 else 1
        split = auto_split(w, triton.cdiv(w.n, bn) * m, w.device, 8, per_sm)
        return "gemv", MatmulConfig(bm=1, bs=GEMV_BS, bn=bn, split=split, num_warps=GEMV_WARPS,
                                    num_stages=GEMV_STAGES)
    if m <= DOT_MAX_M:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        programs = triton.cdiv(w.n, 64) * triton.cdiv(m, bm)
        return "dot", MatmulConfig(bm=bm, bs=4 if bm == 16 else 2, bn=64,
                                   split=auto_split(w, programs, w.device, 16), num_warps=4, num_stages=4)
    return "dequant", None


def uses_permuted_input(m: int, x: torch.Tensor) -> bool:
    """Whether `quant_matmul` on `m` rows would read a permuted input (so callers may share one `gather_input`)."""
    return use_triton(x) and 0 < m <= DOT_MAX_M


def uses_dequant(m: int, x: torch.Tensor) -> bool:
    """Whether `quant_matmul` on `m` rows dequantizes and calls cuBLAS (so callers may group weights that share
    the input through `dequant_matmul_group`)."""
    return use_triton(x) and m > DOT_MAX_M


def _dot_or_mma(xp: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, split_sum: bool = False
                ) -> torch.Tensor | SplitSum:
    """The dot path on a permuted input: the Gluon kernel (`mma_dot`) for up to 16 rows where it runs (EXL2 of any
    widths, 4-bit GPTQ), the Triton tensor-core kernel otherwise. `split_sum`: see `permuted_matmul`."""
    if MMA4 and xp.dtype == torch.float16 and mma_dot.supports(w, xp.shape[0]):
        grid = triton.cdiv(w.n, 32 * MMA4_V)
        split = auto_split(w, grid, w.device, 4 * MMA4_BS, MMA4_PER_SM)
        return mma_dot.mma(xp, w, MMA4_BS, MMA4_V, split, MMA4_STAGES, part_only=split_sum)
    return permuted_dot(xp, w, cfg)


def permuted_matmul(xp: torch.Tensor, w: QuantWeight, split_sum: bool = False) -> torch.Tensor | SplitSum:
    """`x · W + bias` from the permuted input alone, xp `[M, S·32]` with M ≤ DOT_MAX_M (a producer such as the GLU
    kernel wrote it in `w.x_index` order, so x itself never existed): `[M, N]`. `split_sum`: where the gemv or
    the Gluon kernel splits K, its partial sums as a `SplitSum` for a consumer that adds them
    (`norm.rms_norm_gather`)."""
    m = xp.shape[0]
    if not 0 < m <= DOT_MAX_M or xp.shape[1] != w.x_index.numel() or xp.stride(-1) != 1:
        raise ValueError("permuted_matmul takes 1 to 64 contiguous rows in the weight's input order.")
    if not use_triton(xp):
        # The twin: undo the permutation (padding positions hold zeros and map nowhere), then the plain matmul.
        idx = w.x_index.long()
        x = torch.zeros((m, w.k), dtype=xp.dtype, device=xp.device)
        keep = idx >= 0
        x[:, idx[keep]] = xp[:, keep]
        return matmul_torch(x, w)
    path, cfg = choose_config(m, w, xp.dtype)
    if path != "gemv":
        return _dot_or_mma(xp, w, cfg, split_sum and SPLIT_SUM_MODE == 2)
    return permuted_gemv(xp, w, cfg, part_only=split_sum)


def quant_matmul(x: torch.Tensor, w: QuantWeight, xp: torch.Tensor | None = None) -> torch.Tensor:
    """`x · W + bias` for x `[..., K]` (fp16; bf16/fp32 accepted): output `[..., N]` in x's dtype.

    N is the stored width (EXL2 pads to a multiple of 32); slice to `w.out_features` if needed. `xp`, optional,
    is x already permuted for this weight by `gather_input` (small batches only).
    """
    if x.shape[-1] != w.k:
        raise ValueError(f"input has {x.shape[-1]} features but the weight expects {w.k}.")
    if not use_triton(x):
        return matmul_torch(x.reshape(-1, w.k), w).view(*x.shape[:-1], w.n)
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    path, cfg = choose_config(x2.shape[0], w, x2.dtype)
    if path == "gemv":
        y = gemv(x2, w, cfg, xp=xp)
    elif path == "dot":
        y = _dot_or_mma(permuted_for(x2, w, xp), w, cfg)
    else:
        y = prompt_matmul(x2, [w])[0]
    return y.view(*x.shape[:-1], w.n)


def prompt_matmul(x: torch.Tensor, ws: Sequence[QuantWeight]) -> list[torch.Tensor]:
    """The large-M path for weights sharing x `[M, K]`: one e4m3 GEMM where they opted in (`prefill_fp8`) and the
    device has it (one a weight where their layouts differ), else dequantize + one cuBLAS GEMM."""
    if fp8_applies(x, ws):
        return fp8_matmul_group(x, ws)
    if len(ws) > 1 and all(fp8_applies(x, [w]) for w in ws):
        return [fp8_matmul_group(x, [w])[0] for w in ws]
    return dequant_matmul_group(x, ws)


def grouped_matmul(x: torch.Tensor, ws: Sequence[QuantWeight], xp: torch.Tensor | None = None
                   ) -> list[torch.Tensor] | None:
    """`[x · W_i + bias_i]` for 2–3 weights sharing x `[M, K]` in one gather and one gemv launch (small M on the
    GPU), or None where that path does not apply (the caller then runs them one by one). `xp`: the permuted
    inputs already gathered into one buffer."""
    if not (FUSE_SHARED_INPUT and use_triton(x) and 0 < x.shape[0] <= DOT_MAX_M):
        return None
    if x.shape[0] > GEMV_ROWS or all(gemv_via_mma(w, x.shape[0], x.dtype) for w in ws):
        return _mma_group(x, ws, xp)
    if not GemvGroup.accepts(ws):
        return None
    group = ws[0]._cache.get(("group", tuple(map(id, ws))))
    if group is None:
        group = ws[0]._cache[("group", tuple(map(id, ws)))] = GemvGroup(ws)
    return group(gather_input(x, ws, whole=True) if xp is None else xp)


def _mma_group(x: torch.Tensor, ws: Sequence[QuantWeight], xp: torch.Tensor | None) -> list[torch.Tensor] | None:
    """`grouped_matmul` for 5-16 rows: one launch of the Gluon kernel where it takes every weight, else None. The
    K split is the one a single matrix as wide as all of them would get."""
    m = x.shape[0]
    if not (MMA4 and 1 < len(ws) <= 3 and x.dtype == torch.float16 and all(mma_dot.supports(w, m) for w in ws)
            and len({w.zeros is None for w in ws}) == 1 and len({w.bias is None for w in ws}) == 1):
        return None
    buf = gather_input(x, ws, whole=True) if xp is None else xp
    offsets = buffer_offsets(buf, ws)
    tiles = sum(triton.cdiv(w.n, 32 * MMA4_V) for w in ws)
    split = min(auto_split(w, tiles, w.device, 4 * MMA4_BS, MMA4_PER_SM) for w in ws)
    return mma_dot.mma_group(buf, ws, offsets, MMA4_BS, MMA4_V, [split] * len(ws), MMA4_STAGES,
                             one_body=GEMV_GROUP_SELECT)
