"""Lazy, memory-mapped reading of (sharded) safetensors directories: never unpickles anything.

FP8 checkpoints (DeepSeek-V3/R1's and GLM-4.5-FP8's 128×128 blocks with `weight_scale_inv`, compressed-tensors'
per-tensor or per-channel `weight_scale`) read as bfloat16: each float8 weight is multiplied by its scales when it is
read, and the scale and activation-scale tensors are hidden, so conversion and fp16 inference see a plain model.
So do gpt-oss's MXFP4 experts (`X_blocks` of packed 4-bit values with `X_scales` powers of two for each 32): they
read as `X` in bfloat16, in the [experts, in, out] layout transformers gives them."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open

from exl2.errors import ModelLoadError


def _check_file(path: Path) -> None:
    """Catch truncated or corrupt files before safetensors does, with a readable message."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is not a safetensors file (it is only {size} bytes long).")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > size - 8:
            raise ModelLoadError(f"{path} is truncated or corrupt (its header claims {hlen} bytes, the file has {size}).")
        try:
            header = json.loads(f.read(hlen))
        except ValueError:
            raise ModelLoadError(f"{path} has an unreadable safetensors header.") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + hlen + end > size:
        raise ModelLoadError(f"{path} is truncated: it should hold {8 + hlen + end} bytes but has {size}.")


# Multimodal checkpoints (Mistral 3, Gemma 3, Llama 4: LLaVA-style wrappers) hold a text decoder under a prefix. It is
# read under the names of the text-only model, and the vision tower and projector are left out (text-only use).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
                    "model.vision_model.", "model.multi_modal_projector.")


class TensorSource:
    """All tensors of a model directory, read on demand from memory-mapped shards.

    Every `*.safetensors` file is indexed (like exllamav2, names of shards do not matter); the HF index JSON is not needed.
    A multimodal checkpoint shows only its text decoder, under text-only names (`_TEXT_PREFIXES`).
    """

    def __init__(self, model_dir: Path | str):
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        # Mistral repos ship their own-format consolidated.safetensors beside the HF shards: same weights, other names
        hf = [f for f in files if not f.name.startswith("consolidated")]
        files = hf or files
        if not files:
            raise ModelLoadError(f"{self.dir} contains no .safetensors weight files.")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for path in files:
            _check_file(path)
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{path} cannot be opened as safetensors ({e}).") from None
            self._handles[path] = handle
            for key in handle.keys():
                self._where.setdefault(key, path)
        self._stored: dict[str, str] = {}  # name shown → name in the file, where a text decoder was unwrapped
        self._unwrap_text_decoder()
        self.base_model = False   # saved without the causal-LM wrapper (see _prefix_base_model)
        self._prefix_base_model()
        self._scales: dict[str, tuple[str, Path]] = {}  # a float8 weight → its scales' name and file
        self._mxfp4: dict[str, tuple[str, tuple[str, Path]]] = {}  # X → (X_blocks, (X_scales, its file))
        self._find_fp8_scales()
        self._find_mxfp4()
        self._fp8_block = _fp8_block(self.dir) if self._scales else None

    def _find_fp8_scales(self) -> None:
        """Pair each float8 `X.weight` with `X.weight_scale_inv` or `X.weight_scale`, and hide those and the
        activation scales (`X.input_scale`), which inference without FP8 activations does not use."""
        for name in list(self._where):
            for suffix in (".weight_scale_inv", ".weight_scale"):
                if name.endswith(suffix):
                    weight = name[: -len(suffix)] + ".weight"
                    if weight in self._where and self.dtype_name(weight).startswith("F8"):
                        self._scales[weight] = (name, self._where[name])
        hidden = {name for name, _ in self._scales.values()}
        hidden |= {n for n in self._where if n.endswith(".input_scale") and n[:-12] + ".weight" in self._scales}
        for name in hidden:
            del self._where[name]

    def _prefix_base_model(self) -> None:
        """A base model saved without its causal-LM wrapper (AutoModel's `embed_tokens.weight`, `layers.…`, as
        embedding models such as Qwen3-Embedding ship) shows under the wrapper's `model.` names."""
        if "model.embed_tokens.weight" in self._where or "embed_tokens.weight" not in self._where:
            return
        where = {}
        for key, path in self._where.items():
            name = key if key.startswith("lm_head.") else "model." + key
            where[name] = path
            if name != key:
                self._stored[name] = self._stored.get(key, key)
        self._where = where
        self.base_model = True

    def _unwrap_text_decoder(self) -> None:
        renamed = {}
        for key in self._where:
            for old, new in _TEXT_PREFIXES:
                if key.startswith(old):
                    renamed[new + key[len(old):]] = key
                    break
        if not renamed:
            return
        wrapped = tuple(old for old, _ in _TEXT_PREFIXES) + _VISION_PREFIXES
        where = {k: p for k, p in self._where.items() if not k.startswith(wrapped)}
        for name, key in renamed.items():
            if name not in where:
                where[name] = self._where[key]
                self._stored[name] = key
        self._where = where

    def embedding_only(self) -> bool:
        """Whether these are a base model's weights without an output head (an embedding model)."""
        return self.base_model and not self.with_prefix("lm_head.")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _find_mxfp4(self) -> None:
        """Show each `X_blocks` / `X_scales` pair (uint8) as the one tensor `X`."""
        for name in list(self._where):
            if not name.endswith("_blocks"):
                continue
            base, scales = name[: -len("_blocks")], name[: -len("_blocks")] + "_scales"
            if scales in self._where and self.dtype_name(name) == "U8":
                self._mxfp4[base] = (name, (scales, self._where[scales]))
                self._where[base] = self._where.pop(name)
                del self._where[scales]

    def _raw(self, name: str, path: Path) -> torch.Tensor:
        return self._handles[path].get_tensor(self._stored.get(name, name))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        if name in self._mxfp4:
            blocks, scales = self._mxfp4[name]
            return dequantize_mxfp4(self._raw(blocks, self._where[name]), self._raw(*scales))
        tensor = self._raw(name, self._where[name])
        if name not in self._scales:
            return tensor
        return dequantize_fp8(tensor, self._raw(*self._scales[name]), name, self._fp8_block)

    def get(self, name: str, default=None):
        return self[name] if name in self._where else default

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> list[int]:
        if name in self._mxfp4:   # [..., rows, groups, 16] packed → [..., groups · 32, rows]
            *lead, rows, groups, _ = self.shape_stored(self._mxfp4[name][0], name)
            return [*lead, groups * 32, rows]
        return self.shape_stored(name, name)

    def shape_stored(self, stored: str, shown: str) -> list[int]:
        return list(self._handles[self._where[shown]].get_slice(self._stored.get(stored, stored)).get_shape())

    def dtype_name(self, name: str) -> str:
        """The stored dtype ("BF16", "F16", "I32", ...); a float8 weight with scales reads as "BF16"."""
        if name in self._scales or name in self._mxfp4:
            return "BF16"
        return self._handles[self._where[name]].get_slice(self._stored.get(name, name)).get_dtype()

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self._where if k.startswith(prefix)]


def _fp8_block(model_dir: Path) -> Optional[tuple[int, int]]:
    """config.json's quantization_config.weight_block_size (DeepSeek-V3's [128, 128]), or None."""
    try:
        qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return block[0], block[1]
    return None


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, name: str,
                   block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """A float8 weight [out, in] times its scales, in bfloat16: one scale for the tensor, one per output row
    ([out] or [out, 1]), or one per block (a [ceil(out / bh), ceil(in / bw)] grid of `block`s, 128 × 128 in
    DeepSeek-V3's and GLM-4.5's files; without `block`, the size the grid implies)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return (w * s.reshape(())).to(torch.bfloat16)
    if s.ndim == 1 or (s.ndim == 2 and s.shape[1] == 1 and w.ndim == 2):
        if s.shape[0] != w.shape[0]:
            raise ModelLoadError(f"{name} has {w.shape[0]} rows but {s.shape[0]} FP8 scales.")
        return (w * s.reshape(-1, 1)).to(torch.bfloat16)
    if w.ndim != 2 or s.ndim != 2:
        raise ModelLoadError(f"{name}'s FP8 scales have shape {tuple(s.shape)}, which fits no known layout.")
    bh, bw = block or (-(-w.shape[0] // s.shape[0]), -(-w.shape[1] // s.shape[1]))
    if -(-w.shape[0] // bh) != s.shape[0] or -(-w.shape[1] // bw) != s.shape[1]:
        raise ModelLoadError(f"{name}'s FP8 scale grid {tuple(s.shape)} does not tile its shape {tuple(w.shape)}.")
    full = s.repeat_interleave(bh, 0)[: w.shape[0]].repeat_interleave(bw, 1)[:, : w.shape[1]]
    return (w * full).to(torch.bfloat16)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 `blocks` [..., rows, groups, 16] (two E2M1 values a byte, low nibble first) times 2^(scale − 127) per
    group of 32, as bfloat16 [..., groups · 32, rows] (transposed, as transformers lays gpt-oss's experts out);
    one leading slice (an expert) at a time, so the float32 temporaries stay small."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    *lead, rows, groups, width = blocks.shape
    if tuple(scales.shape) != (*lead, rows, groups):
        raise ModelLoadError(f"MXFP4 scales of shape {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}.")
    flat_b, flat_s = blocks.reshape(-1, rows, groups, width), scales.reshape(-1, rows, groups)
    out = torch.empty(flat_b.shape[0], groups * width * 2, rows, dtype=torch.bfloat16)
    for i in range(flat_b.shape[0]):
        b = flat_b[i].to(torch.int32)
        values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(rows, groups, width * 2)
        values = torch.ldexp(values, (flat_s[i].to(torch.int32) - 127)[..., None])
        out[i] = values.reshape(rows, groups * width * 2).t()
    return out.reshape(*lead, groups * width * 2, rows)
