"""Quantization pass (spec EXL2.md §3.8, §2.4): quantize each block with its chosen option, in order.

Each block's Hessians come from its inputs on the partly quantized model (errors of earlier blocks included), its
projections are GPTQ-quantized, packed and saved, the module's weights are replaced by the dequantized packed
weights, and the block's quantized outputs become the next block's inputs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from exl2.formats.exl2 import dequantize, pack
from exl2.formats.writer import atomic_write
from exl2.quantize.blocks import (HessianCollector, Proj, Slot, SourceModel, advances, map_rows, projections,
                                  run_block)
from exl2.quantize.gptq import QuantizedMatrix
from exl2.quantize.measure import ProjQuantizer, reference_pass
from exl2.quantize.qparams import QPARAMS_HEAD, QParams

RTN_HEAD_NUMEL = 1e9          # exllamav2 quantizes heads larger than this without error feedback
RFN_ROWS = 16                 # rows kept to report each block's relative error


def tensor_file(out_dir: Path, key: str) -> Path:
    return Path(out_dir) / "out_tensor" / f"{key}.safetensors"


def pack_and_check(key: str, qm: QuantizedMatrix, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Packed tensors (with the layer prefix) after checking that they read back bit-exactly (§1.10 step 5)."""
    packed = pack(qm.codes, qm.groups, qm.scale_codes.to(torch.int64), qm.scale_max, qm.perm,
                  None if bias is None else bias.to(torch.float16))
    tensors = {f"{key}.{name}": t.contiguous() for name, t in packed.items()}
    back = dequantize(tensors, key)[:, : qm.weight.shape[1]]
    if not torch.equal(back.cpu(), qm.weight.cpu()):
        raise RuntimeError(f"packed layer {key} does not read back as quantized")
    return tensors


def save_tensors(out_dir: Path, key: str, tensors: dict[str, torch.Tensor]) -> None:
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(tensor_file(out_dir, key), lambda tmp: save_file(cpu, str(tmp)))


def quantize_proj(quantizer: ProjQuantizer, p: Proj, qp: QParams, out_dir: Path, rtn: bool = False) -> None:
    qm = quantizer.quantize(p, qp, rtn=rtn)
    save_tensors(out_dir, p.key, pack_and_check(p.key, qm, p.module.bias))
    p.module.weight.data = qm.weight.t().to(p.module.weight.dtype).contiguous()


def quantize_slot(model: SourceModel, layer, slot: Slot, option: dict, states: torch.Tensor, device: torch.device,
                  tokens_per_batch: int, out_dir: Path) -> float:
    """Quantize one block in place (`states` become its quantized outputs, except after a parallel layer's attention,
    whose MLP reads the same inputs); returns the mean relative error of the quantized block against the
    unquantized one on the same inputs (over the first rows)."""
    projs = projections(layer, slot)
    for p in projs:
        if p.name not in option:
            raise RuntimeError(f"the strategy for {slot.key} has no option for {p.name}")
    keep = min(RFN_ROWS, states.shape[0])
    ref, got = torch.empty_like(states[:keep]), torch.empty_like(states[:keep])

    def first_rows(into: torch.Tensor):
        def each(sl, x, y):
            if sl.start < keep:
                stop = min(sl.stop, keep)
                into[sl.start:stop] = y[: stop - sl.start].to(into.device, into.dtype)
        return each

    # The first rows' unquantized outputs come from the Hessian pass. All Hessians come from the unquantized block
    # (as in exllamav2): quantizing q/k/v or gate/up first and re-collecting o_proj/down_proj Hessians ("true
    # sequential") gave a higher KL on the golden model.
    collector = reference_pass(model, layer, slot, states, device, tokens_per_batch, projs, each=first_rows(ref))
    quantizer = ProjQuantizer(collector, device)
    for p in projs:
        quantize_proj(quantizer, p, QParams.from_dict(option[p.name]), out_dir)
    del quantizer, collector
    map_rows(lambda x: run_block(model, layer, slot, x), states, device, tokens_per_batch,
             out=states if advances(model.spec, slot) else None, each=first_rows(got))
    d = (got - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-20)
    return float(d.mean())


def quantize_head(model: SourceModel, states: torch.Tensor, head_bits: int, device: torch.device,
                  tokens_per_batch: int, out_dir: Path):
    """Quantize lm_head on the final-norm output of the quantized model (§2.4).

    Returns (relative error of the logits on a few positions, final norm, quantized head module).
    """
    norm, head = model.final_norm(), model.head_linear()
    proj = Proj("lm_head", "head", "lm_head", head)
    collector = HessianCollector([proj])
    map_rows(lambda x: norm(x), states, device, tokens_per_batch, each=lambda sl, x, y: collector.add("lm_head", y))
    sample = states[:1, :256].to(device)     # the logits are large: report the error on a few positions
    with torch.no_grad():
        ref = head(norm(sample)).float()
    rtn = head.in_features * head.out_features > RTN_HEAD_NUMEL
    quantize_proj(ProjQuantizer(collector, device), proj, QPARAMS_HEAD[head_bits], out_dir, rtn=rtn)
    with torch.no_grad():
        out = head(norm(sample)).float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-20)), norm, head


def calibration_perplexity(model: SourceModel, norm, head, states: torch.Tensor, ids: torch.Tensor,
                           device: torch.device) -> float:
    """Perplexity of calibration rows through the quantized model (exllamav2's "calibration perplexity (quant)")."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for r in range(states.shape[0]):
            logits = model.logits(norm, head, states[r:r + 1].to(device))[0, :-1]
            target = ids[r, 1:].to(device)
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += target.numel()
    return float(torch.exp(torch.tensor(nll / max(1, count))))
