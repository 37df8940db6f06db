"""Runs one quantized matmul a few times on a Llama-3-8B-shaped 4-bit layer, for profilers (ncu) to attach to.

    ncu --clock-control none --kernel-name regex:gemv --launch-skip 9 --launch-count 1 \
        python3 benchmarks/gemv_probe.py [--shape gate|q|k|down|head|qkv|gateup] [--rows M] [--mixed]

--mixed takes the body of `exl2 bench --mixed` (10 % 5-bit, 70 % 4-bit, 20 % 3-bit rows) instead of 4-bit alone;
qkv and gateup run the grouped gemv of the three or two matrices sharing one input (`--kernel-name
regex:gemv_group`, no self-checks to skip).

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
from exl2.kernels.exl2_matmul import Exl2Weight  # noqa: E402
from exl2.runtime.synthetic import MIXED_BODY_OPTION, random_exl2_layer  # noqa: E402

SHAPES = {"gate": (4096, 14336, 4), "q": (4096, 4096, 4), "k": (4096, 1024, 4), "down": (14336, 4096, 4),
          "head": (4096, 128256, 6)}
GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "gateup": (4096, (14336, 14336))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="gate", choices=sorted(SHAPES) + sorted(GROUPS))
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--rows", type=int, default=1, help="input rows (1-4: gemv, 5-64: tensor-core kernel)")
    p.add_argument("--mixed", action="store_true", help="the 5/4/3-bit body of `exl2 bench --mixed`")
    a = p.parse_args()
    if not 1 <= a.rows <= qm.DOT_MAX_M:
        p.error(f"--rows must be 1 to {qm.DOT_MAX_M}")
    if a.shape in GROUPS:
        k, ns = GROUPS[a.shape]
        perm = torch.randperm(k, device="cuda")  # one act-order permutation, as the projections of a real layer
        ws = [_layer(k, n, 4, a.mixed, perm) for n in ns]
        permute.share_input_orders(ws)
        x = torch.randn(a.rows, k, dtype=torch.float16, device="cuda")
        buf = permute.gather_input(x, ws, whole=True)
        for _ in range(a.calls):
            qm.grouped_matmul(x, ws, buf)
    else:
        k, n, bits = SHAPES[a.shape]
        w = _layer(k, n, bits, a.mixed)
        x = torch.randn(a.rows, k, dtype=torch.float16, device="cuda")
        xp = permute.gather_input(x, [w])[0]
        for _ in range(a.calls):
            qm.permuted_matmul(xp, w)
    torch.cuda.synchronize()


def _layer(k: int, n: int, bits: int, mixed: bool, perm: torch.Tensor | None = None) -> qweight.QuantWeight:
    """A random layer of one width, or with `mixed` of the bench's mixed body."""
    if mixed:
        t = random_exl2_layer(k, n, MIXED_BODY_OPTION, device="cuda", perm=perm)
        return Exl2Weight.from_tensors({f"L.{key}": v for key, v in t.items()}, "L", device="cuda")
    groups = [(bits, 128)] * (k // 128)
    codes = torch.randint(0, 1 << bits, (k, n), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(len(groups), n, device="cuda") * 0.01 + 0.001).half()
    return qweight.build(codes, groups, scales, None, torch.randperm(k, device="cuda") if perm is None else perm)


if __name__ == "__main__":
    main()
