"""EXL2 quantized linear layers on the kernels: load-time repacking and the matmul entry point.

`Exl2Weight.from_tensors` reads the on-disk tensors of one layer (spec §1), decodes them with
`exl2.formats.exl2` and repacks them into the kernel layout of `exl2.kernels.qweight` (width classes in 32-row
steps, fp16 scales `[G, N]`, the act-order permutation as a per-row input index). `exl2_matmul(x, w)` then runs the
gemv / dot / dequant+cuBLAS path that suits M (`exl2.kernels.quant_matmul`), or the PyTorch twin on CPU.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from exl2.errors import FormatError
from exl2.formats import exl2 as fmt
from exl2.kernels.qweight import QuantWeight, build
from exl2.kernels.quant_matmul import quant_matmul


class Exl2Weight(QuantWeight):
    """A loaded EXL2 layer (a `QuantWeight`)."""

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor] | Any, prefix: str,
                     device: torch.device | str = "cpu", prescale: float = 1.0,
                     out_features: int | None = None) -> "Exl2Weight":
        """Build from `<prefix>.q_weight`, `q_scale`, `q_scale_max`, `q_groups`, `q_invperm` (and `bias`).

        `prescale` is the model-level factor exllamav2 folds into the scales at load (logit scale for the head,
        residual multiplier for o_proj/down_proj; spec §1.5). `out_features` records the true width when N was
        padded to 32 (outputs keep the padded width N).
        """
        q_weight, groups, scales, inv = fmt.read_layer(tensors, prefix, prescale)
        q_weight, scales, inv = q_weight.to(device), scales.to(device), inv.to(device)
        n = q_weight.shape[1]
        codes = fmt.unpack_codes(q_weight, groups)
        name = f"{prefix}.bias"
        bias = tensors[name].to(device) if name in tensors else None
        if bias is not None and tuple(bias.shape) != (n,):
            raise FormatError(f"EXL2 layer {prefix}: bias has shape {list(bias.shape)}, expected [{n}].")
        qw = build(codes, [(g.bits, g.rows) for g in groups], scales, None, torch.argsort(inv), bias, out_features)
        return cls(**{f: getattr(qw, f) for f in ("qweight", "scales", "zeros", "step_group", "row_index", "x_index",
                                                  "classes", "k", "n", "bias", "out_features")})


def exl2_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """`x · W + bias`, x `[..., K]` → `[..., N]` (see `quant_matmul`)."""
    return quant_matmul(x, w)
