"""A tensor-parallel decoder: one process drives N devices, every decoder layer sharded over them (runtime.tp.shard)
and the shards exchanging activations through collectives (runtime.tp.collectives). The embedding, the final norm
and the head stay on the first device, where input ids go in and logits come out; the residual stream is kept on
every device after each collective. Same interface as DecoderModel for the generator and the engine."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from exl2.models.decoder import (DecoderLayer, DecoderModel, KVCache, WeightProvider, deep_rows, last_rows,
                                 on_device, put_rows)
from exl2.models.rope import positioned
from exl2.models.routed_experts import prepare_routed
from exl2.models.spec import ModelSpec
from exl2.runtime.linear import share_inputs
from exl2.runtime.load_progress import report
from exl2.runtime.paged_cache import PagedKVCache
from exl2.runtime.tp.cache import ShardedCache
from exl2.runtime.tp.collectives import Collectives, collectives_for
from exl2.runtime.tp.shard import ShardedLayer, check_supported, shard_spec


class TensorParallelModel(DecoderModel):
    """`layer_w` provides whole decoder layers (on the first device: each is loaded, sharded, sent to the devices
    and dropped, one at a time); `head_w` the embedding, final norm and head on `devices[0]`. Decodes eagerly
    (`is_split`: no CUDA graphs)."""

    def __init__(self, spec: ModelSpec, layer_w: WeightProvider, head_w: WeightProvider,
                 devices: Sequence[torch.device | str], collectives: Optional[Collectives] = None):
        nn.Module.__init__(self)
        self.devices = [torch.device(d) for d in devices]
        check_supported(spec, len(self.devices))
        self.spec = spec
        self.is_split = True
        self.collectives = collectives or collectives_for(self.devices)
        self.shard_spec = shard_spec(spec, len(self.devices))
        self.embed_tokens = nn.Parameter(head_w.tensor("model.embed_tokens.weight"), requires_grad=False)
        layers = []
        for i in range(spec.num_layers):
            with on_device(self.devices[0]), torch.no_grad():
                whole = DecoderLayer(spec, i, layer_w)
                layers.append(ShardedLayer(whole, self.devices))
            del whole
            report(i + 1, spec.num_layers + 1)
        self.layers = nn.ModuleList(layers)
        with on_device(self.devices[0]):
            self._build_head(spec, head_w)
        report(spec.num_layers + 1, spec.num_layers + 1)
        self.head_device = self.devices[0]
        self.layer_devices = [self.devices[0]] * spec.num_layers  # where callers' tensors go
        self._tables_by_device: dict = {}
        share_inputs(self)  # q/k/v and gate/up of a shard read one permuted copy where their orders are equal
        prepare_routed(self)

    @property
    def tensor_parallel(self) -> int:
        """How many devices the layers are sharded over."""
        return len(self.devices)

    def route_split_sums(self, enabled: Optional[bool] = None) -> int:
        """No K-split partial sums leave a shard: its outputs go to a collective."""
        return 0

    def new_paged_cache(self, num_pages: int, page_size: int = 256, mode: str = "fp16",
                        decode_splits: Optional[int] = None) -> ShardedCache:
        """The paged cache this model's forward takes: one PagedKVCache of the shard's KV heads per device."""
        return ShardedCache([PagedKVCache(self.shard_spec, num_pages, page_size, mode, d, self.dtype, decode_splits)
                             for d in self.devices])

    def new_cache(self, batch: int, max_len: int) -> ShardedCache:
        s = self.shard_spec
        return ShardedCache([KVCache(s.num_layers, batch, max_len, s.num_kv_heads, s.head_dim, s.head_dim,
                                     self.dtype, d) for d in self.devices])

    def _shard_caches(self, cache) -> list:
        if cache is None:
            return [None] * len(self.devices)
        if not isinstance(cache, ShardedCache) or len(cache.shards) != len(self.devices):
            raise ValueError("a tensor-parallel model needs its own cache (new_paged_cache or new_cache).")
        return cache.shards

    def forward(self, ids: torch.Tensor, cache=None, start: int | torch.Tensor = 0,
                last_only: bool | torch.Tensor = False, fresh: bool | None = None,
                hidden: bool = False, inject: Optional[tuple] = None,
                rope_shift: Optional[torch.Tensor] = None, mrope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As DecoderModel.forward; ids on the first device, logits (or hidden states) there."""
        q_pos = self.positions(ids, start)
        fresh = (start == 0) if isinstance(start, int) else fresh
        tables = self.rope_tables(q_pos, start + ids.shape[1] if isinstance(start, int) else None)
        if rope_shift is not None or mrope is not None:
            tables = positioned(tables, q_pos, rope_shift, mrope, self.spec.mrope_axes)
        caches = self._shard_caches(cache)
        positions = [q_pos.to(d) for d in self.devices]
        for c, pos in zip(caches, positions):
            note = getattr(c, "note_positions", None)
            if note is not None:
                note(pos, fresh)
        local = [self.tables_on(tables, d) for d in self.devices]
        with on_device(self.devices[0]):
            x = self.embed(ids).contiguous()
            if inject is not None:
                put_rows(x, inject)
            xs = self.collectives.broadcast(x)
        for i, layer in enumerate(self.layers):
            ropes = [self.layer_rope(t, i) for t in local]
            xs = layer(xs, positions, ropes, caches, self.collectives, self.devices)
            xs = [deep_rows(x, inject, i) for x in xs]
        with on_device(self.devices[0]):
            rows = last_rows(self.norm(xs[0]), last_only)
            return rows if hidden else self.logits(rows)


def build_tensor_parallel(src, spec: ModelSpec, devices: Sequence[torch.device | str], dtype: torch.dtype,
                          use_kernels: Optional[bool] = None, collectives: Optional[Collectives] = None,
                          **fmt) -> TensorParallelModel:
    """A model sharded over `devices` (CUDA GPUs, or for tests several entries of "cpu": then the host
    collectives run). `use_kernels` None: quantized layers stay quantized where the devices are CUDA GPUs."""
    from exl2.runtime.weights import WeightLoader

    devs = [torch.device(d) for d in devices]
    check_supported(spec, len(devs))
    kernels = devs[0].type == "cuda" if use_kernels is None else use_kernels
    layer_w = WeightLoader(src, devs[0], dtype, use_kernels=kernels, **fmt)
    head_w = WeightLoader(src, devs[0], dtype, use_kernels=kernels, **fmt)
    with torch.no_grad():
        return TensorParallelModel(spec, layer_w, head_w, devs, collectives).eval()
