"""Quality sweep: convert one model at several bitrates from one measurement, evaluate each against the source.

    python -m exl2.quantize.sweep -i SRC -w WORK --bits 2.5 3.0 4.0 ... [-m measurement.json] [-r R -l L]
        [--eval-rows 16 --eval-length 512] [--objective kl] [--svg plot.svg]

Prints one JSON line per bitrate (measured bpw, perplexity, KL(ref ‖ model), top-1 agreement) and can draw KL
against bpw as a small standalone SVG (no plotting library needed).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def decoder_bpw(model_dir: Path) -> tuple[float, float]:
    """(bits per weight of the decoder's quantized layers, of the head) from the files' tensor sizes."""
    from exl2.formats.safetensors_io import TensorSource

    src = TensorSource(model_dir)
    keys = sorted({k.rsplit(".", 1)[0] for k in src.keys() if k.endswith(".q_weight")})
    out = {"dec": [0, 0], "head": [0, 0]}
    for k in keys:
        bits = sum(src[f"{k}.{t}"].numel() * src[f"{k}.{t}"].element_size() * 8
                   for t in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"))
        w = src.shape(f"{k}.q_invperm")[0] * src.shape(f"{k}.q_weight")[1]
        part = out["head" if k == "lm_head" else "dec"]
        part[0] += bits
        part[1] += w
    return out["dec"][0] / max(1, out["dec"][1]), out["head"][0] / max(1, out["head"][1])


def svg_plot(points: dict[str, list[tuple[float, float]]], path: Path, title: str) -> None:
    """KL (log scale) against bpw, one polyline per series."""
    w, h, ml, mr, mt, mb = 560, 360, 60, 20, 30, 45
    xs = [x for s in points.values() for x, _ in s]
    ys = [y for s in points.values() for _, y in s if y > 0]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    px = lambda x: ml + (x - x0) / (x1 - x0) * (w - ml - mr)
    py = lambda y: mt + (y1 - math.log10(y)) / (y1 - y0) * (h - mt - mb)
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>']
    for x in range(x0, x1 + 1):
        out.append(f'<line x1="{px(x):.1f}" y1="{mt}" x2="{px(x):.1f}" y2="{h - mb}" stroke="#ddd"/>')
        out.append(f'<text x="{px(x):.1f}" y="{h - mb + 16}" text-anchor="middle">{x}</text>')
    for e in range(y0, y1 + 1):
        y = 10.0 ** e
        out.append(f'<line x1="{ml}" y1="{py(y):.1f}" x2="{w - mr}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{ml - 6}" y="{py(y) + 4:.1f}" text-anchor="end">1e{e}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">bits per weight (decoder)</text>')
    out.append(f'<text x="14" y="{h / 2}" text-anchor="middle" transform="rotate(-90 14 {h / 2})">'
               f'KL(fp16 ‖ quantized), nats/token</text>')
    for i, (name, series) in enumerate(points.items()):
        c = colours[i % len(colours)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(series) if y > 0)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in series:
            if y > 0:
                out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{c}"/>')
        out.append(f'<rect x="{w - mr - 215}" y="{mt + 8 + 18 * i}" width="12" height="12" fill="{c}"/>')
        out.append(f'<text x="{w - mr - 197}" y="{mt + 18 + 18 * i}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    from exl2.generation.tokenizer import Tokenizer
    from exl2.quantize.evaluate import eval_rows, evaluate
    from exl2.quantize.pipeline import ConvertSettings, convert
    from exl2.quantize.progress import Reporter
    from exl2.runtime.loader import load_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--in_dir", required=True)
    p.add_argument("-w", "--work", required=True, help="folder for the work and output directories")
    p.add_argument("--bits", type=float, nargs="+", required=True)
    p.add_argument("-m", "--measurement", default=None)
    p.add_argument("-r", "--rows", type=int, default=None)
    p.add_argument("-l", "--length", type=int, default=2048)
    p.add_argument("-mr", "--measurement_rows", type=int, default=None)
    p.add_argument("-ml", "--measurement_length", type=int, default=2048)
    p.add_argument("-hb", "--head_bits", type=int, default=6)
    p.add_argument("--objective", default="auto")
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--eval-length", type=int, default=512)
    p.add_argument("--device", default=None)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    work = Path(args.work)
    tok = Tokenizer.from_dir(args.in_dir)
    ids, _ = eval_rows(tok, None, args.eval_rows, args.eval_length)
    ref = load_model(args.in_dir, args.device, torch.float32)
    for bits in args.bits:
        name = f"b{bits}{args.tag}"
        t0 = time.monotonic()
        s = ConvertSettings(in_dir=args.in_dir, out_dir=str(work / f"{name}_work"), compile_full=str(work / name),
                            bits=bits, head_bits=args.head_bits, rows=args.rows, length=args.length,
                            measurement_rows=args.measurement_rows, measurement_length=args.measurement_length,
                            measurement=args.measurement, device=args.device, objective=args.objective)
        summary = convert(s, Reporter(quiet=True))
        seconds = time.monotonic() - t0
        dec, head = decoder_bpw(work / name)
        res = evaluate(load_model(work / name, args.device, torch.float32), ids, ref)
        print(json.dumps({"name": name, "target": bits, "bpw": round(dec, 4), "head_bpw": round(head, 3),
                          "objective": (summary.get("strategy_summary") or {}).get("objective"),
                          "convert_s": round(seconds, 1), **res.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
