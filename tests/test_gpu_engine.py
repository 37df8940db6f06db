"""GPU checks of engine-level switches verified on the CPU elsewhere (run on a CUDA machine with `pytest -m gpu`):
the Triton prompt attention against SDPA, RoPE overrides through the Triton path, and Engine.close releasing GPU
memory."""
import gc

import pytest
import torch
from safetensors.torch import load_file

from exl2.config import EngineConfig, SamplingSettings
from exl2.models.rope import RopeOverride
from exl2.runtime.loader import load_model
from exl2.runtime.paged_cache import PagedKVCache

from test_exl2_model import GOLDEN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = GOLDEN / "b4.0_hb6"


def _ids(n: int = 96) -> torch.Tensor:
    return load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"][:, :n]


def _prefill_logits(model, ids: torch.Tensor, backend: str) -> torch.Tensor:
    cache = PagedKVCache(model.spec, num_pages=4, page_size=64, mode="fp16", device="cuda", dtype=torch.float16)
    cache.prefill_backend = backend
    cache.bind(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device="cuda"))
    with torch.inference_mode():
        return model(ids.cuda(), cache, 0)[0].float().cpu()


@pytest.mark.parametrize("rope", [None, RopeOverride(scale=2.0), RopeOverride(alpha=2.5), RopeOverride(yarn=2.0)])
def test_prompt_attention_backends_match_the_cpu_path(rope):
    """A 96-token prompt through the paged cache with prompt attention in SDPA ("auto", EngineConfig's default)
    and in the engine's Triton flash-attention kernel (flash_attention_enabled=False), each against the CPU path
    (float32, dequantized weights) with the same RoPE override. Tolerance: every position's logits within 3 % of
    the reference's range (fp16 activations), ≥ 90 % of argmaxes equal, and the two backends within 1 % of each
    other (they differ only in the attention's fp16 rounding); with an override, nearer the CPU path with it than
    the one without it."""
    ids = _ids()
    gpu = load_model(MODEL, "cuda", rope=rope)
    with torch.no_grad():
        ref = load_model(MODEL, "cpu", rope=rope)(ids)[0].float()
    span = (ref.max() - ref.min()).item()
    got = {b: _prefill_logits(gpu, ids, b) for b in ("auto", "triton")}
    for logits in got.values():
        assert (logits - ref).abs().max().item() <= 0.03 * span
        assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    assert (got["auto"] - got["triton"]).abs().max().item() <= 0.01 * span
    if rope is not None:
        # An override moves the logits by only 0.1-0.5 % of their range on average at these positions (the fp16
        # path's own mean error is ~10x smaller), so check that the GPU path follows the override: its logits
        # are much nearer the CPU path's with the override than without it.
        with torch.no_grad():
            plain = load_model(MODEL, "cpu")(ids)[0].float()
        for logits in got.values():
            assert (logits - ref).abs().mean() < 0.5 * (logits - plain).abs().mean()


def test_engine_greedy_replies_agree_across_prompt_attention_backends():
    """The same greedy requests through Engines with flash_attention_enabled on and off: decode attention is the
    same kernel, so the replies may differ only where fp16 rounding in the prompt flips a near-tie (≥ 3 of 4)."""
    from exl2.engine import Engine

    prompts = ["Once upon a time " * 6, "The rain in Spain " * 6, "def f(x):\n    return " * 4, "Paris is " * 8]
    greedy = SamplingSettings(temperature=0)
    replies = {}
    for flash in (True, False):
        engine = Engine(EngineConfig(model_dir=MODEL, device="cuda", max_seq_len=1024,
                                     flash_attention_enabled=flash))
        replies[flash] = [engine.generate(p, greedy, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
        engine.close()
    assert all(len(r) == 24 for r in replies[False])
    assert sum(a == b for a, b in zip(replies[True], replies[False])) >= 3


def test_engine_close_returns_its_gpu_memory():
    """Engines with a 64k-token fp16 cache (~134 MB for this model) load, generate and close twice, as the
    server's model reloads do. A second cycle leaves nothing more behind than the first (cuBLAS's per-stream
    workspaces, 32 MiB each on Hopper, belong to the process and are reused, not one more per load); once those
    are cleared, everything the engine allocated is released (within 8 MB: allocator rounding and small per-shape
    kernel tables that outlive it), and handed back to the driver."""
    from exl2.engine import Engine

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    left = []
    for _ in range(2):
        engine = Engine(EngineConfig(model_dir=MODEL, device="cuda", max_seq_len=2048, cache_size=65536))
        assert torch.cuda.memory_allocated() - before > 100 * 2**20
        engine.generate("Hello there", SamplingSettings(temperature=0.8, top_p=0.9), max_new_tokens=8)
        engine.close()
        left.append(torch.cuda.memory_allocated() - before)
    assert left[1] <= left[0] + 2**20
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated() - before
    assert after <= 8 * 2**20, f"{after / 2**20:.1f} MiB still allocated after close"
    assert torch.cuda.memory_reserved() - before <= 64 * 2**20


def test_classifier_free_guidance_through_the_decode_graphs():
    """A guided job (cfg_scale 2, a negative prompt) beside a plain one on CUDA, through the batched decode graphs,
    against the same CUDA model recomputing both sequences from scratch each step (`test_cfg.cfg_reference`).
    Greedy tokens must agree (fp16 graph decode against fp16 full recompute: identical arithmetic per position up
    to the attention's split order, so only a near-tie could flip one)."""
    from test_cfg import cfg_reference

    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(MODEL)
    model = load_model(MODEL, "cuda")
    ids, negative = tok.encode("The weather today is"), tok.encode("Write something sad and gloomy:")
    plain_ids = tok.encode("Paris is the capital of")
    want = cfg_reference(model, ids, negative, 2.0, 10)
    gen = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16)
    assert gen.graphs is not None
    guided = SamplingSettings(temperature=0, cfg_scale=2.0)
    out = gen.generate([Job(ids, guided, 10, negative_ids=negative),
                        Job(plain_ids, SamplingSettings(temperature=0), 10)])
    assert out[0].token_ids == want
    with torch.inference_mode():
        seq = list(plain_ids)
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq], device="cuda"))[0, -1].argmax()))
    assert out[1].token_ids == seq[len(plain_ids):]
