"""The OpenAI-compatible server as the official `openai` client meets it, checked against the engine itself.

Greedy replies, token counts and stop strings are compared with `engine.generator.generate` on the same
prompt; streaming runs over a real socket (uvicorn in a thread); tool-call translation uses a fake engine
whose reply is canned text in the Hermes, Llama-3.1 and plain forms.
"""
import asyncio
import json
import logging
import re
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn

from exl2.cli.main import main
from exl2.config import EngineConfig, SamplingSettings, ServerConfig
from exl2.engine import Engine
from exl2.generation.chat import ChatTemplate
from exl2.generation.generator import GenerationResult
from exl2.generation.job import Event
from exl2.server.app import create_app
from exl2.server.reasoning import ReasoningSplitter, split_reasoning

from test_cli import SRC

KEY = "sk-test-key"
GREEDY = SamplingSettings(temperature=0)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def run(coro):
    return asyncio.run(coro)


def aclient(app, key=KEY) -> openai.AsyncOpenAI:
    """The async openai client talking to the app in-process (no socket)."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


@contextmanager
def serving(app):
    """uvicorn on a free port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class FakeEngine:
    """The Engine surface the server uses, replying with canned text in small pieces (markers get split)."""

    model_name = "fake-model"
    vision = None                           # no vision tower loaded

    def __init__(self):
        self.config = EngineConfig(model_dir="fake-model", max_seq_len=512)
        self.model = SimpleNamespace(spec=SimpleNamespace(arch="fake", max_position=4096))
        self.tokenizer = SimpleNamespace(encode=lambda text, add_bos=None: list(range(len(text))),
                                         decode=lambda ids: "x" * len(ids))
        self.reply: str | None = CALL      # None: an endless reply, for the disconnect tests
        self.fail_seed: int | None = None  # the job sampling with this seed fails after its first piece
        self.rendered: list[tuple[list, object]] = []
        self.prompts: list = []             # what each engine stream was asked to continue
        self.ends: list[dict] = []          # each stream's stop_token_ids / min_new_tokens / ignore_eos
        self.budgets: list = []             # each stream's reasoning budget (None: none)
        self.template = ChatTemplate()      # ChatML, as for a model without a template of its own
        self.forced: list[str] = []         # the tool_choice grammars asked for
        self.closed = threading.Event()
        self.opened = self.closes = 0      # streams started and closed, for the disconnect tests

    def chat_prompt(self, messages, tools=None, **variables):
        self.rendered.append((messages, tools))
        return "PROMPT"

    def json_grammar(self, schema=None):
        return None

    def tool_grammar(self, tools, name=None):
        self.forced.append(name or "required")
        return None

    async def aevent_stream(self, prompt, settings=None, max_new_tokens=256, stop_strings=(), add_bos=None,
                            grammar=None, logprobs=None, *, stop_token_ids=(), min_new_tokens=0, ignore_eos=False,
                            negative_prompt=None, budget=None, images=(), loras=None):
        self.opened += 1
        self.prompts.append(prompt)
        self.ends.append(dict(stop_token_ids=list(stop_token_ids), min_new_tokens=min_new_tokens,
                              ignore_eos=ignore_eos))
        self.budgets.append(budget)
        try:
            if self.reply is None:
                while True:
                    await asyncio.sleep(0.01)
                    yield Event(None, "x")
            for i in range(0, len(self.reply), 3):
                await asyncio.sleep(0)
                yield Event(None, self.reply[i:i + 3])
                if settings is not None and settings.seed is not None and settings.seed == self.fail_seed:
                    raise RuntimeError("fake engine failure")
            yield Event(None, "", GenerationResult(self.reply, list(range(9)), "stop", 5))
        finally:
            self.closes += 1
            self.closed.set()


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, ServerConfig(api_keys=(KEY, "second-key"), model_name="tiny", max_tokens=16))


@pytest.fixture(scope="module")
def url(app):
    with serving(app) as base:
        yield base


@pytest.fixture(scope="module")
def fake():
    return FakeEngine()


@pytest.fixture(scope="module")
def fake_app(fake):
    return create_app(fake, ServerConfig())


@pytest.fixture(scope="module")
def fake_url(fake_app):
    with serving(fake_app) as base:
        yield base


def reference(engine, prompt, n, stops=(), add_bos=None):
    return engine.generator.generate(prompt, GREEDY, n, stops, add_bos=add_bos)


def sse_data(url, path, body) -> list[str]:
    """The `data:` payloads of a streamed request, [DONE] included."""
    with httpx.stream("POST", f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}, json=body) as r:
        assert r.status_code == 200, r.read()
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def wait_until(condition, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- models, health, auth ---------------------------------------------------------------------------------------

def test_models_health_and_unknown_model(app):
    async def go():
        c = aclient(app)
        models = await c.models.list()
        assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "exl2"
        assert (await c.models.retrieve("tiny")).id == "tiny"
        with pytest.raises(openai.NotFoundError) as e:
            await c.models.retrieve("gpt-4o")
        assert e.value.body["code"] == "model_not_found"
        r = await c._client.get("http://test/health")       # no key needed
        assert r.status_code == 200 and r.json() == {"status": "ok", "model": "tiny", "loading": None}
        card = (await c._client.get("http://test/v1/model", headers={"Authorization": f"Bearer {KEY}"})).json()
        assert card["id"] == "tiny" and card["parameters"]["max_seq_len"] == 512
        assert card["parameters"]["cache_mode"] == "fp16" and card["parameters"]["draft"] is None
        assert card["parameters"]["rope_scale"] is None and card["parameters"]["rope_alpha"] is None
        assert card["parameters"]["num_experts_per_token"] is None                   # a dense model
        assert card["parameters"]["prefill_fp8"] is False and card["parameters"]["use_vision"] is False
        assert card["parameters"]["embedding_pooling"] == "last"
        assert (await c._client.get("http://test/v1/model")).status_code == 401

    run(go())


def test_api_keys(app):
    async def go():
        with pytest.raises(openai.AuthenticationError) as e:
            await aclient(app, key="sk-wrong").models.list()
        err = e.value.body
        assert e.value.status_code == 401 and set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "invalid_api_key"
        assert (await aclient(app, key="second-key").models.list()).data
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        assert (await http.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
        missing = await http.get("/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/v1/models", headers={"x-api-key": "nope"})).status_code == 401

    run(go())


def test_token_endpoints(app, engine):
    """/v1/token/encode of a string and of chat messages (rendered without the reply's opening) and
    /v1/token/decode agree with the engine's tokenizer; a key is needed; a bad id is a 400 naming it."""
    hi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        auth = {"Authorization": f"Bearer {KEY}"}
        text = await http.post("/v1/token/encode", json={"text": "Hello world"}, headers=auth)
        plain = await http.post("/v1/token/encode", json={"text": "Hello world", "add_bos_token": False},
                                headers=auth)
        chat = await http.post("/v1/token/encode", json={"text": hi}, headers=auth)
        ids = text.json()["tokens"]
        back = await http.post("/v1/token/decode", json={"tokens": ids, "decode_special_tokens": False},
                               headers=auth)
        bad = await http.post("/v1/token/decode", json={"tokens": [1, -5]}, headers=auth)
        anon = await http.post("/v1/token/encode", json={"text": "x"})
        return text.json(), plain.json(), chat.json(), back.json(), bad, anon

    text, plain, chat, back, bad, anon = run(go())
    tok = engine.tokenizer
    assert text == {"tokens": tok.encode("Hello world"), "length": len(tok.encode("Hello world"))}
    assert plain["tokens"] == tok.encode("Hello world", add_bos=False)
    rendered = engine.chat_prompt(hi, add_generation_prompt=False)
    assert chat["tokens"] == tok.encode(rendered) and rendered != engine.chat_prompt(hi)
    assert back["text"] == tok.decode(text["tokens"], skip_special=True) and "Hello world" in back["text"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    assert anon.status_code == 401


# ---- chat and text completions against the engine ---------------------------------------------------------------

def test_chat_greedy_matches_engine(app, engine):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    prompt = engine.chat_prompt([{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hello\nthere"}])
    ref = reference(engine, prompt, 12, add_bos=False)

    async def go():
        c = aclient(app)
        r = await c.chat.completions.create(model="whatever", messages=messages, temperature=0,
                                            max_completion_tokens=12)
        default = await c.chat.completions.create(model="tiny", messages=messages, temperature=0)
        return r, default

    r, default = run(go())
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.message.tool_calls is None and choice.finish_reason == "length" == ref.finish_reason
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_bos=False)) == ref.prompt_tokens
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.model == "tiny" and r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.created > 0
    # No max_tokens: ServerConfig.max_tokens (16) applies.
    assert default.usage.completion_tokens == 16
    assert default.choices[0].message.content == reference(engine, prompt, 16, add_bos=False).text


def test_continue_final_message(app, engine):
    """continue_final_message: the prompt ends inside the assistant's last message (as transformers cuts it) and the
    reply is the engine's continuation of it; with add_generation_prompt true, or a last message not the
    assistant's, it is a 400."""
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite is"}]
    prompt = engine.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("My favourite is")
    ref = reference(engine, prompt, 8, add_bos=False)

    async def go():
        return await aclient(app).chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                          max_tokens=8, extra_body={"continue_final_message": True})

    r = run(go())
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_bos=False))


def test_continue_final_message_errors(app):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as h:
            a = await h.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
                "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 2})
            b = await h.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
                "messages": [{"role": "user", "content": "x"}], "continue_final_message": True, "max_tokens": 2})
            return a, b

    a, b = run(go())   # continue_final_message with add_generation_prompt true; a last message not the assistant's
    assert a.status_code == 400 and a.json()["error"]["param"] == "add_generation_prompt", a.text
    assert b.status_code == 400 and b.json()["error"]["param"] == "messages", b.text


def test_penalties_and_logit_bias_reach_the_sampler(url, engine):
    """frequency_penalty / presence_penalty / logit_bias: the reply is the engine's own with the same settings, and
    a +100 bias on one token makes the greedy reply that token throughout."""
    from exl2.config import SamplingSettings

    messages = [{"role": "user", "content": "Count: one one one one"}]
    prompt = engine.chat_prompt(messages)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    for fields in (dict(frequency_penalty=1.5), dict(presence_penalty=2.0)):
        r = c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=10, **fields)
        want = engine.generator.generate(prompt, SamplingSettings(temperature=0, **fields), 10, add_bos=False)
        assert r.choices[0].message.content == want.text, fields
        assert want.token_ids != reference(engine, prompt, 10, add_bos=False).token_ids  # the penalty mattered
    token = engine.tokenizer.encode(" yes", add_bos=False)[0]
    r = c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=4,
                                  logit_bias={str(token): 100})
    assert r.choices[0].message.content == engine.tokenizer.decode([token] * 4)


def test_chat_streaming_over_socket(url, engine):
    messages = [{"role": "user", "content": "Tell me a story."}]
    ref = reference(engine, engine.chat_prompt(messages), 10, add_bos=False)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=10,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    # The raw event stream: data events only, ending with [DONE].
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": messages, "temperature": 0, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(json.loads(d)["choices"] for d in data[:-1])


def test_completions_stop_strings_stream_and_echo(url, app, engine):
    prompt = "The quick brown fox"
    full = reference(engine, prompt, 16)
    stop = full.text[6:9]
    cut = full.text[:full.text.index(stop)]
    assert stop and cut != full.text
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    r = c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=16)
    assert r.choices[0].text == full.text and r.usage.completion_tokens == len(full.token_ids)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt)) and r.object == "text_completion"

    stopped = c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=16, stop=[stop, "@@"])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"

    chunks = list(c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=16, stop=stop,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == stopped.usage.completion_tokens

    echoed = run(aclient(app).completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=16,
                                                 echo=True))
    assert echoed.choices[0].text == prompt + full.text


def test_usage_reports_cached_prompt_tokens(url, engine):
    """A prompt longer than a cache page (256 tokens), sent twice: the second time its first page comes from the
    prompt cache, and the reply is the same."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    prompt = ""
    while len(engine.tokenizer.encode(prompt)) <= 260:
        prompt += "alpha beta gamma delta "
    assert len(engine.tokenizer.encode(prompt)) < 480
    first = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 256)  # another test may have sent it before
    assert again.usage.prompt_tokens_details.cached_tokens == 256 and again.choices[0].text == first.choices[0].text


def test_structured_output(url):
    """response_format json_schema / json_object: replies parse and follow the schema, streamed or not."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}}}
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
    hi = [{"role": "user", "content": "Plan a trip."}]
    replies = []
    for seed in (1, 2):
        r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=120, temperature=1.0, seed=seed,
                                      response_format=fmt)
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"city", "days"} and isinstance(value["days"], int) and len(value["city"]) <= 10
        assert r.choices[0].finish_reason == "stop"
        replies.append(r.choices[0].message.content)
    both = c.chat.completions.create(model="tiny", messages=hi, max_tokens=120, temperature=1.0, seed=1, n=2,
                                     response_format=fmt)      # a grammar per choice: seeds 1 and 2 as above
    assert [ch.message.content for ch in both.choices] == replies
    parts = c.chat.completions.create(model="tiny", messages=hi, max_tokens=120, temperature=1.0, seed=3,
                                      response_format=fmt, stream=True)
    value = json.loads("".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices))
    assert set(value) == {"city", "days"}
    r = c.completions.create(model="tiny", prompt="Data:", max_tokens=200, temperature=0.8, seed=4,
                             extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


# ---- several choices and prompts --------------------------------------------------------------------------------

def test_chat_n_choices(app):
    hi = [{"role": "user", "content": "Tell me a story."}]

    async def go():
        c = aclient(app)
        create = c.chat.completions.create
        one = await create(model="tiny", messages=hi, temperature=0, max_tokens=8)
        greedy = await create(model="tiny", messages=hi, temperature=0, max_tokens=8, n=3)
        seeded = await create(model="tiny", messages=hi, temperature=1, max_tokens=8, n=3, seed=5)
        again = await create(model="tiny", messages=hi, temperature=1, max_tokens=8, n=3, seed=5)
        singles = await asyncio.gather(*(create(model="tiny", messages=hi, temperature=1, max_tokens=8, seed=5 + i)
                                         for i in range(3)))
        return one, greedy, seeded, again, singles

    one, greedy, seeded, again, singles = run(go())
    assert [ch.index for ch in greedy.choices] == [0, 1, 2]
    assert [ch.message.content for ch in greedy.choices] == [one.choices[0].message.content] * 3
    assert [ch.finish_reason for ch in greedy.choices] == ["length"] * 3
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + greedy.usage.completion_tokens
    texts = [ch.message.content for ch in seeded.choices]
    assert texts == [s.choices[0].message.content for s in singles]      # choice i samples with seed + i
    assert texts == [ch.message.content for ch in again.choices] and len(set(texts)) > 1


def test_completions_several_prompts(app, engine):
    prompts = ["The quick brown fox", "Once upon a time"]

    async def go():
        c = aclient(app)
        create = c.completions.create
        many = await create(model="tiny", prompt=prompts, n=2, temperature=1, seed=7, max_tokens=6)
        singles = await asyncio.gather(*(create(model="tiny", prompt=p, temperature=1, seed=7 + i, max_tokens=6)
                                         for p in prompts for i in range(2)))
        ids = await create(model="tiny", prompt=[engine.tokenizer.encode(p) for p in prompts], temperature=0,
                           max_tokens=6, echo=True)
        return many, singles, ids

    many, singles, ids = run(go())
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]              # prompt-major: prompt * n + i
    assert [ch.text for ch in many.choices] == [s.choices[0].text for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens + singles[2].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    for p, ch in zip(prompts, ids.choices):                               # token-id prompts, echoed as text
        assert ch.text == engine.tokenizer.decode(engine.tokenizer.encode(p)) + reference(engine, p, 6).text


def test_streaming_n_choices_over_socket(url):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 1, "seed": 11,
            "max_tokens": 10, "n": 2}
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    whole = c.chat.completions.create(model="tiny", **body)
    data = sse_data(url, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert data.count("[DONE]") == 1 and data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    with_usage = [i for i, ch in enumerate(chunks) if ch.get("usage")]
    assert with_usage == [len(chunks) - 1] and chunks[-1]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details")   # not the timings
    assert {k: chunks[-1]["usage"][k] for k in counts} == whole.usage.model_dump(exclude_none=True, include=set(counts))
    parts = [ch["choices"][0] for ch in chunks[:-1]]
    assert all(len(ch["choices"]) == 1 for ch in chunks[:-1]) and {p["index"] for p in parts} == {0, 1}
    for i in (0, 1):
        mine = [p for p in parts if p["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(p["delta"].get("content") or "" for p in mine) == whole.choices[i].message.content
        assert [p["finish_reason"] for p in mine if p["finish_reason"]] == [whole.choices[i].finish_reason]
        assert mine[-1]["finish_reason"]                                  # the finish chunk ends its choice


def test_best_of_returns_the_candidates_with_the_highest_logprob_per_token(app):
    """best_of 3, n 2 = the same request with n 3 (the candidates: seeds seed + i), ranked by the mean
    log-probability of their tokens, best first; usage counts every candidate's tokens, and logprobs appear only
    where asked for."""
    async def go():
        c = aclient(app)
        kw = dict(model="tiny", prompt=["Once upon a time", "The sky"], max_tokens=6, temperature=1.0, seed=11)
        every = await c.completions.create(n=3, logprobs=0, **kw)
        best = await c.completions.create(n=2, best_of=3, **kw)
        return every, best

    every, best = run(go())
    want = []
    for p in range(2):
        cands = every.choices[3 * p:3 * p + 3]
        mean = [sum(x.logprobs.token_logprobs) / len(x.logprobs.token_logprobs) for x in cands]
        assert len(set(mean)) == 3                      # a strict order, so the ranking is checkable
        want += [cands[i].text for i in sorted(range(3), key=lambda i: -mean[i])[:2]]
    assert [ch.text for ch in best.choices] == want
    assert [ch.index for ch in best.choices] == [0, 1, 2, 3] and all(ch.logprobs is None for ch in best.choices)
    assert best.usage.completion_tokens == every.usage.completion_tokens
    assert best.usage.prompt_tokens == every.usage.prompt_tokens


# ---- errors -----------------------------------------------------------------------------------------------------

def test_bad_requests_are_400_in_openai_shape(app):
    hi = [{"role": "user", "content": "hi"}]

    async def go():
        c = aclient(app)
        cases = [dict(n=17), dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
                 dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                     "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}),
                 dict(logit_bias={"abc": 1.0}), dict(logit_bias={"99999999": 1.0}), dict(top_logprobs=3),
                 dict(stop=[f"s{i}" for i in range(65)])]
        params = []
        for extra in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="tiny", messages=hi, max_tokens=2, **extra)
            assert set(e.value.body) == {"message", "type", "param", "code"}
            params.append(e.value.body["param"])
        assert params == ["n", "response_format", "response_format", "logit_bias", "logit_bias", "top_logprobs",
                          "stop"]
        assert "at most 64" in e.value.body["message"]
        many = await c.chat.completions.create(model="tiny", messages=hi, max_tokens=2,
                                               stop=[f"s{i}" for i in range(8)])
        assert many.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, n=17)
        assert e.value.body["param"] == "n" and "16" in e.value.body["message"]
        for extra in (dict(best_of=1, n=2), dict(best_of=17), dict(best_of=3, stream=True)):
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="tiny", prompt="a", max_tokens=2, **extra)
            assert e.value.body["param"] == "best_of"

        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
        assert "image_url" in e.value.body["message"]

        long = "hello " * 600                    # > 512 tokens of context
        for stream in (False, True):             # streamed too: a 400 before any event is sent
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="tiny", prompt=long, max_tokens=2, stream=stream)
            assert e.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=2)
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"

        http = c._client
        auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
        bad_json = await http.post("http://test/v1/chat/completions", content=b"{not json", headers=auth)
        missing = await http.post("http://test/v1/chat/completions", json={"model": "tiny"}, headers=auth)
        wrong_type = await http.post("http://test/v1/completions", json={"prompt": "x", "temperature": "hot"},
                                     headers=auth)
        return bad_json, missing, wrong_type

    bad_json, missing, wrong_type = run(go())
    for r in (bad_json, missing, wrong_type):
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in bad_json.json()["error"]["message"]
    assert missing.json()["error"]["param"] == "messages"
    assert wrong_type.json()["error"]["param"] == "temperature"


# ---- tools ------------------------------------------------------------------------------------------------------

def test_tool_calls_non_streamed(fake_app, fake):
    async def go(reply, **kw):
        fake.reply = reply
        return await aclient(fake_app).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS, **kw)

    r = run(go(CALL))
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert fake.rendered[-1][1] == [{"type": "function", "function": TOOLS[0]["function"]}]

    r = run(go("Let me add.\n" + CALL, tool_choice={"type": "function", "function": {"name": "add"}}))
    assert r.choices[0].message.content == "Let me add." and r.choices[0].message.tool_calls

    llama = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    r = run(go(llama, tool_choice="required"))
    assert r.choices[0].message.tool_calls[0].function.name == "add" and r.choices[0].message.content is None

    assert fake.forced[-2:] == ["add", "required"]    # forced choices are enforced by a grammar, 'auto' is not
    r = run(go(CALL, tool_choice="auto"))
    assert fake.forced[-2:] == ["add", "required"]
    with pytest.raises(openai.BadRequestError):
        run(go(CALL, tool_choice="required", response_format={"type": "json_object"}))

    r = run(go(CALL, tool_choice="none"))            # no tools rendered, nothing parsed
    assert fake.rendered[-1][1] is None
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError):
        run(go(CALL, tool_choice={"type": "function", "function": {"name": "missing"}}))

    r = run(go("Let me add.\n" + CALL, n=2))                # parsed per choice
    assert [ch.index for ch in r.choices] == [0, 1] and [ch.finish_reason for ch in r.choices] == ["tool_calls"] * 2
    assert [ch.message.content for ch in r.choices] == ["Let me add."] * 2
    ids = [ch.message.tool_calls[0].id for ch in r.choices]
    assert len(set(ids)) == 2 and all(ch.message.tool_calls[0].function.name == "add" for ch in r.choices)
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == 5


def test_tool_calls_streamed(fake_url, fake):
    c = openai.OpenAI(base_url=f"{fake_url}/v1", api_key="unused", max_retries=0)

    def stream(reply):
        fake.reply = reply
        chunks = list(c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "1+2?"}],
                                                tools=TOOLS, stream=True))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        return content, calls, chunks[-1].choices[0].finish_reason

    content, calls, finish = stream("Let me add.\n" + CALL)
    assert content == "Let me add.\n" and finish == "tool_calls"      # no piece of the call leaked as content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].type == "function" and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}

    content, calls, finish = stream('  {"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert content == "" and [tc.function.name for tc in calls] == ["add"] and finish == "tool_calls"

    content, calls, finish = stream("[1, 2] are <tool numbers")     # held back, then released as text
    assert content == "[1, 2] are <tool numbers" and calls == [] and finish == "stop"

    content, calls, finish = stream("Plain answer <b>3</b>.")
    assert content == "Plain answer <b>3</b>." and calls == [] and finish == "stop"

    fake.reply = "Let me add.\n" + CALL                    # n=2: each choice holds back and parses its own call
    chunks = list(c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "1+2?"}],
                                            tools=TOOLS, stream=True, n=2))
    ids = set()
    for i in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
        assert "".join(p.delta.content or "" for p in mine) == "Let me add.\n"
        calls = [tc for p in mine for tc in p.delta.tool_calls or []]
        assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "add"
        assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
        assert [p.finish_reason for p in mine if p.finish_reason] == ["tool_calls"]
        ids.add(calls[0].id)
    assert len(ids) == 2


def test_legacy_function_calling(fake_app, fake_url, fake):
    """OpenAI's deprecated `functions` / `function_call`: the functions reach the template as tools, a call comes
    back as the message's one `function_call` (finish_reason 'function_call'), streamed too; a named
    function_call forces that call; earlier `function_call` turns and `function` results render as a tool call and
    its result; mixing both APIs is a 400."""
    functions = [TOOLS[0]["function"]]
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None,
                "function_call": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
               {"role": "function", "name": "add", "content": "3"},
               {"role": "user", "content": "and 2+2?"}]

    async def go(reply, messages=history[:1], **kw):
        fake.reply = reply
        return await aclient(fake_app).chat.completions.create(model="fake-model", messages=messages,
                                                               functions=functions, **kw)

    r = run(go("Let me add.\n" + CALL))
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.content == "Let me add." and choice.message.function_call.name == "add"
    assert json.loads(choice.message.function_call.arguments) == {"a": 1, "b": 2}
    assert fake.rendered[-1][1] == [{"type": "function", "function": TOOLS[0]["function"]}]

    run(go(CALL, function_call={"name": "add"}))
    assert fake.forced[-1] == "add"
    r = run(go(CALL, function_call="none"))
    assert fake.rendered[-1][1] is None and r.choices[0].message.content == CALL

    r = run(go("It is 4.", messages=history))
    messages = fake.rendered[-1][0]
    assert r.choices[0].message.content == "It is 4." and r.choices[0].finish_reason == "stop"
    call = messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert messages[2] == {"role": "tool", "content": "3", "name": "add", "tool_call_id": call["id"]}

    c = openai.OpenAI(base_url=f"{fake_url}/v1", api_key="unused", max_retries=0)
    fake.reply = "Let me add.\n" + CALL
    chunks = list(c.chat.completions.create(model="fake-model", messages=history[:1], functions=functions,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me add.\n"
    calls = [ch.choices[0].delta.function_call for ch in chunks if ch.choices[0].delta.function_call]
    assert len(calls) == 1 and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert chunks[-1].choices[0].finish_reason == "function_call"

    for bad in (dict(tools=TOOLS), dict(function_call={"name": "add"}, tool_choice="auto")):
        with pytest.raises(openai.BadRequestError) as e:
            run(go(CALL, **bad))
        assert e.value.body["param"] in ("functions", "function_call")
    with pytest.raises(openai.BadRequestError) as e:
        fake.reply = CALL
        run(aclient(fake_app).chat.completions.create(model="fake-model", messages=history[:1],
                                                      function_call="auto"))
    assert e.value.body["param"] == "function_call"


def test_error_in_one_choice_ends_the_stream(fake_url, fake):
    fake.reply, fake.fail_seed = "Some plain text that takes a while to send.", 1
    fake.opened = fake.closes = 0
    try:
        data = sse_data(fake_url, "/v1/completions", {"prompt": "go", "stream": True, "n": 2, "seed": 0})
    finally:
        fake.fail_seed = None
    assert "[DONE]" not in data and json.loads(data[-1])["error"]["type"] == "server_error"
    assert all("error" not in json.loads(d) for d in data[:-1])
    assert wait_until(lambda: fake.closes == fake.opened == 2), "not every choice's engine stream was closed"


def test_tool_history_renders_through_real_engine(app, engine):
    history = [{"role": "user", "content": "What is 1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    as_template = [history[0],             # what HF templates expect: arguments as a dict, content a string
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                                        "function": {"name": "add",
                                                                                     "arguments": {"a": 1, "b": 2}}}]},
                   history[2]]
    ref = reference(engine, engine.chat_prompt(as_template, TOOLS), 6, add_bos=False)
    r = run(aclient(app).chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0,
                                                 max_tokens=6))
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.prompt_tokens


# ---- cancellation -----------------------------------------------------------------------------------------------

def test_client_disconnect_closes_the_engine_stream(fake_url, fake):
    fake.reply = None                                    # endless
    fake.closed.clear()
    with httpx.stream("POST", f"{fake_url}/v1/completions", json={"prompt": "go", "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert not fake.closed.is_set()
    assert fake.closed.wait(5), "the engine stream was not closed after the client left"

    fake.closed.clear()                                  # non-streamed: the server polls for the hang-up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fake_url}/v1/completions", json={"prompt": "go"}, timeout=0.3)
    assert fake.closed.wait(5)

    for stream in (True, False):                         # n=2: every choice's engine stream is closed
        assert wait_until(lambda: fake.closes == fake.opened)
        fake.opened = fake.closes = 0
        body = {"messages": [{"role": "user", "content": "go"}], "stream": stream, "n": 2}
        if stream:
            with httpx.stream("POST", f"{fake_url}/v1/chat/completions", json=body) as r:
                assert next(line for line in r.iter_lines() if line.startswith("data: "))
                assert wait_until(lambda: fake.opened == 2), fake.opened
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{fake_url}/v1/chat/completions", json=body, timeout=0.3)
        assert wait_until(lambda: fake.closes == fake.opened == 2), f"streams left open (stream={stream})"


# ---- exl2 serve -------------------------------------------------------------------------------------------------

def test_serve_cli_errors_are_one_line(capsys, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        rc = main(["serve", "-m", str(SRC), "--device", "cpu", "--port", str(busy.getsockname()[1])])
    finally:
        busy.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "already in use" in err[0] and "Traceback" not in err[0]

    rc = main(["serve", "-m", str(tmp_path / "missing"), "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "does not exist" in err[0]


def test_forced_tool_choice_through_real_engine(app):
    """A named tool_choice on the (random) real model: its reply is a call of that tool, arguments in its schema."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                       "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}, TOOLS[0] | {"function": {"name": "sub"}}]
    r = run(aclient(app).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "1+2?"}], tools=tools, max_tokens=120, seed=7,
        tool_choice={"type": "function", "function": {"name": "add"}}))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["add"] * len(choice.message.tool_calls)
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    assert set(args) == {"a", "b"} and all(0 <= v <= 9 for v in args.values())


# ---- log-probabilities --------------------------------------------------------------------------------------------

def test_logprobs_chat_and_completions(app, engine):
    """Greedy requests with logprobs: every generated token comes with the engine's own log-probability (the
    model's raw distribution) and its top alternatives, the sampled token first among them."""
    prompt = engine.chat_prompt([{"role": "user", "content": "Hello"}])
    ref = engine.generator.generate(prompt, GREEDY, 6, add_bos=False, logprobs=2)

    async def go():
        c = aclient(app)
        chat = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                               temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
        text = await c.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=5,
                                          logprobs=3)
        plain = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                temperature=0, max_tokens=2)
        return chat, text, plain

    chat, text, plain = run(go())
    content = chat.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == chat.usage.completion_tokens
    for entry, want in zip(content, ref.logprobs):
        assert entry.token == engine.tokenizer.decode([want.token_id]) and entry.logprob == pytest.approx(want.logprob)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in want.top])
        assert entry.top_logprobs[0].token == entry.token and entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8") == entry.token
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                           lp.token_logprobs))
    assert lp.text_offset[0] == 0 and plain.choices[0].logprobs is None

    async def streamed():
        c = aclient(app)
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                 temperature=0, max_tokens=6, logprobs=True, top_logprobs=2,
                                                 stream=True)
        return [ch async for ch in stream]
    chunks = run(streamed())
    got = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in got] == [(e.token, e.logprob) for e in content]
    assert sum(1 for ch in chunks for c in ch.choices if c.logprobs) > 1     # with the text, not all at the end

    async def streamed_text():
        stream = await aclient(app).completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                                       max_tokens=5, logprobs=3, stream=True)
        return [ch async for ch in stream]
    parts = [c.logprobs for ch in run(streamed_text()) for c in ch.choices if c.logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_logprobs_requests_the_engine_cannot_serve(app):
    async def bad(**kw):
        with pytest.raises(openai.BadRequestError):
            await aclient(app).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=2, **kw)

    async def go():
        await bad(top_logprobs=2)                          # without logprobs=true
        await bad(logprobs=True, top_logprobs=21)
        with pytest.raises(openai.BadRequestError):
            await aclient(app).completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=1, echo=True)
        with pytest.raises(openai.BadRequestError):
            await aclient(app).completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=6)
    run(go())


# ---- reasoning output -------------------------------------------------------------------------------------------

# Qwen3-style: the generation prompt opens a think block unless enable_thinking is false, which closes it empty.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THOUGHT = 'Maybe <tool_call>{"name": "sub", "arguments": {}}</tool_call>? No: add.'


class ThinkingEngine(FakeEngine):
    """A fake reasoning model: its own template (so chat_template_kwargs reach it) and canned replies."""

    model_name = "thinking-model"

    def __init__(self):
        super().__init__()
        self.template = ChatTemplate(THINKING_TEMPLATE)     # mentions <think>: the reasoning parser is on

    def chat_prompt(self, messages, tools=None, **variables):
        self.rendered.append((messages, tools))
        return self.template.render(messages, tools, **variables)

    def json_grammar(self, schema=None):
        return "json grammar"          # not applied by the fake; tells the server the reply is constrained


@pytest.fixture(scope="module")
def thinker():
    return ThinkingEngine()


@pytest.fixture(scope="module")
def thinker_url(thinker):
    with serving(create_app(thinker, ServerConfig())) as base:
        yield base


def test_reasoning_splitter_any_chunking():
    """Every way of cutting a reply into two or three pieces, and one character at a time, splits it as the whole
    text does: tags cut across pieces are held until complete, whitespace around the block is dropped."""
    cases = [("<think>\nLet me see.\n</think>\n\nIt is 3.", False, ("Let me see.", "It is 3.")),
             ("Let me see.\n</think>\n\nIt is 3.", True, ("Let me see.", "It is 3.")),
             ("<think>\nagain</think>It is 3.", True, ("again", "It is 3.")),
             ("  <think>a  b </think>  c d ", False, ("a  b", "c d ")),
             ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),
             ("<think>cut off at max_tok", False, ("cut off at max_tok", "")),
             ("cut off in the tag </thi", True, ("cut off in the tag </thi", "")),
             ("\n\nPlain <b>x</b> </think>", False, (None, "\n\nPlain <b>x</b> </think>")),
             ("<thi", False, (None, "<thi")), ("", True, ("", "")), ("", False, (None, ""))]
    for text, thinking, want in cases:
        assert split_reasoning(text, thinking) == want, text
        cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
        pieces = [[text[:i], text[i:j], text[j:]] for i, j in cuts] + [list(text)]
        for parts in pieces:
            splitter, reasoning, content = ReasoningSplitter(thinking), "", ""
            for part in parts:
                r, c = splitter.push(part)
                reasoning, content = reasoning + r, content + c
            r, c = splitter.finish()
            assert (reasoning + r if splitter.found else None, content + c) == want, (text, parts)


def test_reasoning_non_streamed(thinker_url, thinker):
    """The template opens the think block, so the reply only closes it; with enable_thinking false the prompt
    closes it and the reply is all content; a reply opening its own block is split too; tool calls are read only
    from the content (a call mentioned while thinking is not one)."""
    c = openai.OpenAI(base_url=f"{thinker_url}/v1", api_key="unused", max_retries=0)
    hi = [{"role": "user", "content": "1+2?"}]

    thinker.reply = "\nLet me see.\n</think>\n\nIt is 3."
    r = c.chat.completions.create(model="x", messages=hi)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Let me see." and msg.content == "It is 3." and r.choices[0].finish_reason == "stop"
    assert thinker.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")

    history = [*hi, {"role": "assistant", "content": "It is 3.", "reasoning_content": "Easy."}, *hi]
    c.chat.completions.create(model="x", messages=history)     # thinking sent back reaches the template
    assert thinker.rendered[-1][0][1] == {"role": "assistant", "content": "It is 3.", "reasoning_content": "Easy.",
                                          "thinking": "Easy."}     # gpt-oss's template reads `thinking`

    thinker.reply = "It is 3."
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    r = c.chat.completions.create(model="x", messages=hi, extra_body=no_think)
    assert r.choices[0].message.content == "It is 3." and r.choices[0].message.reasoning_content is None
    assert thinker.prompts[-1].endswith("<think>\n\n</think>\n\n")

    c.chat.completions.create(model="x", messages=hi, n=2, extra_body={"thinking_budget": 5,
                                                                  "reasoning_budget_message": "Enough."})
    a, b = thinker.budgets[-2:]
    assert a is not b and (a.tokens, a.inside, a.start) == (5, True, 0)    # the template opened the block
    assert a.end_ids == thinker.tokenizer.encode("Enough.\n</think>\n\n", add_bos=False)
    c.chat.completions.create(model="x", messages=hi)
    assert thinker.budgets[-1] is None

    r = c.chat.completions.create(model="x", messages=hi, extra_body={"enable_thinking": False})   # top-level
    assert r.choices[0].message.content == "It is 3." and thinker.prompts[-1].endswith("<think>\n\n</think>\n\n")
    r = c.chat.completions.create(model="x", messages=hi, extra_body={
        "enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}})    # the explicit one wins
    assert not thinker.prompts[-1].endswith("</think>\n\n")

    thinker.reply = "<think>Easy.</think>\n3"
    r = c.chat.completions.create(model="x", messages=hi, extra_body={"template_vars": {"enable_thinking": False}})
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Easy.", "3")

    thinker.reply = "Still thinking when max_tokens ran out"
    r = c.chat.completions.create(model="x", messages=hi)
    assert r.choices[0].message.reasoning_content == thinker.reply and r.choices[0].message.content is None

    thinker.reply = THOUGHT + "\n</think>\n\n" + CALL
    r = c.chat.completions.create(model="x", messages=hi, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.reasoning_content == THOUGHT and msg.content is None
    assert [t.function.name for t in msg.tool_calls] == ["add"]
    thinker.reply = '{"a": 1}'                           # a grammar from the first token: the reply cannot think
    r = c.chat.completions.create(model="x", messages=hi, response_format={"type": "json_object"})
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (None, '{"a": 1}')
    thinker.reply = THOUGHT + "\n</think>\n\nNo call."
    r = c.chat.completions.create(model="x", messages=hi, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "No call."


def test_reasoning_streamed(thinker_url, thinker):
    """Streamed deltas carry reasoning_content, then content, equal to the non-streamed split however the fake's
    3-character pieces cut the tags; neither carries a tag; with tools the call is parsed from the content alone."""
    def stream(reply, **body):
        thinker.reply = reply
        data = sse_data(thinker_url, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "1+2?"}], "stream": True, **body})
        deltas = [json.loads(d)["choices"][0]["delta"] for d in data[:-1]]
        finish = json.loads(data[-2])["choices"][0]["finish_reason"]
        assert not any("think>" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
        return ("".join(d.get("reasoning_content") or "" for d in deltas),
                "".join(d.get("content") or "" for d in deltas),
                [tc for d in deltas for tc in d.get("tool_calls") or []], finish, deltas)

    no_think = {"enable_thinking": False}
    for pad in ("", "x", "xy"):                          # the closing tag cut at each place of a piece
        reasoning, content, _, finish, deltas = stream(f"\n{pad}Let me see.\n</think>\n\nIt is 3.")
        assert (reasoning, content, finish) == (f"{pad}Let me see.", "It is 3.", "stop")
        first = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all(not d.get("reasoning_content") for d in deltas[first:])      # thinking first, then the answer
        reasoning, content, _, _, _ = stream(f"{pad}It is 3.", chat_template_kwargs=no_think)
        assert (reasoning, content) == ("", f"{pad}It is 3.")
        reasoning, content, _, _, _ = stream(f"<think>{pad}Hm.</think> 3", chat_template_kwargs=no_think)
        assert (reasoning, content) == (f"{pad}Hm.", "3")
    c = openai.OpenAI(base_url=f"{thinker_url}/v1", api_key="unused", max_retries=0)
    for reply, kwargs in [("Cut off in the tag </thi", {}), ("Cut off with space  ", {}), ("<thi", no_think),
                          ("  \n", no_think), ("<think>x\n</think>\n", no_think)]:
        streamed = stream(reply, chat_template_kwargs=kwargs)[:2]      # what is held at the end comes out too
        whole = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "1+2?"}],
                                          extra_body={"chat_template_kwargs": kwargs}).choices[0].message
        assert streamed == (whole.reasoning_content or "", whole.content or ""), reply

    reasoning, content, calls, finish, _ = stream(THOUGHT + "\n</think>\n\n" + CALL, tools=TOOLS)
    assert reasoning == THOUGHT and content == "" and finish == "tool_calls"
    assert [tc["function"]["name"] for tc in calls] == ["add"]
    reasoning, content, calls, finish, _ = stream("Hm.</think>Let me add.\n" + CALL, tools=TOOLS, n=1)
    assert (reasoning, content, finish) == ("Hm.", "Let me add.\n", "tool_calls") and len(calls) == 1


def test_reasoning_parser_setting(thinker, fake_app):
    """Auto: on for a template that mentions <think>, off otherwise (the ChatML-prompted fake); ServerConfig turns
    it off (the reply then comes unchanged, without reasoning_content) or on."""
    async def ask(app, reply):
        thinker.reply = reply
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        card = (await http.get("/v1/model")).json()["parameters"]["reasoning_parser"]
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        return card, r.json()["choices"][0]["message"]

    reply = "Hm.\n</think>\n\n3"
    card, msg = run(ask(create_app(thinker, ServerConfig(reasoning_parser=False)), reply))
    assert card is False and msg["content"] == reply and "reasoning_content" not in msg
    card, msg = run(ask(create_app(thinker, ServerConfig()), reply))
    assert card is True and (msg["reasoning_content"], msg["content"]) == ("Hm.", "3")
    plain = FakeEngine()
    plain.reply = "<think>Hm.</think>3"
    forced = create_app(plain, ServerConfig(reasoning_parser=True))
    assert fake_app.state.exl2.reasoning is False and forced.state.exl2.reasoning is True
    msg = run(aclient(forced).chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}]))
    assert (msg.choices[0].message.reasoning_content, msg.choices[0].message.content) == ("Hm.", "3")


def test_other_reasoning_tags():
    """Magistral's [THINK]…[/THINK]: found in its template (parser on, tags taken from it), or set by the server
    (reasoning_start_token / reasoning_end_token); the split is the <think> one's with the other tags, chunked
    any way."""
    from exl2.generation.budget import ThinkTags

    tags = ThinkTags("[THINK]", "[/THINK]")
    text = "[THINK]\nLet me see.\n[/THINK]\n\nIt is 3."
    assert split_reasoning(text, False, tags) == ("Let me see.", "It is 3.")
    assert split_reasoning(text) == (None, text)           # not <think>: plain content
    for cut in range(len(text) + 1):
        splitter = ReasoningSplitter(False, tags)
        r1, c1 = splitter.push(text[:cut])
        r2, c2 = splitter.push(text[cut:])
        r3, c3 = splitter.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == ("Let me see.", "It is 3."), cut

    magistral = FakeEngine()
    magistral.template = ChatTemplate("{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
                                      "{# the model may write [THINK]...[/THINK] first #}")
    magistral.chat_prompt = lambda messages, tools=None, **v: magistral.template.render(messages, tools, **v)
    magistral.reply = "[THINK]Hm.[/THINK]3"
    app = create_app(magistral, ServerConfig())
    assert app.state.exl2.reasoning is True and app.state.exl2.tags == tags
    msg = run(aclient(app).chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}]))
    assert (msg.choices[0].message.reasoning_content, msg.choices[0].message.content) == ("Hm.", "3")

    plain = FakeEngine()
    plain.reply = "<reasoning>Hm.</reasoning>3"
    app = create_app(plain, ServerConfig(reasoning_parser=True, reasoning_start_token="<reasoning>",
                                         reasoning_end_token="</reasoning>"))
    msg = run(aclient(app).chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}]))
    assert (msg.choices[0].message.reasoning_content, msg.choices[0].message.content) == ("Hm.", "3")
    with pytest.raises(ValueError, match="give both or neither"):
        ServerConfig(reasoning_start_token="<r>")


# ---- chat template variables ------------------------------------------------------------------------------------

def test_chat_template_kwargs_reach_the_template(thinker_url, thinker, app, engine):
    c = openai.OpenAI(base_url=f"{thinker_url}/v1", api_key="unused", max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    thinker.reply = "3"
    for body, closed in [({}, False), ({"chat_template_kwargs": {"enable_thinking": False}}, True),
                         ({"template_vars": {"enable_thinking": False}}, True),
                         ({"template_vars": {"enable_thinking": False},
                           "chat_template_kwargs": {"enable_thinking": True}}, False),   # the latter wins
                         ({"chat_template_kwargs": {"enable_thinking": True, "x": [1, {"y": None}]}}, False)]:
        c.chat.completions.create(model="x", messages=hi, extra_body=body)
        assert thinker.prompts[-1].endswith("<think>\n\n</think>\n\n" if closed else "assistant\n<think>\n"), body

    # The real engine: variables its template does not use leave the prompt as engine.chat_prompt renders it.
    ref = reference(engine, engine.chat_prompt(hi), 2, add_bos=False)
    r = run(aclient(app).chat.completions.create(model="tiny", messages=hi, temperature=0, max_tokens=2,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.prompt_tokens


def test_per_request_prompt_template(app, engine):
    """TabbyAPI's per-request prompt_template: the reply is the one to the chat rendered with that template (a
    bundled name here), the served template stays; a path or an unknown name is a 400 naming the field."""
    from exl2.generation.templates import choose_template

    hi = [{"role": "user", "content": "hi"}]
    served = engine.template
    alpaca = choose_template(engine.tokenizer, "alpaca").render(hi, add_generation_prompt=True)
    assert alpaca != engine.chat_prompt(hi)
    ref = reference(engine, alpaca, 3, add_bos=False)

    async def go():
        c = aclient(app)
        r = await c.chat.completions.create(model="tiny", messages=hi, temperature=0, max_tokens=3,
                                            extra_body={"prompt_template": "alpaca"})
        assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.prompt_tokens
        for name in ("../etc/passwd", "/tmp/x.jinja", "x.jinja", "no-such-template"):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="tiny", messages=hi, max_tokens=2,
                                                extra_body={"prompt_template": name})
            assert e.value.body["param"] == "prompt_template", name
    run(go())
    assert engine.template is served


def test_choices_say_what_ended_the_reply(app, url, engine):
    """TabbyAPI's choice extras: eos_reason (stop_string, stop_token, max_new_tokens) and stop_str, the stop string
    or the stop token's text, on chat and completions, streamed (the last chunk) or not."""
    ref = reference(engine, "Once upon a time", 8)
    cut = ref.text.strip()[1:3]
    stop_id = ref.token_ids[2]
    assert cut and cut in ref.text

    async def go():
        c = aclient(app)
        r = await c.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=8,
                                       stop=[cut, "never-there"])
        extra = r.choices[0].model_extra
        assert (r.choices[0].finish_reason, extra["eos_reason"], extra["stop_str"]) == ("stop", "stop_string", cut)
        r = await c.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=8,
                                       extra_body={"stop_token_ids": [stop_id]})
        extra = r.choices[0].model_extra
        assert (extra["eos_reason"], extra["stop_str"]) == ("stop_token", engine.tokenizer.decode([stop_id]))
        r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, max_tokens=2, extra_body={"ignore_eos": True})
        extra = r.choices[0].model_extra
        assert r.choices[0].finish_reason == "length" and extra["eos_reason"] == "max_new_tokens"
        assert "stop_str" not in extra
    run(go())
    chunks = [json.loads(d) for d in sse_data(url, "/v1/completions", {
        "model": "tiny", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 8, "stop": [cut],
        "stream": True})[:-1]]
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["eos_reason"], last["stop_str"]) == ("stop", "stop_string", cut)
    assert all("eos_reason" not in ch["choices"][0] for ch in chunks[:-1])


def test_logging_switches(fake, caplog):
    """log_prompt / log_generation_params: each request's prompt and its non-default settings as INFO lines; off
    by default."""
    hi = [{"role": "user", "content": "hi"}]
    fake.reply = "fine"          # the module's fake may have been left endless by the disconnect tests

    def ask(config):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="exl2.server"):
            run(aclient(create_app(fake, config)).chat.completions.create(
                model="x", messages=hi, max_tokens=7, temperature=0.3, stop=["END"], n=2))
            run(aclient(create_app(fake, config)).completions.create(model="x", prompt="Once", max_tokens=3))
        return [r.getMessage() for r in caplog.records]

    quiet = ask(ServerConfig())
    assert not any(m.startswith(("prompt:", "generation params:")) for m in quiet)
    lines = ask(ServerConfig(log_prompt=True, log_generation_params=True))
    assert lines.count('prompt: "PROMPT"') == 1 and 'prompt: "Once"' in lines
    params = [json.loads(m.split(": ", 1)[1]) for m in lines if m.startswith("generation params:")]
    assert params[0]["temperature"] == 0.3 and params[0]["max_tokens"] == 7 and params[0]["stop"] == ["END"]
    assert params[0]["n"] == 2 and params[1]["max_tokens"] == 3


def test_embedding_model_beside_the_served_one(fake, engine):
    """An embedding model loaded beside the served one answers /v1/embeddings (its vectors, its name) and is
    listed by /v1/models; chat still goes to the served model."""
    app = create_app(fake, ServerConfig(), embedder=engine)

    async def go():
        c = aclient(app)
        r = await c.embeddings.create(model=engine.model_name, input=["first text", "a second one"])
        want = engine.embed(["first text", "a second one"])
        assert r.model == engine.model_name and len(r.data) == 2
        assert torch.allclose(torch.tensor([d.embedding for d in r.data]), want.vectors, atol=1e-5)
        ids = [m.id for m in (await c.models.list()).data]
        assert ids == [fake.model_name, engine.model_name]
        fake.reply = "ok"
        chat = await c.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == "ok"
    run(go())


def test_server_template_variables_and_start_in_reasoning(thinker):
    """The server's default template variables (a request's own replace them) and forced ones (nothing replaces
    them); start_in_reasoning "never" reads a reply as content although the prompt opens <think>, "always" as
    reasoning."""
    hi = [{"role": "user", "content": "1+2?"}]

    def ask(config, extra):
        app = create_app(thinker, ServerConfig(api_keys=(KEY,), **config))
        return run(aclient(app).chat.completions.create(model="x", messages=hi, extra_body=extra))

    thinker.reply = "It is 3."
    for config, extra, closed in [
            (dict(template_vars_default={"enable_thinking": False}), {}, True),
            (dict(template_vars_default={"enable_thinking": False}), {"enable_thinking": True}, False),
            (dict(template_vars_force={"enable_thinking": False}),
             {"chat_template_kwargs": {"enable_thinking": True}}, True)]:
        ask(config, extra)
        assert thinker.prompts[-1].endswith("<think>\n\n</think>\n\n") == closed, (config, extra)
    thinker.reply = "Easy. It is 3."
    for mode, reasoning, content in (("never", None, "Easy. It is 3."), ("always", "Easy. It is 3.", None)):
        msg = ask(dict(start_in_reasoning=mode),
                  {"chat_template_kwargs": {"enable_thinking": mode == "never"}}).choices[0].message
        assert (getattr(msg, "reasoning_content", None), msg.content) == (reasoning, content), mode
    with pytest.raises(ValueError, match="cannot set 'messages'"):
        ServerConfig(template_vars_force={"messages": []})


def test_chat_template_kwargs_rejected(thinker_url):
    """Not an object, or a name the server sets itself: a 400 with one sentence naming the field."""
    def post(**body):
        return httpx.post(f"{thinker_url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], **body})

    for body, param, words in [({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages",
                                "messages"),
                               ({"template_vars": {"bos_token": "<s>"}}, "template_vars.bos_token", "bos_token"),
                               ({"chat_template_kwargs": {"add_generation_prompt": False}},
                                "chat_template_kwargs.add_generation_prompt", "add_generation_prompt"),
                               ({"chat_template_kwargs": {"raise_exception": 1}},
                                "chat_template_kwargs.raise_exception", "raise_exception"),
                               ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs.self", "self"),
                               ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "dictionary"),
                               ({"template_vars": "enable_thinking"}, "template_vars", "dictionary")]:
        r = post(**body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], (body, err)
        assert err["message"].count(". ") == 0 and err["message"].endswith("."), err["message"]


# ---- CORS -------------------------------------------------------------------------------------------------------

def test_cors(fake, fake_app):
    """With origins configured, a browser's preflight is answered (before the key check) and replies, errors
    included, carry Access-Control-Allow-Origin for those origins only; without, no CORS headers at all."""
    origin = "http://localhost:3000"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}

    async def go(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        pre = await http.options("/v1/chat/completions", headers=preflight)
        other = await http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        ok = await http.get("/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
        denied = await http.get("/v1/models", headers={"Origin": origin})
        return pre, other, ok, denied

    on = create_app(fake, ServerConfig(api_keys=(KEY,), cors_origins=(origin, "https://app.example")))
    pre, other, ok, denied = run(go(on))
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in other.headers
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == origin

    pre, other, ok, _ = run(go(create_app(fake, ServerConfig(api_keys=(KEY,)))))
    assert pre.status_code != 200 and not any(h.startswith("access-control-") for h in pre.headers)
    assert "access-control-allow-origin" not in ok.headers
    assert run(go(create_app(fake, ServerConfig(cors_origins=("*",)))))[0].headers["access-control-allow-origin"] == "*"

    for bad in ("http://localhost:3000/", "localhost:3000", "null", ""):
        with pytest.raises(ValueError, match="origin"):
            ServerConfig(cors_origins=(bad,))


def test_serve_flags(monkeypatch, capsys):
    """`exl2 serve --cors-origin ... --no-reasoning-parser` reaches the app's ServerConfig; a bad origin is one
    line on stderr before anything loads."""
    import uvicorn as uv

    apps = []
    monkeypatch.setattr("exl2.engine.Engine", lambda config, progress=None: ThinkingEngine())
    monkeypatch.setattr(uv.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    argv = ["serve", "-m", str(SRC), "--device", "cpu", "--port", "0"]
    assert main(argv + ["--cors-origin", "http://a.example", "--cors_origin", "http://b.example:8080",
                        "--no-reasoning-parser"]) == 0
    assert main(argv) == 0
    flagged, plain = (a.state.exl2 for a in apps)
    assert flagged.config.cors_origins == ("http://a.example", "http://b.example:8080")
    assert plain.config.cors_origins == ()
    assert flagged.config.reasoning_parser is False and flagged.reasoning is False
    assert plain.config.reasoning_parser is None and plain.reasoning is True         # the template mentions <think>
    capsys.readouterr()
    assert main(argv + ["--cors-origin", "http://a.example/"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cors_origins" in err[0] and "http://a.example/" in err[0]


def test_min_tokens_ignore_eos_and_stop_token_ids(app, engine, fake_app, fake):
    """vLLM's stop_token_ids / min_tokens / ignore_eos and TabbyAPI's integer `stop` / ban_eos_token reach the
    engine and do there what the engine does with them; invalid values are 400s naming the field."""
    prompt = "The quick brown fox"
    full = reference(engine, prompt, 16)
    at = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    stop_id = full.token_ids[at]
    eos = next(iter(engine.tokenizer.eos_ids))
    pushy = {str(eos): 100}                   # EOS would be the greedy choice at every step

    async def go():
        c = aclient(app)

        async def complete(max_tokens=16, logit_bias=None, stop=None, **extra):
            r = await c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=max_tokens,
                                           logit_bias=logit_bias, stop=stop, extra_body=extra)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

        out = {"ids": await complete(stop_token_ids=[stop_id]), "tabby": await complete(stop=["@@", stop_id]),
               "min": await complete(stop_token_ids=[stop_id], min_tokens=at + 3),
               "eos": await complete(8, pushy), "ignore": await complete(8, pushy, ignore_eos=True),
               "ban": await complete(8, pushy, ban_eos_token=True), "eos_min": await complete(8, pushy, min_tokens=5)}
        errors = []
        for max_tokens, extra in ((16, dict(min_tokens=-1)), (4, dict(min_tokens=5)), (None, dict(min_tokens=17)),
                                  (16, dict(stop_token_ids=[10 ** 8])), (16, dict(stop=[-3]))):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=max_tokens, extra_body=extra)
            errors.append((e.value.body["param"], e.value.body["message"]))
        return out, errors

    out, errors = run(go())
    assert out["ids"] == out["tabby"] == (engine.tokenizer.decode(full.token_ids[:at]), "stop", at)
    late = engine.generator.generate(prompt, GREEDY, 16, stop_token_ids=[stop_id], min_new_tokens=at + 3)
    assert out["min"] == (late.text, late.finish_reason, len(late.token_ids)) and len(late.token_ids) >= at + 3
    assert out["eos"] == ("", "stop", 0)
    assert out["ignore"] == out["ban"] == (reference(engine, prompt, 8).text, "length", 8)
    assert out["eos_min"] == (reference(engine, prompt, 5).text, "stop", 5)
    assert [p for p, _ in errors] == ["min_tokens", "min_tokens", "min_tokens", "stop_token_ids", "stop"]
    assert errors[0][1] == "min_tokens must be 0 or more, not -1."
    assert errors[1][1] == "min_tokens (5) is more than max_tokens (4)."
    assert errors[2][1] == "min_tokens (17) is more than the default max_tokens (16)."
    assert "outside the model's vocabulary" in errors[3][1]

    fake.reply = "ok"
    c = aclient(fake_app)
    run(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=9, n=2,
                                  stop=["x", 7], extra_body=dict(stop_token_ids=[5], min_tokens=3, ignore_eos=True)))
    assert fake.ends[-2:] == [dict(stop_token_ids=[5, 7], min_new_tokens=3, ignore_eos=True)] * 2


def test_history_tool_call_arguments_render_as_mapping_and_as_text():
    """Templates iterate arguments (`|items`, `|tojson`) or, like DeepSeek's, join them into a string: both work
    with the arguments a client sends as a JSON string."""
    from exl2.server.messages import template_messages
    from exl2.server.schemas import ChatMessage

    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris", "n": 2}'}}]})
    joined = ChatTemplate("{% for m in messages %}{% for t in m.tool_calls %}"
                          "{{ '<args>' + t['function']['arguments'] + '</args>' }}{% endfor %}{% endfor %}")
    mapped = ChatTemplate("{% for m in messages %}{% for t in m.tool_calls %}{% for k, v in "
                          "t['function']['arguments'] | items %}{{ k }}={{ v }};{% endfor %}"
                          "{{ t['function']['arguments'] | tojson }}{% endfor %}{% endfor %}")
    history = template_messages([msg])
    assert joined.render(history, add_generation_prompt=False) == '<args>{"city": "Paris", "n": 2}</args>'
    assert mapped.render(history, add_generation_prompt=False) == 'city=Paris;n=2;{"city": "Paris", "n": 2}'


# ---- model management (TabbyAPI's /v1/model/list, /load, /unload) -------------------------------------------------

ADMIN = "sk-admin-key"
GOLDEN = SRC.parent        # src, b3.0_hb6, b4.0_hb6, b6.0_hb6 and measurement.json


class LoadedFake(FakeEngine):
    """A FakeEngine as the patched build_engine makes it: named after its directory, replying with its name,
    recording when the server closes it."""

    def __init__(self, config: EngineConfig, reply: str | None = None):
        super().__init__()
        self.config = config
        self.reply = reply or f"reply of {self.model_name}"
        self.released = threading.Event()

    @property
    def model_name(self):
        return config_dir(self.config).name

    def close(self):
        self.released.set()


class SlowFake(LoadedFake):
    """Streams its reply a piece every 50 ms, so a request is still running when the model is swapped."""

    async def aevent_stream(self, prompt, settings=None, max_new_tokens=256, stop_strings=(), add_bos=None,
                            grammar=None, logprobs=None, **ends):
        self.opened += 1
        pieces = self.reply.split(" ")
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0.05)
            yield Event(None, piece + (" " if i < len(pieces) - 1 else ""))
        yield Event(None, "", GenerationResult(self.reply, list(range(len(pieces))), "stop", 5))


def config_dir(config: EngineConfig):
    return Path(config.model_dir)


@pytest.fixture
def models_root(tmp_path):
    """alpha, beta and broken are models (config.json); notes is a directory without one, .hidden is hidden."""
    root = tmp_path / "models"
    for name in ("alpha", "beta", "broken", ".hidden"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
    (root / "notes").mkdir()
    (root / "readme.txt").write_text("not a model")
    return root


@pytest.fixture
def built(monkeypatch):
    """The engines loads build (fakes); loading 'broken' fails as an unsupported architecture does. Set
    `built.gate` (a threading.Event) to hold builds until it is set."""
    from exl2.errors import ConfigError

    class Built(list):
        gate: threading.Event | None = None
        layers = 0  # progress reports a build makes ("model", i, layers), as Engine's loader does per layer

    engines = Built()

    def build(config, progress=None):
        if engines.gate is not None:
            assert engines.gate.wait(10)
        if config_dir(config).name == "broken":
            raise ConfigError("Architecture 'BrokenForCausalLM' is not supported; supported architectures are: ...")
        for i in range(engines.layers):
            if progress is not None:
                progress("model", i + 1, engines.layers)
        if config_dir(config).name == "torn":
            raise ConfigError("Tensor 'model.layers.1.mlp.up_proj.q_weight' is cut short; the file is damaged.")
        engines.append(LoadedFake(config))
        return engines[-1]

    monkeypatch.setattr("exl2.server.admin.build_engine", build)
    return engines


def mgmt_app(root, engine=None, **config):
    config.setdefault("api_keys", (KEY,))
    config.setdefault("admin_keys", (ADMIN,))
    return create_app(engine, ServerConfig(model_dir_root=root, **config))


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def as_admin(key=ADMIN) -> dict:
    return {"Authorization": f"Bearer {key}"}


def load_events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


async def complete(client, key=KEY, **body):
    return await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"prompt": "hi", "max_tokens": 8, **body})


def test_model_list_filters_and_load_rejects_escaping_names(models_root, built):
    start = LoadedFake(EngineConfig(model_dir="start", max_seq_len=512))
    app = mgmt_app(models_root, start)

    async def go():
        c = http(app)
        listed = (await c.get("/v1/model/list", headers={"x-api-key": KEY})).json()
        assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["alpha", "beta", "broken"]
        assert all(m["object"] == "model" and m["owned_by"] == "exl2" and isinstance(m["created"], int)
                   for m in listed["data"])
        assert (await c.get("/v1/model/draft/list", headers=as_admin())).json() == listed
        assert (await c.get("/v1/model/list")).status_code == 401
        assert [m["id"] for m in (await c.get("/v1/models", headers=as_admin())).json()["data"]] == ["start"]

        for bad in ("../alpha", "..", ".", "/etc", str(models_root / "alpha"), "alpha/../beta", "a\\b", "C:x",
                    ".hidden", ""):
            r = await c.post("/v1/model/load", headers=as_admin(), json={"model_name": bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_model_name", (bad, r.text)
            assert r.json()["error"]["param"] == "model_name"
        r = await c.post("/v1/model/load", headers=as_admin(),
                         json={"name": "alpha", "draft_model": {"draft_model_name": "../beta"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_model.draft_model_name"
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "missing"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "missing" in r.json()["error"]["message"]
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "notes"})
        assert r.status_code == 400 and "config.json" in r.json()["error"]["message"]
        assert built == [] and (await complete(c)).json()["choices"][0]["text"] == "reply of start"

    run(go())
    with pytest.raises(ValueError, match="does not exist"):
        ServerConfig(model_dir_root=models_root / "nope")
    with pytest.raises(ValueError, match="not a directory"):
        ServerConfig(model_dir_root=models_root / "readme.txt")
    with pytest.raises(ValueError, match="admin_keys"):
        ServerConfig(admin_keys=(" ",))


def test_load_streams_progress_events_and_reports_a_late_failure_in_the_stream(models_root, built):
    """TabbyAPI's load reply: a "processing" event per module as the loader reports it, then "finished". A load
    that fails after its first layer (the status line is sent by then) ends the stream with the error object,
    and the model served before keeps serving."""
    (models_root / "torn").mkdir()
    (models_root / "torn" / "config.json").write_text("{}")
    built.layers = 3
    app = mgmt_app(models_root, LoadedFake(EngineConfig(model_dir="start", device="cpu")))

    async def go():
        c = http(app)
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "beta"})
        assert load_events(r) == [{"model_type": "model", "module": i, "modules": 3, "status": "processing"}
                                  for i in (1, 2, 3)] + [
            {"model_type": "model", "module": 1, "modules": 1, "status": "finished"}]
        assert (await complete(c)).json()["choices"][0]["text"] == "reply of beta"
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "torn"})
        events = load_events(r)
        assert [e["module"] for e in events[:-1]] == [1, 2, 3]
        assert events[-1]["error"]["code"] == "model_load_failed"
        assert events[-1]["error"]["message"].startswith("Tensor 'model.layers.1.mlp.up_proj.q_weight' is cut")
        assert (await complete(c)).json()["choices"][0]["text"] == "reply of beta"
        r = await c.post("/v1/model/load", headers=as_admin(), json={"model_name": "broken"})  # before any layer
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed"

    run(go())


def test_load_swaps_the_engine_and_a_failed_load_keeps_the_old_one(models_root, built):
    start = LoadedFake(EngineConfig(model_dir="start", max_seq_len=512, device="cpu", max_batch_size=4))
    app = mgmt_app(models_root, start)

    async def go():
        c = http(app)
        assert (await complete(c)).json()["choices"][0]["text"] == "reply of start"
        # as SillyTavern's TabbyAPI loader sends it: `name`, numbers as strings, TabbyAPI's neutral values
        r = await c.post("/v1/model/load", headers={"x-admin-key": ADMIN}, json={
            "name": "beta", "max_seq_len": "1024", "cache_mode": "Q4", "rope_scale": "1.0", "rope_alpha": 1.0,
            "gpu_split_auto": True, "fasttensors": True, "skip_queue": False})
        assert load_events(r) == [{"model_type": "model", "module": 1, "modules": 1, "status": "finished"}]
        beta = built[-1]
        cfg = beta.config
        assert config_dir(cfg) == models_root / "beta" and cfg.max_seq_len == 1024 and cfg.kv_cache_mode == "q4"
        assert cfg.rope_scale is None and cfg.rope_alpha is None and cfg.gpu_split is None
        assert cfg.device == "cpu" and cfg.max_batch_size == 4        # inherited from the model served before
        out = (await complete(c)).json()
        assert out["choices"][0]["text"] == "reply of beta" and out["model"] == "beta"
        assert [m["id"] for m in (await c.get("/v1/models", headers=as_admin())).json()["data"]] == ["beta"]
        assert (await c.get("/v1/model", headers=as_admin())).json()["parameters"]["cache_mode"] == "q4"
        assert (await c.get("/health")).json() == {"status": "ok", "model": "beta", "loading": None}
        assert wait_until(start.released.is_set), "the replaced engine was not closed"

        r = await c.post("/v1/model/load", headers=as_admin(), json={"model_name": "broken"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "model_load_failed"
        assert err["message"].startswith("Architecture 'BrokenForCausalLM' is not supported")
        assert (await complete(c)).json()["choices"][0]["text"] == "reply of beta"
        assert not beta.released.is_set() and (await c.get("/health")).json()["model"] == "beta"

        # the same model with the same settings again: nothing is rebuilt
        n = len(built)
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "beta", "max_seq_len": 1024,
                                                                      "cache_mode": "q4"})
        assert load_events(r)[-1]["status"] == "finished" and len(built) == n and built[-1] is beta

        r = await c.post("/v1/model/load", headers=as_admin(), json={
            "model_name": "alpha", "draft_model": {"draft_model_name": "beta", "draft_num_tokens": 3}})
        assert [e["model_type"] for e in load_events(r)] == ["draft", "model"]
        cfg = built[-1].config
        assert config_dir(cfg) == models_root / "alpha" and cfg.draft_model_dir == models_root / "beta"
        assert cfg.num_draft_tokens == 3 and cfg.max_seq_len == 512      # the first model's, as given
        assert cfg.draft_rope_alpha is None                               # not asked for: the draft's own (or NTK)
        assert wait_until(beta.released.is_set)
        r = await c.post("/v1/model/load", headers=as_admin(), json={
            "model_name": "alpha", "draft_model": {"draft_model_name": "beta", "draft_rope_alpha": 2.5,
                                                  "draft_rope_scale": 1.0}})
        assert r.status_code == 200, r.text
        assert built[-1].config.draft_rope_alpha == 2.5
        assert built[-1].config.draft_rope_scale is None
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha", "num_experts_per_token": 1})
        assert r.status_code == 200, r.text
        assert built[-1].config.experts_per_token == 1
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha", "chunk_size": 512})
        assert r.status_code == 200, r.text
        assert built[-1].config.chunk_size == 512
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha", "prompt_template": "chatml"})
        assert r.status_code == 200, r.text
        assert built[-1].config.prompt_template == "chatml"     # bundled: the engine resolves it

        for body, param in (({"max_seq_len": 100}, "max_seq_len"), ({"cache_mode": "FP8"}, "cache_mode"),
                            ({"vision": True}, "vision"),
                            ({"num_experts_per_token": 0}, "num_experts_per_token"),
                            ({"chunk_size": 64}, "chunk_size"),
                            ({"draft": {"draft_model_name": "beta", "draft_rope_alpha": -2.0}},
                             "draft_model.draft_rope_alpha"),
                            ({"max_seq_len": 2048, "cache_size": 1024}, None)):
            r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "beta", **body})
            assert r.status_code == 400, (body, r.text)
            assert param is None or r.json()["error"]["param"] == param, (body, r.json())
        assert (await complete(c)).json()["choices"][0]["text"] == "reply of alpha"

    run(go())


def test_loads_inherit_vision_where_the_model_has_a_tower(models_root, built):
    """A server started with --vision (its engine's config) loads later models with their vision tower where they
    have one and as text models where not; a request asking for vision on a text model is a 400."""
    (models_root / "eye").mkdir()
    (models_root / "eye" / "config.json").write_text('{"vision_config": {"model_type": "pixtral"}}')
    app = mgmt_app(models_root, LoadedFake(EngineConfig(model_dir="start", device="cpu", vision=True)))

    async def go():
        c = http(app)
        got = []
        for body in ({"name": "eye"}, {"name": "alpha"}, {"name": "eye", "vision": False}):
            r = await c.post("/v1/model/load", headers=as_admin(), json=body)
            assert r.status_code == 200, r.text
            got.append(built[-1].config.vision)
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha", "vision": True})
        return got, r

    got, refused = run(go())
    assert got == [True, False, False]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "vision"


def test_load_past_the_native_context_gets_tabbyapis_automatic_rope_alpha(models_root, built):
    """TabbyAPI's rope_alpha "auto" (also what a request without RoPE settings gets): a max_seq_len past the
    model's context, or past override_base_seq_len, loads with the NTK alpha for the ratio; RoPE settings of the
    request win; within the native context nothing changes."""
    from tiny_models import ARCHS

    from exl2.models.rope import ntk_alpha

    cfg = ARCHS["llama"]()                                                                  # 256 positions
    cfg.architectures = ["LlamaForCausalLM"]
    (models_root / "alpha" / "config.json").write_text(cfg.to_json_string())
    app = mgmt_app(models_root, LoadedFake(EngineConfig(model_dir="start", max_seq_len=512, device="cpu")))

    async def go():
        c = http(app)
        for body, alpha in (({"max_seq_len": 1024}, ntk_alpha(4.0)),
                            ({"max_seq_len": 1024, "rope_alpha": "auto"}, ntk_alpha(4.0)),
                            ({"max_seq_len": 1024, "override_base_seq_len": 512}, ntk_alpha(2.0)),
                            ({"max_seq_len": 1024, "rope_alpha": 1.5}, 1.5),
                            ({"max_seq_len": 1024, "rope_scale": 4.0}, None),
                            ({"max_seq_len": 512, "override_base_seq_len": 512}, None)):
            r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha", **body})
            assert r.status_code == 200, (body, r.text)
            got = built[-1].config.rope_alpha
            assert got == (None if alpha is None else pytest.approx(alpha, abs=1e-4)), (body, got)
        r = await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha", "override_base_seq_len": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "override_base_seq_len", r.text

    run(go())


def test_inline_model_loading(models_root, built):
    """A request naming another model of the root loads it first (with the load defaults) and is answered by it;
    names that are no model of the root (a client's default, a path) are answered by the loaded model; a model
    that fails to load is a 400; /v1/models lists every model; off by default."""
    start = LoadedFake(EngineConfig(model_dir="start", max_seq_len=512, device="cpu"))
    app = mgmt_app(models_root, start, inline_model_loading=True)

    async def go():
        c = http(app)

        async def complete_as(model):
            return await c.post("/v1/completions", headers=as_admin(KEY), json={"prompt": "hi", "model": model})

        ids = [m["id"] for m in (await c.get("/v1/models", headers=as_admin(KEY))).json()["data"]]
        assert ids == ["start", "alpha", "beta", "broken"]
        r = await complete_as("beta")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "reply of beta", r.text
        assert config_dir(built[-1].config) == models_root / "beta" and built[-1].config.max_seq_len == 512
        n = len(built)
        for other in ("gpt-4o", "../alpha", "notes", "beta"):
            r = await complete_as(other)
            assert r.json()["choices"][0]["text"] == "reply of beta" and len(built) == n, other
        r = await c.post("/v1/chat/completions", headers=as_admin(KEY), json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "reply of alpha", r.text
        r = await complete_as("broken")
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed", r.text
        assert (await complete_as("x")).json()["choices"][0]["text"] == "reply of alpha"

        plain = http(mgmt_app(models_root, LoadedFake(EngineConfig(model_dir="start", max_seq_len=512))))
        r = await plain.post("/v1/completions", headers=as_admin(KEY), json={"prompt": "hi", "model": "beta"})
        assert r.json()["choices"][0]["text"] == "reply of start"
        assert [m["id"] for m in (await plain.get("/v1/models", headers=as_admin(KEY))).json()["data"]] == ["start"]

    run(go())
    with pytest.raises(ValueError, match="inline_model_loading"):
        ServerConfig(inline_model_loading=True)


@pytest.mark.parametrize("interval", [0.02, 0.0])
def test_streams_send_keep_alive_pings_at_the_configured_interval(interval):
    """sse_ping_interval: a stream that waits between its pieces (50 ms each here) carries `: ping` comments every
    `interval` seconds, and none with 0; the data is the same either way."""
    slow = SlowFake(EngineConfig(model_dir="slow", max_seq_len=512), reply="a b c d e f")
    with serving(create_app(slow, ServerConfig(sse_ping_interval=interval))) as base:
        with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            lines = list(r.iter_lines())
    pings = [line for line in lines if line.startswith(": ping")]
    assert (len(pings) >= 3) if interval else not pings
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines
             if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(texts) == "a b c d e f"


def test_requests_wait_for_a_load_and_running_ones_finish_on_the_old_engine(models_root, built):
    """While a load runs, the old model streams on; a request arriving then waits and is served by the new
    model; the old engine is closed only after its last request ended."""
    old = SlowFake(EngineConfig(model_dir="old", max_seq_len=512), reply=" ".join(f"w{i}" for i in range(40)))
    app = mgmt_app(models_root, old)
    built.gate = threading.Event()
    with serving(app) as base:
        results = {}

        def stream_on_old():
            results["stream"] = sse_data(base, "/v1/completions", {"prompt": "hi", "stream": True})

        def load():
            results["load"] = httpx.post(f"{base}/v1/model/load", headers=as_admin(), json={"name": "beta"},
                                         timeout=20)

        def later():
            results["later"] = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                          json={"prompt": "hi"}, timeout=20)

        streaming = threading.Thread(target=stream_on_old)
        streaming.start()
        assert wait_until(lambda: old.opened == 1)
        loading = threading.Thread(target=load)
        loading.start()
        assert wait_until(lambda: app.state.exl2_host.loading == "beta")
        health = httpx.get(f"{base}/health").json()
        assert health == {"status": "ok", "model": "old", "loading": "beta"}
        second = httpx.post(f"{base}/v1/model/load", headers=as_admin(), json={"name": "alpha"})
        assert second.status_code == 409 and "beta" in second.json()["error"]["message"]
        waiting = threading.Thread(target=later)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and "later" not in results       # held until the load ends
        built.gate.set()
        loading.join(20)
        waiting.join(20)
        assert streaming.is_alive() and not old.released.is_set()     # swapped, yet the old one still streams
        streaming.join(20)
        assert load_events(results["load"])[-1]["status"] == "finished"
        assert results["later"].json()["choices"][0]["text"] == "reply of beta"
        chunks = [json.loads(d) for d in results["stream"][:-1]]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == old.reply
        assert {ch["model"] for ch in chunks} == {"old"}
        assert wait_until(old.released.is_set)


def test_unload_then_generation_answers_503(models_root, built):
    start = LoadedFake(EngineConfig(model_dir="start", max_seq_len=512))
    app = mgmt_app(models_root, start)
    no_model = "No model is loaded; load one with POST /v1/model/load."

    async def go():
        c = http(app)
        r = await c.post("/v1/model/unload", headers=as_admin())
        assert r.status_code == 200 and r.json() == {"status": "unloaded", "model": "start", "running_requests": 0}
        assert start.released.is_set()                      # nothing was running: closed before the reply
        r = await complete(c)
        assert r.status_code == 503 and r.json()["error"]["message"] == no_model
        assert r.json()["error"]["code"] == "model_not_loaded"
        r = await c.post("/v1/chat/completions", headers=as_admin(KEY),
                         json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["message"] == no_model
        assert (await c.post("/v1/token/encode", headers=as_admin(KEY), json={"text": "hi"})).status_code == 503
        assert (await c.get("/v1/model", headers=as_admin(KEY))).status_code == 503
        assert (await c.get("/v1/models", headers=as_admin(KEY))).json() == {"object": "list", "data": []}
        assert (await c.get("/v1/models/start", headers=as_admin(KEY))).status_code == 404
        assert (await c.get("/health")).json() == {"status": "ok", "model": None, "loading": None}
        assert (await complete(c, key="sk-wrong")).status_code == 401         # the key check still comes first
        r = await c.post("/v1/model/unload", headers=as_admin())
        assert r.status_code == 200 and r.json()["model"] is None
        assert load_events(await c.post("/v1/model/load", headers=as_admin(), json={"name": "alpha"}))
        assert (await complete(c)).json()["choices"][0]["text"] == "reply of alpha"

    run(go())


def test_admin_key_rules(models_root, built):
    async def status(app, path="/v1/model/load", headers=None, body=None):
        r = await http(app).post(path, headers=headers or {}, json=body if body is not None else {"name": "alpha"})
        return r.status_code, r.json().get("error", {}).get("code") if r.status_code >= 400 else None

    async def go():
        both = mgmt_app(models_root)
        assert await status(both) == (401, "invalid_api_key")
        assert await status(both, headers=as_admin(KEY)) == (403, "admin_key_required")
        assert await status(both, headers=as_admin("sk-wrong")) == (401, "invalid_api_key")
        assert await status(both, headers={"x-api-key": ADMIN}) == (200, None)
        assert await status(both, "/v1/model/unload", {"x-admin-key": KEY}) == (403, "admin_key_required")
        assert await status(both, "/v1/model/unload", as_admin()) == (200, None)
        c = http(both)
        assert (await c.get("/v1/models", headers=as_admin())).status_code == 200     # an admin key is an API key
        assert (await c.get("/v1/auth/permission", headers=as_admin())).json() == {"permission": "admin"}
        assert (await c.get("/v1/auth/permission", headers=as_admin(KEY))).json() == {"permission": "api"}
        assert (await c.get("/v1/auth/permission")).status_code == 401

        api_only = mgmt_app(models_root, admin_keys=())
        assert await status(api_only, headers=as_admin(KEY)) == (403, "admin_disabled")
        assert await status(api_only, "/v1/model/unload", as_admin(KEY)) == (403, "admin_disabled")
        assert await status(api_only) == (401, "invalid_api_key")

        admin_only = mgmt_app(models_root, api_keys=())
        assert await status(admin_only) == (401, "invalid_api_key")
        assert await status(admin_only, headers=as_admin("sk-wrong")) == (401, "invalid_api_key")
        assert await status(admin_only, headers=as_admin()) == (200, None)
        assert (await complete(http(admin_only), key="anything")).status_code == 200   # the API needs no key

        open_ = mgmt_app(models_root, api_keys=(), admin_keys=())       # local single-user use: no keys at all
        assert await status(open_) == (200, None)
        assert await status(open_, "/v1/model/unload", {"Origin": "http://test"}, {}) == (200, None)   # same origin
        assert await status(open_, "/v1/model/unload", {"Origin": "https://evil.example"}, {}) \
            == (403, "origin_not_allowed")
        allowed = mgmt_app(models_root, api_keys=(), admin_keys=(), cors_origins=("http://localhost:8000",))
        assert await status(allowed, headers={"Origin": "http://localhost:8000"}) == (200, None)

    run(go())


def test_real_load_and_unload_through_the_engine(engine):
    """The golden directory as the model root: a server started empty loads the tiny model through the real
    Engine (greedy text as the engine itself gives) and unloading stops its generator thread."""
    from exl2.errors import Exl2Error

    app = create_app(None, ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), model_dir_root=GOLDEN),
                     load_defaults={"device": "cpu"})

    async def go():
        c = http(app)
        assert (await c.get("/health")).json()["model"] is None
        assert (await complete(c)).status_code == 503
        ids = [m["id"] for m in (await c.get("/v1/model/list", headers=as_admin(KEY))).json()["data"]]
        assert ids == ["b3.0_hb6", "b4.0_hb6", "b6.0_hb6", "src"]
        r = await c.post("/v1/model/load", headers=as_admin(), json={"model_name": "src", "max_seq_len": 512})
        assert load_events(r)[-1] == {"model_type": "model", "module": 1, "modules": 1, "status": "finished"}
        served = app.state.exl2.engine
        assert served.model_name == "src" and served.config.device == "cpu"
        out = (await complete(c, prompt="The capital of France is", max_tokens=12, temperature=0)).json()
        assert out["model"] == "src"
        assert out["choices"][0]["text"] == reference(engine, "The capital of France is", 12).text
        thread = served.worker._thread
        assert thread.is_alive()
        assert (await c.post("/v1/model/unload", headers=as_admin())).json()["model"] == "src"
        assert not thread.is_alive()
        with pytest.raises(Exl2Error, match="closed"):
            served.generate("x")
        assert (await complete(c)).status_code == 503

    run(go())


def test_serve_with_a_model_root_and_no_model(monkeypatch, capsys, tmp_path):
    """`exl2 serve --model-dir-root DIR` without -m starts with no model; its flags become load defaults."""
    import uvicorn as uv

    apps = []
    monkeypatch.setattr(uv.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    assert main(["serve", "--model-dir-root", str(GOLDEN), "--device", "cpu", "--port", "0", "-l", "1024",
                 "--admin-key", ADMIN, "--admin_key", "sk-admin-2", "-cm", "q8", "--chunk-size", "512", "-ng",
                 "--max-draft-batch", "2"]) == 0
    assert "Serving no model yet" in capsys.readouterr().err
    app = apps[-1]
    h = app.state.exl2_host
    assert app.state.exl2 is None and h.config.admin_keys == (ADMIN, "sk-admin-2")
    assert h.config.model_dir_root == GOLDEN
    assert h.load_defaults["device"] == "cpu" and h.load_defaults["max_seq_len"] == 1024
    assert h.load_defaults["kv_cache_mode"] == "q8"
    assert h.load_defaults["chunk_size"] == 512 and h.load_defaults["cuda_graphs"] is False
    assert h.load_defaults["max_draft_batch"] == 2

    async def go():
        c = http(app)
        return (await c.get("/health")).json(), (await complete(c)).status_code

    assert run(go()) == ({"status": "ok", "model": None, "loading": None}, 503)

    monkeypatch.setenv("EXL2_ADMIN_KEY", "env-admin, other")
    assert main(["serve", "--model-dir-root", str(GOLDEN), "--port", "0"]) == 0
    assert apps[-1].state.exl2_host.config.admin_keys == ("env-admin", "other")
    capsys.readouterr()
    for argv, words in ((["--model-dir-root", str(tmp_path / "none")], ("model_dir_root", "does not exist")),
                        (["--model-dir-root", str(GOLDEN), "-dm", str(SRC)], ("--draft_model_dir", "load"))):
        assert main(["serve", "--port", "0", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


def test_engine_close_lets_the_running_request_finish(engine):
    """Engine.close() (what an unload or swap calls) lets a job in flight end, then stops the generator thread;
    the engine then refuses work with one sentence."""
    from exl2.errors import Exl2Error

    own = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))
    pieces = own.stream("The capital of France is", GREEDY, 16)
    first = next(pieces)
    thread = own.worker._thread
    own.close()
    assert not thread.is_alive()
    assert first + "".join(pieces) == reference(engine, "The capital of France is", 16).text
    with pytest.raises(Exl2Error, match="closed"):
        own.generate("again")
    own.close()                                     # a second close does nothing


# ---- TabbyAPI's further samplers --------------------------------------------------------------------------------

def refused_on_both_endpoints(c, extras: list[dict]) -> list[dict]:
    """Each extra body sent to chat completions, then to completions, each answered with a 400: the error bodies
    in that order."""
    hi = [{"role": "user", "content": "hi"}]

    async def go():
        out = []
        for extra in extras:
            for create in (lambda: c.chat.completions.create(model="m", messages=hi, max_tokens=2, extra_body=extra),
                           lambda: c.completions.create(model="m", prompt="x", max_tokens=2, extra_body=extra)):
                with pytest.raises(openai.BadRequestError) as e:
                    await create()
                out.append(e.value.body)
        return out

    return run(go())


class SettingsFake(FakeEngine):
    """A fake engine that keeps the SamplingSettings each stream gets."""

    def __init__(self):
        super().__init__()
        self.reply = "ok"
        self.settings: list[SamplingSettings] = []

    async def aevent_stream(self, prompt, settings=None, *args, **kwargs):
        self.settings.append(settings)
        async for event in super().aevent_stream(prompt, settings, *args, **kwargs):
            yield event


def test_tabby_samplers_reach_the_engine():
    """Every TabbyAPI sampler field, by its name or its alias, arrives in SamplingSettings; TabbyAPI's 0 for DRY's
    base and allowed length means the engine's default."""
    fake = SettingsFake()
    c = aclient(create_app(fake, ServerConfig()))
    hi = [{"role": "user", "content": "hi"}]
    fields = dict(top_a=0.2, tfs=0.9, typical_p=0.8, smoothing_factor=0.3, temperature_last=True, dynatemp_low=0.5,
                  dynatemp_high=1.5, dynatemp_exponent=2.0, xtc_probability=0.4, xtc_threshold=0.2,
                  dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, dry_penalty_last_n=64,
                  dry_sequence_breakers=["\n", ":"], mirostat=2, mirostat_tau=4.0, mirostat_eta=0.2, skew=0.5,
                  dry_max_ngram=6, xtc_ignore_tokens=[3, 9])
    canonical = dict(fields, typical=0.8, min_temp=0.5, max_temp=1.5, temp_exponent=2.0, dry_range=64,
                     mirostat_mode=2, mirostat_tau=5.0, mirostat_eta=0.25)
    for key in ("typical_p", "dynatemp_low", "dynatemp_high", "dynatemp_exponent", "dry_penalty_last_n", "mirostat"):
        del canonical[key]

    async def go():
        await c.chat.completions.create(model="m", messages=hi, max_tokens=4, extra_body=fields)
        await c.completions.create(model="m", prompt="x", max_tokens=4, extra_body=canonical)
        await c.chat.completions.create(model="m", messages=hi, max_tokens=4)
        for breakers in ('["\\n", ":"]', "\n,:", '"\\n", ":"', "a, b,,c", "", []):
            await c.chat.completions.create(model="m", messages=hi, max_tokens=4,
                                            extra_body=dict(dry_multiplier=1.0, dry_sequence_breakers=breakers))

    run(go())
    via_alias, by_name, default = fake.settings[:3]
    expected = dict(top_a=0.2, tfs=0.9, typical=0.8, smoothing_factor=0.3, temperature_last=True, min_temp=0.5,
                    max_temp=1.5, temp_exponent=2.0, xtc_probability=0.4, xtc_threshold=0.2, dry_multiplier=0.8,
                    dry_base=2.0, dry_allowed_length=3, dry_range=64, dry_sequence_breakers=("\n", ":"),
                    mirostat_mode=2, mirostat_tau=4.0, mirostat_eta=0.2, skew=0.5, dry_max_ngram=6,
                    xtc_ignore_tokens=(3, 9))
    assert {k: getattr(via_alias, k) for k in expected} == expected
    assert {k: getattr(by_name, k) for k in expected} == dict(expected, mirostat_tau=5.0, mirostat_eta=0.25)
    assert via_alias.dynamic_temperature and via_alias.dry and via_alias.mirostat
    engine_default = SamplingSettings()
    for k in expected:
        if k != "mirostat_eta":       # TabbyAPI's default (0.3) differs from the engine's
            assert getattr(default, k) == getattr(engine_default, k), k
    assert default.mirostat_eta == 0.3 and default.dry_base == 1.75 and default.dry_allowed_length == 2
    assert [s.dry_sequence_breakers for s in fake.settings[3:]] == [
        ("\n", ":"), ("\n", ":"), ("\n", ":"), ("a", "b", "c"), None, None]


def test_tabby_sampler_values_the_engine_cannot_take_are_400s():
    """An out-of-range value, Mirostat 1 and a malformed breaker list are 400s naming the field."""
    fake = SettingsFake()
    c = aclient(create_app(fake, ServerConfig()))
    cases = [(dict(mirostat=1), "mirostat_mode", "Only Mirostat 2 is supported"),
             (dict(mirostat_mode=1), "mirostat_mode", "Only Mirostat 2 is supported"),
             (dict(skew=11), "skew", "less than or equal to 10"),
             (dict(xtc_probability=2), "xtc_probability", "less than or equal to 1"),
             (dict(typical_p=-0.1), "typical_p", "greater than or equal to 0"),
             (dict(dynatemp_high=11), "dynatemp_high", "less than or equal to 10"),
             (dict(mirostat_tau=0), "mirostat_tau", "greater than 0"),
             (dict(dry_base=0.5), "dry_base", "greater than or equal to 1"),            # the engine's bound
             (dict(dry_sequence_breakers=["a", ""]), "dry_sequence_breakers", "empty strings"),
             (dict(dry_sequence_breakers="[1, 2]"), "dry_sequence_breakers", "JSON list of strings"),
             (dict(dry_sequence_breakers="[oops"), "dry_sequence_breakers", "JSON list of strings")]

    bodies = refused_on_both_endpoints(c, [extra for extra, _, _ in cases])
    for i, (_, param, words) in enumerate(cases):
        for body in bodies[2 * i:2 * i + 2]:
            assert body["param"] == param and words in body["message"], body
            assert param.split("_")[0] in body["message"] and body["message"].count(". ") == 0, body
    assert fake.settings == []


# ---- TabbyAPI's token lists, structured-output fields, usage timings, generation prompt and prefix ------------------

def test_token_lists_reach_the_engine(app, engine):
    """banned_tokens / allowed_tokens, by their names or TabbyAPI's aliases, as lists or comma-separated strings,
    arrive in SamplingSettings; on the real model an allowed token is the only one sampled, a banned one never."""
    fake = SettingsFake()
    fake.model.spec.vocab_size = 100
    c = aclient(create_app(fake, ServerConfig()))
    hi = [{"role": "user", "content": "hi"}]

    async def go():
        await c.chat.completions.create(model="m", messages=hi, max_tokens=4,
                                        extra_body=dict(banned_tokens=[1, 2], allowed_tokens="3, 4,5"))
        await c.completions.create(model="m", prompt="x", max_tokens=4,
                                   extra_body=dict(custom_token_bans="7,8", allowed_token_ids=[9]))
        await c.chat.completions.create(model="m", messages=hi, max_tokens=4,
                                        extra_body=dict(banned_tokens="", allowed_tokens=[]))

    run(go())
    assert [(s.banned_tokens, s.allowed_tokens) for s in fake.settings] == [
        ((1, 2), (3, 4, 5)), ((7, 8), (9,)), (None, None)]

    prompt = engine.chat_prompt([{"role": "user", "content": "Say something."}])
    ref = reference(engine, prompt, 4, add_bos=False)
    token = engine.tokenizer.encode(" yes", add_bos=False)[0]

    async def real():
        rc = aclient(app)
        only = await rc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say something."}],
                                                temperature=0, max_tokens=4, extra_body=dict(allowed_tokens=[token]))
        banned = await rc.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say something."}], temperature=0, max_tokens=4,
            extra_body=dict(custom_token_bans=",".join(str(t) for t in ref.token_ids)))
        return only, banned

    only, banned = run(real())
    assert only.choices[0].message.content == engine.tokenizer.decode([token] * 4)
    want = engine.generator.generate(prompt, SamplingSettings(temperature=0, banned_tokens=tuple(ref.token_ids)), 4,
                                     add_bos=False)
    assert banned.choices[0].message.content == want.text and not set(want.token_ids) & set(ref.token_ids)


def test_token_lists_that_are_not_token_ids_are_400s(app):
    """An id outside the vocabulary, a negative one or an item that is not an integer is a 400 naming the field."""
    cases = [(dict(banned_tokens=[10 ** 8]), "banned_tokens", "outside the model's vocabulary"),
             (dict(allowed_tokens="1,-2"), "allowed_tokens", "outside the model's vocabulary"),
             (dict(allowed_tokens="1,x"), "allowed_tokens", "comma-separated integers"),
             (dict(banned_tokens=[1, "a"]), "banned_tokens", "integer"),
             (dict(banned_tokens=[1.5]), "banned_tokens", "integer"),
             (dict(allowed_token_ids=[True]), "allowed_token_ids", "integer")]

    bodies = refused_on_both_endpoints(aclient(app), [extra for extra, _, _ in cases])
    for i, (_, param, words) in enumerate(cases):
        for body in bodies[2 * i:2 * i + 2]:
            assert body["param"] == param and words in body["message"], body


def test_tabby_structured_output_fields(url):
    """regex_pattern, grammar_string (Lark) and a top-level json_schema hold the real model's reply, streamed or
    not, on both endpoints; an invalid one is a 400 naming the field."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    hi = [{"role": "user", "content": "Answer."}]
    for seed in (1, 2):
        r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=12, temperature=1.0, seed=seed,
                                      extra_body=dict(regex_pattern="[0-9]{3}"))
        assert re.fullmatch("[0-9]{3}", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
        r = c.completions.create(model="tiny", prompt="Answer:", max_tokens=12, temperature=1.0, seed=seed,
                                 extra_body=dict(grammar_string='start: "yes" | "no"'))
        assert r.choices[0].text in {"yes", "no"} and r.choices[0].finish_reason == "stop"
    parts = c.chat.completions.create(model="tiny", messages=hi, max_tokens=12, temperature=1.0, seed=3, stream=True,
                                      extra_body=dict(grammar_string='start: "yes" | "no"'))
    assert "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices) in {"yes", "no"}
    parts = c.completions.create(model="tiny", prompt="Code:", max_tokens=12, temperature=1.0, seed=4, stream=True,
                                 extra_body=dict(regex_pattern="[a-c]{2}-[0-9]"))
    assert re.fullmatch("[a-c]{2}-[0-9]", "".join(ch.choices[0].text for ch in parts if ch.choices))

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}}}
    r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=120, temperature=1.0, seed=5,
                                  extra_body=dict(json_schema=schema))
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "days"} and isinstance(value["days"], int) and len(value["city"]) <= 10
    same = c.chat.completions.create(model="tiny", messages=hi, max_tokens=120, temperature=1.0, seed=5,
                                     response_format={"type": "json_schema", "json_schema": {"name": "t",
                                                                                             "schema": schema}})
    assert same.choices[0].message.content == r.choices[0].message.content
    free = c.chat.completions.create(model="tiny", messages=hi, max_tokens=4, temperature=0,
                                     extra_body=dict(regex_pattern="", grammar_string="", json_schema={}))
    plain = c.chat.completions.create(model="tiny", messages=hi, max_tokens=4, temperature=0)
    assert free.choices[0].message.content == plain.choices[0].message.content      # empty: not given

    invalid = [(dict(regex_pattern="[0-9"), "regex_pattern"), (dict(grammar_string="start: foo"), "grammar_string"),
               (dict(json_schema={"type": "nonsense"}), "json_schema"), (dict(json_schema=[1]), "json_schema")]
    for extra, param in invalid:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=hi, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


def test_constraint_fields_conflict(fake_app, fake):
    """More than one of response_format, json_schema, regex_pattern, grammar_string and a forced tool_choice is a
    400 that names the conflicting fields."""
    fake.reply = "ok"
    hi = [{"role": "user", "content": "hi"}]
    cases = [(dict(json_schema={"type": "object"}, regex_pattern="a"), ("json_schema", "regex_pattern")),
             (dict(response_format={"type": "json_object"}, grammar_string='start: "a"'),
              ("response_format", "grammar_string")),
             (dict(tools=TOOLS, tool_choice="required", json_schema={"type": "object"}),
              ("json_schema", "tool_choice")),
             (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                   response_format={"type": "json_object"}), ("response_format", "tool_choice")),
             (dict(regex_pattern="a", grammar_string='start: "a"', json_schema={"type": "object"}),
              ("json_schema", "regex_pattern", "grammar_string"))]
    opened = fake.opened

    async def go():
        c = aclient(fake_app)
        out = []
        for extra, _ in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="m", messages=hi, max_tokens=2, extra_body=extra)
            out.append(e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="m", prompt="x", max_tokens=2,
                                       extra_body=dict(regex_pattern="a", grammar_string='start: "a"'))
        out.append(e.value.body)
        # a text response_format, tool_choice auto and empty fields constrain nothing: no conflict
        await c.chat.completions.create(model="m", messages=hi, max_tokens=2, tools=TOOLS, tool_choice="auto",
                                        response_format={"type": "json_object"},
                                        extra_body=dict(regex_pattern="", grammar_string=""))
        return out

    bodies = run(go())
    for body, (_, fields) in zip(bodies, cases + [(None, ("regex_pattern", "grammar_string"))]):
        assert body["param"] == fields[-1] and "cannot be combined" in body["message"], body
        assert all(f in body["message"].split(": only")[0] for f in fields), body
    assert fake.opened == opened + 1


def _timings_ok(usage: dict) -> None:
    for key in ("prompt_time", "prompt_tokens_per_sec", "completion_time", "completion_tokens_per_sec", "total_time"):
        assert isinstance(usage[key], float) and usage[key] >= 0, (key, usage)
    assert usage["completion_time"] > 0 and usage["prompt_time"] > 0
    assert usage["completion_tokens_per_sec"] == pytest.approx(usage["completion_tokens"] / usage["completion_time"])
    assert usage["prompt_tokens_per_sec"] == pytest.approx(usage["prompt_tokens"] / usage["prompt_time"])
    assert usage["total_time"] >= max(usage["prompt_time"], usage["completion_time"])


def test_usage_timings(url, fake_app, fake):
    """TabbyAPI's usage timings beside OpenAI's counts: non-streamed and in the streamed usage chunk, with several
    choices; a rate over no time is 0; the slowest choice's times, the summed tokens."""
    from exl2.server.completions import _usage

    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    hi = [{"role": "user", "content": "Tell me a story."}]
    r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=6, temperature=0)
    usage = r.usage.model_dump()
    _timings_ok(usage)
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    r = c.completions.create(model="tiny", prompt=["Once upon", "The fox"], n=2, max_tokens=5, temperature=1, seed=2)
    _timings_ok(r.usage.model_dump())
    data = sse_data(url, "/v1/chat/completions", {"messages": hi, "max_tokens": 6, "n": 2, "stream": True,
                                                  "temperature": 0, "stream_options": {"include_usage": True}})
    streamed = json.loads(data[-2])["usage"]  # greedy, as the first request: no choice may end early
    _timings_ok(streamed)
    assert streamed["completion_tokens"] == 12

    fake.reply = "ok"                          # the fake reports no times
    zero = run(aclient(fake_app).chat.completions.create(model="m", messages=hi, max_tokens=2)).usage.model_dump()
    assert [zero[k] for k in ("prompt_time", "prompt_tokens_per_sec", "completion_time", "completion_tokens_per_sec",
                              "total_time")] == [0.0] * 5

    results = [GenerationResult("a", [1, 2], "stop", 10, time_queued=0.5, time_prefill=0.25, time_generate=1.0),
               GenerationResult("b", [1, 2, 3, 4], "stop", 10, time_queued=0.0, time_prefill=0.5, time_generate=2.0)]
    u = _usage(results, 2)
    assert (u["prompt_time"], u["completion_time"], u["total_time"]) == (0.5, 2.0, 2.5)
    assert (u["prompt_tokens_per_sec"], u["completion_tokens_per_sec"]) == (20.0, 3.0)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (10, 6, 16)


def test_add_generation_prompt_and_response_prefix(url, engine, thinker_url, thinker):
    """add_generation_prompt false renders no assistant opening; response_prefix ends the prompt, the reply
    continues it and its content starts with it, streamed (the first content delta) or not."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    hi = [{"role": "user", "content": "Tell me a story."}]
    header = "<|im_start|>assistant\n"                   # ChatML, the tiny model's (fallback) template
    with_header, without = engine.chat_prompt(hi), engine.chat_prompt(hi, add_generation_prompt=False)
    assert with_header.endswith(header) and not without.endswith(header) and with_header == without + header

    r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=6, temperature=0,
                                  extra_body=dict(add_generation_prompt=False))
    on = c.chat.completions.create(model="tiny", messages=hi, max_tokens=6, temperature=0,
                                   extra_body=dict(add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(without, add_bos=False)) < on.usage.prompt_tokens
    assert r.choices[0].message.content == reference(engine, without, 6, add_bos=False).text
    assert on.choices[0].message.content == reference(engine, with_header, 6, add_bos=False).text

    prefix = "Once upon a time,"
    ref = reference(engine, with_header + prefix, 8, add_bos=False)
    r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=8, temperature=0,
                                  extra_body=dict(response_prefix=prefix))
    assert r.choices[0].message.content == prefix + ref.text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == ref.prompt_tokens
    chunks = list(c.chat.completions.create(model="tiny", messages=hi, max_tokens=8, temperature=0, stream=True,
                                            extra_body=dict(response_prefix=prefix)))
    contents = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert contents[0] == prefix and "".join(contents) == prefix + ref.text
    r = c.chat.completions.create(model="tiny", messages=hi, max_tokens=4, temperature=0,
                                  extra_body=dict(add_generation_prompt=False, response_prefix="\nSo"))
    assert r.choices[0].message.content == "\nSo" + reference(engine, without + "\nSo", 4, add_bos=False).text

    # The prefix is part of the reply: a reasoning model's prefix inside the think block is reasoning.
    t = openai.OpenAI(base_url=f"{thinker_url}/v1", api_key="unused", max_retries=0)
    thinker.reply = " see.\n</think>\n\nIt is 3."
    r = t.chat.completions.create(model="x", messages=hi, extra_body=dict(response_prefix="Let me"))
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Let me see.", "It is 3.")
    assert thinker.prompts[-1].endswith("<think>\nLet me")
    parts = list(t.chat.completions.create(model="x", messages=hi, stream=True,
                                           extra_body=dict(response_prefix="Let me")))
    assert "".join(getattr(p.choices[0].delta, "reasoning_content", None) or "" for p in parts
                   if p.choices) == "Let me see."


def test_tabby_penalty_range_and_banned_strings_reach_the_engine():
    """penalty_range (and its aliases; -1 and 0 mean the whole text), repetition_decay and banned_strings (a list or
    one string; empty strings dropped) arrive in SamplingSettings."""
    fake = SettingsFake()
    c = aclient(create_app(fake, ServerConfig()))
    hi = [{"role": "user", "content": "hi"}]
    bodies = [dict(repetition_penalty=1.1, penalty_range=512, repetition_decay=64, banned_strings=["shivers", ""],
                   token_healing=True),
              dict(rep_pen_range=128, banned_strings="ministrations"), dict(repetition_penalty_range=-1),
              dict(repetition_range=0, banned_strings=[])]

    async def go():
        for body in bodies:
            await c.chat.completions.create(model="m", messages=hi, max_tokens=4, extra_body=body)
        await c.completions.create(model="m", prompt="x", max_tokens=4, extra_body=bodies[0])

    run(go())
    got = [(s.repetition_range, s.repetition_decay, s.banned_strings) for s in fake.settings]
    assert got == [(512, 64, ("shivers",)), (128, 0, ("ministrations",)), (0, 0, None), (0, 0, None),
                   (512, 64, ("shivers",))]
    assert fake.settings[0].ranged_penalty and fake.settings[0].token_healing and not fake.settings[1].token_healing


def test_a_finished_request_logs_one_metrics_line(caplog):
    """Whoever runs the server sees a line per finished request (streamed or not): its jobs, tokens and speeds."""
    import logging

    fake = SettingsFake()
    c = aclient(create_app(fake, ServerConfig()))
    hi = [{"role": "user", "content": "hi"}]

    async def go():
        await c.chat.completions.create(model="m", messages=hi, max_tokens=4)
        stream = await c.completions.create(model="m", prompt="x", max_tokens=4, n=2, stream=True)
        async for _ in stream:
            pass

    with caplog.at_level(logging.INFO, logger="exl2.server"):
        run(go())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished")]
    assert len(lines) == 2 and lines[0].startswith("finished 1 job:") and lines[1].startswith("finished 2 jobs:")
    assert all("prompt tokens" in ln and "generated" in ln and "finish" in ln for ln in lines)
