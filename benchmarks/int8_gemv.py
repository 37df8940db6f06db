"""Experiment for batch-1 decode on the H200: a 4-bit EXL2 gemv on int8 activations with integer dot products
(`dp4a`), timed against the library's fp16 gemv on the same weights, from DRAM and from L2.

Session 13 timed this on an H100 from DRAM and rejected it (0.90-1.02x): there the gemv is bound by bandwidth, so
fewer instructions a weight could not show. Session 28 found the H200's gemv issue-bound instead (0.5 issued
warps a scheduler-cycle), where a word of eight 4-bit codes at 5 instructions (two masks, a shift, two `dp4a`)
against ~14 in packed fp16 is the lever. `--l2` keeps one copy of each weight in L2 so the gemv is issue-bound on
an H100 too (as `layout_probe.py --l2`). The input is quantized per 32-row step on the host (int8 codes, an fp32
scale, the codes' sum: code - 8 summed against x is dot(codes, x) - 8 sum(x)); in the library the kernel producing
it (norm-gather, GLU) would write it. Both kernels leave K-split partial sums (`[SPLIT, N]` fp32) for their
consumer, as the library's gemv does at batch 1, so neither pays an output clear.

    python3 benchmarks/int8_gemv.py [--l2]       # GPU: error against float64 and µs a call, both kernels
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl2.kernels import permute, qweight  # noqa: E402
from exl2.kernels import quant_matmul as qm  # noqa: E402
from exl2.kernels.backend import tl, triton  # noqa: E402
from exl2.kernels.gemv import _by_word, step_words4  # noqa: E402
from exl2.kernels.split_sum import SplitSum  # noqa: E402

# One step of one column: $1-$4 the words (code i of word j at bits 4i, row 8j + i), $5-$12 the input codes of
# word j as two int32 (rows 8j + 0, 2, 4, 6 and 8j + 1, 3, 5, 7, one signed byte each), $13 the step's code sum.
DP4A_STEP = "\n".join(
    ["{", ".reg .b32 lo, hi, t, d;", "mov.b32 d, 0;"]
    + [line for j in range(4) for line in (
        f"and.b32 lo, ${1 + j}, 0x0F0F0F0F;",
        f"shr.u32 t, ${1 + j}, 4;",
        "and.b32 hi, t, 0x0F0F0F0F;",
        f"dp4a.u32.s32 d, lo, ${5 + 2 * j}, d;",
        f"dp4a.u32.s32 d, hi, ${6 + 2 * j}, d;")]
    + ["mad.lo.s32 $0, $13, -8, d;", "}"])
_DP4A_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 13))
# (steps an iteration, columns a program, K split, warps) tried for the int8 kernel; the best is reported
SETTINGS = ((8, 64, 1, 4), (8, 64, 2, 4), (8, 64, 4, 4), (16, 64, 1, 4), (16, 64, 2, 4), (16, 64, 1, 8),
            (16, 32, 1, 4), (16, 32, 2, 4), (16, 32, 4, 4), (32, 32, 1, 4), (32, 32, 2, 4), (32, 64, 1, 8))
L2_CALLS = 16  # calls a graph replay with --l2 (one copy, called again and again)
DRAM_SPAN = 256 << 20  # bytes of weight copies cycled through without --l2


@triton.jit
def _gemv4_int8_kernel(xq_ptr, xs_ptr, xsum_ptr, qw_ptr, sc_ptr, sg_ptr, out_ptr, N, n_steps, SPLIT,
                       ASM: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """out[pid_k, n] = Σ over this program's share of the steps of xs·scale·(dot(codes, xq) - 8·xsum)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    s_lo = (n_steps * pid_k) // SPLIT
    s_hi = (n_steps * (pid_k + 1)) // SPLIT
    acc = tl.zeros([BS, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        offs_s = s0 + tl.arange(0, BS)
        mask_s = offs_s < s_hi
        w0, w1, w2, w3, sc = step_words4(qw_ptr, sc_ptr, sg_ptr, N, 0, 0, offs_s, mask_s, offs_n, mask_n)
        xw = tl.load(xq_ptr + offs_s[:, None] * 8 + tl.arange(0, 8)[None, :], mask=mask_s[:, None], other=0)
        ev, od = tl.split(tl.reshape(xw, [BS, 4, 2]))  # each word's even-row and odd-row codes
        e0, e1, e2, e3 = _by_word(tl.reshape(ev, [BS, 2, 2]))
        o0, o1, o2, o3 = _by_word(tl.reshape(od, [BS, 2, 2]))
        xs = tl.load(xs_ptr + offs_s, mask=mask_s, other=0.0)
        xsum = tl.load(xsum_ptr + offs_s, mask=mask_s, other=0)
        dot = tl.inline_asm_elementwise(
            ASM, _DP4A_CONSTRAINTS,
            [w0, w1, w2, w3, e0, o0, e1, o1, e2, o2, e3, o3, xsum[:, None]], dtype=tl.int32, is_pure=True, pack=1)
        acc += dot.to(tl.float32) * (sc.to(tl.float32) * xs[:, None])
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, axis=0), mask=mask_n)


def quantize_input(x: torch.Tensor, w: qweight.QuantWeight) -> tuple[torch.Tensor, ...]:
    """x `[K]` in w's stored row order, quantized per 32-row step: (codes packed as int32 `[S, 8]` in the
    kernel's order, fp32 scales `[S]`, int32 code sums `[S]`, the dequantized input in natural order)."""
    xr = x.float()[w.row_index.long()].view(-1, 32)
    scale = xr.abs().amax(1).clamp(min=1e-8) / 127.0
    q = torch.round(xr / scale[:, None]).clamp(-127, 127).to(torch.int8)
    words = q.view(-1, 4, 8)
    packed = torch.stack([words[:, :, 0::2], words[:, :, 1::2]], 2).contiguous()  # [S, word, even/odd, 4]
    xq = packed.view(torch.uint8).view(-1, 8, 4).view(torch.int32).view(-1, 8)
    deq = torch.zeros(w.k, dtype=torch.float32, device=x.device)
    deq[w.row_index.long()] = (q.float() * scale[:, None]).view(-1)
    return xq.contiguous(), scale.contiguous(), q.int().sum(1).contiguous(), deq


def gemv4_int8(xq, xs, xsum, w: qweight.QuantWeight, out: torch.Tensor, bs: int, bn: int, split: int,
               warps: int, stages: int = 3) -> torch.Tensor:
    """The K-split partial sums `[split, N]` into out."""
    if len(w.classes) != 1 or w.classes[0].bits != 4 or w.zeros is not None:
        raise ValueError("the experiment takes 4-bit EXL2 weights of one class.")
    _gemv4_int8_kernel[(triton.cdiv(w.n, bn), split)](xq, xs, xsum, w.qweight, w.scales, w.step_group, out, w.n,
                                                        w.n_steps, split, ASM=DP4A_STEP, BS=bs, BN=bn,
                                                        STAGES=stages, num_warps=warps)
    return out


def main() -> None:
    from kernels import make_weight  # noqa: E402 - the converter-like random layer of benchmarks/kernels.py
    from layout_probe import _graph_time  # noqa: E402 - the same graph timing as the layout probe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--l2", action="store_true", help="one copy of each weight, called again and again from L2")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/int8_gemv.py needs a CUDA GPU.")
    torch.manual_seed(0)
    regime = "L2" if args.l2 else "DRAM"
    print(f"4-bit gemv on {torch.cuda.get_device_name()}, weights from {regime}")
    print("| shape | fp16 gemv µs | int8 gemv µs | speed-up | int8 (bs, bn, split, warps) | fp16 err | int8 err |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, k, n in (("gate/up", 4096, 28672), ("q/k/v", 4096, 6144), ("o", 4096, 4096), ("down", 14336, 4096)):
        copies = 1 if args.l2 else max(1, DRAM_SPAN // (k * n // 2))
        calls = L2_CALLS if args.l2 else copies
        ws = [make_weight(k, n, 4) for _ in range(copies)]
        w = ws[0]
        x = torch.randn(k, device="cuda").half()
        xq, xs, xsum, deq = quantize_input(x, w)
        wd = qweight.dequantize_torch(w).double()
        ref = x.double() @ wd
        xp = permute.gather_input(x.view(1, -1), [w])[0]

        def fp16(i):
            y = qm.permuted_matmul(xp, ws[i], split_sum=True)
            return y.parts.sum(0).view(-1) if isinstance(y, SplitSum) else y.view(-1)

        err16 = float((fp16(0).double() - ref).norm() / ref.norm())
        t16 = _graph_time(lambda i: qm.permuted_matmul(xp, ws[i], split_sum=True), copies, calls)
        best = None
        for bs, bn, split, warps in SETTINGS:
            if k // 32 < split * bs:
                continue
            out = torch.empty((split, n), dtype=torch.float32, device="cuda")
            y8 = gemv4_int8(xq, xs, xsum, w, out, bs, bn, split, warps).sum(0)
            # against the same int8 input; the fp16 weights' one rounding (which the kernel skips) is ~3e-4
            err8 = float((y8.double() - deq.double() @ wd).norm() / ref.norm())
            if err8 > 2e-3:
                print(f"  {name} int8 {(bs, bn, split, warps)}: WRONG RESULT (rel err {err8:.1e})")
                continue
            t = _graph_time(lambda i, c=(bs, bn, split, warps), o=out: gemv4_int8(xq, xs, xsum, ws[i], o, *c),
                          copies, calls)
            print(f"  {name} int8 {(bs, bn, split, warps)}: {t:.2f} µs")
            if best is None or t < best[0]:
                best = (t, (bs, bn, split, warps), err8)
        if best:
            print(f"| {name} {k}→{n} | {t16:.2f} | {best[0]:.2f} | {t16 / best[0]:.2f} | {best[1]} | {err16:.1e} | "
                  f"{best[2]:.1e} |")
        quant_err = float((deq.double() @ wd - ref).norm() / ref.norm())
        print(f"  ({name}: the int8 input itself is off by {quant_err:.1e} relative)")


if __name__ == "__main__":
    main()
