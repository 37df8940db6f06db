"""Calibration and evaluation data: deterministic built-in rows, user files, held-out text kept apart."""
import json
from pathlib import Path

import pytest
import torch

from exl2.errors import ConfigError
from exl2.generation.tokenizer import Tokenizer
from exl2.quantize import calibration as C

SRC = Path(__file__).parent / "fixtures" / "golden" / "src"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SRC)


def test_builtin_rows_are_deterministic_and_mixed(tok):
    a = C.builtin_calibration(tok, 16, 128, 1024, seed=0)
    b = C.builtin_calibration(tok, 16, 128, 1024, seed=0)
    c = C.builtin_calibration(tok, 16, 128, 1024, seed=1)
    assert a.ids.shape == (16, 128) and a.ids.dtype == torch.int64 and a.dataset == "(default)"
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    assert int(a.ids.min()) >= 0 and int(a.ids.max()) < 1024
    text = [tok.decode(r.tolist()) for r in a.ids[:-2]]
    assert any("def " in t or "return" in t for t in text)          # code rows
    # English rows (stdlib docstrings, package READMEs and licenses: which packages are installed moves the count)
    assert sum(1 for t in text if any(w in t.lower() for w in (" the ", " of ", " and ", " to "))) >= 4
    assert sum(1 for r in a.ids[:-2] if int(r[0]) == tok.bos_id) == 7   # every other text row starts with BOS


def test_eval_text_is_never_harvested_for_calibration():
    files = [rel for rel, _ in C._stdlib_files()]
    assert files and not any(rel.startswith("pydoc_data/") or "site-packages/" in rel for rel in files)
    held = {rel for rel in files if C._held_out(rel)}
    assert 0 < len(held) < len(files) / 5
    text = C.heldout_text()
    assert len(text) > 100_000
    # The calibration streams never read a held-out module, nor pydoc_data.
    seen = []
    orig = C._read

    def spy(path):
        seen.append(Path(path))
        return orig(path)

    C._read = spy
    try:
        for cat in ("prose", "code"):
            for _, doc in zip(range(40), C._documents(cat, 0)):
                pass
    finally:
        C._read = orig
    stdlib = Path(C.sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(stdlib).as_posix() for p in seen if stdlib in p.parents]
    assert rels and not any(C._held_out(r) or r.startswith("pydoc_data/") for r in rels)


def test_user_files(tmp_path, tok):
    txt = tmp_path / "d.txt"
    txt.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"Row {i}: the cat sat on the mat."}) for i in range(300)))
    ids, warn = C.rows_from_texts(C.read_texts(txt), tok, 4, 64)
    assert ids.shape == (4, 64) and warn is None
    cal, warn = C.user_calibration(jl, tok, 1000, 64)
    assert cal.dataset == "d.jsonl" and warn is not None and 1 <= cal.ids.shape[0] < 1000
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["Alpha beta gamma delta. " * 40] * 10, "n": list(range(10))}),
                   tmp_path / "d.parquet")
    ids, _ = C.rows_from_texts(C.read_texts(tmp_path / "d.parquet"), tok, 2, 32)
    assert tok.decode(ids[0].tolist()).strip().startswith("Alpha beta")
    with pytest.raises(ConfigError):
        C.read_texts(tmp_path / "missing.txt")
    with pytest.raises(ConfigError):
        C.rows_from_texts(["tiny"], tok, 2, 4096)
