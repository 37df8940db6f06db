"""`exl2 eval`: perplexity of a model, and with --ref the KL divergence and top-1 agreement against a reference."""
from __future__ import annotations

import json


def register(sub) -> None:
    from exl2.cli.common import add_gpu_args
    from exl2.quantize.evaluate import DEFAULT_LENGTH, DEFAULT_ROWS

    p = sub.add_parser(
        "eval", help="perplexity, and KL divergence / top-1 agreement against a reference model",
        description="Evaluate a model on held-out text: perplexity, and with --ref the mean KL divergence "
                    "KL(ref || model) and the top-1 agreement of the next-token distributions on the same tokens. "
                    "The built-in text (Python's pydoc topics) is never part of the built-in calibration set.")
    p.add_argument("-m", "--model_dir", "--model", dest="model_dir", default=None,
                   help="model to evaluate (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--ref", default=None, help="reference model directory (e.g. the fp16 source of a conversion)")
    p.add_argument("--data", default=None, help="evaluation text: .parquet, .jsonl or .txt (default: built-in)")
    p.add_argument("-r", "--rows", type=int, default=DEFAULT_ROWS, help=f"rows to evaluate (default {DEFAULT_ROWS})")
    p.add_argument("-l", "--length", type=int, default=DEFAULT_LENGTH,
                   help=f"tokens per row (default {DEFAULT_LENGTH})")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    add_gpu_args(p, "; --ref is placed the same way, planned on its own (with 'auto', over what the model left)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from exl2.cli.common import resolve_model_dir
    from exl2.errors import ConfigError
    from exl2.generation.tokenizer import Tokenizer
    from exl2.quantize.evaluate import eval_rows, evaluate
    from exl2.quantize.progress import Reporter
    from exl2.runtime.loader import load_model
    from exl2.runtime.placement import parse_gpu_split

    if args.rows < 1 or args.length < 2:
        raise ConfigError("-r must be at least 1 and -l at least 2.")
    split = parse_gpu_split(args.gpu_split)
    ui = Reporter(quiet=args.json)
    model_dir = resolve_model_dir(args.model_dir)
    tok = Tokenizer.from_dir(model_dir)
    ids, warning = eval_rows(tok, args.data, args.rows, args.length)
    if warning:
        ui.warn(warning)
    dtype = torch.float32 if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu" else None
    model = load_model(model_dir, args.device, dtype, gpu_split=split, cache_tokens=args.length,
                       tensor_parallel=args.tensor_parallel)
    ref = None
    if args.ref:
        ref = load_model(args.ref, args.device, dtype, gpu_split=split, cache_tokens=args.length,
                         tensor_parallel=args.tensor_parallel)
        if ref.spec.vocab_size != model.spec.vocab_size:
            raise ConfigError(f"The reference model has a vocabulary of {ref.spec.vocab_size} tokens and the model "
                              f"{model.spec.vocab_size}; they must share a tokenizer.")
    with ui.stage("evaluation", ids.shape[0]) as tick:
        res = evaluate(model, ids, ref, lambda: tick(1))
    if args.json:
        print(json.dumps(res.as_dict()))
        return 0
    print(f"tokens          {res.tokens}")
    print(f"perplexity      {res.perplexity:.4f}")
    if res.kl is not None:
        print(f"ref perplexity  {res.ref_perplexity:.4f}")
        print(f"KL(ref||model)  {res.kl:.5f}")
        print(f"top-1 agreement {100 * res.top1:.2f} %")
    return 0
