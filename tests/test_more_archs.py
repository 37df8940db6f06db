"""Gemma 1, Granite 3.x, Command-R (Cohere), Command R7B (Cohere2), GLM-4 and GLM-4-0414 and Mistral 3 (text only):
what the parity fixtures (test_decoder_parity: `gemma`, `granite`, `cohere`, `cohere_qk_norm`, `cohere2`, `glm`,
`glm4`, `mistral3`) do not show. Published config.json files read into the right spec, the paged cache (RoPE applied
while storing keys, interleaved for Cohere and GLM, on the sliding layers only for Cohere2) matches the contiguous one,
the float16 CPU path stays near the float32 reference, a multimodal checkpoint's weights load under either layout,
GLM and Cohere convert to EXL2, and GLM, Cohere and Granite shard for tensor parallelism."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import build_tiny, reference_logits

from exl2.errors import ConfigError
from exl2.formats.safetensors_io import TensorSource
from exl2.models.registry import spec_from_config
from exl2.runtime.loader import load_model
from exl2.runtime.paged_cache import PagedKVCache
from exl2.runtime.tp.model import build_tensor_parallel

NEW = ["gemma", "granite", "cohere", "cohere_qk_norm", "mistral3", "cohere2", "glm", "glm4"]

GEMMA_2B = {  # google/gemma-2b (transformers 4.38 layout)
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1,
    "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 16384,
    "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8, "num_hidden_layers": 18,
    "num_key_value_heads": 1, "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
    "vocab_size": 256000,
}
GRANITE_8B = {  # ibm-granite/granite-3.1-8b-instruct
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_multiplier": 0.0078125,
    "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12800, "logits_scaling": 16.0, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "granite", "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
    "tie_word_embeddings": True, "vocab_size": 49155,
}
COMMAND_R = {  # CohereForAI/c4ai-command-r-v01 (no tie_word_embeddings key: tied)
    "architectures": ["CohereForCausalLM"], "attention_bias": False, "bos_token_id": 5, "eos_token_id": 255001,
    "hidden_act": "silu", "hidden_size": 8192, "intermediate_size": 22528, "layer_norm_eps": 1e-05,
    "logit_scale": 0.0625, "max_position_embeddings": 8192, "model_type": "cohere", "num_attention_heads": 64,
    "num_hidden_layers": 40, "num_key_value_heads": 64, "pad_token_id": 0, "rope_theta": 8000000.0,
    "use_qk_norm": False, "vocab_size": 256000,
}
COMMAND_R7B = {  # CohereLabs/c4ai-command-r7b-12-2024 (keys transformers does not read left out)
    "architectures": ["Cohere2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 5,
    "eos_token_id": 255001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "layer_norm_eps": 1e-05, "logit_scale": 0.25, "max_position_embeddings": 132096, "model_type": "cohere2",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pad_token_id": 0,
    "rope_scaling": None, "rope_theta": 50000, "sliding_window": 4096, "sliding_window_pattern": 4,
    "vocab_size": 256000,
}
GLM4_32B = {  # THUDM/GLM-4-32B-0414
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 6144,
    "intermediate_size": 23040, "max_position_embeddings": 32768, "model_type": "glm4", "num_attention_heads": 48,
    "num_hidden_layers": 61, "num_key_value_heads": 2, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 151552,
}
GLM4_9B_CHAT = {  # THUDM/glm-4-9b-chat-hf
    "architectures": ["GlmForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 13696, "max_position_embeddings": 131072, "model_type": "glm", "num_attention_heads": 32,
    "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1.5625e-07, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 151552,
}
MISTRAL_SMALL_31 = {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503 (vision_config shortened)
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {
        "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 32768, "max_position_embeddings": 131072, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072,
    },
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "num_hidden_layers": 24},
    "vision_feature_layer": -1,
}


def test_gemma1_published_config():
    """hidden_act "gelu" without hidden_activation runs the tanh GELU Gemma was trained with (transformers 4.38+,
    exllamav2); global attention, plain pre-norm blocks, no soft-caps, (1 + w) norms, embeddings x sqrt(H), tied."""
    s = spec_from_config(GEMMA_2B)
    assert (s.activation, s.head_dim, s.num_kv_heads, s.norm_offset) == ("gelu_tanh", 256, 1, 1.0)
    assert s.embed_scale == pytest.approx(2048 ** 0.5) and s.tie_embeddings and s.eos_token_ids == (1,)
    assert not s.sandwich_norm and s.attn_scale is None and s.attn_softcap is None and s.final_softcap is None
    assert all(layer.sliding_window is None for layer in s.layers) and s.rope.theta == 10000.0
    assert spec_from_config({**GEMMA_2B, "hidden_activation": "gelu"}).activation == "gelu"  # explicit legacy
    no_head_dim = {k: v for k, v in GEMMA_2B.items() if k != "head_dim"}
    assert spec_from_config(no_head_dim).head_dim == 256  # GemmaConfig's default, not H/nh


def test_granite_published_config():
    s = spec_from_config(GRANITE_8B)
    assert (s.embed_scale, s.attn_scale, s.residual_scale, s.logit_scale) == (12.0, 0.0078125, 0.22, 1 / 16)
    assert s.head_dim == 128 and s.rope.theta == 1e7 and s.tie_embeddings and s.norm_type == "rms"
    plain = spec_from_config({k: v for k, v in GRANITE_8B.items() if "multiplier" not in k and k != "logits_scaling"})
    assert (plain.embed_scale, plain.attn_scale, plain.residual_scale, plain.logit_scale) == (1.0, 1.0, 1.0, 1.0)


def test_command_r_published_config():
    s = spec_from_config(COMMAND_R)
    assert (s.norm_type, s.parallel_block, s.norm_eps, s.logit_scale) == ("layernorm", True, 1e-5, 0.0625)
    assert s.rope.interleaved and s.rope.theta == 8e6 and s.tie_embeddings and not s.qk_norm
    assert not s.qkv_bias and not s.o_bias and s.head_dim == 128 and s.eos_token_ids == (255001,)
    plus = spec_from_config({**COMMAND_R, "use_qk_norm": True, "logit_scale": 0.8333333333333334})
    assert plus.qk_norm and plus.logit_scale == pytest.approx(0.8333333333333334)


def _hf_config(cfg: dict):
    """transformers' own config object for config.json `cfg`."""
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def _cohere2_layers_of(hf) -> list[tuple]:
    """(window, RoPE) per layer as transformers' Cohere2Attention runs it: rotated exactly where it slides."""
    return [(hf.sliding_window, True) if t == "sliding_attention" and hf.sliding_window is not None else (None, False)
            for t in hf.layer_types]


def test_command_r7b_published_config():
    """Every 4th layer (sliding_window_pattern 4) is global and NoPE, the others slide over 4096 keys and rotate;
    Command-R's LayerNorm, parallel blocks, interleaved RoPE and tied head otherwise."""
    s = spec_from_config(COMMAND_R7B)
    assert [(layer.sliding_window, layer.use_rope) for layer in s.layers] == _cohere2_layers_of(_hf_config(COMMAND_R7B))
    assert [layer.sliding_window for layer in s.layers[:4]] == [4096, 4096, 4096, None]
    assert (s.norm_type, s.parallel_block, s.norm_eps, s.logit_scale, s.head_dim) == ("layernorm", True, 1e-5, 0.25,
                                                                                       128)
    assert s.rope.interleaved and s.rope.theta == 50000 and s.rope.dim == 128 and s.tie_embeddings
    assert not s.qk_norm and not s.qkv_bias and s.num_kv_heads == 8 and s.eos_token_ids == (255001,)


@pytest.mark.parametrize("change", [
    {"layer_types": ["full_attention", "sliding_attention"] * 16},   # wins over sliding_window_pattern
    {"sliding_window_pattern": 3},
    {"sliding_window_pattern": None, "sliding_window": None, "rope_theta": None, "max_position_embeddings": None},
], ids=["layer_types", "pattern_3", "defaults"])
def test_cohere2_layer_rules_follow_transformers(change):
    """Windows, RoPE layers, theta and context as transformers' Cohere2Config reads them (None: the key left out;
    its defaults: window 4096, pattern 4, theta 1e4, 8192 positions)."""
    cfg = {k: v for k, v in {**COMMAND_R7B, **change}.items() if v is not None}
    s, hf = spec_from_config(cfg), _hf_config(cfg)
    assert [(layer.sliding_window, layer.use_rope) for layer in s.layers] == _cohere2_layers_of(hf)
    assert s.rope.theta == hf.rope_parameters["rope_theta"] and s.max_position == hf.max_position_embeddings


@pytest.mark.parametrize("cfg", [GLM4_32B, GLM4_9B_CHAT], ids=["GLM-4-32B-0414", "glm-4-9b-chat-hf"])
def test_glm_published_configs(cfg):
    """RoPE on the first half of each head (64 of 128 dims) in GPT-J pairs, q/k/v biases without an o bias, untied;
    GLM-4-0414 adds the post-attention and post-MLP norms under its own tensor names."""
    s, hf = spec_from_config(cfg), _hf_config(cfg)
    assert (s.rope.dim, s.rope.interleaved, s.rope.theta) == (64, True, hf.rope_parameters["rope_theta"])
    assert (s.head_dim, s.num_kv_heads, s.norm_eps, s.norm_type) == (128, 2, hf.rms_norm_eps, "rms")
    assert s.qkv_bias and not s.o_bias and not s.mlp_bias and not s.tie_embeddings and not s.parallel_block
    assert s.eos_token_ids == tuple(hf.eos_token_id) and s.max_position == hf.max_position_embeddings
    glm4 = cfg["architectures"] == ["Glm4ForCausalLM"]
    assert s.sandwich_norm == glm4 and s.sandwich_names == (
        "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


@pytest.mark.parametrize("arch,model_type", [("GlmForCausalLM", "glm"), ("Glm4ForCausalLM", "glm4")])
def test_glm_defaults_are_transformers(arch, model_type):
    """A config.json that leaves the GLM keys out gets GlmConfig's / Glm4Config's values, not the Llama ones."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    cfg = {"architectures": [arch], "model_type": model_type, **{k: GLM4_32B[k] for k in keep}}
    s, hf = spec_from_config(cfg), _hf_config(cfg)
    assert (s.head_dim, s.num_kv_heads, s.max_position, s.norm_eps) == (hf.head_dim, hf.num_key_value_heads,
                                                                        hf.max_position_embeddings, hf.rms_norm_eps)
    assert s.rope.dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) and s.rope.theta == 10000.0
    assert s.qkv_bias == hf.attention_bias and s.tie_embeddings == hf.tie_word_embeddings
    assert s.eos_token_ids == tuple(hf.eos_token_id)


def test_mistral3_published_config():
    """Mistral3ForConditionalGeneration runs its text_config as MistralForCausalLM: sliding_window null there
    means full attention (MistralConfig would default an absent key to 4096)."""
    s = spec_from_config(MISTRAL_SMALL_31)
    assert (s.arch, s.hidden_size, s.head_dim, s.num_layers, s.vocab_size) == ("MistralForCausalLM", 5120, 128, 40,
                                                                                131072)
    assert all(layer.sliding_window is None for layer in s.layers) and s.rope.theta == 1e9
    outer = spec_from_config({**MISTRAL_SMALL_31, "eos_token_id": 2, "bos_token_id": 1})
    assert outer.eos_token_ids == (2,) and outer.bos_token_id == 1  # top-level ids where text_config has none
    ministral3 = {**MISTRAL_SMALL_31, "text_config": {**MISTRAL_SMALL_31["text_config"], "model_type": "ministral3"}}
    with pytest.raises(ConfigError, match="ministral3"):
        spec_from_config(ministral3)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {name: build_tiny(name, tmp_path_factory.mktemp(name)) for name in NEW}


@pytest.mark.parametrize("name", ["gemma", "granite", "cohere", "cohere_qk_norm", "cohere2", "glm", "glm4"])
def test_paged_cache_matches_contiguous(dirs, name):
    """Two sequences of different lengths decoded together through scattered pages give each sequence's logits
    from the contiguous cache (the paged cache rotates keys while storing them: Cohere's and GLM's interleaved pairs
    too, GLM's on the first half of each head, Cohere2's on its sliding layers only)."""
    model = load_model(dirs[name], "cpu")
    lens, steps = [23, 40], 6
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in lens]
    refs = []
    with torch.no_grad():
        for p in prompts:
            c = model.new_cache(1, 64)
            out = [model(p, c, 0)[:, -1]]
            toks = []
            for i in range(steps):
                toks.append(out[-1].argmax(-1, keepdim=True))
                out.append(model(toks[-1], c, p.shape[1] + i)[:, -1])
            refs.append((torch.stack(out, 1), torch.cat(toks, 1)))
        cache = PagedKVCache(model.spec, num_pages=16, page_size=8, device="cpu", dtype=torch.float32)
        tables = torch.tensor([[9, 2, 14, 5, 7, 0], [1, 12, 3, 8, 10, 6]], dtype=torch.int32)
        for b, p in enumerate(prompts):
            cache.bind(tables[b:b + 1])
            assert torch.allclose(model(p, cache, 0)[:, -1], refs[b][0][:, 0], atol=1e-5)
        cache.bind(tables)
        for i in range(steps):
            toks = torch.stack([refs[b][1][:, i] for b in range(2)])
            logits = model(toks, cache, torch.tensor(lens) + i)[:, -1]
            for b in range(2):
                assert torch.allclose(logits[b], refs[b][0][0, i + 1], atol=1e-5), f"step {i} row {b}"


@pytest.mark.parametrize("name", NEW)
def test_float16_on_cpu_stays_near_float32(dirs, name):
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    ref = reference_logits(dirs[name], ids)
    with torch.no_grad():
        half = load_model(dirs[name], "cpu", dtype=torch.float16)(ids)[0]
    assert half.dtype == torch.float32 and (half - ref).abs().max().item() <= 1e-2 * ref.abs().max().item() + 2e-3


def test_mistral3_either_checkpoint_layout(dirs, tmp_path):
    """Published files (and transformers 5's save_pretrained) hold language_model.model.* / language_model.lm_head.*
    with vision_tower.* / multi_modal_projector.*; the in-memory layout of transformers 5 is model.language_model.*,
    lm_head.*, model.vision_tower.*. Both load the same text model and show no vision tensor."""
    src = dirs["mistral3"]
    tensors = load_file(src / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in tensors) and any(k.startswith("language_model.model.")
                                                                        for k in tensors)
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))

    def v5_name(k):
        for old, new in renames:
            if k.startswith(old):
                return new + k[len(old):]
        return k

    other = tmp_path / "v5"
    other.mkdir()
    save_file({v5_name(k): v for k, v in tensors.items()}, str(other / "model.safetensors"))
    (other / "config.json").write_text((src / "config.json").read_text())
    for d in (src, other):
        names = set(TensorSource(d).keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
        assert not any("vision" in n or "projector" in n or "language_model" in n for n in names)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(load_model(src, "cpu")(ids), load_model(other, "cpu")(ids))
    assert json.loads((src / "config.json").read_text())["architectures"] == ["Mistral3ForConditionalGeneration"]


@pytest.mark.parametrize("name", [*NEW, "qwen2_moe"])
def test_engine_chat_is_transformers_greedy(tmp_path, name):
    """The whole serving path (tokenizer, chat template, dynamic generator, paged cache, sampler) at temperature 0
    replies with transformers' greedy continuation of the same prompt ids (the golden model's tokenizer and template
    over a tiny model of its 1024-token vocabulary; Mistral 3 as text only)."""
    import shutil

    from test_cli import SRC
    from tiny_models import reference_decode

    from exl2.config import EngineConfig, SamplingSettings
    from exl2.engine import Engine

    d = build_tiny(name, tmp_path / name, vocab_size=1024)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SRC / f, d)
    engine = Engine(EngineConfig(model_dir=d, device="cpu"))  # context: the tiny config's 256 positions
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = engine.tokenizer.encode(engine.chat_prompt(messages), add_bos=False)
    steps = 8
    _, _, greedy = reference_decode(d, torch.tensor(ids), steps)
    got = engine.chat(messages, SamplingSettings(temperature=0), steps).token_ids
    want = greedy.tolist()
    assert got and got == want[:len(got)] and (len(got) == steps or want[len(got)] in engine.model.spec.eos_token_ids)


GLM_4_5_AIR = {  # zai-org/GLM-4.5-Air
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": False, "vocab_size": 151552,
}


def test_glm_4_5_air_config():
    """Rotate-half RoPE on 64 of 128 dims, q/k/v biases without q/k norms, layer 0 dense then 128 experts routed by
    sigmoid scores (8 a token) beside one shared expert of 1,408."""
    s = spec_from_config(GLM_4_5_AIR)
    assert (s.num_layers, s.head_dim, s.num_kv_heads) == (46, 128, 8)
    assert s.rope.dim == 64 and not s.rope.interleaved and s.rope.theta == 1e6
    assert s.qkv_bias and not s.o_bias and not s.qk_norm
    assert [layer.moe for layer in s.layers[:2]] == [False, True] and s.intermediate_size == 10944
    m = s.moe
    assert (m.num_experts, m.top_k, m.expert_dim, m.shared_dim, m.router) == (128, 8, 1408, 1408, "sigmoid_grouped")
    assert s.eos_token_ids == (151329, 151336, 151338)


def test_glm4_moe_converts_without_its_next_token_layer(tmp_path):
    """GLM-4.5's files carry a next-token-prediction layer past the decoder's (model.layers.{n}: a whole MoE layer
    and its own norms and projection); the conversion leaves it out, and the EXL2 model stays near the source
    (6 bpw on a random tiny model whose sigmoid routing flips easily, as DeepSeek-V3's: measured relative error
    33 %)."""
    def with_extra_layer(src):
        path = next(src.glob("*.safetensors"))
        tensors = load_file(path)
        n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        extra = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in tensors.items()
                 if k.startswith(f"model.layers.{n - 1}.")}
        extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
        extra[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
        save_file({**tensors, **extra}, str(path))
        return n

    src, out, keys = _converted_keys(tmp_path, "glm4_moe", edit=with_extra_layer)
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{n - 1}.mlp.experts.3.up_proj.q_weight" in keys
    assert not any(k.startswith(f"model.layers.{n}.") for k in keys)
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = load_model(out, "cpu")(ids), load_model(src, "cpu")(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.4
    # sharded over two devices, every quantized expert split by its steps: the unsharded EXL2 model's logits
    tp = build_tensor_parallel(TensorSource(out), spec_from_config(json.loads((out / "config.json").read_text())),
                               ["cpu", "cpu"], torch.float32, use_kernels=True)
    assert tp.layers[1].mlp[0].experts[0].down_proj.kernel is not None
    with torch.no_grad():
        exl2 = load_model(out, "cpu", dtype=torch.float32)(ids)
        assert (tp(ids) - exl2).abs().max().item() <= 1e-3 * exl2.abs().max().item()


def _converted_keys(tmp_path, name: str, edit=None):
    """`_converted`'s source and output directories, and the tensor names the output holds."""
    from safetensors import safe_open

    src, out = _converted(tmp_path, name, edit)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        return src, out, set(f.keys())


def _converted(tmp_path, name: str, edit=None):
    """A tiny `name` model (the golden tokenizer's 1,024 tokens) and its 6-bpw EXL2 conversion, calibrated on Python's
    pydoc topics: the built-in set also reads the installed packages' METADATA, so installing one would move the
    measured errors."""
    import shutil

    from test_cli import SRC

    from exl2.cli.main import main
    from exl2.quantize.calibration import heldout_text

    src = build_tiny(name, tmp_path / "src", vocab_size=1024)
    if edit is not None:
        edit(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SRC / f, src)
    cal = tmp_path / "calibration.txt"
    cal.write_text(heldout_text(), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["convert", "-i", str(src), "-o", str(tmp_path / "work"), "-cf", str(out), "-b", "6.0", "-c", str(cal),
                 "-r", "4", "-l", "64", "-mr", "4", "-ml", "64"]) == 0
    return src, out


@pytest.mark.parametrize("name,bound", [("qwen2_moe", 0.15), ("deepseek_v2", 0.25), ("deepseek_v3", 0.35),
                                        ("qwen3_vl_moe", 0.15), ("gpt_oss", 0.2)])
def test_moe_models_convert_and_load(tmp_path, name, bound):
    """Qwen2-MoE, DeepSeek-V2/V3 (MLA: the sensitivity pass differentiates through its in-place RoPE) and
    Qwen3-VL-MoE (experts fused in the source files, quantized one by one) and gpt-oss (fused, interleaved,
    biased experts; sinks and router bias carried) to EXL2: the converted model's logits stay near the source's
    (6 bpw on random tiny models; measured relative error 9.0 %, 16.3 %, 28.5 %, 8.8 %, 9.5 %)."""
    src, out = _converted(tmp_path, name)
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = load_model(out, "cpu")(ids), load_model(src, "cpu")(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < bound


def test_qwen2_moe_conversion_keeps_the_gates(tmp_path):
    """The routed and shared experts are quantized, the router and the shared expert's gate kept as they are; an
    input width EXL2 cannot pack is refused before any work."""
    from exl2.quantize.pipeline import Converter, ConvertSettings

    src, out, keys = _converted_keys(tmp_path, "qwen2_moe")
    p = "model.layers.0.mlp"
    assert {f"{p}.shared_expert.down_proj.q_weight", f"{p}.experts.3.up_proj.q_weight", f"{p}.gate.weight",
            f"{p}.shared_expert_gate.weight"} <= keys
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "shared_expert_intermediate_size": 48}))
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size is 48"):
        Converter(ConvertSettings(in_dir=str(src), out_dir=str(tmp_path / "work2"), bits=4.0))
    assert not (tmp_path / "work2").exists() or not any((tmp_path / "work2").iterdir())


@pytest.mark.parametrize("name,bound", [("cohere", 0.16), ("cohere_qk_norm", 0.12), ("cohere2", 0.17)])
def test_cohere_models_convert_and_load(tmp_path, name, bound):
    """Command-R (+ its q/k-norm variant) and Command R7B to EXL2: each parallel layer is measured and quantized as
    its attention (scored on x + attn(n(x))) and then its MLP (on the whole layer, with the attention already
    quantized), both fed the layer's input; the converted model's logits stay near the source's (6 bpw on random
    tiny models; measured relative error 11.8 %, 8.1 %, 13.0 %; GLM-4's is 8.6 %). Two shards of the EXL2 model
    (quantized o_proj gathered, the MLP reduced) give its unsharded logits."""
    src, out, keys = _converted_keys(tmp_path, name)
    p = "model.layers.1"
    assert {f"{p}.self_attn.q_proj.q_weight", f"{p}.mlp.down_proj.q_weight", f"{p}.input_layernorm.weight"} <= keys
    assert not any("post_attention_layernorm" in k for k in keys)
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = load_model(out, "cpu")(ids), load_model(src, "cpu")(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < bound
    tp = build_tensor_parallel(TensorSource(out), spec_from_config(json.loads((out / "config.json").read_text())),
                               ["cpu", "cpu"], torch.float32, use_kernels=True)
    assert tp.layers[1].o_mode == "gather"
    with torch.no_grad():
        exl2 = load_model(out, "cpu", dtype=torch.float32)(ids)
        assert (tp(ids) - exl2).abs().max().item() <= 1e-3 * exl2.abs().max().item()


def test_cohere_measurement_is_exllamav2s_parallel_layout_and_reusable(tmp_path):
    """A parallel layer's measurement goes out as exllamav2 writes it (`model.layers.N.parallel_decoder` holding
    `attn` and `mlp`), and a conversion given that file with -m reads it back and writes the very same tensors."""
    from safetensors.torch import load_file

    from exl2.cli.main import main

    src, out = _converted(tmp_path, "cohere")
    data = json.loads((tmp_path / "work" / "measurement.json").read_text())
    m = data["measurement"]
    assert list(m) == [f"model.layers.{i}.parallel_decoder" for i in range(3)] + ["model.norm.norm", "lm_head.linear"]
    assert data["last_module_idx"] == 5
    assert {"q_proj", "o_proj"} <= set(m["model.layers.1.parallel_decoder"]["attn"][0])
    assert {"gate_proj", "down_proj"} <= set(m["model.layers.1.parallel_decoder"]["mlp"][0])
    assert main(["convert", "-i", str(src), "-o", str(tmp_path / "work2"), "-cf", str(tmp_path / "out2"), "-b", "6.0",
                 "-c", str(tmp_path / "calibration.txt"), "-r", "4", "-l", "64",
                 "-m", str(tmp_path / "work" / "measurement.json")]) == 0
    a, b = (load_file(str(next(d.glob("*.safetensors")))) for d in (out, tmp_path / "out2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cohere_conversion_resumed_after_an_attention_block_is_the_same(tmp_path, monkeypatch):
    """A conversion killed between a parallel layer's attention and MLP blocks resumes at the attention (the MLP
    block runs the quantized attention, which a fresh process has not loaded) and writes the very same tensors."""
    from safetensors.torch import load_file

    from exl2.cli.main import main
    from exl2.quantize import pipeline, quantize

    src, out = _converted(tmp_path, "cohere")
    real, calls = quantize.quantize_slot, {"n": 0}

    def killed_at_layer_1_mlp(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    args = ["convert", "-i", str(src), "-o", str(tmp_path / "work2"), "-cf", str(tmp_path / "out2"), "-b", "6.0",
            "-c", str(tmp_path / "calibration.txt"), "-r", "4", "-l", "64", "-mr", "4", "-ml", "64"]
    monkeypatch.setattr(pipeline, "quantize_slot", killed_at_layer_1_mlp)
    assert main(args) != 0
    monkeypatch.setattr(pipeline, "quantize_slot", real)
    assert main(args) == 0
    a, b = (load_file(str(next(d.glob("*.safetensors")))) for d in (out, tmp_path / "out2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name,bound", [("glm", 0.15), ("glm4", 0.2)])
def test_glm_models_convert_and_load(tmp_path, name, bound):
    """GLM-4 and GLM-4-0414 to EXL2: the fused gate_up_proj is quantized as gate_proj and up_proj, the q/k/v biases
    and GLM-4-0414's four norms per layer are kept under their names, and the converted model's logits stay near
    the source's (6 bpw on random tiny models; measured relative error 8.6 %, 12.8 %)."""
    src, out, keys = _converted_keys(tmp_path, name)
    p = "model.layers.1"
    assert {f"{p}.mlp.gate_proj.q_weight", f"{p}.mlp.up_proj.q_weight", f"{p}.self_attn.k_proj.bias"} <= keys
    assert not any("gate_up_proj" in k for k in keys)
    if name == "glm4":
        assert {f"{p}.{n}.weight" for n in ("post_self_attn_layernorm", "post_attention_layernorm",
                                            "post_mlp_layernorm")} <= keys
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = load_model(out, "cpu")(ids), load_model(src, "cpu")(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < bound


def test_olmo2_converts_and_counts_its_norms_once(tmp_path):
    """OLMo 2 to EXL2 (norms after the sublayers only, q/k norms over whole projections): both output norms and
    the q/k norms kept under their names, every decoder tensor counted once for the bit rate, and the logits near
    the source's (6 bpw on a random tiny model; measured relative error 9.1 %)."""
    from exl2.quantize.blocks import SourceModel, slots
    from exl2.quantize.pipeline import decoder_numel

    src, out, keys = _converted_keys(tmp_path, "olmo2")
    p = "model.layers.1"
    assert {f"{p}.{n}.weight" for n in ("post_attention_layernorm", "post_feedforward_layernorm",
                                        "self_attn.q_norm", "self_attn.k_norm")} <= keys
    assert f"{p}.self_attn.q_proj.q_weight" in keys and f"{p}.input_layernorm.weight" not in keys
    spec = spec_from_config(json.loads((src / "config.json").read_text()))
    model = SourceModel(src, spec, torch.device("cpu"), torch.float32)
    layers = [k for k in model.src.keys() if k.startswith("model.layers.")]
    assert decoder_numel(model, slots(spec)) == sum(model.src[k].numel() for k in layers)
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = load_model(out, "cpu")(ids), load_model(src, "cpu")(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.15


OLMO_2_7B = {  # allenai/OLMo-2-1124-7B
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
    "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352,
}
SMOLLM3_3B = {  # after HuggingFaceTB/SmolLM3-3B (its no_rope_layers written out by the interval)
    "architectures": ["SmolLM3ForCausalLM"], "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008,
    "max_position_embeddings": 65536, "model_type": "smollm3", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 4, "no_rope_layer_interval": 4, "rms_norm_eps": 1e-06, "rope_theta": 5000000.0,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 128256,
}


MINIMAX_M2 = {  # after MiniMaxAI/MiniMax-M2's config.json (keys transformers does not read left out)
    "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "use_qk_norm": True,
    "vocab_size": 200064, "tie_word_embeddings": False,
}


def test_minimax_m2_config():
    """RoPE on rotary_dim 64 of 128, q/k norms over whole projections, 256 experts (8 a token) by biased sigmoid
    scores in one group, Mixtral's names under block_sparse_moe."""
    s = spec_from_config(MINIMAX_M2)
    assert s.rope.dim == 64 and not s.rope.interleaved and s.qk_norm_full and s.pre_norm
    m = s.moe
    assert (m.num_experts, m.top_k, m.expert_dim, m.router, m.n_group, m.style) == (256, 8, 1536, "sigmoid_grouped",
                                                                                   1, "mixtral")
    assert s.mlp_key == "block_sparse_moe" and all(layer.moe for layer in s.layers)


EXAONE_4_32B = {  # after LGAI-EXAONE/EXAONE-4.0-32B's config.json (its layer_types written by the pattern)
    "architectures": ["Exaone4ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "intermediate_size": 27392, "max_position_embeddings": 131072, "model_type": "exaone4", "num_attention_heads": 40,
    "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": 4096, "sliding_window_pattern": "LLLG", "tie_word_embeddings": False, "vocab_size": 102400,
}


def test_exaone4_config():
    """"LLLG": three sliding, rotated layers then a global NoPE one; norms after the sublayers, per-head q/k norms."""
    s = spec_from_config(EXAONE_4_32B)
    assert [layer.sliding_window for layer in s.layers[:4]] == [4096, 4096, 4096, None]
    assert [layer.use_rope for layer in s.layers[:8]] == [True, True, True, False] * 2
    assert s.qk_norm and not s.qk_norm_full and not s.pre_norm and s.sandwich_norm


def test_olmo2_and_smollm3_configs():
    s = spec_from_config(OLMO_2_7B)
    assert s.qk_norm_full and not s.pre_norm and s.sandwich_norm and not s.qk_norm
    assert s.rope.theta == 500000 and all(layer.sliding_window is None for layer in s.layers)
    s = spec_from_config(SMOLLM3_3B)
    assert [layer.use_rope for layer in s.layers[:8]] == [True, True, True, False] * 2
    assert s.tie_embeddings and s.num_kv_heads == 4 and all(layer.sliding_window is None for layer in s.layers)


def test_glm4_blocks_count_each_norm_once(dirs):
    """The converter's parameter count (its bits per weight) finds GLM-4-0414's norms under their own names: every
    tensor of the decoder layers once (the tiny model's widths need no padding)."""
    from exl2.quantize.blocks import SourceModel, slots
    from exl2.quantize.pipeline import decoder_numel

    model = SourceModel(dirs["glm4"], spec_from_config(json.loads((dirs["glm4"] / "config.json").read_text())),
                        torch.device("cpu"), torch.float32)
    want = sum(model.src[k].numel() for k in model.src.keys() if k.startswith("model.layers."))
    assert decoder_numel(model, slots(model.spec)) == want


@pytest.mark.parametrize("name", ["glm", "glm4", "cohere", "cohere_qk_norm", "cohere2", "granite", "olmo2", "olmo3",
                                  "minimax_m2"])
def test_tensor_parallel_matches_unsharded(dirs, tmp_path, name):
    """Two CPU shards of GLM-4 / GLM-4-0414 (partial interleaved RoPE, q/k/v biases, the fused gate_up_proj split,
    GLM-4-0414's sandwich norms), Command-R (parallel layers: one all-reduce for o_proj's and the MLP's partial sums;
    LayerNorm; per-head q/k LayerNorms split by head), Command R7B (sliding and NoPE layers, o bias), Granite
    (scaled residuals), OLMo 2/3 (no norm before the sublayers; q/k RMSNorms over the whole projections, each shard's
    share normed with every shard's sums) and MiniMax-M2 (those q/k norms in an MoE model) give the unsharded
    logits, prefill and paged decode."""
    from exl2.models.registry import read_config
    from exl2.runtime.paged_cache import paged_cache_for
    from exl2.runtime.tp.model import build_tensor_parallel

    src = dirs[name] if name in dirs else build_tiny(name, tmp_path / name)
    ref = load_model(src, "cpu")
    tp = build_tensor_parallel(TensorSource(src), spec_from_config(read_config(src)), ["cpu"] * 2, torch.float32)
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (tp, ref):
        cache = paged_cache_for(model, 8, 16, "fp16")
        cache.bind(torch.arange(8, dtype=torch.int32).view(2, 4))
        with torch.inference_mode():
            out = [model(ids, cache, 0)]
            for i in range(6):
                out.append(model(out[-1][:, -1:].argmax(-1), cache, ids.shape[1] + i))
        logits.append(out)
    for i, (got, want) in enumerate(zip(*logits)):
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), f"step {i}"


def test_quantizer_logits_are_the_decoders(dirs):
    """The quantizer's source-model logits (measurement, KL) go through the decoder's final_logits: Granite's
    logits_scaling applies there too."""
    from exl2.quantize.blocks import SourceModel

    model = load_model(dirs["granite"], "cpu")
    src = SourceModel(dirs["granite"], model.spec, torch.device("cpu"), torch.float32)
    x = torch.randn(1, 4, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.logits(model.norm(x))
        got = src.logits(src.final_norm(), src.head_linear(), x)
    assert model.spec.logit_scale != 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_consolidated_mistral_weights_are_not_indexed(tmp_path):
    """Mistral repos ship consolidated.safetensors (their own names) beside the HF shards: only the shards count."""
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(tmp_path / "consolidated.safetensors"))
    src = TensorSource(tmp_path)
    assert "model.embed_tokens.weight" in src and "tok_embeddings.weight" not in src


def test_chat_template_json_is_read(tmp_path):
    """Processor-style repos keep the chat template in chat_template.json."""
    import shutil

    from test_cli import SRC

    from exl2.generation.tokenizer import Tokenizer

    for f in SRC.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("config.json", "special_tokens_map.json"):
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    assert Tokenizer.from_dir(tmp_path).chat_template == "{{ messages[0]['content'] }}!"
