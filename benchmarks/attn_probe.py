"""Decode (and chunked-prefill) attention over a paged cache, for profilers to attach to and for variant timings.

    ncu --clock-control none --kernel-name regex:_attn_kernel --launch-skip 3 --launch-count 1 \
        python3 benchmarks/attn_probe.py [--batch 16 --ctx 128 --mode fp16 --splits 1]
    python3 benchmarks/attn_probe.py --sweep    # graph-timed table of kernel variants, cold caches
    python3 benchmarks/attn_probe.py --split-sweep --batch 1 --ctx 2048 --mode q4   # splits x tiles, one shape
    python3 benchmarks/attn_probe.py --split-sweep --quick --chunk 256 --mode q4    # chunked-prefill tiles

Shapes are Llama-3-8B's (32 query / 8 KV heads of 128, pages of 256 tokens). `--splits 1` is what the batch-16
short-context graph runs; None lets the kernel pick. The sweep varies the key block, warps, pipelining stages and
whether decode launches skip the query-offset loads (`attention.ONE_Q`).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl2.kernels import attention as at  # noqa: E402
from exl2.kernels import kv_quant as kq  # noqa: E402
from kernels import COLD_BYTES, decode_attention_inputs, graph_us, rel_err  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 256
SHORT = False  # --short: only the batch-16 one-split cases, and a few configs
CHUNK = 1  # --chunk: query tokens a sequence (more than 4: a chunked prefill over the cached context)


def inputs(batch: int, ctx: int, mode: str):
    bt, lens, q, k, v, kc, ks, vc, vs = decode_attention_inputs(batch, ctx, HQ, HKV, D, PAGE)
    if CHUNK > 1:
        q = torch.randn(batch * CHUNK, HQ, D, device=q.device).half()
    kb, vb = kq.KV_MODES[mode]
    if mode == "fp16":
        tensors = (k, v, None, None)
    elif mode == "q4":
        tensors = (kc, vc, ks, vs)
    else:
        tensors = kq.quantize_kv(k, kb) + kq.quantize_kv(v, vb)
        tensors = (tensors[0], tensors[2], tensors[1], tensors[3])
    return bt, lens, q, tensors, (kb, vb)


def _queries(lens):
    """(cu_seqlens_q, max_q_len) of CHUNK queries a sequence: None for decode."""
    if CHUNK == 1:
        return None, 1
    return torch.arange(lens.numel() + 1, dtype=torch.int32, device=lens.device) * CHUNK, CHUNK




def call(q, c, bt, lens, bits, splits, perm=None):
    """`bits`: (key bits, value bits)."""
    cu, max_q = _queries(lens)
    return at.paged_attention(q, c[0], c[1], bt, lens, cu, max_q, k_bits=bits[0], v_bits=bits[1], k_scales=c[2],
                              v_scales=c[3], num_splits=splits, out_index=perm)


def _case(batch: int, ctx: int, mode: str, layout: str, out: str):
    """Inputs of one shape, enough copies of the cache for cold timings, the reference output and the byte count.
    "perm": the output in o_proj's permuted input order, as the decoder asks for it; "contiguous": each
    sequence's pages in order, as the bench's decode step lays them out."""
    bt, lens, q, tensors, bits = inputs(batch, ctx, mode)
    if layout == "contiguous":
        bt = torch.arange(bt.numel(), dtype=torch.int32, device=bt.device).view_as(bt)
    perm = torch.randperm(HQ * D, device=q.device).int() if out == "perm" else None
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    copies = [tensors] + [tuple(None if t is None else t.clone() for t in tensors)
                          for _ in range(max(1, -(-COLD_BYTES // nbytes)) - 1)]
    ref = at.paged_attention_torch(q, tensors[0], tensors[1], bt, lens, *_queries(lens), k_bits=bits[0],
                                   v_bits=bits[1], k_scales=tensors[2], v_scales=tensors[3])
    return bt, lens, q, copies, bits, perm, ref, nbytes


def _row(cells: str, case, splits) -> None:
    """Time the current `attention.TUNING`/`ONE_Q` on a `_case` and print its table row (attention and merge)."""
    bt, lens, q, copies, bits, perm, ref, nbytes = case
    try:
        got = call(q, copies[0], bt, lens, bits, splits, perm)
        if perm is not None:
            got = got[:, perm.long()].view_as(ref)
        err = rel_err(got, ref)
        us = graph_us([lambda c=c: call(q, c, bt, lens, bits, splits, perm) for c in copies])
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
        print(f"{cells} failed: {type(e).__name__}: {str(e)[:120]} | | |")
        return
    print(f"{cells} {us:.2f} | {nbytes / us / 1e3:.0f} | {err:.1e} |", flush=True)


def _header() -> None:
    print("| batch | ctx | cache | splits | pages | out | bn | warps | stages | one_q | µs | GB/s | rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def sweep() -> None:
    saved = dict(at.TUNING), at.ONE_Q
    _header()
    for batch, ctx, mode, splits, layout, out in (
            (16, 128, "fp16", 1, "random", "plain"), (16, 128, "fp16", 1, "random", "perm"),
            (16, 128, "fp16", 1, "contiguous", "perm"), (16, 128, "q4", None, "random", "plain"),
            (1, 2048, "fp16", None, "random", "plain"), (16, 2048, "fp16", None, "random", "plain"),
            (1, 2048, "fp16", None, "random", "perm"), (16, 128, "q4", None, "random", "perm")):
        if SHORT and out != "perm":
            continue
        case = _case(batch, ctx, mode, layout, out)
        key = at.tuning_key(1, HQ // HKV, D, D, *case[4], splits)
        default = saved[0][key]
        grid = [(default[0], default[1], s, o) for s in (1, 2, 3) for o in (False, True)]
        grid += [(bn, nw, default[2], True) for bn, nw in itertools.product((32, 64, 128), (2, 4, 8))
                 if (bn, nw) != default[:2]]
        if SHORT:
            grid = [default + (True,), (64, 4, 1, True), (64, 4, 2, True), (128, 4, 1, True), (128, 4, 2, True),
                    (128, 8, 1, True)]
        for bn, nw, stages, one_q in grid:
            at.TUNING[key], at.ONE_Q = (bn, nw, stages), one_q
            _row(f"| {batch} | {ctx} | {mode} | {splits} | {layout} | {out} | {bn} | {nw} | {stages} | {one_q} |",
                 case, splits)
        at.TUNING.clear()
        at.TUNING.update(saved[0])
        at.ONE_Q = saved[1]
        del case


def split_sweep(batch: int, ctx: int, mode: str, quick: bool = False) -> None:
    """Key splits (the kernel's pick first) × key block × warps × stages for one decode shape, output in o_proj's
    order: what tunes a batch-1 long-context step (the q4 cache at ctx 2048 is 11 % behind fp16, session 16).
    `quick`: three split counts and five or six tiles, for an A/B of kernel variants in one device call. With
    --chunk above 4 (a chunked prefill) only the kernel's own split count (one)."""
    key = at.tuning_key(CHUNK, HQ // HKV, D, D, *kq.KV_MODES[mode], None)
    saved = dict(at.TUNING)
    case = _case(batch, ctx, mode, "random", "perm")
    _header()
    tiles = list(itertools.product((32, 64, 128), (2, 4, 8), (1, 2)))
    if quick:  # the default, it with the other stage count, a few others
        bn, nw, st = saved[key]
        tiles = list(dict.fromkeys([(bn, nw, st), (bn, nw, 3 - st), (64, 4, 1), (32, 4, 1), (32, 2, 1), (128, 4, 1)]))
    split_counts = (None, 16, 32) if quick else (None, 4, 8, 16, 32)
    for splits in (split_counts if key[0] == "decode" else (None,)):
        for bn, nw, stages in tiles:
            at.TUNING[key] = (bn, nw, stages)
            _row(f"| {batch} | {ctx} | {mode} | {splits} | random | perm | {bn} | {nw} | {stages} | {at.ONE_Q} |",
                 case, splits)
        at.TUNING.update(saved)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--mode", default="fp16", choices=tuple(kq.KV_MODES))
    p.add_argument("--splits", type=int, default=1, help="key splits (0: the kernel picks)")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--short", action="store_true", help="with --sweep: the permuted-output cases, a few configs")
    p.add_argument("--split-sweep", dest="split_sweep", action="store_true",
                   help="sweep splits, key block, warps and stages for --batch/--ctx/--mode")
    p.add_argument("--quick", action="store_true", help="with --split-sweep: 3 split counts x 5-6 tiles")
    p.add_argument("--chunk", type=int, default=1,
                   help="query tokens a sequence at the end of its context (> 4: the chunked-prefill tiles)")
    a = p.parse_args()
    global SHORT, CHUNK
    SHORT, CHUNK = a.short, max(1, a.chunk)
    if a.sweep:
        sweep()
        return
    if a.split_sweep:
        split_sweep(a.batch, a.ctx, a.mode, a.quick)
        return
    bt, lens, q, tensors, bits = inputs(a.batch, a.ctx, a.mode)
    for _ in range(a.calls):
        call(q, tensors, bt, lens, bits, a.splits or None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
