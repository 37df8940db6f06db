"""The collectives a tensor-parallel model's shards exchange activations with, behind one small interface:
NCCL (`torch.cuda.nccl`, one process driving every GPU) where each shard has a GPU of its own, a plain host
implementation (sum / concatenate, a copy back to each shard's device) everywhere else: the CPU tests' "devices",
or several shards on one GPU. Both take one tensor per shard, in shard order, and return one per shard."""
from __future__ import annotations

from typing import Sequence

import torch


class Collectives:
    """Host implementation: correct anywhere, one copy per shard (the reference the NCCL one must match)."""

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = [torch.device(d) for d in devices]

    def all_reduce(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Σ xs on every shard (new tensors; shards never share one, so in-place updates stay local)."""
        total = xs[0].clone()
        for x in xs[1:]:
            total += x.to(total.device)
        return [total.to(d, copy=True) for d in self.devices]

    def all_gather(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The shards' tensors concatenated along the last dimension, on every shard."""
        whole = torch.cat([x.to(self.devices[0]) for x in xs], dim=-1)
        return [whole.to(d, copy=True) for d in self.devices]

    def broadcast(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x on every shard, a copy each."""
        return [x.to(d, copy=True) for d in self.devices]


class NcclCollectives(Collectives):
    """NCCL over distinct CUDA devices from one process. Each op runs on every device's current stream, after
    the work queued there; the communicators are built on the first call and kept by torch."""

    def __init__(self, devices: Sequence[torch.device]):
        super().__init__(devices)
        from torch.cuda import nccl
        self.nccl = nccl

    def all_reduce(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = [x.contiguous() for x in xs]
        self.nccl.all_reduce(out)
        return out

    def all_gather(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # NCCL gathers flat buffers one after another: [shards, *x.shape], then the shard axis moves last
        xs = [x.contiguous() for x in xs]
        outs = [torch.empty((len(xs), *x.shape), dtype=x.dtype, device=x.device) for x in xs]
        self.nccl.all_gather(xs, outs)
        return [o.movedim(0, -2).reshape(*x.shape[:-1], -1) for o, x in zip(outs, xs)]

    def broadcast(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [x.to(self.devices[0], copy=True).contiguous()]
        out += [torch.empty_like(out[0], device=d) for d in self.devices[1:]]
        self.nccl.broadcast(out, root=0)
        return out


def collectives_for(devices: Sequence[torch.device]) -> Collectives:
    """NCCL where every shard has its own CUDA device and NCCL is available, else the host implementation."""
    devs = [torch.device(d) for d in devices]
    if all(d.type == "cuda" for d in devs) and len(set(devs)) == len(devs) and _nccl_available():
        return NcclCollectives(devs)
    return Collectives(devs)


def _nccl_available() -> bool:
    try:
        from torch.cuda import nccl
        return nccl.is_available([torch.zeros(1, device="cuda")])
    except (ImportError, RuntimeError):
        return False
