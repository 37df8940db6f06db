"""The paged cache gives the same logits as the contiguous cache, with pages scattered across sequences."""
import pytest
import torch

from tiny_models import build_tiny

from exl2.runtime.loader import load_model
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
