"""Linear layers whatever the weight format: dense, EXL2 or GPTQ, on CPU (PyTorch) or GPU (Triton kernels)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x · W + b.

    `weight` is the dense [out, in] matrix (the CPU path dequantizes quantized layers once at load);
    `kernel`, when set, is a callable `kernel(x2d) -> y2d` from exl2.kernels that computes straight from the
    quantized data on the GPU. `info` records the on-disk format for `exl2 info` and the quantizer.
    """

    def __init__(self, in_features: int, out_features: int, weight: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, kernel=None, info: Optional[dict] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight, requires_grad=False) if weight is not None else None
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.kernel = kernel
        self.info = info or {"format": "dense"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            shape = x.shape
            y = self.kernel(x.reshape(-1, shape[-1]))[:, : self.out_features]
            y = y.reshape(*shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.info.get('format')}"
