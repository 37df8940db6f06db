"""Classifier-free guidance (exllamav2's cfg_scale): a job runs its prompt and a negative prompt as two sequences
of the batch and samples from s·log_softmax(prompt's logits) + (1 − s)·log_softmax(negative prompt's logits).

The reference is a plain loop on the golden 4.0 bpw model on CPU that recomputes both sequences with no cache every
step and mixes their log-probabilities the same way; batching, chunked prefill, cached prefixes and a plain job
beside the pair must not change a token."""
import pytest
import torch

from exl2.config import SamplingSettings
from exl2.errors import ConfigError, ContextLengthError
from exl2.generation.dynamic import DynamicGenerator, Job

import test_dynamic

MODEL = test_dynamic.MODEL
model, tok = test_dynamic.model, test_dynamic.tok   # the golden model and its tokenizer (module fixtures)

STEPS = 10


def greedy(scale: float = 1.0) -> SamplingSettings:
    return SamplingSettings(temperature=0, cfg_scale=scale)


def cfg_reference(model, ids: list[int], negative: list[int], scale: float, n: int) -> list[int]:
    """Greedy tokens of the guided distribution, both sequences recomputed from scratch each step."""
    reply: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            pos = model(torch.tensor([ids + reply], device=model.device))[0, -1].float()
            neg = model(torch.tensor([negative + reply], device=model.device))[0, -1].float()
            mixed = scale * torch.log_softmax(pos, -1) + (1 - scale) * torch.log_softmax(neg, -1)
            reply.append(int(mixed.argmax()))
    return reply


def test_a_guided_job_matches_the_uncached_reference(model, tok):
    ids, negative = tok.encode("The weather today is"), tok.encode("Write something sad and gloomy:")
    want = cfg_reference(model, ids, negative, 2.0, STEPS)
    gen = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16)
    got = gen.generate([Job(ids, greedy(2.0), STEPS, negative_ids=negative)])[0]
    assert got.token_ids == want and got.finish_reason == "length"
    assert want != cfg_reference(model, ids, negative, 1.0, STEPS), "guidance must change this reply"
    assert not gen.active and gen.pool.available() == gen.pool.num_pages


def test_pairs_and_plain_jobs_batch_with_chunked_prefill_and_cached_prefixes(model, tok):
    """A long negative prompt whose prefill takes several chunks, a guided job whose negative is the BOS token
    alone (the default), a negative scale, and a plain job, together; then the same again from cached pages."""
    long_negative = tok.encode("A long list of unrelated words: apple, river, stone, cloud, seven, lantern, "
                               "quiet, marble, distant, orange, violin, harbor, thunder, paper, candle.")
    prompts = [tok.encode("Once upon a time"), tok.encode("The capital of France is"), tok.encode("def add(a, b):")]
    bos = [tok.bos_id]
    jobs = lambda: [Job(prompts[0], greedy(1.5), STEPS, negative_ids=long_negative),  # noqa: E731
                    Job(prompts[1], greedy(-0.5), STEPS),
                    Job(prompts[2], greedy(), STEPS)]
    want = [cfg_reference(model, prompts[0], long_negative, 1.5, STEPS),
            cfg_reference(model, prompts[1], bos, -0.5, STEPS),
            cfg_reference(model, prompts[2], prompts[2], 1.0, STEPS)]
    gen = DynamicGenerator(model, tok, 256, max_batch=6, page_size=16, chunk=16)
    first = gen.generate(jobs())
    assert [r.token_ids for r in first] == want
    second = jobs()
    assert [r.token_ids for r in gen.generate(second)] == want
    assert second[0].guide.cached_tokens >= 16, "the long negative prompt starts from cached pages"


def test_scale_one_is_plain_decoding_and_seeds_reproduce(model, tok):
    ids, negative = tok.encode("Paris is the capital of"), tok.encode("Nonsense")
    gen = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16)
    plain = gen.generate([Job(ids, greedy(), STEPS)])[0].token_ids
    job = Job(ids, greedy(1.0), STEPS, negative_ids=negative)
    assert gen.generate([job])[0].token_ids == plain and job.guide is None
    sampled = SamplingSettings(temperature=0.9, top_p=0.95, seed=7, cfg_scale=1.8)
    a, b = (gen.generate([Job(ids, sampled, STEPS, negative_ids=negative)])[0].token_ids for _ in range(2))
    assert a == b


def test_a_banned_string_takes_the_guide_back_too(model, tok):
    ids, negative = tok.encode("The weather today is"), tok.encode("Write something sad and gloomy:")
    free = cfg_reference(model, ids, negative, 2.0, STEPS)
    banned = tok.decode(free[1:3]).strip()
    settings = SamplingSettings(temperature=0, cfg_scale=2.0, banned_strings=(banned,))
    gen = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16)
    job = Job(ids, settings, STEPS, negative_ids=negative)
    out = gen.generate([job])[0]
    assert banned.lower() in tok.decode(free).lower() and banned.lower() not in out.text.lower()
    # the guide was fed every reply token but the last (the job ended on it), rewinds included
    assert job.guide.tokens[len(negative):] == job.tokens[len(ids):-1]


def test_guidance_needs_two_rows_and_room_for_both(model, tok):
    ids = tok.encode("Hello")
    with pytest.raises(ConfigError, match="two sequences"):
        DynamicGenerator(model, tok, 256, max_batch=1).enqueue(Job(ids, greedy(1.5), 4))
    small = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16, cache_tokens=256)
    with pytest.raises(ContextLengthError, match="Classifier-free guidance keeps"):
        small.enqueue(Job(ids, greedy(1.5), 250, negative_ids=tok.encode("x " * 40)))


def test_engine_and_generator_take_a_negative_prompt(tok):
    from exl2.config import EngineConfig
    from exl2.engine import Engine

    engine = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu"))
    try:
        prompt, negative = "The weather today is", "Write something sad and gloomy:"
        want = cfg_reference(engine.model, tok.encode(prompt), tok.encode(negative), 2.0, STEPS)
        assert engine.generate(prompt, greedy(2.0), STEPS, negative_prompt=negative).token_ids == want
        assert engine.generator.generate(prompt, greedy(2.0), STEPS, negative_prompt=negative).token_ids == want
        _server_checks(engine, prompt, negative, want)
    finally:
        engine.close()


def _server_checks(engine, prompt, negative, want):
    """TabbyAPI's cfg_scale and negative_prompt on /v1/completions give the engine's reply."""
    pytest.importorskip("fastapi")
    import asyncio

    import httpx

    from exl2.config import ServerConfig
    from exl2.server.app import create_app

    app = create_app(engine, ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            body = {"prompt": prompt, "max_tokens": STEPS, "temperature": 0, "cfg_scale": 2.0,
                    "negative_prompt": negative}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(want)
            r = await c.post("/v1/completions", json={**body, "cfg_scale": 1000})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cfg_scale", r.text

    asyncio.run(go())
