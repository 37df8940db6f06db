"""The extended samplers (`exl2.generation.truncation`) against independent references: transformers' logits
warpers where it has one (temperature, top-k, top-p, min-p, typical), plain per-row Python for the rest (top-a,
tail-free, smoothing, dynamic temperature, Mirostat 2.0, XTC). Batched rows with different settings must each
equal their own single-row result."""
import math

import pytest
import torch
from transformers import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
                          TypicalLogitsWarper)

from exl2.config import SamplingSettings
from exl2.generation import truncation as T
from exl2.generation.sampler import filter_rows, sample_rows

NEG = float("-inf")


def _logits(b=4, v=64, seed=0, holes=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g) * 2.5
    if holes:
        x[0, ::5] = NEG
    return x


def _kept(y):
    return torch.isfinite(y)


def _probs(row):
    return torch.softmax(row.double(), -1)


@pytest.mark.parametrize("seed", range(4))
def test_common_filters_match_transformers_warpers(seed):
    """temperature → top-k → top-p → min-p → typical, each against transformers' warper applied in that order."""
    x = _logits(seed=seed)
    cases = [dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, typical=0.8),
             dict(temperature=1.3, typical=0.5), dict(temperature=1.0, top_p=0.5, typical=0.95),
             dict(temperature=0.9, min_p=0.1, top_k=7)]
    for case in cases:
        s = SamplingSettings(**case)
        got = T.truncate(x, [s] * x.shape[0])
        ref = TemperatureLogitsWarper(s.temperature)(None, x.clone())
        if s.top_k:
            ref = TopKLogitsWarper(s.top_k)(None, ref)
        if s.top_p < 1:
            ref = TopPLogitsWarper(s.top_p)(None, ref)
        if s.min_p:
            ref = MinPLogitsWarper(s.min_p)(None, ref)
        if s.typical < 1:
            ref = TypicalLogitsWarper(s.typical)(None, ref)
        assert torch.equal(_kept(got), _kept(ref)), case
        assert torch.allclose(got[_kept(got)], ref[_kept(ref)], rtol=1e-6)


def _ref_top_a(row, a):
    p = _probs(row)
    return torch.where(p < a * p.max() ** 2, NEG, row)


def _ref_tfs(row, z):
    p = _probs(row).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    sp = [p[i] for i in order]
    d1 = [sp[i] - sp[i + 1] for i in range(len(sp) - 1)]
    d2 = [abs(d1[i] - d1[i + 1]) for i in range(len(d1) - 1)]
    total = sum(d2)
    out = row.clone()
    if total == 0:
        return out
    run = 0.0
    for pos in range(len(sp)):
        if pos == 0:
            continue
        if pos == len(sp) - 1:
            out[order[pos]] = NEG
            continue
        run += d2[pos - 1] / total
        if run > z:
            out[order[pos]] = NEG
    return out


def _ref_smooth(row, f):
    m = row.max()
    return torch.tensor([m - f * (v - m) ** 2 if math.isfinite(v) else NEG for v in row.tolist()])


def _ref_dyn_temp(row, lo, hi, e):
    p = _probs(row).tolist()
    h = -sum(q * math.log(q) for q in p if q > 0)
    n = sum(math.isfinite(v) for v in row.tolist())
    t = lo + (hi - lo) * (h / math.log(n)) ** e if n > 1 else lo
    return row / max(t, T.MIN_TEMPERATURE)


def _ref_mirostat(row, mu):
    p = _probs(row)
    s = -torch.log2(p)
    out = torch.where(s > mu, NEG, row)
    out[row.argmax()] = row[row.argmax()]
    return out


def _ref_xtc(row, thr, keep=()):
    p = _probs(row).tolist()
    above = [i for i, q in enumerate(p) if q >= thr]
    out = row.clone()
    if len(above) < 2:
        return out
    least = min(above, key=lambda i: p[i])
    for i in above:
        if i != least and i not in keep:
            out[i] = NEG
    return out


def _close(a, b):
    assert torch.equal(_kept(a), _kept(b))
    assert torch.allclose(a[_kept(a)].double(), b[_kept(b)].double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_single_filters_match_plain_references(seed):
    x = _logits(b=3, v=48, seed=seed)
    for row in x:
        for a in (0.05, 0.2, 0.6):
            _close(T.top_a(row[None], [a])[0], _ref_top_a(row, a))
        for z in (0.3, 0.7, 0.95):
            _close(T.tail_free(row[None], [z])[0], _ref_tfs(row, z))
        for f in (0.2, 1.5):
            _close(T._smooth(row[None], [f])[0], _ref_smooth(row, f))
        for lo, hi, e in ((0.5, 1.5, 1.0), (0.0, 2.0, 0.5), (0.8, 1.2, 2.0)):
            s = SamplingSettings(temperature=1.0, min_temp=lo, max_temp=hi, temp_exponent=e)
            _close(T.truncate(row[None], [s])[0], _ref_dyn_temp(row, lo, hi, e))
        for mu in (1.0, 3.0, 6.0):
            s = SamplingSettings(temperature=1.0, mirostat_mode=2)
            _close(T.mirostat(row[None], [s], [True], [mu])[0], _ref_mirostat(row, mu))
        for thr in (0.02, 0.1, 0.3):
            s = SamplingSettings(temperature=1.0, xtc_probability=1.0, xtc_threshold=thr)
            _close(T.xtc(row[None], [s], [True], [0.5])[0], _ref_xtc(row, thr))
            keep = torch.zeros(row.numel(), dtype=torch.bool)
            top = int(row.argmax())
            keep[top] = True
            _close(T.xtc(row[None], [s], [True], [0.5], keep)[0], _ref_xtc(row, thr, {top}))


def test_xtc_fires_only_when_its_coin_falls_under_the_probability():
    x = _logits(b=1, v=32, seed=3, holes=False)
    s = SamplingSettings(temperature=1.0, xtc_probability=0.4, xtc_threshold=0.02)
    assert not torch.equal(T.xtc(x, [s], [True], [0.39]), x)
    assert torch.equal(T.xtc(x, [s], [True], [0.41]), x)
    coins = [T.xtc_coin(7, c) for c in range(4000)]
    assert all(0.0 <= c < 1.0 for c in coins) and abs(sum(coins) / len(coins) - 0.5) < 0.02
    assert coins == [T.xtc_coin(7, c) for c in range(4000)] and coins[:50] != [T.xtc_coin(8, c) for c in range(50)]


def test_sample_rows_never_lets_xtc_drop_the_kept_tokens():
    """XTC at probability 1 with a low threshold: the likeliest token is never drawn, unless `xtc_keep` marks it."""
    x = _logits(b=1, v=16, seed=6, holes=False)
    top = int(x.argmax())
    s = SamplingSettings(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.01, seed=2)
    n = 400
    keep = torch.zeros(16, dtype=torch.bool)
    keep[top] = True
    assert (sample_rows(x.expand(n, -1), [s] * n, [2] * n, list(range(n))) != top).all()
    assert (sample_rows(x.expand(n, -1), [s] * n, [2] * n, list(range(n)), xtc_keep=keep) == top).any()
    rows = torch.zeros(n, 16, dtype=torch.bool)   # per row: the odd rows keep the top token, the even rows nothing
    rows[1::2, top] = True
    drawn = sample_rows(x.expand(n, -1), [s] * n, [2] * n, list(range(n)), xtc_keep=rows)
    assert (drawn[0::2] != top).all() and (drawn[1::2] == top).any()


def test_chain_order_and_temperature_last():
    """One row through every stage equals the references applied in exllamav2's order; temperature_last moves
    the division after the truncations (which then see the untempered distribution)."""
    x = _logits(b=1, v=64, seed=11, holes=False)[0]
    s = SamplingSettings(temperature=0.6, smoothing_factor=0.3, top_k=40, top_p=0.95, top_a=0.02, min_p=0.01,
                         tfs=0.97, typical=0.9, mirostat_mode=2, xtc_probability=1.0, xtc_threshold=0.05)
    ref = _ref_smooth(x, 0.3) / 0.6
    ref = TopKLogitsWarper(40)(None, ref[None])
    ref = TopPLogitsWarper(0.95)(None, ref)[0]
    ref = _ref_top_a(ref, 0.02)
    ref = MinPLogitsWarper(0.01)(None, ref[None])[0]
    ref = _ref_tfs(ref, 0.97)
    ref = TypicalLogitsWarper(0.9)(None, ref[None])[0]
    ref = _ref_mirostat(ref, 2 * 1.5)
    ref = _ref_xtc(ref, 0.05)
    _close(T.truncate(x[None], [s], coins=[0.0])[0], ref)

    last = SamplingSettings(temperature=3.0, top_p=0.8, temperature_last=True)
    ref = TopPLogitsWarper(0.8)(None, x[None].clone())[0] / 3.0
    _close(T.truncate(x[None], [last])[0], ref)
    assert not torch.equal(_kept(T.truncate(x[None], [last])), _kept(T.truncate(x[None], [last.model_copy(
        update={"temperature_last": False})])))


def test_rows_are_independent_and_greedy_rows_untouched():
    x = _logits(b=5, v=80, seed=5)
    settings = [SamplingSettings(temperature=0.8, top_a=0.1, tfs=0.9),
                SamplingSettings(temperature=0.0, typical=0.5),
                SamplingSettings(temperature=1.2, min_temp=0.5, max_temp=2.0, temperature_last=True, top_k=30),
                SamplingSettings(temperature=1.0, mirostat_mode=2, mirostat_tau=2.0, xtc_probability=0.5),
                SamplingSettings(temperature=0.7, smoothing_factor=0.4, typical=0.7)]
    coins = [0.1, 0.9, 0.2, 0.3, 0.4]
    mus = [None, None, None, 2.5, None]
    both = T.truncate(x, settings, coins, mus)
    for i, s in enumerate(settings):
        alone = T.truncate(x[i:i + 1], [s], [coins[i]], [mus[i]])
        assert torch.equal(_kept(both[i:i + 1]), _kept(alone))
        assert torch.allclose(both[i:i + 1][_kept(alone)], alone[_kept(alone)], rtol=1e-6)
    assert torch.equal(both[1], x[1])


def test_mirostat_mu_follows_the_observed_surprise():
    """sample_rows updates μ in place: μ − eta·(−log2 p(token) − tau), p under the distribution drawn from; the
    μ steers the kept set (a lower μ keeps fewer tokens)."""
    x = _logits(b=2, v=64, seed=2, holes=False)
    s = SamplingSettings(temperature=1.0, mirostat_mode=2, mirostat_tau=3.0, mirostat_eta=0.2, seed=1)
    mus = [None, 4.0]
    picks = sample_rows(x, [s, s], [1, 2], [0, 0], mus=mus)
    for row, start, mu, pick in zip(x, [6.0, 4.0], mus, picks.tolist()):
        y = _ref_mirostat(row, start)
        lp = torch.log_softmax(y.double(), -1)[pick].item()
        assert mu == pytest.approx(start - 0.2 * (-lp / math.log(2) - 3.0), rel=1e-5)
        assert math.isfinite(y[pick])
    assert _kept(T.mirostat(x, [s, s], [True, True], [1.0, 1.0])).sum() < _kept(
        T.mirostat(x, [s, s], [True, True], [5.0, 5.0])).sum()


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Drawing many times with fresh counters: each token's frequency is its probability after the filters
    (tail-free + top-a + dynamic temperature), within 4 standard errors; removed tokens never come."""
    x = _logits(b=1, v=24, seed=9, holes=False)
    s = SamplingSettings(temperature=1.0, tfs=0.95, top_a=0.01, min_temp=0.7, max_temp=1.4)
    n = 6000
    draws = sample_rows(x.expand(n, -1), [s] * n, [5] * n, list(range(n)))
    p = torch.softmax(T.truncate(x, [s])[0].double(), -1)
    freq = torch.bincount(draws, minlength=24).double() / n
    assert freq[p == 0].sum() == 0
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9).all()


def test_filter_rows_keeps_the_old_chain_for_common_settings():
    """Settings without the extended samplers go through exactly temperature → top-k → top-p → min-p (what the
    fused GPU kernels implement)."""
    x = _logits(b=3, v=40, seed=4)
    settings = [SamplingSettings(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
                SamplingSettings(temperature=1.1), SamplingSettings(temperature=0.0)]
    _, y = filter_rows(x, settings)
    for i, s in enumerate(settings[:2]):
        ref = x[i:i + 1] / s.temperature
        ref = TopKLogitsWarper(s.top_k)(None, ref) if s.top_k else ref
        ref = TopPLogitsWarper(s.top_p)(None, ref) if s.top_p < 1 else ref
        ref = MinPLogitsWarper(s.min_p)(None, ref) if s.min_p else ref
        _close(y[i], ref[0])
    assert torch.equal(y[2], x[2])
    assert not any(s.extended for s in settings)


def test_extended_flag():
    assert not SamplingSettings().extended
    assert not SamplingSettings(temperature=0, top_a=0.5).extended   # greedy never truncates
    for kw in (dict(top_a=0.1), dict(tfs=0.9), dict(typical=0.9), dict(smoothing_factor=0.2),
               dict(temperature_last=True), dict(min_temp=0.5, max_temp=1.5), dict(xtc_probability=0.5),
               dict(mirostat_mode=2)):
        assert SamplingSettings(**kw).extended, kw
    for kw in (dict(tfs=0.0), dict(typical=0.0), dict(min_temp=1.5, max_temp=0.5), dict(dry_multiplier=0.8)):
        assert not SamplingSettings(**kw).extended, kw
