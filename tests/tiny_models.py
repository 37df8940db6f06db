"""Tiny random Hugging Face models and transformers reference outputs for decoder parity tests.

Each ARCHS entry builds a 2-3 layer float32 model whose config is chosen so that the architecture's
quirks bite on a 64 + 16 token sequence (sliding windows and chunks of 16, rope scaling whose original
length is below the sequence, soft-caps small enough to matter, mixes of dense and MoE layers). All
weights, including norms, biases, routers and DeepSeek's routing bias, are re-drawn at a scale that
keeps activations O(1), so no code path is a no-op. See docs/architectures.md for what each quirk is.

ARCHS maps a fixture name to a function returning its transformers config; build_tiny makes the weights.
Import from tests as `from tiny_models import ARCHS, build_tiny, reference_logits, reference_decode`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# A shared small shape: hidden 64, 4 query heads, 2 KV heads, vocab 256.
_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


def _cfg(**overrides):
    out = dict(_BASE)
    out.update(overrides)
    return out


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**_cfg(head_dim=16, **kw))


def _arch_llama():
    return _llama(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _arch_llama3_rope():
    # original 64 -> wavelength bounds 16 and 64: with head_dim 16 / theta 1e4, pair 0 (wavelength 6.3)
    # is kept, pairs 1-2 (19.9, 62.8) are smoothed and pairs 3-7 are divided by the factor.
    return _llama(
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def _arch_llama_linear_rope():
    return _llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})


def _arch_llama_dynamic_rope():
    # max_position_embeddings 32 < the 80-token test sequence, so the NTK base is recomputed.
    return _llama(
        max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )


def _arch_llama_yarn_rope():
    return _llama(
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    )


def _arch_llama_tied():
    return _llama(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _arch_mistral_swa():
    from transformers import MistralConfig

    # head_dim 32 != hidden/heads (16): Mistral-Nemo style decoupled head_dim.
    return MistralConfig(
        **_cfg(head_dim=32, sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    )


def _arch_mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(
        **_cfg(
            head_dim=16,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    )


def _arch_qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _arch_qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_cfg(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


# Layers 0 and 2 are MoE, layer 1 is dense (mlp_only_layers); norm_topk_prob False keeps the raw softmax mass of the
# chosen experts (Mixtral covers the renormalising branch).
_QWEN_MOE = dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _arch_qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_cfg(head_dim=32, **_QWEN_MOE))


def _arch_qwen2_moe():
    from transformers import Qwen2MoeConfig

    # Qwen2-MoE: q/k/v biases instead of q/k norms, and a shared expert scaled by its sigmoid gate.
    return Qwen2MoeConfig(**_cfg(shared_expert_intermediate_size=64, **_QWEN_MOE))


def _arch_gemma():
    from transformers import GemmaConfig

    # Gemma 1: (1+w) norms, embeddings x sqrt(H), GeGLU (tanh), tied head, head_dim 32 != H/nh; no soft-caps,
    # no sandwich norms, every layer global. MQA (1 KV head) as Gemma 2B; 3 layers keep greedy decoding varied.
    return GemmaConfig(
        **_cfg(
            num_hidden_layers=3,
            head_dim=32,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            hidden_act="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


def _arch_gemma2():
    from transformers import Gemma2Config

    # Layers 0, 2 sliding (window 16), layer 1 global; soft-caps small enough to change the numbers
    # (tied logits here have std ~0.25, so the final cap of 0.5 bends most of them).
    return Gemma2Config(
        **_cfg(
            num_hidden_layers=3,
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            query_pre_attn_scalar=24,
            sliding_window=16,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=0.5,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


def _arch_gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_cfg(
            num_hidden_layers=3,
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            query_pre_attn_scalar=24,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        )
    )


def _arch_granite():
    from transformers import GraniteConfig

    # Granite 3.x: Llama with muP multipliers, each far from what Llama would do: embeddings x 12, softmax scale
    # 0.03 (not head_dim^-0.5 = 0.25), sublayer outputs x 0.22 before each residual add, logits / 3. Untied: with
    # a tied head the x12 embedding of the last token outweighs the x0.22 sublayers and greedy repeats it.
    return GraniteConfig(
        **_cfg(
            num_hidden_layers=3,
            head_dim=16,
            embedding_multiplier=12.0,
            attention_multiplier=0.03,
            residual_multiplier=0.22,
            logits_scaling=3.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


def _cohere(config_class=None, **kw):
    from transformers import CohereConfig

    base = _cfg(layer_norm_eps=1e-5, tie_word_embeddings=True, logit_scale=0.25,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base.pop("rms_norm_eps")
    base.update(kw)
    return (config_class or CohereConfig)(**base)


def _arch_cohere():
    # Command-R: bias-free LayerNorm, parallel attention + MLP from one norm, interleaved (GPT-J) RoPE,
    # logits x logit_scale, tied head (3 layers keep greedy decoding varied).
    return _cohere(num_hidden_layers=3)


def _arch_cohere_qk_norm():
    # Command-R+ style per-head LayerNorms on q and k (weights [heads, head_dim]); with attention biases on q, k,
    # v and o; untied head (lm_head.weight in the file).
    return _cohere(use_qk_norm=True, attention_bias=True, tie_word_embeddings=False)


def _arch_cohere2():
    from transformers import Cohere2Config

    # Command R7B / Command A: Command-R's parallel LayerNorm blocks (tied, logit_scale 0.25) where
    # sliding_window_pattern 2 makes layers 0 and 2 sliding (window 16) and rotated, and layer 1 global and NoPE;
    # attention biases on q, k, v and o; head_dim 32 != H/nh (config.json's head_dim is the one used).
    return _cohere(num_hidden_layers=3, head_dim=32, sliding_window=16, sliding_window_pattern=2,
                   attention_bias=True, config_class=Cohere2Config)


def _glm(config_class, **kw):
    # GLM-4: fused gate_up_proj, q/k/v biases (o has none), RoPE on the first half of each head in GPT-J pairs.
    return config_class(**_cfg(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.5}, **kw))


def _arch_glm():
    from transformers import GlmConfig

    # glm-4-9b-chat-hf: pre-norm Llama blocks otherwise; head_dim 16, so 8 dims (4 pairs) rotate.
    return _glm(GlmConfig, head_dim=16)


def _arch_glm4():
    from transformers import Glm4Config

    # GLM-4-0414: four norms per layer (post_self_attn_layernorm on the attention output, post_attention_layernorm
    # before the MLP, post_mlp_layernorm on its output); head_dim 32 != H/nh, 16 dims rotate; 3 layers.
    return _glm(Glm4Config, head_dim=32, num_hidden_layers=3)


def _arch_glm4_moe():
    from transformers import Glm4MoeConfig

    # GLM-4.5: DeepSeek-V3 routing (4 groups of 2 experts, the best 2 groups; scaling 2.5; one shared expert; layer 0
    # dense) under GQA with q/k/v biases, q/k norms and rotate-half RoPE on the first 16 of head_dim 32.
    return Glm4MoeConfig(**_cfg(num_hidden_layers=3, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                attention_bias=True, use_qk_norm=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5}))


def _arch_smollm3():
    from transformers import SmolLM3Config

    # SmolLM3: layers 2 and 5 without RoPE (no_rope_layer_interval 3), rope_theta 1000 on the others; tied head.
    return SmolLM3Config(**_cfg(num_hidden_layers=6, head_dim=16, no_rope_layer_interval=3, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}))


def _arch_seed_oss():
    from transformers import SeedOssConfig

    # Seed-OSS: q/k/v biases, an o_proj bias under its own switch, head_dim 32 != H/nh.
    return SeedOssConfig(**_cfg(head_dim=32, attention_bias=True, attention_out_bias=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_gpt_oss():
    from transformers import GptOssConfig

    # gpt-oss: 4 experts (2 a token) fused with interleaved gate/up columns and biases, the clamped SwiGLU, sink
    # logits, sliding (window 16) and full layers alternating, YaRN with truncate off; head_dim 16.
    return GptOssConfig(**_cfg(head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False}))


def _arch_ernie4_5_moe():
    from transformers import Ernie4_5_MoeConfig

    # ERNIE 4.5 MoE: layer 0 dense, layers 1-2 with 4 experts (2 a token, chosen by probability plus a bias) beside
    # one shared expert; GPT-J RoPE pairs.
    return Ernie4_5_MoeConfig(**_cfg(num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                     moe_k=2, moe_num_experts=4, moe_num_shared_experts=1, moe_layer_start_index=1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_dots1():
    from transformers import Dots1Config

    # dots.llm1: GLM-4.5's DeepSeek-V3 routing (no renormalization, scaling 2.5) under Qwen3 attention (per-head q/k
    # norms, full RoPE); layer 0 dense.
    return Dots1Config(**_cfg(num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                              first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_ernie4_5():
    from transformers import Ernie4_5Config

    # ERNIE 4.5: RoPE on GPT-J pairs, biases on every projection (use_bias), tied head; head_dim 32.
    return Ernie4_5Config(**_cfg(head_dim=32, use_bias=True, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_exaone4():
    from transformers import Exaone4Config

    # EXAONE 4: OLMo 2's output norms, per-head q/k norms; layers 0-2 slide (window 16) with RoPE, layer 3 is global
    # and NoPE.
    return Exaone4Config(**_cfg(num_hidden_layers=4, head_dim=16, sliding_window=16, sliding_window_pattern=4,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_minimax_m2():
    from transformers import MiniMaxM2Config

    # MiniMax-M2: 4 experts (2 a token) by sigmoid scores with a selection bias, q/k norms over whole projections,
    # RoPE on the first half of head_dim 32.
    return MiniMaxM2Config(**_cfg(head_dim=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5}))


def _arch_olmo2():
    from transformers import Olmo2Config

    # OLMo 2: norms after attention and MLP only, RMSNorms over the whole q and k projections.
    return Olmo2Config(**_cfg(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_olmo3():
    from transformers import Olmo3Config

    # OLMo 3: OLMo 2's layers, sliding (window 16) three in four, with rope per layer type; 4 layers.
    return Olmo3Config(**_cfg(num_hidden_layers=4, sliding_window=16))


def _arch_mistral3():
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    # Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration) used as text only: the Mistral decoder is saved
    # under language_model.model.* / language_model.lm_head.*, next to a (tiny) Pixtral vision tower and projector
    # that must be ignored. head_dim 32 != H/nh; sliding_window null (full attention), as the real text_config.
    text = MistralConfig(**_cfg(head_dim=32, sliding_window=None,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, image_size=28, patch_size=14)
    return Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _arch_qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    # Qwen2.5-VL used as text: a Qwen2 decoder (q/k/v biases) with M-RoPE sections [2, 3, 3] over head_dim 16's 8
    # frequencies, under model.language_model.*, next to a tiny vision tower (model.visual.*) that must be ignored.
    # Text alone has equal (t, h, w) positions: plain RoPE. The image path is tests/test_vision_qwen2vl_chat.py's.
    text = _cfg(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_BASE["hidden_size"],
                  window_size=56, fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _arch_qwen3_vl():
    from transformers import Qwen3VLConfig

    # Qwen3-VL used as text: a Qwen3 decoder (q/k norms) with interleaved M-RoPE sections [4, 2, 2] over head_dim
    # 16's 8 frequencies, next to a tiny vision tower that must be ignored. The image path (interleaved 3-D
    # positions, DeepStack rows) is tests/test_vision_qwen3vl_chat.py's.
    text = _cfg(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                              "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_BASE["hidden_size"],
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _arch_qwen3_vl_moe():
    from transformers import Qwen3VLMoeConfig

    # Qwen3-VL-MoE (30B-A3B style) as text: Qwen3-MoE layers whose experts transformers keeps fused
    # (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and whose router always renormalizes its
    # top-k; interleaved M-RoPE as qwen3_vl.
    text = _cfg(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                              "mrope_interleaved": True},
                **{**{k: v for k, v in _QWEN_MOE.items() if k not in ("mlp_only_layers", "rope_parameters")},
                   "moe_intermediate_size": 96})   # 2·96 ≠ 64: the fused tensors' orientation is unambiguous
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_BASE["hidden_size"],
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _arch_phi3():
    from transformers import Phi3Config

    return Phi3Config(**_cfg(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _arch_phi3_longrope():
    from transformers import Phi3Config

    # Phi-4-mini style: partial rotary 0.75 (12 of 16 dims, 6 pairs). The top-level
    # original_max_position_embeddings (32 < 80) overrides the one in rope_parameters, so long factors
    # apply whenever the highest position + 1 exceeds 32.
    gen = torch.Generator().manual_seed(1234)
    short = (1.0 + torch.rand(6, generator=gen)).tolist()
    long = (1.0 + 4.0 * torch.rand(6, generator=gen)).tolist()
    return Phi3Config(
        **_cfg(
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.75,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": short,
                "long_factor": long,
                "original_max_position_embeddings": 32,
            },
        )
    )


def _deepseek(**kw):
    from transformers import DeepseekV3Config

    base = _cfg(
        num_hidden_layers=3,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rms_norm_eps=1e-6,
    )
    base.update(kw)
    return DeepseekV3Config(**base)


def _arch_deepseek_v3():
    # YaRN with mscale != mscale_all_dim so both the cos/sin factor and the softmax-scale factor differ from 1.
    return _deepseek(
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    )


def _arch_deepseek_v3_no_qlora():
    # DeepSeek-V2-Lite style attention: plain q_proj, non-interleaved rope, default rope, no top-k renorm.
    return _deepseek(
        q_lora_rank=None,
        rope_interleave=False,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _arch_deepseek_v2():
    from transformers import DeepseekV2Config

    # DeepSeek-V2: softmax router, group-limited greedy (4 groups of 2, the best 1: both experts from it, which an
    # unlimited top-2 would often not pick), routed_scaling_factor applied without
    # renormalisation; q_lora as V2 (V2-Lite has none: deepseek_v3_no_qlora covers that attention).
    cfg = _deepseek().to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "moe_intermediate_size", "num_experts_per_tok",
            "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    return DeepseekV2Config(**{k: cfg[k] for k in keep if k in cfg}, n_routed_experts=8, n_shared_experts=1,
                            n_group=4, topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=2.5,
                            norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _arch_llama4():
    from transformers import Llama4TextConfig

    # Layers 0, 1 use rope + chunked attention (chunk 16) + L2 qk-norm; layer 2 is NoPE, full attention,
    # with temperature tuning (floor_scale 16 so it changes scales inside 80 tokens). Layer 1 is MoE.
    return Llama4TextConfig(
        **_cfg(
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 0],
            attention_chunk_size=16,
            use_qk_norm=True,
            attn_temperature_tuning=True,
            floor_scale=16,
            attn_scale=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


ARCHS: dict[str, Callable] = {
    "llama": _arch_llama,
    "llama3_rope": _arch_llama3_rope,
    "llama_linear_rope": _arch_llama_linear_rope,
    "llama_dynamic_rope": _arch_llama_dynamic_rope,
    "llama_yarn_rope": _arch_llama_yarn_rope,
    "llama_tied": _arch_llama_tied,
    "mistral_swa": _arch_mistral_swa,
    "mixtral": _arch_mixtral,
    "qwen2": _arch_qwen2,
    "qwen3": _arch_qwen3,
    "qwen3_moe": _arch_qwen3_moe,
    "qwen2_moe": _arch_qwen2_moe,
    "gemma": _arch_gemma,
    "gemma2": _arch_gemma2,
    "gemma3": _arch_gemma3,
    "granite": _arch_granite,
    "cohere": _arch_cohere,
    "cohere_qk_norm": _arch_cohere_qk_norm,
    "cohere2": _arch_cohere2,
    "glm": _arch_glm,
    "glm4": _arch_glm4,
    "glm4_moe": _arch_glm4_moe,
    "smollm3": _arch_smollm3,
    "seed_oss": _arch_seed_oss,
    "olmo2": _arch_olmo2,
    "minimax_m2": _arch_minimax_m2,
    "ernie4_5": _arch_ernie4_5,
    "dots1": _arch_dots1,
    "ernie4_5_moe": _arch_ernie4_5_moe,
    "gpt_oss": _arch_gpt_oss,
    "exaone4": _arch_exaone4,
    "olmo3": _arch_olmo3,
    "mistral3": _arch_mistral3,
    "qwen2_5_vl": _arch_qwen2_5_vl,
    "qwen3_vl": _arch_qwen3_vl,
    "qwen3_vl_moe": _arch_qwen3_vl_moe,
    "phi3": _arch_phi3,
    "phi3_longrope": _arch_phi3_longrope,
    "deepseek_v3": _arch_deepseek_v3,
    "deepseek_v3_no_qlora": _arch_deepseek_v3_no_qlora,
    "deepseek_v2": _arch_deepseek_v2,
    "llama4": _arch_llama4,
}


@torch.no_grad()
def _randomize(model: nn.Module, config, seed: int) -> None:
    """Redraw every weight so norms, biases and routers all matter and activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    gemma = config.model_type in ("gemma", "gemma2", "gemma3_text")
    llama4 = config.model_type == "llama4_text"

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.copy_(0.1 * randn(p.shape))
        elif p.ndim == 1 or name.endswith("norm.weight"):
            # Norm weights (Cohere's q/k norms are [heads, head_dim]): Gemma stores w and multiplies by (1 + w);
            # the others multiply by w.
            p.copy_((0.0 if gemma else 1.0) + 0.1 * randn(p.shape))
        elif "embed_tokens" in name:
            # Gemma multiplies embeddings by sqrt(hidden). A tied head scores the input token's own
            # embedding highly, so tied models get smaller embeddings to keep greedy decoding varied.
            scale = config.hidden_size**-0.5 * 0.25 if gemma else (0.1 if config.tie_word_embeddings else 1.0)
            p.copy_(randn(p.shape) * scale)
        elif p.ndim == 3:
            # Fused expert tensors: Llama4 stores [E, in, out], the others [E, out, in].
            fan_in = p.shape[1] if llama4 else p.shape[2]
            p.copy_(randn(p.shape) * fan_in**-0.5)
        else:
            p.copy_(randn(p.shape) * p.shape[1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * randn(b.shape))


def _auto_class(config):
    """The transformers auto class of `config`: image-text-to-text for the multimodal wrappers (used as text only)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    wrapped = ("mistral3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    return AutoModelForImageTextToText if config.model_type in wrapped else AutoModelForCausalLM


def build_tiny(name: str, out_dir: Path, seed: int = 0, vocab_size: int | None = None) -> Path:
    """Build the tiny float32 model `name` with weights drawn from `seed` and save it as safetensors.
    `vocab_size` replaces the 256 of the fixtures (e.g. to run a real tokenizer's ids through it)."""
    config = ARCHS[name]()
    if vocab_size is not None:
        config.get_text_config().vocab_size = vocab_size
    return build_config(config, out_dir, seed)


def build_config(config, out_dir: Path, seed: int = 0) -> Path:
    """`build_tiny` for a config of one's own (a variant of an ARCHS entry)."""
    model = _auto_class(config).from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, config, seed)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _load(model_dir: Path):
    from transformers import AutoConfig

    auto = _auto_class(AutoConfig.from_pretrained(Path(model_dir)))
    model = auto.from_pretrained(Path(model_dir), attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def _batched(input_ids: torch.Tensor) -> tuple[torch.Tensor, bool]:
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim == 1:
        return input_ids[None], True
    return input_ids, False


@torch.no_grad()
def reference_logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits of one full forward pass over `input_ids` ([T] -> [T, V], [B, T] -> [B, T, V])."""
    ids, squeeze = _batched(input_ids)
    logits = _load(model_dir)(input_ids=ids, use_cache=False).logits.float()
    return logits[0] if squeeze else logits


@torch.no_grad()
def reference_decode(
    model_dir: Path, input_ids: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Greedy decoding through transformers' own KV cache, one token per forward.

    Returns (prefill_logits, step_logits, tokens): prefill_logits are the logits of every prompt position
    ([T, V] or [B, T, V]); tokens[i] is the greedy token fed at decode step i (tokens[0] is the argmax of
    the last prefill position, tokens[i + 1] the argmax of step_logits[i]); step_logits[i] are the logits
    ([V] or [B, V]) produced by feeding tokens[i]. len(step_logits) == tokens.shape[-1] == steps.
    """
    from transformers import DynamicCache

    ids, squeeze = _batched(input_ids)
    model = _load(model_dir)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    prefill = out.logits.float()
    cache = out.past_key_values
    nxt = prefill[:, -1].argmax(-1)
    steps_out: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    for _ in range(steps):
        tokens.append(nxt)
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
        steps_out.append(logits[0] if squeeze else logits)
        nxt = logits.argmax(-1)
    toks = torch.stack(tokens, dim=-1) if tokens else torch.empty(ids.shape[0], 0, dtype=torch.long)
    if squeeze:
        return prefill[0], steps_out, toks[0]
    return prefill, steps_out, toks
