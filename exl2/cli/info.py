"""`exl2 info`: architecture, size, weight format, context and (for EXL2) the bit mix of every layer."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("info", help="describe a model directory",
                       description="Show architecture, parameter count, weight format, context length and, for "
                                   "quantized models, the bit mix per layer and the effective bits per weight.")
    p.add_argument("model_dir", nargs="?", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--layers", action="store_true", help="list every quantized layer (default: a summary)")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from exl2.cli.common import resolve_model_dir
    from exl2.formats.safetensors_io import TensorSource
    from exl2.generation.embeddings import Pooling
    from exl2.models.registry import read_config, spec_from_config

    model_dir = resolve_model_dir(args.model_dir)
    cfg = read_config(model_dir)
    spec = spec_from_config(cfg)
    src = TensorSource(model_dir)
    console = Console()
    params = sum(_numel(src.shape(k)) for k in src.keys() if k.endswith(".weight"))
    exl2_layers = sorted(k[: -len(".q_weight")] for k in src.keys() if k.endswith(".q_weight"))
    gptq_layers = [k for k in src.keys() if k.endswith(".qweight")]
    fmt = "EXL2" if exl2_layers else "GPTQ" if gptq_layers else _dense_dtype(src)
    qc = cfg.get("quantization_config") or {}
    t = Table(show_header=False, box=None)
    t.add_row("directory", str(model_dir))
    t.add_row("architecture", f"{spec.arch} ({spec.model_type})")
    t.add_row("layers / hidden / heads", f"{spec.num_layers} / {spec.hidden_size} / {spec.num_heads} "
              f"(kv {spec.num_kv_heads}, head dim {spec.head_dim})")
    if spec.moe:
        t.add_row("experts", f"{spec.moe.num_experts} (top {spec.moe.top_k})")
    t.add_row("parameters", f"{(params if not exl2_layers else spec.num_params_hint) / 1e6:,.1f} M")
    t.add_row("vocabulary", f"{spec.vocab_size}")
    t.add_row("context length", f"{spec.max_position}")
    t.add_row("rope", f"{spec.rope.rope_type} (theta {spec.rope.theta:g})")
    t.add_row("weight format", fmt + (f", target {qc['bits']} bpw, head {qc.get('head_bits')} bits"
                                      if qc.get("quant_method") == "exl2" else ""))
    if src.embedding_only():
        pooling = Pooling.from_dir(model_dir)
        t.add_row("output", f"none (an embedding model: {pooling.mode}-token pooling"
                            f"{', normalised' if pooling.normalize else ''})")
    console.print(t)
    if exl2_layers:
        _exl2_table(console, src, exl2_layers, args.layers)
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dense_dtype(src) -> str:
    for k in src.keys():
        if k.endswith(".weight"):
            return {"F16": "fp16", "BF16": "bf16", "F32": "fp32"}.get(src.dtype_name(k), src.dtype_name(k))
    return "unknown"


def _exl2_table(console, src, layers: list[str], every: bool) -> None:
    from rich.table import Table

    from exl2.formats.exl2 import bit_mix, layer_bpw

    t = Table(title="EXL2 layers", show_lines=False)
    t.add_column("layer")
    t.add_column("K×N", justify="right")
    t.add_column("bit mix (share of rows)")
    t.add_column("bpw", justify="right")
    total_bits = total_w = 0.0
    head_bits = head_w = 0.0
    weights_per_width: dict[int, float] = {}
    for prefix in layers:
        mix = bit_mix(src, prefix)
        k = sum(mix.values())
        n = src.shape(f"{prefix}.q_weight")[1]
        bpw = layer_bpw(src, prefix)
        if prefix.endswith("lm_head"):
            head_bits, head_w = bpw * k * n, k * n
        else:
            total_bits += bpw * k * n
            total_w += k * n
            for b, rows in mix.items():
                weights_per_width[b] = weights_per_width.get(b, 0) + rows * n
        if every or prefix.endswith("lm_head"):
            share = ", ".join(f"{b}b {r / k:.0%}" for b, r in sorted(mix.items(), reverse=True))
            t.add_row(prefix, f"{k}×{n}", share, f"{bpw:.3f}")
    if not every and total_w:
        share = ", ".join(f"{b}b {w / total_w:.0%}" for b, w in sorted(weights_per_width.items(), reverse=True))
        t.add_row(f"decoder layers ({len(layers) - (1 if head_w else 0)}; --layers lists each)", "", share,
                  f"{total_bits / total_w:.3f}")
    console.print(t)
    if total_w:
        console.print(f"effective bits per weight, decoder layers: [bold]{total_bits / total_w:.3f}[/bold]"
                      + (f"; head: {head_bits / head_w:.3f}" if head_w else ""))
