"""Linear layers whatever the weight format: dense, EXL2 or GPTQ, on CPU (PyTorch) or GPU (Triton kernels)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from exl2.kernels import quant_matmul as qm
from exl2.kernels.permute import gather_input, input_layout, share_input_orders, split_permuted, take_columns
from exl2.kernels.quant_matmul import (grouped_matmul, permuted_matmul, prompt_matmul, quant_matmul, uses_dequant,
                                       uses_permuted_input)
from exl2.kernels.split_sum import SplitSum


@dataclass(eq=False)
class LoraWeights:
    """One LoRA adapter's low-rank pair for one Linear (runtime.lora): the layer adds `(x · aᵀ) · bᵀ`.

    `a` [r, in]; `b` [out, r] with the adapter's scale folded in; `a_perm` [r, width]: `a`'s columns in a
    quantized kernel's input order (`QuantWeight.x_index`, zero columns for its padding), for the paths where
    only the permuted input exists."""

    a: torch.Tensor
    b: torch.Tensor
    a_perm: Optional[torch.Tensor] = None
    rows: Optional["RowScales"] = None   # the adapter's per-token multipliers, shared by all its pairs


class RowScales:
    """Per-token multipliers of one adapter's deltas, so that requests batched together can use different adapters
    (`generation.request_loras`): `scales` [capacity] holds one value per token row of the next forward, in
    batch-major order, 0 for the rows of requests without the adapter. None: every row takes the delta as it is.
    The buffer stays one tensor for good, so a CUDA graph that reads it sees each step's values."""

    def __init__(self) -> None:
        self.scales: Optional[torch.Tensor] = None


def permute_lora_a(a: torch.Tensor, x_index: torch.Tensor) -> torch.Tensor:
    """`a` [r, in] with its columns in the order of a permuted input (`xp[:, p] = x[:, x_index[p]]`, 0 where
    x_index < 0), so that `xp · a_permᵀ == x · aᵀ`."""
    return take_columns(a, x_index).contiguous()


def lora_delta(x: torch.Tensor, loras: Sequence[LoraWeights], permuted: bool = False) -> torch.Tensor:
    """The summed LoRA deltas for input x `[..., in]`, or with `permuted` for a permuted input `[..., width]`
    (each pair's `a_perm`)."""
    out = None
    for lw in loras:
        d = F.linear(F.linear(x, lw.a_perm if permuted else lw.a), lw.b)
        if lw.rows is not None and lw.rows.scales is not None:
            d = d * lw.rows.scales[: d.numel() // d.shape[-1]].view(*d.shape[:-1], 1).to(d.dtype)
        out = d if out is None else out + d
    return out


class Linear(nn.Module):
    """y = x · W + b.

    `weight` is the dense [out, in] matrix (the CPU path dequantizes quantized layers once at load);
    `kernel`, when set, is an exl2.kernels QuantWeight (EXL2 or GPTQ, bias included) that the quantized matmul
    kernels compute from directly on the GPU. `info` records the on-disk format for `exl2 info` and the quantizer.
    `source` (prefix, first row, end row): the Hugging Face module and the rows of its output this layer holds,
    which LoRA adapters are matched against; `loras`: the active adapters' pairs (runtime.lora.set_loras).
    """

    def __init__(self, in_features: int, out_features: int, weight: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, kernel=None, info: Optional[dict] = None,
                 source: Optional[tuple[str, int, int]] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight, requires_grad=False) if weight is not None else None
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.kernel = kernel
        self.info = info or {"format": "dense"}
        # set by the decoder where this layer's output feeds a norm-gather, which can add K-split partial sums
        self.split_sum = False
        self.source = source
        self.loras: list[LoraWeights] = []

    def forward(self, x: torch.Tensor, xp: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`xp`: x already permuted for this layer's kernel (see `project`)."""
        if self.kernel is not None:
            y = self.trim(quant_matmul(x, self.kernel, xp))
        else:
            y = F.linear(x, self.weight, self.bias)
        return y + lora_delta(x, self.loras) if self.loras else y

    def forward_permuted(self, xp: torch.Tensor, lead: Sequence[int]) -> torch.Tensor | SplitSum:
        """The quantized layer on its permuted input only (`[rows, S·32]`, rows ≤ 64); output `[*lead, out]`, or
        with `split_sum` set, where the kernel splits K, its partial sums (`SplitSum`, for the norm-gather).
        Active LoRA adapters add their deltas from xp through their permuted A (no partial sums then)."""
        split = self.split_sum and not self.loras and self.kernel.n == self.out_features
        y = permuted_matmul(xp, self.kernel, split)
        if isinstance(y, SplitSum):
            y.lead = tuple(lead)
            return y
        y = self.trim(y)
        if self.loras:
            y = y + lora_delta(xp, self.loras, permuted=True)
        return y.reshape(*lead, self.out_features)

    def trim(self, y: torch.Tensor) -> torch.Tensor:
        """The kernel's output without the columns EXL2 pads N with (to a multiple of 32)."""
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.info.get('format')}"


def permuted_indices(linears: Sequence[nn.Module]) -> Optional[list[torch.Tensor]]:
    """The distinct input orders (`QuantWeight.x_index`, in `input_layout` order) of 1–3 linears that are all
    quantized, so that the kernel producing their shared input can also write the permuted copies, one per
    distinct order (`rms_norm_gather`); else None."""
    if 0 < len(linears) <= 3 and all(isinstance(m, Linear) and m.kernel is not None for m in linears):
        return input_layout([m.kernel for m in linears])[0]
    return None


def share_inputs(model: nn.Module, enabled: Optional[bool] = None) -> int:
    """Alias equal input orders of the quantized linears that read one input (`share_input_orders` on every
    module's `shared_input_linears()`: q/k/v, gate/up, experts' gate/up), once after the weights are loaded.
    `enabled` None follows EXL2_SHARED_INPUT. Returns how many weights now share an earlier one's order."""
    if not (qm.SHARED_INPUT if enabled is None else enabled):
        return 0
    aliased = 0
    for mod in model.modules():
        group = getattr(mod, "shared_input_linears", None)
        if group is None:
            continue
        kernels = [m.kernel for m in group() if isinstance(m, Linear) and m.kernel is not None]
        if len(kernels) > 1:
            aliased += share_input_orders(kernels)
    return aliased


def quant_kernels(model: nn.Module) -> list:
    """The kernels' weights (QuantWeight) of every quantized linear of the model."""
    return [mod.kernel for mod in model.modules() if isinstance(mod, Linear) and mod.kernel is not None]


def set_prefill_fp8(model: nn.Module, enabled: bool = True) -> int:
    """Send the prompt-sized matmuls of every quantized linear through e4m3 (`fp8_prefill`; decoding keeps the
    exact kernels) or back. Returns how many weights it set."""
    weights = quant_kernels(model)
    for w in weights:
        w.prefill_fp8 = enabled
    return len(weights)


def project(x: torch.Tensor, linears: Sequence[nn.Module], xp: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """Apply several linears to the same input (q/k/v, gate/up). On the large-batch GPU path quantized ones
    share one GEMM (`prompt_matmul`). On the small-batch path they read x permuted into their own row
    order: `xp` holds those copies side by side, one per distinct order (`input_layout`), when the producer of x
    wrote them (see `permuted_indices`); otherwise one gather launch prepares them."""
    quant = [m for m in linears if isinstance(m, Linear) and m.kernel is not None]
    rows = x.numel() // max(1, x.shape[-1])
    if xp is None and 1 < len(quant) == len(linears) and uses_dequant(rows, x):  # large batches: one GEMM
        outs = prompt_matmul(x.reshape(rows, x.shape[-1]), [m.kernel for m in quant])
        return with_loras(x, linears, [m.trim(y.view(*x.shape[:-1], y.shape[-1])) for m, y in zip(linears, outs)])
    if xp is None and (len(quant) < 2 or not uses_permuted_input(rows, x)):
        return [m(x) for m in linears]
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    kernels = [m.kernel for m in quant]
    if len(quant) == len(linears):
        outs = grouped_matmul(x2, kernels, xp)
        if outs is not None:
            return with_loras(x, linears, [m.trim(y.view(*x.shape[:-1], y.shape[-1])) for m, y in zip(linears, outs)])
        views = gather_input(x2, kernels) if xp is None else split_permuted(xp, kernels)
        return [m(x, v) for m, v in zip(linears, views)]
    if xp is not None:
        raise ValueError("a permuted input buffer needs every linear to be quantized.")
    xps = dict(zip(map(id, quant), gather_input(x2, kernels)))
    return [m(x, xps[id(m)]) if id(m) in xps else m(x) for m in linears]


def with_loras(x: torch.Tensor, linears: Sequence[nn.Module], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`outs` (the linears' outputs on x from a path that bypasses `Linear.forward`) plus their LoRA deltas."""
    return [y + lora_delta(x, m.loras) if getattr(m, "loras", None) else y for m, y in zip(linears, outs)]
