"""The paged KV cache: fixed-size pages shared by all sequences, addressed through per-sequence block tables.

Keys/values are stored fp16 or quantized (q8, q6 = 8-bit keys + 4-bit values, q4, q3, q2; layout in
exl2.kernels.kv_quant). `attend` writes the new keys/values of a forward and runs attention over each sequence's
pages: the paged (flash-decoding) kernel for decode and chunked prefill, plain prefill attention over the new
tokens when no prefix is cached. A decode step uses only static tensors, so it can be captured in a CUDA graph.

With `layer_devices` (a model split over several GPUs, runtime.placement) each layer's pages live on that layer's
device, and the bound block table and the per-forward slot metadata have one copy per device.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from exl2.errors import ConfigError
from exl2.kernels import kv_quant
from exl2.kernels.attention import paged_attention, scatter_columns, varlen_attention, write_kv
from exl2.kernels.rotary import apply_rotary, rotary_store
from exl2.models.layers import attention, block_attention
from exl2.models.rope import rope_index
from exl2.models.spec import ModelSpec

KV_MODES = kv_quant.KV_MODES


def kv_shape(spec: ModelSpec) -> tuple[int, int, int]:
    """(heads, key dim, value dim) of one cached token in one layer; multi-head latent attention caches one
    latent row (`MLAttention`): the normed kv_lora_rank vector with the RoPE key, and the vector alone as value."""
    if spec.mla is not None:
        r = spec.mla.kv_lora_rank
        return 1, r + spec.mla.qk_rope_head_dim, r
    return spec.num_kv_heads, spec.head_dim, spec.head_dim


def layer_bytes_per_token(spec: ModelSpec, mode: str = "fp16", elem_bytes: int = 2) -> float:
    """Cache bytes of one token in one layer (fp16 rows take `elem_bytes` per value; quantized rows their packed
    codes plus an fp16 scale per 32 values)."""
    heads, k_dim, v_dim = kv_shape(spec)
    k_bits, v_bits = KV_MODES[mode]

    def row(dim, bits):
        return dim * elem_bytes if bits == 16 else dim * bits / 8 + dim // 32 * 2
    return heads * (row(k_dim, k_bits) + row(v_dim, v_bits))


def _indexed(device: torch.device | str) -> torch.device:
    """`cuda` as `cuda:N` (the current GPU), so that devices compare equal to tensors' `.device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class PagedKVCache:
    """`decode_splits` fixes the key-range splits of decode attention; None lets the kernel pick them from the
    batch alone (enough programs to fill the GPU: 32 at batch 1, 3 at batch 16 for 8 KV heads), which stays
    constant inside a captured graph whatever the context length. `layer_devices` (one per layer; None: all on
    `device`) places each layer's pages; `device` is where callers' block tables and positions come from."""

    def __init__(self, spec: ModelSpec, num_pages: int, page_size: int = 256, mode: str = "fp16",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float16,
                 decode_splits: int | None = None, layer_devices: Optional[Sequence[torch.device | str]] = None):
        if mode not in KV_MODES:
            raise ValueError(f"unknown cache mode {mode}")
        self.spec, self.num_pages, self.page_size, self.mode = spec, num_pages, page_size, mode
        self.device, self.dtype = torch.device(device), dtype
        self.decode_splits = decode_splits
        self.prefill_backend = "auto"  # varlen_attention's backend for fresh prompts ("triton": no SDPA/flash_attn)
        self.kv_heads, self.k_dim, self.v_dim = kv_shape(spec)
        self.k_bits, self.v_bits = KV_MODES[mode]
        for bits, dim in ((self.k_bits, self.k_dim), (self.v_bits, self.v_dim)):
            if bits != 16 and dim % 64:
                raise ConfigError(f"The {mode} cache needs head dimensions divisible by 64, but this model's are "
                                  f"{dim}; use the fp16 cache.")
        self.layer_devices = [_indexed(d) for d in layer_devices] if layer_devices is not None else \
            [self.device] * spec.num_layers
        if len(self.layer_devices) != spec.num_layers:
            raise ValueError(f"layer_devices has {len(self.layer_devices)} entries for {spec.num_layers} layers")
        self.devices = list(dict.fromkeys(self.layer_devices))  # distinct, in layer order
        self._slot = [self.devices.index(d) for d in self.layer_devices]  # layer -> index into self.devices
        self.k, self.k_scales = zip(*[self._alloc(self.k_dim, self.k_bits, d) for d in self.layer_devices])
        self.v, self.v_scales = zip(*[self._alloc(self.v_dim, self.v_bits, d) for d in self.layer_devices])
        self.block_table: Optional[torch.Tensor] = None
        # [B, T] the last key each query of the next prefill sees (image tokens see their whole image: Gemma 3),
        # set after `bind` for one forward; None: causal
        self.limits: Optional[torch.Tensor] = None
        self._tables: list = [None] * len(self.devices)  # the bound block table on each device
        self._reset_meta()

    def _reset_meta(self) -> None:
        n = len(self.devices)
        self._meta: list[tuple] = [(None, None, None)] * n   # per device: (q_pos, slots, seq_lens)
        self._fresh_of: list[tuple] = [(None, False)] * n    # per device: (q_pos, every row starts at 0)

    def _alloc(self, dim: int, bits: int, device: torch.device):
        shape = (self.num_pages, self.page_size, self.kv_heads)
        if bits == 16:
            return torch.zeros(*shape, dim, dtype=self.dtype, device=device), None
        return (torch.zeros(*shape, kv_quant.packed_dim(dim, bits), dtype=torch.uint8, device=device),
                torch.zeros(*shape, dim // 32, dtype=torch.float16, device=device))

    def bytes_per_token(self) -> float:
        """Cache bytes per token of context over all layers (what a decode step reads per cached token)."""
        return layer_bytes_per_token(self.spec, self.mode) * self.spec.num_layers

    def bind(self, block_table: torch.Tensor) -> None:
        """Select the sequences of the next forward: row b of the batch uses pages block_table[b]."""
        self.block_table = block_table.to(device=self.device, dtype=torch.int32)
        self.limits = None
        if len(self.devices) == 1 and self.devices[0] == self.device:
            self._tables[0] = self.block_table
        else:  # one copy per device of the layers (`.to` returns the tensor itself where it already is)
            self._tables = [self.block_table.to(d) for d in self.devices]
        self._reset_meta()

    def slots(self, q_pos: torch.Tensor, table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flat slot index (page * page_size + offset) of every position [B, T] (through `table`, a copy of the
        bound block table on q_pos's device; default the bound table)."""
        table = self.block_table if table is None else table
        page = table.long().gather(1, torch.div(q_pos, self.page_size, rounding_mode="floor"))
        return page * self.page_size + q_pos % self.page_size

    def _read(self, layer: int, key: bool, length: int) -> torch.Tensor:
        """Dequantized keys or values of positions [0, length) of every bound sequence: [B, length, H, D]."""
        store, scales = (self.k[layer], self.k_scales[layer]) if key else (self.v[layer], self.v_scales[layer])
        bits, dim = (self.k_bits, self.k_dim) if key else (self.v_bits, self.v_dim)
        pages = -(-length // self.page_size)
        bt = self._tables[self._slot[layer]][:, :pages].long()
        x = store[bt] if bits == 16 else kv_quant.dequantize_kv(store[bt], scales[bt], bits, dim)
        return x.reshape(bt.shape[0], pages * self.page_size, self.kv_heads, dim)[:, :length]

    def _slots_and_lens(self, q_pos: torch.Tensor, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of the new tokens and sequence lengths, computed once per forward and device (all layers on a
        device share q_pos); `slot` indexes `self.devices`."""
        key, slots, lens = self._meta[slot]
        if key is not q_pos or slots is None:
            slots, lens = self.slots(q_pos, self._tables[slot]).reshape(-1), (q_pos[:, -1] + 1).int()
            self._meta[slot] = (q_pos, slots, lens)
        return slots, lens

    def note_positions(self, q_pos: torch.Tensor, fresh: bool | None) -> None:
        """The forward's positions (on one device of the layers; a split model notes each copy) and whether they
        start every row at 0, when its caller knows (None: unknown), so that no layer reads it back from the GPU."""
        if fresh is None:
            return
        if len(self.devices) == 1:
            self._fresh_of[0] = (q_pos, fresh)
        elif q_pos.device in self.devices:
            self._fresh_of[self.devices.index(q_pos.device)] = (q_pos, fresh)

    def _fresh(self, q_pos: torch.Tensor, slot: int = 0) -> bool:
        """Whether every row starts at position 0 (new prompts, no cached prefix). A host read, so it waits for
        the GPU: done once per forward (and device), not once per layer (it was 32 waits a forward of the 8B
        model)."""
        key, fresh = self._fresh_of[slot]
        if key is not q_pos:
            fresh = not bool((q_pos[:, 0] > 0).any())
            self._fresh_of[slot] = (q_pos, fresh)
        return fresh

    def fresh_prompt(self, layer: int, q_pos: torch.Tensor) -> bool:
        """Whether this forward is a fresh multi-token prompt (every row starts at 0), whose attention is among its
        own tokens only: a caller may then attend in another form than the cached rows' (MLA's expanded heads)."""
        return q_pos.shape[1] > 1 and self.limits is None and self._fresh(q_pos, self._slot[layer])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> None:
        """Write keys/values `[B, T, Hkv, D]` at q_pos without attending (see `fresh_prompt`)."""
        b, t = q_pos.shape
        slots, _ = self._slots_and_lens(q_pos, self._slot[layer])
        write_kv(k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]), self.k[layer], self.v[layer],
                 slots, self.k_bits, self.v_bits, self.k_scales[layer], self.v_scales[layer])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               scale: float, window=None, chunk=None, softcap=None, out_index=None, rope=None,
               sinks=None) -> torch.Tensor:
        """Write the new keys/values, attend: `[B, T, H, Dv]`, or with `out_index` the rows `[B·T, H·Dv]` in that
        column order (`attention.scatter_columns`; decode writes them from the kernel). `rope` (cos, sin,
        interleaved): rotate q and k first; a decode step does it in the cache-write launch. `sinks`: gpt-oss's
        per-head logits (in the paged kernel; a fresh prompt then goes through it too, its rows being written)."""
        b, t = q_pos.shape
        slot = self._slot[layer]
        table = self._tables[slot]
        slots, seq_lens = self._slots_and_lens(q_pos, slot)
        kf, vf = k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:])
        q_rotated = False
        r_pos = None if rope is None else rope_index(rope, q_pos)
        if rope is not None and self.k_bits == 16 and self.v_bits == 16:  # RoPE and the cache write: one launch
            rotary_store(q, k, v, rope[0], rope[1], r_pos, self.k[layer], self.v[layer], slots,
                         2 * rope[0].shape[-1], rope[2], keep_k=t > 1)
        elif rope is not None and t == 1 and self.k_bits != 16 and self.v_bits != 16:
            q_rotated = kv_quant.write_kv_quant_pair(
                kf, vf, (self.k[layer], self.k_scales[layer]), (self.v[layer], self.v_scales[layer]),
                slots.reshape(-1), self.k_bits, self.v_bits,
                rope=(q, rope[0], rope[1], r_pos, 2 * rope[0].shape[-1], rope[2]), hadamard_q=chunk is None)
        else:
            if rope is not None:
                apply_rotary(q, k, rope[0], rope[1], r_pos, 2 * rope[0].shape[-1], rope[2])
            write_kv(kf, vf, self.k[layer], self.v[layer], slots, self.k_bits, self.v_bits, self.k_scales[layer],
                     self.v_scales[layer])
        limit = self.limits if t > 1 else None
        if chunk is not None or limit is not None:  # Llama 4 chunks, Gemma 3 images: not in the kernels
            length = int(q_pos[:, -1].max()) + 1
            kk, vv = self._read(layer, True, length), self._read(layer, False, length)
            if chunk is None and not softcap and sinks is None:
                out = block_attention(q, kk.to(q.dtype), vv.to(q.dtype), q_pos, scale, window, limit.to(q.device))
            else:
                out = attention(q, kk.to(q.dtype), vv.to(q.dtype), q_pos, scale, window, chunk, softcap,
                                None if limit is None else limit.to(q.device), sinks=sinks)
            return out if out_index is None else scatter_columns(out.reshape(b * t, *out.shape[2:]), out_index)
        qf = q.reshape(b * t, *q.shape[2:])
        opts = dict(scale=scale, sliding_window=window or 0, softcap=softcap or 0.0)
        if sinks is not None:
            opts["sinks"] = sinks
        if t == 1:
            out = paged_attention(qf, self.k[layer], self.v[layer], table, seq_lens,
                                  k_bits=self.k_bits, v_bits=self.v_bits, k_scales=self.k_scales[layer],
                                  v_scales=self.v_scales[layer], num_splits=self.decode_splits,
                                  out_index=out_index, q_rotated=q_rotated, **opts)
            if out_index is not None:
                return out
        elif self._fresh(q_pos, slot) and sinks is None:  # fresh prompts: attention among the new tokens only
            cu = list(range(0, b * t + 1, t))
            out = varlen_attention(qf, k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]), cu, t,
                                   backend=self.prefill_backend, **opts)
        else:  # chunked prefill after a cached prefix
            cu = torch.arange(0, b * t + 1, t, dtype=torch.int32, device=q.device)
            out = paged_attention(qf, self.k[layer], self.v[layer], table, seq_lens, cu, t,
                                  k_bits=self.k_bits, v_bits=self.v_bits, k_scales=self.k_scales[layer],
                                  v_scales=self.v_scales[layer], **opts)
        if out_index is not None:
            return scatter_columns(out, out_index)
        return out.view(b, t, *out.shape[1:])


def paged_cache_for(model, num_pages: int, page_size: int = 256, mode: str = "fp16"):
    """The paged cache `model`'s forward takes, on its devices: a tensor-parallel model (runtime.tp) makes its own
    (one cache per shard, `new_paged_cache`); any other gets a PagedKVCache over its layers' devices."""
    make = getattr(model, "new_paged_cache", None)
    if make is not None:
        return make(num_pages, page_size, mode)
    return PagedKVCache(model.spec, num_pages, page_size, mode, model.device, model.dtype,
                        layer_devices=getattr(model, "layer_devices", None))
