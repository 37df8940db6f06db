"""Atomic model-directory writer: sharding, crash safety, copied files and config.json."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl2.formats.writer import atomic_write, write_exl2_model_dir, write_safetensors_shards

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
KIB = 1024


def _tensors(sizes_kib, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}.weight", torch.randn(s * KIB // 4, generator=gen)) for i, s in enumerate(sizes_kib)]


def _read_all(paths):
    out = {}
    for p in paths:
        out.update(load_file(p))
    return out


def _leftovers(directory: Path):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_single_file_when_everything_fits(tmp_path):
    tensors = _tensors([100, 200, 300])
    paths = write_safetensors_shards(tensors, tmp_path, shard_mb=1)
    assert [p.name for p in paths] == ["output.safetensors"]
    got = _read_all(paths)
    assert set(got) == {n for n, _ in tensors}
    assert all(torch.equal(got[n], t) for n, t in tensors)


def test_shards_split_greedily_and_reassemble(tmp_path):
    tensors = _tensors([400, 400, 400, 900, 100, 1500, 10])  # 1 MiB limit
    paths = write_safetensors_shards(iter(tensors), tmp_path, shard_mb=1)
    assert [p.name for p in paths] == [f"output-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    groups = [sorted(load_file(p)) for p in paths]  # a tensor over the limit gets a shard of its own
    assert groups == [["t0.weight", "t1.weight"], ["t2.weight"], ["t3.weight", "t4.weight"], ["t5.weight"],
                      ["t6.weight"]]
    got = _read_all(paths)
    assert set(got) == {n for n, _ in tensors} and all(torch.equal(got[n], t) for n, t in tensors)
    assert _leftovers(tmp_path) == []


def test_zero_means_unlimited(tmp_path):
    paths = write_safetensors_shards(_tensors([900, 900, 900]), tmp_path, shard_mb=0)
    assert [p.name for p in paths] == ["output.safetensors"]


def test_stale_shards_removed_after_new_ones(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    write_safetensors_shards(_tensors([700, 700, 700]), tmp_path, shard_mb=1)
    assert len(list(tmp_path.glob("output-*-of-00003.safetensors"))) == 3
    paths = write_safetensors_shards(_tensors([10, 10]), tmp_path, shard_mb=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output.safetensors", "tokenizer.json"]
    paths = write_safetensors_shards(_tensors([700, 700], seed=1), tmp_path, shard_mb=1)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [p.name for p in paths] == \
        ["output-00001-of-00002.safetensors", "output-00002-of-00002.safetensors"]


def test_views_sharing_storage_are_written(tmp_path):
    base = torch.arange(64, dtype=torch.float16)
    paths = write_safetensors_shards([("a", base[:32]), ("b", base[32:]), ("c", base.view(8, 8).t())], tmp_path, 0)
    got = load_file(paths[0])
    assert torch.equal(got["a"], base[:32]) and torch.equal(got["c"], base.view(8, 8).t())


def test_duplicate_names_rejected(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        write_safetensors_shards([("a", torch.zeros(2)), ("a", torch.ones(2))], tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_crash_in_write_fn_keeps_old_file(tmp_path):
    target = tmp_path / "config.json"
    target.write_text("old")

    def crash(tmp: Path):
        tmp.write_text("half-writ")
        raise RuntimeError("power cut")

    with pytest.raises(RuntimeError):
        atomic_write(target, crash)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    atomic_write(target, lambda tmp: tmp.write_text("new"))
    assert target.read_text() == "new" and _leftovers(tmp_path) == []


def test_crash_while_sharding_keeps_previous_output(tmp_path):
    old = _tensors([10], seed=3)
    write_safetensors_shards(old, tmp_path, shard_mb=1)

    def failing():
        yield from _tensors([700, 700, 700])  # the first shard is flushed to a temp file before the failure
        raise RuntimeError("quantizer died")

    with pytest.raises(RuntimeError):
        write_safetensors_shards(failing(), tmp_path, shard_mb=1)
    assert [p.name for p in tmp_path.iterdir()] == ["output.safetensors"]
    assert torch.equal(load_file(tmp_path / "output.safetensors")["t0.weight"], old[0][1])


def _source(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(GOLDEN / "src", src)
    (src / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (src / "pytorch_model.bin").write_bytes(b"\0" * 16)
    (src / "README.md").write_text("hello")
    (src / "subdir").mkdir()
    return src


QUANT = {"version": "0.3.2", "bits": 4.0, "head_bits": 6,
         "calibration": {"rows": 115, "length": 512, "dataset": "(default)"}}


def test_model_dir_matches_exllamav2_config_and_copies_side_files(tmp_path):
    src, out = _source(tmp_path), tmp_path / "out"
    golden = load_file(GOLDEN / "b4.0_hb6" / "output.safetensors")
    paths = write_exl2_model_dir(out, golden.items(), src, QUANT)
    assert [p.name for p in paths] == ["output.safetensors"]
    # exllamav2 0.3.2 wrote this exact config.json for the same source and settings
    assert (out / "config.json").read_text() == (GOLDEN / "b4.0_hb6" / "config.json").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                     "output.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    got = load_file(out / "output.safetensors")
    assert set(got) == set(golden) and all(torch.equal(got[k], v) for k, v in golden.items())


def test_model_dir_replaces_existing_quantization_config(tmp_path):
    src, out = _source(tmp_path), tmp_path / "out"
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    write_exl2_model_dir(out, [("x", torch.zeros(4))], src, {**QUANT, "bits": 3.5}, shard_mb=0)
    text = (out / "config.json").read_text()
    qc = json.loads(text)["quantization_config"]
    assert qc == {"quant_method": "exl2", "version": "0.3.2", "bits": 3.5, "head_bits": 6,
                  "calibration": {"rows": 115, "length": 512, "dataset": "(default)"}}
    assert '\n    "architectures": [' in text  # 4-space indent
    assert _leftovers(out) == []


def test_model_dir_needs_config_and_complete_quant_config(tmp_path):
    from exl2.errors import ModelLoadError

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        write_exl2_model_dir(tmp_path / "o", [], empty, QUANT)
    with pytest.raises(ValueError, match="head_bits"):
        write_exl2_model_dir(tmp_path / "o", [], _source(tmp_path), {"bits": 4.0})
