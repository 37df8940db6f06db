"""A matmul's output left as its K-split partial sums, for a consumer that adds them while it reads them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exl2.kernels.backend import tl, triton


@dataclass
class SplitSum:
    """fp32 partial sums `[S, M, N]` of a matmul whose K was split S ways (`quant_matmul.permuted_matmul` with
    `split_sum`): the consumer (`norm.rms_norm_gather`) adds them, so the matmul's programs end without the
    arrival counter and the last program's sum. `lead`: the shape before the last dim of the summed output."""
    parts: torch.Tensor
    lead: tuple[int, ...]

    def total(self, dtype: torch.dtype) -> torch.Tensor:
        """The summed output `[*lead, N]` in `dtype`, for a consumer that cannot take the partials."""
        return self.parts.sum(0).to(dtype).view(*self.lead, self.parts.shape[-1])


@triton.jit
def load_summed(ptrs, mask, stride_part, NPART: tl.constexpr, DTYPE: tl.constexpr):
    """x at `ptrs` as fp32; with NPART > 0 `ptrs` point into the first of NPART fp32 partial sums `stride_part`
    elements apart, which are added and rounded to DTYPE as the matmul's own sum would have been stored."""
    if NPART == 0:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, NPART):
        acc += tl.load(ptrs + s * stride_part, mask=mask, other=0.0)
    return acc.to(DTYPE).to(tl.float32)


def part_args(x: "torch.Tensor | SplitSum", heads: int) -> tuple[torch.Tensor, int, int]:
    """(source `[T, heads, D]` view, partial count, elements between partials) of a kernel input that may be a
    `SplitSum` of `[S, T, heads·D]` partial sums (count 0: a plain tensor)."""
    if isinstance(x, SplitSum):
        s, t, n = x.parts.shape
        return x.parts[0].view(t, heads, n // heads), s, t * n
    return x, 0, 0
