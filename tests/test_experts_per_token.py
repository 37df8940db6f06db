"""Experts per token (exllamav2's -ept, TabbyAPI's num_experts_per_token): a mixture-of-experts model routed to a
different number of experts than its config.json says, against transformers running a config.json that says it.

Tolerance: max |Δlogit| ≤ 1e-4 · max |logit| (float32 rounding only), as in test_decoder_parity.
"""
import json
import shutil

import pytest
import torch

from tiny_models import build_tiny, reference_logits

from exl2.errors import ConfigError
from exl2.runtime.loader import load_model

# (tiny architecture, experts per token to run, the largest count it can route)
CASES = [("mixtral", 1, 4), ("mixtral", 3, 4), ("qwen3_moe", 4, 8), ("deepseek_v3", 3, 4), ("llama4", 1, 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_tiny(name, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


def _with_experts(src, dst, k):
    """A copy of model `src` whose config.json routes to k experts (the reference's way to get the same model)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    target = cfg.get("text_config", cfg) if "num_experts_per_tok" not in cfg else cfg
    assert "num_experts_per_tok" in target
    target["num_experts_per_tok"] = k
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name,k,_limit", CASES)
def test_logits_match_transformers_with_that_many_experts(tiny, tmp_path, name, k, _limit):
    src = tiny(name)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = reference_logits(_with_experts(src, tmp_path / "ref", k), ids)
    model = load_model(src, "cpu", experts_per_token=k)
    assert model.spec.moe.top_k == k
    with torch.no_grad():
        ours = model(ids)
    assert (ours[0] - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    default = reference_logits(src, ids)
    assert (default - ref).abs().max().item() > 1e-3 * ref.abs().max().item(), "the override must change the model"


@pytest.mark.parametrize("name,_k,limit", CASES[:1] + CASES[2:4])
def test_counts_the_model_cannot_route_are_one_sentence(tiny, name, _k, limit):
    for bad in (0, limit + 1):
        with pytest.raises(ConfigError, match=f"between 1 and {limit}"):
            load_model(tiny(name), "cpu", experts_per_token=bad)


def test_a_model_without_experts_is_refused(tiny):
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        load_model(tiny("llama"), "cpu", experts_per_token=2)


def test_engine_config_and_server_field(tiny):
    from exl2.config import EngineConfig

    with pytest.raises(ValueError, match="experts_per_token"):
        EngineConfig(model_dir=tiny("mixtral"), experts_per_token=0)
    assert EngineConfig(model_dir=tiny("mixtral"), experts_per_token=1).experts_per_token == 1
