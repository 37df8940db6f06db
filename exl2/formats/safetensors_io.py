"""Lazy, memory-mapped reading of (sharded) safetensors directories: never unpickles anything."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

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

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        return self._handles[self._where[name]].get_tensor(self._stored.get(name, name))

    def get(self, name: str, default=None):
        return self[name] if name in self._where else default

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> list[int]:
        return list(self._handles[self._where[name]].get_slice(self._stored.get(name, name)).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._handles[self._where[name]].get_slice(self._stored.get(name, name)).get_dtype()

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self._where if k.startswith(prefix)]
