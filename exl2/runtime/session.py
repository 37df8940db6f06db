"""One sequence's decoding state: a paged KV cache sized for the context, chunked prefill, and (on CUDA) a
captured decode graph."""
from __future__ import annotations

import torch

from exl2.models.decoder import DecoderModel
from exl2.runtime.graphs import DecodeGraphs
from exl2.runtime.paged_cache import PagedKVCache


class Session:
    """Feed a prompt, then one token at a time; each call returns float32 logits of the last position."""

    def __init__(self, model: DecoderModel, max_seq_len: int, cache_mode: str = "fp16", page_size: int = 256,
                 chunk: int = 2048, use_graphs: bool = True):
        self.model, self.chunk = model, chunk
        pages = -(-max_seq_len // page_size)
        # One spare page: the scratch target of padded graph rows.
        self.cache = PagedKVCache(model.spec, pages + 1, page_size, cache_mode, model.device, model.dtype)
        self.table = torch.arange(pages, dtype=torch.int32, device=model.device).view(1, -1)
        model.prepare_rope(pages * page_size)
        self.graphs = None
        if use_graphs and model.device.type == "cuda" and self._graph_safe():
            self.graphs = DecodeGraphs(model, self.cache, pages, batch_sizes=(1,), scratch_page=pages)
            self.graphs.capture()
        self.length = 0

    def _graph_safe(self) -> bool:
        """MoE routing and Llama 4 chunked attention read values on the host: those models decode eagerly."""
        s = self.model.spec
        return not any(l.moe or l.chunk_size for l in s.layers) and s.rope.static and \
            (s.local_rope is None or s.local_rope.static)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        dev = self.model.device
        logits = None
        for start in range(0, len(ids), self.chunk):
            part = torch.tensor([ids[start:start + self.chunk]], dtype=torch.long, device=dev)
            self.cache.bind(self.table)
            logits = self.model(part, self.cache, self.length, last_only=True)[:, -1]
            self.length += part.shape[1]
        return logits.float()

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        ids = token.view(1, 1).to(self.model.device)
        if self.graphs is not None:
            pos = torch.full((1,), self.length, dtype=torch.long, device=ids.device)
            out = self.graphs.step(ids, pos, self.table, max_len=self.length + 1)
        else:
            self.cache.bind(self.table)
            out = self.model(ids, self.cache, self.length, last_only=True)[:, -1]
        self.length += 1
        return out.float()
