"""A second tier of the prompt cache in host memory: full pages the GPU cache evicts are copied here under their
prefix keys and copied back when a later prompt starts with them, so a conversation's earlier turns outlive a
busy GPU cache (TabbyAPI's sysmem_kv_cache). Copying a page back costs a host-to-device copy of its keys and
values (for an 8B model in fp16, 32 MB for 256 tokens: ~2 ms), against a prefill of those tokens."""
from __future__ import annotations

import logging
from collections import OrderedDict
import torch

log = logging.getLogger("exl2.model")


def page_tensors(cache) -> list[torch.Tensor]:
    """Every tensor of a paged cache whose first dimension is the page (keys, values and their scales, of every
    layer; of every shard of a tensor-parallel cache)."""
    out: list[torch.Tensor] = []
    for shard in getattr(cache, "shards", [cache]):
        for group in (shard.k, shard.v, shard.k_scales, shard.v_scales):
            out += [t for t in group if t is not None]
    return out


class HostPages:
    """Pages' contents by prefix key, least recently stored dropped first past `budget_bytes`."""

    def __init__(self, cache, budget_bytes: int):
        self.tensors = page_tensors(cache)
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.capacity = int(budget_bytes // max(1, self.page_bytes))
        if budget_bytes and not self.capacity:
            log.warning("The host cache (%.2f GB) is smaller than one cache page (%.1f MB), so it holds nothing.",
                        budget_bytes / 2**30, self.page_bytes / 2**20)
        self.pinned = any(t.is_cuda for t in self.tensors)
        self._pages: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def save(self, page: int, key: bytes) -> None:
        """Copy GPU page `page` (holding the prefix `key`) to host memory before it is reused."""
        if self.capacity < 1 or key in self._pages:
            return
        while len(self._pages) >= self.capacity:
            self._pages.popitem(last=False)
        data = []
        for t in self.tensors:
            host = torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=self.pinned)
            host.copy_(t[page])
            data.append(host)
        self._pages[key] = data

    def take(self, key: bytes) -> list[torch.Tensor]:
        """The stored contents of prefix `key`, no longer kept here (a GPU page is about to hold them)."""
        return self._pages.pop(key)

    def write(self, page: int, data: list[torch.Tensor]) -> None:
        """Copy contents `take` gave into GPU page `page`."""
        for t, host in zip(self.tensors, data):
            t[page].copy_(host)

    def clear(self) -> None:
        self._pages.clear()

    def run(self, keys: list[bytes]) -> int:
        """How many of `keys` (a prompt's next page keys, in order) are held here without a gap."""
        n = 0
        while n < len(keys) and keys[n] in self._pages:
            n += 1
        return n

