"""DRY penalties against a plain brute-force reference; breaker masks and token texts on a real tokenizer."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from exl2.config import SamplingSettings
from exl2.generation.dry import DEFAULT_BREAKERS, apply_dry, dry_penalties, sequence_breakers
from exl2.generation.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"


def reference(history, breakers, multiplier, base, allowed_length, dry_range=0, max_ngram=20):
    """The semantics written out directly: {token id: penalty}."""
    if multiplier == 0:
        return {}
    h = list(history[-dry_range:]) if dry_range > 0 else list(history)
    L = len(h)
    V = len(breakers)

    def is_breaker(t):
        return t < 0 or t >= V or bool(breakers[t])

    best = {}
    for j in range(1, L):
        n = 0
        for cand_n in range(0, min(max_ngram, j) + 1):
            ok = True
            for k in range(cand_n):
                if h[j - 1 - k] != h[L - 1 - k] or is_breaker(h[L - 1 - k]):
                    ok = False
                    break
            if ok:
                n = cand_n
        t = h[j]
        best[t] = max(best.get(t, 0), n)
    return {t: multiplier * base ** (n - allowed_length)
            for t, n in best.items() if n >= allowed_length and 0 <= t < V}


def as_dict(result):
    ids, pens = result
    assert ids.dtype == torch.int64 and pens.dtype == torch.float32
    assert ids.shape == pens.shape
    assert ids.tolist() == sorted(set(ids.tolist()))
    return dict(zip(ids.tolist(), pens.tolist()))


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for t, v in want.items():
        assert got[t] == pytest.approx(v, rel=1e-6)


def test_matches_brute_force_reference():
    rng = random.Random(1234)
    for trial in range(1500):
        vocab = rng.randint(6, 12)
        L = rng.randint(0, 60)
        # Small alphabets make long repeats common; a few ids outside the mask's range test that rule.
        alphabet = rng.randint(2, vocab)
        history = [rng.randrange(alphabet) for _ in range(L)]
        if rng.random() < 0.1 and history:
            history[rng.randrange(L)] = rng.choice([-1, vocab, vocab + 3])
        breakers = torch.tensor([rng.random() < 0.2 for _ in range(vocab)], dtype=torch.bool)
        allowed = rng.randint(1, 3)
        dry_range = rng.choice([0, 0, rng.randint(1, 30)])
        max_ngram = rng.choice([1, 2, 3, 20, 100])
        mult, base = rng.choice([0.5, 0.8, 2.0]), rng.choice([1.0, 1.75, 3.0])
        got = as_dict(dry_penalties(history, breakers, mult, base, allowed, dry_range, max_ngram))
        want = reference(history, breakers.tolist(), mult, base, allowed, dry_range, max_ngram)
        assert_same(got, want)


def test_tensor_history_same_as_list():
    history = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2, 3]
    brk = torch.zeros(8, dtype=torch.bool)
    a = dry_penalties(history, brk, 1.0, 1.75, 2)
    b = dry_penalties(torch.tensor(history), brk, 1.0, 1.75, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


A, B, C, D, DOT = 0, 1, 2, 3, 4


def _brk(vocab=6, on=(DOT,)):
    m = torch.zeros(vocab, dtype=torch.bool)
    m[list(on)] = True
    return m


def test_repeat_penalizes_continuation():
    # "a b c d a b c": the suffix "a b c" occurred before 'd' -> n = 3, allowed 2 -> multiplier * base^1.
    got = as_dict(dry_penalties([A, B, C, D, A, B, C], _brk(), 0.8, 1.75, 2))
    assert got == {D: pytest.approx(0.8 * 1.75)}


def test_breaker_in_suffix_stops_match():
    # "a . c d a . c": the suffix match stops at the breaker '.', so 'd' only matches n = 1 < 2.
    assert as_dict(dry_penalties([A, DOT, C, D, A, DOT, C], _brk(), 0.8, 1.75, 2)) == {}
    # With allowed 1 it is penalized at n = 1.
    assert as_dict(dry_penalties([A, DOT, C, D, A, DOT, C], _brk(), 0.8, 1.75, 1)) == {D: pytest.approx(0.8)}


def test_range_cuts_off_earlier_occurrence():
    history = [A, B, C, D, DOT, DOT, A, B, C]
    assert D in as_dict(dry_penalties(history, _brk(), 1.0, 1.75, 2))
    assert as_dict(dry_penalties(history, _brk(), 1.0, 1.75, 2, dry_range=5)) == {}


def test_multiplier_zero_and_short_history_empty():
    assert as_dict(dry_penalties([A, B, C, D, A, B, C], _brk(), 0.0, 1.75, 2)) == {}
    assert as_dict(dry_penalties([A], _brk(), 1.0, 1.75, 1)) == {}
    assert as_dict(dry_penalties([], _brk(), 1.0, 1.75, 1)) == {}


def test_max_ngram_caps_length():
    history = [A, B, C, D, A, B, C]
    got = as_dict(dry_penalties(history, _brk(), 1.0, 2.0, 1, max_ngram=2))
    assert got == {D: pytest.approx(2.0)}  # n capped at 2 -> base^(2-1)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(GOLDEN)


def test_token_texts(tok):
    texts = tok.token_texts()
    assert len(texts) == tok.vocab_size
    assert texts == [tok.decode([i]) for i in range(tok.vocab_size)]
    assert tok.token_texts() is texts  # cached


def test_default_breakers(tok):
    mask = sequence_breakers(tok, None)
    texts = tok.token_texts()
    assert mask.dtype == torch.bool and mask.shape == (tok.vocab_size,)
    special = tok.special_ids
    assert special
    for i, t in enumerate(texts):
        if "." in t or "\n" in t or i in special:
            assert mask[i], (i, t)
        if i not in special and not any(s in t for s in DEFAULT_BREAKERS):
            assert not mask[i], (i, t)
    assert any("." in t for t in texts)
    assert sequence_breakers(tok, None) is mask  # cached


def test_custom_breakers(tok):
    mask = sequence_breakers(tok, ["*"])
    want = [("*" in t) for t in tok.token_texts()]
    assert mask.tolist() == want
    assert sequence_breakers(tok, ("*",)) is mask


def test_apply_dry_one_row():
    V = 6
    history = [A, B, C, D, A, B, C]
    brk = _brk(V)
    s = SamplingSettings(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    logits = torch.randn(2, V, dtype=torch.float16)
    out = apply_dry(logits, [(1, history, s, brk)])
    want = logits.float().clone()
    for t, p in reference(history, brk.tolist(), 0.8, 1.75, 2).items():
        want[1, t] -= p
    assert out.dtype == torch.float32
    assert torch.equal(out[0], logits[0].float())
    assert torch.allclose(out[1], want[1], rtol=0, atol=1e-6)
    assert not torch.equal(out[1], logits[1].float())

    # Nothing to penalize: the very same tensor comes back.
    assert apply_dry(logits, [(0, [A, B, C], s, brk)]) is logits
    assert apply_dry(logits, []) is logits


def test_apply_dry_skips_ids_past_logits():
    # The breaker mask is larger than the logits' vocabulary; penalties for ids >= V are dropped.
    s = SamplingSettings(dry_multiplier=1.0, dry_allowed_length=1)
    brk = torch.zeros(10, dtype=torch.bool)
    logits = torch.zeros(1, 4)
    out = apply_dry(logits, [(0, [1, 8, 1], s, brk)])
    assert out is logits
    out = apply_dry(logits, [(0, [1, 2, 8, 1, 2, 8, 1], s, brk)])
    assert out[0].tolist()[2] < 0 and out[0].tolist()[0] == 0 and out[0].tolist()[1] == 0


def test_apply_dry_batches_rows_like_one_row_at_a_time():
    """Many rows at once (different lengths, settings, ranges, longest n-grams and breaker masks; some with nothing
    to penalize) subtract exactly what the brute-force reference gives each row alone."""
    rng = random.Random(7)
    V = 9
    for trial in range(60):
        rows, want = [], torch.zeros(5, V)
        for r in rng.sample(range(5), rng.randint(1, 5)):
            history = [rng.randrange(V) for _ in range(rng.randint(0, 40))]
            brk = torch.tensor([rng.random() < 0.2 for _ in range(V)])
            s = SamplingSettings(dry_multiplier=rng.choice([0.0, 0.5, 1.3]), dry_base=rng.choice([1.5, 2.0]),
                                 dry_allowed_length=rng.randint(1, 3), dry_range=rng.choice([0, 0, 12]),
                                 dry_max_ngram=rng.choice([2, 3, 20]))
            rows.append((r, history, s, brk))
            h = history[-s.dry_range:] if s.dry_range else history
            if s.dry_multiplier:
                for t, p in reference(h, brk.tolist(), s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                                      max_ngram=s.dry_max_ngram).items():
                    want[r, t] -= p
        got = apply_dry(torch.zeros(5, V), rows)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), trial


def test_token_history_follows_a_growing_and_taken_back_token_list():
    from exl2.generation.dry import TokenHistory

    h, tokens = TokenHistory(), []
    for step in range(600):                      # past the first buffer size: it grows and keeps what it had
        tokens.append(step % 37)
        assert h.sync(tokens).tolist() == tokens
    del tokens[590:]
    h.truncate(len(tokens))
    tokens += [5, 6]
    assert h.sync(tokens).tolist() == tokens
    del tokens[100:]                             # cut short without truncate(): sync sees a shorter list
    assert h.sync(tokens).tolist() == tokens
    tokens.append(9)
    assert h.sync(tokens).tolist() == tokens


def test_each_row_keeps_its_own_longest_ngram():
    """Two rows with one history (a repeat of 5 tokens) and dry_max_ngram 2 and 20: batched together, the first
    row's match is capped at 2 (penalty 1 · 1.75^0), the second's is the full 5 (1.75^3)."""
    h = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    rows = [(i, h, SamplingSettings(dry_multiplier=1.0, dry_max_ngram=n), torch.zeros(9, dtype=torch.bool))
            for i, n in enumerate((2, 20))]
    got = apply_dry(torch.zeros(2, 9), rows)
    assert got[0, 6].item() == pytest.approx(-1.0) and got[1, 6].item() == pytest.approx(-1.75 ** 3)
    assert got[:, :6].abs().sum() == 0 and got[:, 7:].abs().sum() == 0
