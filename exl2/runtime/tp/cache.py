"""The KV cache of a tensor-parallel model: one cache per shard holding only that shard's KV heads, all bound to
the same page tables (the page pool allocates once; every shard stores the same pages of its heads)."""
from __future__ import annotations

from typing import Sequence

import torch


class ShardedCache:
    """Shard caches (PagedKVCache, or the contiguous KVCache) behind the one cache object the generator binds."""

    def __init__(self, shards: Sequence):
        self.shards = list(shards)

    def bind(self, block_table: torch.Tensor) -> None:
        """Select the sequences of the next forward on every shard (each copies the table to its device)."""
        for s in self.shards:
            s.bind(block_table)

    @property
    def block_table(self):
        return getattr(self.shards[0], "block_table", None)

    @property
    def num_pages(self) -> int:
        return self.shards[0].num_pages

    @property
    def page_size(self) -> int:
        return self.shards[0].page_size

    @property
    def mode(self) -> str:
        return self.shards[0].mode

    @property
    def device(self) -> torch.device:
        return self.shards[0].device

    def bytes_per_token(self) -> float:
        """Cache bytes per token of context over all layers and shards."""
        return sum(s.bytes_per_token() for s in self.shards)
