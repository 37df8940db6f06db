"""A mixture-of-experts block's routed experts for small batches, computed from the router's choice on the GPU
(`kernels.routed_gemv`): every (token, chosen expert) slot runs through its expert's gate/up and down weights in
a fixed set of launches, with no host read, so MoE models decode through CUDA graphs."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from exl2.kernels.backend import env_choice, use_triton
from exl2.kernels.routed_dense import RoutedDense
from exl2.kernels.routed_gemv import RoutedWeights, sum_slots
from exl2.runtime.linear import Linear

# Token rows up to which an eager MoE block takes the routed path (EXL2_MOE_ROUTED_ROWS); larger batches group
# tokens by expert (one host read, one matmul an active expert). A CUDA-graph capture always takes it.
ROUTED_MAX_ROWS = env_choice("EXL2_MOE_ROUTED_ROWS", 16, range(0, 1 << 16))


class RoutedExperts:
    """The routed tables of one MoE block's experts (`GatedMLP`s): `RoutedWeights` where gate, up and down are
    quantized, `RoutedDense` stacks where they are fp16 / bf16."""

    def __init__(self, gate_up: RoutedWeights | RoutedDense, down: RoutedWeights | RoutedDense, experts: int,
                 hidden: int, shared_order: bool, activation: str):
        # gate and up of every expert in one table (up's rows after gate's): one launch computes both
        self.gate_up, self.down = gate_up, down
        self.experts, self.hidden = experts, hidden
        self.shared_order, self.activation = shared_order, activation

    @classmethod
    def build(cls, experts: Sequence, activation: str) -> Optional["RoutedExperts"]:
        """The tables, or None where the routed path does not apply: an expert projection with LoRA adapters,
        quantized and dense projections mixed, experts that differ in shape or kind (`RoutedWeights.problem`,
        `RoutedDense.problem`), or dense experts where the kernels do not run (the CPU)."""
        if not experts:
            return None
        gates, ups, downs = ([getattr(e, name, None) for e in experts] for name in ("gate_proj", "up_proj",
                                                                                     "down_proj"))
        linears = gates + ups + downs
        if not all(isinstance(m, Linear) and not m.loras for m in linears):
            return None
        if len({(e.gate_proj.out_features, e.up_proj.out_features, e.down_proj.out_features) for e in experts}) > 1:
            return None
        hidden = downs[0].out_features
        if all(m.kernel is not None for m in linears):
            gate_up = [m.kernel for m in gates + ups]
            if RoutedWeights.problem(gate_up) or RoutedWeights.problem([m.kernel for m in downs]):
                return None
            # exllamav2 files quantize gate and up with one act-order permutation: one gathered input serves both
            shared = all(g.kernel.x_index is u.kernel.x_index for g, u in zip(gates, ups))
            return cls(RoutedWeights(gate_up), RoutedWeights([m.kernel for m in downs]), len(experts), hidden,
                       shared, activation)
        if any(m.kernel is not None or m.weight is None for m in linears) or not use_triton(gates[0].weight):
            return None
        if RoutedDense.problem(gates + ups) or RoutedDense.problem(downs):
            return None
        return cls(RoutedDense.stack(gates + ups), RoutedDense.stack(downs), len(experts), hidden, True, activation)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether `forward` should take x `[N, H]`: on the kernels' device, for small batches or a capture."""
        if not use_triton(x):
            return False
        return x.shape[0] <= ROUTED_MAX_ROWS or (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, scale_input: bool) -> torch.Tensor:
        """Σ_j w[t, j] · expert_idx[t, j](x[t]) for x `[N, H]`, idx / w `[N, k]` (`scale_input`: the expert reads
        w·x and its output is summed unweighted, Llama 4's rule)."""
        n, k = idx.shape
        s = n * k
        sel = idx.reshape(-1)
        wf = w.reshape(-1)
        scale = wf if scale_input else None
        e = self.experts   # slot s's gate, then its up: rows s and S + s of two copies of the choices
        if self.shared_order:   # gate's input order serves up: one copy a slot, read by rows s and S + s
            xp = self.gate_up.gather(x, sel, k, scale)
        else:
            xp = self.gate_up.gather(x, sel, k, scale, copies=2, e_step=e)
        gu = self.gate_up(xp, sel, copies=2, e_step=e)
        if gu.dim() == 3:   # K-split partials
            gu = gu.sum(0).to(x.dtype)
        y = self.down(self.down.glu_gather(gu, sel, self.activation), sel, weight=None if scale_input else wf)
        return sum_slots(y, k, self.hidden, x.dtype)


def prepare_routed(model: torch.nn.Module) -> int:
    """Build (or, after LoRA adapters change, rebuild) the routed tables of every MoE block of `model` (after
    `share_inputs`, whose aliased input orders they record). Returns how many blocks take the routed path."""
    return sum(bool(mod.prepare_routed()) for mod in model.modules() if hasattr(mod, "prepare_routed"))
