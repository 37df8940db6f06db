"""One generic decoder for every supported architecture, driven by a ModelSpec.

Weights come through a `WeightProvider` (see exl2.runtime.weights): the decoder asks for linears and tensors by
their Hugging Face names and never sees file formats. A model split over several GPUs (runtime.placement) gets one
provider per decoder layer and one for the final norm and head, each loading onto its own device.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Protocol, Sequence

import torch
from torch import nn

from exl2.errors import ModelLoadError
from exl2.models.layers import (GatedMLP, MoE, RMSNorm, attention, l2_norm, make_norm, norm_pair, softcap,
                               temperature_scale)
from exl2.kernels.attention import scatter_columns, varlen_attention
from exl2.kernels.qweight import dequantize_torch
from exl2.kernels.rotary import apply_rotary
from exl2.models.rope import positioned, rope_index
from exl2.models.routed_experts import prepare_routed
from exl2.models.spec import LayerSpec, ModelSpec
from exl2.kernels import quant_matmul as qm
from exl2.kernels.quant_matmul import uses_permuted_input
from exl2.kernels.split_sum import SplitSum
from exl2.runtime.linear import Linear, permuted_indices, project, share_inputs
from exl2.runtime.load_progress import report

NO_HEAD = "This model has no output head (an embedding model): it computes embeddings, not text."


def last_rows(normed: torch.Tensor, last_only: bool | torch.Tensor) -> torch.Tensor:
    """The positions whose logits a forward returns: all, the last ([B, 1, H]), or per row ([B] indices)."""
    if isinstance(last_only, torch.Tensor):
        rows = torch.arange(normed.shape[0], device=normed.device)
        return normed[rows, last_only.to(normed.device)][:, None]
    return normed[:, -1:] if last_only else normed


def put_rows(x: torch.Tensor, inject: tuple) -> None:
    """Write rows [n, H] over the positions (flat indices into x's [B, T]) of x [B, T, H], in place: the
    embeddings of a prompt's images in place of their tokens' (generation.images)."""
    x.view(-1, x.shape[-1]).index_copy_(0, inject[0], inject[1].to(x.dtype))


def deep_rows(x: torch.Tensor, inject: Optional[tuple], layer: int) -> torch.Tensor:
    """x [B, T, H] after decoder layer `layer`, plus that layer's DeepStack rows at the image positions when
    `inject` carries them (its third entry: one [n, H] per early layer; Qwen3-VL adds its tower's intermediate
    features to the first layers' outputs)."""
    if inject is None or len(inject) < 3 or layer >= len(inject[2]):
        return x
    x = x.contiguous()
    x.view(-1, x.shape[-1]).index_add_(0, inject[0].to(x.device), inject[2][layer].to(x.device, x.dtype))
    return x


def _summed(y, like: torch.Tensor) -> torch.Tensor:
    """y, or the sum of a `SplitSum` in like's dtype (for the paths that add a module's output themselves)."""
    return y.total(like.dtype) if isinstance(y, SplitSum) else y


def residual_scaled(spec, h: torch.Tensor) -> torch.Tensor:
    """A sublayer's output as the residual add takes it: × Granite's residual_multiplier (else as it is)."""
    m = spec.residual_scale
    return h if m == 1.0 else h * m


def on_device(device: Optional[torch.device]):
    """Make `device` the current CUDA device inside the block: Triton launches on the current device, not on
    its tensors' device (a no-op context for the CPU)."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext()


class WeightProvider(Protocol):
    def has(self, name: str) -> bool: ...
    def embedding_only(self) -> bool: ...
    def tensor(self, name: str) -> torch.Tensor: ...
    def linear(self, prefix: str, in_features: int, out_features: int, bias: bool) -> nn.Module: ...
    def linears_split(self, prefix: str, in_features: int, sizes: list[int], bias: bool) -> list[nn.Module]: ...
    def expert_linears(self, prefix: str, num: int, hidden: int, dim: int, interleaved: bool = False,
                       bias: bool = False) -> list[tuple[nn.Module, nn.Module, nn.Module]]: ...


class KVCache:
    """Contiguous per-layer key/value cache for incremental decoding: [B, max_len, Hkv, D].

    Caches implement `attend`, so the decoder never knows how keys are stored (the paged, quantized cache in
    exl2.runtime has the same method, backed by kernels). `layer_devices` (one per layer) overrides `device`."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 layer_devices: Optional[Sequence[torch.device]] = None):
        devs = list(layer_devices) if layer_devices is not None else [device] * num_layers
        self.k = [torch.zeros(batch, max_len, kv_heads, k_dim, dtype=dtype, device=d) for d in devs]
        self.v = [torch.zeros(batch, max_len, kv_heads, v_dim, dtype=dtype, device=d) for d in devs]
        self.max_len = max_len
        self.length = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               scale: float, window=None, chunk=None, softcap=None, out_index=None, rope=None,
               sinks=None) -> torch.Tensor:
        """Store k/v at the positions q_pos ([B, T], contiguous per row) and attend over everything cached;
        `out_index`: return `[B·T, H·Dv]` rows in that column order instead; `rope` (cos, sin, interleaved):
        rotate q and k first (see PagedKVCache.attend); `sinks`: gpt-oss's per-head logits."""
        b, t = q_pos.shape
        if rope is not None:
            apply_rotary(q, k, rope[0], rope[1], rope_index(rope, q_pos), 2 * rope[0].shape[-1], rope[2])
        starts = q_pos[:, 0].tolist()
        for i, s0 in enumerate(starts):
            self.k[layer][i, s0:s0 + t] = k[i]
            self.v[layer][i, s0:s0 + t] = v[i]
        end = int(q_pos[:, -1].max()) + 1
        o = attention(q, self.k[layer][:b, :end], self.v[layer][:b, :end], q_pos, scale, window, chunk, softcap,
                      sinks=sinks)
        return o if out_index is None else scatter_columns(o.reshape(b * t, *o.shape[2:]), out_index)


class Attention(nn.Module):
    """Grouped-query attention with the per-architecture options of ModelSpec/LayerSpec."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, idx: int, w: WeightProvider, prefix: str):
        super().__init__()
        self.spec, self.layer, self.idx = spec, layer, idx
        h, hk, d, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        sizes = [h * d, hk * d, hk * d]
        if spec.fused_qkv and w.has(f"{prefix}.qkv_proj.weight"):
            self.q_proj, self.k_proj, self.v_proj = w.linears_split(f"{prefix}.qkv_proj", hid, sizes, spec.qkv_bias)
        else:
            self.q_proj = w.linear(f"{prefix}.q_proj", hid, sizes[0], spec.qkv_bias)
            self.k_proj = w.linear(f"{prefix}.k_proj", hid, sizes[1], spec.qkv_bias)
            self.v_proj = w.linear(f"{prefix}.v_proj", hid, sizes[2], spec.qkv_bias)
        self.o_proj = w.linear(f"{prefix}.o_proj", h * d, hid, spec.o_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm or spec.qk_norm_full:
            self.q_norm = make_norm(spec, w.tensor(f"{prefix}.q_norm.weight"))
            self.k_norm = make_norm(spec, w.tensor(f"{prefix}.k_norm.weight"))
        self.scale = spec.attn_scale if spec.attn_scale is not None else d ** -0.5
        self.sinks = w.tensor(f"{prefix}.sinks") if spec.attn_sinks else None

    def shared_input_linears(self) -> tuple[nn.Module, ...]:
        """The projections that read this block's input (their equal input orders are aliased at load)."""
        return self.q_proj, self.k_proj, self.v_proj

    def permuted_indices(self):
        """Distinct input orders of q/k/v for a norm that writes their permuted inputs (None: not quantized)."""
        return permuted_indices(self.shared_input_linears())

    def forward(self, x: torch.Tensor, q_pos: torch.Tensor, rope: Optional[tuple], cache=None,
                xp: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, _ = x.shape
        order = self._o_order(b * t, x) if cache is not None else None
        if order is not None:  # the attention writes o_proj's permuted input: no gather launch
            return self.o_proj.forward_permuted(self.heads(x, q_pos, rope, cache, xp, order), (b, t))
        return self.o_proj(self.heads(x, q_pos, rope, cache, xp))

    def heads(self, x: torch.Tensor, q_pos: torch.Tensor, rope: Optional[tuple], cache=None,
              xp: Optional[torch.Tensor] = None, out_index: Optional[torch.Tensor] = None,
              qkv: Optional[tuple] = None) -> torch.Tensor:
        """The attention output before o_proj, `[B, T, H·Dv]` (with `out_index`, the rows `[B·T, H·Dv]` in that
        column order): what a tensor-parallel shard exchanges before its share of o_proj (runtime.tp). `qkv`: the
        projections of x already made (and, for whole-projection q/k norms, normed: a shard's norm needs every
        shard's sums)."""
        b, t, _ = x.shape
        s, layer = self.spec, self.layer
        if qkv is not None:
            q, k, v = qkv
        else:
            q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), xp)
            if s.qk_norm_full:
                q, k = self.q_norm(q.reshape(b, t, -1)), self.k_norm(k.reshape(b, t, -1))
        q = q.view(b, t, s.num_heads, s.head_dim)
        k = k.view(b, t, s.num_kv_heads, s.head_dim)
        v = v.view(b, t, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and not s.qk_norm_full:
            q, k = norm_pair(self.q_norm, self.k_norm, q, k)
        # with a cache and nothing between RoPE and attention, the cache applies it while storing k
        rope_in_cache = rope is not None and cache is not None and not (layer.qk_l2_norm or layer.temperature_tuning)
        if rope is not None and not rope_in_cache:
            cos, sin, inter = rope[:3]
            apply_rotary(q, k, cos, sin, rope_index(rope, q_pos), 2 * cos.shape[-1], inter)
        if layer.qk_l2_norm:
            q, k = l2_norm(q, s.norm_eps), l2_norm(k, s.norm_eps)
        if layer.temperature_tuning:
            q = temperature_scale(q, q_pos, *s.attn_temperature)
        args = (q_pos, self.scale, layer.sliding_window, layer.chunk_size, s.attn_softcap)
        if cache is None:
            return attention(q, k, v, *args, sinks=self.sinks).reshape(b, t, -1)
        kw = {"rope": rope} if rope_in_cache else {}
        if self.sinks is not None:
            kw["sinks"] = self.sinks
        if out_index is not None:
            return cache.attend(self.idx, q, k, v, *args, out_index=out_index, **kw)
        return cache.attend(self.idx, q, k, v, *args, **kw).reshape(b, t, -1)

    def _o_order(self, rows: int, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Where each attention output column goes in o_proj's permuted input, when o_proj reads one."""
        kernel = getattr(self.o_proj, "kernel", None)
        if kernel is None or not uses_permuted_input(rows, x):
            return None
        return kernel.scatter_index()


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention. With a cache, the cache holds one latent row a token (the normed
    kv_lora_rank vector and the rotated RoPE key, 576 values for DeepSeek-V3 where expanded keys and values
    take 40,960): kv_b_proj's key half is absorbed into the queries and its value half applied to the attention
    output (`latent`), so every head attends over the one shared latent "KV head". Without a cache (the
    quantizer's passes) keys and values are expanded per head, as the reference computes them."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, idx: int, w: WeightProvider, prefix: str):
        super().__init__()
        m = spec.mla
        self.spec, self.layer, self.idx, self.m = spec, layer, idx, m
        hid, h = spec.hidden_size, spec.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a_proj = w.linear(f"{prefix}.q_a_proj", hid, m.q_lora_rank, spec.qkv_bias)
            self.q_a_norm = RMSNorm(w.tensor(f"{prefix}.q_a_layernorm.weight"), 1e-6)  # fixed eps, as in HF
            self.q_b_proj = w.linear(f"{prefix}.q_b_proj", m.q_lora_rank, h * qk, False)
        else:
            self.q_proj = w.linear(f"{prefix}.q_proj", hid, h * qk, False)
        self.kv_a_proj = w.linear(f"{prefix}.kv_a_proj_with_mqa", hid, m.kv_lora_rank + m.qk_rope_head_dim,
                                  spec.qkv_bias)
        self.kv_a_norm = RMSNorm(w.tensor(f"{prefix}.kv_a_layernorm.weight"), 1e-6)
        self.kv_b_proj = w.linear(f"{prefix}.kv_b_proj", m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim),
                                  False)
        self.o_proj = w.linear(f"{prefix}.o_proj", h * m.v_head_dim, hid, spec.o_bias)
        self.scale = spec.attn_scale
        self._latent: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def latent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as (W_UK [H, nope, rank], W_UV [H, v, rank]), dense (a quantized kv_b_proj is dequantized
        once, on first use: 33 MB a layer in fp16 for DeepSeek-V3)."""
        if self._latent is None:
            m, h, kv_b = self.m, self.spec.num_heads, self.kv_b_proj
            if kv_b.weight is not None:
                dense = kv_b.weight
            else:
                dense = dequantize_torch(kv_b.kernel)[:, : kv_b.out_features].t()
            dense = dense.reshape(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            self._latent = (dense[:, : m.qk_nope_head_dim].contiguous(), dense[:, m.qk_nope_head_dim:].contiguous())
        return self._latent

    def forward(self, x, q_pos, rope, cache=None):
        return self.o_proj(self.heads(x, q_pos, rope, cache))

    def heads(self, x: torch.Tensor, q_pos: torch.Tensor, rope: Optional[tuple], cache=None) -> torch.Tensor:
        """The attention output before o_proj, `[B, T, H·v_head_dim]` (what a tensor-parallel shard exchanges)."""
        b, t, _ = x.shape
        m, h = self.m, self.spec.num_heads
        if m.q_lora_rank:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, t, h, -1)
        # slices, not split(): the quantizer's sensitivity pass differentiates through here, and autograd refuses
        # in-place writes (the rotation below) into the views of a multi-output split
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        ckv = self.kv_a_proj(x)
        c, k_pe = ckv[..., :m.kv_lora_rank], ckv[..., m.kv_lora_rank:]
        if cache is not None:
            return self._latent_attention(q, q_nope, q_pe, c, k_pe, q_pos, rope, cache)
        kv = self.kv_b_proj(self.kv_a_norm(c)).view(b, t, h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = k_pe.view(b, t, 1, m.qk_rope_head_dim)
        cos, sin, inter = rope[:3]
        # in place, through the views
        apply_rotary(q_pe, k_pe, cos, sin, rope_index(rope, q_pos), m.qk_rope_head_dim, inter)
        k = torch.cat([k_nope, k_pe.expand(b, t, h, m.qk_rope_head_dim)], dim=-1)
        o = attention(q, k, v.contiguous(), q_pos, self.scale)
        return o.reshape(b, t, -1)

    def _latent_attention(self, q, q_nope, q_pe, c, k_pe, q_pos, rope, cache):
        """Attention over the cached latent rows: q·k = (W_UKᵀ q_nope)·c + q_pe·k_pe, o = W_UV (Σ p·c)."""
        b, t = q.shape[:2]
        m = self.m
        c = self.kv_a_norm(c)
        k_pe = k_pe.reshape(b, t, 1, m.qk_rope_head_dim)
        cos, sin, inter = rope[:3]
        apply_rotary(q_pe, k_pe, cos, sin, rope_index(rope, q_pos), m.qk_rope_head_dim, inter)
        k_lat = torch.cat([c, k_pe.reshape(b, t, -1)], dim=-1).view(b, t, 1, -1)
        v_lat = c.reshape(b, t, 1, -1).contiguous()
        fresh = getattr(cache, "fresh_prompt", None)
        if fresh is not None and fresh(self.idx, q_pos):
            # a fresh prompt attends among its own tokens in the expanded form (192 + 128 values a head against
            # the latent 576 + 512), and leaves its latent rows in the cache
            cache.store(self.idx, k_lat, v_lat, q_pos)
            h = self.spec.num_heads
            kv = self.kv_b_proj(c).view(b, t, h, m.qk_nope_head_dim + m.v_head_dim)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(b, t, h, m.qk_rope_head_dim)], dim=-1)
            o = varlen_attention(q.reshape(b * t, h, -1), k.reshape(b * t, h, -1), v.reshape(b * t, h, -1),
                                 list(range(0, b * t + 1, t)), t, scale=self.scale, backend=cache.prefill_backend)
            return o.reshape(b, t, -1)
        w_uk, w_uv = self.latent()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk.to(q.dtype))
        q_full = torch.cat([q_lat, q_pe], dim=-1)
        o = cache.attend(self.idx, q_full, k_lat, v_lat, q_pos, self.scale)
        o = torch.einsum("bthr,hvr->bthv", o, w_uv.to(o.dtype))
        return o.reshape(b, t, -1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, idx: int, w: WeightProvider):
        super().__init__()
        self.spec, self.idx = spec, idx
        layer = spec.layers[idx]
        self.layer = layer
        p = f"model.layers.{idx}"
        self.input_layernorm = make_norm(spec, w.tensor(f"{p}.input_layernorm.weight")) if spec.pre_norm else \
            nn.Identity()
        if spec.sandwich_norm:  # attributes named for Gemma's roles, tensors as the architecture names them
            after_attn, before_mlp, after_mlp = (make_norm(spec, w.tensor(f"{p}.{name}.weight")) if name
                                                 else nn.Identity() for name in spec.sandwich_names)
            self.post_attention_layernorm = after_attn
            self.pre_feedforward_layernorm = before_mlp
            self.post_feedforward_layernorm = after_mlp
        elif not spec.parallel_block:  # a parallel block's attention and MLP both read input_layernorm's output
            self.post_attention_layernorm = make_norm(spec, w.tensor(f"{p}.post_attention_layernorm.weight"))
        attn_cls = MLAttention if spec.mla is not None else Attention
        self.self_attn = attn_cls(spec, layer, idx, w, f"{p}.self_attn")
        self.mlp = build_mlp(spec, layer, w, f"{p}.{spec.mlp_key}")

    def attn_block(self, x, q_pos, rope, cache=None) -> torch.Tensor:
        """Residual stream after the attention half of the layer; q_pos [B, T] absolute positions."""
        self._check_sequential()
        h = _summed(self.self_attn(self.input_layernorm(x), q_pos, rope, cache), x)
        if self.spec.sandwich_norm:
            h = self.post_attention_layernorm(h)
        return x + self._scaled(h)

    def mlp_block(self, x) -> torch.Tensor:
        """Residual stream after the feed-forward half of the layer."""
        self._check_sequential()
        if self.spec.sandwich_norm:
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self._scaled(_summed(self.mlp(self.post_attention_layernorm(x)), x))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return residual_scaled(self.spec, h)

    def _check_sequential(self) -> None:
        if self.spec.parallel_block:
            raise RuntimeError(f"{self.spec.arch}'s layers run attention and MLP in parallel on one normed input: "
                               "call parallel() or parallel_attn(), not attn_block() / mlp_block().")

    def parallel(self, x, q_pos, rope, cache=None) -> torch.Tensor:
        """Cohere's block: `x + attn(n(x)) + mlp(n(x))`, one norm read by both (added in transformers' order)."""
        h = self.input_layernorm(x)
        a = _summed(self.self_attn(h, q_pos, rope, cache), x)
        return x + a + _summed(self.mlp(h), x)

    def parallel_attn(self, x, q_pos, rope) -> torch.Tensor:
        """`x + attn(n(x))`: a parallel block without its MLP, the output the quantizer scores its attention on."""
        return x + _summed(self.self_attn(self.input_layernorm(x), q_pos, rope), x)

    def forward(self, x, q_pos, rope, cache=None):
        if self.spec.parallel_block:
            return self.parallel(x, q_pos, rope, cache)
        return self.mlp_block(self.attn_block(x, q_pos, rope, cache))

    def fused_step(self, x: torch.Tensor, delta: Optional[torch.Tensor], q_pos, rope, cache=None):
        """Inference form of forward: `x` is the residual stream (updated in place) and `delta` the previous
        layer's MLP output not yet added, so each residual add fuses with the following norm. Returns the new
        (x, delta)."""
        if self.spec.sandwich_norm or self.spec.parallel_block:
            if delta is not None:
                x = x + _summed(delta, x)
            return self.forward(x, q_pos, rope, cache), None
        if delta is None:
            h = self.self_attn(self.input_layernorm(x), q_pos, rope, cache)
        else:
            h, x = self._norm_into(self.input_layernorm, delta, x, self.self_attn, q_pos, rope, cache)
        if self.spec.residual_scale != 1.0:  # (route_split_sums leaves such a model's projections unsplit)
            h = self._scaled(_summed(h, x))
        out, x = self._norm_into(self.post_attention_layernorm, h, x, self.mlp)
        if self.spec.residual_scale != 1.0:
            out = self._scaled(_summed(out, x))
        return x, out

    @staticmethod
    def _norm_into(norm: RMSNorm, delta: torch.Tensor, x: torch.Tensor, module: nn.Module, *args):
        """(module(norm(x + delta), *args), x + delta): the sum in place in x, or on the small-batch GPU path in a
        new tensor from the norm kernel that also writes the permuted inputs of the module's quantized projections
        (one launch fewer per projection group)."""
        rows = x.numel() // x.shape[-1]
        idx = module.permuted_indices() if hasattr(module, "permuted_indices") else None
        if idx is None or not uses_permuted_input(rows, x):
            return module(norm.add_norm(delta, x), *args), x
        h, xp, x = norm.add_norm(delta, x, gather=idx)
        return module(h, *args, xp=xp), x


def final_logits(spec: ModelSpec, out: torch.Tensor) -> torch.Tensor:
    """The head's output `out` as float32 logits: the vocabulary columns, × logit_scale (Granite, Cohere), then
    soft-capped (Gemma 2/3). Every path that computes logits (decoder, tensor parallel, quantizer) should use it."""
    out = out[..., : spec.vocab_size].float()
    if spec.logit_scale != 1.0:
        out = out * spec.logit_scale
    return softcap(out, spec.final_softcap)


def build_mlp(spec: ModelSpec, layer: LayerSpec, w: WeightProvider, p: str) -> nn.Module:
    hid = spec.hidden_size
    if not layer.moe:
        dim = layer.dense_dim or spec.intermediate_size
        if w.has(f"{p}.gate_up_proj.weight"):
            gate, up = w.linears_split(f"{p}.gate_up_proj", hid, [dim, dim], spec.mlp_bias)
        else:
            gate = w.linear(f"{p}.gate_proj", hid, dim, spec.mlp_bias)
            up = w.linear(f"{p}.up_proj", hid, dim, spec.mlp_bias)
        down = w.linear(f"{p}.down_proj", dim, hid, spec.mlp_bias)
        return GatedMLP(gate, up, down, spec.activation)
    m = spec.moe
    router_key = {"mixtral": "gate", "qwen": "gate", "deepseek": "gate", "llama4": "router", "gpt_oss": "router"}[
        m.style]
    gpt_oss = m.style == "gpt_oss"   # fused experts, gate and up columns interleaved, every projection biased
    experts = [GatedMLP(g, u, d, spec.activation)
               for g, u, d in w.expert_linears(f"{p}.experts", m.num_experts, hid, m.expert_dim,
                                               interleaved=gpt_oss, bias=gpt_oss)]
    shared = None
    if m.shared_dim:
        sp = f"{p}.shared_experts" if m.style == "deepseek" else f"{p}.shared_expert"
        shared = GatedMLP(w.linear(f"{sp}.gate_proj", hid, m.shared_dim, False),
                          w.linear(f"{sp}.up_proj", hid, m.shared_dim, False),
                          w.linear(f"{sp}.down_proj", m.shared_dim, hid, False), spec.activation)
    bias_key = f"{p}.gate.e_score_correction_bias"
    if not w.has(bias_key):   # MiniMax-M2 keeps it beside the router, ERNIE 4.5 in moe_statics
        bias_key = f"{p}.e_score_correction_bias" if w.has(f"{p}.e_score_correction_bias") else \
            f"{p}.moe_statics.e_score_correction_bias"
    return MoE(m, w.tensor(f"{p}.{router_key}.weight"), experts, shared,
               w.tensor(bias_key) if w.has(bias_key) else None,
               w.tensor(f"{p}.shared_expert_gate.weight") if m.shared_gate else None,
               w.tensor(f"{p}.router.bias") if gpt_oss else None)


class DecoderModel(nn.Module):
    """Embeddings → decoder layers → final norm → head, for any ModelSpec.

    `w` provides the embedding (and everything else, unless split). A split model (`layer_w`: one provider per
    decoder layer, `head_w`: the final norm and head's) runs each run of layers that share a provider on that
    provider's device and moves the hidden state between them; logits come back on `device`, the embedding's."""

    def __init__(self, spec: ModelSpec, w: WeightProvider, layer_w: Optional[Sequence[WeightProvider]] = None,
                 head_w: Optional[WeightProvider] = None):
        super().__init__()
        self.spec = spec
        self.is_split = layer_w is not None or head_w is not None
        layer_w = list(layer_w) if layer_w is not None else [w] * spec.num_layers
        head_w = head_w if head_w is not None else w
        if len(layer_w) != spec.num_layers:
            raise ValueError(f"{len(layer_w)} layer weight providers for {spec.num_layers} layers")
        self.embed_tokens = nn.Parameter(w.tensor("model.embed_tokens.weight"), requires_grad=False)
        layers = []
        for i, lw in enumerate(layer_w):
            with self._loading_on(lw):
                layers.append(DecoderLayer(spec, i, lw))
            report(i + 1, spec.num_layers + 1)
        self.layers = nn.ModuleList(layers)
        with self._loading_on(head_w):
            self._build_head(spec, head_w)
        report(spec.num_layers + 1, spec.num_layers + 1)
        # the devices the norms' weights landed on (a layer's every tensor is on its provider's device)
        self.layer_devices: list[torch.device] = [
            (layer.input_layernorm if spec.pre_norm else layer.post_attention_layernorm).weight.device
            for layer in self.layers]
        self.head_device: torch.device = self.norm.weight.device
        # runs of consecutive layers with one provider (one device): (device, first, end); one run unless split
        starts = [i for i in range(spec.num_layers) if i == 0 or layer_w[i] is not layer_w[i - 1]]
        self._groups = [(self.layer_devices[a], a, b) for a, b in zip(starts, starts[1:] + [spec.num_layers])]
        self._tables_by_device: dict = {}
        # q/k/v (and gate/up) of exllamav2 files share one act-order permutation: one permuted copy of their input
        # where their input orders are equal (EXL2_SHARED_INPUT=0: one per weight)
        share_inputs(self)
        prepare_routed(self)
        self.route_split_sums()

    def _loading_on(self, w: WeightProvider):
        """A split model's parts load with their device current (kernels may run while repacking)."""
        dev = getattr(w, "device", None) if self.is_split else None
        return on_device(torch.device(dev) if dev is not None else None)

    def _build_head(self, spec: ModelSpec, w: WeightProvider) -> None:
        self.norm = make_norm(spec, w.tensor("model.norm.weight"))
        if w.has("lm_head.weight") or w.has("lm_head.q_weight") or w.has("lm_head.qweight"):
            self.lm_head = w.linear("lm_head", spec.hidden_size, spec.vocab_size, False)
        elif spec.tie_embeddings:
            self.lm_head = w.linear("model.embed_tokens", spec.hidden_size, spec.vocab_size, False)
        elif w.embedding_only():
            self.lm_head = None   # an embedding model (a base model's weights, no head): hidden states only
        else:
            self.lm_head = w.linear("lm_head", spec.hidden_size, spec.vocab_size, False)

    def route_split_sums(self, enabled: Optional[bool] = None) -> int:
        """Let o_proj and down leave their K-split partial sums to the norm-gather that reads their output in
        `DecoderLayer.fused_step` (`Linear.split_sum`): o_proj where the layer's MLP reads a norm-gather, down where
        the next layer's attention does. `enabled` None follows EXL2_SPLIT_SUM. Returns how many projections emit
        them."""
        on = qm.SPLIT_SUM if enabled is None else enabled
        routed = 0
        starts = {first for _, first, _ in self._groups}  # partial sums do not cross to another device
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            nxt = self.layers[i + 1].self_attn if i + 1 < len(self.layers) and i + 1 not in starts else None
            pairs = [(getattr(attn, "o_proj", None), getattr(mlp, "permuted_indices", lambda: None)()),
                     (getattr(mlp, "down_proj", None) if isinstance(mlp, GatedMLP) else None,
                      getattr(nxt, "permuted_indices", lambda: None)() if nxt is not None else None)]
            for producer, consumer_idx in pairs:
                if isinstance(producer, Linear):
                    producer.split_sum = bool(on and not self.spec.sandwich_norm and isinstance(attn, Attention)
                                              and self.spec.residual_scale == 1.0 and not self.spec.parallel_block
                                              and self.spec.norm_type == "rms"
                                              and producer.kernel is not None and consumer_idx is not None)
                    routed += producer.split_sum
        return routed

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.functional.embedding(ids, self.embed_tokens)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def prepare_rope(self, length: int) -> None:
        """Precompute cos/sin tables up to `length`, so a forward needs no host sync (CUDA-graph safe)."""
        ropes = {"global": self.spec.rope, "local": self.spec.local_rope}
        self._rope_cache = {name: (*r.table(length, self.device), r.interleaved)
                            for name, r in ropes.items() if r is not None and r.static}
        self._rope_len = length

    def rope_tables(self, q_pos: torch.Tensor, end: int | None = None) -> dict:
        """cos/sin tables [positions, dim/2] covering q_pos, per RoPE table in use.

        `end` (one past the last position, when the host knows it) avoids reading q_pos back from the GPU.
        Static tables are kept and grown by doubling, so a forward does not rebuild them on the CPU."""
        s = self.spec
        static = all(r.static for r in (s.rope, s.local_rope) if r is not None)
        cached = getattr(self, "_rope_cache", None)
        if end is None and (cached is None or not static):
            end = int(q_pos.max()) + 1
        if static and end is not None and (cached is None or end > self._rope_len):
            DecoderModel.prepare_rope(self, max(256, 1 << (end - 1).bit_length(), 2 * getattr(self, "_rope_len", 0)))
            cached = self._rope_cache
        tables = {}
        for name, r in (("global", s.rope), ("local", s.local_rope)):
            if r is None:
                continue
            if cached and name in cached:
                tables[name] = cached[name]
            else:
                tables[name] = (*r.table(end, self.device), r.interleaved)
        return tables

    def tables_on(self, tables: dict, device: torch.device) -> dict:
        """`rope_tables`' tables on `device`, for a split model's layers there: copied once per device and kept
        while the source tables are (the static ones live until regrown), not once per layer or step."""
        out = {}
        for name, t in tables.items():
            hit = self._tables_by_device.get((name, device))
            if hit is None or hit[0] is not t:
                hit = (t, tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in t))
                self._tables_by_device[(name, device)] = hit
            out[name] = hit[1]
        return out

    def layer_rope(self, tables: dict, i: int):
        layer = self.spec.layers[i]
        if not layer.use_rope:
            return None
        return tables["local" if layer.local_rope else "global"]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + output projection (+ soft-capping) → float32 logits."""
        return self.logits(self.norm(x))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ModelLoadError(NO_HEAD)
        return final_logits(self.spec, self.lm_head(normed))

    @staticmethod
    def positions(ids: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """[B, T] absolute positions for tokens placed after `start` (an int or a per-row [B] tensor)."""
        b, t = ids.shape
        steps = torch.arange(t, device=ids.device)
        if isinstance(start, torch.Tensor):
            return start.to(ids.device).view(-1, 1) + steps
        return (steps + start).expand(b, t)

    def forward(self, ids: torch.Tensor, cache=None, start: int | torch.Tensor = 0,
                last_only: bool | torch.Tensor = False, fresh: bool | None = None,
                hidden: bool = False, inject: Optional[tuple] = None, rope_shift: Optional[torch.Tensor] = None,
                mrope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (float32) for token ids [B, T] placed at positions start..start+T-1 (start per row or shared).
        `last_only`: only the last position's logits [B, 1, V]; a [B] tensor: the logits at those positions of each
        row (right-padded rows of different lengths).
        `fresh`: whether every row starts at 0, when a tensor `start` hides it (saves the cache a GPU read).
        `hidden`: the final norm's output [B, T, H] (the model's dtype) instead of logits (embeddings).
        `inject` (flat positions [n] into [B, T], rows [n, H][, DeepStack rows]): embeddings that replace those
        positions' token embeddings (images in a prompt: generation.images), and what to add there after each of
        the first layers (`deep_rows`).
        M-RoPE models (Qwen2-VL) rotate by other positions than they cache at once a prompt holds an image:
        `mrope` [3, B, T] gives each token's (t, h, w) position, `rope_shift` [B] what each row adds to its
        positions instead (text after the images; generation.images.mrope_positions)."""
        q_pos = self.positions(ids, start)
        note = getattr(cache, "note_positions", None)
        fresh = (start == 0) if isinstance(start, int) else fresh
        if note is not None:
            note(q_pos, fresh)
        tables = self.rope_tables(q_pos, start + ids.shape[1] if isinstance(start, int) else None)
        if rope_shift is not None or mrope is not None:
            tables = positioned(tables, q_pos, rope_shift, mrope, self.spec.mrope_axes)
        x, delta = self.embed(ids).contiguous(), None
        if inject is not None:
            put_rows(x, inject)
        if self.is_split:
            return self._forward_split(x, q_pos, tables, cache, fresh, last_only, hidden, inject)
        for i, layer in enumerate(self.layers):
            x, delta = layer.fused_step(x, delta, q_pos, self.layer_rope(tables, i), cache)
            x = deep_rows(x, inject, i)
        normed = self.norm.add_norm(delta, x) if delta is not None else self.norm(x)
        rows = last_rows(normed, last_only)
        return rows if hidden else self.logits(rows)

    def _forward_split(self, x: torch.Tensor, q_pos: torch.Tensor, tables: dict, cache, fresh: Optional[bool],
                       last_only: bool | torch.Tensor, hidden: bool = False,
                       inject: Optional[tuple] = None) -> torch.Tensor:
        """`forward` over several devices: each run of layers with its device current, the residual stream and the
        pending MLP output (`fused_step`'s pair) moved where the run starts, positions and RoPE tables copied once
        per device and forward (the cache is told of each copy); the head's logits back on the embedding's device.
        `.to` returns a tensor already on the device itself, so runs on one device copy nothing."""
        note = getattr(cache, "note_positions", None)
        delta = None
        for dev, first, end in self._groups:
            with on_device(dev):
                x = x.to(dev)
                delta = None if delta is None else _summed(delta, x).to(dev)
                pos = q_pos.to(dev)
                if note is not None and pos is not q_pos:
                    note(pos, fresh)
                local = self.tables_on(tables, dev)
                for i in range(first, end):
                    x, delta = self.layers[i].fused_step(x, delta, pos, self.layer_rope(local, i), cache)
                    x = deep_rows(x, inject, i)
        dev = self.head_device
        with on_device(dev):
            x = x.to(dev)
            normed = self.norm.add_norm(_summed(delta, x).to(dev), x) if delta is not None else self.norm(x)
            rows = last_rows(normed, last_only)
            out = rows if hidden else self.logits(rows)
        return out.to(self.device)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        s = self.spec
        devs = self.layer_devices if self.is_split else None
        if s.mla is not None:   # one latent row a token (MLAttention)
            r = s.mla.kv_lora_rank
            return KVCache(s.num_layers, batch, max_len, 1, r + s.mla.qk_rope_head_dim, r, self.dtype,
                           self.device, devs)
        return KVCache(s.num_layers, batch, max_len, s.num_kv_heads, s.head_dim, s.head_dim, self.dtype, self.device,
                       devs)
