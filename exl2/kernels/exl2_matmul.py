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
        def get(key: str) -> torch.Tensor:
            name = f"{prefix}.{key}"
            if name not in tensors:
                raise FormatError(f"EXL2 layer {prefix} has no {key} tensor.")
            return tensors[name].to(device)

        q_weight = get("q_weight")
        if q_weight.dim() != 2 or q_weight.dtype not in (torch.int32, torch.uint32):
            raise FormatError(f"EXL2 layer {prefix}: q_weight must be a 2-D int32 tensor, got {q_weight.dtype} "
                              f"{list(q_weight.shape)}.")
        groups = fmt.parse_groups(get("q_groups"), q_weight.shape[0], prefix)
        n = q_weight.shape[1]
        k = sum(g.rows for g in groups)
        q_scale, q_scale_max, q_invperm = get("q_scale"), get("q_scale_max"), get("q_invperm")
        if tuple(q_scale.shape) != (len(groups), n // 8) or n % 8:
            raise FormatError(f"EXL2 layer {prefix}: q_scale has shape {list(q_scale.shape)}, expected "
                              f"[{len(groups)}, {n // 8}].")
        if tuple(q_scale_max.shape) != (len(groups),):
            raise FormatError(f"EXL2 layer {prefix}: q_scale_max has shape {list(q_scale_max.shape)}, expected "
                              f"[{len(groups)}].")
        if tuple(q_invperm.shape) != (k,):
            raise FormatError(f"EXL2 layer {prefix}: q_invperm has {q_invperm.numel()} entries for {k} rows.")
        inv = q_invperm.to(torch.int64)
        if k and (int(inv.min()) < 0 or int(inv.max()) >= k or bool(torch.bincount(inv, minlength=k).ne(1).any())):
            raise FormatError(f"EXL2 layer {prefix}: q_invperm is not a permutation of 0..{k - 1}.")
        # S = fp16((nib+1)^2 · fp16(M·prescale/256)): both products exact in fp32, one fp16 rounding each.
        m_g = (q_scale_max.to(torch.float32) * prescale / 256).to(torch.float16)
        sq = fmt.unpack_scale_codes(q_scale, n).to(torch.float32).square()
        scales = (sq * m_g.to(torch.float32).unsqueeze(1)).to(torch.float16)
        codes = fmt.unpack_codes(q_weight, groups)
        name = f"{prefix}.bias"
        bias = tensors[name].to(device) if name in tensors else None
        if bias is not None and tuple(bias.shape) != (n,):
            raise FormatError(f"EXL2 layer {prefix}: bias has shape {list(bias.shape)}, expected [{n}].")
        qw = build(codes, [(g.bits, g.rows) for g in groups], scales, None, torch.argsort(inv), bias, out_features)
        return cls(**{f: getattr(qw, f) for f in ("qweight", "scales", "zeros", "step_group", "row_index",
                                                  "classes", "k", "n", "bias", "out_features")})


def exl2_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """`x · W + bias`, x `[..., K]` → `[..., N]` (see `quant_matmul`)."""
    return quant_matmul(x, w)
