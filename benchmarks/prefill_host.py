"""Where the host spends one prefill of the synthetic 8B model: cProfile of the forward's launches (no sync until
the end), next to its wall and GPU-synchronized time. Prints the functions with the most own time.

    python3 benchmarks/prefill_host.py [--tokens 2047] [--layers 32] [--top 25]
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
from exl2.runtime.paged_cache import PagedKVCache  # noqa: E402
from exl2.runtime.synthetic import LLAMA3_8B, DictSource, llama_exl2_tensors  # noqa: E402
from exl2.runtime.weights import WeightLoader  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2047)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
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
        ids = torch.randint(0, model.spec.vocab_size, (1, a.tokens), device=dev)
        for _ in range(2):
            model(ids, cache, 0, last_only=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, cache, 0, last_only=True)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        model(ids, cache, 0, last_only=True)
        prof.disable()
        torch.cuda.synchronize()
    print(f"host (issuing) {host * 1e3:.2f} ms, wall {wall * 1e3:.2f} ms, {a.tokens / wall:,.0f} tok/s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
