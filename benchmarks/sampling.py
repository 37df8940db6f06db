"""Where a sampled decode step's sampling time goes: `sample_rows` on [batch, 128,256] fp32 logits (Llama 3's
vocabulary) for several settings, GPU time per call (CUDA events over many calls, the host's launches included
since nothing else hides them), and with `--profile` the kernels of one call. Run on a CUDA machine:

    python benchmarks/sampling.py [--batches 1,16] [--vocab 128256] [--profile]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.config import SamplingSettings  # noqa: E402
from exl2.generation.dry import apply_dry  # noqa: E402
from exl2.generation.sampler import sample_rows  # noqa: E402

CASES = {
    "greedy": SamplingSettings(temperature=0),
    "T 0.8": SamplingSettings(temperature=0.8),
    "T 0.8, top-p 0.9": SamplingSettings(temperature=0.8, top_p=0.9),
    "T 0.8, top-k 50": SamplingSettings(temperature=0.8, top_k=50),
    "T 0.8, min-p 0.05": SamplingSettings(temperature=0.8, min_p=0.05),
    "T 0.8, top-p 0.9, penalty 1.1": SamplingSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.1),
    "T 0.8, top-k 50, top-p 0.9": SamplingSettings(temperature=0.8, top_k=50, top_p=0.9),
    "T 0.8, top-p 0.9, frequency 0.5": SamplingSettings(temperature=0.8, top_p=0.9, frequency_penalty=0.5),
    # the PyTorch path (generation.truncation): exllamav2's further samplers
    "T 1.0, typical 0.9": SamplingSettings(temperature=1.0, typical=0.9),
    "T 1.0, tail-free 0.95, top-a 0.1": SamplingSettings(temperature=1.0, tfs=0.95, top_a=0.1),
    "T 1.0, XTC 0.5 / 0.1, min-p 0.05": SamplingSettings(temperature=1.0, xtc_probability=0.5, min_p=0.05),
    "dynamic T 0.5-1.5, top-p 0.9": SamplingSettings(temperature=1.0, min_temp=0.5, max_temp=1.5, top_p=0.9),
    "T 1.0, Mirostat 2 (μ read back)": SamplingSettings(temperature=1.0, mirostat_mode=2),
}


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--profile", action="store_true", help="also list the kernels of one call per case (batch 16)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/sampling.py needs a CUDA GPU.", file=sys.stderr)
        return 1
    batches = [int(b) for b in a.batches.split(",")]
    print(f"sample_rows on [batch, {a.vocab:,}] fp32 logits, {torch.cuda.get_device_name()}")
    print("| case | " + " | ".join(f"batch {b} (ms)" for b in batches) + " |")
    print("| --- |" + " --- |" * len(batches))
    for name, s in CASES.items():
        cells = []
        for b in batches:
            logits = torch.randn(b, a.vocab, device="cuda") * 3
            seen = torch.zeros(b, a.vocab, dtype=torch.bool, device="cuda")
            seen[:, :512] = True
            counts = torch.zeros(b, a.vocab, device="cuda")
            counts[:, :256] = 2.0
            mus = [None] * b if s.mirostat else None
            cells.append(time_ms(lambda: sample_rows(logits, [s] * b, list(range(b)), [0] * b, seen, counts, mus)))
        print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    dry = SamplingSettings(temperature=1.0, dry_multiplier=0.8)
    breakers = torch.zeros(a.vocab, dtype=torch.bool)
    breakers[:200] = True
    cells = []
    for b in batches:
        logits = torch.randn(b, a.vocab, device="cuda") * 3
        history = torch.randint(0, 2000, (4096,)).tolist()  # a small alphabet: many repeats to match
        cells.append(time_ms(lambda: apply_dry(logits, [(i, history, dry, breakers) for i in range(b)])))
    print("| DRY penalties over 4,096 tokens a row (apply_dry) | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        b = max(batches)
        logits = torch.randn(b, a.vocab, device="cuda") * 3
        for name in ("T 0.8, top-p 0.9",):
            s = CASES[name]
            sample_rows(logits, [s] * b, list(range(b)), [0] * b)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                sample_rows(logits, [s] * b, list(range(b)), [0] * b)
                torch.cuda.synchronize()
            print(f"\nkernels of one call, {name}, batch {b}:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
