"""Convert a Llama-3-8B-shaped model to EXL2 on the GPU and report time and peak memory (issue 5 acceptance).

    python benchmarks/convert_8b.py --json convert_8b.json               # all 32 layers
    python benchmarks/convert_8b.py --layers 4 --json convert_8b.json    # 4 layers, extrapolated to 32
    python benchmarks/convert_8b.py --tiny --device cpu                  # end-to-end smoke test on a CPU

The model is fabricated (random bf16 weights, normal with std 0.02, norms 1, and the default model's tokenizer,
whose ids are all below 128256), so nothing is downloaded; its quality numbers mean nothing, only time and memory
do. The conversion runs in a child process so that the peak host RSS and GPU memory are its own. Every block's
measurement and quantization is timed, so a run with fewer layers than the real model is extrapolated from the
per-layer cost; the table labels measured and extrapolated figures.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
             "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "attention_bias": False,
             "mlp_bias": False, "torch_dtype": "bfloat16"}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
PER_LAYER_STAGES = ("sensitivity", "measure_quant", "quant")
SHARD_BYTES = 4 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers to fabricate (default 32; --tiny: 2)")
    p.add_argument("--target-layers", type=int, default=32, help="layer count to extrapolate to (default 32)")
    p.add_argument("--tiny", action="store_true", help="hidden 256, intermediate 512, 2 layers (smoke test)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--bits", type=float, default=4.0, help="target bpw (default 4.0)")
    p.add_argument("--rows", type=int, default=None, help="-r: quantization rows (default: the converter's)")
    p.add_argument("--mrows", type=int, default=None, help="-mr: measurement rows (default: the converter's)")
    p.add_argument("--length", type=int, default=2048, help="-l: tokens per quantization row (default 2048)")
    p.add_argument("--mlength", type=int, default=2048, help="-ml: tokens per measurement row (default 2048)")
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json (default: the default model's fp16 import)")
    p.add_argument("--dir", default=None, help="working folder (default: a temporary one, removed at the end); "
                                               "a source model already fabricated there with the same shape is reused")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 2 if args.tiny else 32
    return args


def model_config(args, tok_dir: Path) -> dict:
    cfg = dict(LLAMA3_8B, **(TINY if args.tiny else {}), num_hidden_layers=args.layers)
    gen = tok_dir / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        cfg.update({k: g[k] for k in ("bos_token_id", "eos_token_id") if k in g})
    return cfg


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in file order."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def fabricate(cfg: dict, tok_dir: Path, out: Path, device: str) -> float:
    """Write the model directory (safetensors shards of ≤ 4 GiB, index, config, tokenizer); returns seconds
    (0 if the same model is already there)."""
    import torch
    from safetensors.torch import save_file

    t0 = time.monotonic()
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return 0.0
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict = {}
    files: list[tuple[Path, list[str]]] = []

    def flush() -> None:
        path = out / f"shard{len(files)}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        files.append((path, list(shard)))
        shard.clear()

    size = 0
    for name, shape in tensor_shapes(cfg):
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
            t = t.to(torch.bfloat16).cpu()
        if shard and size + t.numel() * 2 > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = t
        size += t.numel() * 2
    flush()
    weight_map = {}
    for i, (path, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        path.rename(out / final)
        weight_map.update({n: final for n in names})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file() and f != "generation_config.json":
            shutil.copyfile(tok_dir / f, out / f)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))       # last: marks the directory complete
    return time.monotonic() - t0


def _child(settings: dict, queue) -> None:
    """Run the conversion, timing every block, and send back the summary and this process's peak memory."""
    import torch

    from exl2.quantize import pipeline
    from exl2.quantize.progress import Reporter

    cuda = (settings.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    blocks: dict[str, list[float]] = {"measure_quant": [], "quant": []}

    def timed(fn, stage):
        def run(*a, **kw):
            t = time.monotonic()
            out = fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            blocks[stage].append(time.monotonic() - t)
            return out
        return run

    pipeline.measure_slot = timed(pipeline.measure_slot, "measure_quant")
    pipeline.quantize_slot = timed(pipeline.quantize_slot, "quant")
    try:
        summary = pipeline.convert(pipeline.ConvertSettings(**settings), Reporter(messages=True))
    except BaseException as e:  # noqa: BLE001 - report any failure to the parent
        queue.put({"error": f"{type(e).__name__}: {e}"})
        return
    res = {"summary": summary, "block_seconds": blocks,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if cuda:
        res["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
        res["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
        res["gpu"] = torch.cuda.get_device_name()
    queue.put(res)


def extrapolate(stage_s: dict, block_s: dict, layers: int, target: int, cfg: dict) -> dict:
    """Stage times for `target` layers: per-block parts scale with the layer count, the rest stays; the
    sensitivity pass counts as all per-layer (an upper bound), compile scales with the parameter count."""
    out = {}
    for stage, t in stage_s.items():
        if stage == "sensitivity":
            out[stage] = t * target / layers
        elif stage in block_s:
            per = sum(block_s[stage])
            out[stage] = t - per + per * target / layers
        elif stage == "compile":
            out[stage] = t * _params(cfg, target) / _params(cfg, layers)
        else:
            out[stage] = t
    return out


def _params(cfg: dict, layers: int) -> int:
    c = dict(cfg, num_hidden_layers=layers)
    n = 0
    for _, shape in tensor_shapes(c):
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def sensitivity_bytes_per_layer(cfg: dict, settings: dict, rows: int) -> int:
    """Host memory the sensitivity pass holds per layer: a block input and a gradient (bf16) per block, 2 blocks."""
    return 2 * 2 * rows * settings["measurement_length"] * cfg["hidden_size"] * 2


def report(res: dict, args, cfg: dict, settings: dict, fab_s: float, wall_s: float) -> dict:
    import torch

    from exl2.quantize.pipeline import BUILTIN_MEASURE_ROWS, BUILTIN_ROWS
    from exl2.quantize.sensitivity import rows_for

    s, n, tgt = res["summary"], args.layers, args.target_layers
    stages = s["stage_seconds"]
    block = {k: v for k, v in res["block_seconds"].items() if v}
    ext = extrapolate(stages, block, n, tgt, cfg)
    mrows = settings["measurement_rows"] or BUILTIN_MEASURE_ROWS
    grad_rows = {k: rows_for(mrows, settings["measurement_length"], cfg["hidden_size"], 2 * k) for k in (n, tgt)}
    rss_ext = res["peak_rss_bytes"] + tgt * sensitivity_bytes_per_layer(cfg, settings, grad_rows[tgt]) \
        - n * sensitivity_bytes_per_layer(cfg, settings, grad_rows[n])
    out = {
        "model": {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "vocab_size", "rope_theta")},
        "layers_measured": n, "layers_extrapolated_to": tgt, "device": settings["device"],
        "gpu": res.get("gpu"), "torch": torch.__version__,
        "settings": {"bits": settings["bits"], "rows": settings["rows"] or BUILTIN_ROWS, "length": settings["length"],
                     "measurement_rows": mrows, "measurement_length": settings["measurement_length"]},
        "fabricate_seconds": fab_s, "process_wall_seconds": wall_s, "convert_seconds": s["seconds"],
        "stage_seconds": stages, "per_layer_seconds": {k: sum(v) / n for k, v in block.items()},
        "extrapolated_stage_seconds": ext, "extrapolated_convert_seconds": sum(ext.values()) + s["seconds"]
        - sum(stages.values()),
        "peak_gpu_allocated_bytes": res.get("peak_gpu_allocated_bytes"),
        "peak_gpu_reserved_bytes": res.get("peak_gpu_reserved_bytes"),
        "peak_rss_bytes": res["peak_rss_bytes"], "extrapolated_peak_rss_bytes": rss_ext,
    }
    gib = 2 ** 30
    print(f"\nLlama-3-8B-shaped conversion to {settings['bits']} bpw on {out['gpu'] or out['device']} "
          f"(torch {out['torch']}): {n} layers measured, extrapolated to {tgt}")
    st = out["settings"]
    print(f"calibration: quantization {st['rows']} × {st['length']}, measurement {st['measurement_rows']} × "
          f"{st['measurement_length']} tokens; hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}")
    print(f"\n{'stage':<20}{'measured s':>12}{'per layer s':>13}{f'≈ {tgt} layers s':>18}")
    for stage, t in stages.items():
        per = out["per_layer_seconds"].get(stage)
        if per is None and stage == "sensitivity":
            per = t / n
        print(f"{stage:<20}{t:>12.1f}{'' if per is None else f'{per:.2f}':>13}{ext[stage]:>18.1f}")
    print(f"{'total (convert)':<20}{out['convert_seconds']:>12.1f}{'':>13}{out['extrapolated_convert_seconds']:>18.1f}")
    print(f"\nfabricating the source model: {fab_s:.1f} s (not part of the conversion); child process wall "
          f"time {wall_s:.1f} s")
    if out["peak_gpu_allocated_bytes"] is not None:
        print(f"peak GPU memory: {out['peak_gpu_allocated_bytes'] / gib:.2f} GiB allocated, "
              f"{out['peak_gpu_reserved_bytes'] / gib:.2f} GiB reserved (measured; about the same for {tgt} layers)")
    print(f"peak host RSS: {out['peak_rss_bytes'] / gib:.2f} GiB measured, ≈ {rss_ext / gib:.2f} GiB for {tgt} "
          f"layers (the sensitivity pass keeps each block's input and gradient)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda was asked for but no CUDA GPU is available.", file=sys.stderr)
        return 2
    if args.tokenizer:
        tok_dir = Path(args.tokenizer)
    else:
        from exl2.models.default_model import default_source_dir
        tok_dir = default_source_dir()
    if not (tok_dir / "tokenizer.json").is_file():
        print(f"error: {tok_dir} has no tokenizer.json; pass --tokenizer DIR.", file=sys.stderr)
        return 2
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="exl2_convert_8b_"))
    cfg = model_config(args, tok_dir)
    try:
        fab_s = fabricate(cfg, tok_dir, base / "source", device)
        print(f"source model: {base / 'source'} ({_params(cfg, args.layers) / 1e9:.2f} B parameters, "
              f"{'reused' if fab_s == 0 else f'fabricated in {fab_s:.1f} s'})", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(base / "work", ignore_errors=True)
        shutil.rmtree(base / "out", ignore_errors=True)
        settings = {"in_dir": str(base / "source"), "out_dir": str(base / "work"), "compile_full": str(base / "out"),
                    "bits": args.bits, "rows": args.rows, "length": args.length, "measurement_rows": args.mrows,
                    "measurement_length": args.mlength, "device": device}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        t0 = time.monotonic()
        proc = ctx.Process(target=_child, args=(settings, queue))
        proc.start()
        res = None
        while res is None:
            try:
                res = queue.get(timeout=5)
            except Empty:
                if not proc.is_alive():
                    res = {"error": f"the process died with exit code {proc.exitcode} (out of memory?)"}
        proc.join()
        wall = time.monotonic() - t0
        if "error" in res:
            print(f"error: the conversion failed: {res['error']}", file=sys.stderr)
            return 1
        out = report(res, args, cfg, settings, fab_s, wall)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
            print(f"results written to {args.json}")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
