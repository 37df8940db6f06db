"""Speculative decoding (generation.speculative + DynamicGenerator._speculate) on CPU: whatever the drafter
guesses, greedy output must be exactly the uncached reference's; guesses must actually be kept when they are right.
Models: the golden 6.0 bpw file as the model, the 3.0 bpw file (a worse copy of it) and itself as draft models."""
import pytest

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.errors import ConfigError
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.speculative import ModelDraft, NgramDraft, PerJobDraft, make_drafter
from exl2.generation.tokenizer import Tokenizer
from exl2.runtime.loader import load_model

from test_dynamic import GREEDY, PROMPTS, greedy_reference
from test_exl2_model import GOLDEN


@pytest.fixture(scope="module")
def model():
    return load_model(GOLDEN / "b6.0_hb6", "cpu")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(GOLDEN / "b6.0_hb6")


@pytest.fixture(scope="module")
def small():
    return load_model(GOLDEN / "b3.0_hb6", "cpu")


def test_ngram_draft_finds_the_latest_repeat():
    d = NgramDraft(max_n=3)
    assert d.propose(0, [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]   # latest match of [1, 2, 3] wins
    assert d.propose(0, [5, 6, 7, 5, 6], 4) == [7, 5, 6]                    # stops at the end of the sequence
    assert d.propose(0, [1, 2, 3, 4], 4) == []


def _latest_repeat(tokens, k, max_n=4, min_n=1):
    """NgramDraft's rule written out directly: the tokens after the latest earlier occurrence of the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_draft_follows_a_growing_and_taken_back_text():
    """The array-backed search against the rule written out, on random texts that grow a few tokens a step (as a
    job's do), are sometimes taken back (banned strings) and are sometimes another job's."""
    import random

    rng = random.Random(3)
    d = NgramDraft()
    texts = {1: [], 2: []}
    for step in range(600):
        job = rng.choice((1, 2))
        t = texts[job]
        if t and rng.random() < 0.1:
            del t[rng.randrange(len(t)):]
        t += [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        k = rng.randint(1, 5)
        assert d.propose(job, t, k) == _latest_repeat(t, k), step
    d.forget(1)
    assert 1 not in d.texts and 2 in d.texts


@pytest.mark.parametrize("drafter", ["ngram", "small", "self"])
def test_greedy_output_is_exactly_plain_decoding(model, tok, small, drafter):
    draft = {"ngram": lambda: NgramDraft(), "small": lambda: ModelDraft(small, 600, page_size=16),
             "self": lambda: ModelDraft(model, 600, page_size=16)}[drafter]()
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, draft=draft, num_draft_tokens=4)
    kept = 0
    for p in PROMPTS[:3]:
        ids = tok.encode(p * 3)  # repeated text: n-grams have something to find
        job = Job(ids, GREEDY, 20)
        assert gen.generate([job])[0].token_ids == greedy_reference(model, ids, 20)
        assert job.drafted > 0
        kept += job.accepted
    assert kept > 0 and gen.pool.available() == gen.pool.num_pages
    if drafter == "self":  # a model guessing its own tokens is always right
        assert kept >= 3 * 15


def test_speculation_respects_limits_stops_and_batching(model, tok):
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, draft=ModelDraft(model, 600, page_size=16))
    ids = tok.encode(PROMPTS[1] * 2)
    ref = greedy_reference(model, ids, 12)
    for n in (1, 2, 5, 12):  # max_new_tokens never exceeded, even when guesses run past it
        assert gen.generate([Job(ids, GREEDY, n)])[0].token_ids == ref[:n]
    stop = tok.decode(ref[5:7])
    r = gen.generate([Job(ids, GREEDY, 12, stop_strings=[stop])])[0]
    assert r.finish_reason == "stop" and stop not in r.text and tok.decode(ref).startswith(r.text)
    # several jobs at once check their drafts together; outputs unchanged
    jobs = [Job(tok.encode(p), GREEDY, 12) for p in PROMPTS[:3]] + [Job(ids, GREEDY, 40)]
    out = gen.generate(jobs)
    assert [r.token_ids for r in out] == [greedy_reference(model, j.ids, j.max_new_tokens) for j in jobs]
    assert jobs[-1].accepted > 0


class _Oracle(PerJobDraft):
    """Guesses a known reply: every guess is right exactly when the verify step draws what plain decoding drew."""

    def __init__(self, prompt: list[int], reply: list[int]):
        self.prompt, self.reply = prompt, reply

    def propose(self, job_id, tokens, k):
        done = len(tokens) - len(self.prompt)
        return self.reply[done:done + k]


def test_sampled_speculation_is_plain_sampling(model, tok):
    """Every position draws from the stream position plain decoding would use, with the same seen tokens: a seeded
    sampled reply (with a repetition penalty) is the same token for token with and without a drafter, and guesses
    of that very reply are all kept."""
    hot = SamplingSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=3)
    ids = tok.encode(PROMPTS[2] * 3)
    plain = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16).generate([Job(ids, hot, 24)])[0].token_ids
    assert len(plain) >= 12
    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16, draft=_Oracle(ids, plain),
                           num_draft_tokens=4)
    job = Job(ids, hot, 24)
    assert gen.generate([job])[0].token_ids == plain
    assert job.drafted > 0 and job.accepted == job.drafted  # every guess kept


def test_engine_settings(tmp_path):
    with pytest.raises(ValueError):
        EngineConfig(model_dir=GOLDEN / "b6.0_hb6", ngram_draft=True, draft_model_dir=GOLDEN / "b3.0_hb6")
    engine = Engine(EngineConfig(model_dir=GOLDEN / "b6.0_hb6", max_seq_len=512, device="cpu",
                                 draft_model_dir=GOLDEN / "b3.0_hb6", num_draft_tokens=3, max_draft_batch=2,
                                 max_batch_size=8))
    assert isinstance(engine.dynamic.draft, ModelDraft) and engine.dynamic.num_draft_tokens == 3
    assert engine.dynamic.max_draft_batch == 2
    ids = engine.tokenizer.encode(PROMPTS[0] * 4)
    assert engine.generate(PROMPTS[0] * 4, GREEDY, 10).token_ids == greedy_reference(engine.model, ids, 10)
    with pytest.raises(ConfigError):
        make_drafter(engine.model, ngram=True, draft_model_dir=GOLDEN / "b3.0_hb6")


def test_speculation_with_the_extended_samplers(model, tok):
    """XTC and the other stateless samplers speculate and stay plain sampling token for token; DRY and Mirostat
    need each token on the host before the next draw, so their jobs decode plainly (no guesses checked)."""
    ids = tok.encode(PROMPTS[2] * 3)
    xtc = SamplingSettings(temperature=0.9, xtc_probability=0.5, xtc_threshold=0.05, typical=0.9, seed=5)
    plain = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16).generate([Job(ids, xtc, 24)])[0].token_ids
    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16, draft=_Oracle(ids, plain),
                           num_draft_tokens=4)
    job = Job(ids, xtc, 24)
    assert gen.generate([job])[0].token_ids == plain
    assert job.drafted > 0 and job.accepted == job.drafted
    for s in (SamplingSettings(temperature=0.0, dry_multiplier=1.0, seed=1),
              SamplingSettings(temperature=1.0, mirostat_mode=2, seed=1)):
        ref = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16).generate([Job(ids, s, 16)])[0].token_ids
        gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16, draft=NgramDraft(), num_draft_tokens=4)
        job = Job(ids, s, 16)
        assert gen.generate([job])[0].token_ids == ref and job.drafted == 0


def test_a_draft_model_with_a_shorter_context_gets_an_ntk_alpha(tmp_path):
    """draft_rope: an explicit override wins; a draft model whose native context (2,048 for the golden model) is
    shorter than the length to cover gets the NTK alpha for the ratio; one that covers it gets none. The Engine
    and the CLI pass the draft flags on, and the drafter's model then runs with them."""
    from exl2.generation.speculative import draft_rope, ntk_alpha
    from exl2.models.rope import RopeOverride

    draft_dir = GOLDEN / "b3.0_hb6"
    assert draft_rope(draft_dir, 2048) is None
    auto = draft_rope(draft_dir, 4096)
    assert auto.alpha == pytest.approx(ntk_alpha(2.0)) == pytest.approx(2.62978) and auto.context == 4096
    assert ntk_alpha(1.0) == ntk_alpha(1.02) == 1.0 < ntk_alpha(1.04)
    mine = RopeOverride(scale=2.0)
    assert draft_rope(draft_dir, 4096, mine) is mine
    engine = Engine(EngineConfig(model_dir=GOLDEN / "b6.0_hb6", device="cpu", draft_model_dir=draft_dir,
                                 max_seq_len=1024, draft_rope_scale=2.0))
    assert engine.dynamic.draft.model.spec.max_position == 4096     # 2,048 native × 2
    with pytest.raises(Exception, match="draft_rope_alpha"):
        EngineConfig(model_dir=GOLDEN / "b6.0_hb6", draft_rope_alpha=-1.0)


class _Wrong(PerJobDraft):
    """A drafter whose guesses are never right: token 0 every time (the golden model never predicts it here)."""

    def propose(self, job_id, tokens, k):
        return [0] * k


@pytest.mark.parametrize("adaptive", [True, False])
def test_drafting_pauses_where_guesses_are_never_kept(model, tok, adaptive):
    """Adaptive drafting checks a useless drafter's guesses a few times, then decodes plainly (pausing SPEC_PAUSE
    steps between tries); without it every step is a check. The output is the plain greedy one either way."""
    from exl2.generation.dynamic import SPEC_PAUSE

    ids = tok.encode(PROMPTS[0] * 2)
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, draft=_Wrong(), num_draft_tokens=2,
                           adaptive_draft=adaptive)
    job = Job(ids, GREEDY, 40)
    assert gen.generate([job])[0].token_ids == greedy_reference(model, ids, 40)
    checks = job.drafted // 2
    assert job.accepted == 0
    if adaptive:
        assert checks <= 1 + 40 // (SPEC_PAUSE + 1) + 1
    else:
        assert checks >= 30


class _Counting:
    """Wraps a drafter, noting how many jobs each call drafted for."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []
        self.reads_images = inner.reads_images

    def propose_batch(self, requests):
        self.batches.append(sum(1 for r in requests if r[2] > 0))
        return self.inner.propose_batch(requests)

    def forget(self, job_id):
        self.inner.forget(job_id)


@pytest.mark.parametrize("drafter", ["ngram", "small", "self"])
def test_a_batch_checks_its_drafts_together(model, tok, small, drafter):
    """Several jobs decoding at once draft and check together (one forward of B × (1 + k) tokens), near their ends
    too (max_new_tokens of 1 to 30, guesses running past them); greedy output stays exactly plain decoding."""
    inner = {"ngram": lambda: NgramDraft(), "small": lambda: ModelDraft(small, 600, page_size=16, max_batch=4),
             "self": lambda: ModelDraft(model, 600, page_size=16, max_batch=4)}[drafter]()
    draft = _Counting(inner)
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, draft=draft, num_draft_tokens=3)
    jobs = [Job(tok.encode(p * 3), GREEDY, n) for p, n in zip(PROMPTS, (30, 1, 7, 20))]
    out = gen.generate(jobs)
    assert [r.token_ids for r in out] == [greedy_reference(model, j.ids, j.max_new_tokens) for j in jobs]
    assert max(draft.batches) >= 3 and sum(j.accepted for j in jobs) > 0
    if drafter == "self":  # right every time: a check yields 1 + k tokens, as long as the reply has room
        assert all(j.accepted == j.drafted for j in jobs)
        assert jobs[0].accepted >= 20
    assert not gen.active and gen.pool.available() == gen.pool.num_pages
    if isinstance(inner, ModelDraft):  # every sequence forgotten: all its pages back
        assert not inner.seqs and len(inner.free) == inner.scratch


def test_sampled_batch_speculation_is_plain_sampling(model, tok):
    """Seeded sampling with penalties, two jobs checked together with guesses of their own plain replies: the
    replies are plain decoding's and every guess is kept."""
    hot = [SamplingSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=3),
           SamplingSettings(temperature=1.0, frequency_penalty=0.3, seed=11)]
    prompts = [tok.encode(PROMPTS[2] * 3), tok.encode(PROMPTS[1] * 3)]
    plain = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16).generate(
        [Job(ids, s, 16) for ids, s in zip(prompts, hot)])
    replies = {tuple(ids): r.token_ids for ids, r in zip(prompts, plain)}

    class Oracle(PerJobDraft):
        def propose(self, job_id, tokens, k):
            ids = next(p for p in prompts if list(tokens[:len(p)]) == p)
            done = len(tokens) - len(ids)
            return replies[tuple(ids)][done:done + k]

    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16, draft=Oracle(), num_draft_tokens=4)
    jobs = [Job(ids, s, 16) for ids, s in zip(prompts, hot)]
    assert [r.token_ids for r in gen.generate(jobs)] == [r.token_ids for r in plain]
    assert all(j.drafted > 0 and j.accepted == j.drafted for j in jobs)


def test_batches_past_max_draft_batch_decode_plainly(model, tok):
    draft = _Counting(NgramDraft())
    gen = DynamicGenerator(model, tok, 512, max_batch=4, page_size=16, draft=draft, max_draft_batch=2)
    jobs = [Job(tok.encode(p * 3), GREEDY, n) for p, n in zip(PROMPTS[1:4], (16, 4, 16))]
    out = gen.generate(jobs)
    assert [r.token_ids for r in out] == [greedy_reference(model, j.ids, j.max_new_tokens) for j in jobs]
    assert draft.batches and max(draft.batches) <= 2     # drafting starts once the short job has left
    assert jobs[1].drafted == 0


def test_a_draft_model_short_of_pages_drafts_for_fewer_jobs(model, tok):
    """A draft cache with room for about one sequence: the least recently drafted idle sequence gives its pages up,
    a job that finds none gets no guesses that step; output stays exact and no page is lost."""
    inner = ModelDraft(model, 200, page_size=16, cache_tokens=100, max_batch=2)
    gen = DynamicGenerator(model, tok, 200, max_batch=2, page_size=16, draft=inner, num_draft_tokens=3)
    jobs = [Job(tok.encode(p * 3), GREEDY, 16) for p in PROMPTS[1:3]]
    assert [r.token_ids for r in gen.generate(jobs)] == [greedy_reference(model, j.ids, 16) for j in jobs]
    assert sum(j.accepted for j in jobs) > 0
    assert not inner.seqs and len(inner.free) == inner.scratch


def test_a_check_keeps_to_the_small_batch_rows(model, tok):
    """B sequences check min(k, CHECK_ROWS / B - 1) guesses each, so a check stays within the small-batch matmuls'
    16 rows; batches past max_draft_batch (or too large for one guess each) decode plainly."""
    gen = DynamicGenerator(model, tok, 512, max_batch=16, page_size=16, draft=NgramDraft(), num_draft_tokens=4)
    assert gen.check_guesses == {1: 4, 2: 4, 4: 3, 8: 1} and gen.max_draft_batch == 8
    gen = DynamicGenerator(model, tok, 512, max_batch=16, page_size=16, draft=NgramDraft(), num_draft_tokens=8,
                           max_draft_batch=3)
    assert gen.check_guesses == {1: 8, 2: 7, 3: 4} and gen.max_draft_batch == 3


def test_a_cancelled_job_gives_back_its_draft_pages(model, tok):
    """Cancelling a drafting job returns its pages in the draft model's cache, not only in the model's."""
    inner = ModelDraft(model, 600, page_size=16, max_batch=2)
    gen = DynamicGenerator(model, tok, 512, max_batch=2, page_size=16, draft=inner, num_draft_tokens=3)
    job = Job(tok.encode(PROMPTS[1] * 3), GREEDY, 40)
    gen.enqueue(job)
    while job.drafted == 0:
        gen.iterate()
    assert job.id in inner.seqs
    gen.cancel(job)
    assert not inner.seqs and len(inner.free) == inner.scratch and gen.pool.available() == gen.pool.num_pages
