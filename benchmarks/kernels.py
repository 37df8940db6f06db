"""Kernel benchmarks on Llama-3-8B shapes: EXL2 matmul (gemv / dot / dequant+cuBLAS) vs cuBLAS fp16, and paged
decode attention with an fp16 vs a Q4 cache. Prints markdown tables (time, GB/s, % of the measured copy
bandwidth, ratio to cuBLAS) and, with --sweep, searches the launch parameters behind the dispatcher's defaults.

    python benchmarks/kernels.py [--sweep] [--json FILE] [--budget SECONDS]

Timing (decode-sized work, as the runtime runs it): R calls captured in one CUDA graph, cycling over enough
copies of the weights (or KV caches) to exceed the L2 cache several times, replayed; time per call = replay
time / R (median of 5 replays). Large-M work: triton.testing.do_bench (median). Every timed path is first
checked against the PyTorch twin (relative error column).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from exl2.kernels import attention as at  # noqa: E402
from exl2.kernels import kv_quant as kq  # noqa: E402
from exl2.kernels import mma_dot  # noqa: E402
from exl2.kernels import quant_matmul as qm  # noqa: E402
from exl2.kernels.matmul_launch import MatmulConfig  # noqa: E402
from exl2.kernels import backend  # noqa: E402
from exl2.kernels import dequant  # noqa: E402
from exl2.kernels import dot as dot_k  # noqa: E402
from exl2.kernels import gemv as gemv_k  # noqa: E402
from exl2.kernels import permute  # noqa: E402
from exl2.kernels import qweight  # noqa: E402

SHAPES = [("gate/up 4096→14336", 4096, 14336, 4), ("q/o 4096→4096", 4096, 4096, 4), ("down 14336→4096", 14336, 4096, 4),
          ("k/v 4096→1024", 4096, 1024, 4), ("head 4096→128256", 4096, 128256, 6)]
COLD_BYTES = 256 << 20  # cycle through this much data so weights come from HBM, not L2 (60 MB)
ROWS: list[dict] = []
T0 = time.time()
BUDGET = 1e9


def log(*a):
    print(*a, flush=True)


def over_budget() -> bool:
    return time.time() - T0 > BUDGET


def graph_us(calls, reps: int = 40) -> float:
    """Median time per call of `calls` (cycled) captured `reps` times in one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    del g
    return sorted(times)[2]


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = bench_us(lambda: b.copy_(a))
    del a, b
    return 2 * (2 << 30) / us / 1e6  # TB/s, read + write


def make_weight(k: int, n: int, bits: int, mixed: bool = False) -> qweight.QuantWeight:
    """Random layer like the converter's: act-order permutation, groups of 128 (mixed: 8/5/4/3-bit classes)."""
    if mixed:
        groups = [(8, 128)] * 2 + [(5, 128)] * 4 + [(4, 128)] * (k // 128 - 12) + [(3, 128)] * 6
    else:
        groups = [(bits, 128)] * (k // 128)
    codes = torch.cat([torch.randint(0, 1 << b, (r, n), dtype=torch.uint8, device="cuda") for b, r in groups])
    scales = (torch.rand(len(groups), n, device="cuda") * 0.01 + 0.001).half()
    return qweight.build(codes, groups, scales, None, torch.randperm(k, device="cuda"))


def clone_weight(w: qweight.QuantWeight) -> qweight.QuantWeight:
    return qweight.QuantWeight(w.qweight.clone(), w.scales.clone(), None, w.step_group.clone(), w.row_index.clone(),
                               w.classes, w.k, w.n, x_index=w.x_index.clone())


def cold_weights(k: int, n: int, bits: int, mixed: bool = False):
    """A random layer, its bytes and enough copies of it (the first is the layer) to exceed L2 when cycled."""
    w = make_weight(k, n, bits, mixed)
    wbytes = w.weight_bytes()
    return w, wbytes, [w] + [clone_weight(w) for _ in range(max(0, -(-COLD_BYTES // wbytes) - 1))]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def record(**kw):
    ROWS.append(kw)
    log("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()))


def row(shape, m, path, us, nbytes, bw, t_ref=None, err=0.0, cfg=""):
    record(shape=shape, m=m, path=path, us=us, gbs=nbytes / us / 1e3, pct_bw=nbytes / us / 1e6 / bw * 100,
           vs_cublas=(t_ref / us) if t_ref else 0.0, err=err, cfg=cfg)


def sweep(copies, x, fn, cfgs, ref, label):
    """Best (us, cfg, err) of fn(x, w, cfg) over cfgs, graph-timed over the weight copies."""
    best = None
    for cfg in cfgs:
        if over_budget():
            log(f"  ({label}: time budget reached, sweep cut short)")
            break
        try:
            err = rel_err(fn(x, copies[0], cfg), ref)
            us = graph_us([lambda w=w: fn(x, w, cfg) for w in copies])
        except Exception as e:  # noqa: BLE001 - report and go on with the other configs
            log(f"  {label} {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        log(f"    {label} {cfg}: {us:.2f} us  err {err:.1e}")
        if err > 5e-3:
            log(f"  {label} {cfg}: WRONG RESULT (rel err {err:.2e})")
            continue
        if best is None or us < best[0]:
            best = (us, cfg, err)
    return best


def matmul_section(bw: float, sweep_on: bool) -> None:
    """Per shape: cuBLAS fp16 and the dispatcher's default at M = 1, 2, 4, 8, 16 (including the input gather),
    the gemv/dot kernels alone on a pre-gathered input, and (--sweep) the best launch parameters."""
    C = MatmulConfig
    # the loop pipelined by Triton num_stages deep (cp.async)
    gemv_cfgs = [C(bs=bs, bn=128, split=sp, num_warps=nw, num_stages=st)
                 for bs, nw, st in ((8, 4, 2), (8, 4, 3), (8, 4, 4), (4, 4, 4), (16, 4, 3), (16, 8, 3))
                 for sp in (1, 2, 4, 8, 16)] if sweep_on else []
    big_cfgs = [C(bm=bm, bs=4, bn=128, split=1, num_warps=nw, num_stages=st) for bm, nw, st in
                ((64, 4, 2), (64, 8, 3), (128, 8, 2), (128, 8, 3))] if sweep_on else []
    dot_cfgs = [C(bm=16, bs=bs, bn=bn, split=sp, num_warps=nw, num_stages=st)
                for bs, bn, nw, st in ((4, 128, 4, 2), (4, 128, 4, 3), (4, 128, 4, 4), (8, 128, 4, 3), (4, 64, 4, 4),
                                       (4, 256, 8, 3))
                for sp in (1, 2, 4, 8)] if sweep_on else []
    for name, k, n, bits in SHAPES:
        if over_budget():
            break
        w, wbytes, copies = cold_weights(k, n, bits)
        fp16 = [torch.randn(k, n, device="cuda").half() for _ in range(max(1, -(-COLD_BYTES // (k * n * 2))))]
        log(f"== {name}: {bits}-bit, {wbytes / 1e6:.1f} MB quantized ({len(copies)} copies), {k * n * 2 / 1e6:.1f} MB fp16")
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda").half()
            xp = permute.gather_input(x, [w])[0]
            ref = qweight.matmul_torch(x, w)
            t_cub = graph_us([lambda wd=wd: torch.matmul(x, wd) for wd in fp16])
            row(name, m, "cuBLAS fp16", t_cub, k * n * 2, bw, t_cub)
            path, cfg = qm.choose_config(m, w)
            t = graph_us([lambda w_=w_: qm.quant_matmul(x, w_) for w_ in copies])
            row(name, m, f"exl2 default ({path}, with gather)", t, wbytes, bw, t_cub,
                rel_err(qm.quant_matmul(x, w), ref), str(cfg))
            kern = gemv_k.gemv if path == "gemv" else dot_k.dot
            t = graph_us([lambda w_=w_: kern(x, w_, cfg, xp=xp) for w_ in copies])
            row(name, m, f"exl2 {path} kernel alone", t, wbytes, bw, t_cub, rel_err(kern(x, w, cfg, xp=xp), ref),
                str(cfg))
            if m == 1:
                t = graph_us([lambda: permute.gather_input(x, [w])])
                row(name, m, "gather alone", t, 0, bw)
            cands = [("gemv", gemv_k.gemv, gemv_cfgs)] if m == 1 else ([("dot", dot_k.dot, dot_cfgs)] if m == 16 else [])
            for label, fn, cfgs in cands:
                best = sweep(copies, x, lambda x_, w_, c, fn=fn, xp=xp: fn(x_, w_, c, xp=xp), cfgs, ref,
                             f"{name} M={m} {label}")
                if best:
                    row(name, m, f"exl2 {label} best", best[0], wbytes, bw, t_cub, best[2], str(best[1]))
        if not over_budget():
            x = torch.randn(2047, k, device="cuda").half()
            t_cub = bench_us(lambda: torch.matmul(x, fp16[0]))
            row(name, 2047, "cuBLAS fp16", t_cub, k * n * 2, bw, t_cub)
            ref = qweight.matmul_torch(x, w)
            err = rel_err(dequant.dequant_matmul(x, w), ref)
            t = bench_us(lambda: dequant.dequant_matmul(x, w))
            row(name, 2047, "exl2 dequant+cuBLAS", t, wbytes, bw, t_cub, err)
            xp = permute.gather_input(x, [w])[0]
            for cfg in big_cfgs:  # the tensor-core kernel as a fused dequant-GEMM for prefill
                if over_budget():
                    break
                try:
                    err = rel_err(dot_k.dot(x, w, cfg, xp=xp), ref)
                    t = bench_us(lambda: dot_k.dot(x, w, cfg, xp=xp))
                except Exception as e:  # noqa: BLE001
                    log(f"  dot M=2047 {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                row(name, 2047, "exl2 dot (fused dequant-GEMM)", t, wbytes, bw, t_cub, err, str(cfg))
        del w, copies, fp16
        torch.cuda.empty_cache()
    if over_budget():
        return
    w = make_weight(4096, 14336, 4, mixed=True)  # mixed widths inside one matrix
    copies = [w] + [clone_weight(w) for _ in range(8)]
    wbytes = w.weight_bytes()
    for m in (1, 16):
        x = torch.randn(m, 4096, device="cuda").half()
        ref = qweight.matmul_torch(x, w)
        t = graph_us([lambda w_=w_: qm.quant_matmul(x, w_) for w_ in copies])
        row("gate/up mixed 8/5/4/3", m, "exl2 default", t, wbytes, bw, None, rel_err(qm.quant_matmul(x, w), ref),
            str(qm.choose_config(m, w)[1]))


def group_section(bw: float) -> None:
    """q/k/v and gate/up at M = 1 and 4: one gather + separate gemv launches (today's default) against one gather +
    one grouped launch (`qm.grouped_matmul`, behind `qm.FUSE_SHARED_INPUT`)."""
    for name, k, ns in (("q/k/v 4096→4096+1024+1024", 4096, (4096, 1024, 1024)),
                        ("gate/up 4096→2×14336", 4096, (14336, 14336))):
        if over_budget():
            break
        ws = [make_weight(k, n, 4) for n in ns]
        wbytes = sum(w.weight_bytes() for w in ws)
        n_cp = max(1, -(-COLD_BYTES // wbytes))
        sets = [ws] + [[clone_weight(w) for w in ws] for _ in range(n_cp - 1)]
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda").half()
            refs = [qweight.matmul_torch(x, w) for w in ws]

            def separate(s):
                xps = permute.gather_input(x, s)
                return [qm.quant_matmul(x, w, xp) for w, xp in zip(s, xps)]

            groups = [gemv_k.GemvGroup(s) for s in sets]

            def grouped(s, g):
                return g(permute.gather_input(x, s, whole=True))

            t_sep = graph_us([lambda s=s: separate(s) for s in sets])
            err = max(rel_err(y, r) for y, r in zip(separate(ws), refs))
            row(name, m, "gather + separate gemvs", t_sep, wbytes, bw, None, err)
            t_grp = graph_us([lambda s=s, g=g: grouped(s, g) for s, g in zip(sets, groups)])
            err = max(rel_err(y, r) for y, r in zip(grouped(ws, groups[0]), refs))
            row(name, m, "gather + one grouped gemv", t_grp, wbytes, bw, t_sep, err, "vs_cublas column = separate / grouped")
        del ws, sets
        torch.cuda.empty_cache()




def dot16_group_section(bw: float) -> None:
    """M = 16 q/k/v and gate/up: one launch per weight (the dispatcher's `permuted_matmul`) against one grouped
    launch (`grouped_matmul`), both on a pre-gathered input."""
    for name, k, ns in (("q/k/v 4096→4096+1024+1024", 4096, (4096, 1024, 1024)),
                        ("gate/up 4096→2×14336", 4096, (14336, 14336))):
        ws = [make_weight(k, n, 4) for n in ns]
        wbytes = sum(w.weight_bytes() for w in ws)
        sets = [ws] + [[clone_weight(w) for w in ws] for _ in range(max(1, -(-COLD_BYTES // wbytes)) - 1)]
        x = torch.randn(16, k, device="cuda").half()
        refs = [qweight.matmul_torch(x, w) for w in ws]
        bufs = [permute.gather_input(x, s, whole=True) for s in sets]
        views = [permute.split_permuted(b, s) for b, s in zip(bufs, sets)]
        t_sep = graph_us([lambda s=s, v=v: [qm.permuted_matmul(xp, w) for w, xp in zip(s, v)]
                          for s, v in zip(sets, views)])
        err = max(rel_err(qm.permuted_matmul(xp, w), r) for w, xp, r in zip(ws, views[0], refs))
        row(name, 16, "separate launches", t_sep, wbytes, bw, None, err)
        t_grp = graph_us([lambda s=s, b=b: qm.grouped_matmul(x, s, b) for s, b in zip(sets, bufs)])
        err = max(rel_err(y, r) for y, r in zip(qm.grouped_matmul(x, ws, bufs[0]), refs))
        row(name, 16, "one grouped launch", t_grp, wbytes, bw, t_sep, err, "vs_cublas column = separate / grouped")
        del ws, sets, bufs, views
        torch.cuda.empty_cache()


def dot16_section(bw: float) -> None:
    """M = 16 per Llama-3-8B shape (and the body shapes with mixed 8/5/4/3-bit classes), graph-timed on cold
    weights: the dispatcher's default and the Triton kernel it replaces (EXL2_MMA4=0), then (DOT16_SWEEP) the
    Gluon kernel over steps per iteration, tile width, K split and ring depth, and the Triton kernel over tile
    sizes, pipeline depths, warps and K splits."""
    C = MatmulConfig
    cfgs = [C(bm=16, bs=bs, bn=bn, split=sp, num_warps=nw, num_stages=st)
            for bs, bn, nw, st in ((4, 64, 4, 4), (4, 64, 4, 2), (4, 64, 4, 3), (2, 64, 4, 4), (8, 64, 4, 3),
                                   (4, 128, 4, 3), (4, 128, 8, 3), (4, 32, 4, 4), (2, 128, 4, 4), (8, 128, 8, 3))
            for sp in (1, 4)]
    shapes = [s + (False,) for s in SHAPES] + [(f"{s[0]} mixed", *s[1:], True) for s in SHAPES[:4]]
    for name, k, n, bits, mixed in shapes:
        if over_budget():
            break
        w, wbytes, copies = cold_weights(k, n, bits, mixed)
        x = torch.randn(16, k, device="cuda").half()
        xp = permute.gather_input(x, [w])[0]
        ref = qweight.matmul_torch(x, w)
        path, cfg = qm.choose_config(16, w)
        qm.MMA4 = False
        try:
            t0 = graph_us([lambda w_=w_: qm.permuted_matmul(xp, w_) for w_ in copies])
            row(name, 16, "Triton kernel (EXL2_MMA4=0)", t0, wbytes, bw, None, rel_err(qm.permuted_matmul(xp, w), ref))
        finally:
            qm.MMA4 = True
        t = graph_us([lambda w_=w_: qm.permuted_matmul(xp, w_) for w_ in copies])
        row(name, 16, "dispatcher default", t, wbytes, bw, t0, rel_err(qm.permuted_matmul(xp, w), ref),
            f"{cfg}; vs_cublas column = Triton kernel / default")
        if mma_dot.supports(w, 16) and os.environ.get("DOT16_SWEEP", "1") == "1":
            grid = {v: triton.cdiv(n, 32 * v) for v in (1, 2, 4)}
            mcfg = [(bs, v, sp, st) for bs in (2, 4, 8) for v in (1, 2, 4) for st in (3, 4) for sp in (1, 2, 4, 8)
                    if sp == 1 or grid[v] * sp <= 6 * backend.sm_count(w.device)]
            best = sweep(copies, x, lambda x_, w_, c: mma_dot.mma(xp, w_, *c), mcfg, ref, f"{name} M=16 mma")
            if best:
                row(name, 16, "gluon mma best", best[0], wbytes, bw, None, best[2], f"bs, v, split, stages = {best[1]}")
        # a split only where the tiles alone leave SMs idle
        cands = [c for c in cfgs if c.split == 1 or triton.cdiv(n, c.bn) < 2 * backend.sm_count(w.device)]
        best = sweep(copies, x, lambda x_, w_, c: dot_k.dot(x_, w_, c, xp=xp), cands, ref, f"{name} M=16 dot")
        if best:
            row(name, 16, "Triton dot best", best[0], wbytes, bw, None, best[2], str(best[1]))
        del w, copies
        torch.cuda.empty_cache()


def decode_inputs(k: int, ns, bits: int):
    """Weights of widths `ns` sharing one [1, k] input, as the M = 1 sections time them: (weights, their bytes,
    cold copies of them, x, the twin's outputs, each copy's permuted-input buffer)."""
    ws = [make_weight(k, n, bits) for n in ns]
    wbytes = sum(w.weight_bytes() for w in ws)
    sets = [ws] + [[clone_weight(w) for w in ws] for _ in range(max(1, -(-COLD_BYTES // wbytes)) - 1)]
    x = torch.randn(1, k, device="cuda").half()
    refs = [qweight.matmul_torch(x, w) for w in ws]
    return ws, wbytes, sets, x, refs, [permute.gather_input(x, s, whole=True) for s in sets]


def decode_section(bw: float) -> None:
    """M = 1 gemvs of a Llama-3-8B layer as the decoder runs them: q/k/v and gate/up grouped (`GemvGroup`), o,
    down and the 6-bit head on their own (`gemv`)."""
    cases = (("q/k/v", 4096, (4096, 1024, 1024), 4), ("gate/up", 4096, (14336, 14336), 4), ("o", 4096, (4096,), 4),
             ("down", 14336, (4096,), 4), ("head (6-bit)", 4096, (128256,), 6))
    for name, k, ns, bits in cases:
        if over_budget():
            break
        ws, wbytes, sets, x, refs, bufs = decode_inputs(k, ns, bits)
        if len(ws) > 1:
            groups = [gemv_k.GemvGroup(s) for s in sets]
            t = graph_us([lambda g=g, b=b: g(b) for g, b in zip(groups, bufs)])
            err = max(rel_err(y, r) for y, r in zip(groups[0](bufs[0]), refs))
            row(name, 1, "grouped gemv", t, wbytes, bw, None, err)
        else:
            path, cfg = qm.choose_config(1, ws[0])
            t = graph_us([lambda s=s, b=b: gemv_k.gemv(x, s[0], cfg, xp=b) for s, b in zip(sets, bufs)])
            err = rel_err(gemv_k.gemv(x, ws[0], cfg, xp=bufs[0]), refs[0])
            row(name, 1, "gemv", t, wbytes, bw, None, err, str(cfg))
        del ws, sets, bufs
        torch.cuda.empty_cache()


def tiles_section(bw: float) -> None:
    """M = 1 gemvs of a Llama-3-8B layer with narrower column tiles (64), more warps or more programs per SM than
    the defaults, for the grouped q/k/v and gate/up launches (`GemvGroup`) and the single o and down ones."""
    C = MatmulConfig
    # session 11: ncu put the default gate gemv at 11 % achieved occupancy (0.5 issued per scheduler and cycle),
    # so this set adds warps per program and programs per SM (session 4's set: 2-8 warps, <= 3 per SM)
    group_cfgs = [dict(bn=bn, bs=bs, num_warps=nw, stages=st, per_sm=ps) for bn, bs, nw, st, ps in
                  ((64, 8, 4, 3, 2), (64, 8, 8, 3, 2), (64, 8, 8, 3, 4), (64, 8, 4, 3, 4), (64, 8, 8, 3, 8),
                   (64, 16, 8, 3, 2), (64, 16, 8, 2, 4), (32, 8, 4, 3, 2), (32, 8, 4, 3, 4), (32, 8, 2, 3, 4),
                   (128, 8, 8, 3, 2), (64, 8, 8, 4, 4))]
    single_cfgs = [C(bs=bs, bn=bn, split=sp, num_warps=nw, num_stages=3) for bn, bs, nw in
                   ((64, 8, 4), (64, 8, 8), (64, 16, 8), (32, 8, 4)) for sp in (2, 4, 8, 16)]
    for name, k, ns in (("q/k/v", 4096, (4096, 1024, 1024)), ("gate/up", 4096, (14336, 14336)),
                        ("o", 4096, (4096,)), ("down", 14336, (4096,))):
        if over_budget():
            break
        ws, wbytes, sets, x, refs, bufs = decode_inputs(k, ns, 4)
        if len(ws) > 1:
            cands = [(str(c), [lambda b, g=gemv_k.GemvGroup(s, **c): g(b) for s in sets]) for c in group_cfgs]
        else:
            cands = [(str(c), [lambda b, w=s[0], c=c: [gemv_k.gemv(x, w, c, xp=b)] for s in sets]) for c in single_cfgs]
        best = None
        for label, fns in cands:
            if over_budget():
                break
            try:
                err = max(rel_err(y, r) for y, r in zip(fns[0](bufs[0]), refs))
                t = graph_us([lambda f=f, b=b: f(b) for f, b in zip(fns, bufs)])
            except Exception as e:  # noqa: BLE001 - report and go on with the other configs
                log(f"  tiles {name} {label} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            log(f"    tiles {name} {label}: {t:.2f} us err {err:.1e}")
            if best is None or t < best[0]:
                best = (t, label, err)
            if label == cands[0][0]:
                row(name, 1, "gemv, default tiles", t, wbytes, bw, None, err, label)
        if best:
            row(name, 1, "gemv, best tiles", best[0], wbytes, bw, None, best[2], best[1])
        del ws, sets, bufs
        torch.cuda.empty_cache()


def dequant_section(bw: float) -> None:
    """The prefill's dequantization to fp16 (the large-M path, before cuBLAS) at Llama-3-8B shapes, q/k/v and
    gate/up as one launch into one matrix (`_dequant_group`): bytes moved (codes and scales read, fp16 written)
    against the copy bandwidth, over tile sizes (steps, columns, warps); every result bit-equal to the default's."""
    cfgs = [(4, 128, 4)] + [(bs, bn, nw) for bs in (2, 4, 8) for bn in (64, 128, 256) for nw in (4, 8)
                            if (bs, bn, nw) != (4, 128, 4)]
    for name, k, ns in (("q/k/v", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)),
                        ("gate/up", 4096, (14336, 14336)), ("down", 14336, (4096,))):
        if over_budget():
            break
        ws = [make_weight(k, n, 4) for n in ns]
        nbytes = sum(w.weight_bytes() for w in ws) + k * sum(ns) * 2
        out = torch.empty((k, sum(ns)), dtype=torch.float16, device="cuda")

        def run(cfg):
            bs, bn, nw = cfg
            if len(ws) > 1:
                dequant._dequant_group(out, ws, bs, bn, nw)
            else:
                dequant.dequantize_triton(ws[0], bs, bn, out=out, num_warps=nw)
        run(cfgs[0])
        ref = out.clone()
        best = None
        for cfg in cfgs:
            if over_budget():
                break
            try:
                out.zero_()
                run(cfg)
                ok = torch.equal(out, ref)
                t = graph_us([lambda cfg=cfg: run(cfg)])
            except Exception as e:  # noqa: BLE001 - report and go on with the other configs
                log(f"  dequant {name} {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            log(f"    dequant {name} bs, bn, warps = {cfg}: {t:.1f} us{'' if ok else '  WRONG RESULT'}")
            if cfg == cfgs[0]:
                row(name, 2047, "dequantize, default tiles", t, nbytes, bw, None, 0.0, str(cfg))
            if ok and (best is None or t < best[0]):
                best = (t, cfg)
        if best:
            row(name, 2047, "dequantize, best tiles", best[0], nbytes, bw, None, 0.0, str(best[1]))
        del ws, out, ref
        torch.cuda.empty_cache()


def chunks_section(bw: float) -> None:
    """Whether the prefill's dequantize + cuBLAS pays when done in column chunks small enough to stay in L2 (a
    reused [K, C] buffer, dequantized then multiplied before the next chunk overwrites it): the fp16 weight's DRAM
    write and read-back would go. Per shape at M = 2047: the engine's path, its GEMM alone on a ready fp16
    weight, its dequantization alone, then chunk sizes C (N / C distinct random weights, so no codes are L2-hot)."""
    m = 2047
    for name, k, n, sizes in (("gate/up", 4096, 28672, (1024, 2048, 3584, 4096, 7168)),
                              ("down", 14336, 4096, (512, 1024, 2048)),
                              ("q/k/v", 4096, 6144, (1024, 2048, 3072)),
                              ("o", 4096, 4096, (1024, 2048))):
        if over_budget():
            break
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = make_weight(k, n, 4)
        wd = dequant.dequantize_triton(w)
        flops = 2 * m * k * n
        t_full = graph_us([lambda: dequant.dequant_matmul(x, w)], reps=10)
        t_gemm = graph_us([lambda: torch.matmul(x, wd)], reps=10)
        t_deq = graph_us([lambda: dequant.dequantize_triton(w, out=wd)], reps=10)
        log(f"  chunks {name}: engine {t_full:.0f} us, GEMM alone {t_gemm:.0f} us ({flops / t_gemm / 1e6:.0f} TFLOPS), "
            f"dequantize alone {t_deq:.0f} us")
        record(shape=name, path="engine (dequantize all, one GEMM)", c=n, us=t_full, tflops=flops / t_full / 1e6)
        record(shape=name, path="GEMM alone", c=n, us=t_gemm, tflops=flops / t_gemm / 1e6)
        record(shape=name, path="dequantize alone", c=n, us=t_deq, tflops=0.0)
        del wd
        for c in sizes:
            if over_budget():
                break
            parts = [make_weight(k, c, 4) for _ in range(n // c)]
            buf = torch.empty(k, c, dtype=torch.float16, device="cuda")
            ys = [torch.empty(m, c, dtype=torch.float16, device="cuda") for _ in parts]

            def chunked():
                for p, y in zip(parts, ys):
                    dequant.dequantize_triton(p, out=buf)
                    torch.matmul(x, buf, out=y)

            def deq_only():
                for p in parts:
                    dequant.dequantize_triton(p, out=buf)
            t = graph_us([chunked], reps=4)
            td = graph_us([deq_only], reps=4)
            log(f"  chunks {name} C={c}: {t:.0f} us ({t_full / t:.2f}x the engine), dequantize only {td:.0f} us")
            record(shape=name, path="chunked", c=c, us=t, tflops=flops / t / 1e6)
            record(shape=name, path="chunked, dequantize only", c=c, us=td, tflops=0.0)
            del parts, buf, ys
        del x, w
        torch.cuda.empty_cache()


def norm_section(bw: float) -> None:
    """The RMSNorm that feeds the quantized projections, at decode sizes: the norm alone, the norm + one
    `gather_input` launch for the permuted copies, and `rms_norm_gather` (the copies written by the norm's own
    launch), for the q/k/v (3 copies) and gate/up (2 copies) inputs of a 4096-wide model."""
    from types import SimpleNamespace

    from exl2.kernels import norm

    d = 4096
    w = torch.rand(d, device="cuda").half() + 0.5
    for m in (1, 16):
        x = torch.randn(m, d, device="cuda").half()
        res = torch.randn(m, d, device="cuda").half()
        for copies in (3, 2):
            idx = [torch.randperm(d, device="cuda").int() for _ in range(copies)]
            fake = [SimpleNamespace(x_index=i) for i in idx]
            label = f"rmsnorm + {copies} permuted copies, d={d}"
            t = graph_us([lambda: norm.rms_norm(x, w, 1e-5, residual=res)])
            row(label, m, "norm alone", t, 0, bw)
            t = graph_us([lambda: permute.gather_input(norm.rms_norm(x, w, 1e-5, residual=res)[0], fake, whole=True)])
            row(label, m, "norm + gather launch", t, 0, bw)
            t = graph_us([lambda: norm.rms_norm_gather(x, w, 1e-5, idx, residual=res)])
            row(label, m, "rms_norm_gather (one launch)", t, 0, bw)
    # The decode step's case: o/down leave 4 K-split partials (`SplitSum`), q/k/v (or gate/up) share one input
    # order; the launch settings of the one launch
    from exl2.kernels.split_sum import SplitSum

    parts = torch.randn(4, 1, d, device="cuda")
    res = torch.randn(1, d, device="cuda").half()
    idx = [torch.randperm(d, device="cuda").int()]
    for gblock in (512, 1024, 2048, 4096):
        for warps in (4, 8, 16):
            t = graph_us([lambda: norm.rms_norm_gather(SplitSum(parts, (1,)), w, 1e-5, idx, residual=res,
                                                       gblock=gblock, num_warps=warps)])
            row(f"rmsnorm of 4 partials + 1 permuted copy, d={d}", 1, "rms_norm_gather", t, 0, bw,
                cfg=f"gblock={gblock}, warps={warps}")


def decode_attention_inputs(batch: int, ctx: int, hq: int, hkv: int, d: int, page: int):
    """Block table, lengths, one query token per sequence, and a random paged cache (fp16 k, v and q4 codes and
    scales of each) for `batch` sequences of `ctx` tokens."""
    pages_per = -(-ctx // page)
    n_pages = batch * pages_per
    bt = torch.randperm(n_pages, device="cuda", dtype=torch.int32).view(batch, pages_per)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda").half()
    k = torch.randn(n_pages, page, hkv, d, device="cuda").half()
    v = torch.randn(n_pages, page, hkv, d, device="cuda").half()
    kc, ks = kq.quantize_kv(k, 4)
    vc, vs = kq.quantize_kv(v, 4)
    return bt, lens, q, k, v, kc, ks, vc, vs


def attention_section(bw: float, sweep_on: bool) -> None:
    hq, hkv, d, page = 32, 8, 128, 256
    for batch, ctx in ((1, 2048), (16, 128), (16, 2048)) if sweep_on else ((1, 2048), (16, 2048)):
        if over_budget():
            break
        bt, lens, q, k, v, kc, ks, vc, vs = decode_attention_inputs(batch, ctx, hq, hkv, d, page)
        modes = {"fp16": ((k, v, None, None), 16), "q4": ((kc, vc, ks, vs), 4)}
        best_t = {}
        for mode, (tensors, bits) in modes.items():
            nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
            n_cp = max(1, -(-COLD_BYTES // nbytes))
            caches = [tensors] + [tuple(None if t is None else t.clone() for t in tensors) for _ in range(n_cp - 1)]
            ref = at.paged_attention_torch(q, tensors[0], tensors[1], bt, lens, k_bits=bits, v_bits=bits,
                                           k_scales=tensors[2], v_scales=tensors[3])
            key = ("decode", "quant" if bits != 16 else "fp16")
            default = at.TUNING[key]
            grid = [(bn, nw, ve) for bn in (16, 32, 64, 128) for nw in (4, 8) for ve in (False, True)] \
                if sweep_on else [default[:2] + (at.V_EARLY,)]
            best = None
            v_early = at.V_EARLY
            for bn, nw, ve in grid:
                at.TUNING[key], at.V_EARLY = (bn, nw, default[2]), ve
                for splits in ((None, 8, 16, 32) if sweep_on else (None,)):
                    if over_budget():
                        break
                    def call(c, splits=splits):
                        return at.paged_attention(q, c[0], c[1], bt, lens, k_bits=bits, v_bits=bits, k_scales=c[2],
                                                  v_scales=c[3], num_splits=splits)
                    try:
                        err = rel_err(call(caches[0]), ref)
                        us = graph_us([lambda c=c: call(c) for c in caches])
                    except Exception as e:  # noqa: BLE001
                        log(f"  attention {mode} {bn}/{nw}/{splits} failed: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    log(f"    attn B={batch} ctx={ctx} {mode} bn={bn} warps={nw} v_early={ve} splits={splits}: "
                        f"{us:.2f} us")
                    if (bn, nw) == default[:2] and ve == v_early and splits is None:
                        row(f"attn B={batch} ctx={ctx}", batch, f"paged {mode} default", us, nbytes, bw, None, err,
                            f"bn={bn} warps={nw} splits=auto")
                    if best is None or us < best[0]:
                        best = (us, f"bn={bn} warps={nw} v_early={ve} splits={splits}", err)
            at.TUNING[key], at.V_EARLY = default, v_early
            if best:
                best_t[mode] = best[0]
                row(f"attn B={batch} ctx={ctx}", batch, f"paged {mode} best", best[0], nbytes, bw, None, best[2],
                    best[1])
            del caches
        if len(best_t) == 2:
            log(f"  q4 / fp16 time (best configs), B={batch} ctx={ctx}: {best_t['q4'] / best_t['fp16']:.3f}")
        new_k = torch.randn(batch, hkv, d, device="cuda").half()
        slots = torch.arange(batch, device="cuda") * page
        us = graph_us([lambda: kq.write_kv_quant(new_k, kc, ks, slots, 4)])
        row(f"attn B={batch}", batch, "write_kv_quant q4 (keys)", us, 0, bw)


def merge_section(bw: float) -> None:
    """Decode attention as the decoder runs it (output in o_proj's permuted order) with the merge fused into the
    last-arriving split or as its own launch, values loaded before or after the first dot, several split counts."""
    hq, hkv, d, page = 32, 8, 128, 256
    fused_default, early_default = at.FUSED_MERGE, at.V_EARLY
    perm = torch.randperm(hq * d, device="cuda").int()
    for batch, ctx in ((1, 2048), (16, 128)):
        bt, lens, q, k, v, kc, ks, vc, vs = decode_attention_inputs(batch, ctx, hq, hkv, d, page)
        for mode, c, bits in (("fp16", (k, v, None, None), 16), ("q4", (kc, vc, ks, vs), 4)):
            ref = at.scatter_columns(at.paged_attention_torch(q, c[0], c[1], bt, lens, k_bits=bits, v_bits=bits,
                                                              k_scales=c[2], v_scales=c[3]), perm)
            nbytes = sum(t.numel() * t.element_size() for t in c if t is not None)
            for fused in (True, False):
                for early in (True, False):
                    for splits in (None, 8, 16):
                        if over_budget():
                            break
                        at.FUSED_MERGE, at.V_EARLY = fused, early

                        def call(splits=splits):
                            return at.paged_attention(q, c[0], c[1], bt, lens, k_bits=bits, v_bits=bits,
                                                      k_scales=c[2], v_scales=c[3], num_splits=splits, out_index=perm)
                        try:
                            err = rel_err(call(), ref)
                            us = graph_us([call])
                        except Exception as e:  # noqa: BLE001
                            log(f"  merge {mode} {fused}/{early}/{splits} failed: {type(e).__name__}: {str(e)[:300]}")
                            continue
                        row(f"attn B={batch} ctx={ctx}", batch, f"{mode} {'fused' if fused else 'launch'} merge, "
                            f"V {'early' if early else 'late'}", us, nbytes, bw, None, err, f"splits={splits}")
    at.FUSED_MERGE, at.V_EARLY = fused_default, early_default
    try:  # registers and spills of every attention variant compiled above
        for caches in at._attn_kernel.device_caches.values():
            for key, k in caches[0].items():
                log(f"  _attn_kernel variant: {k.n_regs} registers, {k.n_spills} spills, "
                    f"{k.metadata.shared} B shared, {k.metadata.num_warps} warps | {str(key)[-160:]}")
    except Exception as e:  # noqa: BLE001 - Triton-version dependent introspection
        log(f"  (kernel statistics unavailable: {type(e).__name__}: {e})")


def table(rows) -> str:
    out = ["| shape | M | path | µs | GB/s | % copy BW | cuBLAS time / this | rel err | config |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in (r for r in rows if "gbs" in r):
        out.append(f"| {r['shape']} | {r['m']} | {r['path']} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct_bw']:.0f} | "
                   f"{r['vs_cublas']:.2f} | {r['err']:.1e} | {r['cfg']} |")
    return "\n".join(out)


def main() -> None:
    global BUDGET
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="search launch parameters (slower)")
    ap.add_argument("--json", default=None, help="write all rows as JSON here")
    ap.add_argument("--only", choices=("matmul", "attention", "group", "norm", "decode", "tiles", "merge", "dot16",
                                       "dequant", "chunks"), default=None)
    ap.add_argument("--budget", type=float, default=1e9, help="stop sweeping after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU.")
    BUDGET = args.budget
    torch.manual_seed(0)
    bw = copy_bandwidth()
    log(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"commit {os.environ.get('EXL2_COMMIT', '?')} | copy bandwidth {bw:.2f} TB/s")
    try:
        if args.only in (None, "norm"):
            try:
                norm_section(bw)
            except Exception as e:  # noqa: BLE001 - report and go on with the other sections
                log(f"norm section failed: {type(e).__name__}: {str(e)[:500]}")
        if args.only in (None, "decode"):
            decode_section(bw)
        if args.only == "tiles":
            tiles_section(bw)
        if args.only == "merge":
            merge_section(bw)
        if args.only == "dequant":
            dequant_section(bw)
        if args.only == "chunks":
            chunks_section(bw)
        if args.only == "dot16":
            dot16_group_section(bw)
            dot16_section(bw)
        if args.only in (None, "attention"):
            attention_section(bw, args.sweep)
        if args.only in (None, "matmul", "group"):
            try:
                group_section(bw)
            except Exception as e:  # noqa: BLE001 - report and go on with the other sections
                log(f"group section failed: {type(e).__name__}: {str(e)[:500]}")
        if args.only in (None, "matmul"):
            matmul_section(bw, args.sweep)
    finally:
        log(f"\n(total {time.time() - T0:.0f} s)\n")
        log(table(ROWS))
        chunk_rows = [r for r in ROWS if "tflops" in r]
        if chunk_rows:
            log("\n| shape | path | columns a chunk | µs | TFLOPS |\n| --- | --- | --- | --- | --- |")
            for r in chunk_rows:
                log(f"| {r['shape']} | {r['path']} | {r['c']} | {r['us']:.0f} | {r['tflops']:.0f} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"bw_tbs": bw, "rows": ROWS}, indent=1))


if __name__ == "__main__":
    main()
