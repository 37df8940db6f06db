"""Runs one quantized matmul a few times on a Llama-3-8B-shaped 4-bit layer, for profilers (ncu) to attach to.

    ncu --clock-control none --kernel-name regex:gemv --launch-skip 9 --launch-count 1 \
        python3 benchmarks/gemv_probe.py [--shape gate|q|k|down|head] [--rows M]

The first six gemv launches of a process are the packed decoders' self-checks (`gemv.fast4_available`, one a
width), hence the skip of 9. With --rows 5..16 the Gluon tensor-core kernel runs instead (`--kernel-name regex:_mma_kernel`, the `ncumma`
step of benchmarks/device.sh), with 17..64 the Triton one (`regex:dot`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl2.kernels import quant_matmul as qm  # noqa: E402
from exl2.kernels import permute  # noqa: E402
from exl2.kernels import qweight  # noqa: E402

SHAPES = {"gate": (4096, 14336, 4), "q": (4096, 4096, 4), "k": (4096, 1024, 4), "down": (14336, 4096, 4),
          "head": (4096, 128256, 6)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="gate", choices=sorted(SHAPES))
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--rows", type=int, default=1, help="input rows (1-4: gemv, 5-64: tensor-core kernel)")
    a = p.parse_args()
    k, n, bits = SHAPES[a.shape]
    groups = [(bits, 128)] * (k // 128)
    codes = torch.randint(0, 1 << bits, (k, n), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(len(groups), n, device="cuda") * 0.01 + 0.001).half()
    w = qweight.build(codes, groups, scales, None, torch.randperm(k, device="cuda"))
    if not 1 <= a.rows <= qm.DOT_MAX_M:
        p.error(f"--rows must be 1 to {qm.DOT_MAX_M}")
    x = torch.randn(a.rows, k, dtype=torch.float16, device="cuda")
    xp = permute.gather_input(x, [w])[0]
    for _ in range(a.calls):
        qm.permuted_matmul(xp, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
