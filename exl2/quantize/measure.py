"""Measurement pass (spec EXL2.md §3.5): score every candidate option of one block on calibration data.

For a block, a reference forward collects the projections' input Hessians and the reference outputs; then for each
row of the option table the projections are replaced by their GPTQ-quantized versions and the block is re-run.
Scores per option:

* `accuracy` — exllamav2's: 1 − mean over rows of ‖Y_q − Y_ref‖_F / ‖Y_ref‖_F (output includes the residual);
* `kl` — when output gradients of a sampled-label log-likelihood are available for this block (see
  `sensitivity.py`), the predicted contribution to the model's mean KL divergence, ½·E[(g·ΔY)²] per token: the
  second-order (Fisher) expansion of the KL in the block's output. Summed over blocks it estimates the whole
  model's KL, which is what the optimizer minimizes;
* `kl_iso` (the same with the gradient's direction averaged out) and `mse` (mean squared output error), kept for
  comparison.

The extra keys sit beside exllamav2's in each option dict; exllamav2 reads only `accuracy`, `total_bits` and the
projection dicts, so the file stays usable by it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from exl2.quantize.blocks import (HessianCollector, Proj, Slot, SourceModel, advances, map_rows, projections,
                                  run_block)
from exl2.quantize.gptq import PreparedHessian, QuantizedMatrix, gptq_quantize, prepare_hessian
from exl2.quantize.qparams import QParams, roles, table


def proj_shape(p: Proj) -> tuple[int, int, int]:
    """(K, N, bias length) of a projection."""
    bias = p.module.bias
    return p.module.in_features, p.module.out_features, (0 if bias is None else -(-bias.numel() // 32) * 32)


def option_entry(projs: list[Proj], kind: str, row: tuple[QParams, ...]) -> dict:
    """measurement.json option dict (scores filled in later): total bits and one QParams dict per projection name."""
    idx = {r: i for i, r in enumerate(roles(kind))}
    entry: dict = {"accuracy": 0.0, "total_bits": 0}
    total = 0
    for p in projs:
        qp = row[idx[p.role]]
        k, n, b = proj_shape(p)
        total += qp.total_bits(k, n, b)
        entry.setdefault(p.name, qp.to_dict())
    entry["total_bits"] = total
    return entry


def block_scores(model: SourceModel, layer, slot: Slot, states: torch.Tensor, y_ref: torch.Tensor,
                 device: torch.device, tokens_per_batch: int, grads: Optional[torch.Tensor] = None
                 ) -> dict[str, torch.Tensor]:
    """Scores of the block's current (quantized) weights against the reference outputs, as 0-d tensors on the
    device (reading them would stall a GPU once per option; `scores_to_floats` reads them all at once).

    rfn: mean over rows of the relative Frobenius error; mse: mean squared error per position; with gradients for
    the first rows, kl: ½·mean (g·ΔY)² (the Fisher estimate of the KL increase) and kl_iso: the same with the
    gradient's direction averaged out, ½·mean ‖g‖²‖ΔY‖²/H.
    """
    rel: list[torch.Tensor] = []
    sums: dict[str, torch.Tensor] = {}
    tokens = {"mse": 0, "kl": 0}

    def add(key: str, value: torch.Tensor) -> None:
        sums[key] = sums[key] + value if key in sums else value

    def each(sl, x, y):
        ref = y_ref[sl].to(device, torch.float32)
        d = y.to(torch.float32) - ref
        num = d.flatten(1).norm(dim=1)
        den = ref.flatten(1).norm(dim=1).clamp_min(1e-20)
        rel.append(num / den)
        add("mse", d.square().sum().double())
        tokens["mse"] += d.shape[0] * d.shape[1]
        if grads is not None and sl.start < grads.shape[0]:
            stop = min(sl.stop, grads.shape[0])
            g = grads[sl.start:stop].to(device, torch.float32)
            dd = d[: stop - sl.start]
            add("kl", (g * dd).sum(-1).square().sum().double() / 2)
            add("kl_iso", (g.square().sum(-1) * dd.square().sum(-1)).sum().double() / (2 * g.shape[-1]))
            tokens["kl"] += g.shape[0] * g.shape[1]

    map_rows(lambda x: run_block(model, layer, slot, x), states, device, tokens_per_batch, each=each)
    out = {"rfn": torch.cat(rel).double().mean(), "mse": sums["mse"] / max(1, tokens["mse"])}
    if tokens["kl"]:
        out["kl"] = sums["kl"] / tokens["kl"]
        out["kl_iso"] = sums["kl_iso"] / tokens["kl"]
    return out


def scores_to_floats(scores: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Read many options' score tensors with one device-to-host copy."""
    if not scores:
        return []
    keys = [list(s) for s in scores]
    flat = torch.stack([s[k].reshape(()) for s, ks in zip(scores, keys) for k in ks]).tolist()
    out, i = [], 0
    for ks in keys:
        out.append(dict(zip(ks, flat[i:i + len(ks)])))
        i += len(ks)
    return out


class ProjQuantizer:
    """Hessians of one block's projections and GPTQ on demand, sharing prepared Hessians between projections that
    see the same input (q/k/v, gate/up)."""

    def __init__(self, collector: HessianCollector, device: torch.device):
        self.collector, self.device = collector, device
        self._prepared: dict[str, PreparedHessian] = {}
        # The modules' weights get swapped for quantized ones; always quantize the originals.
        self._weights = {p.key: p.module.weight.data for p in collector.projs}

    def prepared(self, p: Proj) -> PreparedHessian:
        owner, h = self.collector.hessian(p.key, p.module.in_features, self.device)
        if owner not in self._prepared:
            self._prepared[owner] = prepare_hessian(h)
        return self._prepared[owner]

    def quantize(self, p: Proj, qp: QParams, rtn: bool = False) -> QuantizedMatrix:
        return gptq_quantize(self._weights[p.key].t(), self.prepared(p), qp, rtn=rtn)


def reference_pass(model: SourceModel, layer, slot: Slot, states: torch.Tensor, device: torch.device,
                   tokens_per_batch: int, projs: list[Proj], out: Optional[torch.Tensor] = None,
                   each: Optional[Callable] = None) -> HessianCollector:
    """Run the unquantized block over all rows: fills `out` with its outputs (and passes each batch to `each`, as
    `map_rows` does) and returns the Hessians."""
    collector = HessianCollector(projs)

    def batch_done(sl, x, y):
        collector.end_batch()
        if each is not None:
            each(sl, x, y)

    with collector:
        map_rows(lambda x: run_block(model, layer, slot, x), states, device, tokens_per_batch, out=out,
                 each=batch_done)
    return collector


def measure_slot(model: SourceModel, layer, slot: Slot, states: torch.Tensor, device: torch.device,
                 tokens_per_batch: int, grads: Optional[torch.Tensor] = None,
                 tick: Optional[Callable[[], None]] = None) -> tuple[list[dict], torch.Tensor]:
    """Options of one block with their scores, and the next block's inputs: the reference outputs (or, after a
    parallel layer's attention, the same inputs)."""
    projs = projections(layer, slot)
    y_ref = torch.empty_like(states)
    quantizer = ProjQuantizer(reference_pass(model, layer, slot, states, device, tokens_per_batch, projs, y_ref),
                              device)
    rows = table(slot.kind)
    idx = {r: i for i, r in enumerate(roles(slot.kind))}
    layouts = [[(p.key, tuple(row[idx[p.role]].layout(p.module.in_features))) for p in projs] for row in rows]
    last_use: dict = {}
    for r, lay in enumerate(layouts):
        for item in lay:
            last_use[item] = r
    originals = {p.key: p.module.weight.data for p in projs}
    cache: dict = {}
    scored: dict = {}
    results = []
    sigs = []
    try:
        for r, row in enumerate(rows):
            sig = tuple(layouts[r])
            if sig not in scored:
                for p, item in zip(projs, layouts[r]):
                    if item not in cache:
                        qm = quantizer.quantize(p, row[idx[p.role]])
                        cache[item] = qm.weight.t().to(originals[p.key].dtype).contiguous()
                    p.module.weight.data = cache[item]
                scored[sig] = block_scores(model, layer, slot, states, y_ref, device, tokens_per_batch, grads)
            sigs.append(sig)
            for item in list(cache):
                if last_use[item] <= r:
                    del cache[item]
            if tick is not None:
                tick()
    finally:
        for p in projs:
            p.module.weight.data = originals[p.key]
    values = dict(zip(scored, scores_to_floats(list(scored.values()))))
    for row, sig in zip(rows, sigs):
        entry = option_entry(projs, slot.kind, row)
        scores = values[sig]
        entry["accuracy"] = max(1e-6, 1.0 - scores["rfn"])
        entry.update({k: v for k, v in scores.items() if k != "rfn"})
        results.append(entry)
    return results, (y_ref if advances(model.spec, slot) else states)
