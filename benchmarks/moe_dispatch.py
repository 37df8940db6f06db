"""What grouping tokens by expert costs a mixture-of-experts block on the GPU: the per-expert dispatch
(`torch.unique`, then a `nonzero` per active expert, each a wait for the host) against the sorted one MoE.forward
uses now (one argsort, one read of the counts), on a block shaped like Qwen3-30B-A3B's (128 experts, 8 a token,
hidden 2048, experts 768 wide, fp16 dense experts), at decode batch sizes. Both give the same output; the table
shows microseconds per block call and the ratio.

    python3 benchmarks/moe_dispatch.py [--experts 128] [--top-k 8] [--hidden 2048] [--dim 768] [--batch 1,4,16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.models.layers import GatedMLP, MoE  # noqa: E402
from exl2.models.spec import MoESpec  # noqa: E402


class _Dense(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def per_expert(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The previous dispatch: one host read for the active experts, then one `nonzero` (another) per expert."""
    flat = x.reshape(-1, x.shape[-1])
    idx, w = moe.route(flat)
    out = torch.zeros_like(flat)
    for e in torch.unique(idx).tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, moe.experts[e](flat[rows]) * w[rows, slot].to(flat.dtype)[:, None])
    return out.view(x.shape)


def timed(fn, x: torch.Tensor, reps: int) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_dispatch.py needs a CUDA GPU.")
    dev, h, d = torch.device("cuda"), args.hidden, args.dim
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(rows, cols):
        return torch.randn(rows, cols, generator=g, device=dev, dtype=torch.float16) * cols ** -0.5

    experts = [GatedMLP(_Dense(weight(d, h)), _Dense(weight(d, h)), _Dense(weight(h, d)), "silu")
               for _ in range(args.experts)]
    spec = MoESpec(num_experts=args.experts, top_k=args.top_k, expert_dim=d, router="softmax", style="qwen")
    moe = MoE(spec, weight(args.experts, h), experts, None)
    print("| tokens | per-expert µs | sorted µs | speedup |\n|---:|---:|---:|---:|")
    with torch.inference_mode():
        for n in (int(b) for b in args.batch.split(",")):
            x = torch.randn(n, h, generator=g, device=dev, dtype=torch.float16)
            assert torch.equal(per_expert(moe, x), moe(x))
            old, new = timed(lambda t: per_expert(moe, t), x, args.reps), timed(moe, x, args.reps)
            print(f"| {n} | {old:.0f} | {new:.0f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
