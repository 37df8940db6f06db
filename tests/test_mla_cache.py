"""Multi-head latent attention over a latent cache (`MLAttention`): one cached row a token (the normed latent and
the RoPE key) instead of expanded per-head keys and values, checked against the cache-less forward (keys and
values expanded, as transformers computes them), through the contiguous and paged caches, the Triton kernels and
quantized caches."""
import pytest
import torch

from tiny_models import ARCHS, _deepseek, build_config

from exl2.kernels.backend import force_triton, triton_usable
from exl2.runtime.loader import load_model
from exl2.runtime.paged_cache import PagedKVCache, layer_bytes_per_token


def _dense(**kw):
    """A tiny DeepSeek-V3 without experts: the fp16 kernels' rounding flips its sigmoid routing between near-equal
    experts, which would hide the attention's own error."""
    return _deepseek(first_k_dense_replace=3, **kw)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """DeepSeek-V3's attention (q LoRA, interleaved YaRN RoPE) with a 32 + 8 latent row."""
    cfg = _dense(max_position_embeddings=128, rope_parameters=ARCHS["deepseek_v3"]().rope_parameters)
    return load_model(build_config(cfg, tmp_path_factory.mktemp("mla")), "cpu")


@pytest.fixture(scope="module")
def mla64(tmp_path_factory):
    """Latent rows of 64 + 64 values (quantized caches work on 64-element blocks), V2-Lite-style attention."""
    cfg = _dense(kv_lora_rank=64, qk_rope_head_dim=64, q_lora_rank=None, rope_interleave=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return load_model(build_config(cfg, tmp_path_factory.mktemp("mla64")), "cpu")


def test_the_cache_holds_one_latent_row_a_token(mla):
    m = mla.spec.mla
    cache = PagedKVCache(mla.spec, num_pages=2, page_size=8, device="cpu", dtype=torch.float32)
    assert (cache.kv_heads, cache.k_dim, cache.v_dim) == (1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank)
    expanded = mla.spec.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    assert layer_bytes_per_token(mla.spec) == 2 * (2 * m.kv_lora_rank + m.qk_rope_head_dim) < 2 * expanded


@pytest.mark.parametrize("kernels", [False, True])
def test_paged_latent_prefill_and_decode_match_the_expanded_forward(mla, kernels):
    """A prompt in two chunks (the second over the paged prefix), then four decode steps, on scattered pages:
    logits as the whole sequence through the expanded (cache-less) forward; `kernels`: the Triton paths
    (interpreter), every head attending over the one latent row."""
    if kernels and not triton_usable():
        pytest.skip("needs Triton (interpreter)")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = mla(ids)
    cache = PagedKVCache(mla.spec, num_pages=8, page_size=8, device="cpu", dtype=torch.float32)
    cache.bind(torch.tensor([[5, 1, 7, 2]], dtype=torch.int32))
    ctx = force_triton() if kernels else torch.no_grad()
    with torch.no_grad(), ctx:
        outs = [mla(ids[:, :13], cache, 0), mla(ids[:, 13:26], cache, 13)]
        outs += [mla(ids[:, i:i + 1], cache, i) for i in range(26, 30)]
    tol = 2e-3 if kernels else 1e-4
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("mode,tol", [("q8", 0.006), ("q4", 0.05)])
def test_quantized_latent_cache_stays_close(mla64, mode, tol):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = mla64(ids)[:, 32:]
        cache = PagedKVCache(mla64.spec, num_pages=4, page_size=16, mode=mode, device="cpu", dtype=torch.float32)
        cache.bind(torch.tensor([[3, 0, 2]], dtype=torch.int32))
        mla64(ids[:, :32], cache, 0)
        got = torch.cat([mla64(ids[:, i:i + 1], cache, i) for i in range(32, 40)], 1)
    err = (got - ref).abs().max().item() / (ref.max() - ref.min()).item()
    assert 0 < err <= tol, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_latent_decode_on_the_gpu(tmp_path, mode):
    """DeepSeek-V3's real latent row (512 + 64) and 16 heads in fp16 on CUDA: a prompt, then 8 steps through the
    decode graph (all 16 heads on one latent row in the paged kernel), against the expanded forward in float32
    on the CPU: logits within 3 % (fp16 cache) / 6 % (q4) of their span."""
    from exl2.runtime.graphs import DecodeGraphs

    cfg = _dense(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128,
                 rope_parameters=ARCHS["deepseek_v3"]().rope_parameters)
    d = build_config(cfg, tmp_path)
    gpu, cpu = load_model(d, "cuda"), load_model(d, "cpu")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(6))
    cache = PagedKVCache(gpu.spec, num_pages=4, page_size=16, mode=mode, device="cuda", dtype=torch.float16)
    graphs = DecodeGraphs(gpu, cache, max_pages_per_seq=3, scratch_page=3)
    graphs.capture((1,))
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32, device="cuda")
    cache.bind(table)
    with torch.inference_mode():
        got = [gpu(ids[:, :32].cuda(), cache, 0, last_only=True)[:, -1].float().cpu()]
    for i in range(32, 40):
        got.append(graphs.step(ids[:, i:i + 1].cuda(), torch.tensor([i], device="cuda"), table).float().cpu())
    with torch.no_grad():
        ref = cpu(ids)[0, 31:40]
    err = (torch.cat(got) - ref).abs().max().item() / (ref.max() - ref.min()).item()
    assert err <= (0.03 if mode == "fp16" else 0.06), err
