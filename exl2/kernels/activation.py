"""Gated activations of the MLP: `act(gate) * up` for SwiGLU (silu) and GeGLU (gelu, tanh or erf form), and
gpt-oss's clamped SwiGLU: `(clamp(up, ±7) + 1) · g · sigmoid(1.702 g)` with `g = min(gate, 7)`.

Input is either one fused tensor `[..., 2I]` (gate first, then up, as produced by a fused gate/up projection) or
separate `gate` and `up` `[..., I]`. Computed in fp32, rounded once to the input dtype.
"""
from __future__ import annotations

import math

import torch

from exl2.kernels.backend import next_pow2, pdl_args, pdl_sync, tl, triton, use_triton
from exl2.kernels.permute import take_columns

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "gptoss")
GPTOSS_ALPHA, GPTOSS_LIMIT = 1.702, 7.0
ACT_ID = {name: i for i, name in enumerate(ACTIVATIONS)}


@triton.jit
def _glu_kernel(g_ptr, u_ptr, o_ptr, I, stride_g, stride_u, stride_o, ACT: tl.constexpr, BLOCK: tl.constexpr,
                idx_ptr=None, GATHER: tl.constexpr = False, PDL: tl.constexpr = False):
    """Output column p of a row is act(g[c])·u[c] with c = p, or c = idx[p] (0 where idx[p] < 0) with GATHER.
    The index, which no kernel writes, is read before the PDL wait (its latency overlaps the previous kernel's)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    if GATHER:
        col = tl.load(idx_ptr + offs, mask=mask, other=-1)
        src = mask & (col >= 0)
    else:
        col = offs
        src = mask
    if PDL:
        pdl_sync()
    y = glu_values(g_ptr + row * stride_g, u_ptr + row * stride_u, col, src, ACT)
    tl.store(o_ptr + row * stride_o + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_values(g_row, u_row, col, src, ACT: tl.constexpr):
    """act(g[col])·u[col] in fp32 (0 where not `src`) for the activation ACT (`ACT_ID`)."""
    g = tl.load(g_row + col, mask=src, other=0.0).to(tl.float32)
    u = tl.load(u_row + col, mask=src, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))  # 0.5·(1 + tanh z) = sigmoid(2z): no cancellation for g << 0
    elif ACT == 2:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        g = tl.minimum(g, 7.0)
        a = g / (1.0 + tl.exp(-1.702 * g))
        u = tl.minimum(tl.maximum(u, -7.0), 7.0) + 1.0
    return a * u


def _split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"a fused gate/up tensor needs an even last dim, got {gate.shape[-1]}.")
        i = gate.shape[-1] // 2
        return gate[..., :i], gate[..., i:]
    if up.shape != gate.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ in shape.")
    return gate, up


def _act_torch(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g)
    if activation == "gelu_tanh":
        return g * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (g + 0.044715 * g.pow(3)))
    if activation == "gelu":
        return torch.nn.functional.gelu(g)
    raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}.")


def glu_torch(gate: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu",
              index: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `glu`."""
    g, u = _split(gate, up)
    if activation == "gptoss":
        g = g.float().clamp(max=GPTOSS_LIMIT)
        y = ((u.float().clamp(-GPTOSS_LIMIT, GPTOSS_LIMIT) + 1) * g * torch.sigmoid(GPTOSS_ALPHA * g)).to(gate.dtype)
    else:
        y = (_act_torch(g.float(), activation) * u.float()).to(gate.dtype)
    return y if index is None else take_columns(y, index)


def glu(gate: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu",
        index: torch.Tensor | None = None) -> torch.Tensor:
    """`act(gate) * up`; `activation` is "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU). With `index` (int32,
    -1 for a zero) the output columns come in that order: the permuted input of the quantized down projection
    (`QuantWeight.x_index`), written by this kernel instead of a separate gather."""
    if activation not in ACT_ID:
        raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}.")
    if not use_triton(gate):
        return glu_torch(gate, up, activation, index)
    g, u = _split(gate, up)
    if index is not None:
        return _glu_gather(g, u, activation, index)
    i = g.shape[-1]
    g2, u2 = g.reshape(-1, i), u.reshape(-1, i)  # views for the fused [.., 2I] case (row stride 2I)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    o2 = out.view(-1, i)
    if o2.shape[0]:
        block = min(2048, next_pow2(i))
        grid = (o2.shape[0], triton.cdiv(i, block))
        _glu_kernel[grid](g2, u2, o2, i, g2.stride(0), u2.stride(0), o2.stride(0), ACT=ACT_ID[activation],
                          BLOCK=block, num_warps=4, **pdl_args(g2.device, o2.shape[0], small=True))
    return out


def _glu_gather(g: torch.Tensor, u: torch.Tensor, activation: str, index: torch.Tensor) -> torch.Tensor:
    i = g.shape[-1]
    g2, u2 = g.reshape(-1, i), u.reshape(-1, i)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    p = index.numel()
    out = torch.empty((g2.shape[0], p), dtype=g.dtype, device=g.device)
    if out.shape[0]:
        block = min(512, next_pow2(p))  # more programs: each waits on an index load, then on the gathered loads
        _glu_kernel[(out.shape[0], triton.cdiv(p, block))](g2, u2, out, p, g2.stride(0), u2.stride(0), out.stride(0),
                                                           ACT=ACT_ID[activation], BLOCK=block, idx_ptr=index,
                                                           GATHER=True, num_warps=4,
                                                           **pdl_args(g2.device, out.shape[0], small=True))
    return out.view(*g.shape[:-1], p)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up`."""
    return glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (Gemma's `gelu_pytorch_tanh`)."""
    return glu(gate, up, "gelu_tanh")
