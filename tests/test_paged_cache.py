"""The paged cache gives the same logits as the contiguous cache, with pages scattered across sequences."""
import pytest
import torch

from tiny_models import build_tiny

from exl2.runtime.loader import load_model
from exl2.kernels.backend import force_triton, triton_usable
from exl2.runtime.paged_cache import PagedKVCache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny("mistral_swa", tmp_path_factory.mktemp("m")), "cpu")


def test_batched_paged_decode_matches_single_sequences(model):
    torch.manual_seed(0)
    lens = [23, 40]
    prompts = [torch.randint(0, 256, (1, n)) for n in lens]
    steps = 6
    # reference: each sequence alone through the contiguous cache
    refs = []
    with torch.no_grad():
        for p in prompts:
            c = model.new_cache(1, 64)
            out = [model(p, c, 0)[:, -1]]
            tok = out[-1].argmax(-1, keepdim=True)
            toks = []
            for i in range(steps):
                toks.append(tok)
                out.append(model(tok, c, p.shape[1] + i)[:, -1])
                tok = out[-1].argmax(-1, keepdim=True)
            refs.append((torch.stack(out, 1), torch.cat(toks, 1)))
    page = 8
    cache = PagedKVCache(model.spec, num_pages=16, page_size=page, device="cpu", dtype=torch.float32)
    tables = torch.tensor([[9, 2, 14, 5, 7, 0], [1, 12, 3, 8, 10, 6]], dtype=torch.int32)
    with torch.no_grad():
        for b, p in enumerate(prompts):  # prefill one sequence at a time
            cache.bind(tables[b:b + 1])
            first = model(p, cache, 0)[:, -1]
            assert torch.allclose(first, refs[b][0][:, 0], atol=1e-5)
        cache.bind(tables)
        pos = torch.tensor(lens)
        for i in range(steps):
            toks = torch.stack([refs[b][1][:, i] for b in range(2)])
            logits = model(toks, cache, pos + i)[:, -1]
            for b in range(2):
                assert torch.allclose(logits[b], refs[b][0][0, i + 1], atol=1e-5)


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    """A tiny Llama with head_dim 64 (quantized caches work on 64-element blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    d = tmp_path_factory.mktemp("m64")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return load_model(d, "cpu")


@pytest.mark.parametrize("mode,tol", [("q8", 0.003), ("q6", 0.04), ("q4", 0.04), ("q3", 0.06), ("q2", 0.1)])
def test_quantized_cache_decode_stays_close(model64, mode, tol):
    """Decoding over a quantized cache moves the logits by at most `tol` of their range (error grows as bits
    shrink), and the fp16 cache reproduces the contiguous cache exactly."""
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    table = torch.tensor([[2, 0, 3, 1, 4]], dtype=torch.int32)
    out = {}
    for m in ("fp16", mode):
        cache = PagedKVCache(model64.spec, num_pages=5, page_size=16, mode=m, device="cpu", dtype=torch.float32)
        cache.bind(table)
        with torch.no_grad():
            model64(ids[:, :60], cache, 0)
            out[m] = torch.cat([model64(ids[:, 60 + i:61 + i], cache, 60 + i) for i in range(10)], 1)
    with torch.no_grad():
        ref = model64(ids)[:, 60:]
    assert torch.allclose(out["fp16"], ref, atol=1e-5)
    err = (out[mode] - ref).abs().max().item() / (ref.max() - ref.min()).item()
    assert 0 < err <= tol, err


def test_chunked_prefill_matches_one_shot(model):
    """Prefill in two chunks (the second attends to the paged prefix) equals a one-shot prefill, whether the
    chunk's start is an int (the forward tells the cache whether it is a fresh prompt) or a per-row tensor (the
    cache reads it back)."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
    for start0, start1 in ((0, 17), (torch.tensor([0]), torch.tensor([17]))):
        cache = PagedKVCache(model.spec, num_pages=8, page_size=8, device="cpu", dtype=torch.float32)
        cache.bind(torch.tensor([[3, 1, 4, 0, 5, 7]], dtype=torch.int32))
        with torch.no_grad():
            a = model(ids[:, :17], cache, start0)
            b = model(ids[:, 17:], cache, start1)
        assert torch.allclose(torch.cat([a, b], 1), ref, atol=1e-5)


@pytest.mark.skipif(not triton_usable(), reason="needs Triton (interpreter)")
def test_chunked_prefill_through_the_kernels_matches_the_twins(model):
    """The same two-chunk prefill with the Triton kernels (interpreter): the first chunk's RoPE and cache write are
    one launch that also keeps the rotated keys for its own attention, the second attends to the pages."""
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids)
        cache = PagedKVCache(model.spec, num_pages=8, page_size=8, device="cpu", dtype=torch.float32)
        cache.bind(torch.tensor([[3, 1, 4, 0]], dtype=torch.int32))
        with force_triton():
            a = model(ids[:, :13], cache, 0)
            b = model(ids[:, 13:], cache, 13)
    torch.testing.assert_close(torch.cat([a, b], 1), ref, atol=1e-3, rtol=1e-3)
