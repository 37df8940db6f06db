"""Small per-step host values (token ids, positions, sampling settings) sent to the device without waiting.

A copy from pageable host memory to the GPU first waits for everything queued on the stream: a decode step's
sampling would then wait for the step's forward, and the host could not prepare the next step meanwhile. From
pinned memory the copy is queued behind the running work instead (PyTorch's pinned-memory cache keeps the buffer
until the copy has run).
"""
from __future__ import annotations

from typing import Sequence

import torch


def upload(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, without a wait on a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
