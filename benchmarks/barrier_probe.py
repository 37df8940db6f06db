"""What a kernel boundary costs a decode step, against a grid-wide barrier inside one persistent kernel.

Batch-1 decoding runs ~10 launches a layer (norm-gather, q/k/v, RoPE, attention, merge, o, norm-gather, gate/up,
GLU, down), most of them a few µs of latency with little work (benchmarks/RESULTS.md). A persistent decode kernel
would run the same phases inside one launch, separated by grid-wide barriers. This probe times one phase of a
dependent chain both ways on the same grid: each phase reads a value another program wrote in the phase before
(so the boundary is needed) and writes its own.

* `launches`: one tiny kernel a phase, captured back to back in a CUDA graph (the decode step's situation);
* `launches + PDL`: the same as programmatic dependent launches (each waits for the previous one's writes);
* `grid barrier`: one kernel of as many programs, phases separated by an arrival counter (release add, acquire
  spin) between two CTA barriers.

    python3 benchmarks/barrier_probe.py [--phases 64] [--programs 132,264,528]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.kernels.backend import pdl_sync, sm_count, tl, triton  # noqa: E402


@triton.jit
def _phase(src_ptr, dst_ptr, P):
    """dst[pid] = src[(pid + 1) % P] + 1, the value read past L1 (another SM wrote it)."""
    pid = tl.program_id(0)
    v = tl.load(src_ptr + (pid + 1) % P, cache_modifier=".cg")
    tl.store(dst_ptr + pid, v + 1)


@triton.jit
def _phase_kernel(src_ptr, dst_ptr, P, PDL: tl.constexpr):
    if PDL:
        pdl_sync()
    _phase(src_ptr, dst_ptr, P)


@triton.jit
def _grid_barrier(cnt_ptr, target):
    """Every program of the grid has arrived `target` times in all (the counter only grows): the program's stores
    are published by the release add, the others' seen after the acquire spin."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(a_ptr, b_ptr, cnt_ptr, P, PHASES: tl.constexpr):
    """PHASES phases of `_phase`, ping-ponging between a and b, one grid barrier after each but the last."""
    for i in tl.static_range(PHASES):
        if i % 2 == 0:
            _phase(a_ptr, b_ptr, P)
        else:
            _phase(b_ptr, a_ptr, P)
        if i + 1 < PHASES:
            _grid_barrier(cnt_ptr, (i + 1) * P)


def run_launches(a: torch.Tensor, b: torch.Tensor, phases: int, pdl: bool) -> None:
    p = a.numel()
    extra = {"launch_pdl": True} if pdl else {}
    for i in range(phases):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        _phase_kernel[(p,)](src, dst, p, PDL=pdl, num_warps=4, **extra)


def run_persistent(a: torch.Tensor, b: torch.Tensor, cnt: torch.Tensor, phases: int) -> None:
    """One launch; `cnt` must be zero (cleared here, inside whatever graph captures it)."""
    cnt.zero_()
    _persistent_kernel[(a.numel(),)](a, b, cnt, a.numel(), PHASES=phases, num_warps=4)


def result(a: torch.Tensor, b: torch.Tensor, phases: int) -> torch.Tensor:
    """Where the last phase wrote (every entry then equals the phase count, from zeros)."""
    return b if phases % 2 else a


def main() -> None:
    from layout_probe import _graph_time  # noqa: E402 - the same graph timing as the layout probe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=64)
    ap.add_argument("--programs", default=None, help="grid sizes, comma-separated (default: 1, 2 and 4 per SM)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/barrier_probe.py needs a CUDA GPU.")
    sms = sm_count(torch.device("cuda"))
    grids = [int(g) for g in args.programs.split(",")] if args.programs else [sms, 2 * sms, 4 * sms]
    n = args.phases
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, {n} phases")
    print("| programs | launches µs a phase | launches + PDL | grid barrier |")
    print("| --- | --- | --- | --- |")
    for p in grids:
        a = torch.zeros(p, dtype=torch.int32, device="cuda")
        b = torch.zeros_like(a)
        cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
        times = []
        for name, fn in (("launches", lambda: run_launches(a, b, n, False)),
                         ("launches + PDL", lambda: run_launches(a, b, n, True)),
                         ("grid barrier", lambda: run_persistent(a, b, cnt, n))):
            a.zero_()
            b.zero_()
            fn()
            torch.cuda.synchronize()
            ok = bool((result(a, b, n) == n).all())
            times.append(f"{_graph_time(lambda _: fn(), 1) / n:.2f}" if ok else "WRONG RESULT")
        print(f"| {p} | " + " | ".join(times) + " |")


if __name__ == "__main__":
    main()
