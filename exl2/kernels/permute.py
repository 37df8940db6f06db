"""Reading a row through an index vector with -1 for "zero": how the quantized matmuls' permuted inputs are made
(`quant_matmul.gather_input`, `norm.rms_norm_gather`, `activation.glu(index=...)`), in Triton and in PyTorch."""
from __future__ import annotations

import torch

from exl2.kernels.backend import tl, triton


@triton.jit
def gather_block(src_row, idx_ptr, dst_row, n, offs):
    """dst[p] = src[idx[p]] (0 where idx[p] < 0) for the positions `offs` below n."""
    m = offs < n
    idx = tl.load(idx_ptr + offs, mask=m, other=-1)
    v = tl.load(src_row + idx, mask=idx >= 0, other=0.0)
    tl.store(dst_row + offs, v.to(dst_row.dtype.element_ty), mask=m)


def take_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[..., index]` with 0 where index < 0: the PyTorch twin of `gather_block`."""
    i = index.long()
    return x.index_select(-1, i.clamp(min=0)).masked_fill(i < 0, 0)
