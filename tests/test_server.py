"""The OpenAI-compatible server as the official `openai` client meets it, checked against the engine itself.

Greedy replies, token counts and stop strings are compared with `engine.generator.generate` on the same
prompt; streaming runs over a real socket (uvicorn in a thread); tool-call translation uses a fake engine
whose reply is canned text in the Hermes, Llama-3.1 and plain forms.
"""
import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from exl2.cli.main import main
from exl2.config import EngineConfig, SamplingSettings, ServerConfig
from exl2.engine import Engine
from exl2.generation.generator import GenerationResult
from exl2.generation.job import Event
from exl2.server.app import create_app

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

    def __init__(self):
        self.config = EngineConfig(model_dir="fake-model", max_seq_len=512)
        self.model = SimpleNamespace(spec=SimpleNamespace(arch="fake", max_position=4096))
        self.tokenizer = SimpleNamespace(encode=lambda text, add_bos=None: list(range(len(text))),
                                         decode=lambda ids: "x" * len(ids))
        self.reply: str | None = CALL      # None: an endless reply, for the disconnect tests
        self.fail_seed: int | None = None  # the job sampling with this seed fails after its first piece
        self.rendered: list[tuple[list, object]] = []
        self.forced: list[str] = []         # the tool_choice grammars asked for
        self.closed = threading.Event()
        self.opened = self.closes = 0      # streams started and closed, for the disconnect tests

    def chat_prompt(self, messages, tools=None):
        self.rendered.append((messages, tools))
        return "PROMPT"

    def json_grammar(self, schema=None):
        return None

    def tool_grammar(self, tools, name=None):
        self.forced.append(name or "required")
        return None

    async def aevent_stream(self, prompt, settings=None, max_new_tokens=256, stop_strings=(), add_bos=None,
                            grammar=None, logprobs=None):
        self.opened += 1
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
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        card = (await c._client.get("http://test/v1/model", headers={"Authorization": f"Bearer {KEY}"})).json()
        assert card["id"] == "tiny" and card["parameters"]["max_seq_len"] == 512
        assert card["parameters"]["cache_mode"] == "fp16" and card["parameters"]["draft"] is None
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
    assert chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)
    parts = [ch["choices"][0] for ch in chunks[:-1]]
    assert all(len(ch["choices"]) == 1 for ch in chunks[:-1]) and {p["index"] for p in parts} == {0, 1}
    for i in (0, 1):
        mine = [p for p in parts if p["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(p["delta"].get("content") or "" for p in mine) == whole.choices[i].message.content
        assert [p["finish_reason"] for p in mine if p["finish_reason"]] == [whole.choices[i].finish_reason]
        assert mine[-1]["finish_reason"]                                  # the finish chunk ends its choice


# ---- errors -----------------------------------------------------------------------------------------------------

def test_bad_requests_are_400_in_openai_shape(app):
    hi = [{"role": "user", "content": "hi"}]

    async def go():
        c = aclient(app)
        cases = [dict(n=17), dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
                 dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                     "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}),
                 dict(frequency_penalty=0.5), dict(top_logprobs=3), dict(stop=["a", "b", "c", "d", "e"])]
        params = []
        for extra in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="tiny", messages=hi, max_tokens=2, **extra)
            assert set(e.value.body) == {"message", "type", "param", "code"}
            params.append(e.value.body["param"])
        assert params == ["n", "response_format", "response_format", "frequency_penalty", "top_logprobs", "stop"]
        assert "at most 4" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, n=17)
        assert e.value.body["param"] == "n" and "16" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="tiny", prompt="a", max_tokens=2, best_of=2)
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
