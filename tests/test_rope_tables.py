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


# ---------------------------------------------------------------- RoPE overrides (-rs/-ra/-ry), exllamav2's semantics
import logging  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from exl2.config import EngineConfig, SamplingSettings  # noqa: E402
from exl2.errors import ConfigError  # noqa: E402
from exl2.models.registry import read_config, spec_from_config  # noqa: E402
from exl2.models.rope import RopeOverride  # noqa: E402
from exl2.runtime.loader import context_length  # noqa: E402

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "src"   # Llama, head_dim 64, theta 1e4, 2048 positions


def _golden_cfg() -> dict:
    return read_config(GOLDEN)


def _plain_inv(theta: float, d: int) -> torch.Tensor:
    """Textbook RoPE inverse frequencies in float64: 1 / theta^(2i/d)."""
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


@pytest.mark.parametrize("s", [2.0, 4.0, 1.5, 3.0])
def test_rope_scale_is_the_unscaled_table_at_positions_over_s(s):
    spec = spec_from_config(_golden_cfg(), RopeOverride(scale=s))
    n = 512
    cos, sin = spec.rope.table(n, "cpu")
    ang = torch.outer(torch.arange(n, dtype=torch.float64) / s, _plain_inv(10000.0, 64))
    torch.testing.assert_close(cos.double(), ang.cos(), rtol=0, atol=2e-4)
    torch.testing.assert_close(sin.double(), ang.sin(), rtol=0, atol=2e-4)
    plain_cos, plain_sin = spec_from_config(_golden_cfg()).rope.table(n, "cpu")
    if s in (2.0, 4.0):  # power-of-two scales are exact in float32: position s·k of the scaled table is k unscaled
        k = n // int(s)
        assert torch.equal(cos[:: int(s)], plain_cos[:k]) and torch.equal(sin[:: int(s)], plain_sin[:k])


def test_rope_scale_replaces_a_linear_factor_and_divides_on_top_of_other_types(tmp_path):
    """exllamav2's scale_pos_emb: the same knob as config.json's linear factor, and applied after llama3/YaRN."""
    base = _plain_inv(10000.0, 16).float()
    linear = spec_from_config(read_config(build_tiny("llama_linear_rope", tmp_path / "lin")), RopeOverride(scale=4))
    torch.testing.assert_close(linear.rope.inv_freq(8)[0], base / 4)   # 4, not the config's 2 × 4
    d = build_tiny("llama3_rope", tmp_path / "l3")
    own, _ = spec_from_config(read_config(d)).rope.inv_freq(8)
    scaled, att = spec_from_config(read_config(d), RopeOverride(scale=2)).rope.inv_freq(8)
    assert torch.equal(scaled, own / 2) and att == 1.0


@pytest.mark.parametrize("alpha", [1.0, 2.0, 2.63])
def test_rope_alpha_multiplies_the_base_by_alpha_to_the_d_over_d_minus_2(alpha):
    spec = spec_from_config(_golden_cfg(), RopeOverride(alpha=alpha))
    inv, att = spec.rope.inv_freq(8)
    want = _plain_inv(10000.0 * alpha ** (64 / 62), 64)
    torch.testing.assert_close(inv.double(), want, rtol=1e-6, atol=0)
    assert att == 1.0 and spec.rope.rope_type == "default"
    if alpha == 1.0:
        assert torch.equal(inv, spec_from_config(_golden_cfg()).rope.inv_freq(8)[0])


def _hf_yarn(cfg: dict, params: dict) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
    hf = LlamaConfig(**{k: cfg[k] for k in keys}, rope_parameters=params)
    return ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_rope_yarn_matches_transformers_with_the_native_length_as_original(factor):
    cfg = _golden_cfg()
    spec = spec_from_config(cfg, RopeOverride(yarn=factor))
    inv, att = spec.rope.inv_freq(8)
    want, want_att = _hf_yarn(cfg, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
                                    "original_max_position_embeddings": 2048})
    torch.testing.assert_close(inv, want.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(want_att) and att == pytest.approx(0.1 * math.log(factor) + 1)
    assert spec.max_position == int(2048 * factor) and spec.native_max_position == 2048


def test_rope_yarn_keeps_the_configs_own_yarn_original(tmp_path):
    cfg = read_config(build_tiny("llama_yarn_rope", tmp_path))   # YaRN factor 4 over an original of 32
    spec = spec_from_config(cfg, RopeOverride(yarn=8))
    want, want_att = _hf_yarn(cfg, {**cfg["rope_parameters"], "factor": 8.0})
    inv, att = spec.rope.inv_freq(8)
    torch.testing.assert_close(inv, want.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(want_att) and spec.max_position == 32 * 8


def test_context_each_override_covers():
    cfg = _golden_cfg()
    assert spec_from_config(cfg).max_position == 2048
    assert spec_from_config(cfg, RopeOverride()).max_position == 2048
    assert spec_from_config(cfg, RopeOverride(scale=2.5)).max_position == 5120
    # alpha has no length of its own: the length asked for is taken as it is (exllamav2 leaves it to the user)
    assert spec_from_config(cfg, RopeOverride(alpha=2.0)).max_position == 2048
    assert spec_from_config(cfg, RopeOverride(alpha=2.0, context=8192)).max_position == 8192
    assert spec_from_config(cfg, RopeOverride(scale=2, alpha=2.0, context=1024)).max_position == 4096


def test_context_length_caps_with_one_warning(caplog):
    native = spec_from_config(_golden_cfg())
    scaled = spec_from_config(_golden_cfg(), RopeOverride(scale=2))
    with caplog.at_level(logging.WARNING, logger="exl2.model"):
        assert context_length(native, None) == 2048   # the default 4096, quietly fitted to the model
        assert context_length(native, 1024) == 1024
        assert context_length(scaled, 4096) == 4096 and context_length(scaled, None) == 4096
        assert not caplog.records
        assert context_length(native, 4096) == 2048
        assert context_length(scaled, 6000) == 4096
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and all("\n" not in m for m in msgs)
    assert "native context of 2048" in msgs[0] and "rope_scale" in msgs[0]
    assert "rope_scale 2" in msgs[1] and "capped at 4096" in msgs[1]


@pytest.mark.parametrize("kw,words", [
    ({"scale": 0.0}, "rope_scale must be a positive number"), ({"alpha": -1.0}, "rope_alpha must be"),
    ({"yarn": float("inf")}, "rope_yarn must be"), ({"yarn": 2.0, "scale": 2.0}, "cannot be combined"),
    ({"yarn": 2.0, "alpha": 2.0}, "cannot be combined"),
])
def test_invalid_overrides_are_one_sentence(kw, words):
    with pytest.raises(ConfigError) as e:
        RopeOverride(**kw)
    msg = str(e.value)
    assert words in msg and msg.endswith(".") and "\n" not in msg


def _greedy(**rope) -> list[int]:
    from exl2.engine import Engine

    engine = Engine(EngineConfig(model_dir=GOLDEN, max_seq_len=512, device="cpu", **rope))
    return engine.generate("The quick brown fox jumps over", SamplingSettings(temperature=0), 24).token_ids


def test_identity_overrides_change_no_greedy_token():
    plain = _greedy()
    assert len(plain) == 24
    assert _greedy(rope_scale=1.0) == plain
    assert _greedy(rope_alpha=1.0) == plain
    assert _greedy(rope_scale=1.0, rope_alpha=1.0) == plain


def test_rope_scale_2_changes_the_logits():
    ids = torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = load_model(GOLDEN, "cpu", torch.float32)(ids)
        one = load_model(GOLDEN, "cpu", torch.float32, rope=RopeOverride(scale=1.0))(ids)
        two = load_model(GOLDEN, "cpu", torch.float32, rope=RopeOverride(scale=2.0))(ids)
    assert torch.equal(one, plain)
    assert torch.equal(two[:, 0], plain[:, 0])   # position 0 has angle 0 at any scale
    assert (two[:, 1:] - plain[:, 1:]).abs().amax() > 1e-2


def test_engine_runs_past_the_native_context_only_with_an_override(caplog):
    from exl2.engine import Engine

    with caplog.at_level(logging.WARNING, logger="exl2.model"):
        capped = Engine(EngineConfig(model_dir=GOLDEN, max_seq_len=4096, device="cpu", max_batch_size=1))
        assert capped.generator.max_seq_len == 2048 and len(caplog.records) == 1
        scaled = Engine(EngineConfig(model_dir=GOLDEN, max_seq_len=4096, device="cpu", max_batch_size=1,
                                     rope_scale=2.0))
        assert scaled.generator.max_seq_len == 4096 and scaled.model.spec.max_position == 4096
        assert len(caplog.records) == 1
    long_prompt = list(range(3, 1003)) * 3   # 3000 tokens: past the native 2048
    out = scaled.generate(long_prompt, SamplingSettings(temperature=0), 4)
    assert out.prompt_tokens == 3000 and len(out.token_ids) == 4
