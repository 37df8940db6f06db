"""Building blocks of the generic decoder, in plain PyTorch: norms, attention math, MLP and MoE."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from exl2.kernels.activation import glu
from exl2.kernels.norm import rms_norm, rms_norm_gather, rms_norm_pair
from exl2.kernels.backend import use_triton
from exl2.kernels.quant_matmul import uses_permuted_input
from exl2.kernels.router import softmax_topk_route
from exl2.kernels.split_sum import SplitSum
from exl2.models.routed_experts import RoutedExperts
from exl2.runtime.linear import permuted_indices, project


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; `offset` 1.0 gives Gemma's (1 + w) scaling."""

    def __init__(self, weight: torch.Tensor | None, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False) if weight is not None else None
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.contiguous(), self.weight, self.eps, gemma=bool(self.offset))

    def add_norm(self, delta: torch.Tensor, residual: torch.Tensor, gather=None):
        """residual += delta (in place); return norm(residual). One fused kernel on the GPU. With `gather` (index
        vectors from `permuted_indices`) return `(normed, permuted copies, residual + delta)` from that same kernel,
        the sum in a new tensor and `residual` left as it was (the kernel then ends without ordering its reads of
        the residual before an overwrite)."""
        split = isinstance(delta, SplitSum)  # a matmul's K-split partial sums (`Linear.split_sum`)
        if gather:
            return rms_norm_gather(delta if split else delta.contiguous(), self.weight, self.eps, gather,
                                   residual=residual, gemma=bool(self.offset))
        if split:
            delta = delta.total(residual.dtype).view(residual.shape)
        normed, _ = rms_norm(delta.contiguous(), self.weight, self.eps, residual=residual, gemma=bool(self.offset))
        return normed


def norm_pair(norm_a: nn.Module, norm_b: nn.Module, a: torch.Tensor, b: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_a(a), norm_b(b)); two RMSNorms of one kind with weights in one launch (`rms_norm_pair`)."""
    if (type(norm_a) is RMSNorm and type(norm_b) is RMSNorm and norm_a.weight is not None
            and norm_b.weight is not None and (norm_a.eps, norm_a.offset) == (norm_b.eps, norm_b.offset)):
        return rms_norm_pair(a, norm_a.weight, b, norm_b.weight, norm_a.eps, gemma=bool(norm_a.offset))
    return norm_a(a), norm_b(b)


class LayerNorm(nn.Module):
    """LayerNorm without bias, computed in float32 (Cohere): `w * (x - mean) / sqrt(var + eps)`. `weight` may be
    [H] or, for Cohere's per-head q/k norms, [heads, head_dim] (the statistics are over the last dim either way)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * ((xf - mean) * torch.rsqrt(var + self.eps))).to(x.dtype)

    def add_norm(self, delta: torch.Tensor, residual: torch.Tensor, gather=None):
        """residual += delta (in place); return norm(residual) (RMSNorm.add_norm's contract, without `gather`)."""
        if gather:
            raise ValueError("LayerNorm does not write permuted copies for quantized projections.")
        if isinstance(delta, SplitSum):
            delta = delta.total(residual.dtype).view(residual.shape)
        residual += delta
        return self(residual)


def make_norm(spec, weight: torch.Tensor) -> nn.Module:
    """The norm `spec` uses (its type, eps and Gemma offset) around `weight`."""
    if spec.norm_type == "layernorm":
        return LayerNorm(weight, spec.norm_eps)
    return RMSNorm(weight, spec.norm_eps, spec.norm_offset)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
              window: int | None = None, chunk: int | None = None, softcap: float | None = None,
              limit: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference causal attention. q [B,T,H,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv]; q_pos [T] or [B,T] absolute
    positions of the queries (key s sits at position s); `limit` [B,T]: the last key each query sees where that is
    past itself (an image's tokens see the whole image: `attention_mask`); `sinks` [H]: a logit per head that
    joins every softmax without a value (gpt-oss), so a query may attend to nothing. Returns [B,T,H,Dv]."""
    h, hkv = q.shape[2], k.shape[2]
    if h != hkv:
        k = k.repeat_interleave(h // hkv, dim=2)
        v = v.repeat_interleave(h // hkv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = attention_mask(q_pos if q_pos.dim() == 2 else q_pos[None], k.shape[1], window, chunk, limit)
    scores = scores.masked_fill(~mask[:, None], float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
    else:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    window: int | None, limit: torch.Tensor) -> torch.Tensor:
    """`attention` with a `limit` (Gemma 3's image tokens) through SDPA and a boolean mask, so a prefill chunk over
    a long cached context never holds its float32 scores: shapes as `attention`'s."""
    mask = attention_mask(q_pos, k.shape[1], window, None, limit)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def attention_mask(q_pos: torch.Tensor, kv_len: int, window: int | None = None, chunk: int | None = None,
                   limit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean [B, T, S] mask: causal, optionally within a sliding window of `window` keys or the same chunk.
    `limit` [B, T] lets a query see keys up to it rather than up to itself (Gemma 3's image tokens attend to their
    whole image, as transformers' blockwise overlay: OR(causal, block), then AND the window)."""
    kv_pos = torch.arange(kv_len, device=q_pos.device)[None, None, :]
    qp = q_pos[:, :, None]
    mask = kv_pos <= (qp if limit is None else limit.to(q_pos.device)[:, :, None])
    if window is not None:
        mask &= (qp - kv_pos) < window
    if chunk is not None:
        mask &= (qp // chunk) == (kv_pos // chunk)
    return mask


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module, act: str):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self.act_name = act

    def shared_input_linears(self) -> tuple[nn.Module, ...]:
        """The projections that read this block's input (their equal input orders are aliased at load)."""
        return self.gate_proj, self.up_proj

    def permuted_indices(self):
        """Distinct input orders of gate/up for a norm that writes their permuted inputs (None: not quantized)."""
        return permuted_indices(self.shared_input_linears())

    def forward(self, x: torch.Tensor, xp: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj), xp)
        down = self.down_proj
        if permuted_indices((down,)) and uses_permuted_input(gate.numel() // gate.shape[-1], gate):
            # The GLU kernel writes the down projection's permuted input directly.
            h = glu(gate, up, self.act_name, index=down.kernel.x_index)
            return down.forward_permuted(h.reshape(-1, h.shape[-1]), gate.shape[:-1])
        return down(glu(gate, up, self.act_name))


# Token rows up to which the softmax router runs as two kernels (`softmax_topk_route`); prompts take the GEMM.
FUSED_ROUTE_ROWS = 64


class MoE(nn.Module):
    """Routed experts (+ optional shared expert). Routing rules follow the source architectures exactly."""

    def __init__(self, spec, router_weight: torch.Tensor, experts: list[GatedMLP], shared: GatedMLP | None,
                 score_bias: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                 router_bias: torch.Tensor | None = None):
        super().__init__()
        self.spec = spec
        self.router_weight = nn.Parameter(router_weight, requires_grad=False)
        self.router_bias = nn.Parameter(router_bias, requires_grad=False) if router_bias is not None else None
        self.score_bias = nn.Parameter(score_bias, requires_grad=False) if score_bias is not None else None
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.shared_gate = nn.Parameter(shared_gate, requires_grad=False) if shared_gate is not None else None
        self.routed: RoutedExperts | None = None

    def prepare_routed(self) -> bool:
        """(Re)build the experts' routed tables (`RoutedExperts`) once the weights are in place, and after LoRA
        adapters change; returns whether small batches now take the routed path (graph-safe decoding)."""
        act = getattr(self.experts[0], "act_name", None) if len(self.experts) else None
        self.routed = RoutedExperts.build(list(self.experts), act) if act else None
        return self.routed is not None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (expert ids [N, k], weights [N, k]) for flattened tokens x [N, H]."""
        m = self.spec
        if m.router == "softmax" and use_triton(x) and x.shape[0] <= FUSED_ROUTE_ROWS:
            return softmax_topk_route(x, self.router_weight, self.router_bias, m.top_k, m.norm_topk_prob)
        bias = None if self.router_bias is None else self.router_bias.float()
        logits = F.linear(x.float(), self.router_weight.float(), bias)
        if m.router == "softmax":
            probs = torch.softmax(logits, dim=-1)
            w, idx = torch.topk(probs, m.top_k, dim=-1)
            if m.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return idx, w
        if m.router == "softmax_grouped":   # DeepSeek-V2: groups ranked by their best expert
            probs = torch.softmax(logits, dim=-1)
            if m.n_group > 1:
                n = x.shape[0]
                best = probs.view(n, m.n_group, -1).amax(dim=-1)
                gidx = best.topk(m.topk_group, dim=-1, sorted=False)[1]
                keep = torch.zeros_like(best).scatter_(1, gidx, 1).bool()
                per = probs.shape[1] // m.n_group
                probs = probs.masked_fill(~keep[:, :, None].expand(n, m.n_group, per).reshape(n, -1), 0.0)
            w, idx = torch.topk(probs, m.top_k, dim=-1, sorted=False)
            if m.norm_topk_prob and m.top_k > 1:   # DeepSeek's own rule: renormalised weights are not scaled
                return idx, w / (w.sum(-1, keepdim=True) + 1e-20)
            return idx, w * m.routed_scaling_factor
        if m.router == "sigmoid_grouped":
            scores = logits.sigmoid()
            choice = scores + self.score_bias.float() if self.score_bias is not None else scores
            n = x.shape[0]
            grouped = choice.view(n, m.n_group, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            gidx = group_scores.topk(m.topk_group, dim=-1, sorted=False)[1]
            gmask = torch.zeros_like(group_scores).scatter_(1, gidx, 1)
            smask = gmask[:, :, None].expand_as(grouped).reshape(n, -1)
            choice = choice.masked_fill(smask == 0, 0.0)
            idx = choice.topk(m.top_k, dim=-1, sorted=False)[1]
            w = scores.gather(1, idx)
            if m.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return idx, w * m.routed_scaling_factor
        if m.router == "softmax_biased":   # ERNIE 4.5: chosen by probability plus a bias, weighed by probability
            probs = torch.softmax(logits, dim=-1)
            choice = probs + self.score_bias.float().reshape(-1) if self.score_bias is not None else probs
            idx = choice.topk(m.top_k, dim=-1)[1]
            w = probs.gather(1, idx)
            return idx, w / w.sum(-1, keepdim=True).clamp(min=1e-12)
        if m.router == "softmax_topk":   # gpt-oss: the chosen logits softmaxed among themselves
            val, idx = torch.topk(logits, m.top_k, dim=-1)
            return idx, torch.softmax(val, dim=-1)
        if m.router == "sigmoid_input":
            val, idx = torch.topk(logits.to(x.dtype), m.top_k, dim=-1)
            return idx, torch.sigmoid(val.float())
        raise ValueError(m.router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert with one sort and one read of the counts on the host (a GPU waits once a
        layer, not once an expert); each expert's tokens in row order, experts in index order."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.route(flat)
        scale_input = self.spec.router == "sigmoid_input"
        if self.routed is not None and self.routed.applies(flat):
            out = self.routed.forward(flat, idx, w, scale_input)
            return self._with_shared(flat, out).view(shape)
        out = torch.zeros_like(flat)
        k = idx.shape[1]
        picks = idx.reshape(-1)
        order = torch.argsort(picks, stable=True)
        weights = w.reshape(-1)[order].to(flat.dtype)[:, None]
        start = 0
        for e, count in enumerate(torch.bincount(picks, minlength=len(self.experts)).tolist()):
            if not count:
                continue
            rows = order[start:start + count] // k
            we = weights[start:start + count]
            start += count
            if scale_input:
                out.index_add_(0, rows, self.experts[e](flat[rows] * we))
            else:
                out.index_add_(0, rows, self.experts[e](flat[rows]) * we)
        return self._with_shared(flat, out).view(shape)

    def _with_shared(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum plus the shared expert's output (gated where the model gates it)."""
        if self.shared is None:
            return out
        shared = self.shared(flat)
        if self.shared_gate is not None:
            shared = shared * torch.sigmoid(F.linear(flat, self.shared_gate.to(flat.dtype)))
        return out + shared


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scale(q: torch.Tensor, q_pos: torch.Tensor, attn_scale: float, floor_scale: float) -> torch.Tensor:
    """Llama 4 attention temperature tuning for NoPE layers."""
    s = torch.log1p(torch.floor((q_pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * s.reshape(-1 if q_pos.dim() == 2 else 1, q.shape[1], 1, 1)).to(q.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return torch.tanh(x / cap) * cap if cap else x

