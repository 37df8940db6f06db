"""Resumable job state of a conversion: `job_new.json` plus the intermediate tensor files of the working directory.

Every file is replaced atomically (temporary file + rename), and the running stage's progress (next block and the
results so far) travels inside the same file as the hidden states it belongs to, so a kill at any moment leaves a
consistent pair to resume from.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exl2.errors import ConfigError
from exl2.formats.writer import atomic_write, atomic_write_text

JOB_FILE = "job_new.json"
CAL_FILE = "cal_data.st"
STATES_FILE = "states.st"
SENS_FILE = "sensitivity.st"
MEASUREMENT_FILE = "measurement.json"
JOB_FORMAT = "exl2-convert-job"
JOB_VERSION = 1
STAGES = ("begin", "initial_embeddings", "sensitivity", "measure_quant", "optimize", "tokens_cal", "embeddings",
          "quant", "compile", "finished")
_OWN_FILES = (JOB_FILE, CAL_FILE, STATES_FILE, SENS_FILE, MEASUREMENT_FILE)


class Job:
    """The job dict (`progress`, `settings`, `measurement`, `strategy`, …) of one working directory."""

    def __init__(self, work_dir: Path, data: dict):
        self.dir = Path(work_dir)
        self.data = data

    @classmethod
    def load(cls, work_dir: Path) -> Optional["Job"]:
        path = Path(work_dir) / JOB_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise ConfigError(f"{path} is not a readable job file; pass -nr to start over.") from None
        if not isinstance(data, dict) or data.get("format") != JOB_FORMAT or data.get("progress") not in STAGES:
            raise ConfigError(f"{path} was not written by this converter; pass -nr to start over or use another -o.")
        return cls(Path(work_dir), data)

    @classmethod
    def new(cls, work_dir: Path, settings: dict) -> "Job":
        return cls(Path(work_dir), {"format": JOB_FORMAT, "version": JOB_VERSION, "progress": "begin",
                                    "settings": settings})

    @property
    def progress(self) -> str:
        return self.data["progress"]

    def advance(self, stage: str, **fields: Any) -> None:
        self.data.update(fields)
        self.data["progress"] = stage
        self.save()

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.dir / JOB_FILE, json.dumps(self.data, indent=2))

    def path(self, name: str) -> Path:
        return self.dir / name


def clear_work_dir(work_dir: Path) -> None:
    """-nr: remove what a conversion writes to the working directory (and nothing else)."""
    d = Path(work_dir)
    if not d.is_dir():
        return
    for name in _OWN_FILES:
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(d / "out_tensor", ignore_errors=True)
    for p in d.glob("output*.safetensors"):
        p.unlink()


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: Optional[dict] = None) -> None:
    """Atomically write tensors with JSON-serialisable metadata (stored as one JSON string)."""
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    md = {"exl2": json.dumps(meta or {})}
    atomic_write(path, lambda tmp: save_file(cpu, str(tmp), metadata=md))


def load_tensors(path: Path, names: Optional[list[str]] = None) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("exl2", "{}"))
            keys = names if names is not None else list(f.keys())
            return {k: f.get_tensor(k) for k in keys}, meta
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path} is damaged ({e}); pass -nr to start over.") from None


def read_meta(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("exl2", "{}"))
