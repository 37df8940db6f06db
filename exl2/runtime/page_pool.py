"""Pages of the KV cache handed out to sequences, with prompt-prefix sharing.

A page that holds a complete run of `page_size` tokens is keyed by a hash of those tokens chained to the key of
the page before it, so the key names the whole prefix up to the page's end. A new sequence whose prompt starts
with cached pages points its block table at them instead of computing them again (a chat's next turn, many
requests behind one system prompt). Pages no sequence uses keep their contents and key until the space is needed,
oldest first.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable, Iterator, Optional, Sequence

import numpy as np


def page_key(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """Key of a full page: its tokens and everything before it (through the parent page's key). A 128-bit digest,
    so that two different prefixes sharing a key (and one reading the other's cache) is not a practical risk."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class PagePool:
    """Reference-counted pages `[0, num_pages)` with a prefix cache of full pages."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("a page pool needs at least one page")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self.key_of: dict[int, bytes] = {}                 # page -> key, for pages holding a keyed prefix
        self.page_of: dict[bytes, int] = {}                # key -> page
        self.free: list[int] = list(range(num_pages - 1, -1, -1))    # never written since the start, or released
        self.idle: OrderedDict[int, None] = OrderedDict()  # keyed pages nobody uses, least recently used first
        # called with (page, key) as a cached page is taken for other contents (a host-memory tier saves it)
        self.on_evict: Optional[Callable[[int, bytes], None]] = None

    def available(self) -> int:
        """Pages a new sequence could take (free ones plus cached ones nobody uses)."""
        return len(self.free) + len(self.idle)

    def match(self, tokens: Sequence[int], max_pages: int, root: Optional[bytes] = None
              ) -> tuple[list[int], Optional[bytes]]:
        """The cached pages that hold the longest prefix of `tokens` (at most `max_pages` of them), and the key
        of the last one (`root` when none matches). They are not taken yet: `acquire` does that. `root` starts
        the chain of keys: prefixes computed another way (other LoRA adapters) never match each other."""
        pages, key = [], root
        for k in self._chain(tokens, root, 0, max_pages):
            page = self.page_of.get(k)
            if page is None:
                break
            pages.append(page)
            key = k
        return pages, key

    def keys_after(self, tokens: Sequence[int], key: Optional[bytes], first: int, max_pages: int) -> list[bytes]:
        """The keys of `tokens`' full pages `first`, `first` + 1, ... (below `max_pages`), chained from `key`, the
        key of the page before them."""
        return list(self._chain(tokens, key, first, max_pages))

    def _chain(self, tokens: Sequence[int], key: Optional[bytes], first: int, max_pages: int) -> Iterator[bytes]:
        """`keys_after`, one key at a time (`match` stops hashing at its first miss)."""
        for i in range(first, min(max_pages, len(tokens) // self.page_size)):
            key = page_key(key, tokens[i * self.page_size:(i + 1) * self.page_size])
            yield key

    def room(self, shared: list[int]) -> int:
        """How many empty pages a sequence that takes the `shared` cached pages could get besides them (those of
        the shared pages nobody uses count as available until taken)."""
        return self.available() - sum(1 for p in shared if self.refs[p] == 0)

    def acquire(self, shared: list[int], new: int) -> list[int]:
        """Take the `shared` cached pages and `new` empty ones; raises if there are not enough."""
        room = self.room(shared)
        if new > room:
            raise RuntimeError(f"the cache has {room} free pages, {new} needed")
        for p in shared:
            if self.refs[p] == 0:
                del self.idle[p]
            self.refs[p] += 1
        out = []
        for _ in range(new):
            if self.free:
                p = self.free.pop()
            else:
                p, _ = self.idle.popitem(last=False)
                key = self.key_of.pop(p)
                del self.page_of[key]
                if self.on_evict is not None:
                    self.on_evict(p, key)
            self.refs[p] = 1
            out.append(p)
        return list(shared) + out

    def publish(self, page: int, key: bytes) -> None:
        """Record that `page` now holds the full prefix named `key`, so later prompts can share it. A page
        already cached under that key wins (the sequence keeps its own copy until it releases it)."""
        if key in self.page_of or page in self.key_of:
            return
        self.page_of[key] = page
        self.key_of[page] = key

    def forget_prefixes(self) -> None:
        """Unpublish every cached prefix, for when the keys/values they hold no longer match the model (its LoRA
        adapters changed): no later prompt shares them. Cached pages nobody uses become free; pages still in use
        stay with their sequences and are freed, not cached, when released."""
        self.free.extend(self.idle)
        self.idle.clear()
        self.key_of.clear()
        self.page_of.clear()

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unused keyed pages stay cached, the others become free."""
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.key_of:
                    self.idle[p] = None
                    self.idle.move_to_end(p)
                else:
                    self.free.append(p)
