"""How fast a batch-1 gemv could stream its weights, by layout: pure-load kernels over a 4-bit EXL2 weight's words
against the real gemv on the same shapes.

The gemv reads `[K/8 word rows, N]` int32 words, each program a BN-column strip, a loop iteration BS steps = 32
word rows of BN columns: 32 segments of BN·4 bytes, N·4 bytes apart. A column-strip-major repack ("strip": all of
a strip's rows contiguous) would make each iteration one contiguous block. This probe times, per shape, the load
stream alone in both layouts (a xor-reduce keeps the loads; no decoding) over a sweep of tile sizes and pipeline
depths, and the real `permuted_gemv`, each as a CUDA graph of back-to-back calls cycling over enough copies of the
weight to keep it out of L2 (the decode step's situation). Prints GB/s and the share of the copy bandwidth.

    python3 benchmarks/layout_probe.py [--shapes o,down,qkv,gateup] [--stream] [--sweep] [--json FILE]

--sweep times the real gemv over launch settings instead (steps an iteration, pipeline depth, warps, column tile,
K split; each list can be narrowed, e.g. --bs 8,16 --bn 32,64), to check its defaults against the same L2-cold,
back-to-back measurement. --widths times it on all-5, all-4, all-3-bit weights and the bench's 5/4/3-bit mix
(`exl2 bench --mixed`), GB/s of each one's own bytes: if the mix runs slower than its classes do alone, the cost is
in mixing them, not in decoding any one width.

--l2 (with --sweep or --widths) times one copy of each weight, left in L2 by the previous call: the gemv then
streams faster than DRAM can feed it and is bound by its own issue rate. On an H100 (bandwidth-bound at batch 1)
that stands in for the H200, where the same kernel is issue-bound from DRAM (benchmarks/RESULTS.md session 28).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.formats.exl2 import group_layout  # noqa: E402
from exl2.kernels import permute, qweight  # noqa: E402
from exl2.kernels import quant_matmul as qm  # noqa: E402
from exl2.kernels.backend import sm_count  # noqa: E402
from exl2.kernels.gemv import GemvGroup, permuted_gemv  # noqa: E402
from exl2.kernels.matmul_launch import MatmulConfig  # noqa: E402

# name: (K, N, the gemv's column tile, programs per SM its K split aims at)
SHAPES = {"o": (4096, 4096, 64, 2), "down": (14336, 4096, 64, 2), "qkv": (4096, 6144, 64, 4),
          "gateup": (4096, 28672, 64, 4)}
L2_SPAN = 256 << 20  # bytes of weight copies cycled through per graph replay
L2_CALLS = 16  # calls a graph replay with --l2 (one copy, called again and again)


@triton.jit
def _stream(w_ptr, out_ptr, N, KW, SPLIT, BN: tl.constexpr, RB: tl.constexpr, STRIP: tl.constexpr,
            STAGES: tl.constexpr):
    """xor of this program's share of rows of one BN-column strip: row-major [KW, N] or strip-major
    [N / BN, KW, BN] words."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r_lo = (KW * pid_k) // SPLIT
    r_hi = (KW * (pid_k + 1)) // SPLIT
    cols = tl.arange(0, BN)
    acc = tl.zeros([RB, BN], dtype=tl.int32)
    for r0 in tl.range(r_lo, r_hi, RB, num_stages=STAGES):
        rows = r0 + tl.arange(0, RB)
        if STRIP:
            off = pid_n.to(tl.int64) * KW * BN + rows[:, None] * BN + cols[None, :]
        else:
            off = rows[:, None].to(tl.int64) * N + pid_n * BN + cols[None, :]
        acc ^= tl.load(w_ptr + off, mask=(rows < r_hi)[:, None], other=0)
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + pid_n) * BN + cols, tl.xor_sum(acc, axis=0))


def _split(kw: int, tiles: int, per_sm: int, rb: int) -> int:
    split, target = 1, per_sm * sm_count(torch.device("cuda"))
    while split < 32 and tiles * split * 2 <= target and kw // (split * 2) >= rb:
        split *= 2
    return split


def _graph_time(fn, copies: int, calls: int | None = None, reps: int = 20) -> float:
    """µs per call of `fn(i % copies)` for i in range(calls) (default: copies), replayed as one CUDA graph."""
    calls = calls or copies
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % copies)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (reps * calls))
    return best


def _copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _graph_time(lambda i: b.copy_(a), 1, reps=10)
    return 2 * a.numel() / us / 1e3  # GB/s, read + write


def _strip(words: torch.Tensor, bn: int) -> torch.Tensor:
    kw, n = words.shape
    return words.view(kw, n // bn, bn).permute(1, 0, 2).contiguous()


def probe(name: str, copy_gbs: float, stream: bool, sweep: dict | None, l2: bool = False) -> list[dict]:
    k, n, gemv_bn, per_sm = SHAPES[name]
    kw = k // 8
    nbytes = kw * n * 4
    copies = 1 if l2 else max(2, L2_SPAN // nbytes)
    calls = L2_CALLS if l2 else copies
    rows = []

    def row(variant: str, us: float) -> None:
        gbs = nbytes / us / 1e3
        rows.append({"shape": name, "variant": variant, "us": round(us, 2), "GB/s": round(gbs),
                     "pct_copy": round(100 * gbs / copy_gbs, 1)})
        print(f"| {name} | {variant} | {us:.2f} | {gbs:,.0f} | {100 * gbs / copy_gbs:.1f} % |", flush=True)

    # The real gemv: random 4-bit codes, groups of 128, act-order permutation (q/k/v and gate/up as a group).
    groups = [(4, 128)] * (k // 128)
    parts = {"qkv": [4096, 1024, 1024], "gateup": [14336, 14336]}.get(name, [n])
    ws = []
    for c in range(copies):
        perm = torch.randperm(k, device="cuda")
        mats = []
        for width in parts:
            codes = torch.randint(0, 16, (k, width), dtype=torch.uint8, device="cuda")
            scales = (torch.rand(len(groups), width, device="cuda") * 0.01 + 0.001).half()
            mats.append(qweight.build(codes, groups, scales, None, perm))
        ws.append(mats)
    x = torch.randn(1, k, dtype=torch.float16, device="cuda")
    if len(parts) > 1:
        grouped = [GemvGroup(m) for m in ws]
        xps = [permute.gather_input(x, m, whole=True) for m in ws]
        row("gemv (grouped, real)", _graph_time(lambda i: grouped[i](xps[i]), copies, calls))
    else:
        xps = [permute.gather_input(x, m)[0] for m in ws]
        row("gemv (real, split sums)", _graph_time(lambda i: qm.permuted_matmul(xps[i], ws[i][0], True), copies, calls))
        row("gemv (real)", _graph_time(lambda i: qm.permuted_matmul(xps[i], ws[i][0]), copies, calls))
    if sweep is not None:
        _sweep(name, ws, xps, calls, row, **sweep)
    if not stream:
        return rows
    words = [torch.cat([w.qweight for w in m], dim=1) for m in ws]
    ws = xps = None  # the copies are not needed past here
    strips = {bn: [_strip(w, bn) for w in words] for bn in (64, 128)}
    for bn in (64, 128):
        tiles = n // bn
        for rb in (16, 32, 64):
            for stages in (2, 3, 4, 6):
                split = _split(kw, tiles, per_sm if bn == 64 else max(1, per_sm // 2), rb)
                out = torch.empty(split * tiles * bn, dtype=torch.int32, device="cuda")
                for strip in (False, True):
                    src = strips[bn] if strip else words

                    def call(i, src=src, out=out, split=split, rb=rb, stages=stages, strip=strip, bn=bn):
                        _stream[(tiles, split)](src[i], out, n, kw, split, BN=bn, RB=rb, STRIP=strip,
                                                STAGES=stages, num_warps=4)

                    row(f"{'strip' if strip else 'rows '} BN {bn} RB {rb} stages {stages} split {split}",
                        _graph_time(call, copies))
    return rows


def _sweep(name: str, ws: list, xps: list, calls: int, row, warps_list=(4, 8), bs_list=(4, 8, 16),
           stages_list=(2, 3, 4, 6), bn_list=None, per_sm_list=None) -> None:
    """The real gemv (grouped for q/k/v and gate/up) over launch settings; splits relative to the default's."""
    grouped = len(ws[0]) > 1
    bn_list = bn_list or ((64, 128) if name == "gateup" else (64,))
    per_sm_list = per_sm_list or ((2, 4, 8) if grouped else (1, 2, 4))
    for warps in warps_list:
        for bs in bs_list:
            for stages in stages_list:
                for bn in bn_list:
                    for per_sm in per_sm_list:
                        tag = f"gemv BS {bs} stages {stages} warps {warps} BN {bn} per-SM {per_sm}"
                        try:
                            if grouped:
                                gs = [GemvGroup(m, bn=bn, bs=bs, stages=stages, per_sm=per_sm, num_warps=warps)
                                      for m in ws]
                                us = _graph_time(lambda i: gs[i](xps[i]), len(gs), calls)
                            else:
                                w0 = ws[0][0]
                                tiles = triton.cdiv(w0.n, bn)
                                split = qm.auto_split(w0, tiles, w0.device, 8, per_sm)
                                cfg = MatmulConfig(bm=1, bs=bs, bn=bn, split=split, num_warps=warps,
                                                   num_stages=stages)
                                us = _graph_time(lambda i: permuted_gemv(xps[i], ws[i][0], cfg, part_only=True),
                                                 len(ws), calls)
                                tag += f" split {split}"
                        except Exception as e:  # noqa: BLE001 - a setting that does not compile is a row, not a stop
                            print(f"| {name} | {tag} | failed: {type(e).__name__} | | |", flush=True)
                            continue
                        row(tag, us)


WIDTH_OPTIONS = {"5-bit": ([5], [1.0], [128]), "4-bit": ([4], [1.0], [128]), "3-bit": ([3], [1.0], [128]),
                 "mixed 5/4/3": ([5, 4, 3], [0.1, 0.7, 0.2], [128, 128, 128])}


def widths_probe(name: str, copy_gbs: float, l2: bool = False) -> list[dict]:
    """The real gemv (grouped for q/k/v and gate/up, split sums otherwise) over each of `WIDTH_OPTIONS` (`l2`: one
    copy, called `L2_CALLS` times a replay)."""
    k, n, _, _ = SHAPES[name]
    parts = {"qkv": [4096, 1024, 1024], "gateup": [14336, 14336]}.get(name, [n])
    rows = []
    for label, (bits, prop, gs) in WIDTH_OPTIONS.items():
        groups = group_layout(k, bits, prop, gs)
        scales = [(torch.rand(len(groups), width, device="cuda") * 0.01 + 0.001).half() for width in parts]

        def copy(sc=scales, groups=groups):
            """One set of the shape's matrices (sharing an act-order permutation, as exllamav2 writes them)."""
            perm = torch.randperm(k, device="cuda")
            return [qweight.build(torch.cat([torch.randint(0, 1 << b, (r, s.shape[1]), dtype=torch.uint8,
                                                           device="cuda") for b, r in groups]), groups, s, None, perm)
                    for s in sc]

        ws = [copy()]
        nbytes = sum(m.qweight.numel() * 4 + m.scales.numel() * 2 for m in ws[0])
        copies = 1 if l2 else max(2, L2_SPAN // nbytes)
        calls = L2_CALLS if l2 else copies
        ws += [copy() for _ in range(copies - 1)]
        x = torch.randn(1, k, dtype=torch.float16, device="cuda")
        if len(parts) > 1:
            grouped = [GemvGroup(m) for m in ws]
            xps = [permute.gather_input(x, m, whole=True) for m in ws]
            us = _graph_time(lambda i: grouped[i](xps[i]), copies, calls)
        else:
            xps = [permute.gather_input(x, m)[0] for m in ws]
            us = _graph_time(lambda i: qm.permuted_matmul(xps[i], ws[i][0], True), copies, calls)
        gbs = nbytes / us / 1e3
        rows.append({"shape": name, "variant": label, "us": round(us, 2), "MB": round(nbytes / 1e6, 1),
                     "GB/s": round(gbs), "pct_copy": round(100 * gbs / copy_gbs, 1)})
        print(f"| {name} | {label} ({nbytes / 1e6:.1f} MB) | {us:.2f} | {gbs:,.0f} | {100 * gbs / copy_gbs:.1f} % |",
              flush=True)
    return rows


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="o,down,qkv,gateup")
    p.add_argument("--stream", action="store_true", help="the pure-load kernels by layout")
    p.add_argument("--sweep", action="store_true", help="the real gemv over launch settings")
    p.add_argument("--widths", action="store_true", help="the real gemv on 5/4/3-bit and mixed weights")
    p.add_argument("--l2", action="store_true", help="one copy of each weight, L2-resident (issue-bound)")
    for flag in ("warps", "bs", "stages", "bn", "per-sm"):
        p.add_argument(f"--{flag}", type=_ints, help=f"--sweep's {flag} values, comma-separated")
    p.add_argument("--json")
    a = p.parse_args()
    grid = {f"{key}_list": v for key, v in (("warps", a.warps), ("bs", a.bs), ("stages", a.stages), ("bn", a.bn),
                                             ("per_sm", a.per_sm)) if v}
    sweep = grid if a.sweep else None
    copy_gbs = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:,.0f} GB/s (read + write)")
    print("| shape | variant | µs | GB/s | % of copy |\n| --- | --- | --- | --- | --- |")
    rows = []
    for name in a.shapes.split(","):
        rows += widths_probe(name, copy_gbs, a.l2) if a.widths else probe(name, copy_gbs, a.stream, sweep, a.l2)
    if a.json:
        Path(a.json).write_text(json.dumps({"copy_GBs": copy_gbs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
