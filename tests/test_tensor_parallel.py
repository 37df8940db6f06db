"""Tensor parallelism (runtime.tp) on CPU "devices": the weight shares sum to the whole, a sharded model gives the
unsharded model's logits (prefill and paged decode) and greedy tokens through the dynamic generator, and the user
errors. A `gpu` test compares two real GPUs (NCCL) and one GPU's shards (host collectives, Triton kernels).

Tolerance for whole models: max |Δ logit| ≤ 1e-4 · max |logit| in float32 (the sums over shares change only the
order of additions), as the architecture parity tests use; fp16 on the GPU: 3 % of the logit range."""
from pathlib import Path

import pytest
import torch

from exl2.config import EngineConfig, SamplingSettings
from exl2.errors import ConfigError
from exl2.formats.safetensors_io import TensorSource
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.tokenizer import Tokenizer
from exl2.kernels.qweight import (build, input_features, matmul_torch, slice_steps, step_shares, take_outputs,
                                  with_inputs)
from exl2.models.decoder import DecoderModel
from exl2.models.registry import read_config, spec_from_config
from exl2.runtime.loader import load_model, tensor_parallel_devices
from exl2.runtime.paged_cache import paged_cache_for
from exl2.runtime.synthetic import LLAMA3_8B, DictSource, llama_exl2_tensors
from exl2.runtime.tp.cache import ShardedCache
from exl2.runtime.tp.collectives import Collectives
from exl2.runtime.tp.model import TensorParallelModel, build_tensor_parallel
from exl2.runtime.weights import WeightLoader
from tiny_models import build_tiny

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
MIXED = ([8, 6, 5, 4, 3, 2], [0.1, 0.1, 0.2, 0.3, 0.2, 0.1], [32, 32, 32, 64, 32, 32])
# 8 query heads over 4 KV heads: shards over 2 and 4 devices
SYNTH = dict(LLAMA3_8B, vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> bool:
    return float((got - want).abs().max()) <= tol * float(want.abs().max())


# ---- weight shares ---------------------------------------------------------------------------------------------

def random_weight(zeros: bool, seed: int = 0, k: int = 560, n: int = 96):
    """A QuantWeight with every width class, a group whose rows are not a multiple of 32 (padding rows) and an
    act-order permutation; GPTQ-like (zero points) or EXL2-like."""
    g = torch.Generator().manual_seed(seed)
    groups = [(8, 32), (6, 64), (5, 48), (4, 128), (4, 96), (3, 64), (2, 128)]
    assert sum(r for _, r in groups) == k
    codes = torch.cat([torch.randint(0, 1 << b, (r, n), generator=g, dtype=torch.uint8) for b, r in groups])
    scales = (torch.rand(len(groups), n, generator=g) * 0.01 + 0.001).half()
    z = torch.cat([torch.randint(0, 1 << b, (1, n), generator=g) for b, _ in groups]).half() if zeros else None
    bias = torch.randn(n, generator=g).half()
    return build(codes, groups, scales, z, torch.randperm(k, generator=g), bias)


@pytest.mark.parametrize("zeros", [False, True], ids=["exl2", "gptq"])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_step_shares_sum_to_the_whole(zeros, parts):
    w = random_weight(zeros)
    x = torch.randn(5, w.k, generator=torch.Generator().manual_seed(1))
    want = matmul_torch(x, w)
    shares = [slice_steps(w, r, parts) for r in range(parts)]
    torch.testing.assert_close(sum(matmul_torch(x, s) for s in shares), want, rtol=0, atol=1e-4)
    # the shares partition the input features, hold an even share of every class, and one of them the bias
    feats = torch.cat([input_features(s) for s in shares])
    assert torch.equal(torch.sort(feats).values, torch.arange(w.k))
    assert max(s.n_steps for s in shares) - min(s.n_steps for s in shares) <= 1
    assert sum(s.bias is not None for s in shares) == 1
    for c in w.classes:
        got = [next((x.n_steps for x in s.classes if x.bits == c.bits), 0) for s in shares]
        assert sum(got) == c.n_steps and max(got) - min(got) <= 1
    # a share reading only its own features (the down projection's scheme) gives the same products
    local = [with_inputs(s, input_features(s)) for s in shares]
    torch.testing.assert_close(sum(matmul_torch(x[:, input_features(s)], lw) for s, lw in zip(shares, local)),
                               want, rtol=0, atol=1e-4)
    # misassigned: share 0 reading its features in another order breaks it
    rest = sum(matmul_torch(x[:, input_features(s)], lw) for s, lw in zip(shares[1:], local[1:]))
    bad = matmul_torch(x[:, input_features(shares[0]).flip(0)], local[0]) + rest
    assert not torch.allclose(bad, want, atol=1e-2)


def test_step_shares_are_balanced_over_classes():
    bounds = [step_shares([1, 1, 1, 1, 5], r, 4) for r in range(4)]
    assert [sum(b - a for a, b in share) for share in bounds] == [3, 2, 2, 2]
    with pytest.raises(ValueError):
        slice_steps(random_weight(False), 2, 2)


def test_take_outputs_is_a_column_slice():
    w = random_weight(True)
    x = torch.randn(3, w.k, generator=torch.Generator().manual_seed(2))
    cols = torch.tensor([5, 0, 17, 95, 40])
    torch.testing.assert_close(matmul_torch(x, take_outputs(w, cols)), matmul_torch(x, w)[:, cols], rtol=0,
                               atol=1e-5)


def test_collectives_copy_per_shard():
    c = Collectives(["cpu", "cpu"])
    a, b = torch.ones(2, 3), torch.full((2, 3), 2.0)
    r = c.all_reduce([a, b])
    assert torch.equal(r[0], torch.full((2, 3), 3.0)) and r[0] is not r[1] and torch.equal(a, torch.ones(2, 3))
    g = c.all_gather([a, b])
    assert g[0].shape == (2, 6) and torch.equal(g[1][:, 3:], b) and g[0] is not g[1]
    x = c.broadcast(a)
    assert x[0] is not x[1] and x[0] is not a


# ---- whole models ----------------------------------------------------------------------------------------------

def paged_run(model, ids: torch.Tensor, steps: int, page_size: int = 16) -> list[torch.Tensor]:
    """Prefill logits, then the logits of `steps` greedy decode steps through a paged cache."""
    b = ids.shape[0]
    pages = -(-(ids.shape[1] + steps) // page_size)
    cache = paged_cache_for(model, b * pages, page_size, "fp16")
    cache.bind(torch.arange(b * pages, dtype=torch.int32).view(b, pages))
    out = []
    with torch.inference_mode():
        logits = model(ids, cache, 0)
        out.append(logits)
        for i in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, cache, ids.shape[1] + i)
            out.append(logits)
    return out


def assert_same_run(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-4) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert close(g, w, tol), f"step {i}: max |Δ| {float((g - w).abs().max())}"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {name: build_tiny(name, tmp_path_factory.mktemp(name))
            for name in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral_swa", "mixtral",
                         "qwen3_moe", "qwen2_moe", "llama4", "glm4_moe", "gpt_oss", "deepseek_v3", "olmo2")}


def tp_from_dir(d: Path, parts: int, **kw) -> TensorParallelModel:
    return build_tensor_parallel(TensorSource(d), spec_from_config(read_config(d)), ["cpu"] * parts,
                                 torch.float32, **kw)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral_swa", "mixtral",
                                  "qwen3_moe", "qwen2_moe", "llama4", "glm4_moe", "gpt_oss", "deepseek_v3"])
def test_dense_tiny_models_match_unsharded(tiny_dirs, name):
    """Biases, q/k norms, sandwich norms, soft-caps, sliding windows, fused qkv/gate_up (Phi-3); mixtures of
    experts with every routing rule (softmax, Qwen2-MoE's gated shared expert, Llama 4's input-scaled sigmoid,
    GLM-4.5's grouped sigmoid with a score bias and shared expert, gpt-oss's biased router and experts and its
    per-head attention sinks); DeepSeek-V3's latent attention (each shard's heads over a replicated latent cache)."""
    d = tiny_dirs[name]
    ref, tp = load_model(d, "cpu"), tp_from_dir(d, 2)
    assert tp.layers[0].o_mode == "reduce" and isinstance(tp.new_paged_cache(2), ShardedCache)
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert close(tp(ids), ref(ids))
    assert_same_run(paged_run(tp, ids, 6), paged_run(ref, ids, 6))


def test_a_misassigned_share_breaks_the_comparison(tiny_dirs):
    d = tiny_dirs["llama"]
    ref, tp = load_model(d, "cpu"), tp_from_dir(d, 2)
    ids = torch.randint(0, 250, (1, 24), generator=torch.Generator().manual_seed(3))
    mlp = tp.layers[1].mlp
    mlp[0].down_proj, mlp[1].down_proj = mlp[1].down_proj, mlp[0].down_proj
    with torch.inference_mode():
        assert not close(tp(ids), ref(ids), 1e-2)


@pytest.fixture(scope="module")
def synthetic():
    src = DictSource(llama_exl2_tensors(SYNTH, body=MIXED))
    spec = spec_from_config(SYNTH)
    ref = DecoderModel(spec, WeightLoader(src, "cpu", torch.float32, use_kernels=True)).eval()
    return src, spec, ref


@pytest.mark.parametrize("parts", [2, 4])
def test_quantized_model_matches_unsharded(synthetic, parts):
    """A synthetic EXL2 model (every width class, act-order): q/k/v by head, o_proj by columns after a gather,
    down by shares of steps, gate/up by the features those read."""
    src, spec, ref = synthetic
    tp = build_tensor_parallel(src, spec, ["cpu"] * parts, torch.float32, use_kernels=True)
    layer = tp.layers[0]
    assert layer.o_mode == "gather" and all(m.down_proj.kernel is not None for m in layer.mlp)
    assert sum(m.down_proj.in_features for m in layer.mlp) == spec.intermediate_size
    ids = torch.randint(0, 500, (2, 30), generator=torch.Generator().manual_seed(1))
    assert_same_run(paged_run(tp, ids, 5), paged_run(ref, ids, 5))
    # two shards' down shares swapped (each then reads the other's features; the shapes agree) is caught; whole
    # shards swapped would not be wrong (every shard reads the same input, the all-reduce sums them all)
    mlp = tp.layers[1].mlp
    mlp[0].down_proj, mlp[1].down_proj = mlp[1].down_proj, mlp[0].down_proj
    with torch.inference_mode():
        assert not close(tp(ids), ref(ids), 1e-2)


def test_golden_exl2_and_its_dequantized_form(synthetic):
    spec = spec_from_config(read_config(GOLDEN))
    src = TensorSource(GOLDEN)
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512, 3, 17, 64, 128]])
    for kernels in (True, False):
        ref = DecoderModel(spec, WeightLoader(src, "cpu", torch.float32, use_kernels=kernels)).eval()
        tp = build_tensor_parallel(src, spec, ["cpu", "cpu"], torch.float32, use_kernels=kernels)
        assert tp.layers[0].o_mode == ("gather" if kernels else "reduce")
        assert_same_run(paged_run(tp, ids, 4), paged_run(ref, ids, 4))


def test_gptq_model_matches_unsharded():
    from safetensors.torch import load_file

    from test_gptq_model import rtn_gptq

    gen = torch.Generator().manual_seed(0)
    tensors = DictSource()
    for name, t in load_file(GOLDEN.parent / "src" / "model.safetensors").items():
        if t.dim() == 2 and "proj" in name:
            packed = rtn_gptq(t.float().t().contiguous(), 32, 4, True, gen, "gptq")
            tensors.update({f"{name[:-len('.weight')]}.{k}": v for k, v in packed.items()})
        else:
            tensors[name] = t
    spec = spec_from_config(read_config(GOLDEN.parent / "src"))
    ref = DecoderModel(spec, WeightLoader(tensors, "cpu", torch.float32, use_kernels=True)).eval()
    tp = build_tensor_parallel(tensors, spec, ["cpu", "cpu"], torch.float32, use_kernels=True)
    assert tp.layers[0].mlp[0].down_proj.kernel.zeros is not None
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512]])
    assert_same_run(paged_run(tp, ids, 3), paged_run(ref, ids, 3))


def test_dynamic_generator_greedy_tokens_match():
    """The generator builds its cache for whatever model it is given: the sharded one gets one per shard."""
    spec, src = spec_from_config(read_config(GOLDEN)), TensorSource(GOLDEN)
    tok = Tokenizer.from_dir(GOLDEN)
    prompts = ["Hello", "Once upon a time in a land far away", "def fibonacci(n):\n    return"]
    greedy = SamplingSettings(temperature=0)

    def tokens(model):
        gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16)
        return gen, [r.token_ids for r in gen.generate([Job(tok.encode(p), greedy, 10) for p in prompts])]

    ref = DecoderModel(spec, WeightLoader(src, "cpu", torch.float32, use_kernels=True)).eval()
    tp = build_tensor_parallel(src, spec, ["cpu", "cpu"], torch.float32, use_kernels=True)
    gen, got = tokens(tp)
    assert isinstance(gen.cache, ShardedCache) and gen.graphs is None
    assert [c.kv_heads for c in gen.cache.shards] == [1, 1]
    assert got == tokens(ref)[1]


# ---- errors ----------------------------------------------------------------------------------------------------

def test_unsupported_models_and_device_counts(tiny_dirs):
    with pytest.raises(ConfigError, match=r"KV head count \(2\) to be a multiple of 4"):
        tp_from_dir(tiny_dirs["llama"], 4)
    with pytest.raises(ConfigError, match="at least two devices"):
        tp_from_dir(tiny_dirs["llama"], 1)


def test_user_facing_errors(tiny_dirs):
    with pytest.raises(ConfigError, match="needs at least two GPUs, but the GPU split lists one"):
        tensor_parallel_devices([20, 0], 2)
    with pytest.raises(ConfigError, match="only one is visible"):
        tensor_parallel_devices(None, 1)
    assert tensor_parallel_devices([0, 20, 20], 3) == [1, 2] and tensor_parallel_devices("auto", 3) == [0, 1, 2]
    with pytest.raises(ConfigError, match="visible"):
        tensor_parallel_devices([20, 20, 20], 2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA GPUs"):
            load_model(tiny_dirs["llama"], tensor_parallel=True)
    with pytest.raises(ConfigError, match="--device cpu"):
        load_model(tiny_dirs["llama"], "cpu", tensor_parallel=True)
    with pytest.raises(ValueError, match="two GPUs"):
        EngineConfig(model_dir=tiny_dirs["llama"], tensor_parallel=True, gpu_split=[20])
    with pytest.raises(ValueError, match="CUDA"):
        EngineConfig(model_dir=tiny_dirs["llama"], tensor_parallel=True, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_cli_flag_without_cuda_exits_with_one_sentence(tiny_dirs):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "exl2.cli.main", "generate", "-m", str(tiny_dirs["llama"]), "-tp",
                        "-p", "hi"], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "tensor-parallel" in r.stderr


# ---- GPUs ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shards_on_one_gpu_match_unsharded():
    """Two shards both on cuda:0 (host collectives): the Triton kernels on sliced weights, fp16."""
    spec, src = spec_from_config(read_config(GOLDEN)), TensorSource(GOLDEN)
    cuda = torch.device("cuda", 0)
    one = load_model(GOLDEN, "cuda")
    tp = build_tensor_parallel(src, spec, [cuda, cuda], torch.float16)
    assert type(tp.collectives) is Collectives
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512]], device="cuda")
    want, got = paged_run(one, ids, 4), paged_run(tp, ids, 4)
    for g, w in zip(got, want):
        assert float((g - w).abs().max()) <= 0.03 * float(w.max() - w.min())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_collectives_on_one_gpu():
    """The torch.cuda.nccl calls and the all-gather's layout, with one rank (all that one GPU allows)."""
    from exl2.runtime.tp.collectives import NcclCollectives, collectives_for

    d = torch.device("cuda", 0)
    nccl = NcclCollectives([d])
    x = torch.randn(2, 3, 8, device=d, dtype=torch.float16)
    assert torch.equal(nccl.all_reduce([x.clone()])[0], x)
    assert torch.equal(nccl.all_gather([x])[0], x) and torch.equal(nccl.broadcast(x)[0], x)
    assert type(collectives_for([d, d])) is Collectives


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl_match_one_gpu():
    from exl2.runtime.tp.collectives import NcclCollectives

    one = load_model(GOLDEN, "cuda")
    tp = load_model(GOLDEN, gpu_split=[20, 20], tensor_parallel=True)
    assert isinstance(tp, TensorParallelModel) and isinstance(tp.collectives, NcclCollectives)
    assert [m.down_proj.kernel.device for m in tp.layers[0].mlp] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512]], device="cuda:0")
    want, got = paged_run(one, ids, 4), paged_run(tp, ids, 4)
    for g, w in zip(got, want):
        assert g.device == torch.device("cuda", 0)
        assert float((g - w).abs().max()) <= 0.03 * float(w.max() - w.min())
