"""CUDA graphs of the decode step (one token per sequence) at fixed batch sizes; eager elsewhere.

Each graph owns static input tensors (token ids, positions, block table); a step copies the live batch into the
smallest graph that fits, padding spare rows with a scratch page, and replays it.
"""
from __future__ import annotations

import torch

from exl2.models.decoder import DecoderModel
from exl2.runtime.paged_cache import PagedKVCache

BATCH_SIZES = (1, 2, 4, 8, 16)


class DecodeGraphs:
    def __init__(self, model: DecoderModel, cache: PagedKVCache, max_pages_per_seq: int,
                 batch_sizes=BATCH_SIZES, scratch_page: int = 0):
        self.model, self.cache = model, cache
        self.max_pages, self.scratch = max_pages_per_seq, scratch_page
        self.enabled = model.device.type == "cuda"
        self.graphs: dict[int, tuple] = {}
        self.batch_sizes = tuple(sorted(batch_sizes))
        model.prepare_rope(max_pages_per_seq * cache.page_size)

    def _inputs(self, bs: int):
        dev = self.model.device
        return (torch.zeros(bs, 1, dtype=torch.long, device=dev), torch.zeros(bs, dtype=torch.long, device=dev),
                torch.full((bs, self.max_pages), self.scratch, dtype=torch.int32, device=dev))

    def _forward(self, ids, pos, bt):
        self.cache.bind(bt)
        return self.model(ids, self.cache, pos, last_only=True)[:, -1]

    def capture(self, batch_sizes=None) -> None:
        if not self.enabled:
            return
        for bs in batch_sizes or self.batch_sizes:
            ids, pos, bt = self._inputs(bs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    self._forward(ids, pos, bt)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode():
                out = self._forward(ids, pos, bt)
            self.graphs[bs] = (graph, ids, pos, bt, out)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] for one new token per sequence (ids [B, 1], positions [B], block table [B, pages])."""
        b = ids.shape[0]
        fit = next((s for s in self.batch_sizes if s >= b and s in self.graphs), None)
        if fit is None:
            with torch.inference_mode():
                self.cache.bind(block_table)
                return self.model(ids, self.cache, pos, last_only=True)[:, -1]
        graph, s_ids, s_pos, s_bt, out = self.graphs[fit]
        s_ids[:b].copy_(ids)
        s_pos[:b].copy_(pos)
        s_bt[:b, : block_table.shape[1]].copy_(block_table)
        if fit > b:
            s_ids[b:].zero_()
            s_pos[b:].zero_()
            s_bt[b:].fill_(self.scratch)
        graph.replay()
        return out[:b]
