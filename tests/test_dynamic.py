"""Continuous batching (generation.dynamic), prompt-prefix sharing (runtime.page_pool) and the worker thread
(generation.worker), on the golden 4.0 bpw model on CPU.

The reference is a plain greedy loop that recomputes the whole sequence with no cache each step: batching,
paging, shared prefixes and admission order must not change a single token."""
import asyncio
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.errors import ContextLengthError
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.tokenizer import Tokenizer
from exl2.runtime.loader import load_model
from exl2.runtime.page_pool import PagePool, page_key

MODEL = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
GREEDY = SamplingSettings(temperature=0)
PROMPTS = ["Hello", "Once upon a time in a land far away", "The rain in Spain stays mainly in the plain, they say, "
           "and the snow in", "def fibonacci(n):\n    return", "Paris is the capital of"]


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, "cpu")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(MODEL)


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def refs(model, tok):
    return [greedy_reference(model, tok.encode(p), 12) for p in PROMPTS]


def test_batched_greedy_matches_uncached_reference(model, tok, refs):
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)  # 5 jobs: one waits for a free slot
    results = gen.generate([Job(tok.encode(p), GREEDY, 12) for p in PROMPTS])
    assert [r.token_ids for r in results] == refs
    assert all(r.finish_reason == "length" for r in results)
    assert not gen.active and gen.pool.available() == gen.pool.num_pages


def test_shared_prefix_reuses_pages_and_keeps_tokens(model, tok):
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    system = tok.encode("You are a helpful assistant who answers in one short sentence. " * 3)
    first = gen.generate([Job(system + tok.encode(" Q: why?"), GREEDY, 8)])[0]
    ids = system + tok.encode(" Q: what is the time?")
    job = Job(ids, GREEDY, 8)
    again = gen.generate([job])[0]
    assert job.cached_tokens == (len(system) // 16) * 16 > 0
    assert again.token_ids == greedy_reference(model, ids, 8)
    # the prompt's pages plus the reply's are offered to the next turn
    turn2 = ids + again.token_ids + tok.encode(" And tomorrow?")
    job2 = Job(turn2, GREEDY, 4)
    gen.generate([job2])
    assert job2.cached_tokens == ((len(ids) + len(again.token_ids) - 1) // 16) * 16
    assert first.token_ids and gen.pool.available() == gen.pool.num_pages


def test_small_cache_queues_jobs_and_still_matches(model, tok, refs):
    # 2 jobs fit at a time (each needs 2 pages of 16 tokens, the cache holds 4 pages); the rest wait
    gen = DynamicGenerator(model, tok, 64, cache_tokens=64, max_batch=8, page_size=16)
    jobs = [Job(tok.encode(p), GREEDY, 12) for p in PROMPTS[:4]]
    seen = []
    for job in jobs:
        gen.enqueue(job)
    results = {}
    while gen.has_work():
        for ev in gen.iterate():
            if ev.result is not None:
                results[ev.job.id] = ev.result.token_ids
        seen.append(len(gen.active))
    assert max(seen) <= 2 and [results[j.id] for j in jobs] == refs[:4]


def test_cancel_frees_pages_and_spares_the_others(model, tok, refs):
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    keep, drop = Job(tok.encode(PROMPTS[1]), GREEDY, 12), Job(tok.encode(PROMPTS[2]), GREEDY, 200)
    gen.enqueue(keep)
    gen.enqueue(drop)
    gen.iterate()
    gen.iterate()
    gen.cancel(drop)
    assert drop.done and drop not in gen.active
    while not keep.done:
        gen.iterate()
    assert keep.reply.result(0).token_ids == refs[1]
    assert gen.pool.available() == gen.pool.num_pages


def test_seeded_sampling_does_not_depend_on_the_batch(model, tok):
    hot = SamplingSettings(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=11)
    alone = DynamicGenerator(model, tok, 512, max_batch=1, page_size=16).generate([Job(tok.encode("Once"), hot, 10)])
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    mixed = gen.generate([Job(tok.encode(PROMPTS[1]), SamplingSettings(temperature=1.0, seed=3), 10),
                          Job(tok.encode("Once"), hot, 10), Job(tok.encode(PROMPTS[3]), GREEDY, 10)])
    assert mixed[1].token_ids == alone[0].token_ids


def test_reply_penalties_and_logit_bias_match_an_uncached_loop(model, tok):
    """Frequency/presence penalties count the reply's tokens (not the prompt's) and logit_bias shifts raw logits:
    the batched generator, with one job per kind beside a plain one, against a loop over the whole sequence that
    applies them by hand."""
    from exl2.generation.sampler import filter_rows

    kinds = [SamplingSettings(temperature=0.0, frequency_penalty=1.5),
             SamplingSettings(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.3),
             SamplingSettings(temperature=0.0, logit_bias={tok.encode(" the")[0]: 4.0, 13: -100.0})]
    ids = tok.encode(PROMPTS[2] * 2)

    def reference(s: SamplingSettings, n: int = 12) -> list[int]:
        seq = list(ids)
        with torch.inference_mode():
            for _ in range(n):
                x = model(torch.tensor([seq]))[0, -1:].float()
                for t, b in (s.logit_bias or {}).items():
                    x[0, t] += b
                counts = torch.zeros_like(x)
                for t in seq[len(ids):]:
                    counts[0, t] += 1
                seen = torch.zeros_like(x, dtype=torch.bool)
                seen[0, seq] = True
                seq.append(int(filter_rows(x, [s], seen, counts)[0].argmax()))
        return seq[len(ids):]

    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    out = gen.generate([Job(ids, s, 12) for s in kinds] + [Job(tok.encode(PROMPTS[0]), GREEDY, 12)])
    for s, r in zip(kinds, out):
        assert r.token_ids == reference(s), s
    plain = greedy_reference(model, ids, 12)
    assert all(r.token_ids != plain for r in out[:3])  # each setting changed this reply


def test_stop_strings_and_prompt_too_long(model, tok, refs):
    gen = DynamicGenerator(model, tok, 64, max_batch=2, page_size=16)
    stop = tok.decode(refs[1][4:6])
    r = gen.generate([Job(tok.encode(PROMPTS[1]), GREEDY, 12, stop_strings=[stop])])[0]
    assert r.finish_reason == "stop" and stop not in r.text and tok.decode(refs[1]).startswith(r.text)
    with pytest.raises(ContextLengthError):
        gen.enqueue(Job(list(range(5, 69)), GREEDY, 4))


def test_page_pool_keys_refcounts_and_eviction():
    pool = PagePool(4, 2)
    a = pool.acquire([], 2)
    k1 = page_key(None, [1, 2])
    k2 = page_key(k1, [3, 4])
    pool.publish(a[0], k1)
    pool.publish(a[1], k2)
    assert pool.match([1, 2, 3, 4, 5], 4) == ([a[0], a[1]], k2)
    assert pool.match([9, 2, 3, 4], 4) == ([], None)            # keys cover the whole prefix, not one page
    assert pool.match([1, 2, 3, 4], 1) == ([a[0]], k1)
    b = pool.acquire([a[0]], 1)                                 # shares page 0 while its owner still runs
    assert pool.refs[a[0]] == 2 and pool.available() == 1
    pool.release(a)
    assert pool.available() == 2                                # a[1] kept cached but reclaimable
    pool.release(b)
    assert pool.available() == 4 and pool.match([1, 2, 3, 4], 2)[0] == [a[0], a[1]]
    c = pool.acquire([], 4)                                     # evicts the cached pages, oldest first
    assert sorted(c) == [0, 1, 2, 3] and pool.match([1, 2, 3, 4], 2) == ([], None)
    with pytest.raises(RuntimeError):
        pool.acquire([], 1)


def test_engine_runs_concurrent_requests_as_one_batch(refs):
    engine = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu", max_batch_size=8))
    sizes = []
    step = engine.dynamic.iterate

    def watched():
        sizes.append(len(engine.dynamic.active))
        return step()
    engine.dynamic.iterate = watched

    async def run_all():
        return await asyncio.gather(*(engine.agenerate(p, GREEDY, 12) for p in PROMPTS))
    results = asyncio.run(run_all())
    assert [r.token_ids for r in results] == refs and max(sizes) > 1
    assert [r.token_ids for r in engine.generate_batch(PROMPTS, GREEDY, 12)] == refs

    # threads share the batch too
    out = [None] * 3
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, engine.generate(PROMPTS[i], GREEDY, 12)))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.token_ids for r in out] == refs[:3]


def test_engine_closing_a_stream_cancels_the_job():
    engine = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu"))

    async def first_chunk():
        events = engine.aevents(PROMPTS[2], GREEDY, 400)
        async for text, _ in events:
            if text:
                break
        await events.aclose()
    asyncio.run(first_chunk())
    deadline = time.time() + 10
    while engine.dynamic.has_work() and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.dynamic.has_work() and engine.dynamic.pool.available() == engine.dynamic.pool.num_pages

    with pytest.raises(ContextLengthError):
        engine.generate("word " * 600, GREEDY, 4)
    assert engine.generate(PROMPTS[0], GREEDY, 3).token_ids  # the worker survives a rejected request


def test_a_big_job_lets_small_ones_pass_but_is_not_starved(model, tok):
    from exl2.generation.dynamic import MAX_SKIPS

    gen = DynamicGenerator(model, tok, 64, cache_tokens=64, max_batch=16, page_size=16)  # 4 pages of 16 tokens
    words = tok.encode("one two three four five six seven eight nine ten " * 6)
    first = Job(words[:30], GREEDY, 18)       # 47 tokens: 3 pages, runs first
    big = Job(words[:40], GREEDY, 24)         # 63 tokens: needs all 4 pages, waits for `first`
    small = [Job(words[i:i + 5], GREEDY, 8) for i in range(8)]  # 12 tokens: 1 page each
    results = gen.generate([first, big] + small)
    started_before_big = [j for j in small if j.times[1] < big.times[1]]
    assert 0 < len(started_before_big) <= MAX_SKIPS and big.skipped == len(started_before_big)
    for job, r in zip([first, big] + small, results):
        assert r.token_ids == greedy_reference(model, job.ids, job.max_new_tokens)
        assert r.time_queued >= 0 and r.time_prefill >= 0 and r.time_generate >= 0


def test_results_report_cached_tokens(model, tok):
    gen = DynamicGenerator(model, tok, 512, page_size=16)
    ids = tok.encode("A shared opening that is long enough to fill two pages of sixteen tokens each, at least.")
    assert gen.generate([Job(ids, GREEDY, 4)])[0].cached_tokens == 0
    assert gen.generate([Job(ids + [5, 6], GREEDY, 4)])[0].cached_tokens == (len(ids) // 16) * 16 > 0


def test_new_prompts_prefill_together(model, tok, monkeypatch):
    """New prompts share one forward, right-padded to the longest; each row's logits come from its own last
    token, and the padding's cache entries are overwritten before anything reads them."""
    gen = DynamicGenerator(model, tok, 512, max_batch=8, page_size=16)
    words = tok.encode("red green blue yellow purple orange black white grey pink " * 4)
    prompts = [words[i:i + 21] for i in range(4)] + [words[:9], words[3:20]]   # four of 21 tokens, 9, 17
    calls = []
    forward = model.forward

    def counting(ids, *a, **k):
        calls.append(tuple(ids.shape))
        return forward(ids, *a, **k)
    monkeypatch.setattr(model, "forward", counting)
    results = gen.generate([Job(p, GREEDY, 6) for p in prompts])
    assert calls[0] == (6, 21) and all(c[1] == 1 for c in calls[1:])      # one prefill forward, then decoding
    monkeypatch.setattr(model, "forward", forward)
    assert [r.token_ids for r in results] == [greedy_reference(model, p, 6) for p in prompts]

    calls.clear()
    monkeypatch.setattr(model, "forward", counting)
    long = tok.encode("word " * 200)[:200]
    results = gen.generate([Job(words[:5], GREEDY, 4), Job(long, GREEDY, 4)])   # too much padding: apart
    assert sorted(calls[:2]) == [(1, 5), (1, 200)]
    monkeypatch.setattr(model, "forward", forward)
    assert [r.token_ids for r in results] == [greedy_reference(model, p, 4) for p in (words[:5], long)]


def test_overlapped_decode_keeps_every_token(model, tok, refs):
    """Decode steps launched before the previous step's tokens are read (fed from the sampled tensor) give the
    synchronous path's tokens: greedy against the uncached reference, seeded sampling with a repetition penalty
    against overlap off; jobs that end early (length, stop string, cancel) or arrive late change the batch."""
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, overlap=True)
    jobs = [Job(tok.encode(p), GREEDY, n) for p, n in zip(PROMPTS, (12, 5, 11, 12))]
    out = gen.generate(jobs)
    assert [r.token_ids for r in out] == [refs[i][:n] for i, n in enumerate((12, 5, 11, 12))]
    assert gen.chained >= 6 and gen.pool.available() == gen.pool.num_pages

    hot = [SamplingSettings(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=s) for s in range(3)]
    sync = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, overlap=False)
    want = sync.generate([Job(tok.encode(p), h, 14, logprobs=2 * (i % 2)) for i, (p, h) in enumerate(zip(PROMPTS, hot))])
    chained = gen.chained
    got = gen.generate([Job(tok.encode(p), h, 14, logprobs=2 * (i % 2)) for i, (p, h) in enumerate(zip(PROMPTS, hot))])
    assert [r.token_ids for r in got] == [r.token_ids for r in want] and sync.chained == 0 and gen.chained > chained
    for g, w in zip(got, want):  # `gen` prefills from its prompt cache: the same tokens, rounding apart
        assert [(x.token_id, [t for t, _ in x.top]) for x in g.logprobs] == \
            [(x.token_id, [t for t, _ in x.top]) for x in w.logprobs]
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-4)
    assert len(got[1].logprobs[0].top) == 2

    stop = tok.decode(refs[0][6:8])
    first = gen.enqueue(Job(tok.encode(PROMPTS[0]), GREEDY, 16, stop_strings=[stop]))
    second = gen.enqueue(Job(tok.encode(PROMPTS[1]), GREEDY, 16))
    results = {}
    for i in range(200):
        if i == 3:
            late = gen.enqueue(Job(tok.encode(PROMPTS[2]), GREEDY, 8))
        if i == 6:
            gen.cancel(second)
        for event in gen.iterate():
            if event.result is not None:
                results[event.job.id] = event.result
        if not gen.has_work():
            break
    assert results[first.id].finish_reason == "stop" and tok.decode(refs[0]).startswith(results[first.id].text)
    assert results[late.id].token_ids == refs[2][:8] and second.id not in results
    assert gen.pool.available() == gen.pool.num_pages


def test_logprobs_are_the_models_own(model, tok, refs):
    """Each token's log-probability and top alternatives are the log-softmax of the model's raw logits at that
    step (the uncached reference's), whatever the sampling settings; jobs that ask for none get None."""
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    hot = SamplingSettings(temperature=1.3, top_k=20, repetition_penalty=1.3, seed=2)
    jobs = [Job(tok.encode(PROMPTS[0]), GREEDY, 6, logprobs=3), Job(tok.encode(PROMPTS[1]), hot, 6, logprobs=0),
            Job(tok.encode(PROMPTS[2]), GREEDY, 6)]
    out = gen.generate(jobs)
    assert out[0].token_ids == refs[0][:6] and out[2].logprobs is None
    for job, r in zip(jobs[:2], out[:2]):
        assert [x.token_id for x in r.logprobs] == r.token_ids
        seq = list(job.ids)
        for x in r.logprobs:
            with torch.inference_mode():
                want = torch.log_softmax(model(torch.tensor([seq]))[0, -1].float(), -1)
            assert abs(x.logprob - want[x.token_id].item()) < 1e-4
            assert len(x.top) == job.logprobs
            for (t, lp), (wv, wi) in zip(x.top, zip(*want.topk(job.logprobs))):
                assert t == wi.item() and abs(lp - wv.item()) < 1e-4
            seq.append(x.token_id)


def masked_reference(model, ids: list[int], n: int, ends: set[int], min_tokens: int = 0,
                     bias: Optional[dict[int, float]] = None) -> tuple[list[int], str]:
    """Greedy over the whole sequence each step (with `bias` added to the logits), the end tokens `ends` masked
    while the reply is shorter than min_tokens; (the reply's tokens, its finish reason)."""
    seq, out = list(ids), []
    with torch.inference_mode():
        for step in range(n):
            x = model(torch.tensor([seq]))[0, -1].float()
            for t, b in (bias or {}).items():
                x[t] += b
            if step < min_tokens:
                x[sorted(ends)] = float("-inf")
            token = int(x.argmax())
            if token in ends:
                return out, "stop"
            out.append(token)
            seq.append(token)
    return out, "length"


@pytest.mark.parametrize("mode", ["batched", "overlap", "speculative"])
def test_min_tokens_ignore_eos_and_stop_token_ids(model, tok, refs, mode):
    """stop_token_ids end a reply like EOS (the token not in it); min_new_tokens masks EOS and them until the reply
    has that many tokens (the uncached loop that masks them until then gives the same tokens) and keeps a stop
    string from ending it early; ignore_eos never samples EOS. The same on the batched, overlapped and
    speculative (a model drafting for itself, its guesses unmasked, so the verify rows must mask) paths."""
    from exl2.generation.speculative import ModelDraft

    eos = next(iter(tok.eos_ids))
    ids, plain = tok.encode(PROMPTS[1]), refs[1]
    stop_id = plain[3]                        # the plain greedy reply's 4th token, not among its first three
    assert stop_id not in plain[:3] and stop_id != eos
    pushy = SamplingSettings(temperature=0, logit_bias={eos: 100.0})   # EOS would always win
    hello = tok.encode(PROMPTS[0])
    dashes = tok.encode(PROMPTS[2])           # its greedy reply repeats "----"
    jobs = [Job(ids, GREEDY, 12, stop_token_ids=[stop_id]),
            Job(ids, GREEDY, 12, stop_token_ids=[stop_id], min_new_tokens=6),
            Job(hello, pushy, 10), Job(hello, pushy, 10, min_new_tokens=4), Job(hello, pushy, 10, ignore_eos=True),
            Job(dashes, GREEDY, 8, stop_strings=["--"]), Job(dashes, GREEDY, 8, stop_strings=["--"], min_new_tokens=5),
            Job(tok.encode(PROMPTS[3]), GREEDY, 12)]
    if mode == "speculative":                 # alone, so each job speculates
        gen = DynamicGenerator(model, tok, 512, max_batch=1, page_size=16, draft=ModelDraft(model, 600, page_size=16))
    else:
        gen = DynamicGenerator(model, tok, 512, max_batch=8, page_size=16, overlap=mode == "overlap")
    out = gen.generate(jobs)

    assert (out[0].token_ids, out[0].finish_reason, out[0].text) == (plain[:3], "stop", tok.decode(plain[:3]))
    late, why = masked_reference(model, ids, 12, {eos, stop_id}, 6)
    assert (out[1].token_ids, out[1].finish_reason) == (late, why)
    assert len(late) >= 6 and late[:3] == plain[:3] and late[3] != stop_id
    assert (out[2].token_ids, out[2].finish_reason) == ([], "stop")
    assert (out[3].token_ids, out[3].finish_reason) == (refs[0][:4], "stop")
    assert (out[4].token_ids, out[4].finish_reason) == (refs[0][:10], "length")
    assert (out[5].text, out[5].finish_reason) == ("", "stop")
    assert (out[6].text, out[6].finish_reason, len(out[6].token_ids)) == ("----" * 4, "stop", 5)
    assert out[7].token_ids == refs[3] and out[7].finish_reason == "length"
    if mode == "speculative":
        assert jobs[1].drafted > jobs[1].accepted > 0
    assert gen.pool.available() == gen.pool.num_pages


def test_min_tokens_streams_what_the_result_says(model, tok):
    """With min_new_tokens the text streamed before a stop string counts is the result's text, and a stop
    string counts in the text of the min_new_tokens-th token on."""
    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16)
    job = Job(tok.encode(PROMPTS[2]), GREEDY, 8, stop_strings=["-----"], min_new_tokens=3)
    events = list(gen.stream(job))
    text, result = "".join(e.text for e in events), events[-1].result
    # tokens 1-2 ("--------") stream unchecked, so "-----" in them does not count; the checked text starts with
    # token 3 ("----", held back as a possible start of the stop string) and token 4 completes it there
    assert result.text == text == "-" * 8 and result.finish_reason == "stop" and len(result.token_ids) == 4


def test_extended_samplers_through_the_generator_match_an_uncached_loop(model, tok):
    """DRY (over prompt + reply, custom breakers), Mirostat (μ carried from draw to draw), XTC (its kept tokens:
    newlines and specials), tail-free/typical/top-a and dynamic temperature, batched beside a plain job: each
    seeded reply equals a loop over the whole sequence that applies the same steps by hand at the same stream
    positions."""
    from exl2.generation.dry import dry_penalties, sequence_breakers
    from exl2.generation.sampler import sample_rows

    kinds = [SamplingSettings(temperature=0.0, dry_multiplier=2.0, dry_allowed_length=2, seed=1),
             SamplingSettings(temperature=0.9, dry_multiplier=0.8, dry_base=2.0, dry_sequence_breakers=("e",),
                              seed=2),
             SamplingSettings(temperature=1.0, mirostat_mode=2, mirostat_tau=2.5, mirostat_eta=0.3, seed=3),
             SamplingSettings(temperature=1.0, xtc_probability=0.7, xtc_threshold=0.05, tfs=0.95, typical=0.9,
                              top_a=0.05, min_temp=0.5, max_temp=1.5, seed=4)]
    ids = tok.encode(PROMPTS[2] * 2)
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    keep = torch.tensor([("\n" in t) or i in tok.special_ids for i, t in enumerate(texts)])

    def reference(s: SamplingSettings, n: int = 12) -> list[int]:
        seq, mus = list(ids), [None]
        breakers = sequence_breakers(tok, s.dry_sequence_breakers)
        with torch.inference_mode():
            for step in range(n):
                x = model(torch.tensor([seq]))[0, -1:].float()
                if s.dry:
                    t, p = dry_penalties(seq, breakers, s.dry_multiplier, s.dry_base, s.dry_allowed_length)
                    x[0, t] -= p
                seq.append(int(sample_rows(x, [s], [s.seed], [step], mus=mus, xtc_keep=keep[:x.shape[1]])[0]))
        return seq[len(ids):]

    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    jobs = [Job(ids, s, 12) for s in kinds] + [Job(tok.encode(PROMPTS[0]), GREEDY, 12)]
    out = gen.generate(jobs)
    for s, r in zip(kinds, out):
        assert r.token_ids == reference(s), s
    assert jobs[2].mirostat_mu is not None and jobs[2].mirostat_mu != 2 * 2.5
    assert torch.equal(gen._xtc_keep(jobs[3:4], tok.vocab_size).cpu(), keep)
    assert gen._xtc_keep(jobs[:3], tok.vocab_size) is None     # no job of these uses XTC
    own = Job(ids, kinds[3].model_copy(update={"xtc_ignore_tokens": (5, 7)}), 4)
    rows = gen._xtc_keep([jobs[3], own], tok.vocab_size).cpu()  # a job naming its own: only those are kept
    assert torch.equal(rows[0], keep) and rows[1].nonzero().flatten().tolist() == [5, 7]
    assert out[0].token_ids != greedy_reference(model, ids, 12)  # DRY changed the greedy reply


def test_repetition_penalty_with_a_range_matches_an_uncached_loop(model, tok):
    """A ranged, decaying repetition penalty (greedy, so every token shows it) beside a plain-penalty job: each
    reply equals a loop that applies the penalty by hand over the window of the whole text."""
    from exl2.generation.sampler import filter_rows, recent_tokens

    ranged = SamplingSettings(temperature=0.0, repetition_penalty=3.0, repetition_range=6, repetition_decay=4)
    ids = tok.encode(PROMPTS[2] * 2)

    def reference(n: int = 14) -> list[int]:
        seq = list(ids)
        with torch.inference_mode():
            for _ in range(n):
                x = model(torch.tensor([seq]))[0, -1:].float()
                strength = recent_tokens(seq, 6, 4, x.shape[1])[None]
                seq.append(int(filter_rows(x, [ranged], strength)[0].argmax()))
        return seq[len(ids):]

    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16)
    whole = SamplingSettings(temperature=0.0, repetition_penalty=3.0)
    out = gen.generate([Job(ids, ranged, 14), Job(ids, whole, 14)])
    assert out[0].token_ids == reference()
    assert out[0].token_ids != out[1].token_ids   # the window matters


def test_ban_guard_holds_whole_tokens_and_finds_where_a_banned_string_began():
    from exl2.generation.output import BanGuard

    g = BanGuard(["Shivers"])
    assert g.push("It sent ") == ("It sent ", None)
    assert g.push(" sh") == ("", None)            # could become the banned string: held
    assert g.push("iv") == ("", None)
    assert g.push("ers down") == ("", 1)          # begins in reply token 1 (" sh"), ignoring case
    g.rewind(1)
    assert g.text == "" and g.spans == [] and g.first == 1
    assert g.push(" trembled") == (" trembled", None) and g.first == 2
    assert g.push(" s") == ("", None) and g.flush() == " s"


def test_banned_strings_take_the_reply_back_and_ban_the_token_that_began_them(model, tok):
    """Banned strings (ignoring case) never reach the text: the generator takes the reply back to the token
    where one began and bans that token there. Against a loop over the whole sequence that does the same by
    hand; the streamed text equals the final text, and log-probabilities are kept for exactly its tokens."""
    ids = tok.encode(PROMPTS[1])
    plain = greedy_reference(model, ids, 16)
    text = tok.decode(plain)
    banned = (text[len(tok.decode(plain[:3])):len(tok.decode(plain[:5]))].strip().upper(),
              tok.decode(plain[9:10]).strip() or "zzz")

    def reference(n: int = 16) -> list[int]:
        reply, bans = [], {}
        with torch.inference_mode():
            while len(reply) < n:
                x = model(torch.tensor([ids + reply]))[0, -1].float()
                for t in bans.get(len(reply), ()):
                    x[t] = float("-inf")
                reply.append(int(x.argmax()))
                low = tok.decode(reply).lower()
                hits = [low.find(b.lower()) for b in banned if b.lower() in low]
                if hits:
                    k = next(i for i in range(len(reply)) if len(tok.decode(reply[:i + 1])) > min(hits))
                    bans = {d: b for d, b in bans.items() if d <= k}
                    bans.setdefault(k, set()).add(reply[k])
                    del reply[k:]
        return reply

    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16)
    job = Job(ids, SamplingSettings(temperature=0.0, banned_strings=banned), 16, logprobs=2)
    streamed, records = "", []
    gen.enqueue(job)
    result = None
    while gen.has_work():
        for ev in gen.iterate():
            streamed += ev.text
            records += ev.logprobs
            result = ev.result or result
    assert result.token_ids == reference() != plain
    assert streamed == result.text and not any(b.lower() in result.text.lower() for b in banned)
    assert len(result.logprobs) == len(result.token_ids)
    assert [r.token_id for r in result.logprobs] == result.token_ids == [r.token_id for r in records]


def test_token_healing_regrows_the_last_prompt_token(model, tok):
    """Token healing takes the prompt's last token off; the reply's first token must begin with its text (a loop
    over the whole sequence masks the same way), and the returned text continues the prompt without repeating
    that text: prompt text + reply text == the decoded tokens."""
    prompt = "The rain in Spain stays mainly in the pl"
    ids = tok.encode(prompt)
    head = tok.decode([ids[-1]])
    allowed = [t for t in range(tok.vocab_size) if tok.decode([t]).startswith(head)]
    assert len(allowed) > 1

    def reference(n: int = 10) -> list[int]:
        seq = list(ids[:-1])
        with torch.inference_mode():
            for step in range(n):
                x = model(torch.tensor([seq]))[0, -1].float()
                if step == 0:
                    keep = torch.zeros_like(x, dtype=torch.bool)
                    keep[allowed] = True
                    x = x.masked_fill(~keep, float("-inf"))
                seq.append(int(x.argmax()))
        return seq[len(ids) - 1:]

    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16)
    healing = SamplingSettings(temperature=0.0, token_healing=True)
    job = Job(ids, healing, 10)
    streamed = ""
    gen.enqueue(job)
    result = None
    while gen.has_work():
        for ev in gen.iterate():
            streamed += ev.text
            result = ev.result or result
    assert result.token_ids == reference() and result.token_ids[0] in allowed
    assert streamed == result.text
    assert tok.decode(ids[:-1] + result.token_ids) == tok.decode(ids[:-1]) + head + result.text
    plain = gen.generate([Job(ids, SamplingSettings(temperature=0.0), 10)])[0]   # off: nothing taken off
    assert plain.token_ids == greedy_reference(model, ids, 10)
