"""A conversion made once into a cache folder (the default model's EXL2 build): resumable, atomic, cheap to find.

The job runs in a hidden working directory beside the target, so an interrupted build resumes where it stopped.
The model is compiled into a hidden sibling, stamped with a marker (converter version, settings, source) and only
then renamed into place, so the target is either absent or complete and a finished build is recognised by reading
one small file. A lock file keeps two processes (two shells starting the demo) from building at the same time.
"""
from __future__ import annotations

import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from exl2.errors import ConfigError
from exl2.formats.writer import atomic_write_text, replace_dir
from exl2.quantize.progress import Reporter

BUILD_MARKER = "exl2_build.json"
# Bump when the converter's output changes, so cached builds are redone.
BUILD_VERSION = 1
_SOURCE_MARKER = "exl2_import.json"      # written by import_gguf; identifies the fp16 source cheaply
_KEY_FILE = "build_key.json"             # in the working directory: which build the saved job belongs to


def build_key(source: Path, settings: dict) -> dict:
    """What a cached build depends on: the converter version, the settings and the source's identity."""
    try:
        ident = json.loads((source / _SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        ident = {"dir": str(source.resolve())}
    return {"build_version": BUILD_VERSION, "settings": settings, "source": ident}


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_built(target: Path, key: dict) -> bool:
    """True if `target` holds a finished build of `key` (marker, config and at least one weight file)."""
    return (_read_json(target / BUILD_MARKER) == key and (target / "config.json").is_file()
            and any(target.glob("*.safetensors")))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:            # no POSIX locks (Windows): builds are simply not serialised
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fresh_work_dir(work: Path, staging: Path, key: dict) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    work.mkdir(parents=True)
    atomic_write_text(work / _KEY_FILE, json.dumps(key))


def convert_cached(source: Path, target: Path, settings: dict, what: str,
                   reporter: Optional[Reporter] = None) -> Path:
    """Return `target`, converting `source` into it with `settings` (ConvertSettings fields) unless already built.

    `what` names the build in the one-line message printed to stderr before a conversion starts.
    """
    from exl2.quantize.pipeline import ConvertSettings, convert

    key = build_key(source, settings)
    if is_built(target, key):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    work, staging = parent / f".{target.name}.work", parent / f".{target.name}.building"
    with _locked(parent / f".{target.name}.lock"):
        if is_built(target, key):            # another process finished it while we waited
            return target
        resuming = _read_json(work / _KEY_FILE) == key
        if not resuming:                     # nothing there, another version's job, or a damaged one
            _fresh_work_dir(work, staging, key)
        ui = reporter or Reporter(messages=False)
        if not ui.quiet:
            verb = "Resuming the build of" if resuming else "Building"
            print(f"{verb} {what} (once) in {target}; this takes a few minutes.", file=sys.stderr, flush=True)
        job = ConvertSettings(in_dir=str(source), out_dir=str(work), compile_full=str(staging), **settings)
        try:
            convert(job, ui)
            if not (staging / "config.json").is_file():
                raise ConfigError(f"The compiled model is missing from {staging}.")
        except ConfigError:
            if not resuming:
                raise
            _fresh_work_dir(work, staging, key)   # the saved job cannot be continued: restart it once
            convert(job, ui)
        atomic_write_text(staging / BUILD_MARKER, json.dumps(key, indent=2))
        replace_dir(staging, target)
        shutil.rmtree(work, ignore_errors=True)
    return target
