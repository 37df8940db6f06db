"""Where the host spends one prefill of the synthetic 8B model: cProfile of the forward's launches (no sync until
the end), next to its wall and GPU-synchronized time. Prints the functions with the most own time; `--gaps` adds
where the GPU sat idle between kernels (from the profiler's kernel timestamps), `--graph` the forward replayed as
one CUDA graph (the GPU time with no host in the way).

    python3 benchmarks/prefill_host.py [--tokens 2047] [--layers 32] [--top 25] [--gaps] [--graph] [--bench-setup]
                                       [--repeat N]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.models.decoder import DecoderModel  # noqa: E402
from exl2.models.registry import spec_from_config  # noqa: E402
from exl2.runtime.graphs import DecodeGraphs  # noqa: E402
from exl2.runtime.paged_cache import PagedKVCache  # noqa: E402
from exl2.runtime.synthetic import LLAMA3_8B, DictSource, llama_exl2_tensors  # noqa: E402
from exl2.runtime.weights import WeightLoader  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2047)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gaps", action="store_true")
    p.add_argument("--graph", action="store_true")
    p.add_argument("--bench-setup", action="store_true",
                   help="first capture the decode graphs for batch 1-16 as `exl2 bench` does before its prefill")
    p.add_argument("--repeat", type=int, default=1, help="time this many forwards (host and wall each)")
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg = dict(LLAMA3_8B, num_hidden_layers=a.layers)
    with torch.inference_mode():
        model = DecoderModel(spec_from_config(cfg), WeightLoader(DictSource(llama_exl2_tensors(cfg, device=dev)),
                                                                 dev, torch.float16)).eval()
        pages = -(-(a.tokens + 64) // 256)
        cache = PagedKVCache(model.spec, num_pages=1 + pages, page_size=256, mode="fp16", device=dev,
                             dtype=model.dtype)
        cache.bind((1 + torch.arange(pages, device=dev, dtype=torch.int32)).view(1, -1))
        if a.bench_setup:
            graphs = DecodeGraphs(model, PagedKVCache(model.spec, num_pages=1 + 16 * pages, page_size=256,
                                                      mode="fp16", device=dev, dtype=model.dtype), pages)
            graphs.capture()
        ids = torch.randint(0, model.spec.vocab_size, (1, a.tokens), device=dev)
        for _ in range(2):
            model(ids, cache, 0, last_only=True)
        for _ in range(a.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids, cache, 0, last_only=True)
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            print(f"host (issuing) {host * 1e3:.2f} ms, wall {wall * 1e3:.2f} ms, {a.tokens / wall:,.0f} tok/s")
        prof = cProfile.Profile()
        prof.enable()
        model(ids, cache, 0, last_only=True)
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    if a.gaps:
        with torch.inference_mode():
            print_gaps(lambda: model(ids, cache, 0, last_only=True), a.top)
    if a.graph:
        with torch.inference_mode():
            time_graph(lambda: model(ids, cache, 0, last_only=True), a.tokens)


def print_gaps(fn, top: int) -> None:
    """The GPU's idle time between consecutive kernels of one call of `fn`: the largest gaps with the kernels on
    either side, and the idle time summed by the kernel that ended it."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name[:48]) for ev in prof.events()
                     if ev.device_type.name == "CUDA")
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(kernels, kernels[1:])]
    busy = sum(e - s for s, e, _ in kernels)
    span = kernels[-1][1] - kernels[0][0]
    print(f"\n{len(kernels)} kernels, span {span:,.0f} µs, busy {busy:,.0f} µs, idle {span - busy:,.0f} µs")
    print("largest gaps (µs, after -> before):")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {g:9.1f}  {before} -> {after}")
    by_next: dict[str, list[float]] = {}
    for g, _, after in gaps:
        by_next.setdefault(after, []).append(max(g, 0.0))
    print("idle time by the kernel that ended it (µs total, count, mean):")
    for name, gs in sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(gs):9.1f} {len(gs):5d} {sum(gs) / len(gs):7.2f}  {name}")


def time_graph(fn, tokens: int) -> None:
    """The forward captured as one CUDA graph and replayed: its time is what the GPU needs with no launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - report why the forward cannot be captured and go on
        print(f"\ngraph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 5
    print(f"\nforward as one CUDA graph: {dt * 1e3:.2f} ms, {tokens / dt:,.0f} tok/s")


if __name__ == "__main__":
    main()
