"""Atomic writing of model directories: safetensors shards, copied side files and config.json (spec EXL2.md §2.2).

Every file goes to a temporary name in its final directory, is fsynced and then `os.replace`d, so a crash leaves
either the old file or the new one, never a half-written one.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors.torch import save_file

from exl2.errors import ModelLoadError

SINGLE_NAME = "output.safetensors"
_SHARD_RE = re.compile(r"^output-\d{5}-of-\d{5}\.safetensors$")
_TENSOR_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_SKIPPED_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_temp(directory: Path, name: str) -> Path:
    """Create an empty, uniquely named hidden file (mode 0666 minus umask, unlike mkstemp's 0600)."""
    while True:
        tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on normal exit it is fsynced and renamed over `path`, else deleted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp(path.parent, path.name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write(path: Path | str, write_fn: Callable[[Path], object]) -> Path:
    """Call `write_fn(tmp_path)` to write the whole file, then atomically put it at `path`."""
    with atomic_path(path) as tmp:
        write_fn(tmp)
    return Path(path)


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move a finished temporary directory into place; an existing one is only removed once the new one is there."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """CPU, contiguous and owning its storage: safetensors refuses views that share memory."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _shard_name(i: int, count: int) -> str:
    return SINGLE_NAME if count == 1 else f"output-{i + 1:05d}-of-{count:05d}.safetensors"


def write_safetensors_shards(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path | str,
                             shard_mb: int = 8192) -> list[Path]:
    """Write tensors in order to `output.safetensors`, or `output-0000i-of-0000M.safetensors` when over `shard_mb`.

    Shards are filled greedily (a tensor that does not fit starts the next shard; 0 = unlimited). Each shard is
    written to a temporary file as soon as it is full, so only one shard is held in memory; the final names are
    known (and the renames done) only at the end. Output shards of an earlier write that the new set does not
    overwrite are removed after the new files are in place.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = shard_mb * 1024 * 1024 if shard_mb > 0 else None
    temps: list[Path] = []
    seen: set[str] = set()
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        name = str(_new_temp(out, "output.safetensors"))
        temps.append(Path(name))
        save_file(current, name)
        with open(name, "rb+") as f:
            os.fsync(f.fileno())

    try:
        for name, tensor in tensors:
            if name in seen:
                raise ValueError(f"tensor {name!r} is written twice.")
            seen.add(name)
            tensor = _standalone(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            if current and limit is not None and size + nbytes > limit:
                flush()
                current, size = {}, 0
            current[name] = tensor
            size += nbytes
        if current or not temps:
            flush()
        finals = [out / _shard_name(i, len(temps)) for i in range(len(temps))]
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out)
    keep = {p.name for p in finals}
    for old in out.iterdir():
        if old.name not in keep and (old.name == SINGLE_NAME or _SHARD_RE.match(old.name)):
            old.unlink()
    return finals


def _copy_side_files(source: Path, out: Path) -> None:
    for src in sorted(source.iterdir()):
        if not src.is_file() or src.name == "config.json" or src.name in _SKIPPED_FILES:
            continue
        if src.name.endswith(_TENSOR_SUFFIXES):
            continue
        dst = out / src.name
        if dst.exists() and os.path.samefile(src, dst):
            continue
        atomic_write(dst, lambda tmp, src=src: shutil.copyfile(src, tmp))


def quantization_config(quant_config: dict) -> dict:
    """The §2.2 `quantization_config` object, fields in exllamav2's order; extra keys are kept after them."""
    try:
        cal = quant_config["calibration"]
        obj = {
            "quant_method": "exl2",
            "version": str(quant_config.get("version") or _our_version()),
            "bits": float(quant_config["bits"]),
            "head_bits": int(quant_config["head_bits"]),
            "calibration": {"rows": int(cal["rows"]), "length": int(cal["length"]), "dataset": str(cal["dataset"])},
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"quant_config needs bits, head_bits and calibration.rows/length/dataset ({e!r}).") from None
    for key, value in quant_config.items():
        obj.setdefault(key, value)
    return obj


def _our_version() -> str:
    try:
        from importlib.metadata import version

        return version("exl2")
    except Exception:
        return "0.1.0"


def write_exl2_model_dir(out_dir: Path | str, tensors: Iterable[tuple[str, torch.Tensor]], source_dir: Path | str,
                         quant_config: dict, shard_mb: int = 8192) -> list[Path]:
    """Write a loadable EXL2 directory: weight shards, the source's non-tensor files, and config.json last.

    config.json is the source's, re-serialised with 4-space indent and a `quantization_config` (§2.2) replacing any
    existing one; writing it last means a directory with the new config.json is complete. Returns the shard paths.
    """
    out, source = Path(out_dir), Path(source_dir)
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{source} has no config.json to copy into the converted model.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError:
        raise ModelLoadError(f"{config_path} is not valid JSON.") from None
    config["quantization_config"] = quantization_config(quant_config)
    out.mkdir(parents=True, exist_ok=True)
    shards = write_safetensors_shards(tensors, out, shard_mb)
    _copy_side_files(source, out)
    atomic_write_text(out / "config.json", json.dumps(config, indent=4))
    return shards
