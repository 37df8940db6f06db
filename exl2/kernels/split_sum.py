"""A matmul's output left as its K-split partial sums, for a consumer that adds them while it reads them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
