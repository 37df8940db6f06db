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
    ({"max_seq_len": 100}, "max_seq_len"), ({"max_seq_len": 200000}, "max_seq_len"),
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
