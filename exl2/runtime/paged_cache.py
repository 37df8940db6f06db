"""The paged KV cache: fixed-size pages shared by all sequences, addressed through per-sequence block tables.

Keys/values are stored fp16 or quantized (q8, q6 = 8-bit keys + 4-bit values, q4, q3, q2; see
exl2.kernels.kv_quant). `attend` writes the new keys/values of a forward and runs attention over each
sequence's pages: the paged flash-decoding kernel for single-token steps, gathered pages + prefill attention
otherwise. All tensors it uses are static, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from exl2.models.layers import attention
from exl2.models.spec import ModelSpec

KV_BITS = {"fp16": (16, 16), "q8": (8, 8), "q6": (8, 4), "q4": (4, 4), "q3": (3, 3), "q2": (2, 2)}


class PagedKVCache:
    def __init__(self, spec: ModelSpec, num_pages: int, page_size: int = 256, mode: str = "fp16",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float16):
        if mode not in KV_BITS:
            raise ValueError(f"unknown cache mode {mode}")
        self.spec, self.num_pages, self.page_size, self.mode = spec, num_pages, page_size, mode
        self.device, self.dtype = torch.device(device), dtype
        if spec.mla is not None:
            self.kv_heads, self.k_dim, self.v_dim = spec.num_heads, spec.head_dim, spec.mla.v_head_dim
        else:
            self.kv_heads, self.k_dim, self.v_dim = spec.num_kv_heads, spec.head_dim, spec.head_dim
        self.k_bits, self.v_bits = KV_BITS[mode]
        self.k = [self._alloc(self.k_dim, self.k_bits) for _ in range(spec.num_layers)]
        self.v = [self._alloc(self.v_dim, self.v_bits) for _ in range(spec.num_layers)]
        self.block_table: Optional[torch.Tensor] = None

    # -- storage -------------------------------------------------------------------------------------------
    def _alloc(self, dim: int, bits: int):
        shape = (self.num_pages, self.page_size, self.kv_heads)
        if bits == 16:
            return torch.zeros(*shape, dim, dtype=self.dtype, device=self.device)
        from exl2.kernels.kv_quant import kv_storage
        return kv_storage(shape, dim, bits, self.device)

    def bytes_per_token(self) -> float:
        per = self.kv_heads * (self.k_dim * (self.k_bits + (0.5 if self.k_bits < 16 else 0))
                               + self.v_dim * (self.v_bits + (0.5 if self.v_bits < 16 else 0))) / 8
        return per * self.spec.num_layers

    def bind(self, block_table: torch.Tensor) -> None:
        """Select the sequences of the next forward: row b of the batch uses pages block_table[b]."""
        self.block_table = block_table.to(device=self.device, dtype=torch.int32)

    def slots(self, q_pos: torch.Tensor) -> torch.Tensor:
        """Flat slot index (page * page_size + offset) of every position [B, T]."""
        bt = self.block_table.long()
        page = bt.gather(1, torch.div(q_pos, self.page_size, rounding_mode="floor"))
        return page * self.page_size + q_pos % self.page_size

    def _store(self, store, x: torch.Tensor, slots: torch.Tensor, bits: int) -> None:
        flat = slots.reshape(-1)
        xs = x.reshape(-1, *x.shape[2:])
        if bits == 16:
            store.view(-1, *store.shape[2:]).index_copy_(0, flat, xs.to(store.dtype))
        else:
            from exl2.kernels.kv_quant import kv_write
            kv_write(store, xs, flat, bits)

    def _gather(self, store, bits: int, dim: int, length: int) -> torch.Tensor:
        """Keys or values of positions [0, length) for every bound sequence: [B, length, H, D]."""
        pages = -(-length // self.page_size)
        bt = self.block_table[:, :pages].long()
        if bits == 16:
            x = store[bt]
        else:
            from exl2.kernels.kv_quant import kv_read_pages
            x = kv_read_pages(store, bt, bits, dim, self.dtype)
        return x.reshape(bt.shape[0], pages * self.page_size, self.kv_heads, dim)[:, :length]

    # -- attention -----------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               scale: float, window=None, chunk=None, softcap=None) -> torch.Tensor:
        slots = self.slots(q_pos)
        self._store(self.k[layer], k, slots, self.k_bits)
        self._store(self.v[layer], v, slots, self.v_bits)
        seq_lens = q_pos[:, -1] + 1
        if q.shape[1] == 1 and q.is_cuda:
            from exl2.kernels.attention import paged_decode_attention
            return paged_decode_attention(q, self.k[layer], self.v[layer], self.block_table, seq_lens, scale,
                                          window=window, chunk=chunk, softcap=softcap, k_bits=self.k_bits,
                                          v_bits=self.v_bits, v_dim=self.v_dim)
        length = int(seq_lens.max())
        kk = self._gather(self.k[layer], self.k_bits, self.k_dim, length)
        vv = self._gather(self.v[layer], self.v_bits, self.v_dim, length)
        return attention(q, kk.to(q.dtype), vv.to(q.dtype), q_pos, scale, window, chunk, softcap)
