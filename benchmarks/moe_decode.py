"""Mixture-of-experts decode speed: a fabricated Qwen3-30B-A3B-shaped EXL2 model (128 experts, 8 a token; 4.0 bpw
body, 6-bit head; `--layers` of its 48 decoder layers, fabricating all 48 takes minutes) decoding one token per
sequence at context 128, through three paths of the MoE blocks:

* grouped: tokens grouped by expert, one host read a layer and a gemv an active expert (eager; the only path
  before the routed kernels, and still the one for prompts),
* routed: the routed kernels (`kernels.routed_gemv`), eager,
* graph: the routed kernels inside the decode step's CUDA graph (what `exl2` runs).

Prints ms a step and tokens/s per batch size, and the weight bytes a step reads at batch 1 with the bandwidth
that implies (the bound is the GPU's copy bandwidth over those bytes). With fewer layers than 48, the `48-layer
est.` column scales the measured layer time to the whole model (the head is counted once).

    python3 benchmarks/moe_decode.py [--layers 8] [--batch 1,4,16] [--iters 20]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.models import routed_experts  # noqa: E402
from exl2.runtime.benchmark import _time, weight_bytes  # noqa: E402
from exl2.runtime.graphs import DecodeGraphs  # noqa: E402
from exl2.runtime.paged_cache import PagedKVCache  # noqa: E402
from exl2.runtime.synthetic import QWEN3_30B_A3B, synthetic_model  # noqa: E402


def head_bytes(source) -> int:
    """Bytes a step reads outside the decoder layers: the head, the final norm, one embedding row."""
    return weight_bytes({k: source[k] for k in source.keys() if not k.startswith("model.layers.")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    cfg = QWEN3_30B_A3B
    model, source = synthetic_model(dev, layers=args.layers, shape=cfg)
    head_b = head_bytes(source)
    layer_b = weight_bytes(source, model.spec) - head_b
    print(f"{torch.cuda.get_device_name()}; {args.layers} of {cfg['num_hidden_layers']} layers; a batch-1 step "
          f"reads {layer_b / 1e6:.0f} MB in the layers ({layer_b / args.layers / 1e6:.1f} MB a layer) and "
          f"{head_b / 1e6:.0f} MB in the head")
    page = 256
    pages = -(-(args.ctx + 64) // page)
    big = max(batches)
    cache = PagedKVCache(model.spec, num_pages=1 + big * pages, page_size=page, mode="fp16", device=dev,
                         dtype=model.dtype)
    graphs = DecodeGraphs(model, cache, pages, scratch_page=0)
    graphs.capture(tuple(sorted(set(min(b for b in (1, 2, 4, 8, 16) if b >= x) for x in batches))))
    table = (1 + torch.arange(big * pages, device=dev, dtype=torch.int32)).view(big, -1)
    with torch.inference_mode():
        for b in range(big):
            cache.bind(table[b:b + 1])
            model(torch.randint(0, cfg["vocab_size"], (1, args.ctx), device=dev), cache, 0, last_only=True)
    limit = routed_experts.ROUTED_MAX_ROWS
    print("| batch | path | ms a step | tok/s | 48-layer est. tok/s | GB/s at batch 1 |")
    print("|---:|---|---:|---:|---:|---:|")
    for b in batches:
        ids = torch.randint(0, cfg["vocab_size"], (b, 1), device=dev)
        pos = torch.full((b,), args.ctx, device=dev)

        def eager():
            cache.bind(table[:b])
            with torch.inference_mode():
                model(ids, cache, pos, last_only=True)

        times = {}
        for name in ("grouped", "routed"):
            routed_experts.ROUTED_MAX_ROWS = 0 if name == "grouped" else max(limit, b)
            eager()
            times[name] = _time(eager, args.iters)
        routed_experts.ROUTED_MAX_ROWS = limit
        times["graph"] = _time(lambda: graphs.step(ids, pos, table[:b], max_len=args.ctx + 1), args.iters)
        # the head's share of a step, estimated from its bytes at the graph's rate
        for name, dt in times.items():
            head_t = dt * head_b / (layer_b + head_b)
            est = (dt - head_t) * cfg["num_hidden_layers"] / args.layers + head_t
            gbs = f"{(layer_b + head_b) / dt / 1e9:.0f}" if b == 1 else ""
            print(f"| {b} | {name} | {dt * 1e3:.2f} | {b / dt:.0f} | {b / est:.0f} | {gbs} |")


if __name__ == "__main__":
    main()
