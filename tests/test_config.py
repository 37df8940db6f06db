"""EngineConfig / SamplingSettings validation: readable errors naming the field."""
import pytest
from pydantic import ValidationError

from exl2.config import EngineConfig, SamplingSettings


def test_aliases_and_defaults():
    a = EngineConfig(model_dir="/m")
    b = EngineConfig(model_directory="/m")
    assert a == b and a.kv_cache_mode == "fp16" and a.flash_attention_enabled


@pytest.mark.parametrize("code,mode", [(0, "fp16"), (1, "q8"), (2, "q4"), (3, "q2"), ("Q6", "q6"), ("q3", "q3")])
def test_cache_modes(code, mode):
    assert EngineConfig(model_dir="/m", kv_cache_mode=code).kv_cache_mode == mode


@pytest.mark.parametrize("bad,field", [
    ({"max_seq_len": 100}, "max_seq_len"), ({"max_seq_len": 2_000_000}, "max_seq_len"),
    ({"chunk_size": 100}, "chunk_size"), ({"chunk_size": 20000}, "chunk_size"),
    ({"gpu_split": []}, "gpu_split"), ({"gpu_split": [0]}, "gpu_split"), ({"gpu_split": "some"}, "gpu_split"),
    ({"kv_cache_mode": "q5"}, "kv_cache_mode"), ({"kv_cache_mode": 7}, "kv_cache_mode"), ({"bogus": 1}, "bogus"),
])
def test_invalid_values_name_the_field(bad, field):
    with pytest.raises(ValidationError) as e:
        EngineConfig(model_dir="/m", **bad)
    assert field in str(e.value)


def test_frozen_and_split_auto():
    c = EngineConfig(model_dir="/m", gpu_split="auto")
    assert c.gpu_split == "auto"
    with pytest.raises(ValidationError):
        c.max_seq_len = 1024
    assert EngineConfig(model_dir="/m", gpu_split=[20, 24]).gpu_split == [20.0, 24.0]


def test_sampling_settings():
    assert SamplingSettings(temperature=0).greedy
    with pytest.raises(ValidationError):
        SamplingSettings(top_p=0)


def test_rope_overrides_default_to_the_models_own():
    c = EngineConfig(model_dir="/m")
    assert c.rope_scale is None and c.rope_alpha is None and c.rope_yarn is None
    both = EngineConfig(model_dir="/m", rope_scale=2, rope_alpha=1.5)   # exllamav2 stacks these two
    assert (both.rope_scale, both.rope_alpha) == (2.0, 1.5)
    assert EngineConfig(model_dir="/m", rope_yarn=4).rope_yarn == 4.0


@pytest.mark.parametrize("field", ["rope_scale", "rope_alpha", "rope_yarn"])
@pytest.mark.parametrize("value", [0, -2.0, float("nan"), float("inf")])
def test_rope_overrides_must_be_positive(field, value):
    with pytest.raises(ValidationError) as e:
        EngineConfig(model_dir="/m", **{field: value})
    err = e.value.errors()[0]
    assert err["loc"] == (field,) and f"{field} must be a positive number" in err["msg"]


@pytest.mark.parametrize("other", ["rope_scale", "rope_alpha"])
def test_rope_yarn_is_not_combined_with_scale_or_alpha(other):
    with pytest.raises(ValidationError) as e:
        EngineConfig(model_dir="/m", rope_yarn=2, **{other: 2})
    errs = e.value.errors()
    assert len(errs) == 1 and errs[0]["loc"] == ("rope_yarn",)   # named, so the CLI can say which flag
    msg = errs[0]["msg"].removeprefix("Value error, ")
    assert msg.startswith("rope_yarn cannot be combined with rope_scale or rope_alpha") and "." not in msg


def test_long_contexts_and_chunk_size_validate():
    c = EngineConfig(model_dir="/m", max_seq_len=262144, chunk_size=512)
    assert (c.max_seq_len, c.chunk_size) == (262144, 512)
    assert EngineConfig(model_dir="/m").chunk_size == 2048


def test_chunk_size_reaches_the_generator_and_keeps_the_reply():
    """A prompt prefilled in 256-token chunks decodes the same greedy tokens as one prefilled whole."""
    from pathlib import Path

    from exl2.config import SamplingSettings
    from exl2.engine import Engine

    model = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
    prompt = [(7 * i + 3) % 200 + 10 for i in range(700)]
    replies = []
    for chunk in (256, 2048):
        engine = Engine(EngineConfig(model_dir=model, max_seq_len=1024, device="cpu", max_batch_size=1,
                                     chunk_size=chunk))
        try:
            assert engine.dynamic.chunk == chunk
            *_, (_, result) = engine.generator.stream(prompt, SamplingSettings(temperature=0.0), max_new_tokens=6,
                                                        ignore_eos=True)
            replies.append(result.token_ids)
        finally:
            engine.close()
    assert replies[0] == replies[1] and len(replies[0]) == 6
