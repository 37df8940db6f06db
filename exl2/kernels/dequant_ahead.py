"""Prompt matmuls, pipelined: the next launch's fp16 weight is dequantized on a side stream while this GEMM runs.

A 2,047-token prefill of an 8B model spends ~4.8 ms of ~47 ms dequantizing (memory-bound) between GEMMs that are
bound by the tensor cores, one after the other on one stream. Where a weight knows the next prompt matmul's
weights (`QuantWeight._cache["dequant_next"]`, set by `runtime.lookahead.plan_dequant_ahead`), the large-M path
(`dequant.dequant_matmul_group`) starts their dequantization on a per-device side stream before its own GEMM and
the next call picks the result up (`take`), so the two kinds of work overlap. The results are the same bits: the
same kernels write the same matrix, only earlier. One launch ahead at most: the extra memory is one stage's fp16
weight (gate/up: 235 MB for Llama-3-8B).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from exl2.kernels.qweight import QuantWeight

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# per device: (the weights' ids, their fp16 matrix, the event its last kernel records)
_PENDING: dict[torch.device, tuple[tuple[int, ...], torch.Tensor, torch.cuda.Event]] = {}


def _key(ws: Sequence[QuantWeight]) -> tuple[int, ...]:
    return tuple(id(w) for w in ws)


def _usable(dev: torch.device) -> bool:
    return dev.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def take(ws: Sequence[QuantWeight]) -> torch.Tensor | None:
    """The fp16 matrix of `ws` if the previous call started it, ordered before the current stream's next work;
    else None (and whatever was pending is dropped)."""
    dev = ws[0].device
    pending = _PENDING.pop(dev, None)
    if pending is None or pending[0] != _key(ws) or not _usable(dev):
        return None
    _, wd, ready = pending
    stream = torch.cuda.current_stream(dev)
    stream.wait_event(ready)
    wd.record_stream(stream)  # its memory is not reused until this stream is done with it
    return wd


def start_next(ws: Sequence[QuantWeight], dequantize: Callable[[Sequence[QuantWeight]], torch.Tensor]) -> None:
    """Start dequantizing the weights that follow `ws` (if they name any) on the device's side stream."""
    nxt = ws[0]._cache.get("dequant_next")
    dev = ws[0].device
    if not nxt or not _usable(dev):
        return
    side = _STREAMS.get(dev)
    if side is None:
        side = _STREAMS[dev] = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        wd = dequantize(nxt)
        ready = torch.cuda.Event()
        ready.record(side)
    _PENDING[dev] = (_key(nxt), wd, ready)


def set_next(ws: Sequence[QuantWeight], nxt: Sequence[QuantWeight] | None) -> None:
    """Name (or, None, forget) the weights of the prompt matmul that follows the one of `ws`."""
    for w in ws:
        if nxt:
            w._cache["dequant_next"] = list(nxt)
        else:
            w._cache.pop("dequant_next", None)
