"""What LoRA adapters cost a decoding batch: greedy decode tok/s of N requests on the synthetic 8B model with no
adapter, one adapter active for every request (global, `set_loras`), the same adapter chosen by every request,
and half the batch on each of two adapters chosen per request (`Job.loras`: each attached adapter's delta scaled
per row, read inside the decode graphs). Random rank-r adapters on q/k/v/o of every layer. Prints a table. Run on
a CUDA machine:

    python benchmarks/lora_batch.py [--batches 1,4,16] [--rank 16] [--prompt 128] [--new 64] [--layers N]
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.config import SamplingSettings  # noqa: E402
from exl2.generation.dynamic import DynamicGenerator, Job  # noqa: E402
from exl2.runtime.lora import LoraAdapter  # noqa: E402
from serving import synthetic_on_cuda  # noqa: E402 - the same model and tokenizer as the serving benchmark

GREEDY = SamplingSettings(temperature=0)


def write_adapter(root: Path, name: str, model, rank: int, seed: int) -> Path:
    """A random PEFT adapter on every attention projection of `model` (small: replies stay sensible)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(layer.self_attn, proj)
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.01
    path = root / name
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank}))
    return path


def decode_rate(gen: DynamicGenerator, batch: int, prompt: int, new: int, vocab: int, choices, seed: int) -> float:
    """Decode tok/s in total of `batch` requests (request i with choices[i % len(choices)])."""
    g = torch.Generator().manual_seed(seed)
    jobs = [Job(torch.randint(10, vocab, (prompt,), generator=g).tolist(), GREEDY, new,
                loras=choices[i % len(choices)]) for i in range(batch)]
    for job in jobs:
        gen.enqueue(job)
    first = None
    while gen.has_work():
        gen.iterate()
        if first is None and all(len(j.tokens) > len(j.ids) or j.done for j in jobs):
            torch.cuda.synchronize()
            first = time.perf_counter()
    torch.cuda.synchronize()
    return batch * (new - 1) / (time.perf_counter() - first)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="fewer layers, for a quick check")
    args = p.parse_args()
    loaded = synthetic_on_cuda("lora_batch.py", args.layers)
    if loaded is None:
        return 2
    model, tok = loaded
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as d:
        a, b = (LoraAdapter.from_dir(write_adapter(Path(d), n, model, args.rank, s), model)
                for n, s in (("a", 1), ("b", 2)))
    gen = DynamicGenerator(model, tok, args.prompt + args.new + 64, max_batch=max(batches),
                           cache_tokens=max(batches) * (args.prompt + args.new + 256))
    variants = [("no adapter", [], [None]), ("one adapter, global", [a], [None]),
                ("one adapter, per request", [], [((a, 1.0),)]),
                ("two adapters, per request", [], [((a, 1.0),), ((b, 1.0),)])]
    vocab = model.spec.vocab_size
    print(f"decode tok/s in total, greedy, prompts of {args.prompt} tokens, {args.new} new, rank-{args.rank} "
          f"adapters on q/k/v/o, {torch.cuda.get_device_name()}")
    print("| batch | " + " | ".join(name for name, _, _ in variants) + " |\n|" + " --- |" * (len(variants) + 1))
    for batch in batches:
        rates = []
        for name, globals_, choices in variants:
            gen.set_loras(globals_)
            decode_rate(gen, batch, args.prompt, 8, vocab, choices, seed=1000 + batch)   # capture, compile
            rates.append(decode_rate(gen, batch, args.prompt, args.new, vocab, choices, seed=batch))
        print(f"| {batch} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
