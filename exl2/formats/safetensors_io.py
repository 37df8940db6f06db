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


class TensorSource:
    """All tensors of a model directory, read on demand from memory-mapped shards.

    Every `*.safetensors` file is indexed (like exllamav2, names of shards do not matter); the HF index JSON is not needed.
    """

    def __init__(self, model_dir: Path | str):
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
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

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        return self._handles[self._where[name]].get_tensor(name)

    def get(self, name: str, default=None):
        return self[name] if name in self._where else default

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> list[int]:
        return list(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self._where if k.startswith(prefix)]
