"""The host-memory tier of the prompt cache (`runtime.host_pages`, `EngineConfig.host_cache_gb`): pages the GPU
cache evicts are kept in host memory and copied back when a prompt starts with them, giving the same reply as
computing them; without the tier the same request recomputes them. The golden 4.0 bpw model on CPU, with a cache of
two 256-token pages so that a second long prompt evicts the first one's pages."""
import logging

import pytest
import torch

from test_lora_serving import GREEDY, MODEL

from exl2.config import EngineConfig
from exl2.engine import Engine
from exl2.runtime.host_pages import HostPages, page_tensors
from exl2.runtime.page_pool import PagePool

FIRST = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 11)     # > 1 page
SECOND = " ".join(["A slow green turtle walks under the bright moon by the old mill."] * 11)


def replies(host_gb: float) -> tuple[list, list, list]:
    e = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, cache_size=512, max_batch_size=1, device="cpu",
                            host_cache_gb=host_gb))
    try:
        runs = [e.generate(p, GREEDY, 8, logprobs=1) for p in (FIRST, SECOND, FIRST)]
        return [r.token_ids for r in runs], [r.cached_tokens for r in runs], [[x.logprob for x in r.logprobs]
                                                                              for r in runs]
    finally:
        e.close()


def test_evicted_pages_come_back_from_host_memory():
    tokens, cached, logprobs = replies(1.0)
    plain_tokens, plain_cached, plain_logprobs = replies(0.0)
    assert cached[0] == 0 and plain_cached[2] == 0      # without the tier, the first prompt's page was evicted
    assert cached[2] >= 256                            # with it, that page is copied back instead of computed
    assert tokens == plain_tokens                      # and the reply is the same, to its log-probabilities
    assert logprobs[2] == pytest.approx(plain_logprobs[2], abs=1e-5)


def test_host_pages_store_and_drop_oldest_first(caplog):
    """save/take/write round-trip every tensor of a page; past the budget the oldest page goes first; a budget below
    one page says so."""
    from exl2.models.registry import spec_from_config
    from exl2.runtime.paged_cache import PagedKVCache
    from exl2.runtime.synthetic import QWEN3_30B_A3B

    spec = spec_from_config(dict(QWEN3_30B_A3B, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=64, hidden_size=256, vocab_size=512))
    cache = PagedKVCache(spec, 4, 16, "q4")
    tensors = page_tensors(cache)
    assert len(tensors) == 8                                # k, v and their scales of two layers
    for t in tensors:
        t.copy_(torch.randint(0, 200, t.shape).to(t.dtype))
    store = HostPages(cache, 2 * sum(t[0].numel() * t.element_size() for t in tensors))
    assert store.capacity == 2
    for page, key in ((0, b"a"), (1, b"b"), (2, b"c")):
        store.save(page, key)
    assert b"a" not in store and b"b" in store and len(store) == 2
    data = store.take(b"b")
    store.write(3, data)
    assert all(torch.equal(t[3], t[1]) for t in tensors) and b"b" not in store
    with caplog.at_level(logging.WARNING, logger="exl2.model"):
        assert HostPages(cache, 1000).capacity == 0
    assert "smaller than one cache page" in caplog.text


def test_page_pool_reports_evictions_and_chains_keys():
    pool = PagePool(2, 4)
    seen = []
    pool.on_evict = lambda page, key: seen.append((page, key))
    tokens = list(range(12))
    keys = pool.keys_after(tokens, None, 0, 3)
    a = pool.acquire([], 2)
    pool.publish(a[0], keys[0])
    pool.publish(a[1], keys[1])
    pool.release(a)
    assert pool.match(tokens, 3) == (a, keys[1]) and pool.keys_after(tokens, keys[1], 2, 3) == keys[2:]
    pool.acquire([], 1)                                    # takes the oldest cached page
    assert seen == [(a[0], keys[0])]
