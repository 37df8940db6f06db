"""LoRA adapters in PEFT's format, applied at runtime instead of merged into the weights.

Quantized weights cannot take a merged delta without requantizing, and several adapters can be switched per
model without reloading it: each targeted `Linear` adds `scale · (x · Aᵀ) · Bᵀ` to its output (`Linear.loras`).
Adapters match the model's linears by the Hugging Face module each was loaded from (`Linear.source`), so one
on a fused projection (Phi-3's qkv_proj, gate_up_proj) splits its B rows over the linears the loader made of it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from exl2.errors import ConfigError, ModelLoadError
from exl2.models.routed_experts import prepare_routed
from exl2.runtime.linear import Linear, LoraWeights, RowScales, permute_lora_a

if TYPE_CHECKING:
    from exl2.models.decoder import DecoderModel

_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(eq=False)
class LoraAdapter:
    """A PEFT LoRA adapter resolved against one model: its pairs already scaled, in the model's dtype and on each
    target linear's device, keyed by the linear's module name in the model (`parts`)."""

    name: str
    path: Path
    scaling: float
    rank: int
    alpha: float
    targets: int
    parts: list[tuple[str, LoraWeights]] = field(default_factory=list, repr=False)
    rows: RowScales = field(default_factory=RowScales, repr=False)

    def __post_init__(self) -> None:
        for _, lw in self.parts:
            lw.rows = self.rows

    @property
    def targets_experts(self) -> bool:
        """Whether it changes a mixture-of-experts expert (whose rows are the tokens routed to it, not the batch's)."""
        return any(".experts." in name for name, _ in self.parts)

    @classmethod
    def from_dir(cls, path: Path | str, model: "DecoderModel", scaling: float = 1.0) -> "LoraAdapter":
        """Read `adapter_config.json` and `adapter_model.safetensors` from `path` and match every module the
        adapter changes to the model's linears (their input and output sizes must agree)."""
        path = Path(path)
        name = path.resolve().name
        _check_supported_model(model)
        cfg = _read_config(path, name)
        tensors = _read_tensors(path, name)
        rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
        if rank <= 0:
            raise ConfigError(f"LoRA adapter {name!r} has rank r={rank}; it must be at least 1.")
        pairs = _pairs(tensors, name)
        index = _linear_index(model)
        rslora = bool(cfg.get("use_rslora", False))
        dtype = model.dtype
        parts: list[tuple[str, LoraWeights]] = []
        for module, (a, b) in sorted(pairs.items()):
            found = index.get(module)
            if found is None:
                raise ConfigError(f"LoRA adapter {name!r} changes the module {module!r}, which this model does not "
                                  "have.")
            r = a.shape[0]  # PEFT's rank_pattern gives some modules another rank than r
            scale = scaling * (alpha / math.sqrt(r) if rslora else alpha / r)
            out = max(end for _, _, _, end in found)
            lin0 = found[0][1]
            if a.shape[1] != lin0.in_features or b.shape[0] != out:
                raise ConfigError(f"LoRA adapter {name!r} maps {a.shape[1]}→{b.shape[0]} features in module "
                                  f"{module!r}, which maps {lin0.in_features}→{out} in this model.")
            for mod_name, lin, start, end in found:
                dev = _device_of(lin)
                lw = LoraWeights(a.to(device=dev, dtype=dtype).contiguous(),
                                 (b[start:end].float() * scale).to(device=dev, dtype=dtype).contiguous())
                parts.append((mod_name, lw))
        if not parts:
            raise ConfigError(f"LoRA adapter {name!r} holds no LoRA weights for any linear layer of this model.")
        return cls(name, path, float(scaling), rank, alpha, len(parts), parts)


def set_loras(model: "DecoderModel", adapters: Sequence[LoraAdapter]) -> None:
    """Make exactly these adapters active on the model (an empty list: none); several may be active, their deltas
    add. While any is active the model's projections return whole outputs (no K-split partial sums), so every
    delta has a place to be added; clearing them restores the default routing."""
    adapters = list(adapters)
    if adapters:
        _check_supported_model(model)
    seen: set[int] = set()
    for ad in adapters:
        if not isinstance(ad, LoraAdapter):
            raise ConfigError(f"set_loras takes LoraAdapter objects, not {type(ad).__name__}.")
        if id(ad) in seen:
            raise ConfigError(f"LoRA adapter {ad.name!r} is listed twice.")
        seen.add(id(ad))
    modules = dict(model.named_modules())
    plan: list[tuple[Linear, LoraWeights]] = []
    for ad in adapters:  # check everything before changing anything
        for mod_name, lw in ad.parts:
            lin = modules.get(mod_name)
            if not isinstance(lin, Linear) or lw.a.shape[1] != lin.in_features or lw.b.shape[0] != lin.out_features:
                raise ConfigError(f"LoRA adapter {ad.name!r} was loaded for another model: this one has no matching "
                                  f"linear {mod_name!r}.")
            dev = _device_of(lin)
            if lw.a.device != dev:
                lw.a, lw.b, lw.a_perm = lw.a.to(dev), lw.b.to(dev), None
            if lin.kernel is not None and lw.a_perm is None:
                lw.a_perm = permute_lora_a(lw.a, lin.kernel.x_index)
            plan.append((lin, lw))
    was_active = bool(getattr(model, "_active_loras", None))
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.loras:
            mod.loras = []
    for lin, lw in plan:
        lin.loras = lin.loras + [lw]
    model._active_loras = adapters
    prepare_routed(model)   # experts with adapters leave the routed path (it has no LoRA deltas)
    if adapters:
        model.route_split_sums(False)
    elif was_active:
        model.route_split_sums()


def active_loras(model: nn.Module) -> list[LoraAdapter]:
    """The adapters `set_loras` made active on the model, in its order."""
    return list(getattr(model, "_active_loras", None) or [])


def _check_supported_model(model: nn.Module) -> None:
    if getattr(model, "tensor_parallel", None) is not None:
        raise ConfigError("LoRA adapters are not supported on a tensor-parallel model; load it without "
                          "tensor_parallel to use them.")


def _read_config(path: Path, name: str) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"The LoRA adapter directory {str(path)!r} does not exist.")
    f = path / "adapter_config.json"
    if not f.is_file():
        raise ModelLoadError(f"LoRA adapter {name!r} has no adapter_config.json in {str(path)!r}.")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"LoRA adapter {name!r} has an unreadable adapter_config.json ({e}).") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"LoRA adapter {name!r} has an adapter_config.json that is not a JSON object.")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"Adapter {name!r} is a {cfg['peft_type']} adapter; only LoRA adapters are supported.")
    if cfg.get("fan_in_fan_out"):
        raise ConfigError(f"LoRA adapter {name!r} sets fan_in_fan_out (transposed Conv1D weights, as for GPT-2), "
                          "which is not supported.")
    if cfg.get("use_dora"):
        raise ConfigError(f"LoRA adapter {name!r} is a DoRA adapter (use_dora), which is not supported.")
    if cfg.get("alpha_pattern"):
        raise ConfigError(f"LoRA adapter {name!r} sets per-module alphas (alpha_pattern), which are not supported.")
    if cfg.get("modules_to_save"):
        raise ConfigError(f"LoRA adapter {name!r} also replaces whole modules ({', '.join(cfg['modules_to_save'])} "
                          "in modules_to_save), which is not supported.")
    return cfg


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    f = path / "adapter_model.safetensors"
    if not f.is_file():
        if (path / "adapter_model.bin").is_file():
            raise ModelLoadError(f"LoRA adapter {name!r} has only adapter_model.bin; save it as "
                                 "adapter_model.safetensors (PEFT's save_pretrained(safe_serialization=True)).")
        raise ModelLoadError(f"LoRA adapter {name!r} has no adapter_model.safetensors in {str(path)!r}.")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(f))
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"LoRA adapter {name!r} has an unreadable adapter_model.safetensors ({e}).") from None


def _pairs(tensors: dict[str, torch.Tensor], name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module path: (A [r, in], B [out, r])}; refuses tensors that LoRA at runtime cannot apply."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    unsupported = sorted({k.removeprefix(_PREFIX) for k in tensors if "lora_embedding" in k or "modules_to_save" in k})
    if unsupported:
        raise ConfigError(f"LoRA adapter {name!r} changes embeddings or whole modules ({', '.join(unsupported[:4])}), "
                          "which is not supported.")
    for key, t in tensors.items():
        k = key.removeprefix(_PREFIX)
        m = _KEY.match(k)
        if m is not None:
            halves.setdefault(m["module"], {})[m["which"]] = t
        elif k.endswith(".bias"):
            if bool(t.ne(0).any()):
                raise ConfigError(f"LoRA adapter {name!r} trains biases ({k}), which is not supported (bias must "
                                  "be \"none\").")
        elif "lora_magnitude_vector" in k:
            raise ConfigError(f"LoRA adapter {name!r} is a DoRA adapter ({k}), which is not supported.")
        else:
            raise ConfigError(f"LoRA adapter {name!r} holds the tensor {k!r}, which is not a LoRA weight.")
    heads = sorted(mod for mod in halves if mod == "lm_head" or mod.endswith(".lm_head"))
    if heads:
        raise ConfigError(f"LoRA adapter {name!r} changes the output head ({heads[0]}), which is not supported.")
    out = {}
    for mod, h in halves.items():
        a, b = h.get("A"), h.get("B")
        if a is None or b is None:
            raise ModelLoadError(f"LoRA adapter {name!r} lacks the lora_{'B' if b is None else 'A'} weight of "
                                 f"module {mod!r}.")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ModelLoadError(f"LoRA adapter {name!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                 f"for module {mod!r}, which do not form a rank-r pair.")
        out[mod] = (a, b)
    return out


def _linear_index(model: nn.Module) -> dict[str, list[tuple[str, Linear, int, int]]]:
    """{HF module path: [(module name in the model, Linear, first output row, end row)]} over the linears the
    loader built (those with `source`) but the output head; MoE experts' linears included (an expert is a module
    of its own in PEFT's paths, e.g. `mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`)."""
    head = getattr(model, "lm_head", None)
    index: dict[str, list[tuple[str, Linear, int, int]]] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.source is not None and mod is not head:
            prefix, start, end = mod.source
            index.setdefault(prefix, []).append((mod_name, mod, start, end))
    return index


def _device_of(lin: Linear) -> torch.device:
    if lin.weight is not None:
        return lin.weight.device
    return lin.kernel.device
