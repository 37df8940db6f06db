"""Rotary position embeddings: every scaling variant reduces to an inverse-frequency vector and a cos/sin factor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from exl2.config import ROPE_YARN_EXCLUSIVE, rope_factor_problem
from exl2.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def ntk_alpha(ratio: float) -> float:
    """The NTK-aware RoPE alpha that stretches a model's context by `ratio` > 1 (the quadratic fit exllamav2's
    users and TabbyAPI use; never below 1, which the fit dips under just past ratio 1)."""
    return max(1.0, -0.13436 + 0.80541 * ratio + 0.28833 * ratio * ratio)


@dataclass(frozen=True)
class RopeOverride:
    """The user's RoPE overrides (exllamav2's -rs/-ra/-ry) over config.json; None keeps the model's own.

    `scale`: positions divided by it (linear interpolation); it replaces a linear factor of config.json and
    otherwise divides on top of the model's scaling, as exllamav2's scale_pos_emb does. `alpha`: the base times
    alpha^(d/(d-2)) (NTK-aware), on top of every method, as exllamav2 applies it. `yarn`: a YaRN factor whose
    original length is config.json's YaRN original, else max_position_embeddings. `context`: the length the
    caller asked for explicitly; alpha defines no length of its own, so with alpha that length is allowed."""

    scale: Optional[float] = None
    alpha: Optional[float] = None
    yarn: Optional[float] = None
    context: Optional[int] = None

    def __post_init__(self) -> None:
        for name, v in (("rope_scale", self.scale), ("rope_alpha", self.alpha), ("rope_yarn", self.yarn)):
            problem = rope_factor_problem(name, v)
            if problem:
                raise ConfigError(f"{problem}.")
        if self.yarn is not None and (self.scale is not None or self.alpha is not None):
            raise ConfigError(f"{ROPE_YARN_EXCLUSIVE}.")

    @property
    def active(self) -> bool:
        return self.scale is not None or self.alpha is not None or self.yarn is not None

    def describe(self) -> str:
        """The flags as a user typed them, for messages."""
        parts = [f"{n} {v:g}" for n, v in (("rope_scale", self.scale), ("rope_alpha", self.alpha),
                                           ("rope_yarn", self.yarn)) if v is not None]
        return " and ".join(parts)


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE configuration, normalized from the many ways config.json spells it."""

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 64                       # rotated dimensions (head_dim * partial_rotary_factor)
    max_position: int = 2048            # config.max_position_embeddings
    params: dict = field(default_factory=dict, hash=False, compare=False)
    interleaved: bool = False           # GPT-J style pairs (x0,x1),(x2,x3)… instead of rotate-half
    pos_scale: float = 1.0              # -rs over a non-linear type: positions divided by it on top of the type

    def inv_freq(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [dim/2] (float32) and the cos/sin scale for a forward that reaches `seq_len`."""
        inv, scale = self._type_inv_freq(seq_len)
        return (inv if self.pos_scale == 1.0 else inv / self.pos_scale), scale

    def _type_inv_freq(self, seq_len: int) -> tuple[torch.Tensor, float]:
        p, dim, base = self.params, self.dim, self.theta
        exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv = 1.0 / (base ** exps)
        t = self.rope_type
        if t == "default":
            return inv, 1.0
        if t == "linear":
            return inv / p["factor"], 1.0
        if t == "dynamic":
            seq = max(seq_len, self.max_position)
            f = p["factor"]
            b = base * ((f * seq / self.max_position) - (f - 1)) ** (dim / (dim - 2))
            return 1.0 / (b ** exps), 1.0
        if t == "llama3":
            return llama3_inv_freq(inv, p), 1.0
        if t == "yarn":
            return _yarn(self, p)
        if t == "longrope":
            orig = p["original_max_position_embeddings"]
            factor = p.get("factor") or self.max_position / orig
            att = p.get("attention_factor")
            if att is None:
                att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
            ext = torch.tensor(p["long_factor"] if seq_len > orig else p["short_factor"], dtype=torch.float32)
            return 1.0 / (ext * base ** exps), att
        raise ValueError(f"unknown rope type {t}")

    @property
    def static(self) -> bool:
        """Whether the frequencies are independent of the sequence length (so tables can be precomputed)."""
        if self.rope_type == "dynamic":
            return False
        if self.rope_type == "longrope":
            return self.params.get("long_factor") == self.params.get("short_factor")
        return True

    def table(self, length: int, device, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin [length, dim/2] for positions 0..length-1, as exl2.kernels.rotary takes them.
        `seq_len` is the sequence length the frequencies are chosen for (dynamic and longrope only)."""
        inv, scale = self.inv_freq(seq_len or length)
        ang = torch.outer(torch.arange(length, dtype=torch.float32), inv)
        return (ang.cos() * scale).to(device), (ang.sin() * scale).to(device)


def llama3_inv_freq(inv: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling of the inverse frequencies `inv` (params as in rope_scaling)."""
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    lo_wl, hi_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    out = torch.where(wl > lo_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < hi_wl) & ~(wl > lo_wl)
    return torch.where(medium, smoothed, out)


def _yarn(spec: RopeSpec, p: dict) -> tuple[torch.Tensor, float]:
    dim, base = spec.dim, spec.theta
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            att = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            att = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, float(att)


def mrope_axes(sections: tuple[int, int, int], interleaved: bool = False) -> tuple[int, ...]:
    """Which position (0: temporal, 1: height, 2: width) each of a head's rotary frequencies turns with under
    M-RoPE: `sections` frequencies each, in three runs (Qwen2-VL), or interleaved t, h, w, t, h, w, … with the
    temporal axis taking what is left at the end (Qwen3-VL's mrope_interleaved)."""
    t, h, w = sections
    if not interleaved:
        return (0,) * t + (1,) * h + (2,) * w
    axes = [0] * (t + h + w)
    for axis, count in ((1, h), (2, w)):
        for i in range(axis, min(3 * count, len(axes)), 3):
            axes[i] = axis
    return tuple(axes)


def mrope_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin rows [B·T, dim/2] for 3-D positions [3, B, T] (M-RoPE): frequency i takes the row of
    its axis' position (`mrope_axes`) from the 1-D tables `cos`/`sin` [positions, dim/2]."""
    which = torch.tensor(axes, device=positions.device)
    index = positions.reshape(3, -1)[which].t()          # [B·T, dim/2]: each frequency's position
    return cos.gather(0, index.to(cos.device)), sin.gather(0, index.to(sin.device))


def rope_index(rope: tuple, q_pos: torch.Tensor) -> torch.Tensor:
    """The table rows a layer's tokens [B, T] rotate by: their cache positions q_pos, unless the tables carry rows
    of their own (`positioned`: M-RoPE models, where the two differ once a prompt holds an image)."""
    return rope[3] if len(rope) > 3 else q_pos


def positioned(tables: dict, q_pos: torch.Tensor, shift: Optional[torch.Tensor] = None,
               mrope: Optional[torch.Tensor] = None, axes: Optional[tuple[int, ...]] = None) -> dict:
    """`tables` (name → (cos, sin, interleaved)) with the rows each token [B, T] takes as a fourth entry: its
    position q_pos plus the row's `shift` [B] (text after an image, whose tokens took fewer positions than
    places), or with 3-D positions `mrope` [3, B, T] per-token rows built for them (M-RoPE `axes`)."""
    if mrope is None:
        index = q_pos + shift.to(q_pos.device).view(-1, 1)
        return {name: (*t[:3], index) for name, t in tables.items()}
    index = torch.arange(q_pos.numel(), device=q_pos.device).view(q_pos.shape)
    return {name: (*mrope_rows(t[0], t[1], mrope, axes), t[2], index) for name, t in tables.items()}
