"""Multi-GPU layer splitting on CUDA (`pytest -m gpu`): the golden model over two GPUs against one GPU; on a
single GPU, the split path with every planned GPU being cuda:0 (Triton launches under the device scopes, the
cache's per-device tables, eager decoding) and one-GPU plans."""
import pytest
import torch

from exl2.config import SamplingSettings
from exl2.errors import ConfigError
from exl2.formats.safetensors_io import TensorSource
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.tokenizer import Tokenizer
from exl2.models.registry import read_config, spec_from_config
from exl2.runtime.loader import PAGE_SIZE, build_split, load_model
from exl2.runtime.paged_cache import layer_bytes_per_token
from exl2.runtime.placement import GIB, Plan, model_sizes

from test_exl2_model import GOLDEN

MODEL = GOLDEN / "b4.0_hb6"
GREEDY = SamplingSettings(temperature=0)
PROMPTS = ["Hello", "Once upon a time in a land far away", "def fibonacci(n):\n    return", "Paris is the capital of",
           "The rain in Spain stays mainly in the plain, they say, and the snow in"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
pytestmark = [pytest.mark.gpu, needs_cuda]
CACHE_TOKENS = 512


def greedy_tokens(model, max_batch: int = 4) -> list[list[int]]:
    tok = Tokenizer.from_dir(MODEL)
    gen = DynamicGenerator(model, tok, 512, max_batch=max_batch, page_size=16)
    return [r.token_ids for r in gen.generate([Job(tok.encode(p), GREEDY, 24) for p in PROMPTS])]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def first_gpu_gb(layers: int) -> float:
    """A GPU 0 budget that holds the embedding and `layers` decoder layers (with their cache), not one more."""
    spec = spec_from_config(read_config(MODEL))
    per_layer = (-(-CACHE_TOKENS // PAGE_SIZE) + 1) * PAGE_SIZE * layer_bytes_per_token(spec, "fp16", 2)
    s = model_sizes(TensorSource(MODEL), spec, torch.float16, int(per_layer))
    return (s.embed + sum(s.layers[:layers]) + layers * s.cache_per_layer + s.layers[layers] // 2) / GIB


@needs_two
def test_split_over_two_gpus_matches_one_gpu():
    """Tolerance as in test_gpu_e2e: the one-GPU model decodes through CUDA graphs with K-split sums across every
    layer, the split one eagerly without them at the boundary (fp16 rounding), so ≥ 90 % of greedy tokens equal."""
    one = load_model(MODEL, "cuda")
    split = load_model(MODEL, gpu_split=[first_gpu_gb(2), 20], cache_tokens=CACHE_TOKENS)
    c0, c1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert split.is_split and split.layer_devices == [c0, c0, c1, c1]
    assert split.device == c0 and split.head_device == c1 and torch.cuda.current_device() == 0
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512]], device="cuda")
    with torch.inference_mode():
        got, want = split(ids), one(ids)
    assert got.device == c0
    assert (got - want).abs().max() <= 0.03 * (want.max() - want.min())
    tok = Tokenizer.from_dir(MODEL)
    gen = DynamicGenerator(split, tok, 512, max_batch=4, page_size=16)
    assert [k.device for k in gen.cache.k] == split.layer_devices and not gen.graphs.enabled
    assert agreement(greedy_tokens(split), greedy_tokens(one)) >= 0.9


@needs_two
def test_auto_split_and_a_one_gpu_plan_off_gpu_0():
    tiny = load_model(MODEL, gpu_split="auto", cache_tokens=CACHE_TOKENS)  # fits GPU 0: loaded as unsplit
    assert not tiny.is_split and tiny.device == torch.device("cuda", 0)
    try:
        off = load_model(MODEL, gpu_split=[0, 20], cache_tokens=CACHE_TOKENS)
        assert not off.is_split and off.device == torch.device("cuda", 1) and torch.cuda.current_device() == 1
        assert agreement(greedy_tokens(off), greedy_tokens(tiny)) >= 0.9
    finally:
        torch.cuda.set_device(0)
    with pytest.raises(ConfigError, match="visible"):
        load_model(MODEL, gpu_split=[1] * (torch.cuda.device_count() + 1))


def test_split_path_on_one_gpu_matches_unsplit():
    """Two planned "GPUs" that are both cuda:0: the split forward with its device scopes, per-device positions
    and tables, the cache noting each copy, and eager decoding, against the same weights unsplit (graphs)."""
    src, spec = TensorSource(MODEL), spec_from_config(read_config(MODEL))
    cuda = torch.device("cuda", 0)
    split = build_split(src, spec, Plan(0, (0, 0, 1, 1), 1, (0, 0)), [cuda, cuda], torch.float16)
    split.route_split_sums(False)
    one = load_model(MODEL, "cuda")
    one.route_split_sums(False)
    assert split.is_split and split.layer_devices == [cuda] * 4
    ids = torch.tensor([[1, 5, 9, 300, 42, 7, 99, 512]], device="cuda")
    with torch.inference_mode():
        torch.testing.assert_close(split(ids), one(ids), rtol=0, atol=0)
    assert agreement(greedy_tokens(split), greedy_tokens(one)) >= 0.9


def test_one_gpu_plans_load_unsplit():
    model = load_model(MODEL, gpu_split=[20], cache_tokens=CACHE_TOKENS)
    assert not model.is_split and model.device == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="needs .* GB"):
        load_model(MODEL, gpu_split=[0.001], cache_tokens=CACHE_TOKENS)
    assert not load_model(MODEL, gpu_split="auto").is_split
