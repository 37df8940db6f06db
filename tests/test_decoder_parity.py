"""The generic decoder against transformers (float32, eager attention) for every architecture and RoPE variant.

Tolerance: max |Δlogit| ≤ 1e-4 · max |logit| — float32 rounding differences only.
"""
import pytest
import torch

from tiny_models import ARCHS, build_tiny, reference_decode

from exl2.runtime.loader import load_model

PROMPT, STEPS = 64, 16


def _tol(ref: torch.Tensor) -> float:
    return 1e-4 * ref.abs().max().item()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            d = build_tiny(name, tmp_path_factory.mktemp(name))
            ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
            prefill, steps, toks = reference_decode(d, ids, STEPS)
            cache[name] = (d, ids, (prefill, steps, toks[0].tolist()))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(ARCHS))
def test_prefill_logits_match_transformers(built, name):
    d, ids, (ref_prefill, _, greedy) = built(name)
    model = load_model(d, "cpu")
    with torch.no_grad():
        ours = model(ids)
    assert ours.shape == ref_prefill.shape
    assert (ours - ref_prefill).abs().max().item() <= _tol(ref_prefill)


@pytest.mark.parametrize("name", list(ARCHS))
def test_incremental_decode_matches_transformers(built, name):
    d, ids, (ref_prefill, ref_steps, greedy) = built(name)
    model = load_model(d, "cpu")
    cache = model.new_cache(1, PROMPT + STEPS + 1)
    with torch.no_grad():
        logits = model(ids, cache, 0)
        assert (logits - ref_prefill).abs().max().item() <= _tol(ref_prefill)
        tok = int(logits[0, -1].argmax())
        assert tok == greedy[0]
        for i, ref in enumerate(ref_steps):
            step = model(torch.tensor([[greedy[i]]]), cache, PROMPT + i)
            ref = ref.reshape(step.shape)
            assert (step - ref).abs().max().item() <= _tol(ref), f"step {i}"
