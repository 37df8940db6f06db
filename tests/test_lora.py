"""LoRA adapters (PEFT format) applied at runtime: the model with an adapter active gives the logits of a copy with
`scale · B · A` merged into its dense weights; the permuted-input paths of the GPU give the delta of the plain one;
unsupported adapters stop with one sentence."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2.errors import ConfigError, ModelLoadError
from exl2.formats.safetensors_io import TensorSource
from exl2.kernels import permute, qweight
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.kernels.split_sum import SplitSum
from exl2.models.decoder import DecoderModel
from exl2.models.registry import read_config, spec_from_config
from exl2.runtime.linear import Linear, LoraWeights, lora_delta, permute_lora_a, project, with_loras
from exl2.runtime.loader import load_model
from exl2.runtime.lora import LoraAdapter, active_loras, set_loras
from exl2.runtime.weights import WeightLoader

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
# the golden tiny Llama: hidden 256, 4 heads of 64, 2 KV heads, intermediate 768, 4 layers
SHAPES = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (256, 128), "self_attn.v_proj": (256, 128),
          "self_attn.o_proj": (256, 256), "mlp.gate_proj": (256, 768), "mlp.up_proj": (256, 768),
          "mlp.down_proj": (768, 256)}
ALL = [f"model.layers.{i}.{n}" for i in range(4) for n in SHAPES]


def _shape(module: str) -> tuple[int, int]:
    return SHAPES[module.split(".", 3)[3]]


def make_adapter(d: Path, modules, r: int = 4, alpha: float = 8.0, seed: int = 0, shape=_shape, **cfg) -> Path:
    """A random PEFT adapter directory over `modules` (HF module paths); B is random, not PEFT's zeros."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for m in modules:
        fin, fout = shape(m)
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(r, fin, generator=g) * 0.05
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.05
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, d / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}
    config.update(cfg)
    (d / "adapter_config.json").write_text(json.dumps(config))
    return d


def merged(model: DecoderModel, adapters: list[tuple[Path, float]], rows=None) -> DecoderModel:
    """A deep copy of the dense CPU model with `scale · B @ A` of each (adapter dir, scale) added to the weights;
    `rows(hf_module)` lists (module name in the model, first row, end row), by default the same name unsplit."""
    ref = copy.deepcopy(model)
    set_loras(ref, [])
    mods = dict(ref.named_modules())
    for d, scale in adapters:
        t = load_file(str(d / "adapter_model.safetensors"))
        for key, a in t.items():
            if ".lora_A." not in key:
                continue
            b = t[key.replace(".lora_A.", ".lora_B.")]
            hf = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            for name, start, end in (rows(hf) if rows else [(hf.removeprefix("model."), 0, b.shape[0])]):
                mods[name].weight += scale * b[start:end] @ a
    return ref


def close(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert (y - ref).abs().max() <= rel * ref.abs().max()


def one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg.endswith(".") and "\n" not in msg and not re.search(r"[.!?]\s+[A-Z]", msg), msg
    return msg


@pytest.fixture(scope="module")
def model():
    m = load_model(GOLDEN, "cpu").eval()
    assert m.dtype == torch.float32
    return m


@pytest.fixture
def lora_model(model):
    yield model
    set_loras(model, [])


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def base_logits(model, ids):
    with torch.no_grad():
        return model(ids)


# ------------------------------------------------------------------------------------------ merged weights
def test_every_projection_matches_merged_weights(lora_model, ids, base_logits, tmp_path):
    d = make_adapter(tmp_path / "all", ALL)
    ad = LoraAdapter.from_dir(d, lora_model)
    assert (ad.name, ad.path, ad.rank, ad.alpha, ad.scaling, ad.targets) == ("all", d, 4, 8.0, 1.0, len(ALL))
    set_loras(lora_model, [ad])
    assert active_loras(lora_model) == [ad]
    with torch.no_grad():
        got, ref = lora_model(ids), merged(lora_model, [(d, 8.0 / 4)])(ids)
    close(got, ref)
    assert (got - base_logits).abs().max() > 0.05 * base_logits.abs().max()  # the delta matters


def test_a_subset_matches_merged_weights(lora_model, ids, tmp_path):
    mods = ["model.layers.0.self_attn.q_proj", "model.layers.2.self_attn.v_proj", "model.layers.3.mlp.down_proj",
            "model.layers.1.mlp.up_proj"]
    d = make_adapter(tmp_path / "some", mods, r=8, alpha=16)
    ad = LoraAdapter.from_dir(d, lora_model)
    assert ad.targets == 4
    set_loras(lora_model, [ad])
    touched = {n for n, m in lora_model.named_modules() if isinstance(m, Linear) and m.loras}
    assert touched == {m.removeprefix("model.") for m in mods}
    with torch.no_grad():
        close(lora_model(ids), merged(lora_model, [(d, 2.0)])(ids))


def test_two_adapters_add_and_clearing_restores_the_logits_exactly(lora_model, ids, base_logits, tmp_path):
    d1 = make_adapter(tmp_path / "one", ALL[:14], seed=1)
    d2 = make_adapter(tmp_path / "two", ALL[7:], r=2, alpha=4, seed=2)
    a1, a2 = LoraAdapter.from_dir(d1, lora_model), LoraAdapter.from_dir(d2, lora_model)
    set_loras(lora_model, [a1, a2])
    assert active_loras(lora_model) == [a1, a2]
    with torch.no_grad():
        close(lora_model(ids), merged(lora_model, [(d1, 2.0), (d2, 2.0)])(ids))
        set_loras(lora_model, [a2])  # exactly these: a1 goes
        close(lora_model(ids), merged(lora_model, [(d2, 2.0)])(ids))
        set_loras(lora_model, [])
        assert active_loras(lora_model) == []
        assert not any(m.loras for m in lora_model.modules() if isinstance(m, Linear))
        assert torch.equal(lora_model(ids), base_logits)
    with pytest.raises(ConfigError):
        set_loras(lora_model, [a1, a1])


def test_rslora_and_user_scaling_change_the_scale(lora_model, ids, tmp_path):
    mods = ALL[::3]
    d = make_adapter(tmp_path / "rs", mods, r=16, alpha=8, use_rslora=True)
    set_loras(lora_model, [LoraAdapter.from_dir(d, lora_model)])
    with torch.no_grad():
        got = lora_model(ids)
        close(got, merged(lora_model, [(d, 8.0 / 16 ** 0.5)])(ids))
        assert not torch.allclose(got, merged(lora_model, [(d, 8.0 / 16)])(ids), rtol=0, atol=1e-3)
        half = LoraAdapter.from_dir(d, lora_model, scaling=0.5)
        assert half.scaling == 0.5
        set_loras(lora_model, [half])
        close(lora_model(ids), merged(lora_model, [(d, 0.5 * 8.0 / 16 ** 0.5)])(ids))


def test_lora_on_a_quantized_model_uses_the_kernel_twins(ids, tmp_path):
    """Quantized linears (QuantWeight kernels, their PyTorch twins on the CPU) add the delta too: the same as
    the dense dequantized model with the adapter."""
    spec = spec_from_config(read_config(GOLDEN))
    q = DecoderModel(spec, WeightLoader(TensorSource(GOLDEN), "cpu", torch.float32, use_kernels=True)).eval()
    dense = load_model(GOLDEN, "cpu").eval()
    d = make_adapter(tmp_path / "q", ALL)
    set_loras(q, [LoraAdapter.from_dir(d, q)])
    set_loras(dense, [LoraAdapter.from_dir(d, dense)])
    assert all(lw.a_perm is not None for m in q.modules() if isinstance(m, Linear) for lw in m.loras)
    with torch.no_grad():
        close(q(ids), dense(ids), 1e-3)


# ------------------------------------------------------------------------------------------ permuted paths
def test_delta_from_a_permuted_input_equals_the_delta_from_x():
    """A quantized layer's permuted input `xp[:, p] = x[:, idx[p]]` (0 where idx < 0, padding makes it wider
    than in): xp · A[:, idx]ᵀ · Bᵀ = x · Aᵀ · Bᵀ, also for each order of a buffer holding several side by
    side."""
    g = torch.Generator().manual_seed(0)
    k, r, n = 40, 3, 24
    x = torch.randn(5, k, generator=g, dtype=torch.float64)
    lw = LoraWeights(torch.randn(r, k, generator=g, dtype=torch.float64),
                     torch.randn(n, r, generator=g, dtype=torch.float64))
    ref = lora_delta(x, [lw])
    assert torch.allclose(ref, x @ lw.a.t() @ lw.b.t())
    orders = [torch.cat([torch.randperm(k, generator=g), torch.full((8,), -1)])[torch.randperm(k + 8, generator=g)],
              torch.randperm(k, generator=g)]
    buf = torch.cat([permute.take_columns(x, idx.int()) for idx in orders], dim=1)  # [5, 48 + 40]
    offset = 0
    for idx in orders:
        view = buf[:, offset:offset + idx.numel()]
        offset += idx.numel()
        perm = LoraWeights(lw.a, lw.b, permute_lora_a(lw.a, idx.int()))
        assert perm.a_perm.shape == (r, idx.numel())
        assert torch.allclose(lora_delta(view, [perm], permuted=True), ref)
    two = [lw, LoraWeights(lw.a * 2, lw.b)]
    assert torch.allclose(lora_delta(x, two), 3 * ref)


def _kernel_linears(n_out=(64, 32), seed=0):
    """Quantized linears (random 4-bit codes, an act-order permutation) reading one 256-wide input."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(256, generator=g)
    out = []
    for n in n_out:
        codes = torch.randint(0, 16, (256, n), generator=g).to(torch.uint8)
        w = qweight.build(codes, [(4, 256)], (torch.rand(1, n, generator=g) * 0.01 + 0.001).half(), None, perm,
                          None)
        out.append(Linear(w.k, w.n, kernel=w))
    return out


def _attach(lin: Linear, r: int, seed: int, dtype=torch.float32) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(r, lin.in_features, generator=g) * 0.1).to(dtype)
    lw = LoraWeights(a, (torch.randn(lin.out_features, r, generator=g) * 0.1).to(dtype),
                     permute_lora_a(a, lin.kernel.x_index))
    lin.loras = [lw]
    return lw


def test_forward_permuted_adds_the_delta_and_leaves_no_partial_sums():
    lin = _kernel_linears((64,))[0]
    x = torch.randn(3, 256)
    plain = lin(x)
    lw = _attach(lin, 4, 1)
    lin.split_sum = True  # a LoRA layer keeps its whole output whatever the routing says
    xp = permute.gather_input(x, [lin.kernel])[0]
    y = lin.forward_permuted(xp, (1, 3))
    assert isinstance(y, torch.Tensor) and not isinstance(y, SplitSum) and y.shape == (1, 3, 64)
    close(y[0], plain + (x @ lw.a.t()) @ lw.b.t(), 1e-5)
    close(y[0], lin(x), 1e-5)


def test_project_paths_that_bypass_forward_add_the_deltas():
    lins = _kernel_linears()
    x = torch.randn(2, 1, 256)
    base = project(x, lins)
    lws = [_attach(m, 2 + i, i) for i, m in enumerate(lins)]
    outs = with_loras(x, lins, base)
    for y, y0, lw in zip(outs, base, lws):
        close(y, y0 + x @ lw.a.t() @ lw.b.t(), 1e-5)
    for y, y2 in zip(project(x, lins), outs):
        close(y, y2, 1e-5)


needs_triton = pytest.mark.skipif(not (INTERPRET and triton_usable()), reason="needs TRITON_INTERPRET=1")


@needs_triton
def test_project_grouped_path_adds_the_deltas_under_the_interpreter():
    lins = _kernel_linears()
    x = torch.randn(1, 256).half()
    for m in lins:
        _attach(m, 4, lins.index(m), torch.float16)
    want = [m(x) for m in lins]  # the twin: Linear.forward
    with force_triton():
        got = project(x, lins)
        buf = permute.gather_input(x, [m.kernel for m in lins], whole=True)
        from_buf = project(x, lins, buf)
    for y, y2, ref in zip(got, from_buf, want):
        close(y.float(), ref.float(), 5e-3)
        close(y2.float(), ref.float(), 5e-3)


@needs_triton
def test_quantized_decoder_with_lora_on_the_kernel_paths(tmp_path, monkeypatch):
    """The golden model with its kernels under the interpreter (norm-gather → grouped q/k/v and gate/up, GLU →
    down's permuted input, attention → o_proj's permuted input with a cache): the twins' logits, and no partial
    sums while the adapter is active even where routing was asked for."""
    import exl2.runtime.linear as linear_mod
    from exl2.kernels import quant_matmul as qm

    spec = spec_from_config(read_config(GOLDEN))
    model = DecoderModel(spec, WeightLoader(TensorSource(GOLDEN), "cpu", torch.float16, use_kernels=True)).eval()
    ad = LoraAdapter.from_dir(make_adapter(tmp_path / "k", ALL), model)
    set_loras(model, [ad])
    assert not any(m.split_sum for m in model.modules() if isinstance(m, Linear))
    made, calls = [], []
    real = qm.permuted_matmul

    def counting(xp, w, split_sum=False):
        y = real(xp, w, split_sum)
        made.append(isinstance(y, SplitSum))
        return y
    monkeypatch.setattr(linear_mod, "permuted_matmul", counting)
    real_perm = linear_mod.lora_delta

    def spying(x, loras, permuted=False):
        calls.append(permuted)
        return real_perm(x, loras, permuted)
    monkeypatch.setattr(linear_mod, "lora_delta", spying)
    ids = torch.tensor([[45]])
    with torch.no_grad():
        want = model(ids, model.new_cache(1, 8))
        model.route_split_sums(True)
        with force_triton():
            got = model(ids, model.new_cache(1, 8))
    assert made and not any(made)
    assert calls.count(True) == 2 * spec.num_layers  # o_proj and down read their permuted inputs
    close(got.float(), want.float(), 2e-2)
    set_loras(model, [])


# ------------------------------------------------------------------------------------------ Phi-3 fused
def test_phi3_fused_projections_split_their_b_rows(tmp_path):
    from tiny_models import build_tiny

    d = build_tiny("phi3", tmp_path / "phi3")
    model = load_model(d, "cpu").eval()
    # hidden 64, 4 heads and 2 KV heads of 16: qkv_proj 64 → 64 + 32 + 32, gate_up_proj 64 → 128 + 128
    fused = {"self_attn.qkv_proj": (64, 128, [("self_attn.q_proj", 0, 64), ("self_attn.k_proj", 64, 96),
                                               ("self_attn.v_proj", 96, 128)]),
             "mlp.gate_up_proj": (64, 256, [("mlp.gate_proj", 0, 128), ("mlp.up_proj", 128, 256)]),
             "self_attn.o_proj": (64, 64, [("self_attn.o_proj", 0, 64)])}
    mods = [f"model.layers.{i}.{n}" for i in range(2) for n in fused]

    def shape(m):
        return fused[m.split(".", 3)[3]][:2]

    def rows(m):
        layer, name = m.split(".")[2], m.split(".", 3)[3]
        return [(f"layers.{layer}.{part}", s, e) for part, s, e in fused[name][2]]
    ad_dir = make_adapter(tmp_path / "phi3_lora", mods, r=4, alpha=4, shape=shape)
    ad = LoraAdapter.from_dir(ad_dir, model)
    assert ad.targets == 2 * (3 + 2 + 1)
    set_loras(model, [ad])
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(model(ids), merged(model, [(ad_dir, 1.0)], rows)(ids))


# ------------------------------------------------------------------------------------------ errors
def test_unsupported_adapters_stop_with_one_sentence(model, tmp_path):
    q = ["model.layers.0.self_attn.q_proj"]
    cases = []

    d = make_adapter(tmp_path / "fifo", q, fan_in_fan_out=True)
    cases.append((d, ConfigError, "fan_in_fan_out"))

    d = make_adapter(tmp_path / "bin", q)
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    cases.append((d, ModelLoadError, "safetensors"))

    d = make_adapter(tmp_path / "missing", ["model.layers.9.self_attn.q_proj"], shape=lambda m: (256, 256))
    cases.append((d, ConfigError, "model.layers.9.self_attn.q_proj"))

    d = make_adapter(tmp_path / "shape", q, shape=lambda m: (256, 128))
    cases.append((d, ConfigError, "model.layers.0.self_attn.q_proj"))

    d = make_adapter(tmp_path / "head", ["lm_head"], shape=lambda m: (256, 1024))
    cases.append((d, ConfigError, "lm_head"))

    d = make_adapter(tmp_path / "embed", q)
    t = load_file(str(d / "adapter_model.safetensors"))
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 1024)
    t["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.zeros(256, 4)
    save_file(t, d / "adapter_model.safetensors")
    cases.append((d, ConfigError, "lora_embedding_A"))

    d = make_adapter(tmp_path / "bias", q, bias="lora_only")
    t = load_file(str(d / "adapter_model.safetensors"))
    t["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.ones(256)
    save_file(t, d / "adapter_model.safetensors")
    cases.append((d, ConfigError, "bias"))

    cases.append((make_adapter(tmp_path / "mts", q, modules_to_save=["lm_head"]), ConfigError, "lm_head"))
    cases.append((tmp_path / "nowhere", ModelLoadError, "nowhere"))
    empty = make_adapter(tmp_path / "empty", [])
    cases.append((empty, ConfigError, "empty"))

    for d, cls, word in cases:
        with pytest.raises(cls) as e:
            LoraAdapter.from_dir(d, model)
        assert word in one_sentence(e), (d, str(e.value))


def test_zero_bias_tensors_are_accepted(model, tmp_path):
    d = make_adapter(tmp_path / "zb", ["model.layers.0.self_attn.q_proj"], bias="all")
    t = load_file(str(d / "adapter_model.safetensors"))
    t["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(256)
    save_file(t, d / "adapter_model.safetensors")
    assert LoraAdapter.from_dir(d, model).targets == 1


def test_lora_on_moe_experts_equals_merged_weights(tmp_path):
    """An adapter over MoE experts (PEFT's per-expert paths, with the shared expert and attention too) gives the
    logits of the model with `scale · B @ A` merged into those experts' weights; a module the model lacks is a
    one-sentence error."""
    from tiny_models import build_tiny

    from exl2.runtime.lora import _linear_index

    moe = load_model(build_tiny("qwen2_moe", tmp_path / "moe"), "cpu")
    index = _linear_index(moe)
    shapes = {"gate_proj": (64, 32), "up_proj": (64, 32), "down_proj": (32, 64), "q_proj": (64, 64)}
    mods = ["model.layers.0.mlp.experts.3.gate_proj", "model.layers.0.mlp.experts.3.down_proj",
            "model.layers.2.mlp.experts.5.up_proj", "model.layers.0.self_attn.q_proj",
            "model.layers.2.mlp.shared_expert.gate_proj"]
    d = make_adapter(tmp_path / "expert", mods,
                     shape=lambda m: (64, 64) if "shared" in m else shapes[m.rsplit(".", 1)[-1]])
    adapter = LoraAdapter.from_dir(d, moe, scaling=0.7)
    assert adapter.targets == len(mods)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = merged(moe, [(d, 0.7 * 8.0 / 4)], rows=lambda hf: [(n, s, e) for n, _, s, e in index[hf]])
    set_loras(moe, [adapter])
    with torch.no_grad():
        got, want = moe(ids), ref(ids)
    close(got, want)
    set_loras(moe, [])
    with torch.no_grad():
        assert (moe(ids) - want).abs().max() > 1e-3 * want.abs().max()   # the adapter changed the logits
    bad = make_adapter(tmp_path / "bad", ["model.layers.0.mlp.experts.9.gate_proj"], shape=lambda m: (64, 32))
    with pytest.raises(ConfigError) as e:
        LoraAdapter.from_dir(bad, moe)
    assert "does not have" in one_sentence(e)


def test_tensor_parallel_models_are_refused(model, tmp_path):
    from exl2.runtime.tp.model import build_tensor_parallel

    ad = LoraAdapter.from_dir(make_adapter(tmp_path / "tp", ALL[:2]), model)
    tp = build_tensor_parallel(TensorSource(GOLDEN), spec_from_config(read_config(GOLDEN)), ["cpu", "cpu"],
                               torch.float32)
    with pytest.raises(ConfigError) as e:
        LoraAdapter.from_dir(ad.path, tp)
    assert "tensor-parallel" in one_sentence(e)
    with pytest.raises(ConfigError) as e:
        set_loras(tp, [ad])
    assert "tensor-parallel" in one_sentence(e)
    set_loras(tp, [])  # nothing to clear: allowed
