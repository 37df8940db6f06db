"""Decode/prefill throughput of a model on the GPU, against the memory-bandwidth bound (`exl2 bench`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from exl2.models.decoder import DecoderModel
from exl2.runtime.graphs import DecodeGraphs
from exl2.runtime.linear import quant_kernels, set_prefill_fp8
from exl2.runtime.paged_cache import PagedKVCache

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (DESIGN.md)


@dataclass
class Row:
    name: str
    tokens_per_s: float
    bound: Optional[float] = None

    @property
    def pct(self) -> Optional[float]:
        return 100 * self.tokens_per_s / self.bound if self.bound else None


def weight_bytes(source, spec=None) -> int:
    """Bytes one decode step must read from the model files: every tensor but the embedding table, of which one
    row is read; of a mixture-of-experts `spec`'s routed experts, the share one token picks (top_k of them)."""
    active = spec.moe.top_k / spec.moe.num_experts if spec is not None and spec.moe is not None else 1.0
    total = 0.0
    for name in source.keys():
        t = source[name]
        if name == "model.embed_tokens.weight":
            total += t.shape[1] * t.element_size()
        else:
            total += t.numel() * t.element_size() * (active if ".experts." in name else 1.0)
    return int(total)


def _time(fn: Callable[[], object], iters: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def run_benchmark(model: DecoderModel, wbytes: int, modes=("fp16", "q4"), contexts=(128, 2048),
                  prefill_len: int = 2047, batches: Sequence[int] = (16,), page_size: int = 256,
                  iters: int = 50, log=print, fp8_prefill: bool = False) -> list[Row]:
    """Rows of the benchmark table; `wbytes` is the weight bytes read per decode step (see weight_bytes).
    `batches`: the batch sizes decoded at the first context besides batch 1. `fp8_prefill`: a second prefill row
    with the prompt matmuls in FP8 (`set_prefill_fp8`; the model is left as it was)."""
    dev = model.device
    max_ctx = max(max(contexts), prefill_len) + 64
    pages_per_seq = -(-max_ctx // page_size)
    rows: list[Row] = []
    vocab = model.spec.vocab_size
    big_batch = max(batches)
    for mode in modes:
        cache = PagedKVCache(model.spec, num_pages=1 + big_batch * pages_per_seq, page_size=page_size, mode=mode,
                             device=dev, dtype=model.dtype)
        graphs = DecodeGraphs(model, cache, pages_per_seq, scratch_page=0)
        graphs.capture()
        table = (1 + torch.arange(big_batch * pages_per_seq, device=dev, dtype=torch.int32)).view(big_batch, -1)
        kv_token = cache.bytes_per_token()
        if mode == modes[0]:
            ids = torch.randint(0, vocab, (1, prefill_len), device=dev)
            cache.bind(table[:1])

            def prefill():
                with torch.inference_mode():
                    model(ids, cache, 0, last_only=True)
            kernels = quant_kernels(model)
            before = [w.prefill_fp8 for w in kernels]
            for fp8 in (False, True) if fp8_prefill else (False,):
                set_prefill_fp8(model, fp8)
                prefill()
                dt = _time(prefill, 3)
                rows.append(Row(f"prefill {prefill_len} tokens{', FP8 matmuls' if fp8 else ''} ({mode} cache)",
                                prefill_len / dt))
                log(rows[-1])
            for w, was in zip(kernels, before):
                w.prefill_fp8 = was
        for ctx in contexts:
            ids = torch.randint(0, vocab, (1, 1), device=dev)
            pos = torch.full((1,), ctx, device=dev)
            dt = _time(lambda: graphs.step(ids, pos, table[:1], max_len=ctx + 1), iters)
            bound = COPY_BANDWIDTH / (wbytes + kv_token * ctx)
            rows.append(Row(f"decode bs=1 ctx={ctx} ({mode} cache)", 1 / dt, bound))
            log(rows[-1])
        for b in batches:
            ids = torch.randint(0, vocab, (b, 1), device=dev)
            pos = torch.full((b,), contexts[0], device=dev)
            dt = _time(lambda: graphs.step(ids, pos, table[:b], max_len=contexts[0] + 1), iters)
            bound = b * COPY_BANDWIDTH / (wbytes + b * kv_token * contexts[0])
            rows.append(Row(f"decode bs={b} ctx={contexts[0]} ({mode} cache), total", b / dt, bound))
            log(rows[-1])
        graphs = cache = None  # free this mode's graphs and pages before the next mode allocates its own
        torch.cuda.empty_cache()
    return rows


def kernel_breakdown(model: DecoderModel, page_size: int = 256, ctx: int = 2048, top: int = 15,
                     batch: int = 1, mode: str = "fp16") -> list[tuple]:
    """Per-kernel GPU time of one captured decode step of `batch` sequences at `ctx` over a `mode` cache:
    [(kernel, calls, µs, share)]."""
    dev = model.device
    pages = -(-(ctx + 64) // page_size)
    cache = PagedKVCache(model.spec, num_pages=1 + batch * pages, page_size=page_size, mode=mode, device=dev,
                         dtype=model.dtype)
    graphs = DecodeGraphs(model, cache, pages)
    graphs.capture((batch,))
    table = (1 + torch.arange(batch * pages, device=dev, dtype=torch.int32)).view(batch, -1)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.full((batch,), ctx, device=dev)
    for _ in range(3):
        graphs.step(ids, pos, table, max_len=ctx + 1)
    torch.cuda.synchronize()
    return _profile_kernels(lambda: graphs.step(ids, pos, table, max_len=ctx + 1), 5, top)


def prefill_breakdown(model: DecoderModel, length: int = 2047, page_size: int = 256, top: int = 15,
                      mode: str = "fp16") -> list[tuple]:
    """Per-kernel GPU time of one `length`-token prefill (eager, as `run_benchmark` times it), then rows for the
    forward's wall-clock µs, its GPU span (first to last kernel, events, no profiler: above the kernel
    total by the time the GPU sat between kernels) and the time the host took to issue it."""
    dev = model.device
    pages = -(-(length + 64) // page_size)
    cache = PagedKVCache(model.spec, num_pages=1 + pages, page_size=page_size, mode=mode, device=dev,
                         dtype=model.dtype)
    cache.bind((1 + torch.arange(pages, device=dev, dtype=torch.int32)).view(1, -1))
    ids = torch.randint(0, model.spec.vocab_size, (1, length), device=dev)

    def prefill():
        with torch.inference_mode():
            model(ids, cache, 0, last_only=True)
    prefill()
    wall = _time(prefill, 3) * 1e6
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    prefill()
    end.record()
    host = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    span = begin.elapsed_time(end) * 1e3
    timing = [("wall", 0, wall, 0.0), ("GPU span (events, not profiled)", 0, span, 0.0),
              ("host (issuing only)", 0, host, 0.0)]
    return _profile_kernels(prefill, 2, top) + timing


def _profile_kernels(fn: Callable[[], object], iters: int, top: int) -> list[tuple]:
    """[(kernel, calls, µs, share)] per call of `fn`, the `top` largest and a `total` row."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    stats = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        n, t = stats.get(ev.name, (0, 0.0))
        stats[ev.name] = (n + 1, t + ev.device_time / iters)
    total = sum(t for _, t in stats.values()) or 1.0
    rows = sorted(((k[:60], n // iters, t, t / total) for k, (n, t) in stats.items()), key=lambda r: -r[2])
    return rows[:top] + [("total", sum(r[1] for r in rows), total, 1.0)]


def format_table(rows: list[Row]) -> str:
    lines = [f"| {'measure':<46} | {'tok/s':>10} | {'bound tok/s':>11} | {'% of bound':>10} |",
             f"|{'-' * 48}|{'-' * 12}|{'-' * 13}|{'-' * 12}|"]
    for r in rows:
        b = f"{r.bound:,.0f}" if r.bound else "—"
        p = f"{r.pct:.0f} %" if r.pct else "—"
        lines.append(f"| {r.name:<46} | {r.tokens_per_s:>10,.0f} | {b:>11} | {p:>10} |")
    return "\n".join(lines)
