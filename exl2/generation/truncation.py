"""What a sampled draw does to the (penalized) logits on the PyTorch path, batched over rows with per-row settings:
temperature (static, dynamic, or after the truncations), quadratic smoothing, then top-k, top-p, top-a, min-p,
tail-free, locally typical and Mirostat 2.0 truncation, then XTC. exllamav2's order; removed tokens become -inf.

Each stage runs only when some row asks for it, and leaves the other rows as they are. The fused GPU kernels
(`kernels.sampling`) cover temperature, top-k, top-p and min-p; a batch with any other filter runs here.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from exl2.config import SamplingSettings
from exl2.runtime.upload import upload

NEG_INF = float("-inf")
MIN_TEMPERATURE = 0.01   # a dynamic temperature below this is as good as greedy; it also keeps the division finite


def _column(values: Sequence[float], dev: torch.device) -> torch.Tensor:
    return upload(list(values), torch.float32, dev)[:, None]


def _rows(flags: Sequence[bool], dev: torch.device) -> torch.Tensor:
    return upload(list(flags), torch.bool, dev)[:, None]


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) [B, 1] of the distributions with log-probabilities `logp`; removed tokens (-inf)
    contribute nothing."""
    return -(logp.exp() * logp).nan_to_num(0.0).sum(-1, keepdim=True)


def _temperatures(y: torch.Tensor, settings: Sequence[SamplingSettings], here: Sequence[bool]) -> torch.Tensor:
    """[B, 1] divisors: each row in `here` its temperature (dynamic: mapped from the entropy of its current
    distribution relative to the most it could have), other rows 1."""
    dev = y.device
    static = _column([s.temperature if h and not s.dynamic_temperature else 1.0 for s, h in zip(settings, here)], dev)
    dyn = [h and s.dynamic_temperature for s, h in zip(settings, here)]
    if not any(dyn):
        return static
    params = upload([[s.min_temp, s.max_temp, s.temp_exponent] for s in settings], torch.float32, dev)
    lo, hi, exponent = params[:, :1], params[:, 1:2], params[:, 2:3]
    alive = torch.isfinite(y).sum(-1, keepdim=True).float()
    entropy = _entropy(torch.log_softmax(y, dim=-1))
    spread = torch.where(alive > 1, entropy / alive.clamp(min=2).log(), 0.0).clamp(0.0, 1.0)
    t = (lo + (hi - lo) * spread.pow(exponent)).clamp(min=MIN_TEMPERATURE)
    return torch.where(_rows(dyn, dev), t, static)


def _smooth(y: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """Quadratic sampling: logit → max − factor · (logit − max)² (factor 0: unchanged)."""
    f = _column(factors, y.device)
    top = y.max(-1, keepdim=True).values
    return torch.where(f > 0, top - f * (y - top).square(), y)


def top_k(y: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Keep each row's ks[i] largest logits (0 or ≥ the vocabulary: all)."""
    vocab = y.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in ks]
    if not any(ks):
        return y
    k = upload(ks, torch.long, y.device)[:, None]
    kth = torch.topk(y, max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0))
    return y.masked_fill((k > 0) & (y < kth), NEG_INF)


def top_p(y: torch.Tensor, ps: Sequence[float]) -> torch.Tensor:
    """Keep the smallest set of likeliest tokens whose probability reaches ps[i] (1: all)."""
    if all(p >= 1.0 for p in ps):
        return y
    p = _column(ps, y.device)
    sorted_y, order = torch.sort(y, dim=-1, descending=False)
    cum = sorted_y.softmax(dim=-1).cumsum(dim=-1)
    drop = (cum <= (1.0 - p)) & (p < 1.0)
    drop[..., -1] = False
    return y.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


def _relative_cut(y: torch.Tensor, values: Sequence[float], power: int) -> torch.Tensor:
    """Drop tokens with p < values[i] · p_max^power (min-p: power 1, top-a: 2); the likeliest always stays."""
    if all(v <= 0.0 for v in values):
        return y
    v = _column(values, y.device)
    probs = y.softmax(dim=-1)
    drop = probs < v * probs.max(dim=-1, keepdim=True).values.pow(power)
    drop.scatter_(-1, y.argmax(dim=-1, keepdim=True), False)
    return y.masked_fill(drop, NEG_INF)


def min_p(y: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    return _relative_cut(y, values, 1)


def top_a(y: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    return _relative_cut(y, values, 2)


def _off(v: float) -> bool:
    return v <= 0.0 or v >= 1.0


def tail_free(y: torch.Tensor, zs: Sequence[float]) -> torch.Tensor:
    """Tail-free sampling: sort by probability, take the normalized absolute second differences of the sorted
    probabilities, and cut where their running sum passes z (the likeliest token stays, the last one goes)."""
    if all(_off(z) for z in zs) or y.shape[-1] < 3:
        return y
    z = _column([1.0 if _off(v) else v for v in zs], y.device)
    probs, order = y.softmax(dim=-1).sort(dim=-1, descending=True)
    d2 = probs.diff(dim=-1).diff(dim=-1).abs()
    total = d2.sum(-1, keepdim=True)
    cdf = (d2 / total.clamp(min=1e-30)).cumsum(dim=-1)
    edge = torch.ones_like(probs[:, :1], dtype=torch.bool)
    drop = torch.cat([~edge, cdf > z, edge], dim=-1) & (z < 1.0) & (total > 0)
    return y.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


def typical(y: torch.Tensor, masses: Sequence[float]) -> torch.Tensor:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to masses[i] of
    probability (ties with the last kept token stay)."""
    if all(_off(m) for m in masses):
        return y
    m = _column([1.0 if _off(v) else v for v in masses], y.device)
    logp = torch.log_softmax(y, dim=-1)
    entropy = _entropy(logp)
    shift = (-logp - entropy).abs()
    sorted_shift, order = shift.sort(dim=-1)
    cum = logp.exp().gather(-1, order).cumsum(dim=-1)
    last = (cum < m).sum(-1, keepdim=True).clamp(max=y.shape[-1] - 1)
    drop = (sorted_shift > sorted_shift.gather(-1, last)) & (m < 1.0)
    return y.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


def mirostat_mus(settings: Sequence[SamplingSettings], mus: Optional[Sequence[Optional[float]]]) -> list[float]:
    """Each row's current μ: its own where it has one, else the starting 2·tau."""
    mus = mus or [None] * len(settings)
    return [m if m is not None else 2.0 * s.mirostat_tau for s, m in zip(settings, mus)]


def mirostat(y: torch.Tensor, settings: Sequence[SamplingSettings], live: Sequence[bool],
             mus: Optional[Sequence[Optional[float]]]) -> torch.Tensor:
    """Mirostat 2.0's truncation: drop tokens whose surprise (−log2 p) exceeds the row's μ; the likeliest stays."""
    on = [g and s.mirostat for s, g in zip(settings, live)]
    if not any(on):
        return y
    mu = _column(mirostat_mus(settings, mus), y.device)
    surprise = -torch.log_softmax(y, dim=-1) / math.log(2.0)
    drop = (surprise > mu) & _rows(on, y.device)
    drop.scatter_(-1, y.argmax(dim=-1, keepdim=True), False)
    return y.masked_fill(drop, NEG_INF)


def mirostat_update(y: torch.Tensor, picks: torch.Tensor, settings: Sequence[SamplingSettings],
                    mus: Sequence[Optional[float]]) -> list[Optional[float]]:
    """The rows' μ after drawing `picks` from softmax(y): μ − eta · (observed surprise − tau) for Mirostat rows
    (None for the others). Reads the picks' probabilities back from the device."""
    start = mirostat_mus(settings, mus)
    logp = torch.log_softmax(y, dim=-1).gather(-1, picks.view(-1, 1))[:, 0].tolist()
    return [m - s.mirostat_eta * (-lp / math.log(2.0) - s.mirostat_tau) if s.mirostat and not s.greedy else None
            for s, m, lp in zip(settings, start, logp)]


def xtc(y: torch.Tensor, settings: Sequence[SamplingSettings], live: Sequence[bool], coins: Sequence[float],
        keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exclude Top Choices: in rows whose coin falls under their xtc_probability, drop every token of probability
    ≥ xtc_threshold except the least likely of them, when at least two qualify; `keep` (bool [V], or [B, V] per
    row) marks tokens never dropped (by default newlines and special tokens)."""
    on = [g and s.xtc_probability > 0.0 and c < s.xtc_probability for s, g, c in zip(settings, live, coins)]
    if not any(on):
        return y
    dev = y.device
    probs = y.softmax(dim=-1)
    above = probs >= _column([s.xtc_threshold for s in settings], dev)
    least = torch.where(above, probs, 2.0).argmin(dim=-1, keepdim=True)
    drop = above.scatter(-1, least, False) & (above.sum(-1, keepdim=True) >= 2) & _rows(on, dev)
    if keep is not None:
        drop &= ~keep[..., : y.shape[-1]].to(dev)
    return y.masked_fill(drop, NEG_INF)


def truncate(x: torch.Tensor, settings: Sequence[SamplingSettings], coins: Optional[Sequence[float]] = None,
             mus: Optional[Sequence[Optional[float]]] = None, xtc_keep: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """float32 [B, V] penalized logits → the logits row i is drawn from under settings[i] (greedy rows: as
    they are). `coins`: each row's uniform draw in [0, 1) for XTC; `mus`: Mirostat rows' current μ (None: the
    start); `xtc_keep`: tokens XTC never drops."""
    live = [not s.greedy for s in settings]
    if not any(live):
        return x
    y = x
    if any(g and s.smoothing_factor > 0 for s, g in zip(settings, live)):
        y = _smooth(y, [s.smoothing_factor if g else 0.0 for s, g in zip(settings, live)])
    y = y / _temperatures(y, settings, [g and not s.temperature_last for s, g in zip(settings, live)])
    y = top_k(y, [s.top_k if g else 0 for s, g in zip(settings, live)])
    y = top_p(y, [s.top_p if g else 1.0 for s, g in zip(settings, live)])
    y = top_a(y, [s.top_a if g else 0.0 for s, g in zip(settings, live)])
    y = min_p(y, [s.min_p if g else 0.0 for s, g in zip(settings, live)])
    y = tail_free(y, [s.tfs if g else 1.0 for s, g in zip(settings, live)])
    y = typical(y, [s.typical if g else 1.0 for s, g in zip(settings, live)])
    y = mirostat(y, settings, live, mus)
    last = [g and s.temperature_last for s, g in zip(settings, live)]
    if any(last):
        y = y / _temperatures(y, settings, last)
    if coins is not None:
        y = xtc(y, settings, live, coins, xtc_keep)
    return y


def skew_point(seed: int, counter: int, skew: float) -> float:
    """Where in the sorted distribution's mass a skewed draw lands (exllamav2's skew): u^exp(-skew) for a uniform
    u of the row's seed and draw counter (a stream apart from XTC's), so a draw repeats as XTC's does."""
    return xtc_coin(seed ^ 0x632BE59BD9B4E019, counter) ** math.exp(-skew)


def skewed_draw(y: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """int64 [B]: for each row of the filtered logits y [B, V], the first token, likeliest first, at which the
    running probability reaches `points` [B] (float32 in [0, 1))."""
    p, order = torch.softmax(y.float(), dim=-1).sort(dim=-1, descending=True)
    cdf = p.cumsum(dim=-1)
    last = (p > 0).sum(dim=-1, keepdim=True) - 1          # rounding must not land past the kept tokens
    pos = torch.minimum(torch.searchsorted(cdf, points[:, None].to(cdf.dtype), right=True), last.clamp(min=0))
    return order.gather(-1, pos).squeeze(-1)


def xtc_coin(seed: int, counter: int) -> float:
    """A uniform number in [0, 1) for XTC's choice at a row's draw `counter`, from its seed alone, so that a
    speculative check of the same draw decides the same way (splitmix64 of the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + counter * 0xD1B54A32D192ED03 + 0x5851F42D4C957F2D) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)
