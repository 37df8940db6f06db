"""Sampler against transformers' logits processors; seeded reproducibility; empirical frequencies."""
from __future__ import annotations

import math

import pytest
import torch

from exl2.kernels.backend import INTERPRET

from exl2.config import SamplingSettings
from exl2.generation.sampler import (SeenTokens, apply_repetition_penalty, filter_logits, filter_rows, make_generator,
                                    sample_rows)
from exl2.kernels.backend import force_triton
from exl2.kernels.sampling import counter_uniform, hash32, row_keys

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _hf_chain(settings: SamplingSettings, input_ids, scores):
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper,
    )

    procs = []
    if settings.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
    if settings.temperature not in (0.0, 1.0):
        procs.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k:
        procs.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        procs.append(TopPLogitsWarper(settings.top_p))
    if settings.min_p > 0.0:
        procs.append(MinPLogitsWarper(settings.min_p))
    return LogitsProcessorList(procs)(input_ids, scores.clone())


CASES = [
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=0.9, min_p=0.05),
    dict(temperature=2.0, min_p=0.2),
    dict(temperature=0.8, top_k=200, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
    dict(temperature=1.5, top_k=7, top_p=0.8, repetition_penalty=0.8),
    dict(temperature=1.0, repetition_penalty=1.5),
]


@pytest.mark.parametrize("index", range(len(CASES)))
@pytest.mark.parametrize("device", DEVICES)
def test_filters_match_transformers(index, device):
    case = CASES[index]
    torch.manual_seed(index)
    batch, vocab = 4, 1000
    logits = torch.randn(batch, vocab) * 4
    past = torch.randint(0, vocab, (batch, 64))
    settings = SamplingSettings(**case)
    ref = _hf_chain(settings, past, logits)
    ours = filter_logits(apply_repetition_penalty(logits.to(device), settings.repetition_penalty, past.to(device)),
                         settings).cpu()
    keep = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), keep)
    filtering = settings.top_k or settings.top_p < 1.0 or settings.min_p > 0.0
    assert 0 < keep.sum() < batch * vocab if filtering else keep.all()
    torch.testing.assert_close(ours[keep], ref[keep], rtol=1e-5, atol=1e-5)


def test_repetition_penalty_rows_and_padding():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0], [2.0, -2.0, 1.0, -1.0]])
    expected = torch.tensor([[1.0, -4.0, 1.0, -1.0], [2.0, -2.0, 0.5, -2.0]])
    as_list = apply_repetition_penalty(logits, 2.0, [[0, 1, 0], [2, 3]])
    as_tensor = apply_repetition_penalty(logits, 2.0, torch.tensor([[0, 1, 0, -1], [2, 3, -1, -1]]))
    torch.testing.assert_close(as_list, expected)
    torch.testing.assert_close(as_tensor, expected)


def _seen(past: list[list[int]], vocab: int, device) -> torch.Tensor:
    mask = torch.zeros(len(past), vocab, dtype=torch.bool, device=device)
    for row, ids in enumerate(past):
        mask[row, ids] = True
    return mask


@pytest.mark.parametrize("device", DEVICES)
def test_greedy(device):
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.0]], device=device)
    out = sample_rows(logits, [SamplingSettings(temperature=0.0)] * 2, [0, 0], [0, 0])
    assert out.dtype == torch.int64 and out.device.type == device
    assert out.tolist() == [1, 0]
    # top_k=1 is greedy too, and the repetition penalty still applies before the argmax.
    out = sample_rows(logits, [SamplingSettings(top_k=1, repetition_penalty=2.0)] * 2, [0, 0], [0, 0],
                      _seen([[1], [0]], 4, device))
    assert out.tolist() == [2, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_reproducibility(device):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)).to(device)
    settings = [SamplingSettings(temperature=1.0, top_p=0.95)] * 8
    runs = []
    for seed in (1234, 1234, 99):
        runs.append(torch.stack([sample_rows(logits, settings, [seed] * 8, [step] * 8)
                                 for step in range(5)]).cpu())
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def _frequencies(logits_row, settings, n=40000):
    out = sample_rows(logits_row.expand(n, -1), [settings] * n, [5] * n, list(range(n)))
    return torch.bincount(out, minlength=logits_row.numel()).double() / n


def test_empirical_frequencies():
    """The Gumbel-max draw over the counter noise samples the filtered softmax."""
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, -3.0])
    # Binomial std for n=40000 is at most 0.0025; 0.012 is ~5 sigma.
    freq = _frequencies(logits, SamplingSettings(temperature=1.0))
    torch.testing.assert_close(freq, logits.double().softmax(0), atol=0.012, rtol=0)
    freq = _frequencies(logits, SamplingSettings(temperature=0.5))
    torch.testing.assert_close(freq, (logits.double() / 0.5).softmax(0), atol=0.012, rtol=0)
    freq = _frequencies(logits, SamplingSettings(temperature=1.0, top_k=2))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:2] = logits[:2].double().softmax(0)
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)
    assert freq[2:].sum() == 0
    # min_p=0.3 keeps tokens with p >= 0.3 * p_max: here the first three.
    freq = _frequencies(logits, SamplingSettings(temperature=1.0, min_p=0.3))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:3] = logits[:3].double().softmax(0)
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)
    freq = _frequencies(logits, SamplingSettings(temperature=0.5, top_k=3))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:3] = (logits[:3].double() / 0.5).softmax(0)
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)
    assert freq[3:].sum() == 0


def test_skew_draws_at_the_skewed_point_of_the_sorted_mass():
    """exllamav2's skew: the token at u^exp(-skew) of the mass, likeliest first. The likeliest token (p0) is then
    drawn with probability P(u^exp(-skew) < p0) = p0^exp(skew): 0.5^e ≈ 0.152 for skew 1 (0.5 plain), 0.5^(1/e) ≈
    0.775 for skew -1; a tiny skew samples the distribution itself."""
    from exl2.generation.truncation import skewed_draw

    y = torch.tensor([[0.0, float("-inf"), 2.0, 1.0]])
    p = y.softmax(-1)[0]       # order by likelihood: 2, 3, 0
    for point, token in ((0.0, 2), (float(p[2]) - 1e-4, 2), (float(p[2]) + 1e-4, 3), (0.999999, 0), (1.0, 0)):
        assert int(skewed_draw(y, torch.tensor([point]))[0]) == token, point
    logits = torch.tensor([0.0, -0.5, -1.0, -2.0])
    probs = logits.double().softmax(0)
    for skew, top in ((1.0, float(probs[0]) ** math.e), (-1.0, float(probs[0]) ** (1 / math.e))):
        freq = _frequencies(logits, SamplingSettings(temperature=1.0, skew=skew))
        assert abs(float(freq[0]) - top) < 0.012, (skew, float(freq[0]), top)
    freq = _frequencies(logits, SamplingSettings(temperature=1.0, skew=1e-9))
    torch.testing.assert_close(freq, probs, atol=0.012, rtol=0)
    # the draw repeats for a seed and counter, and a skew over top-k keeps to the kept tokens
    s = SamplingSettings(temperature=1.0, top_k=2, skew=3.0)
    a = sample_rows(logits.expand(64, -1), [s] * 64, [7] * 64, list(range(64)))
    assert torch.equal(a, sample_rows(logits.expand(64, -1), [s] * 64, [7] * 64, list(range(64))))
    assert set(a.tolist()) <= {0, 1}


def test_fp16_logits():
    logits = torch.randn(1, 300).half()
    out = sample_rows(logits, [SamplingSettings(temperature=0.9, top_k=10)], [3], [0])
    assert out.shape == (1,) and out.dtype == torch.int64
    assert out.item() in torch.topk(logits.float(), 10).indices[0].tolist()


def test_make_generator_unseeded_differs():
    a = torch.randint(0, 1 << 30, (4,), generator=make_generator(None))
    b = torch.randint(0, 1 << 30, (4,), generator=make_generator(None))
    assert not torch.equal(a, b)


# ---- the batched sampler -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_filter_rows_is_the_per_row_chain(device):
    """Every row of a batch mixing all CASES (and a greedy row) gets the per-row `sample` chain: exactly on the
    CPU; on CUDA within 1 ulp, since PyTorch divides a CUDA tensor by a Python scalar as a product with its
    reciprocal, and the batch divides by a tensor of temperatures (and of repetition penalties)."""
    torch.manual_seed(0)
    settings = [SamplingSettings(**c) for c in CASES] + [SamplingSettings(temperature=0.0, repetition_penalty=1.4)]
    logits = (torch.randn(len(settings), 1000) * 4).to(device)
    past = torch.randint(0, 1000, (len(settings), 64), device=device)
    seen = torch.zeros(len(settings), 1000, dtype=torch.bool, device=device).scatter_(1, past, True)
    penalized, filtered = filter_rows(logits, settings, seen)
    for i, s in enumerate(settings):
        ref_pen = apply_repetition_penalty(logits[i:i + 1], s.repetition_penalty, past[i:i + 1])
        if device == "cpu":
            assert torch.equal(penalized[i:i + 1], ref_pen)
        torch.testing.assert_close(penalized[i:i + 1], ref_pen, rtol=2e-7, atol=0)
        if not s.greedy:
            ref = filter_logits(ref_pen, s)
            keep = torch.isfinite(ref)
            assert torch.equal(torch.isfinite(filtered[i:i + 1]), keep), CASES[i]
            if device == "cpu":
                assert torch.equal(filtered[i:i + 1], ref), CASES[i]
            torch.testing.assert_close(filtered[i:i + 1][keep], ref[keep], rtol=2e-7, atol=0)
    # a row without a penalty is untouched by another row's seen tokens
    plain = [SamplingSettings(temperature=1.0), SamplingSettings(temperature=1.0, repetition_penalty=2.0)]
    pen, _ = filter_rows(logits[:2], plain, torch.ones(2, 1000, dtype=torch.bool, device=device))
    assert torch.equal(pen[0], logits[0].float()) and not torch.equal(pen[1], logits[1].float())


def test_counter_uniform_is_uniform_and_keyed():
    keys = torch.tensor(row_keys([7, 7, 8, -(1 << 62)], [0, 1, 0, 0]))
    assert len(set(keys.tolist())) == 4 and all(0 <= k < 1 << 32 for k in keys.tolist())
    u = counter_uniform(keys, 100_000)
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002 and abs(u.var().item() - 1 / 12) < 0.002
    for a, b in ((0, 1), (0, 2), (0, 3), (1, 2)):  # another counter or seed: an unrelated stream
        assert abs(torch.corrcoef(u[[a, b]])[0, 1].item()) < 0.02
    # the tensor hash is the host one, element for element
    bits = torch.tensor([hash32((keys[0].item() + v * 0x9E3779B9) & 0xFFFFFFFF) >> 8 for v in range(64)])
    assert torch.equal(counter_uniform(keys[:1], 64)[0], (bits.float() + 0.5) * (1.0 / (1 << 24)))


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="needs the Triton interpreter or a GPU")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 256 tokens, so that a 1,000-token row spans several programs of every launch."""
    from exl2.kernels import sampling

    monkeypatch.setattr(sampling, "chunking", lambda vocab: (256, 128))


def _mixed_batch(vocab: int = 1000):
    """Logits, seen tokens and settings of a batch mixing every filter with greedy and penalized rows; rows of
    only negative and only positive logits (the order key's two halves) and a row with -inf tokens."""
    torch.manual_seed(3)
    settings = [SamplingSettings(**c) for c in CASES] + [
        SamplingSettings(temperature=0.0, repetition_penalty=1.4), SamplingSettings(temperature=1.0),
        SamplingSettings(temperature=0.6, top_p=0.3), SamplingSettings(temperature=1.0, top_k=3, top_p=0.999),
        SamplingSettings(temperature=1.2, top_p=0.001), SamplingSettings(temperature=0.9, top_k=vocab - 1)]
    settings[1] = settings[1].model_copy(update={"frequency_penalty": 0.3, "presence_penalty": 0.7})
    settings[7] = settings[7].model_copy(update={"frequency_penalty": -0.45})
    settings[8] = settings[8].model_copy(update={"presence_penalty": 1.1})  # greedy: penalties still apply
    logits = torch.randn(len(settings), vocab) * 4
    logits[9] -= 100.0
    logits[10] += 100.0
    logits[11, ::4] = float("-inf")
    seen = torch.rand(len(settings), vocab) < 0.05
    counts = torch.randint(0, 4, (len(settings), vocab)).float() * (torch.rand(len(settings), vocab) < 0.05)
    return logits, seen, counts, settings


@needs_kernels
def test_fused_draw_matches_the_pytorch_path(small_chunks):
    """The fused kernels (cutoff search, then the draw) against `filter_rows` and the draw's twin: the same token
    for every row, over several counters, and the same when no row has a penalty or all are greedy."""
    from exl2.generation import sampler

    logits, seen, counts, settings = _mixed_batch()
    n = len(settings)
    for counter in (0, 7):
        keys = torch.tensor(row_keys(list(range(n)), [counter] * n))
        want = sampler._twin_draw(logits, settings, keys, seen, counts)
        with force_triton():
            got = sampler._fused_draw(logits.to(KERNEL_DEVICE), settings, keys.to(KERNEL_DEVICE),
                                      seen.to(KERNEL_DEVICE), counts.to(KERNEL_DEVICE)).cpu()
        assert got.tolist() == want.tolist(), counter
    plain = [SamplingSettings(temperature=0.8), SamplingSettings(temperature=0.0)]
    keys = torch.tensor(row_keys([5, 6], [1, 1]))
    with force_triton():
        got = sampler._fused_draw(logits[:2].to(KERNEL_DEVICE), plain, keys.to(KERNEL_DEVICE), None).cpu()
    assert got.tolist() == sampler._twin_draw(logits[:2], plain, keys, None).tolist()


@needs_kernels
def test_cutoffs_are_the_sorting_filters(small_chunks):
    """The radix-searched top-k/top-p cutoff of each row keeps exactly the tokens the sorting filters keep."""
    from exl2.generation import sampler
    from exl2.kernels.cutoff import order_key_torch

    logits, seen, counts, settings = _mixed_batch()
    settings = [s.model_copy(update={"min_p": 0.0}) for s in settings]  # min-p is applied by the draw, not a cutoff
    n = len(settings)
    penalized, filtered = filter_rows(logits, settings, seen, counts)
    cuts = torch.empty(n, dtype=torch.int32, device=KERNEL_DEVICE)
    with force_triton():
        sampler._fused_draw(logits.to(KERNEL_DEVICE), settings, torch.zeros(n, dtype=torch.int64, device=KERNEL_DEVICE),
                            seen.to(KERNEL_DEVICE), counts.to(KERNEL_DEVICE), cuts=cuts)
    cuts = cuts.cpu()
    checked = 0
    for i, s in enumerate(settings):
        if s.greedy or not (s.top_k or s.top_p < 1.0):
            continue
        y = penalized[i] / s.temperature
        kept = order_key_torch(y) >= cuts[i]
        assert torch.equal(kept, torch.isfinite(filtered[i])), (i, s)
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("device", DEVICES)
def test_sample_rows_depends_only_on_its_own_stream(device):
    """A row's token is a function of its logits, settings, seed and counter: not of the rest of the batch."""
    torch.manual_seed(1)
    logits = torch.randn(6, 500, device=device) * 2
    settings = [SamplingSettings(temperature=1.0, top_p=0.95, seed=s) for s in range(6)]
    seeds, counters = [11, 12, 13, 14, 15, 16], [0, 5, 9, 0, 1, 2]
    batch = sample_rows(logits, settings, seeds, counters)
    alone = [sample_rows(logits[i:i + 1], settings[i:i + 1], seeds[i:i + 1], counters[i:i + 1]).item()
             for i in range(6)]
    assert batch.tolist() == alone and batch.device.type == device
    draws = {tuple(sample_rows(logits, settings, seeds, [c + k for c in counters]).tolist()) for k in range(8)}
    assert len(draws) > 1  # the counter moves the stream
    mixed = sample_rows(logits[:2], [SamplingSettings(temperature=0.0), settings[1]], seeds[:2], counters[:2])
    assert mixed[0].item() == logits[0].argmax().item() and mixed[1].item() == alone[1]


def test_frequency_presence_penalties_and_logit_bias():
    """OpenAI's semantics, after the repetition penalty: logit - frequency · count - presence · (count > 0), over
    the reply's counts; logit_bias is added to the raw logits first (ids past the vocabulary ignored)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0], [0.0, 3.0, 0.0, 0.0]])
    seen = torch.tensor([[True, False, False, True], [False] * 4])
    s0 = SamplingSettings(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s1 = SamplingSettings(temperature=1.0, frequency_penalty=-1.0)
    pen, _ = filter_rows(logits, [s0, s1], seen, counts)
    want = torch.tensor([[2.0 / 2 - 1.0 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0 / 2],
                         [1.0, 1.0 + 3.0, 1.0, 1.0]])
    torch.testing.assert_close(pen, want, rtol=0, atol=1e-6)
    greedy = SamplingSettings(temperature=0.0, frequency_penalty=2.0)
    assert sample_rows(logits, [greedy, greedy], [0, 0], [0, 0], None, counts).tolist() == [3, 0]
    biased = SamplingSettings(temperature=0.0, logit_bias={1: 10.0, 99: 5.0})
    assert sample_rows(logits, [biased, SamplingSettings(temperature=0.0)], [0, 0], [0, 0]).tolist() == [1, 0]
    ban = SamplingSettings(temperature=1.0, logit_bias={3: -100.0, 0: -100.0})
    draws = {sample_rows(logits[:1], [ban], [9], [c]).item() for c in range(64)}
    assert draws <= {1, 2} and len(draws) == 2
    with pytest.raises(ValueError):
        SamplingSettings(logit_bias={1: 101.0})


def test_seen_tokens_count_reply_tokens():
    seen = SeenTokens(2, 10, torch.device("cpu"))
    a = seen.take([1, 2])
    seen.count_replies()
    seen.add([a, a], torch.tensor([4, 4]))
    seen.add([a], torch.tensor([2]))
    assert seen.counts[a].tolist() == [0, 0, 1, 0, 2, 0, 0, 0, 0, 0]  # the prompt's tokens are not counted
    assert seen.take([5]) != a and seen.counts.sum().item() == 3
    seen.give_back(a)
    assert seen.take([]) == a and seen.counts[a].sum().item() == 0


def test_seen_tokens_slots():
    seen = SeenTokens(2, 10, torch.device("cpu"))
    a = seen.take([1, 2, 2, 99])  # out-of-vocabulary ids are ignored
    b = seen.take([3])
    seen.add([a, b], torch.tensor([4, 5]))
    assert seen.mask[a].nonzero().flatten().tolist() == [1, 2, 4]
    assert seen.mask[b].nonzero().flatten().tolist() == [3, 5]
    seen.give_back(a)
    assert seen.take([7]) == a and seen.mask[a].nonzero().flatten().tolist() == [7]


def test_banned_and_allowed_tokens():
    """banned_tokens never come, allowed_tokens are the only ones that can (greedy and sampled, rows independent);
    ids past the vocabulary are ignored, and an allowed list with none inside restricts nothing."""
    from exl2.generation.sampler import apply_token_lists

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, generator=g)
    top = x.argmax(-1)
    settings = [SamplingSettings(temperature=0, banned_tokens=(int(top[0]), 99)),
                SamplingSettings(temperature=1.0, allowed_tokens=(3, 7, 11, 500)),
                SamplingSettings(temperature=0, allowed_tokens=(77,))]
    y = apply_token_lists(x, settings)
    assert y[0, top[0]] == float("-inf") and torch.equal(torch.isinf(y[0]).nonzero().flatten(), top[0:1])
    assert torch.isfinite(y[1]).nonzero().flatten().tolist() == [3, 7, 11]
    assert torch.equal(y[2], x[2])
    n = 300
    draws = sample_rows(x[1:2].expand(n, -1), [settings[1]] * n, [4] * n, list(range(n)))
    assert set(draws.tolist()) == {3, 7, 11}
    greedy = sample_rows(x, settings, [0, 0, 0], [0, 0, 0])
    assert greedy[0] == x[0].masked_fill(torch.arange(50) == top[0], float("-inf")).argmax() and greedy[2] == top[2]
    assert apply_token_lists(x, [SamplingSettings()] * 3) is x
    with pytest.raises(ValueError):
        SamplingSettings(banned_tokens=(-1,))


def test_repetition_penalty_range_and_decay():
    """recent_tokens: 1 inside the window, a linear fade over the decay span, 0 before, each token at its most
    recent place; filter_rows scales the penalty by it (strength 0.5: penalty 1 + (p − 1)/2)."""
    from exl2.generation.sampler import recent_tokens

    history = [5, 1, 2, 3, 4, 1, 6, 7]          # 7 is 0 back, 6 is 1 back, 1 is 2 back, 4: 3, 3: 4, 2: 5, 5: 7
    got = recent_tokens(history, window=3, decay=3, vocab=10)
    want = torch.zeros(10)
    want[[7, 6, 1]] = 1.0
    want[4], want[3], want[2] = 0.75, 0.5, 0.25   # 1, 2, 3 tokens past the window of 3, decay 3: 1 − d/4
    assert torch.equal(got, want)
    assert torch.equal(recent_tokens(history, 2, 0, 10) > 0, torch.isin(torch.arange(10), torch.tensor([6, 7])))
    x = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    s = SamplingSettings(temperature=0, repetition_penalty=1.5, repetition_range=4)
    strength = torch.tensor([[1.0, 0.5, 0.0, 0.5]])
    pen, _ = filter_rows(x, [s], strength)
    assert torch.allclose(pen, torch.tensor([[2.0 / 1.5, -2.0 * 1.25, 2.0, 1.0 / 1.25]]))
    assert s.ranged_penalty and not SamplingSettings(repetition_range=4).ranged_penalty


@needs_kernels
def test_extended_samplers_draw_through_the_fused_kernel_like_the_twin(small_chunks):
    """With samplers only the PyTorch path filters (typical, tail-free, XTC, dynamic temperature), the filtered
    logits go through the fused draw with its filters off: the same tokens as the twin's Gumbel-max, greedy rows
    their argmax."""
    from exl2.generation import sampler

    logits, seen, _, _ = _mixed_batch()
    n = 6
    settings = [SamplingSettings(temperature=0.9, typical=0.8), SamplingSettings(temperature=1.1, tfs=0.9),
                SamplingSettings(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.01),
                SamplingSettings(temperature=1.0, min_temp=0.3, max_temp=2.0, top_p=0.9),
                SamplingSettings(temperature=0.0, repetition_penalty=1.3), SamplingSettings(temperature=0.7, top_a=0.1)]
    for counter in (0, 3):
        keys = torch.tensor(row_keys(list(range(n)), [counter] * n))
        coins = [0.5] * n
        want = sampler._twin_draw(logits[:n], settings, keys, seen[:n], coins=coins)
        with force_triton():
            got = sampler._twin_draw(logits[:n].to(KERNEL_DEVICE), settings, keys.to(KERNEL_DEVICE),
                                     seen[:n].to(KERNEL_DEVICE), coins=coins, fused=True).cpu()
        assert got.tolist() == want.tolist(), counter
