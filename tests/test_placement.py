"""Multi-GPU layer splitting (runtime.placement, the split DecoderModel, PagedKVCache's layer_devices) on CPU.

The plan is a function of numbers, tested with made-up sizes. The forward over several devices is tested by
planning the golden model onto several "GPUs" that are all the CPU: the model then runs its split path (a run of
layers per planned GPU, hidden state and positions moved at each boundary, RoPE tables and cache metadata per
device), which must give exactly the unsplit model's logits and tokens. The CPU has no second device, so the moves
themselves copy nothing here; tests/test_gpu_split.py covers two real GPUs."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.errors import ConfigError
from exl2.formats.safetensors_io import TensorSource
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.tokenizer import Tokenizer
from exl2.models.registry import read_config, spec_from_config
from exl2.runtime.graphs import DecodeGraphs
from exl2.runtime.loader import build_split, load_model
from exl2.runtime.paged_cache import PagedKVCache
from exl2.runtime.placement import (AUTO_RESERVE, GIB, ModelSizes, model_sizes, parse_gpu_split, plan_split,
                                    split_budgets)

MODEL = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
CPU = torch.device("cpu")
GREEDY = SamplingSettings(temperature=0)
PROMPTS = ["Hello", "Once upon a time in a land far away", "def fibonacci(n):\n    return", "Paris is the capital of"]

# made-up model: 1 GB embedding, six 2 GB layers with 0.5 GB of cache each, 1 GB head
SIZES = ModelSizes(GIB, (2 * GIB,) * 6, GIB, GIB // 2)


# ---- the plan ---------------------------------------------------------------------------------------------------

def test_manual_split_fills_gpus_in_order_within_budgets():
    plan = plan_split(SIZES, split_budgets([6.0, 24.0], [0, 0]))
    # GPU 0: embedding 1 + two layers of 2.5 = 6 GB, exactly its budget; the rest on GPU 1
    assert plan.embed == 0 and plan.layers == (0, 0, 1, 1, 1, 1) and plan.head == 1
    assert plan.used == (6 * GIB, 11 * GIB) and plan.gpus == [0, 1]
    assert plan_split(SIZES, split_budgets([40, 24], [0, 0])).gpus == [0]  # fits the first: one GPU
    # a zero budget skips its GPU (exllamav2's "10.5,0,10.5")
    plan = plan_split(SIZES, split_budgets([5.0, 0, 24.0], [0, 0, 0]))
    assert plan.layers == (0, 2, 2, 2, 2, 2) and plan.used[1] == 0


def test_auto_split_uses_free_memory_less_the_reserve():
    free = [6 * GIB + AUTO_RESERVE, 80 * GIB]
    budgets = split_budgets("auto", free)
    assert budgets == [6 * GIB, 80 * GIB - AUTO_RESERVE]
    assert plan_split(SIZES, budgets).layers == (0, 0, 1, 1, 1, 1)
    assert split_budgets("auto", [AUTO_RESERVE // 2]) == [0]  # less free than the reserve: nothing


def test_too_small_budgets_name_the_shortfall():
    with pytest.raises(ConfigError) as e:
        plan_split(SIZES, split_budgets([4, 4], [0, 0]))
    msg = str(e.value)
    assert "needs 17.00 GB" in msg and "weights 14.00 GB, KV cache 3.00 GB" in msg and "only 8.00 GB" in msg
    # enough in total, but filled in order the head is left over: 13.5 GB on GPU 0, 2.5 GB on GPU 1
    with pytest.raises(ConfigError, match=r"17.00 GB.*18.00 GB available.*the output head \(1.00 GB\) does not fit"):
        plan_split(SIZES, split_budgets([15, 3], [0, 0]))


def test_split_needs_visible_gpus():
    with pytest.raises(ConfigError, match="lists 3 GPUs but only 2 are visible"):
        split_budgets([10, 10, 10], [0, 0])
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        split_budgets("auto", [])
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        split_budgets([20], [])


def test_parse_gpu_split():
    assert parse_gpu_split(None) is None
    assert parse_gpu_split("20,24") == [20.0, 24.0]
    assert parse_gpu_split(" Auto ") == "auto"
    for bad in ("20;24", "x", "", "-1,4", "0,0", "nan"):
        with pytest.raises(ConfigError):
            parse_gpu_split(bad)


def test_model_sizes_from_tensor_headers():
    src = TensorSource(MODEL)
    spec = spec_from_config(read_config(MODEL))
    sizes = model_sizes(src, spec, torch.float16, cache_per_layer=123)
    assert len(sizes.layers) == spec.num_layers and min(sizes.layers) > 0
    assert sizes.embed == spec.vocab_size * spec.hidden_size * 2  # fp16
    assert sizes.head > spec.hidden_size * 2  # final norm + the 6-bit head
    stored = sum(src[k].numel() * src[k].element_size() for k in src.keys() if k.startswith("model.layers.0."))
    assert stored <= sizes.layers[0] <= 2 * stored  # packed as stored, plus expanded scales
    assert sizes.cache == 123 * spec.num_layers


def test_tied_head_counts_a_second_copy(tmp_path):
    from tiny_models import build_tiny

    d = build_tiny("llama_tied", tmp_path)
    sizes = model_sizes(TensorSource(d), spec_from_config(read_config(d)), torch.float32)
    assert sizes.head >= sizes.embed > 0


# ---- wiring -----------------------------------------------------------------------------------------------------

def test_split_without_cuda_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="cannot be combined with --device cpu"):
        load_model(MODEL, "cpu", gpu_split=[1.0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--gpu_split needs CUDA GPUs"):
        load_model(MODEL, gpu_split="auto")
    with pytest.raises(ConfigError, match="--gpu_split needs CUDA GPUs"):
        Engine(EngineConfig(model_dir=MODEL, gpu_split=[1.0, 2.0]))


def test_cli_flag(capsys, monkeypatch):
    from exl2.cli.main import main

    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "-gs GB,GB,...|auto, --gpu_split GB,GB,...|auto, --gpu-split" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "-m", str(MODEL), "-p", "x", "-gs", "20,24"]) == 2
    assert "--gpu_split needs CUDA GPUs" in capsys.readouterr().err
    assert main(["generate", "-m", str(MODEL), "-p", "x", "--gpu-split", "20,x"]) == 2
    assert "--gpu_split takes GB per GPU" in capsys.readouterr().err


def test_decode_graphs_turn_off_for_a_split_model():
    fake = SimpleNamespace(device=torch.device("cuda", 0), is_split=True, prepare_rope=lambda n: None,
                           spec=SimpleNamespace(mrope_section=None))
    cache = SimpleNamespace(page_size=16)
    assert not DecodeGraphs(fake, cache, 4).enabled
    fake.is_split = False
    assert DecodeGraphs(fake, cache, 4).enabled


# ---- the forward over several (CPU) devices ---------------------------------------------------------------------

def split_on_cpu(layers_per_gpu: tuple[int, ...], model_dir: Path = MODEL, dtype=torch.float32, **loader_kw):
    """The golden model planned over len(layers_per_gpu) "GPUs" that are all the CPU, with budgets that put that
    many layers on each (the embedding on the first, the head on the last)."""
    src = TensorSource(model_dir)
    spec = spec_from_config(read_config(model_dir))
    sizes = model_sizes(src, spec, dtype)
    budgets, first = [], 0
    for i, n in enumerate(layers_per_gpu):
        b = sum(sizes.layers[first:first + n]) + (sizes.embed if i == 0 else 0)
        budgets.append(b + (sizes.head if i == len(layers_per_gpu) - 1 else 0))
        first += n
    plan = plan_split(sizes, budgets)
    assert plan.gpus == list(range(len(layers_per_gpu)))
    model = build_split(src, spec, plan, [CPU] * len(layers_per_gpu), dtype, **loader_kw)
    return model, plan


@pytest.fixture(scope="module")
def one():
    return load_model(MODEL, "cpu")


@pytest.fixture(scope="module")
def split():
    return split_on_cpu((1, 2, 1))[0]


def test_split_model_layout(split, one):
    assert split.is_split and not one.is_split
    assert split.layer_devices == [CPU] * 4 and split.device == CPU and one.layer_devices == [CPU] * 4
    assert [(a, b) for _, a, b in split._groups] == [(0, 1), (1, 3), (3, 4)]


def test_split_forward_matches_exactly(split, one):
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512]])
    with torch.inference_mode():
        torch.testing.assert_close(split(ids), one(ids), rtol=0, atol=0)
        ca, cb = one.new_cache(1, 32), split.new_cache(1, 32)
        for start, part in ((0, ids[:, :5]), (5, ids[:, 5:6]), (6, ids[:, 6:])):
            torch.testing.assert_close(split(part, cb, start), one(part, ca, start), rtol=0, atol=0)


def test_rope_tables_are_copied_once_per_device(split):
    q_pos = torch.arange(8).view(1, -1)
    first = split.tables_on(split.rope_tables(q_pos, 8), CPU)
    again = split.tables_on(split.rope_tables(q_pos + 8, 16), CPU)
    assert all(first[k][0] is again[k][0] and first[k][1] is again[k][1] for k in first)


def test_paged_cache_places_layers_and_copies_tables():
    spec = spec_from_config(read_config(MODEL))
    cache = PagedKVCache(spec, 4, 16, "q4", "cpu", torch.float32, layer_devices=["cpu"] * spec.num_layers)
    assert cache.devices == [CPU] and all(k.device == CPU for k in cache.k + cache.k_scales)
    cache.bind(torch.tensor([[0, 1]]))
    assert cache._tables[0].dtype == torch.int32 and cache._tables[0] is cache.block_table
    with pytest.raises(ValueError, match="entries for 4 layers"):
        PagedKVCache(spec, 4, 16, layer_devices=["cpu"])


def _record(model):
    seen = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append(out.clone()))
    return seen, handle


@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_split_dynamic_generator_matches_exactly(split, one, mode):
    """Batched, paged, chunked (page 16, chunk 8 so prompts take several prefill steps): every logit row the
    generator computes and every greedy token equal to the unsplit model's."""
    tok = Tokenizer.from_dir(MODEL)
    runs = []
    for model in (one, split):
        seen, handle = _record(model)
        gen = DynamicGenerator(model, tok, 256, mode, max_batch=3, page_size=16, chunk=8)
        try:
            results = gen.generate([Job(tok.encode(p), GREEDY, 10) for p in PROMPTS])
        finally:
            handle.remove()
        assert gen.cache.layer_devices == model.layer_devices
        runs.append(([r.token_ids for r in results], seen))
    (want_ids, want_logits), (got_ids, got_logits) = runs
    assert got_ids == want_ids and all(len(t) == 10 for t in got_ids)
    assert len(got_logits) == len(want_logits)
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_split_kernel_path_with_split_sums():
    """fp16 and the Triton kernels (interpreted): the fused norm-gather path, and K-split partial sums never routed
    across a device boundary (down of the last layer of each run but the final one loses them)."""
    from exl2.kernels.backend import force_triton, triton_usable

    if not triton_usable():
        pytest.skip("needs Triton (the interpreter on CPU)")
    from exl2.models.decoder import DecoderModel
    from exl2.runtime.weights import WeightLoader

    split, _ = split_on_cpu((2, 2), dtype=torch.float16, use_kernels=True)
    one = DecoderModel(split.spec, WeightLoader(TensorSource(MODEL), "cpu", torch.float16, use_kernels=True)).eval()
    n = one.spec.num_layers
    ids = torch.tensor([[45]])  # one row: the permuted-input (gemv) path, where down splits K
    with torch.no_grad(), force_triton():
        assert one.route_split_sums(True) == 2 * n - 1 and split.route_split_sums(True) == 2 * n - 2
        routed = split(ids)
        split.route_split_sums(False), one.route_split_sums(False)
        plain = one(ids)
        torch.testing.assert_close(split(ids), plain, rtol=0, atol=0)
    assert (routed - plain).abs().max() <= 1e-2 * plain.abs().max()
