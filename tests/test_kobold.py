"""The KoboldAI API (`--kobold`) and the discovery endpoints, as Kobold clients meet them: fake engines for how
requests map onto the engine, abort and check; the golden tiny model for real generation and streaming."""
import json
import threading
from pathlib import Path

import httpx
import pytest

from exl2.cli.main import main
from exl2.config import EngineConfig, SamplingSettings, ServerConfig
from exl2.engine import Engine
from exl2.server.app import create_app
from exl2.server.kobold import _fit

from test_cli import SRC
from test_server import KEY, FakeEngine, SettingsFake, run, serving, wait_until

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
AUTH = {"Authorization": f"Bearer {KEY}"}


class RecordingFake(SettingsFake):
    """A SettingsFake that also keeps each stream's length limit and stop strings."""

    def __init__(self):
        super().__init__()
        self.limits: list[tuple[int, tuple]] = []

    async def aevent_stream(self, prompt, settings=None, max_new_tokens=256, stop_strings=(), *args, **kwargs):
        self.limits.append((max_new_tokens, tuple(stop_strings)))
        async for event in super().aevent_stream(prompt, settings, max_new_tokens, stop_strings, *args, **kwargs):
            yield event


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def kobold_app(engine, **config) -> object:
    return create_app(engine, ServerConfig(kobold=True, **config))


def stream_events(url: str, body: dict, on_event=None) -> list[tuple[str, dict]]:
    """(event, data) of a Kobold stream; `on_event(i)` runs after the i-th one arrived."""
    out, event = [], None
    with httpx.stream("POST", f"{url}/api/extra/generate/stream", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[len("data: "):])))
                if on_event is not None:
                    on_event(len(out) - 1)
    return out


# ---- routes and discovery ---------------------------------------------------------------------------------------

def test_kobold_routes_only_with_the_flag():
    """Without `kobold` every Kobold route is a 404 in the server's error shape; with it they answer."""
    paths = [("POST", "/api/v1/generate"), ("POST", "/api/latest/generate"), ("POST", "/api/extra/generate/stream"),
             ("POST", "/api/extra/abort"), ("GET", "/api/extra/generate/check"), ("GET", "/api/v1/model"),
             ("POST", "/api/extra/tokencount"), ("GET", "/api/v1/config/max_length"),
             ("GET", "/api/v1/config/max_context_length"), ("GET", "/api/extra/true_max_context_length"),
             ("GET", "/api/v1/info/version"), ("GET", "/api/extra/version")]

    async def go(app):
        async with client(app) as c:
            return [await c.request(m, p, json={"prompt": "hi", "max_length": 4}) for m, p in paths]

    off = run(go(create_app(FakeEngine(), ServerConfig())))
    assert [r.status_code for r in off] == [404] * len(paths)
    assert off[0].json()["error"]["message"] == "No route POST /api/v1/generate on this server."
    on = run(go(kobold_app(FakeEngine())))
    assert [r.status_code for r in on] == [200] * len(paths), [r.text for r in on]


def test_info_version_model_and_config_endpoints():
    async def go():
        async with client(kobold_app(FakeEngine(), max_tokens=300)) as c:
            return {p: (await c.get(p)).json() for p in (
                "/api/v1/info/version", "/api/extra/version", "/api/v1/model", "/api/v1/config/max_length",
                "/api/v1/config/max_context_length", "/api/extra/true_max_context_length")}

    got = run(go())
    assert got["/api/v1/info/version"] == {"result": "1.2.5"}
    assert got["/api/extra/version"] == {"result": "KoboldCpp", "version": "1.74"}
    assert got["/api/v1/model"] == {"result": "exl2/fake-model"}
    assert got["/api/v1/config/max_length"] == {"value": 300}
    assert got["/api/v1/config/max_context_length"] == got["/api/extra/true_max_context_length"] == {"value": 512}


def test_serviceinfo_and_props():
    """serviceinfo needs no key and lists the Kobold API only when it is on; /props needs the key and a model."""
    async def go():
        out = {}
        for kobold in (False, True):
            async with client(create_app(FakeEngine(), ServerConfig(kobold=kobold, api_keys=(KEY,)))) as c:
                out[kobold] = (await c.get("/.well-known/serviceinfo")).json()
                out["props", kobold] = (await c.get("/props", headers=AUTH)).json()
                out["anon", kobold] = (await c.get("/props")).status_code
        async with client(create_app(None, ServerConfig())) as c:
            out["empty"] = await c.get("/props")
            out["empty info"] = (await c.get("/.well-known/serviceinfo")).status_code
        return out

    out = run(go())
    plain, with_kobold = out[False], out[True]
    assert plain["version"] == 0.2 and plain["software"]["name"] == "exl2" and plain["software"]["version"]
    assert plain["api"] == {"openai": {"name": "OpenAI API", "base_url": "http://test/v1", "rel_url": "/v1"}}
    assert with_kobold["api"]["openai"] == plain["api"]["openai"]
    assert with_kobold["api"]["koboldai"] == {"name": "KoboldAI API", "base_url": "http://test/api",
                                              "rel_url": "/api", "version": "1.2.5"}
    props = out["props", True]
    assert props["total_slots"] == 16 and props["default_generation_settings"] == {"n_ctx": 512}
    assert "<|im_start|>" in props["chat_template"]      # the ChatML template the fake renders with
    assert out["anon", True] == out["anon", False] == 401
    assert out["empty"].status_code == 503 and out["empty"].json()["error"]["code"] == "model_not_loaded"
    assert out["empty info"] == 200


def test_auth_and_no_model():
    """The Kobold routes take the API keys like /v1; generating without a model is a 503."""
    body = {"prompt": "hi", "max_length": 4}

    async def go():
        async with client(kobold_app(RecordingFake(), api_keys=(KEY,))) as c:
            anon = await c.post("/api/v1/generate", json=body)
            wrong = await c.post("/api/v1/generate", json=body, headers={"Authorization": "Bearer nope"})
            version = await c.get("/api/extra/version")
            ok = await c.post("/api/v1/generate", json=body, headers={"x-api-key": KEY})
        async with client(kobold_app(None)) as c:
            empty = await c.post("/api/v1/generate", json=body)
            empty_check = await c.post("/api/extra/generate/check", json={"genkey": "k"})
        return anon, wrong, version, ok, empty, empty_check

    anon, wrong, version, ok, empty, empty_check = run(go())
    assert anon.status_code == wrong.status_code == version.status_code == 401
    assert anon.json()["error"]["code"] == "invalid_api_key"
    assert ok.status_code == 200 and ok.json() == {"results": [{"text": "ok", "finish_reason": "stop"}]}
    assert empty.status_code == 503 and empty.json()["error"]["code"] == "model_not_loaded"
    assert empty_check.json() == {"results": [{"text": ""}]}


def test_serve_flag(monkeypatch):
    import uvicorn as uv

    apps = []
    monkeypatch.setattr("exl2.engine.Engine", lambda config, progress=None: FakeEngine())
    monkeypatch.setattr(uv.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    argv = ["serve", "-m", str(SRC), "--device", "cpu", "--port", "0"]
    assert main(argv + ["--kobold"]) == 0 and main(argv) == 0
    assert [a.state.exl2.config.kobold for a in apps] == [True, False]

    async def go():
        out = []
        for a in apps:
            async with client(a) as c:
                out.append([(await c.get(p)).status_code for p in ("/api/extra/version", "/.well-known/serviceinfo")])
        return out

    assert run(go()) == [[200, 200], [404, 200]]


# ---- how a request reaches the engine ---------------------------------------------------------------------------

def test_kobold_fields_reach_the_sampler():
    """Every Kobold sampler field arrives in SamplingSettings under the engine's name; dynatemp_range spreads
    min_temp/max_temp around the temperature (clamped at 0); rep_pen_range -1 is the whole text; a negative
    sampler_seed is a random one; banned_tokens (KoboldCpp's strings) join banned_strings; stop_sequence and
    use_default_badwordsids reach the job; unknown fields and rep_pen_slope change nothing."""
    fake = RecordingFake()
    full = dict(prompt="Once", max_length=7, temperature=0.7, top_k=40, top_p=0.9, top_a=0.2, min_p=0.05,
                typical=0.8, tfs=0.95, rep_pen=1.1, rep_pen_range=-1, rep_pen_slope=0.7, presence_penalty=0.3,
                smoothing_factor=0.25, dynatemp_range=1.0, dynatemp_exponent=1.5, xtc_probability=0.5,
                xtc_threshold=0.15, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, dry_penalty_last_n=64,
                dry_sequence_breakers='["\\n", ":"]', mirostat=2, mirostat_tau=4.0, mirostat_eta=0.2,
                sampler_seed=1234, stop_sequence=["\nUser:", "", "\n\n"], banned_tokens=["shivers"],
                banned_strings="ministrations", use_default_badwordsids=True, genkey="KCPP1", quiet=True,
                sampler_order=[6, 0, 1], n=1, memory="")
    others = [dict(prompt="x", rep_pen=1.2, rep_pen_range=256, sampler_seed=-1, dynatemp_range=0.5,
                   temperature=0.2, mirostat_mode=0, dry_base=0, dry_allowed_length=0, dry_penalty_last_n=-1),
              dict(prompt="x"), dict(prompt="x", top_p=0, stop_sequence="END")]

    async def go():
        async with client(kobold_app(fake)) as c:
            return [await c.post("/api/v1/generate", json=body) for body in [full, *others]]

    responses = run(go())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert responses[0].json() == {"results": [{"text": "ok", "finish_reason": "stop"}]}
    s = fake.settings[0]
    expected = dict(temperature=0.7, top_k=40, top_p=0.9, top_a=0.2, min_p=0.05, typical=0.8, tfs=0.95,
                    repetition_penalty=1.1, repetition_range=0, presence_penalty=0.3, frequency_penalty=0.0,
                    smoothing_factor=0.25, min_temp=0.0, max_temp=0.7 + 1.0, temp_exponent=1.5, xtc_probability=0.5,
                    xtc_threshold=0.15, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, dry_range=64,
                    dry_sequence_breakers=("\n", ":"), mirostat_mode=2, mirostat_tau=4.0, mirostat_eta=0.2,
                    seed=1234, banned_strings=("shivers", "ministrations"))
    assert {k: getattr(s, k) for k in expected} == expected
    assert s.dynamic_temperature and s.dry and s.mirostat
    assert fake.limits[0] == (7, ("\nUser:", "\n\n")) and fake.ends[0]["ignore_eos"] is True
    second, default, greedy = fake.settings[1:]
    assert (second.repetition_penalty, second.repetition_range, second.seed) == (1.2, 256, None)
    assert (second.min_temp, second.max_temp) == pytest.approx((0.0, 0.7))       # 0.2 - 0.5 clamped at 0
    assert (second.dry_base, second.dry_allowed_length, second.dry_range) == (1.75, 2, 0)   # 0: engine defaults
    assert default.temperature == 1.0 and not default.dynamic_temperature and default.banned_strings is None
    assert fake.limits[2] == (1024, ()) and fake.ends[2]["ignore_eos"] is False   # the server's --max-tokens
    assert greedy.top_k == 1 and fake.limits[3] == (1024, ("END",))


def test_bad_values_are_400s():
    """A value a sampler cannot take is a 400 of one sentence naming the Kobold field; nothing reaches the
    engine."""
    fake = RecordingFake()
    cases = [(dict(temperature=-1), "temperature", "greater than or equal to 0"),
             (dict(rep_pen=0), "rep_pen", "greater than 0"),
             (dict(top_p=1.5), "top_p", "less than or equal to 1"),
             (dict(mirostat=1), "mirostat_mode", "Only Mirostat 2 is supported"),
             (dict(temperature=9.5, dynatemp_range=1), "dynatemp_range", "at most 10"),
             (dict(dry_base=0.5), "dry_base", "greater than or equal to 1"),
             (dict(dry_sequence_breakers="[oops"), "dry_sequence_breakers", "JSON list of strings"),
             (dict(max_length=0), "max_length", "greater than or equal to 1"),
             (dict(prompt=None), "prompt", "valid string")]

    async def go():
        async with client(kobold_app(fake)) as c:
            out = []
            for extra, _, _ in cases:
                for path in ("/api/v1/generate", "/api/extra/generate/stream"):
                    out.append(await c.post(path, json={"prompt": "x", **extra}))
            return out

    responses = run(go())
    for i, (_, param, words) in enumerate(cases):
        for r in responses[2 * i:2 * i + 2]:
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and words in err["message"], err
            assert err["message"].endswith(".") and err["message"].count(". ") == 0, err
    assert fake.settings == []


def test_long_prompts_keep_their_end():
    """A prompt longer than min(max_context_length, the context) less max_length keeps its last tokens, as
    KoboldCpp does (the fake's tokens are the characters' positions); on the real tokenizer BOS stays first."""
    fake = RecordingFake()

    async def go():
        async with client(kobold_app(fake)) as c:
            for body in (dict(prompt="a" * 1000, max_length=20, max_context_length=100),
                         dict(prompt="a" * 1000, max_length=20), dict(prompt="a" * 50, max_length=20),
                         dict(prompt="a" * 1000, max_length=20, max_context_length=9000)):
                assert (await c.post("/api/v1/generate", json=body)).status_code == 200

    run(go())
    assert fake.prompts == [list(range(920, 1000)), list(range(508, 1000)), list(range(50)),
                            list(range(508, 1000))]


def test_fit_keeps_bos():
    from exl2.generation.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(GOLDEN)
    ids = tok.encode("word " * 300)
    assert ids[0] == tok.bos_id and len(ids) > 100
    assert _fit(tok, "word " * 300, 100) == [tok.bos_id] + ids[-99:]
    assert _fit(tok, "word " * 300, 1000) == ids


# ---- abort, check and disconnects -------------------------------------------------------------------------------

@pytest.fixture
def endless():
    """A Kobold server over a socket whose fake engine writes "x" every 10 ms until its job is cancelled."""
    fake = FakeEngine()
    fake.reply = None
    app = kobold_app(fake)
    with serving(app) as url:
        yield fake, app, url


def test_abort_ends_a_running_stream_and_check_sees_its_text(endless):
    fake, app, url = endless
    body = {"prompt": "hi", "max_length": 1000, "genkey": "KCPP4242"}
    checks, aborts = [], []

    def on_event(i):
        if i == 5:
            checks.append(httpx.post(f"{url}/api/extra/generate/check", json={"genkey": "KCPP4242"}).json())
            aborts.append(httpx.post(f"{url}/api/extra/abort", json={"genkey": "nope"}).json())
            aborts.append(httpx.post(f"{url}/api/extra/abort", json={"genkey": "KCPP4242"}).json())

    events = stream_events(url, body, on_event)
    assert aborts == [{"success": False}, {"success": True}]
    tokens = [data["token"] for _, data in events]
    assert all(event == "message" for event, _ in events) and len(events) >= 7
    assert [data["finish_reason"] for _, data in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1][1]["finish_reason"] == "stop"
    assert set("".join(tokens)) == {"x"} and checks[0]["results"][0]["text"].startswith("xxxxxx")
    assert wait_until(lambda: fake.closes == fake.opened)            # the engine job was cancelled
    assert app.state.kobold_generations == {}
    assert httpx.post(f"{url}/api/extra/generate/check", json={"genkey": "KCPP4242"}).json() == \
        {"results": [{"text": ""}]}
    assert httpx.post(f"{url}/api/extra/abort", json={"genkey": "KCPP4242"}).json() == {"success": False}


def test_abort_returns_the_text_so_far_of_a_generate(endless):
    """A non-streamed generate that is aborted answers with what it had; check without a genkey and abort without
    one act on the latest generation (KoboldCpp's single-user form)."""
    fake, app, url = endless
    answer = []
    thread = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{url}/api/v1/generate", json={"prompt": "hi", "max_length": 1000}, timeout=30)))
    thread.start()

    def partial() -> str:
        return httpx.get(f"{url}/api/extra/generate/check").json()["results"][0]["text"]

    assert wait_until(lambda: len(partial()) >= 3)
    assert httpx.post(f"{url}/api/extra/abort").json() == {"success": True}
    thread.join(10)
    result = answer[0].json()["results"][0]
    assert answer[0].status_code == 200 and result["finish_reason"] == "stop"
    assert len(result["text"]) >= 3 and set(result["text"]) == {"x"}
    assert wait_until(lambda: fake.closes == fake.opened) and app.state.kobold_generations == {}


def test_client_disconnect_cancels_the_stream(endless):
    fake, app, url = endless
    with httpx.stream("POST", f"{url}/api/extra/generate/stream", json={"prompt": "hi", "genkey": "gone"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert wait_until(lambda: fake.closes == fake.opened == 1)
    assert wait_until(lambda: app.state.kobold_generations == {})


# ---- the golden tiny model --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(model_dir=GOLDEN, max_seq_len=512, device="cpu"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def url(engine):
    with serving(create_app(engine, ServerConfig(kobold=True, api_keys=(KEY,), model_name="tiny"))) as base:
        yield base


def generate(url: str, **body) -> dict:
    r = httpx.post(f"{url}/api/v1/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def test_real_generate_and_stream_agree(url, engine):
    """A greedy seeded request: the reply is the engine's own greedy continuation, and the streamed tokens add up
    to the non-streamed text."""
    body = dict(prompt="Once upon a time", max_length=16, temperature=0, sampler_seed=7, rep_pen=1.0)
    ref = engine.generator.generate("Once upon a time", SamplingSettings(temperature=0), 16)
    plain = generate(url, **body)
    events = stream_events(url, body)
    assert plain == {"text": ref.text, "finish_reason": ref.finish_reason} and ref.text
    assert "".join(data["token"] for _, data in events) == ref.text
    assert events[-1][1]["finish_reason"] == ref.finish_reason == "length"
    raw = httpx.post(f"{url}/api/extra/generate/stream", json=body, headers=AUTH, timeout=60).text
    assert raw.startswith('event: message\ndata: {"token": ') and "\r" not in raw     # KoboldCpp's framing


def test_real_stop_sequence_and_trim_stop(url, engine):
    """The stop string ends the reply and is cut from it; with trim_stop false it ends the text, streamed too."""
    text = generate(url, prompt="Once upon a time", max_length=24, temperature=0)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.index(stop)]
    body = dict(prompt="Once upon a time", max_length=24, temperature=0, stop_sequence=[stop])
    assert generate(url, **body) == {"text": cut, "finish_reason": "stop"}
    assert generate(url, **body, trim_stop=False) == {"text": cut + stop, "finish_reason": "stop"}
    kept = stream_events(url, dict(body, trim_stop=False))
    assert "".join(data["token"] for _, data in kept) == cut + stop


def test_real_long_prompt_and_tokencount(url, engine):
    """A story longer than the context is answered (its end kept), where /v1/completions would refuse it;
    tokencount counts as the tokenizer does."""
    story = "word " * 3000
    assert generate(url, prompt=story, max_length=4, temperature=0)["text"] is not None
    r = httpx.post(f"{url}/api/extra/tokencount", json={"prompt": "Hello world, again."}, headers=AUTH).json()
    ids = engine.tokenizer.encode("Hello world, again.")
    assert r == {"value": len(ids), "ids": ids}
    model = httpx.get(f"{url}/api/v1/model", headers=AUTH).json()
    assert model == {"result": "exl2/tiny"}


def test_fit_keeps_the_memory():
    """KoboldCpp's memory goes before the prompt and is never trimmed: a long story loses its start, not it."""
    from exl2.generation.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(GOLDEN)
    memory = "[Setting: a quiet harbour town.]\n"
    head = tok.encode(memory)
    got = _fit(tok, "word " * 300, 100, memory)
    assert len(got) == 100 and got[:len(head)] == head
    assert got[len(head):] == tok.encode(memory + "word " * 300)[-(100 - len(head)):]
    assert _fit(tok, "short", 100, memory) == tok.encode(memory + "short")
