"""CUDA graphs of the decode step (one token per sequence) at fixed batch sizes; eager elsewhere.

Each graph owns static input tensors (token ids, positions, block table; for M-RoPE models each row's RoPE shift
as well); a step copies the live batch into the smallest graph that fits, padding spare rows with a scratch page,
and replays it.

Decode attention splits each sequence's keys over several programs and merges them in a second launch, with the
split count fixed inside a graph. A batch whose sequences are all short (the caller says so with `max_len`)
replays a second graph captured with one split: no merge launch, and one program per sequence and KV head walks
its few key blocks (`SHORT_CONTEXT`, EXL2_SHORT_CTX; 0 captures no short graphs). Only batch sizes that already
fill the GPU with few splits (at most SHORT_MAX_SPLITS) get one, and only over an fp16 value cache: a small batch
loses more to the serial walk than the merge launch costs, and quantized values are merged (un-rotated) anyway
(H200, benchmarks/RESULTS.md session 9).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from exl2.kernels.attention import decode_splits
from exl2.kernels.backend import env_choice
from exl2.models.decoder import DecoderModel
from exl2.runtime.paged_cache import PagedKVCache

BATCH_SIZES = (1, 2, 4, 8, 16)
SHORT_CONTEXT = env_choice("EXL2_SHORT_CTX", 256, range(0, 1 << 20))
SHORT_MAX_SPLITS = 4


@lru_cache(maxsize=None)
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the eager runs before each capture (as torch.cuda.graph keeps one capture
    stream): cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it runs on until the process ends, so a
    new stream per capture would leave one behind for each graph of each model ever loaded."""
    return torch.cuda.Stream(device)


def graph_safe(model: DecoderModel) -> bool:
    """Llama 4 chunked attention, and MoE blocks whose experts cannot take the routed path (`RoutedExperts`: not
    quantized, or with LoRA adapters), read values on the host: those models decode eagerly."""
    s = model.spec
    routed = all(getattr(getattr(layer, "mlp", None), "routed", None) is not None
                 for layer, ls in zip(model.layers, s.layers) if ls.moe)
    return routed and not any(l.chunk_size for l in s.layers) and s.rope.static and \
        (s.local_rope is None or s.local_rope.static)


class DecodeGraphs:
    """`tokens` new tokens per sequence a step: 1 for decoding; more to check speculative drafts, when the step
    returns the logits of every position, [B, tokens, V]."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, max_pages_per_seq: int,
                 batch_sizes=BATCH_SIZES, scratch_page: int = 0, tokens: int = 1):
        self.model, self.cache, self.tokens = model, cache, tokens
        self.max_pages, self.scratch = max_pages_per_seq, scratch_page
        # a model split over several GPUs decodes eagerly (one graph would have to span the devices' streams)
        self._device_ok = model.device.type == "cuda" and not getattr(model, "is_split", False)
        self.enabled = self._device_ok
        self.graphs: dict[int, tuple] = {}
        self.short: dict[int, tuple] = {}  # one key split: batches of sequences of at most SHORT_CONTEXT tokens
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.shifted = model.spec.mrope_section is not None   # rows rotate at position + shift (DecoderModel)
        model.prepare_rope(max_pages_per_seq * cache.page_size)

    def _inputs(self, bs: int):
        dev = self.model.device
        return (torch.zeros(bs, self.tokens, dtype=torch.long, device=dev),
                torch.zeros(bs, dtype=torch.long, device=dev),
                torch.full((bs, self.max_pages), self.scratch, dtype=torch.int32, device=dev),
                torch.zeros(bs, dtype=torch.long, device=dev) if self.shifted else None)

    def _forward(self, ids, pos, bt, shift=None):
        self.cache.bind(bt)
        if self.tokens > 1:  # positions are never 0 here: the sequences have a cached prefix
            return self.model(ids, self.cache, pos, fresh=False, rope_shift=shift)
        return self.model(ids, self.cache, pos, last_only=True, rope_shift=shift)[:, -1]

    def capture(self, batch_sizes=None) -> None:
        if not self.enabled:
            return
        for bs in batch_sizes or self.batch_sizes:
            inputs = self._inputs(bs)
            stream = _warmup_stream(torch.device("cuda", torch.cuda.current_device()))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    self._forward(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[bs] = self._capture_one(*inputs)
            if self._wants_short(bs):
                self.cache.decode_splits = 1
                try:
                    self.short[bs] = self._capture_one(*self._inputs(bs))
                finally:
                    self.cache.decode_splits = None

    def reset(self) -> None:
        """Free every captured graph, so that the next `step(lazy=True)` (or `capture`) records the model's
        forward anew: a graph replays the kernels and weights it was captured with, so it goes stale when the
        model's layers change (LoRA adapters set or removed). Steps run eagerly from then on where the model
        stopped being `graph_safe` (adapters on a MoE block's experts)."""
        if (self.graphs or self.short) and self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)   # no replay may still be reading what is freed
        self.graphs.clear()
        self.short.clear()
        self.enabled = self._device_ok and graph_safe(self.model)

    def _wants_short(self, bs: int) -> bool:
        c = self.cache
        return bool(SHORT_CONTEXT and self.tokens == 1 and c.decode_splits is None and c.v_bits == 16
                    and decode_splits(bs * c.kv_heads, self.model.device) <= SHORT_MAX_SPLITS)

    def _capture_one(self, ids, pos, bt, shift) -> tuple:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            out = self._forward(ids, pos, bt, shift)
        return graph, ids, pos, bt, shift, out

    def step(self, ids: torch.Tensor, pos: torch.Tensor, block_table: torch.Tensor,
             max_len: int | None = None, lazy: bool = False, shift: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] for one new token per sequence (ids [B, 1], positions [B], block table [B, pages]);
        [B, T, V] for T tokens per sequence. `shift` [B]: M-RoPE rows' RoPE shifts (DecoderModel.forward).
        `max_len`, the longest sequence's length including this token when the caller knows it on the host,
        picks the one-split graph for short batches. `lazy` captures the graph of the fitting batch size the first
        time it is needed (a server sees few of them; capturing all costs start-up time and memory)."""
        b = ids.shape[0]
        if lazy and self.enabled:
            size = next((s for s in self.batch_sizes if s >= b), None)
            if size is not None and size not in self.graphs:
                self.capture([size])
        fit = next((s for s in self.batch_sizes if s >= b and s in self.graphs), None)
        if fit is None:
            with torch.inference_mode():
                return self._forward(ids, pos, block_table, shift)
        short = max_len is not None and max_len <= SHORT_CONTEXT and fit in self.short
        graph, s_ids, s_pos, s_bt, s_shift, out = (self.short if short else self.graphs)[fit]
        s_ids[:b].copy_(ids)
        s_pos[:b].copy_(pos)
        s_bt[:b, : block_table.shape[1]].copy_(block_table)
        if s_shift is not None:
            if shift is None:
                s_shift.zero_()
            else:
                s_shift[:b].copy_(shift)
        if fit > b:
            s_ids[b:].zero_()
            s_pos[b:].zero_()
            s_bt[b:].fill_(self.scratch)
            if s_shift is not None:
                s_shift[b:].zero_()
        graph.replay()
        return out[:b]
