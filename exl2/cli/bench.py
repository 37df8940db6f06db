"""`exl2 bench`: prefill and decode speed on the GPU against the memory-bandwidth bound."""
from __future__ import annotations

import sys

# the synthetic model's shapes (`--shape`): (name, runtime.synthetic's config of it)
SHAPES = {"llama3-8b": ("Llama-3-8B", "LLAMA3_8B"), "qwen3-30b-a3b": ("Qwen3-30B-A3B", "QWEN3_30B_A3B")}


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed on the GPU",
                       description="Prefill and decode throughput (batch 1 and a large batch, fp16 and quantized "
                                   "KV cache) with the memory-bandwidth bound and the share of it reached. Without "
                                   "-m it fabricates a Llama-3-8B-shaped EXL2 model (4.0 bpw, 6-bit head).")
    p.add_argument("-m", "--model_dir", dest="model_dir", default=None, help="model directory (default: synthetic 8B)")
    p.add_argument("--modes", default="fp16,q4", help="KV cache modes to measure (default fp16,q4)")
    p.add_argument("--contexts", default="128,2048", help="decode context lengths (default 128,2048)")
    p.add_argument("--prefill", type=int, default=2047, help="prefill length (default 2047)")
    p.add_argument("--batch", default="16",
                   help="batch sizes decoded besides batch 1, comma-separated (default 16; e.g. 2,4,16)")
    p.add_argument("--layers", type=int, default=None, help="synthetic model: number of layers (default all)")
    p.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES),
                   help="synthetic model's shape: Llama-3-8B (the default) or Qwen3-30B-A3B (128 experts, 8 a token)")
    p.add_argument("--mixed", nargs="?", const="543", default=None, choices=("543", "table"),
                   help="synthetic model with a real 4.0 bpw file's mixed widths: 543 (the default) 5/4/3-bit "
                        "groups in every matrix; table, each block's option from exllamav2's option tables, as a "
                        "conversion leaves them (width mixes differ between projections)")
    p.add_argument("--prefill-fp8", "--prefill_fp8", dest="prefill_fp8", action="store_true",
                   help="also the prefill with its matmuls in FP8 (EngineConfig.prefill_fp8), a second line; "
                        "--breakdown-prefill then profiles that one")
    p.add_argument("--breakdown", action="store_true", help="also print per-kernel times of one decode step")
    p.add_argument("--breakdown-prefill", dest="breakdown_prefill", action="store_true",
                   help="also print per-kernel times of one prefill of --prefill tokens")
    p.add_argument("--breakdown-batch", dest="breakdown_batch", type=int, default=1,
                   help="batch size of the --breakdown step (default 1; 1, 2, 4, 8 or 16)")
    p.add_argument("--breakdown-mode", dest="breakdown_mode", default="fp16",
                   help="KV cache mode of the --breakdown step (default fp16)")
    from exl2.cli.common import add_rope_args

    add_rope_args(p)  # -m's RoPE as generate would run it (the speed does not depend on it)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from exl2.errors import ConfigError

    from exl2.kernels.kv_quant import KV_MODES

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in KV_MODES]
    if not modes or bad:
        raise ConfigError(f"--modes takes cache modes from {', '.join(KV_MODES)}, not {args.modes!r}.")
    if args.breakdown_mode not in KV_MODES:
        raise ConfigError(f"--breakdown-mode takes one of {', '.join(KV_MODES)}, not {args.breakdown_mode!r}.")
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        contexts = batches = []
    if not contexts or not batches or min(contexts + batches) < 1 or args.prefill < 1:
        raise ConfigError("--contexts and --batch take positive integers separated by commas, and --prefill a "
                          "positive integer.")
    if args.breakdown_batch not in (1, 2, 4, 8, 16):
        raise ConfigError(f"--breakdown-batch must be 1, 2, 4, 8 or 16 (a captured batch size), not "
                          f"{args.breakdown_batch}.")
    from exl2.cli.common import rope_from_args

    rope = rope_from_args(args)
    if not torch.cuda.is_available():
        raise ConfigError("exl2 bench needs a CUDA GPU; none is available here.")
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import read_config, spec_from_config
    from exl2.runtime.benchmark import (format_table, kernel_breakdown, prefill_breakdown, run_benchmark,
                                        weight_bytes)
    from exl2.runtime import synthetic
    from exl2.runtime.weights import WeightLoader
    from exl2.formats.safetensors_io import TensorSource

    dev = torch.device("cuda")
    if args.model_dir:
        source = TensorSource(args.model_dir)
        with torch.inference_mode():
            model = DecoderModel(spec_from_config(read_config(args.model_dir), rope),
                                 WeightLoader(source, dev, torch.float16)).eval()
    else:
        model, source = synthetic.synthetic_model(dev, args.layers, args.mixed or "4bit",
                                                  shape=getattr(synthetic, SHAPES[args.shape][1]))
    if args.prefill_fp8:
        from exl2.kernels.fp8_prefill import fp8_available
        from exl2.runtime.linear import quant_kernels

        if not (fp8_available(dev) and quant_kernels(model)):
            raise ConfigError("--prefill-fp8 needs a quantized model and a GPU whose PyTorch runs row-scaled e4m3 "
                              "GEMMs (sm_89 or newer).")
    wbytes = weight_bytes(source, model.spec)
    kind = {None: "4-bit", "543": "5/4/3-bit mixed", "table": "exllamav2 option-table 4.0 bpw"}[args.mixed]
    shape = SHAPES[args.shape][0]
    print(f"model: {args.model_dir or f'synthetic {shape}-shaped EXL2 ({kind} body), 6-bit head'}; "
          f"{wbytes / 1e9:.2f} GB read per decoded token; GPU: {torch.cuda.get_device_name()}", flush=True)
    def progress(r) -> None:  # each row as soon as it is measured (stderr), so a cut-short run still reports
        print(f"  {r.name}: {r.tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)

    rows = run_benchmark(model, wbytes, tuple(modes), tuple(contexts), args.prefill, tuple(batches), log=progress,
                         fp8_prefill=args.prefill_fp8)
    print(format_table(rows))
    if args.breakdown:
        ctx = 2048 if args.breakdown_batch == 1 else 128
        print(f"\nper-kernel time of one decode step (batch {args.breakdown_batch}, ctx {ctx}, "
              f"{args.breakdown_mode} cache):")
        for name, calls, us, share in kernel_breakdown(model, ctx=ctx, batch=args.breakdown_batch,
                                                       mode=args.breakdown_mode):
            print(f"  {name:<60} {calls:>5} {us:>10.1f} µs {share:>6.1%}")
    if args.breakdown_prefill:
        if args.prefill_fp8:
            from exl2.runtime.linear import set_prefill_fp8

            set_prefill_fp8(model, True)
        print(f"\nper-kernel time of one prefill of {args.prefill} tokens (fp16 cache"
              f"{', FP8 matmuls' if args.prefill_fp8 else ''}):")
        for name, calls, us, share in prefill_breakdown(model, length=args.prefill):
            print(f"  {name:<60} {calls:>5} {us:>10.1f} µs {share:>6.1%}")
    return 0
