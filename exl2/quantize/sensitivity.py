"""Output sensitivities for the measurement pass: gradients of a sampled-label log-likelihood at every block output.

For a small change ΔY of a block's output, the KL divergence of the model's next-token distribution from its own
unperturbed one is, to second order, ½·ΔYᵀ F ΔY, where F is the Fisher information in that hidden state. Sampling
one label per position from the model's own distribution and back-propagating its log-probability gives a vector g
with E[g gᵀ] = F, so ½·(g·ΔY)² averaged over positions is an unbiased estimate of the KL a quantization error causes
(cross-position effects included, since g collects the influence on every later position). The pass runs forward
layer by layer keeping each block's input, then backward block by block, so memory stays at one layer plus the
stored states of the (few) rows used.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from exl2.quantize.blocks import Slot, SourceModel, advances, run_block

GRAD_DTYPE = torch.bfloat16


MAX_TOKENS = 16384      # positions with gradients; enough to pin the per-option estimates down


def _ram_bytes() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 16e9


def rows_for(rows: int, length: int, hidden: int, num_slots: int, budget_bytes: float | None = None) -> int:
    """How many measurement rows get gradients: up to MAX_TOKENS positions, as many rows as fit a quarter of the RAM
    (≤ 16 GB) with every block's input and output gradient stored (bf16)."""
    budget = budget_bytes if budget_bytes is not None else min(16e9, 0.25 * _ram_bytes())
    per_row = length * hidden * num_slots * 4
    return max(1, min(rows, MAX_TOKENS // length, int(budget // max(1, per_row))))


def sensitivity_pass(model: SourceModel, slots: list[Slot], x0: torch.Tensor, device: torch.device, seed: int,
                     tick: Optional[Callable[[], None]] = None) -> dict[int, torch.Tensor]:
    """Gradients (bf16, CPU) at the output of every block for the rows of `x0` [S, T, H] (embedded inputs)."""
    inputs: dict[int, torch.Tensor] = {}
    x = x0
    layer = None
    with torch.no_grad():
        for slot in slots:
            if layer is None or layer.idx != slot.layer:
                layer = model.layer(slot.layer)
            if advances(model.spec, slot):
                inputs[slot.index] = x.to("cpu", GRAD_DTYPE)   # only a linearization point: bf16 is plenty
                x = torch.cat([run_block(model, layer, slot, x[r:r + 1].to(device)).cpu() for r in range(x.shape[0])])
            if slot.kind == "mlp" and tick is not None:
                tick()
    layer = None
    norm, head = model.final_norm(), model.head_linear()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = torch.empty_like(x, dtype=torch.float32)
    for r in range(x.shape[0]):
        xr = x[r:r + 1].to(device).detach().requires_grad_(True)
        with torch.enable_grad():
            logits = model.logits(norm, head, xr)[0]
            logp = torch.log_softmax(logits, dim=-1)
            cdf = logp.detach().exp().cumsum(-1)             # inverse-CDF sampling (multinomial is slow on CPU)
            u = torch.rand((cdf.shape[0], 1), generator=gen).to(cdf.device) * cdf[:, -1:]   # seeded on the host
            labels = torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1)
            loss = logp.gather(1, labels).sum()
            (gr,) = torch.autograd.grad(loss, xr)
        g[r] = gr[0].cpu()
    del norm, head
    grads: dict[int, torch.Tensor] = {}
    for slot in reversed(slots):
        if not advances(model.spec, slot):
            # A parallel layer's attention adds straight into the layer's output, whose gradient the MLP block has;
            # its backward already reached the layer's input (through the attention too), so g stays.
            grads[slot.index] = grads[slot.index + 1].clone()   # (saved as its own tensor)
            if tick is not None and slot.index:
                tick()
            continue
        grads[slot.index] = g.to(GRAD_DTYPE)
        if slot.index == 0:
            break
        if layer is None or layer.idx != slot.layer:
            layer = model.layer(slot.layer)
        x_in = inputs.pop(slot.index)
        g_in = torch.empty_like(g)
        for r in range(x_in.shape[0]):
            xr = x_in[r:r + 1].to(device, x0.dtype).requires_grad_(True)
            with torch.enable_grad():
                y = run_block(model, layer, slot, xr)
                (gr,) = torch.autograd.grad(y, xr, g[r:r + 1].to(device, y.dtype))
            g_in[r] = gr[0].to("cpu", torch.float32)
        g = g_in
        if slot.kind == "attn" and tick is not None:
            tick()
    if tick is not None:
        tick()
    return grads
