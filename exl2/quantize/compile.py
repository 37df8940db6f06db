"""Compile stage (spec EXL2.md §2.2): assemble the quantized layers and the source's other tensors into shards.

Tensors go out in module order (embedding, then per layer norms and projections, final norm, head, anything else).
Quantized projections replace their source weights; every other model tensor is stored as fp16 (kept in its own dtype
if fp16 cannot hold it); tensors outside the language model (e.g. a vision tower) are copied verbatim.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open

from exl2.formats.safetensors_io import TensorSource
from exl2.formats.writer import write_exl2_model_dir, write_safetensors_shards
from exl2.models.registry import spec_from_dir

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED = ("qkv_proj", "gate_up_proj")


def _order(name: str) -> tuple:
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    m = _LAYER_RE.match(name)
    if m:
        return (1, int(m.group(1)), name)
    if name.startswith("model.norm"):
        return (2, 0, name)
    if name.startswith("lm_head"):
        return (3, 0, name)
    return (4, 0, name)


def quantized_keys(work_dir: Path) -> list[str]:
    return sorted(p.name[: -len(".safetensors")] for p in (Path(work_dir) / "out_tensor").glob("*.safetensors"))


def _consumed(src: TensorSource, keys: list[str]) -> set[str]:
    """Source tensors replaced by quantized layers (their weights/biases, and fused tensors split by the decoder)."""
    out = set()
    for key in keys:
        out |= {f"{key}.weight", f"{key}.bias"}
        parent = key.rsplit(".", 1)[0]
        for fused in _FUSED:
            out |= {f"{parent}.{fused}.weight", f"{parent}.{fused}.bias"}
        m = re.match(r"^(.*\.experts)\.\d+\.", key)
        if m:   # fused 3-D expert tensors, split per expert by the decoder
            out |= {f"{m.group(1)}.{t}{s}" for t in ("gate_up_proj", "down_proj") for s in ("", ".weight", "_bias")}
    return {n for n in out if n in src}


def _as_stored(name: str, t: torch.Tensor) -> torch.Tensor:
    if not (name.startswith("model.") or name.startswith("lm_head")) or not t.is_floating_point():
        return t
    h = t.to(torch.float16)
    if torch.isfinite(t).all() and not torch.isfinite(h).all():
        return t
    return h


def _past_decoder(name: str, num_layers: int) -> bool:
    """A tensor of a layer past the decoder's: the next-token-prediction modules DeepSeek-V3 and GLM-4.5 files
    carry (a whole MoE layer each), which inference never runs."""
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def model_tensors(source_dir: Path | str, work_dir: Path | str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the output model, in module order, read lazily; layers past the decoder's are left out."""
    src = TensorSource(source_dir)
    keys = quantized_keys(Path(work_dir))
    consumed = _consumed(src, keys)
    num_layers = spec_from_dir(source_dir).num_layers
    items: list[tuple[tuple, str, Optional[str]]] = []
    for name in src.keys():
        if name not in consumed and not _past_decoder(name, num_layers):
            items.append((_order(name), name, None))
    for key in keys:
        items.append((_order(f"{key}.weight"), key, key))
    items.sort(key=lambda t: t[0])
    for _, name, qkey in items:
        if qkey is None:
            yield name, _as_stored(name, src[name])
            continue
        with safe_open(str(Path(work_dir) / "out_tensor" / f"{qkey}.safetensors"), framework="pt") as f:
            for tname in f.keys():
                yield tname, f.get_tensor(tname)


def compile_model(source_dir: Path | str, work_dir: Path | str, out_dir: Optional[Path | str], quant_config: dict,
                  shard_mb: int) -> list[Path]:
    """Write the shards to `out_dir` as a complete model directory, or (no -cf) the bare shards to the work dir."""
    tensors = model_tensors(source_dir, work_dir)
    if out_dir is None:
        return write_safetensors_shards(tensors, work_dir, shard_mb)
    return write_exl2_model_dir(out_dir, tensors, source_dir, quant_config, shard_mb)
