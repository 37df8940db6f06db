"""`exl2 eval`: perplexity of a model, and with --ref the KL divergence and top-1 agreement against a reference."""
from __future__ import annotations

import json
from typing import Optional


def register(sub) -> None:
    from exl2.cli.common import add_experts_arg, add_gpu_args, add_rope_args
    from exl2.quantize.evaluate import DEFAULT_CHUNK, DEFAULT_LENGTH, DEFAULT_ROWS

    p = sub.add_parser(
        "eval", help="perplexity, and KL divergence / top-1 agreement against a reference model",
        description="Evaluate a model on held-out text: perplexity, and with --ref the mean KL divergence "
                    "KL(ref || model) and the top-1 agreement of the next-token distributions on the same tokens. "
                    "The built-in text (Python's pydoc topics) is never part of the built-in calibration set. "
                    "With a quantized -cm the model reads each row in chunks through a KV cache of that mode, so "
                    "that later chunks attend to keys/values read back from it: what the cache costs in quality.")
    p.add_argument("-m", "--model_dir", "--model", dest="model_dir", default=None,
                   help="model to evaluate (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--ref", default=None, help="reference model directory (e.g. the fp16 source of a conversion)")
    p.add_argument("--data", default=None, help="evaluation text: .parquet, .jsonl or .txt (default: built-in)")
    p.add_argument("-r", "--rows", type=int, default=DEFAULT_ROWS, help=f"rows to evaluate (default {DEFAULT_ROWS})")
    p.add_argument("-l", "--length", type=int, default=DEFAULT_LENGTH,
                   help=f"tokens per row (default {DEFAULT_LENGTH})")
    p.add_argument("-cm", "--cache-mode", "--cache_mode", dest="cache_mode", default="fp16",
                   choices=["fp16", "q8", "q6", "q4", "q3", "q2"],
                   help="the model's KV cache: fp16 or quantized (q8, q6 = 8-bit keys/4-bit values, q4, q3, q2); "
                        "--ref always runs uncached (default fp16: one uncached forward per row)")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"tokens per forward through the cache (default {DEFAULT_CHUNK} with a quantized -cm; "
                        "with fp16, --chunk runs the fp16 paged cache the same way, a control for the chunking)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    add_rope_args(p)  # the model's and --ref's: both read the rows with the same positions
    add_experts_arg(p)  # the model's only: --ref keeps its own routing (what fewer experts cost)
    add_gpu_args(p, "; --ref is placed the same way, planned on its own (with 'auto', over what the model left)")
    p.add_argument("--prefill-fp8", "--prefill_fp8", dest="prefill_fp8", action="store_true",
                   help="the model's matmuls in FP8 where it would use them for prompts (GPUs from sm_89); --ref "
                        "stays exact, so --ref on the same model measures what FP8 prompts cost")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def cache_settings(args, warn) -> tuple[Optional[str], int]:
    """(the model's cache mode, None for one uncached forward per row; tokens per chunk). fp16 without --chunk keeps
    the uncached forward; a chunk as long as the rows would never read the cache back, hence the warning."""
    from exl2.errors import ConfigError
    from exl2.quantize.evaluate import DEFAULT_CHUNK

    if args.chunk is not None and args.chunk < 1:
        raise ConfigError(f"--chunk must be at least 1 token, not {args.chunk}.")
    chunk = args.chunk or DEFAULT_CHUNK
    if args.cache_mode == "fp16" and args.chunk is None:
        return None, chunk
    if args.cache_mode != "fp16" and chunk >= args.length:
        warn(f"--chunk {chunk} covers whole rows of {args.length} tokens: the {args.cache_mode} cache is written "
             "but never read, so it cannot change the result; use a smaller --chunk")
    return args.cache_mode, chunk


def run(args) -> int:
    import torch

    from exl2.cli.common import resolve_model_dir, rope_from_args
    from exl2.errors import ConfigError
    from exl2.generation.tokenizer import Tokenizer
    from exl2.quantize.evaluate import eval_rows, evaluate, row_cache
    from exl2.quantize.progress import Reporter
    from exl2.runtime.linear import quant_kernels
    from exl2.runtime.loader import load_model
    from exl2.runtime.placement import parse_gpu_split

    if args.rows < 1 or args.length < 2:
        raise ConfigError("-r must be at least 1 and -l at least 2.")
    ui = Reporter(quiet=args.json)
    cache_mode, chunk = cache_settings(args, ui.warn)
    rope = rope_from_args(args)
    split = parse_gpu_split(args.gpu_split)
    model_dir = resolve_model_dir(args.model_dir)
    tok = Tokenizer.from_dir(model_dir)
    ids, warning = eval_rows(tok, args.data, args.rows, args.length)
    if warning:
        ui.warn(warning)
    dtype = torch.float32 if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu" else None
    model = load_model(model_dir, args.device, dtype, gpu_split=split, cache_tokens=args.length,
                       cache_mode=args.cache_mode, tensor_parallel=args.tensor_parallel, rope=rope,
                       experts_per_token=args.experts_per_token, prefill_fp8=args.prefill_fp8)
    if cache_mode is not None:
        row_cache(model, cache_mode, 1)  # a model that cannot use the mode fails now, not after loading --ref
    ref = None
    if args.ref:
        ref = load_model(args.ref, args.device, dtype, gpu_split=split, cache_tokens=args.length,
                         tensor_parallel=args.tensor_parallel, rope=rope)
        if ref.spec.vocab_size != model.spec.vocab_size:
            raise ConfigError(f"The reference model has a vocabulary of {ref.spec.vocab_size} tokens and the model "
                              f"{model.spec.vocab_size}; they must share a tokenizer.")
    with ui.stage("evaluation", ids.shape[0]) as tick:
        res = evaluate(model, ids, ref, lambda: tick(1), cache_mode, chunk)
    fp8 = args.prefill_fp8 and any(w.prefill_fp8 for w in quant_kernels(model))
    if args.json:
        print(json.dumps(res.as_dict() | ({"prefill_fp8": True} if fp8 else {})))
        return 0
    if fp8:
        print("matmuls         FP8 (e4m3) where rows > 64")
    print(f"tokens          {res.tokens}")
    print(f"cache mode      {res.cache_mode}" + (f", chunks of {res.chunk} tokens" if res.chunk else ", uncached"))
    print(f"perplexity      {res.perplexity:.4f}")
    if res.kl is not None:
        print(f"ref perplexity  {res.ref_perplexity:.4f}")
        print(f"KL(ref||model)  {res.kl:.5f}")
        print(f"top-1 agreement {100 * res.top1:.2f} %")
    return 0
