"""Work started one matmul ahead. Decode (one row): each gemv ends by prefetching the start of the next matrix's
weights into L2. Prefill (`plan_dequant_ahead`): the next matmul's fp16 weight is dequantized on a side stream
while the current GEMM runs (`kernels.dequant_ahead`).

Between two matmuls of a decode step run kernels that read almost nothing (RoPE and the cache write, attention,
the merge, norms, the GLU), and a gemv of 8-60 MB ramps up and drains at a fraction of the copy bandwidth, so
DRAM sits idle for a third of a batch-1 step. A gemv whose weight carries a lookahead table
(`QuantWeight.lookahead`) spends its programs' last instructions asking L2 for the next matrix's first lines, in
the order that matrix's programs read them (the first rows of each K share), and the next gemv starts on data
already in L2. The step reads the same bytes; it only stops waiting for them between kernels.

`EXL2_LOOKAHEAD_MB` bounds the bytes asked for ahead of each launch (0 turns it off); L2 holds 50 MB on an
H100 or H200.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

from exl2.kernels import dequant_ahead
from exl2.kernels.backend import env_choice
from exl2.kernels.qweight import QuantWeight
from exl2.kernels.quant_matmul import decode_splits

LOOKAHEAD_MB = env_choice("EXL2_LOOKAHEAD_MB", 0, range(0, 257))
# EXL2_DEQUANT_AHEAD=1: prompt matmuls dequantize the next one's weights during their GEMM
DEQUANT_AHEAD = env_choice("EXL2_DEQUANT_AHEAD", 0, range(0, 2)) == 1
LINE = 128  # bytes an L2 prefetch asks for

_ATTENTION = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


def _kernels(mods: Sequence[Optional[nn.Module]]) -> Optional[list[QuantWeight]]:
    kernels = [getattr(m, "kernel", None) for m in mods]
    return kernels if kernels and all(isinstance(k, QuantWeight) for k in kernels) else None


def decode_stages(model: nn.Module) -> list[Optional[list[QuantWeight]]]:
    """The quantized matrices of a decode step in the order it reads them, one entry a launch (q/k/v and gate/up
    together), None where the order is not known (MLA, experts, parallel blocks, dense layers): nothing is
    prefetched across a None."""
    stages: list[Optional[list[QuantWeight]]] = []
    for layer in getattr(model, "layers", ()):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        spec = getattr(layer, "spec", None)
        if spec is None or getattr(spec, "parallel_block", False) or attn is None or mlp is None:
            stages.append(None)
            continue
        for names, owner in ((_ATTENTION, attn), (("o_proj",), attn), (_MLP, mlp), (("down_proj",), mlp)):
            stages.append(_kernels([getattr(owner, n, None) for n in names]))
    stages.append(_kernels([getattr(model, "lm_head", None)]))
    return stages


def lookahead_table(ws: Sequence[QuantWeight], splits: Sequence[int], budget: int) -> Optional[torch.Tensor]:
    """int64 `[ranges, 2]` (byte address, 128-byte lines) of the first `budget` bytes of the weights' words as
    their gemv reads them: the same leading fraction of every K share (`gemv._word_share`), so that every program
    of the next launch finds its first rows in L2. None for an empty budget."""
    total = sum(w.qweight.numel() * w.qweight.element_size() for w in ws)
    if budget <= 0 or total == 0:
        return None
    frac = min(1.0, budget / total)
    rows = []
    for w, split in zip(ws, splits):
        kw, n = w.qweight.shape
        row_bytes = n * w.qweight.element_size()
        for k in range(split):
            lo, hi = kw * k // split, kw * (k + 1) // split
            take = min(hi - lo, math.ceil((hi - lo) * frac))
            if take <= 0:
                continue
            start = w.qweight.data_ptr() + lo * row_bytes
            first = start // LINE * LINE
            rows.append((first, -(-(start + take * row_bytes - first) // LINE)))
    return torch.tensor(rows, dtype=torch.int64, device=ws[0].device) if rows else None


def plan_lookahead(model: nn.Module, mb: Optional[int] = None) -> int:
    """Give every decode-step gemv whose successor is known and on the same GPU a lookahead table of up to `mb`
    MB of it (None: `EXL2_LOOKAHEAD_MB`; 0 clears the tables). Returns how many launches got one."""
    budget = (LOOKAHEAD_MB if mb is None else mb) << 20
    stages = decode_stages(model)
    planned = 0
    for cur, nxt in zip(stages, stages[1:]):
        if cur is None:
            continue
        table = None
        if budget and nxt is not None and cur[0].device.type == "cuda" and cur[0].device == nxt[0].device:
            splits = decode_splits(nxt)
            table = lookahead_table(nxt, splits, budget) if splits is not None else None
        for w in cur:
            w.lookahead = table
        planned += table is not None
    return planned


def plan_dequant_ahead(model: nn.Module, enabled: Optional[bool] = None) -> int:
    """Chain the prompt matmuls of the decoder layers (`decode_stages` without the head, which a prefill runs on
    its last rows only) so that each dequantizes its successor ahead (None: `EXL2_DEQUANT_AHEAD`; False clears
    the chain). Returns how many launches name a successor."""
    on = DEQUANT_AHEAD if enabled is None else enabled
    stages = decode_stages(model)[:-1]
    chained = 0
    for cur, nxt in zip(stages, stages[1:] + [None]):
        if cur is None:
            continue
        link = on and nxt is not None and cur[0].device.type == "cuda" and cur[0].device == nxt[0].device
        dequant_ahead.set_next(cur, nxt if link else None)
        chained += link
    return chained
