"""LoRA adapters chosen per request (`Job.loras`, `Engine.generate(loras=...)`): requests batched together with
different adapters each reply exactly as an engine with only their adapters active would; cached prompt pages are
never shared between requests with other adapters; adapters no running request uses are detached when the
next request starts.

The golden 4.0 bpw model on CPU with the random PEFT adapters of test_lora_serving."""
from pathlib import Path

import pytest
import torch

from test_lora_serving import GREEDY, MODEL, PROMPT, adapters, engine  # noqa: F401 (the fixtures)

from exl2.config import EngineConfig, LoraSpec
from exl2.engine import Engine
from exl2.errors import ConfigError
from exl2.generation.request_loras import choice_key
from exl2.runtime.lora import active_loras

LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 11)  # > one 256-token page


def reference(engine: Engine, specs: list, prompt: str) -> list[int]:
    """The greedy reply with exactly `specs` active on the whole engine (and its prompt cache then forgotten)."""
    engine.set_loras(specs)
    try:
        return engine.generate(prompt, GREEDY, 12).token_ids
    finally:
        engine.set_loras([])


def test_a_batch_of_requests_with_different_adapters(engine, adapters):
    one, two = LoraSpec(path=adapters / "one"), LoraSpec(path=adapters / "two", scaling=0.5)
    want = {"base": reference(engine, [], PROMPT), "one": reference(engine, [one], PROMPT),
            "one+two": reference(engine, [one, two], PROMPT)}
    assert len({tuple(v) for v in want.values()}) == 3
    choices = [None, [one], [one, two], [], [one]]
    got = engine.generate_batch([PROMPT] * 5, GREEDY, 12, loras=choices)
    assert [r.token_ids for r in got] == [want[k] for k in ("base", "one", "one+two", "base", "one")]
    # each directory was read once, at scaling 1: the request's scaling multiplies its rows
    assert sorted(Path(p).name for p in engine._request_adapters) == ["one", "two"]
    assert all(a.scaling == 1.0 for a in engine._request_adapters.values())
    # none stays attached once no request uses it (checked when the next one starts)
    assert engine.generate(PROMPT, GREEDY, 12).token_ids == want["base"]
    assert active_loras(engine.model) == [] and engine.loras == []


def test_requests_choose_against_the_engines_global_adapter(engine, adapters):
    """With an adapter active on the engine, a request naming none gets it, [] the base model, and its own list
    exactly that list."""
    one, two = LoraSpec(path=adapters / "one"), LoraSpec(path=adapters / "two")
    want_base, want_two = reference(engine, [], PROMPT), reference(engine, [two], PROMPT)
    want_one = reference(engine, [one], PROMPT)
    engine.set_loras([one])
    try:
        got = engine.generate_batch([PROMPT] * 3, GREEDY, 12, loras=[None, [], [two]])
        assert [r.token_ids for r in got] == [want_one, want_base, want_two]
        assert [a.name for a in engine.loras] == ["one"]
    finally:
        engine.set_loras([])


def test_prompt_pages_are_not_shared_across_adapters(engine, adapters):
    """A long prompt's full pages computed without an adapter must not serve the same prompt with one (and the
    same adapter and scaling do share them)."""
    one = LoraSpec(path=adapters / "one")
    want = reference(engine, [one], LONG)
    engine.dynamic.pool.forget_prefixes()
    assert engine.generate(LONG, GREEDY, 12).token_ids != want          # publishes the base model's pages
    first = engine.generate(LONG, GREEDY, 12, loras=[one])
    assert first.token_ids == want
    again = engine.generate(LONG, GREEDY, 12, loras=[one])
    assert again.token_ids == want and again.cached_tokens > 0
    assert choice_key(None) is None and choice_key(()) != choice_key(engine.request_loras([one]))


def test_bad_choices_are_one_sentence(engine, adapters, tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        engine.generate(PROMPT, GREEDY, 4, loras=[LoraSpec(path=adapters / "missing")])
    one = LoraSpec(path=adapters / "one")
    with pytest.raises(ConfigError, match="listed twice"):
        engine.generate(PROMPT, GREEDY, 4, loras=[one, one])
    with pytest.raises(ConfigError, match="2 prompts but 1 LoRA choices"):
        engine.generate_batch([PROMPT, PROMPT], GREEDY, 4, loras=[None])


def test_row_scales_multiply_each_rows_delta():
    """lora_delta scales each token row by its adapter's multiplier: rows of other requests get none of it."""
    from exl2.runtime.linear import LoraWeights, RowScales, lora_delta

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=g)
    lw = LoraWeights(torch.randn(4, 8, generator=g), torch.randn(6, 4, generator=g), rows=RowScales())
    full = lora_delta(x, [lw])
    lw.rows.scales = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 7.0])   # capacity past the 6 rows
    got = lora_delta(x, [lw])
    assert torch.allclose(got, full * torch.tensor([1.0, 0.0, 0.5])[:, None, None])
    assert torch.allclose(lora_delta(x.reshape(6, 8), [lw]), got.reshape(6, 6))


def test_server_requests_name_their_adapters(engine, adapters):
    """`loras` on /v1/completions and /v1/chat/completions (and through them /v1/messages and /v1/responses), or a
    `model` naming an adapter: concurrent requests with different adapters get their own replies; /v1/models lists
    the adapters under the served model; bad names are a 400 blaming `loras`."""
    import asyncio

    httpx = pytest.importorskip("httpx")
    from exl2.config import ServerConfig
    from exl2.server.app import create_app

    one, two = LoraSpec(path=adapters / "one"), LoraSpec(path=adapters / "two", scaling=0.5)
    want = [engine.tokenizer.decode(reference(engine, specs, PROMPT)) for specs in ([], [one], [one, two])]
    app = create_app(engine, ServerConfig(lora_dir=adapters))
    bare = create_app(engine, ServerConfig())

    async def go():
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        bodies = [{"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra} for extra in
                  ({}, {"loras": [{"name": "one"}]}, {"loras": [{"name": "one"}, {"name": "two", "scaling": 0.5}]})]
        replies = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
        assert [r.json()["choices"][0]["text"] for r in replies] == want
        talk = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
        chat = await c.post("/v1/chat/completions", json={**talk, "loras": [{"name": "one"}]})
        plain = await c.post("/v1/chat/completions", json=talk)
        assert chat.status_code == 200, chat.text
        reply = chat.json()["choices"][0]["message"]["content"]
        assert reply != plain.json()["choices"][0]["message"]["content"]
        # the Messages and Responses APIs pass the field through to the chat completion they make
        msg = await c.post("/v1/messages", json={**talk, "loras": [{"name": "one"}]})
        assert msg.status_code == 200, msg.text
        assert msg.json()["content"][0]["text"] == reply
        resp = await c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 6, "temperature": 0,
                                                    "loras": [{"name": "one"}], "store": False})
        assert resp.status_code == 200, resp.text
        assert resp.json()["output"][-1]["content"][0]["text"] == reply
        # vLLM's convention: `model` naming an adapter runs the served model with it; /v1/models lists them
        named = await c.post("/v1/chat/completions", json={**talk, "model": "one"})
        assert named.json()["choices"][0]["message"]["content"] == reply
        cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        served = engine.model_name
        assert cards["one"]["parent"] == served and cards["two"]["parent"] == served and ".hidden" not in cards
        assert (await c.get("/v1/models/one")).json()["parent"] == served
        assert (await c.get("/v1/models/nothing")).status_code == 404
        other = await c.post("/v1/chat/completions", json={**talk, "model": "gpt-4o"})   # a client's default
        assert other.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
        for loras, code in (([{"name": "missing"}], "invalid_lora"), ([{"name": "../one"}], "invalid_lora_name"),
                            ([{"name": "one"}, {"name": "one"}], "invalid_lora")):
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "loras": loras})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "loras" and err["code"] == code, r.text
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "loras": [{"name": "one", "scaling": -1}]})
        assert r.status_code == 400
        c2 = httpx.AsyncClient(transport=httpx.ASGITransport(app=bare), base_url="http://test")
        r = await c2.post("/v1/completions", json={"prompt": PROMPT, "loras": [{"name": "one"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_dir_unset"

    asyncio.run(go())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_request_adapters_through_the_decode_graphs(adapters):
    """On the GPU (decode graphs on, the per-row multipliers read inside them): each row of a batch mixing
    adapters replies as the same row of a batch of five running its adapters globally (same batch, same kernels;
    scalings that are powers of two, so folding them into B or multiplying the rows rounds alike)."""
    e = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cuda"))
    try:
        assert e.dynamic.graphs is not None
        one, two = LoraSpec(path=adapters / "one"), LoraSpec(path=adapters / "two", scaling=0.5)
        # the base rows' reference runs an adapter at scaling 0: its delta is exactly 0, and like the mixed batch it
        # keeps the projections' K-split partial sums off (an active adapter does)
        sets = {"base": [LoraSpec(path=adapters / "one", scaling=0.0)], "one": [one], "one+two": [one, two]}
        want = {}
        for name, specs in sets.items():
            e.set_loras(specs)
            want[name] = [r.token_ids for r in e.generate_batch([PROMPT] * 5, GREEDY, 16)]
        e.set_loras([])
        order = ["base", "one", "one+two", "base", "one"]
        got = e.generate_batch([PROMPT] * 5, GREEDY, 16, loras=[None, [one], [one, two], [], [one]])
        assert [r.token_ids for r in got] == [want[name][i] for i, name in enumerate(order)]
        assert len({tuple(want[n][0]) for n in sets}) == 3
    finally:
        e.close()


def test_a_base_model_choice_without_adapters_attaches_nothing(engine, monkeypatch):
    """A request choosing [] while no adapter is active changes nothing on the model: no set_loras, no graph
    reset, on any step."""
    from exl2.runtime import lora

    want = engine.generate(PROMPT, GREEDY, 6).token_ids   # (detaches what earlier tests' requests left attached)
    calls = []
    monkeypatch.setattr(lora, "set_loras", lambda *a: calls.append(a))
    assert engine.generate(PROMPT, GREEDY, 6, loras=[]).token_ids == want
    assert calls == []


def test_a_refused_global_change_changes_nothing(engine, adapters):
    """set_loras with an adapter listed twice is a ConfigError, and the adapters active before stay active."""
    one = engine.load_lora(LoraSpec(path=adapters / "one"))
    engine.set_loras([one])
    try:
        want = engine.generate(PROMPT, GREEDY, 6).token_ids
        with pytest.raises(ConfigError, match="listed twice"):
            engine.set_loras([one, one])
        assert engine.loras == [one] and engine.generate(PROMPT, GREEDY, 6).token_ids == want
    finally:
        engine.set_loras([])
