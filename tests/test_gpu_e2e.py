"""GPU end to end (run on a CUDA machine with `pytest -m gpu`): the Triton path against the CPU reference path."""
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

from exl2.models.rope import RopeOverride
from exl2.runtime.graphs import DecodeGraphs
from exl2.runtime.loader import load_model
from exl2.runtime.paged_cache import PagedKVCache

from graph_decode import greedy_graph_decode, three_prompts
from test_exl2_model import GOLDEN
from test_kernels_quant_matmul import rand_exl2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NAMES = ["b3.0_hb6", "b4.0_hb6", "b6.0_hb6"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["fp16", "q8", "q4"])
def test_golden_greedy_decode_matches_cpu(name, mode):
    """Prefill 96 reference tokens, then 32 greedy steps through CUDA graphs over the paged cache.

    The CPU path (float32, dequantized weights) teacher-forces the same tokens. Tolerance: logits within 3 % of
    their range (fp16 activations and the fp16/quantized cache), and ≥ 90 % of greedy choices equal (near-ties in
    a random tiny model may flip)."""
    _golden_decode(name, mode)


@pytest.mark.parametrize("name", NAMES)
def test_golden_greedy_decode_with_split_sums(name):
    """The same with o_proj and down leaving their K-split partial sums to the norm-gather (EXL2_SPLIT_SUM)."""
    _golden_decode(name, "fp16", split_sum=True)


@pytest.mark.parametrize("mode", ["fp16", "q8"])
def test_golden_greedy_decode_with_rope_scale(mode):
    """The same with a RoPE override (-rs 2): the decode graphs' RoPE + cache write and the prefill follow it.
    (A q4 cache's own error, 0.6 % of the logits' range on average, exceeds what the override changes.)"""
    _golden_decode("b4.0_hb6", mode, rope=RopeOverride(scale=2.0))


@pytest.mark.parametrize("mode", ["fp16", "q8"])
def test_golden_greedy_decode_with_a_lora_adapter(mode, tmp_path):
    """The same with a LoRA adapter on every projection: on the GPU its deltas are added where only permuted
    inputs exist (the norm-gather's q/k/v and gate/up copies, the GLU's down input, attention's o_proj input),
    inside the decode graphs, with split sums off; the CPU reference runs the same adapter. (Not q4: this random
    adapter doubles the keys' and values' spread, and a q4 cache's error with it, 3.6 % of the logits' range at
    worst on an H100, passes the 3 % bound only without it.)"""
    from test_lora import ALL, make_adapter

    _golden_decode("b4.0_hb6", mode, lora=make_adapter(tmp_path / "a", ALL, r=8, alpha=16.0, seed=3))


def _golden_decode(name: str, mode: str, split_sum: bool = False, rope: RopeOverride | None = None,
                   lora=None) -> None:
    from exl2.runtime.lora import LoraAdapter, set_loras

    ids = load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"][:, :96]
    gpu = load_model(GOLDEN / name, "cuda", rope=rope)
    if split_sum:
        assert gpu.route_split_sums(True) > 0
    cpu = load_model(GOLDEN / name, "cpu", rope=rope)
    if lora is not None:
        for m in (gpu, cpu):
            set_loras(m, [LoraAdapter.from_dir(lora, m)])
    page = 64
    cache = PagedKVCache(gpu.spec, num_pages=5, page_size=page, mode=mode, device="cuda", dtype=torch.float16)
    graphs = DecodeGraphs(gpu, cache, max_pages_per_seq=4, scratch_page=4)
    graphs.capture((1,))
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device="cuda")
    got, toks = greedy_graph_decode(gpu, cache, graphs, ids, 32, table)
    seq = torch.cat([ids, toks], 1)
    with torch.no_grad():
        ref = cpu(seq)[0, 95:]
    span = (ref.max() - ref.min()).item()
    assert (got - ref).abs().max().item() <= 0.03 * span
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    if rope is not None or lora is not None:  # it follows the override or adapter (see test_gpu_engine.py)
        with torch.no_grad():
            plain = load_model(GOLDEN / name, "cpu")(seq)[0, 95:]
        assert (got - ref).abs().mean() < 0.5 * (got - plain).abs().mean()


@pytest.mark.parametrize("max_len", [None, 71])
def test_batched_graph_decode_matches_eager(max_len, monkeypatch):
    """Batch 3 through the batch-4 graph (one padded row) equals eager decoding of the same rows; with `max_len`
    through the one-split graph of short batches (no merge launch; captured here whatever the default split
    count of this small model would be)."""
    from exl2.runtime import graphs as graphs_mod

    monkeypatch.setattr(graphs_mod, "SHORT_MAX_SPLITS", 32)
    gpu = load_model(GOLDEN / "b4.0_hb6", "cuda")
    cache = PagedKVCache(gpu.spec, num_pages=13, page_size=64, device="cuda", dtype=torch.float16)
    graphs = DecodeGraphs(gpu, cache, max_pages_per_seq=4, scratch_page=12)
    graphs.capture((4,))
    table, pos, ids = three_prompts(gpu, cache, 1024)
    assert 4 in graphs.short
    a = graphs.step(ids, pos, table, max_len=max_len).float()
    cache.bind(table)
    with torch.inference_mode():
        b = gpu(ids, cache, pos, last_only=True)[:, -1].float()
    assert torch.allclose(a, b, atol=1e-2, rtol=0)


@pytest.mark.parametrize("batch", [8, 16])
@pytest.mark.parametrize("mixed", [False, True])
def test_batched_decode_through_the_gluon_kernel_matches_the_twin(batch, mixed):
    """A Llama-shaped model (4-bit body, or 5/4/3-bit groups in every matrix; 8/6-bit head) decoding `batch` rows
    (the Gluon tensor-core kernel, grouped for q/k/v and gate/up) against the same step through the PyTorch twins,
    and through the Triton kernel (EXL2_MMA4 off)."""
    from exl2.kernels import quant_matmul as qm
    from exl2.kernels.backend import force_torch
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import spec_from_config
    from exl2.runtime.synthetic import BODY_OPTION, LLAMA3_8B, MIXED_BODY_OPTION, DictSource, llama_exl2_tensors
    from exl2.runtime.weights import WeightLoader

    cfg = dict(LLAMA3_8B, num_hidden_layers=2, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=4096)
    tensors = DictSource(llama_exl2_tensors(cfg, "cuda", body=MIXED_BODY_OPTION if mixed else BODY_OPTION))
    with torch.inference_mode():
        model = DecoderModel(spec_from_config(cfg), WeightLoader(tensors, torch.device("cuda"), torch.float16)).eval()
    cache = PagedKVCache(model.spec, num_pages=batch + 1, page_size=64, device="cuda", dtype=torch.float16)
    table = torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1)
    lens = [5 + 3 * b for b in range(batch)]
    g = torch.Generator(device="cuda").manual_seed(batch)
    for b, n in enumerate(lens):
        cache.bind(table[b:b + 1])
        with torch.inference_mode():
            model(torch.randint(0, 4096, (1, n), device="cuda", generator=g), cache, 0)
    ids = torch.randint(0, 4096, (batch, 1), device="cuda", generator=g)
    pos = torch.tensor(lens, device="cuda")
    cache.bind(table)
    outs = []
    for mode in ("mma", "triton", "twin"):  # each step writes the same keys and values at the same positions
        old = qm.MMA4
        qm.MMA4 = mode == "mma"
        try:
            with torch.inference_mode(), (force_torch() if mode == "twin" else nullcontext()):
                outs.append(model(ids, cache, pos, last_only=True)[:, -1].float())
        finally:
            qm.MMA4 = old
    mma, triton_dot, twin = outs
    _assert_near(mma, twin)
    _assert_near(triton_dot, twin)


def _random_4bit(k: int, n: int, seed: int, bits: int = 4):
    """A pure 4-bit (or `bits`-bit) layer in the kernel layout (groups of 128, act-order permutation) and a
    generator for inputs."""
    from exl2.kernels.qweight import build

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (k, n), device=dev, dtype=torch.uint8, generator=g)
    scales = (torch.rand(k // 128, n, device=dev, generator=g) * 0.01 + 0.001).half()
    return build(codes, [(bits, 128)] * (k // 128), scales, None, torch.randperm(k, device=dev, generator=g)), g


def _assert_near(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp16 partial sums: within 0.5 % of the output range."""
    assert (got.float() - ref).abs().max().item() <= 5e-3 * (ref.max() - ref.min()).item()


def test_fast_4bit_gemv_is_used_and_matches_twin():
    """The packed-fp16 4-bit decoder passes its self-check and matches the twin at a real shape."""
    from exl2.kernels.gemv import fast4_available, gemv
    from exl2.kernels.matmul_launch import MatmulConfig
    from exl2.kernels.qweight import matmul_torch

    assert fast4_available(torch.device("cuda")) == 63  # the packed decoders of every width
    w, g = _random_4bit(4096, 14336, 1)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16, generator=g)
    _assert_near(gemv(x, w, MatmulConfig(bs=8, bn=128, split=4), fast4=True), matmul_torch(x, w).float())


@pytest.mark.parametrize("bits", [8, 6, 5, 3, 2])
@pytest.mark.parametrize("bn,split", [(128, 1), (64, 3)])
def test_packed_gemv_widths_match_portable_and_twin(bits, bn, split):
    """The packed-fp16 decoders of the other widths (a wide layer, ragged K splits) against the portable decoder
    and the twin."""
    from exl2.kernels.gemv import gemv
    from exl2.kernels.matmul_launch import MatmulConfig
    from exl2.kernels.qweight import matmul_torch

    w, g = _random_4bit(4096, 8192, 7, bits=bits)
    x = torch.randn(2, 4096, device="cuda", dtype=torch.float16, generator=g)
    cfg = MatmulConfig(bs=8, bn=bn, split=split, num_stages=3)
    ref = matmul_torch(x, w).float()
    _assert_near(gemv(x, w, cfg, fast4=True), ref)
    _assert_near(gemv(x, w, cfg, fast4=False), ref)


@pytest.mark.parametrize("stages", [2, 4])
def test_fast_4bit_gemv_pipeline_depths_match_twin(stages):
    """The Triton-pipelined word-at-a-time 4-bit decoder, 2 and 4 tiles in flight, with a K split that leaves
    ragged tails."""
    from exl2.kernels.gemv import gemv
    from exl2.kernels.matmul_launch import MatmulConfig
    from exl2.kernels.qweight import matmul_torch

    w, g = _random_4bit(4096, 4096, 2)
    x = torch.randn(2, 4096, device="cuda", dtype=torch.float16, generator=g)
    got = gemv(x, w, MatmulConfig(bs=8, bn=128, split=3, num_stages=stages), fast4=True)
    _assert_near(got, matmul_torch(x, w).float())


def test_fast_4bit_dot_decodes_exactly_like_the_portable_one():
    """The packed 4-bit decoder of the tensor-core path dequantizes bit-exactly (one rounding, the scale product),
    so with the same tiles and dot order the outputs are identical, and both match the twin."""
    from exl2.kernels.dot import dot
    from exl2.kernels.matmul_launch import MatmulConfig
    from exl2.kernels.qweight import matmul_torch

    w, g = _random_4bit(4096, 4096, 5)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.float16, generator=g)
    cfg = MatmulConfig(bm=16, bs=4, bn=128, split=2)
    fast, portable = dot(x, w, cfg, fast4=True), dot(x, w, cfg, fast4=False)
    assert torch.equal(fast, portable)
    _assert_near(fast, matmul_torch(x, w).float())


def test_grouped_gemv_real_sizes_match_twin():
    """q/k/v-shaped weights with different width mixes through one `GemvGroup` launch, fast 4-bit path on."""
    from exl2.kernels.exl2_matmul import Exl2Weight
    from exl2.kernels.gemv import GemvGroup
    from exl2.kernels.permute import gather_input
    from exl2.kernels.qweight import matmul_torch

    layouts = ((4096, [(4, 128)] * 32), (1024, [(6, 128)] * 4 + [(4, 128)] * 28),
               (1024, [(5, 128)] * 8 + [(4, 128)] * 20 + [(3, 128)] * 4))
    ws = [Exl2Weight.from_tensors(rand_exl2(layout, n, bias=False, seed=3 + i, device="cuda"), "L", device="cuda")
          for i, (n, layout) in enumerate(layouts)]
    x = torch.randn(3, 4096, device="cuda", dtype=torch.float16)
    group = GemvGroup(ws)
    for _ in range(2):  # the second call reuses the split-K counters reset by the first
        for w, y in zip(ws, group(gather_input(x, ws, whole=True))):
            _assert_near(y, matmul_torch(x, w).float())



def test_dynamic_batch_through_lazy_graphs_matches_one_at_a_time():
    """Five prompts through the dynamic generator at batch ≤ 4 (graphs captured on first use, padded rows on the
    scratch page, a shared prefix) against each prompt alone and eager. Tolerance: different batch sizes pick
    different kernels (fp16 rounding), so at least 4 of the 5 greedy sequences must be identical."""
    from exl2.config import SamplingSettings
    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.tokenizer import Tokenizer

    model = load_model(GOLDEN / "b4.0_hb6", "cuda")
    tok = Tokenizer.from_dir(GOLDEN / "b4.0_hb6")
    greedy = SamplingSettings(temperature=0)
    head = "A long shared system prompt that fills more than one page of sixteen tokens, surely. "
    prompts = [tok.encode(head + p) for p in ("Hello", "Once upon a time", "The rain in Spain", "def f(x):", "Paris")]
    batched = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    got = [r.token_ids for r in batched.generate([Job(p, greedy, 24) for p in prompts])]
    assert set(batched.graphs.graphs) >= {4} and batched.pool.available() == batched.pool.num_pages
    alone = DynamicGenerator(model, tok, 512, max_batch=1, page_size=16, use_graphs=False)
    want = [alone.generate([Job(p, greedy, 24)])[0].token_ids for p in prompts]
    assert sum(g == w for g, w in zip(got, want)) >= 4


def _self_drafting(max_batch: int):
    """The golden 4.0 bpw model drafting for itself on the GPU: (its five repeated-text prompts' plain greedy
    replies, the jobs, a DynamicGenerator with a ModelDraft of a second copy drafting up to `max_batch`)."""
    from exl2.config import SamplingSettings
    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.speculative import ModelDraft
    from exl2.generation.tokenizer import Tokenizer

    model = load_model(GOLDEN / "b4.0_hb6", "cuda")
    tok = Tokenizer.from_dir(GOLDEN / "b4.0_hb6")
    greedy = SamplingSettings(temperature=0)
    prompts = [tok.encode(p * 3) for p in ("Hello there. ", "Once upon a time ", "The rain in Spain ", "def f(x): ",
                                           "Paris is ")]
    plain = DynamicGenerator(model, tok, 512, max_batch=1, page_size=16)
    want = [plain.generate([Job(p, greedy, 32)])[0].token_ids for p in prompts]
    draft = ModelDraft(load_model(GOLDEN / "b4.0_hb6", "cuda"), 600, page_size=16, max_batch=max_batch)
    spec = DynamicGenerator(model, tok, 512, max_batch=max_batch, page_size=16, draft=draft)
    return want, [Job(p, greedy, 32) for p in prompts], spec


def test_speculative_decoding_through_verify_graphs():
    """A model drafting for itself on the GPU: its guesses are checked 5 tokens at a time by a captured graph
    (tokens=5, positions from a tensor, chunked attention over the cache). Same tolerance as above: at least 4 of 5
    greedy sequences identical to plain decoding; most guesses kept."""
    want, jobs, spec = _self_drafting(1)
    got = [spec.generate([j])[0].token_ids for j in jobs]
    assert 1 in spec.verify_graphs[4].graphs
    assert sum(g == w for g, w in zip(got, want)) >= 4
    assert sum(j.accepted for j in jobs) >= 0.8 * sum(j.drafted for j in jobs)


def test_batched_speculative_decoding_through_graphs():
    """Four sequences drafting together on the GPU: the draft model decodes them as one batch (its decode graphs
    at batch 4), the model checks 4 × 4 tokens (3 guesses each: CHECK_ROWS) in one captured graph. At least 4 of 5
    greedy sequences identical to plain decoding (graph and eager kernels may round a near-tie differently); most
    guesses kept."""
    want, jobs, spec = _self_drafting(4)
    got = [r.token_ids for r in spec.generate(jobs)]
    assert spec.check_guesses[4] == 3 and 4 in spec.verify_graphs[3].graphs and 4 in spec.draft.graphs.graphs
    assert sum(g == w for g, w in zip(got, want)) >= 4
    assert sum(j.accepted for j in jobs) >= 0.8 * sum(j.drafted for j in jobs)


def test_extended_samplers_on_cuda_match_eager_decoding():
    """exllamav2's further samplers (typical, tail-free, XTC, dynamic temperature, Mirostat, DRY, a ranged penalty,
    banned strings, banned tokens) through the dynamic generator on CUDA, with decode graphs and overlapped steps
    where a job allows them, against eager decoding without overlap: the same seeded replies (≥ 4 of 5: graph and
    eager kernels may round a near-tie differently)."""
    from exl2.config import SamplingSettings
    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.tokenizer import Tokenizer

    model = load_model(GOLDEN / "b4.0_hb6", "cuda")
    tok = Tokenizer.from_dir(GOLDEN / "b4.0_hb6")
    kinds = [SamplingSettings(temperature=1.0, typical=0.9, tfs=0.95, xtc_probability=0.5, seed=1),
             SamplingSettings(temperature=1.0, min_temp=0.5, max_temp=1.5, top_p=0.9, banned_tokens=(13,), seed=2),
             SamplingSettings(temperature=1.0, mirostat_mode=2, mirostat_tau=3.0, seed=3),
             SamplingSettings(temperature=0.8, dry_multiplier=1.0, repetition_penalty=1.2, repetition_range=32,
                              seed=4),
             SamplingSettings(temperature=0.0, banned_strings=("the", "and"), seed=5)]
    ids = tok.encode("Once upon a time in a land far away, " * 3)

    def replies(gen):
        return [r.token_ids for r in gen.generate([Job(ids, s, 24) for s in kinds])]

    fast = replies(DynamicGenerator(model, tok, 512, max_batch=4, page_size=16))
    slow = replies(DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, use_graphs=False, overlap=False))
    assert all(len(r) > 0 for r in fast)
    assert sum(a == b for a, b in zip(fast, slow)) >= 4
    assert not any(b in tok.decode(fast[4]).lower() for b in ("the", "and"))
