"""Warm L2 with the weights a later kernel of the decode step will stream, while the kernels in between leave
DRAM idle.

At batch 1 a decode step alternates weight-bound gemvs with short kernels that read little (RMSNorm, the RoPE and
cache write, attention, the merge, the GLU): about a third of the step runs with DRAM mostly idle, then each
gemv starts cold. A prefetch launch placed before such a stretch asks L2 for the next projection's bytes with
`cp.async.bulk.prefetch.L2` (sm_90; one instruction per CHUNK bytes, no registers or shared memory), so that gemv
reads them from L2. The launch takes programmatic dependent launch like its neighbours: it issues its requests
before waiting for the previous kernel (weights are never written by the step) and then waits, so the kernels
after it still see every earlier write.
"""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels.backend import INTERPRET, env_choice, pdl_args, pdl_sync, tl, triton

CHUNK = 1 << 16  # bytes per bulk request
BLOCK = 128  # requests per program (one per thread at 4 warps)
# What a decode step of at most AHEAD_ROWS rows prefetches (EXL2_L2_AHEAD, a bit mask): 1, a layer's q/k/v weights
# before its input norm; 2, o_proj's before the RoPE/cache write and attention; 4, with those, the first
# AHEAD_GATE_UP of gate/up's (EXL2_L2_GATE_UP, percent); 8, the first AHEAD_DOWN of down's before the GLU.
AHEAD = env_choice("EXL2_L2_AHEAD", 0, range(0, 16))
AHEAD_ROWS = env_choice("EXL2_L2_AHEAD_ROWS", 4, range(1, 4097))
AHEAD_GATE_UP = env_choice("EXL2_L2_GATE_UP", 30, range(0, 101)) / 100
AHEAD_DOWN = env_choice("EXL2_L2_DOWN", 30, range(0, 101)) / 100


@triton.jit
def _l2_prefetch_kernel(table_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Entry i of the int64 table [n, 2] is (address, bytes): a 16-byte aligned run of at most 2**31 bytes."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    addr = tl.load(table_ptr + 2 * i, mask=ok, other=0)
    size = tl.load(table_ptr + 2 * i + 1, mask=ok, other=0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{\n .reg .pred p;\n setp.ne.s32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;\n}",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        pdl_sync()


def chunk_table(regions: Sequence[tuple[int, int]], chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(address, bytes) requests covering each (address, bytes) region with 16-byte aligned pieces of at most
    `chunk` bytes, never outside the region (a ragged head or tail under 16 bytes is left out)."""
    out = []
    for addr, nbytes in regions:
        start, end = (addr + 15) // 16 * 16, (addr + nbytes) // 16 * 16
        for a in range(start, end, chunk):
            out.append((a, min(chunk, end - a)))
    return out


def tensor_region(t: torch.Tensor, fraction: float = 1.0) -> tuple[int, int]:
    """The first `fraction` of a contiguous tensor's bytes as an (address, bytes) region."""
    if not t.is_contiguous():
        raise ValueError("L2 prefetch regions must be contiguous tensors.")
    return t.data_ptr(), int(t.numel() * t.element_size() * fraction)


class L2Prefetch:
    """One prefetch launch for a fixed set of regions (the table is built once, so CUDA graphs can replay it)."""

    def __init__(self, regions: Sequence[tuple[int, int]], device: torch.device, chunk: int = CHUNK):
        table = chunk_table(regions, chunk)
        self.nbytes = sum(size for _, size in table)
        self.n = len(table)
        self.table = torch.tensor(table or [(0, 0)], dtype=torch.int64, device=device).contiguous()

    def __call__(self) -> None:
        if self.n == 0 or self.table.device.type != "cuda" or INTERPRET:
            return  # off the GPU there is no L2 to warm; the twin path has nothing to do
        _l2_prefetch_kernel[(triton.cdiv(self.n, BLOCK),)](self.table, self.n, BLOCK=BLOCK, num_warps=BLOCK // 32,
                                                           **pdl_args(self.table.device, 1, small=True))
