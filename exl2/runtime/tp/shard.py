"""Megatron-style shards of one decoder layer for tensor parallelism: which columns and rows of each projection a
shard holds, made from a layer loaded whole on the host.

- Attention: shard r holds a contiguous group of KV heads and the query heads that read them (q/k/v column
  slices by head) and the paged cache of those heads only.
- o_proj: a dense one is row-parallel over the shard's own heads (one all-reduce). A quantized one reads its
  input in act-order, its rows scattered over every head, so the shards all-gather the attention output (hidden
  wide) and each computes a column slice of o_proj from it, then all-gather those columns: exact (every output
  is one whole dot product, the same as unsharded) and an all-gather moves half the bytes of an all-reduce.
- MLP: down is row-parallel. A quantized down's share is a share of the 32-row steps of every width class
  (`qweight.slice_steps`, like the kernels' split-K); gate and up keep exactly the intermediate features that
  share reads (its `row_index`), renumbered so the GLU stays local and down needs no gather; one all-reduce.
  Dense weights: the same with contiguous slices.
- Mixture of experts: every expert (and the shared expert) is sharded as that MLP is, and the router, its score
  bias and the shared expert's gate are replicated, so every shard routes alike; a token's output is a weighted sum
  of expert outputs, each of which the shards' partial sums make up, so one all-reduce after the block suffices.
- Norms are replicated (Cohere's per-head q/k norms: the shard's heads' rows); a bias of a row-parallel projection
  goes with shard 0 only.
- A parallel layer (Cohere: attention and MLP on one normed input) adds its dense o_proj's and its MLP's partial
  sums before one all-reduce.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from exl2.errors import ConfigError
from exl2.kernels.qweight import QuantWeight, input_features, slice_steps, take_outputs, with_inputs
from exl2.models.decoder import Attention, DecoderLayer, MLAttention, on_device, residual_scaled
from exl2.models.layers import GatedMLP, LayerNorm, MoE, RMSNorm
from exl2.models.spec import ModelSpec
from exl2.runtime.linear import Linear, project
from exl2.runtime.tp.collectives import Collectives


def check_supported(spec: ModelSpec, parts: int) -> None:
    """Raise ConfigError (one sentence) where this model cannot be sharded over `parts` devices."""
    if parts < 2:
        raise ConfigError("Tensor parallelism needs at least two devices; leave it off to run on one.")
    if spec.num_kv_heads % parts:
        raise ConfigError(f"Tensor parallel over {parts} devices needs the KV head count ({spec.num_kv_heads}) to be "
                          f"a multiple of {parts}.")


def shard_spec(spec: ModelSpec, parts: int) -> ModelSpec:
    """The spec one shard's attention and cache see: its share of the query and KV heads."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // parts, num_kv_heads=spec.num_kv_heads // parts)


def _move_kernel(w: QuantWeight, device: torch.device) -> QuantWeight:
    """w on `device`, keeping its class (QuantWeight.to makes a plain QuantWeight)."""
    moved = {f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
             if isinstance(getattr(w, f.name), torch.Tensor)}
    return dataclasses.replace(w, _cache={}, **moved)


def linear_on(in_features: int, out_features: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
              kernel: Optional[QuantWeight], info: dict, device: torch.device) -> Linear:
    """A Linear with its tensors on `device` (contiguous copies: a slice never pins the whole host matrix)."""
    mv = lambda t: None if t is None else t.to(device).contiguous().clone()  # noqa: E731
    return Linear(in_features, out_features, mv(weight), mv(bias),
                  None if kernel is None else _move_kernel(kernel, device), dict(info))


def columns(lin: Linear, cols: torch.Tensor, device: torch.device) -> Linear:
    """The output columns `cols` of a linear (all its inputs)."""
    if lin.kernel is not None:
        return linear_on(lin.in_features, cols.numel(), None, None, take_outputs(lin.kernel, cols), lin.info, device)
    bias = None if lin.bias is None else lin.bias[cols]
    return linear_on(lin.in_features, cols.numel(), lin.weight[cols], bias, None, lin.info, device)


def dense_rows(lin: Linear, features: torch.Tensor, keep_bias: bool, device: torch.device) -> Linear:
    """A dense linear reading only the input features `features` (a row share; the bias on one share only)."""
    bias = lin.bias if keep_bias else None
    return linear_on(features.numel(), lin.out_features, lin.weight[:, features], bias, None, lin.info, device)


def _heads(count: int, dim: int, part: int, parts: int) -> torch.Tensor:
    per = count // parts
    return torch.arange(part * per * dim, (part + 1) * per * dim)


class _Prepared:
    """A WeightProvider serving ready-made shard linears and tensors by name, so that a shard's Attention is
    built by Attention's own constructor."""

    def __init__(self, linears: dict, tensors: dict):
        self.linears, self.tensors = linears, tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def linear(self, prefix: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return self.linears[prefix]


def norm_on(norm: Optional[nn.Module], device: torch.device) -> Optional[nn.Module]:
    """A copy of an RMSNorm or LayerNorm on `device` (an Identity, where a model has no norm, as it is)."""
    if norm is None or isinstance(norm, nn.Identity):
        return norm
    if isinstance(norm, LayerNorm):
        return LayerNorm(_replica(norm.weight, device), norm.eps)
    return RMSNorm(_replica(norm.weight, device), norm.eps, norm.offset)


def shard_attention(attn: Attention, spec: ModelSpec, part: int, parts: int, device: torch.device
                    ) -> tuple[Attention, str]:
    """Shard `part`'s Attention (its heads; its `o_proj` as `o_mode` says) and `o_mode`: "reduce" (dense o_proj
    over the shard's heads, outputs all-reduced) or "gather" (quantized o_proj: all-gathered input, a column
    slice of the output, all-gathered)."""
    d = spec.head_dim
    q_cols, kv_cols = _heads(spec.num_heads, d, part, parts), _heads(spec.num_kv_heads, d, part, parts)
    prefix = f"model.layers.{attn.idx}.self_attn"
    o_shard, o_mode = _o_shard(attn.o_proj, q_cols, part, parts, device)
    linears = {f"{prefix}.q_proj": columns(attn.q_proj, q_cols, device),
               f"{prefix}.k_proj": columns(attn.k_proj, kv_cols, device),
               f"{prefix}.v_proj": columns(attn.v_proj, kv_cols, device),
               f"{prefix}.o_proj": o_shard}
    tensors = {}
    if attn.q_norm is not None:
        if spec.qk_norm_full:           # RMSNorms over the whole projections: the shard's features of the weight
            rows = (q_cols, kv_cols)
        elif attn.q_norm.weight.dim() == 2:   # one weight row a head (Cohere): the shard's heads
            rows = tuple(_heads(n, 1, part, parts) for n in (spec.num_heads, spec.num_kv_heads))
        else:                           # one weight for every head (Qwen3): whole
            rows = (None, None)
        tensors = {f"{prefix}.{name}.weight": _replica(norm.weight if r is None else norm.weight[r], device)
                   for name, norm, r in zip(("q_norm", "k_norm"), (attn.q_norm, attn.k_norm), rows)}
    if attn.sinks is not None:   # one per query head: the shard's heads' own
        per = spec.num_heads // parts
        tensors[f"{prefix}.sinks"] = _replica(attn.sinks[part * per:(part + 1) * per], device)
    with torch.no_grad():
        shard = Attention(shard_spec(spec, parts), attn.layer, attn.idx, _Prepared(linears, tensors), prefix)
    shard.scale = attn.scale
    return shard, o_mode


def shard_mla(attn: MLAttention, spec: ModelSpec, part: int, parts: int, device: torch.device
              ) -> tuple[MLAttention, str]:
    """`shard_attention` for multi-head latent attention: the shard's heads of q (q_b_proj or q_proj), kv_b_proj
    and o_proj; the latent projections and norms replicated, so every shard caches the whole latent row and
    attends over it with its own heads."""
    m = spec.mla
    prefix = f"model.layers.{attn.idx}.self_attn"
    q_cols = _heads(spec.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, part, parts)
    o_proj, o_mode = _o_shard(attn.o_proj, _heads(spec.num_heads, m.v_head_dim, part, parts), part, parts, device)
    linears = {f"{prefix}.kv_a_proj_with_mqa": _replica_linear(attn.kv_a_proj, device),
               f"{prefix}.kv_b_proj": columns(attn.kv_b_proj, _heads(spec.num_heads, m.qk_nope_head_dim
                                                                      + m.v_head_dim, part, parts), device),
               f"{prefix}.o_proj": o_proj}
    tensors = {f"{prefix}.kv_a_layernorm.weight": _replica(attn.kv_a_norm.weight, device)}
    if m.q_lora_rank:
        linears[f"{prefix}.q_a_proj"] = _replica_linear(attn.q_a_proj, device)
        linears[f"{prefix}.q_b_proj"] = columns(attn.q_b_proj, q_cols, device)
        tensors[f"{prefix}.q_a_layernorm.weight"] = _replica(attn.q_a_norm.weight, device)
    else:
        linears[f"{prefix}.q_proj"] = columns(attn.q_proj, q_cols, device)
    with torch.no_grad():
        shard = MLAttention(shard_spec(spec, parts), attn.layer, attn.idx, _Prepared(linears, tensors), prefix)
    shard.scale = attn.scale
    return shard, o_mode


def _o_shard(o: Linear, head_cols: torch.Tensor, part: int, parts: int, device: torch.device) -> tuple[Linear, str]:
    """A shard's o_proj and how its output is combined: "reduce" (dense: the rows of the shard's heads, outputs
    all-reduced) or "gather" (quantized: all-gathered input, a column slice of the output, all-gathered)."""
    if o.kernel is None:
        return dense_rows(o, head_cols, part == 0, device), "reduce"
    return columns(o, torch.tensor_split(torch.arange(o.out_features), parts)[part], device), "gather"


class _Idle(nn.Module):
    """A shard's MLP that reads no intermediate features (an expert narrower than one 32-row step a shard): its
    share of the output is zero."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


def shard_mlp(mlp: GatedMLP, part: int, parts: int, device: torch.device) -> nn.Module:
    """Shard `part`'s GatedMLP: its share of down's input rows and the gate/up columns producing exactly them."""
    down = mlp.down_proj
    if down.kernel is not None:
        share = slice_steps(down.kernel, part, parts)
        features = input_features(share)
        if not features.numel():
            return _Idle(down.out_features)
        down_shard = linear_on(features.numel(), down.out_features, None, None, with_inputs(share, features),
                               down.info, device)
    else:
        features = torch.tensor_split(torch.arange(down.in_features), parts)[part]
        down_shard = dense_rows(down, features, part == 0, device)
    return GatedMLP(columns(mlp.gate_proj, features, device), columns(mlp.up_proj, features, device), down_shard,
                    mlp.act_name)


def _replica(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().to(device).clone()


def _replica_linear(lin: Linear, device: torch.device) -> Linear:
    """A whole copy of a linear on `device` (every shard computes it: MLA's latent projections)."""
    return linear_on(lin.in_features, lin.out_features, lin.weight, lin.bias, lin.kernel, lin.info, device)


def shard_moe(moe: MoE, part: int, parts: int, device: torch.device) -> MoE:
    """Shard `part`'s MoE block: every expert's and the shared expert's share (`shard_mlp`), the router, score
    bias and shared gate whole."""
    experts = [shard_mlp(e, part, parts, device) for e in moe.experts]
    shared = None if moe.shared is None else shard_mlp(moe.shared, part, parts, device)
    return MoE(moe.spec, _replica(moe.router_weight, device), experts, shared, _replica(moe.score_bias, device),
               _replica(moe.shared_gate, device), _replica(moe.router_bias, device))


def shard_ffn(ffn: nn.Module, part: int, parts: int, device: torch.device) -> nn.Module:
    """A layer's feed-forward block, dense or mixture of experts, for shard `part`."""
    if isinstance(ffn, MoE):
        return shard_moe(ffn, part, parts, device)
    return shard_mlp(ffn, part, parts, device)


def _rms_with(x: torch.Tensor, sum_sq: torch.Tensor, features: int, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm of a shard's share `x` of a wider row, given the whole row's sum of squares (`kernels.norm`'s
    arithmetic: fp32, then the weight, then x's dtype)."""
    y = x.float() * torch.rsqrt(sum_sq / features + norm.eps)[..., None]
    return (y * (norm.weight.float() + norm.offset)).to(x.dtype)


class ShardedLayer(nn.Module):
    """One decoder layer as `parts` shards: per shard its norms, attention and MLP (on that shard's device)."""

    def __init__(self, layer: DecoderLayer, devices: list[torch.device]):
        super().__init__()
        self.spec, self.idx = layer.spec, layer.idx
        self.sandwich, self.parallel = layer.spec.sandwich_norm, layer.spec.parallel_block
        parts = len(devices)
        shard = shard_mla if layer.spec.mla is not None else shard_attention
        attns, modes = zip(*[shard(layer.self_attn, layer.spec, r, parts, d) for r, d in enumerate(devices)])
        self.o_mode = modes[0]
        self.attn = nn.ModuleList(attns)
        self.mlp = nn.ModuleList([shard_ffn(layer.mlp, r, parts, d) for r, d in enumerate(devices)])
        names = ["input_layernorm"] if self.parallel else ["input_layernorm", "post_attention_layernorm"]
        if self.sandwich:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for name in names:
            setattr(self, name, nn.ModuleList([norm_on(getattr(layer, name), d) for d in devices]))

    def _full_normed(self, r: int, qkv: tuple, sums: torch.Tensor) -> tuple:
        """Shard r's q and k normed over the whole projections (OLMo 2/3, MiniMax-M2) from every shard's sums."""
        q, k, v = qkv
        s, attn = self.spec, self.attn[r]
        return (_rms_with(q, sums[..., 0], s.num_heads * s.head_dim, attn.q_norm),
                _rms_with(k, sums[..., 1], s.num_kv_heads * s.head_dim, attn.k_norm), v)

    def forward(self, xs: list[torch.Tensor], positions: list[torch.Tensor], ropes: list, caches: list,
                coll: Collectives, devices: list[torch.device]) -> list[torch.Tensor]:
        """The residual stream after this layer, one replica per shard: three collectives with a quantized
        o_proj (gather, gather, reduce), two with a dense one (reduce, reduce; one for a parallel layer)."""
        def each(fn) -> list:
            out = []
            for r, d in enumerate(devices):  # queued one device after another; the GPUs run them side by side
                with on_device(d):
                    out.append(fn(r))
            return out

        h = each(lambda r: self.input_layernorm[r](xs[r]))
        if self.spec.qk_norm_full:   # RMSNorms over whole projections: every shard's sums of squares first
            qkv = each(lambda r: project(h[r], (self.attn[r].q_proj, self.attn[r].k_proj, self.attn[r].v_proj)))
            sums = coll.all_reduce(each(lambda r: torch.stack([y.float().square().sum(-1) for y in qkv[r][:2]], -1)))
            qkv = each(lambda r: self._full_normed(r, qkv[r], sums[r]))
            a = each(lambda r: self.attn[r].heads(h[r], positions[r], ropes[r], caches[r], qkv=qkv[r]))
        else:
            a = each(lambda r: self.attn[r].heads(h[r], positions[r], ropes[r], caches[r]))
        if self.parallel and self.o_mode == "reduce":
            s = coll.all_reduce(each(lambda r: self.attn[r].o_proj(a[r]) + self.mlp[r](h[r])))
            return each(lambda r: xs[r] + s[r])
        if self.o_mode == "reduce":
            o = coll.all_reduce(each(lambda r: self.attn[r].o_proj(a[r])))
        else:
            full = coll.all_gather(a)
            o = coll.all_gather(each(lambda r: self.attn[r].o_proj(full[r])))
        if self.parallel:
            m = coll.all_reduce(each(lambda r: self.mlp[r](h[r])))
            return each(lambda r: xs[r] + o[r] + m[r])
        if self.sandwich:
            o = each(lambda r: self.post_attention_layernorm[r](o[r]))
        xs = each(lambda r: xs[r] + residual_scaled(self.spec, o[r]))
        norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        m = coll.all_reduce(each(lambda r: self.mlp[r](norm[r](xs[r]))))
        if self.sandwich:
            m = each(lambda r: self.post_feedforward_layernorm[r](m[r]))
        return each(lambda r: xs[r] + residual_scaled(self.spec, m[r]))
