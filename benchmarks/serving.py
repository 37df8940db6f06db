"""What a server gets out of the dynamic generator: N requests submitted at once on the synthetic 8B model (or -m
MODEL), each a random prompt and a fixed number of new tokens. Prints per batch: time to the first token, decode
tokens/s in total, and the whole run's tokens/s; compare the decode column with `exl2 bench` at the same batch
(the bare graph replay: what the generator's host work costs is the difference), greedy and sampled (temperature
0.8, top-p 0.9), with the decode steps overlapping the host's work and without. Then the cost of checking k
speculative guesses in one step against a plain step. Run on a CUDA machine:

    python benchmarks/serving.py [--batches 1,4,16] [--prompt 128] [--new 128] [--cache-mode fp16]
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.config import SamplingSettings  # noqa: E402
from exl2.generation.dynamic import DynamicGenerator, Job  # noqa: E402
from exl2.runtime.synthetic import synthetic_model, synthetic_tokenizer  # noqa: E402


GREEDY = SamplingSettings(temperature=0)
SAMPLED = SamplingSettings(temperature=0.8, top_p=0.9)
VARIANTS = [(name, settings, overlap) for name, settings in (("greedy", GREEDY), ("T 0.8, top-p 0.9", SAMPLED))
            for overlap in (True, False)]
# a roleplay front end's usual mix (--extended): min-p with DRY and XTC, which run on the PyTorch path and keep
# their jobs' steps from being launched ahead (DRY reads each token on the host)
ROLEPLAY = SamplingSettings(temperature=1.0, min_p=0.05, dry_multiplier=0.8, xtc_probability=0.5)
# classifier-free guidance (--cfg): every job decodes a second sequence (its negative prompt, the BOS token)
GUIDED = SamplingSettings(temperature=0, cfg_scale=1.5)


def synthetic_on_cuda(script: str, layers: Optional[int]):
    """(the synthetic 8B model on the GPU, its tokenizer), or None (having said why) without a GPU."""
    if not torch.cuda.is_available():
        print(f"error: benchmarks/{script} needs a CUDA GPU.", file=sys.stderr)
        return None
    return synthetic_model(torch.device("cuda"), layers)[0], synthetic_tokenizer()


def run(gen: DynamicGenerator, batch: int, prompt: int, new: int, vocab: int, seed: int = 0,
        settings: SamplingSettings = GREEDY, spread: float = 0.0, sizes_seed: int = 0, repeat: int = 0,
        jobs_out: Optional[list] = None) -> tuple[float, float, float]:
    """(time to first token of the last request admitted, decode tok/s over all requests, overall tok/s). Prompt
    lengths are drawn from prompt · [1 - spread, 1 + spread] (by `sizes_seed`, so a warm-up can use the measured
    shapes), their tokens by `seed` (so nothing comes from the prompt cache); `repeat` > 0 makes each prompt one
    random chunk of that many tokens over and over (text an n-gram drafter finds repeats in). `jobs_out` receives
    the jobs."""
    lo, hi = max(1, round(prompt * (1 - spread))), max(1, round(prompt * (1 + spread)))
    sizes = torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(sizes_seed)).tolist()
    g = torch.Generator().manual_seed(seed)
    texts = [torch.randint(10, vocab, (repeat or n,), generator=g).tolist() for n in sizes]
    jobs = [Job((t * (n // len(t) + 1))[:n], settings, new) for t, n in zip(texts, sizes)]
    if jobs_out is not None:
        jobs_out += jobs
    for job in jobs:
        gen.enqueue(job)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = None
    while gen.has_work():
        gen.iterate()
        if first is None and all(len(j.tokens) > len(j.ids) or j.done for j in jobs):  # each has sampled
            first = time.perf_counter()
    end = time.perf_counter()
    decoded = batch * (new - 1)
    return first - t0, decoded / (end - first), batch * new / (end - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--cache-mode", default="fp16")
    p.add_argument("--spread", type=float, default=0.5, help="prompt lengths vary by this fraction (default 0.5)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers, for a quick check")
    p.add_argument("--extended", action="store_true", help="also min-p + DRY + XTC (a roleplay front end's mix)")
    p.add_argument("--cfg", action="store_true", help="also greedy with classifier-free guidance (scale 1.5)")
    p.add_argument("--no-speculative", action="store_true", help="skip the speculative check-step table")
    p.add_argument("--ngram", action="store_true",
                   help="also greedy decoding with n-gram drafts, prompts repeating a 32-token chunk: decode tok/s "
                        "with and without, and the guesses kept (a random model's replies repeat little: run it "
                        "with a real model's numbers in mind)")
    args = p.parse_args()
    variants = VARIANTS + ([("min-p 0.05, DRY 0.8, XTC 0.5", ROLEPLAY, True)] if args.extended else []) \
        + ([("greedy, CFG 1.5 (two sequences a job)", GUIDED, False)] if args.cfg else [])
    rows = 2 if args.cfg else 1
    loaded = synthetic_on_cuda("serving.py", args.layers)
    if loaded is None:
        return 2
    model, tok = loaded
    batches = [int(b) for b in args.batches.split(",")]
    longest = round(args.prompt * (1 + args.spread)) + args.new + 64
    gen = DynamicGenerator(model, tok, longest, args.cache_mode, cache_tokens=rows * max(batches) * (longest + 256),
                           max_batch=rows * max(batches))
    # Warm-up at the measured shapes (compiles the prefill's kernels, captures the decode graphs); other prompts
    # than the measured ones, so nothing comes from the prompt cache.
    for b in batches:  # every variant once, at the measured prompt shapes
        for _, settings, overlap in variants:
            gen.overlap = overlap
            run(gen, b, args.prompt, 4, model.spec.vocab_size, seed=1000 + b, settings=settings,
                spread=args.spread, sizes_seed=b)
    print(f"dynamic generator, prompts of {args.prompt} tokens ± {args.spread:.0%}, {args.new} new tokens, "
          f"{args.cache_mode} cache, {torch.cuda.get_device_name()}")
    print("| batch | sampling | overlap | first token (ms) | decode tok/s (total) | overall tok/s |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for b in batches:
        for name, settings, overlap in variants:
            gen.overlap = overlap
            ttft, decode, overall = run(gen, b, args.prompt, args.new, model.spec.vocab_size,
                                        seed=b * 100 + 2 * (settings is SAMPLED) + overlap, settings=settings,
                                        spread=args.spread, sizes_seed=b)
            print(f"| {b} | {name} | {'on' if overlap else 'off'} | {ttft * 1e3:.1f} | {decode:,.0f} | "
                  f"{overall:,.0f} |", flush=True)
    gen.overlap = True
    if args.ngram:
        ngram_table(gen, model, tok, batches, args, longest)
    if args.no_speculative:
        return 0
    print("\nspeculative decoding: one step checking k guesses per sequence against a plain decode step of the "
          "same batch\n(break-even: the guesses a sequence must keep per check for drafting to pay, the drafting "
          "itself not counted)")
    print("| batch | tokens fed per sequence | step (ms) | against plain | break-even guesses kept |\n"
          "| --- | --- | --- | --- | --- |")
    for b in (1, 2, 4, 8):
        plain = None
        for k in (0, 2, 4, 8):
            t = verify_step_ms(model, args.prompt, k, args.cache_mode, b)
            plain = plain or t
            print(f"| {b} | {k + 1} | {t:.3f} | {t / plain:.2f}x | {t / plain - 1:.2f} |", flush=True)
    return 0


def ngram_table(plain: DynamicGenerator, model, tok, batches: list[int], args, longest: int) -> None:
    """Greedy decode tok/s of prompts repeating a 32-token chunk, without drafts and with n-gram drafts checked
    together (DynamicGenerator.check_guesses), and the share of guesses kept."""
    from exl2.generation.speculative import NgramDraft

    drafted = DynamicGenerator(model, tok, longest, args.cache_mode, cache_tokens=max(batches) * (longest + 256),
                               max_batch=max(batches), draft=NgramDraft())
    vocab = model.spec.vocab_size
    for b in batches:   # warm-up: compiles and captures the check graphs at the measured shapes
        run(drafted, b, args.prompt, 8, vocab, seed=3000 + b, spread=args.spread, sizes_seed=b, repeat=32)
    print("\nn-gram drafting, greedy, prompts repeating a 32-token chunk (the drafter's own guesses kept / checked;"
          " a row with fewer guesses is padded with its last one, and padding kept speeds decoding without counting"
          " here)")
    print("| batch | plain decode tok/s | drafted decode tok/s | guesses kept / checked |\n| --- | --- | --- | --- |")
    for b in batches:
        _, base, _ = run(plain, b, args.prompt, args.new, vocab, seed=4000 + b, spread=args.spread, sizes_seed=b,
                         repeat=32)
        jobs: list = []
        _, fast, _ = run(drafted, b, args.prompt, args.new, vocab, seed=4000 + b, spread=args.spread,
                         sizes_seed=b, repeat=32, jobs_out=jobs)
        kept, checked = sum(j.accepted for j in jobs), sum(j.drafted for j in jobs)
        print(f"| {b} | {base:,.0f} | {fast:,.0f} | {kept:,} / {checked:,} |", flush=True)


def verify_step_ms(model, context: int, k: int, cache_mode: str, batch: int = 1, iters: int = 50) -> float:
    """Time of one graph replay feeding 1 + k tokens to each of `batch` sequences after `context` cached
    tokens."""
    from exl2.runtime.graphs import DecodeGraphs
    from exl2.runtime.paged_cache import PagedKVCache

    page = 256
    pages = -(-(context + k + 1) // page)
    cache = PagedKVCache(model.spec, batch * pages + 1, page, cache_mode, model.device, model.dtype)
    graphs = DecodeGraphs(model, cache, pages, batch_sizes=(batch,), scratch_page=batch * pages, tokens=k + 1)
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, -1)
    ids = torch.randint(10, 1000, (batch, k + 1), device="cuda")
    pos = torch.full((batch,), context, device="cuda")
    for _ in range(3):  # the first replays pay for compiling and capturing
        graphs.step(ids, pos, table, lazy=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        graphs.step(ids, pos, table)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


if __name__ == "__main__":
    sys.exit(main())
