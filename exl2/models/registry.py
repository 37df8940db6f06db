"""config.json → ModelSpec for every supported Hugging Face architecture."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

from exl2.errors import ConfigError, ModelLoadError
from exl2.models.rope import ROPE_TYPES, RopeOverride, RopeSpec
from exl2.models.spec import GLM4_SANDWICH, OLMO2_SANDWICH, LayerSpec, MLASpec, MoESpec, ModelSpec

_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen3_moe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "llama",
    "SmolLM3ForCausalLM": "llama",
    "SeedOssForCausalLM": "llama",
    "Ernie4_5ForCausalLM": "llama",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "GraniteForCausalLM": "granite",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm",
    "DeepseekV3ForCausalLM": "deepseek",
    "DeepseekV2ForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Dots1ForCausalLM": "glm4_moe",
    "Llama4ForCausalLM": "llama4",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GptOssForCausalLM": "gpt_oss",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo2",
    "Exaone4ForCausalLM": "olmo2",
}
# multimodal wrappers run as their text decoder (config.json's text_config; exl2.formats.safetensors_io unwraps the
# weights and leaves the vision tower and projector out)
_TEXT_DECODER_OF = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "LlavaForConditionalGeneration": "MistralForCausalLM",
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES) + tuple(_TEXT_DECODER_OF)


def read_config(model_dir: Path | str) -> dict[str, Any]:
    """Read config.json with readable errors for the usual mistakes."""
    d = Path(model_dir)
    if not d.exists():
        raise ModelLoadError(f"Model directory {d} does not exist.")
    if not d.is_dir():
        raise ModelLoadError(f"{d} is not a directory (expected a model directory with config.json).")
    path = d / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{d} has no config.json, so it is not a Hugging Face or EXL2 model directory.")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}).") from None


def spec_from_dir(model_dir: Path | str, rope: Optional[RopeOverride] = None) -> ModelSpec:
    return spec_from_config(read_config(model_dir), rope)


# the key under which spec_from_config hands a RoPE override to _rope, past every family's builder
_OVERRIDE = "__exl2_rope_override__"


def spec_from_config(cfg: dict[str, Any], rope: Optional[RopeOverride] = None) -> ModelSpec:
    """The spec of config.json `cfg`; `rope` (-rs/-ra/-ry) overrides its RoPE, and `max_position` becomes the
    context the override covers (`native_max_position` keeps config.json's)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None and cfg.get("model_type") == "gemma3_text":
        arch = "Gemma3ForCausalLM"
    if arch == "Mistral3ForConditionalGeneration":
        text_type = (cfg.get("text_config") or {}).get("model_type", "mistral")
        if text_type != "mistral":  # Ministral 3 / Mistral Large 3 ("ministral3") scale queries by position
            raise ConfigError(f"Mistral3ForConditionalGeneration with a {text_type!r} text model is not supported; "
                              "supported: Mistral Small 3.1 / 3.2 style (text model_type 'mistral').")
    if arch == "LlavaForConditionalGeneration":   # only Pixtral-12B's form: a Pixtral tower on a Mistral decoder
        kinds = ((cfg.get("vision_config") or {}).get("model_type"), (cfg.get("text_config") or {}).get("model_type"))
        if kinds != ("pixtral", "mistral"):
            raise ConfigError(f"LlavaForConditionalGeneration is supported with a Pixtral vision tower on a Mistral "
                              f"text model (Pixtral-12B), not {kinds[0]!r} on {kinds[1]!r}.")
    arch = _TEXT_DECODER_OF.get(arch, arch)
    if arch and arch.endswith("Model") and arch[:-5] + "ForCausalLM" in _FAMILIES:
        arch = arch[:-5] + "ForCausalLM"     # a base model (embedding models: Qwen3Model, MistralModel): same layers
    if "text_config" in cfg and arch in _TEXT_DECODER_OF.values() and "hidden_size" not in cfg:
        outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
        cfg = {**outer, **{k: v for k, v in cfg["text_config"].items() if v is not None or k not in outer},
               "architectures": [arch]}
    if arch not in _FAMILIES:
        raise ConfigError(
            f"Architecture {arch!r} is not supported; supported architectures are: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    active = rope is not None and rope.active
    try:
        spec = _BUILDERS[_FAMILIES[arch]](arch, {**cfg, _OVERRIDE: rope} if active else cfg)
    except KeyError as e:
        raise ConfigError(f"config.json for {arch} lacks the field {e.args[0]!r}.") from None
    if not active:
        return spec
    return dataclasses.replace(spec, max_position=_override_context(spec, rope), rope_override=rope)


def _override_context(spec: ModelSpec, ov: RopeOverride) -> int:
    """Positions the override covers: native × scale, the YaRN original × factor; alpha has no length of its
    own (exllamav2 leaves max_seq_len to the user), so an explicit request (`ov.context`) is taken as it is."""
    native = spec.native_max_position
    if ov.yarn is not None:
        return int(spec.rope.params["original_max_position_embeddings"] * ov.yarn)
    limit = int(native * (ov.scale or 1.0))
    if ov.alpha is not None and ov.context is not None:
        limit = max(limit, ov.context)
    return limit


# ----------------------------------------------------------------------------------------------------------------
def _rope(cfg: dict, head_dim: int, default_theta: float = 10000.0, layer_type: str | None = None,
          interleaved: bool = False, dim: int | None = None) -> RopeSpec:
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if layer_type is not None and layer_type in rp:
        rp = dict(rp[layer_type])
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rtype == "su":
        rtype = "longrope"
    if rtype == "mrope":   # Qwen2-VL's published spelling: default frequencies, split by mrope_section
        rtype = "default"
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"RoPE type {rtype!r} is not supported; supported types are: {', '.join(ROPE_TYPES)}.")
    theta = rp.get("rope_theta", cfg.get("rope_theta", default_theta))
    max_pos = cfg.get("max_position_embeddings", 2048)
    if rtype in ("llama3", "yarn", "longrope"):
        if cfg.get("model_type") == "phi3" and "original_max_position_embeddings" in cfg:
            rp["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]  # HF: top level wins
        rp.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    partial = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rdim = dim if dim is not None else int(head_dim * partial)
    pos_scale = 1.0
    ov: Optional[RopeOverride] = cfg.get(_OVERRIDE)
    # sliding-window layers with a table of their own (Gemma 3) never see distances past their window
    if ov is not None and layer_type != "sliding_attention":
        rtype, rp, theta, pos_scale = _overridden(ov, rtype, rp, float(theta), rdim, max_pos)
    return RopeSpec(rope_type=rtype, theta=float(theta), dim=rdim, max_position=max_pos, params=rp,
                    interleaved=interleaved, pos_scale=pos_scale)


def _overridden(ov: RopeOverride, rtype: str, rp: dict, theta: float, dim: int,
                max_pos: int) -> tuple[str, dict, float, float]:
    """(type, params, base, position scale) of a RoPE under the override, with exllamav2's semantics: -ry
    makes it YaRN (keeping a YaRN config's original length and betas, else the native length as original);
    -rs replaces a linear factor, or divides positions on top of the other types; -ra scales the base of any."""
    pos_scale = 1.0
    if ov.yarn is not None:
        if rtype != "yarn":
            keep = {k: rp[k] for k in ("rope_theta", "partial_rotary_factor") if k in rp}
            rp = {**keep, "rope_type": "yarn", "original_max_position_embeddings": max_pos}
            rtype = "yarn"
        rp = {**rp, "factor": float(ov.yarn)}
    if ov.scale is not None:
        if rtype in ("default", "linear"):
            rtype, rp = "linear", {**rp, "rope_type": "linear", "factor": float(ov.scale)}
        else:
            pos_scale = float(ov.scale)
    if ov.alpha is not None:
        theta = theta * ov.alpha ** (dim / (dim - 2))
    return rtype, rp, theta, pos_scale


def _eos(cfg: dict) -> tuple[int, ...]:
    e = cfg.get("eos_token_id")
    if e is None:
        return ()
    return tuple(e) if isinstance(e, list) else (int(e),)


_HEAD_DIM_DEFAULTS = {"Qwen3ForCausalLM": 128, "Qwen3MoeForCausalLM": 128, "GemmaForCausalLM": 256}


def _common(arch: str, cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or _HEAD_DIM_DEFAULTS.get(arch) or cfg["hidden_size"] // heads
    return dict(
        arch=arch,
        model_type=cfg.get("model_type", ""),
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=cfg.get("intermediate_size", 0),
        max_position=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg),
    )


def _layer_windows(cfg: dict, n: int, arch: str) -> list[int | None]:
    # transformers' MistralConfig defaults the window to 4096 when the key is absent (null disables it).
    window = cfg.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    types = cfg.get("layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if arch == "MistralForCausalLM" or arch == "Phi3ForCausalLM":
        return [window] * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and window:
        start = cfg.get("max_window_layers", n)
        return [window if i >= start else None for i in range(n)]
    return [None] * n


def _llama(arch: str, cfg: dict) -> ModelSpec:
    """Llama and the models that are Llama with switches: Mistral, Qwen2/2.5/3 (q/k/v biases; q/k norms), Phi-3
    (fused projections), SmolLM3 (every fourth layer without RoPE: `no_rope_layers`, 1 = rotated), Seed-OSS (its
    own o_proj bias switch, `attention_out_bias`), ERNIE 4.5 (GPT-J pairs of RoPE, `use_bias` on every
    projection)."""
    c = _common(arch, cfg)
    n = c["num_layers"]
    qwen2 = arch == "Qwen2ForCausalLM"
    ernie = arch == "Ernie4_5ForCausalLM"
    bias = bool(cfg.get("use_bias", False)) if ernie else bool(cfg.get("attention_bias", qwen2))
    o_bias = bool(cfg.get("attention_out_bias", False)) if arch == "SeedOssForCausalLM" else bias and not qwen2
    rotated = [True] * n
    if arch == "SmolLM3ForCausalLM":
        interval = cfg.get("no_rope_layer_interval", 4)
        rotated = [bool(r) for r in cfg.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(n)]]
        if not cfg.get("layer_types"):   # SmolLM3Config: the NoPE layers slide where sliding is on
            slide = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
            cfg = {**cfg, "layer_types": ["sliding_attention" if slide and not r else "full_attention"
                                          for r in rotated]}
    windows = _layer_windows(cfg, n, arch)
    return ModelSpec(
        **c,
        rope=_rope(cfg, c["head_dim"], interleaved=ernie),
        layers=tuple(LayerSpec(sliding_window=w, use_rope=r) for w, r in zip(windows, rotated)),
        activation=_act(cfg),
        qkv_bias=bias,
        o_bias=o_bias,
        mlp_bias=bias if ernie else bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        fused_qkv=arch == "Phi3ForCausalLM",
        mrope_section=_mrope_section(cfg, c["head_dim"]),
        mrope_interleaved=_mrope_interleaved(cfg),
    )


def _mrope_interleaved(cfg: dict) -> bool:
    """Qwen3-VL interleaves its M-RoPE frequencies whatever its config says (transformers' Qwen3-VL rotary
    embedding has no other layout); others where `mrope_interleaved` says so."""
    return bool(_rope_params(cfg).get("mrope_interleaved")) or cfg.get("model_type") in ("qwen3_vl_text",
                                                                                       "qwen3_vl_moe_text")


def _rope_params(cfg: dict) -> dict:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _mrope_section(cfg: dict, head_dim: int) -> Optional[tuple[int, ...]]:
    """Qwen2-VL / Qwen2.5-VL: how many of the head's head_dim/2 frequencies turn with the temporal, height and
    width positions of an image token (text tokens have all three equal, which is plain RoPE)."""
    sections = _rope_params(cfg).get("mrope_section")
    if sections is None:
        return None
    sections = tuple(int(x) for x in sections)
    if len(sections) != 3 or sum(sections) != head_dim // 2:
        raise ConfigError(f"mrope_section {list(sections)} must be three counts adding up to head_dim/2 "
                          f"({head_dim // 2}).")
    return sections


def _granite(arch: str, cfg: dict) -> ModelSpec:
    """Granite 3.x dense: Llama plus four muP multipliers (all default 1.0, like transformers' GraniteConfig)."""
    return dataclasses.replace(
        _llama(arch, cfg),
        embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
        attn_scale=float(cfg.get("attention_multiplier", 1.0)),   # the softmax scale itself, not head_dim ** -0.5
        residual_scale=float(cfg.get("residual_multiplier", 1.0)),
        logit_scale=1.0 / float(cfg.get("logits_scaling", 1.0)),
    )


def _cohere(arch: str, cfg: dict) -> ModelSpec:
    """Command-R (v01, 08-2024; Aya 23): bias-free LayerNorm, attention and MLP in parallel from one norm, GPT-J
    (interleaved) RoPE, logits × logit_scale, tied head; `use_qk_norm` (Command-R+) adds per-head LayerNorms
    (weights [heads, head_dim]) on q and k before RoPE."""
    c = _common(arch, cfg)
    layers = tuple(LayerSpec() for _ in range(c["num_layers"]))
    return _cohere_spec(c, cfg, 500000.0, layers, qk_norm=bool(cfg.get("use_qk_norm", False)))


def _cohere2(arch: str, cfg: dict) -> ModelSpec:
    """Command R7B / Command A: Command-R's layers (no q/k norms) with sliding-window attention on the layers
    `layer_types` marks (else every `sliding_window_pattern`-th layer is global, the others slide), and RoPE only
    on the sliding layers: the global ones are NoPE. transformers rotates exactly where the layer has a window."""
    cfg = {"max_position_embeddings": 8192, "sliding_window": 4096, **cfg}   # Cohere2Config's defaults
    c = _common(arch, cfg)
    n = c["num_layers"]
    if not cfg.get("layer_types"):
        pattern = cfg.get("sliding_window_pattern", 4)
        cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n)]}
    layers = tuple(LayerSpec(sliding_window=w, use_rope=w is not None) for w in _layer_windows(cfg, n, arch))
    return _cohere_spec(c, cfg, 10000.0, layers, qk_norm=False)


def _cohere_spec(c: dict, cfg: dict, default_theta: float, layers: tuple[LayerSpec, ...],
                 qk_norm: bool) -> ModelSpec:
    """What Command-R and Command R7B share: LayerNorm, parallel blocks, interleaved RoPE, logit_scale, tied head."""
    c["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    c["norm_eps"] = float(cfg.get("layer_norm_eps") or 1e-5)
    bias = bool(cfg.get("attention_bias", False))
    logit_scale = cfg.get("logit_scale", 0.0625)
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"], default_theta, interleaved=True), layers=layers,
                     activation=_act(cfg), qkv_bias=bias, o_bias=bias, qk_norm=qk_norm, norm_type="layernorm",
                     parallel_block=True, logit_scale=1.0 if logit_scale is None else float(logit_scale))


# GlmConfig's and Glm4Config's defaults for the keys config.json leaves out (or sets to null)
_GLM_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 2, "max_position_embeddings": 131072,
                 "rms_norm_eps": 1.5625e-7, "partial_rotary_factor": 0.5, "attention_bias": True,
                 "eos_token_id": [151329, 151336, 151338]}


def _glm(arch: str, cfg: dict) -> ModelSpec:
    """GLM-4 (glm-4-9b-chat-hf) and GLM-4-0414: Llama layers with q/k/v biases (o has none), a fused gate_up_proj,
    and GPT-J (interleaved) RoPE on the first `partial_rotary_factor` of each head. GLM-4-0414 also norms the
    attention and MLP outputs before each residual add: Gemma 2's sandwich under other tensor names."""
    cfg = {**_GLM_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    c = _common(arch, cfg)
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"], interleaved=True),
                     layers=tuple(LayerSpec() for _ in range(c["num_layers"])), activation=_act(cfg),
                     qkv_bias=bool(cfg["attention_bias"]), sandwich_norm=arch == "Glm4ForCausalLM",
                     sandwich_names=GLM4_SANDWICH)


def _act(cfg: dict) -> str:
    a = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if a in ("silu", "swish"):
        return "silu"
    if a in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return "gelu_tanh"
    if a == "gelu":
        return "gelu"
    raise ConfigError(f"Activation {a!r} is not supported.")


def _mixtral(arch: str, cfg: dict) -> ModelSpec:
    c = _common(arch, cfg)
    moe = MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["intermediate_size"], router="softmax", norm_topk_prob=True, style="mixtral")
    windows = _layer_windows(cfg, c["num_layers"], "MistralForCausalLM")
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"], 1e6), activation=_act(cfg), moe=moe,
                     layers=tuple(LayerSpec(sliding_window=w, moe=True) for w in windows),
                     mlp_key="block_sparse_moe")


def _qwen3_moe(arch: str, cfg: dict) -> ModelSpec:
    """Qwen3-MoE, and Qwen1.5/Qwen2-MoE: q/k/v biases instead of q/k norms, and an always-on shared expert whose
    output a sigmoid gate scales."""
    c = _common(arch, cfg)
    n = c["num_layers"]
    qwen2 = arch == "Qwen2MoeForCausalLM"
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
    moe = MoESpec(num_experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["moe_intermediate_size"], router="softmax",
                  # Qwen3-VL-MoE's router always renormalizes its top-k (its config has no norm_topk_prob)
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) or cfg.get("model_type") == "qwen3_vl_moe_text",
                  style="qwen", shared_dim=shared,
                  shared_gate=shared > 0)
    step = cfg.get("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    is_moe = [i not in dense_only and moe.num_experts > 0 and (i + 1) % step == 0 for i in range(n)]
    windows = _layer_windows(cfg, n, "Qwen2ForCausalLM" if qwen2 else "Qwen3ForCausalLM")
    if qwen2:   # the q/k/v biases are on unless the config says otherwise (transformers' qkv_bias)
        bias = dict(qkv_bias=bool(cfg.get("qkv_bias", True)), o_bias=False)
    else:
        bias = dict(qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)))
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"]), activation=_act(cfg), moe=moe, qk_norm=not qwen2, **bias,
                     layers=tuple(LayerSpec(sliding_window=w, moe=m) for w, m in zip(windows, is_moe)),
                     mrope_section=_mrope_section(cfg, c["head_dim"]),
                     mrope_interleaved=_mrope_interleaved(cfg))


def _gemma1_act(cfg: dict) -> str:
    """Gemma 1's activation: `hidden_activation` where set, else the tanh GELU whatever `hidden_act` says.
    Published Gemma 1 files say `hidden_act: "gelu"` while the models were trained with the tanh approximation;
    transformers 4.38+ and exllamav2 run tanh (transformers 5 reads `hidden_act` literally)."""
    if cfg.get("hidden_activation"):
        return _act(cfg)
    return "gelu_tanh" if cfg.get("hidden_act", "gelu") == "gelu" else _act(cfg)


def _gemma(arch: str, cfg: dict) -> ModelSpec:
    c = _common(arch, cfg)
    c["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    n = c["num_layers"]
    gemma3 = arch == "Gemma3ForCausalLM"
    if arch == "GemmaForCausalLM":  # Gemma 1: plain pre-norm blocks, global attention, no soft-caps
        return ModelSpec(**c, rope=_rope(cfg, c["head_dim"]), layers=tuple(LayerSpec() for _ in range(n)),
                         activation=_gemma1_act(cfg), norm_offset=1.0, embed_scale=c["hidden_size"] ** 0.5,
                         qkv_bias=bool(cfg.get("attention_bias", False)),
                         o_bias=bool(cfg.get("attention_bias", False)))
    if not cfg.get("layer_types"):
        if gemma3:
            pattern = cfg.get("sliding_window_pattern", 6)
            cfg = {**cfg, "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                          for i in range(n)]}
        else:
            cfg = {**cfg, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}
    windows = _layer_windows(cfg, n, arch)
    rope = _rope(cfg, c["head_dim"], layer_type="full_attention")
    local = None
    if gemma3:
        rp = cfg.get("rope_parameters") or {}
        if "sliding_attention" in rp:
            local = _rope(cfg, c["head_dim"], layer_type="sliding_attention")
        else:
            local = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10000.0)), dim=c["head_dim"],
                             max_position=c["max_position"])
    return ModelSpec(
        **c,
        rope=rope,
        local_rope=local,
        layers=tuple(LayerSpec(sliding_window=w, local_rope=gemma3 and w is not None) for w in windows),
        activation=_act(cfg),
        norm_offset=1.0,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=gemma3,
        sandwich_norm=True,
        image_blocks=gemma3,
        embed_scale=c["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", c["head_dim"]) ** -0.5,
        attn_softcap=None if gemma3 else cfg.get("attn_logit_softcapping"),  # Gemma 3 stores it but never applies it
        final_softcap=cfg.get("final_logit_softcapping"),
    )


def _deepseek(arch: str, cfg: dict) -> ModelSpec:
    c = _common(arch, cfg)
    n = c["num_layers"]
    mla = MLASpec(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                  qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                  v_head_dim=cfg["v_head_dim"])
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    v2 = arch == "DeepseekV2ForCausalLM"   # V2 rotates consecutive pairs always and routes by softmax
    rope = _rope(cfg, qk_head, interleaved=v2 or bool(cfg.get("rope_interleave", True)), dim=mla.qk_rope_head_dim)
    scale = qk_head ** -0.5
    rp = rope.params
    if rope.rope_type == "yarn" and rp.get("mscale_all_dim"):
        import math
        factor = rp["factor"]
        m = 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * m * m
    grouped = not v2 or cfg.get("topk_method", "greedy") == "group_limited_greedy"
    moe = MoESpec(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["moe_intermediate_size"], router="softmax_grouped" if v2 else "sigmoid_grouped",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", not v2)),
                  n_group=(cfg.get("n_group") or 1) if grouped else 1,
                  topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
                  routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                  shared_dim=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0), style="deepseek")
    k_dense = cfg.get("first_k_dense_replace", 0)
    c["head_dim"] = qk_head
    return ModelSpec(**c, rope=rope, mla=mla, moe=moe, attn_scale=scale, activation=_act(cfg),
                     qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                     layers=tuple(LayerSpec(moe=i >= k_dense) for i in range(n)))


def _glm4_moe(arch: str, cfg: dict) -> ModelSpec:
    """GLM-4.5 / 4.6 / 4.7 (and -Air): DeepSeek-V3's mixture of experts (sigmoid router with a score-correction
    bias, shared experts, the first layers dense) under GQA attention with q/k/v biases, optional per-head q/k
    RMSNorms and rotate-half RoPE on the first `partial_rotary_factor` (0.5) of each head. The checkpoints' extra
    next-token-prediction layers (index num_hidden_layers on) are not part of the decoder. dots.llm1
    (Dots1ForCausalLM) is the same mixture under Qwen3's attention: per-head q/k norms, full RoPE, sliding layers
    from max_window_layers on where sliding is configured."""
    dots = arch == "Dots1ForCausalLM"
    cfg = {"partial_rotary_factor": 1.0 if dots else 0.5, **{k: v for k, v in cfg.items() if v is not None}}
    if dots and not cfg.get("layer_types"):
        n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
        start = cfg.get("max_window_layers", n)
        cfg = {**cfg, "layer_types": ["sliding_attention" if window is not None and cfg.get("use_sliding_window")
                                      and i >= start else "full_attention" for i in range(n)]}
    c = _common(arch, cfg)
    moe = MoESpec(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["moe_intermediate_size"], router="sigmoid_grouped",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), n_group=cfg.get("n_group") or 1,
                  topk_group=cfg.get("topk_group") or 1, routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                  shared_dim=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0), style="deepseek")
    k_dense = cfg.get("first_k_dense_replace", 1)
    windows = _layer_windows(cfg, c["num_layers"], arch)
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"]), moe=moe, activation=_act(cfg),
                     qkv_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm=dots or bool(cfg.get("use_qk_norm", False)),
                     layers=tuple(LayerSpec(moe=i >= k_dense, sliding_window=w) for i, w in enumerate(windows)))


def _minimax_m2(arch: str, cfg: dict) -> ModelSpec:
    """MiniMax-M2: every layer a mixture of experts (Mixtral's tensor names under block_sparse_moe) routed by
    sigmoid scores plus a selection bias (`e_score_correction_bias`), the chosen scores renormalized; GQA with
    RMSNorms over the whole q and k projections and rotate-half RoPE on the first `rotary_dim` of each head."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("rotary_dim") and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": cfg["rotary_dim"] / head_dim}
    c = _common(arch, cfg)
    moe = MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["intermediate_size"], router="sigmoid_grouped", norm_topk_prob=True, style="mixtral")
    windows = _layer_windows(cfg, c["num_layers"], arch)
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"]), moe=moe, activation=_act(cfg),
                     qk_norm_full=bool(cfg.get("use_qk_norm", True)), mlp_key="block_sparse_moe",
                     layers=tuple(LayerSpec(sliding_window=w, moe=True) for w in windows))


def _exaone4_layer_types(cfg: dict, n: int) -> list[str]:
    """EXAONE 4's layer_types, or its sliding_window_pattern spelled out: an int p (every p-th layer global) or a
    string such as "LLLG" (L local, G global) repeated from layer 0; no window: all global."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 4)
    if cfg.get("sliding_window") is None or not pattern:
        return ["full_attention"] * n
    if isinstance(pattern, str):
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]


def _ernie4_5_moe(arch: str, cfg: dict) -> ModelSpec:
    """ERNIE 4.5 MoE: ERNIE 4.5's attention (GPT-J RoPE pairs, `use_bias`) with mixture-of-experts layers from
    moe_layer_start_index to moe_layer_end_index every moe_layer_interval: softmax router, experts chosen by
    probability plus a bias (`moe_statics.e_score_correction_bias`) and weighed by their probabilities renormalized,
    beside shared experts."""
    c = _common(arch, cfg)
    n = c["num_layers"]
    start, end = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_end_index", -1)
    end = n - 1 if end in (None, -1) else end
    step = cfg.get("moe_layer_interval", 1) or 1
    moe = MoESpec(num_experts=cfg.get("moe_num_experts", 64), top_k=cfg.get("moe_k", 6),
                  expert_dim=cfg.get("moe_intermediate_size", 1536), router="softmax_biased",
                  shared_dim=cfg.get("moe_intermediate_size", 1536) * (cfg.get("moe_num_shared_experts") or 0),
                  style="deepseek")
    bias = bool(cfg.get("use_bias", False))
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"], 500000.0, interleaved=True), moe=moe, activation=_act(cfg),
                     qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                     layers=tuple(LayerSpec(moe=(i + 1) % step == 0 and start <= i <= end) for i in range(n)))


def _gpt_oss(arch: str, cfg: dict) -> ModelSpec:
    """gpt-oss: every layer a mixture of experts (the router's top-k logits, with its bias, softmaxed; experts fused
    with gate and up columns interleaved and biases everywhere; the clamped SwiGLU `(up + 1) · g · sigmoid(1.702
    g)`), attention with q/k/v/o biases and a learned sink logit per head, sliding (128) and full layers
    alternating, YaRN RoPE."""
    c = _common(arch, cfg)
    moe = MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["intermediate_size"], router="softmax_topk", style="gpt_oss")
    windows = _layer_windows(cfg, c["num_layers"], arch)
    bias = bool(cfg.get("attention_bias", True))
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"], 150000.0), moe=moe, activation="gptoss", qkv_bias=bias,
                     o_bias=bias, attn_sinks=True, layers=tuple(LayerSpec(sliding_window=w, moe=True) for w in windows))


def _olmo2(arch: str, cfg: dict) -> ModelSpec:
    """OLMo 2, OLMo 3 and EXAONE 4: Llama layers whose norms follow the sublayers instead of preceding them
    (`x + post_attention_layernorm(attn(x))`, `x + post_feedforward_layernorm(mlp(x))`). OLMo: RMSNorms on the
    whole q and k projections before RoPE; OLMo 3 slides three layers in four (layer_types), one RoPE table per
    layer type. EXAONE 4: per-head q/k RMSNorms, and where some layers slide, only those are rotated (the global
    ones are NoPE)."""
    c = _common(arch, cfg)
    n = c["num_layers"]
    if arch == "Exaone4ForCausalLM":
        types = _exaone4_layer_types(cfg, n)
        windows = _layer_windows({**cfg, "layer_types": types}, n, arch)
        nope = any(w is not None for w in windows)
        return ModelSpec(**c, rope=_rope(cfg, c["head_dim"]), activation=_act(cfg), qk_norm=True, pre_norm=False,
                         sandwich_norm=True, sandwich_names=OLMO2_SANDWICH,
                         layers=tuple(LayerSpec(sliding_window=w, use_rope=not nope or w is not None)
                                      for w in windows))
    olmo3 = arch == "Olmo3ForCausalLM"
    if olmo3 and not cfg.get("layer_types"):
        cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]}
    rope = _rope(cfg, c["head_dim"], layer_type="full_attention" if olmo3 else None)
    local = _rope(cfg, c["head_dim"], layer_type="sliding_attention") if olmo3 else None
    windows = _layer_windows(cfg, n, arch)
    return ModelSpec(**c, rope=rope, local_rope=local, activation=_act(cfg),
                     layers=tuple(LayerSpec(sliding_window=w, local_rope=olmo3 and w is not None) for w in windows),
                     qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm_full=True, pre_norm=False, sandwich_norm=True, sandwich_names=OLMO2_SANDWICH)


def _llama4(arch: str, cfg: dict) -> ModelSpec:
    c = _common(arch, cfg)
    n = c["num_layers"]
    moe_layers = cfg.get("moe_layers")
    if moe_layers is None:
        step = cfg.get("interleave_moe_layer_step", 1)
        moe_layers = list(range(step - 1, n, step))
    moe_layers = set(moe_layers)
    no_rope = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    types = cfg.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in no_rope]
    chunk = cfg.get("attention_chunk_size")
    moe = MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                  expert_dim=cfg["intermediate_size"], router="sigmoid_input", shared_dim=cfg["intermediate_size"],
                  style="llama4")
    c["intermediate_size"] = cfg.get("intermediate_size_mlp", cfg["intermediate_size"])
    qk = bool(cfg.get("use_qk_norm", True))
    tt = bool(cfg.get("attn_temperature_tuning", True))
    layers = tuple(
        LayerSpec(chunk_size=chunk if t == "chunked_attention" else None, use_rope=bool(r), moe=i in moe_layers,
                  qk_l2_norm=qk and bool(r), temperature_tuning=tt and not r)
        for i, (t, r) in enumerate(zip(types, no_rope))
    )
    return ModelSpec(**c, rope=_rope(cfg, c["head_dim"], 500000.0, interleaved=True), layers=layers,
                     activation=_act(cfg), moe=moe, mlp_key="feed_forward",
                     qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                     attn_temperature=(cfg.get("attn_scale", 0.1), cfg.get("floor_scale", 8192)))


_BUILDERS: dict[str, Callable[[str, dict], ModelSpec]] = {
    "llama": _llama, "granite": _granite, "cohere": _cohere, "cohere2": _cohere2, "glm": _glm, "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe, "gemma": _gemma, "deepseek": _deepseek, "glm4_moe": _glm4_moe, "llama4": _llama4,
    "olmo2": _olmo2, "minimax_m2": _minimax_m2, "gpt_oss": _gpt_oss, "ernie4_5_moe": _ernie4_5_moe,
}
