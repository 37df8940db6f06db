"""ModelSpec: every architecture fact the runtime needs, in one frozen object built from config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from exl2.models.rope import RopeOverride, RopeSpec, mrope_axes


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts block. `router` picks the routing rule; `style` the tensor naming."""

    num_experts: int
    top_k: int
    expert_dim: int
    router: str = "softmax"          # softmax | softmax_grouped (DeepSeek-V2) | sigmoid_grouped (V3) | sigmoid_input
    #                                  | softmax_topk (gpt-oss: the top-k logits, with the router's bias, softmaxed)
    #                                  | softmax_biased (ERNIE 4.5: softmax, chosen by probability + bias, renormed)
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_dim: int = 0              # intermediate size of the always-on shared expert(s), 0 if none
    shared_gate: bool = False        # the shared expert's output scaled by sigmoid(x · g) (Qwen2-MoE)
    style: str = "mixtral"           # mixtral | qwen | deepseek | llama4 | gpt_oss


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention dimensions."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LayerSpec:
    """Per-layer variations: attention window, RoPE use and table, dense or MoE feed-forward."""

    sliding_window: Optional[int] = None   # attend to the last W positions (including the current one)
    chunk_size: Optional[int] = None       # Llama 4 chunked attention
    use_rope: bool = True
    local_rope: bool = False               # use ModelSpec.local_rope (Gemma 3 sliding layers)
    moe: bool = False
    dense_dim: Optional[int] = None        # intermediate size of a dense layer when it differs from the default
    qk_l2_norm: bool = False               # Llama 4 L2 norm on q/k (rope layers only)
    temperature_tuning: bool = False       # Llama 4 attention temperature on NoPE layers


# The sandwich norms' tensor names in a layer, by role: on the attention output, on the MLP input, on the MLP output.
# The decoder keeps Gemma's names for the roles as its attributes; GLM-4-0414 stores the same three under others.
GEMMA_SANDWICH = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
GLM4_SANDWICH = ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
# OLMo 2/3 norm each sublayer's output only: no norm before the MLP (nor before attention: ModelSpec.pre_norm)
OLMO2_SANDWICH = ("post_attention_layernorm", "", "post_feedforward_layernorm")


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    norm_eps: float
    rope: RopeSpec
    layers: tuple[LayerSpec, ...]
    activation: str = "silu"               # silu | gelu_tanh
    norm_offset: float = 0.0               # Gemma stores w-1: scale is (offset + w)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                  # per-head RMSNorm on q and k (Qwen3, Gemma 3; Cohere: LayerNorm)
    qk_norm_full: bool = False             # that RMSNorm over the whole q and k projections (OLMo 2/3)
    pre_norm: bool = True                  # norm each sublayer's input; False: OLMo 2/3 norm outputs only
    attn_sinks: bool = False               # gpt-oss: a learned logit per head joins each softmax (`self_attn.sinks`)
    sandwich_norm: bool = False            # Gemma 2/3, GLM-4-0414: norms after attention and MLP too
    image_blocks: bool = False             # Gemma 3: a prompt's image tokens attend to their whole image
    mrope_section: Optional[tuple[int, ...]] = None   # Qwen2-VL: frequencies per (t, h, w) position (M-RoPE)
    mrope_interleaved: bool = False        # Qwen3-VL: those frequencies interleaved t, h, w, … (rope.mrope_axes)
    sandwich_names: tuple[str, str, str] = GEMMA_SANDWICH   # their tensor names (see GEMMA_SANDWICH)
    norm_type: str = "rms"                 # rms | layernorm (Cohere: mean-centred, weight only, no bias)
    parallel_block: bool = False           # Cohere: x + attn(n(x)) + mlp(n(x)), one norm per layer
    embed_scale: float = 1.0
    residual_scale: float = 1.0            # Granite residual_multiplier: each sublayer's output × it before the add
    logit_scale: float = 1.0               # logits × it (Granite 1/logits_scaling, Cohere logit_scale)
    attn_scale: Optional[float] = None     # softmax scale; default head_dim ** -0.5
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    tie_embeddings: bool = False
    fused_qkv: bool = False                # Phi-3 qkv_proj in the source files (a gate_up_proj is found by name)
    local_rope: Optional[RopeSpec] = None
    moe: Optional[MoESpec] = None
    mla: Optional[MLASpec] = None
    mlp_key: str = "mlp"                   # name of the feed-forward module inside a layer
    attn_temperature: tuple[float, float] = (0.0, 8192.0)   # Llama 4 (attn_scale, floor_scale)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, hash=False, compare=False)
    # the user's RoPE override (-rs/-ra/-ry) this spec was built with; max_position is then the context it covers
    rope_override: Optional[RopeOverride] = None

    @property
    def native_max_position(self) -> int:
        """config.json's max_position_embeddings, before a RoPE override extended `max_position`."""
        return self.rope.max_position

    @property
    def mrope_axes(self) -> Optional[tuple[int, ...]]:
        """The position axis each rotary frequency turns with (M-RoPE models; rope.mrope_axes), else None."""
        return None if self.mrope_section is None else mrope_axes(self.mrope_section, self.mrope_interleaved)

    @property
    def num_params_hint(self) -> int:
        """Rough parameter count for display (embeddings + attention + MLP per layer)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp_dense = 3 * h * i
        total = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        for layer in self.layers:
            if layer.moe and self.moe:
                m = self.moe
                total += attn + 3 * h * m.expert_dim * m.num_experts + 3 * h * m.shared_dim
            else:
                total += attn + (3 * h * layer.dense_dim if layer.dense_dim else mlp_dense)
        return total
