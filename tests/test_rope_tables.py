"""The decoder's RoPE tables: static ones are built once and grown, never rebuilt per forward (that cost 29 ms of
host time a prefill on the H200); dynamic ones follow the sequence length."""
import torch

from tiny_models import build_tiny

from exl2.models.rope import RopeSpec
from exl2.runtime.loader import load_model


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    table = RopeSpec.table

    def counted(self, length, device, seq_len=None):
        calls.append(length)
        return table(self, length, device, seq_len)
    monkeypatch.setattr(RopeSpec, "table", counted)
    return calls


def test_static_table_built_once_then_grown(tmp_path, monkeypatch):
    model = load_model(build_tiny("llama3_rope", tmp_path), "cpu")
    calls = _counting(monkeypatch)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(ids)
        again = model(ids, start=0)
        assert calls == [256], "one table of 256 positions serves every forward inside it"
        model(ids, start=600)
    assert calls == [256, 1024], "a forward past the table doubles it to the next power of two"
    assert torch.equal(first, again)
    cos, sin, _ = model.rope_tables(torch.zeros(1, 1, dtype=torch.long), 608)["global"]
    ref_cos, ref_sin = RopeSpec.table(model.spec.rope, 1024, "cpu")
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_grown_table_gives_the_same_logits(tmp_path):
    d = build_tiny("llama", tmp_path)
    small, grown = load_model(d, "cpu"), load_model(d, "cpu")
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        grown(ids, start=2000)  # grows its table to 2048 first
        assert grown._rope_len == 2048
        assert torch.equal(small(ids, start=100), grown(ids, start=100))


def test_dynamic_table_follows_sequence_length(tmp_path, monkeypatch):
    model = load_model(build_tiny("llama_dynamic_rope", tmp_path), "cpu")
    assert not model.spec.rope.static
    calls = _counting(monkeypatch)
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, start=10)
        model(ids, start=40)
    assert calls == [14, 44]
