"""default_model_dir(): the default model's EXL2 build, made once into the cache, atomically and resumably.

The real build converts SmolLM2 for minutes, so here the source is the 4-layer golden model and the settings are
tiny; everything else (cache layout, marker, notice, resume, reuse) is the code path `make demo` takes.
"""
import json
from pathlib import Path

import pytest
import torch

from exl2.models import default_model
from exl2.quantize import cached, pipeline
from exl2.runtime.loader import load_model

SRC = Path(__file__).parent / "fixtures" / "golden" / "src"
TINY = {"bits": 4.0, "rows": 4, "length": 64, "measurement_rows": 2, "measurement_length": 64, "device": "cpu"}
NAME = "SmolLM2-135M-Instruct-exl2-4.0bpw"


class Interrupt(Exception):
    pass


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "default_source_dir", lambda: SRC)
    monkeypatch.setattr(default_model, "DEMO_SETTINGS", dict(TINY))
    return tmp_path / "exl2" / "models"


def assert_valid_build(path: Path) -> None:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl2" and qc["bits"] == 4.0
    assert json.loads((path / cached.BUILD_MARKER).read_text())["settings"] == TINY
    model = load_model(path, "cpu", torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]]))
    assert logits.shape[-1] == 1024 and torch.isfinite(logits).all()


def test_built_once_then_reused(cache, capfd):
    path = default_model.default_model_dir()
    assert path == cache / NAME
    assert_valid_build(path)
    err = capfd.readouterr().err.strip().splitlines()
    assert err[0].startswith("Building the default model") and str(path) in err[0]
    assert not any("--" in line for line in err)            # the converter's own messages stay quiet
    assert sorted(p.name for p in cache.iterdir()) == [f".{NAME}.lock", NAME]   # no work or staging dirs left
    stamp = (path / "config.json").stat().st_mtime_ns
    assert default_model.default_model_dir() == path
    assert (path / "config.json").stat().st_mtime_ns == stamp and capfd.readouterr().err == ""
    assert not cached.is_built(path, cached.build_key(SRC, {**TINY, "rows": 5}))   # other settings: rebuilt


def test_interrupted_build_resumes(cache, monkeypatch, capfd):
    real, calls = pipeline.quantize_slot, {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupt()
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "quantize_slot", flaky)
    with pytest.raises(Interrupt):
        default_model.default_model_dir()
    assert not (cache / NAME).exists() and (cache / f".{NAME}.work").is_dir()
    measured = {"n": 0}
    real_measure = pipeline.measure_slot

    def counting(*a, **kw):
        measured["n"] += 1
        return real_measure(*a, **kw)

    monkeypatch.setattr(pipeline, "measure_slot", counting)
    capfd.readouterr()
    path = default_model.default_model_dir()
    assert capfd.readouterr().err.startswith("Resuming the build of the default model")
    assert measured["n"] == 0                   # continued in the quantization pass, not from the start
    assert_valid_build(path)
    assert not (cache / f".{NAME}.work").exists()
