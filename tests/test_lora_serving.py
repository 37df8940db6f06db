"""LoRA adapters through the generator, the Engine, the command line and TabbyAPI's LoRA endpoints, on the golden
4.0 bpw model on CPU with random PEFT adapters.

The references are the engine's own greedy replies: with no adapter, with an adapter applied at start-up
(EngineConfig.loras), and an adapter set later must give exactly the start-up one's text, unloading exactly the
plain one's; the prompt cache must never hand a reply keys/values computed under other adapters.
"""
import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from exl2.config import EngineConfig, LoraSpec, SamplingSettings, ServerConfig
from exl2.engine import Engine
from exl2.errors import ConfigError, ModelLoadError
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.runtime.graphs import DecodeGraphs
from exl2.runtime.page_pool import PagePool, page_key

MODEL = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
GREEDY = SamplingSettings(temperature=0)
PROMPT = "Once upon a time in a land far away"
KEY, ADMIN = "sk-test-key", "sk-admin-key"
# the tiny Llama: hidden 256, 4 layers, 4 query heads and 2 KV heads of 64
OUT_FEATURES = {"q_proj": 256, "k_proj": 128, "v_proj": 128, "o_proj": 256}


def make_adapter(root: Path, name: str, seed: int, modules=("q_proj", "v_proj"), rank: int = 8,
                 alpha: float = 16.0) -> Path:
    """A random PEFT LoRA adapter for the tiny model, large enough to change its greedy replies."""
    path = root / name
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(4):
        for m in modules:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 256, generator=g) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(OUT_FEATURES[m], rank, generator=g) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none"}))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    """loras/: two adapters (one, two), a directory that is none (notes) and a hidden adapter."""
    root = tmp_path_factory.mktemp("loras")
    make_adapter(root, "one", 1)
    make_adapter(root, "two", 2, modules=("k_proj", "o_proj"))
    make_adapter(root, ".hidden", 3)
    (root / "notes").mkdir()
    (root / "readme.txt").write_text("not an adapter")
    return root


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu"))
    yield e
    e.close()


@pytest.fixture
def plain(engine):
    """The shared engine with no adapter active before and after the test."""
    engine.set_loras([])
    yield engine
    engine.set_loras([])


@pytest.fixture(scope="module")
def replies(adapters):
    """Greedy replies to PROMPT (12 tokens) from engines started with these adapters."""
    def reply(*specs: LoraSpec) -> list[int]:
        e = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu", loras=list(specs)))
        try:
            assert [a.name for a in e.loras] == [Path(s.path).name for s in specs]
            return e.generate(PROMPT, GREEDY, 12).token_ids
        finally:
            e.close()

    one, two = LoraSpec(path=adapters / "one"), LoraSpec(path=adapters / "two", scaling=0.5)
    return {"base": reply(), "one": reply(one), "one+two": reply(one, two)}


# ---- the generator and the Engine --------------------------------------------------------------------------------

def test_adapters_change_replies_and_unloading_restores_them(plain, adapters, replies):
    base = replies["base"]
    assert plain.generate(PROMPT, GREEDY, 12).token_ids == base
    assert replies["one"] != base and replies["one+two"] not in (base, replies["one"])

    plain.set_loras([LoraSpec(path=adapters / "one")])
    assert [(a.name, a.scaling, a.rank) for a in plain.loras] == [("one", 1.0, 8)]
    assert plain.generate(PROMPT, GREEDY, 12).token_ids == replies["one"]
    # several at once, with scales; an adapter already loaded is taken as it is
    two = plain.load_lora(LoraSpec(path=adapters / "two", scaling=0.5))
    plain.set_loras([LoraSpec(path=adapters / "one"), two])
    assert [(a.name, a.scaling) for a in plain.loras] == [("one", 1.0), ("two", 0.5)]
    assert plain.generate(PROMPT, GREEDY, 12).token_ids == replies["one+two"]
    plain.set_loras([])
    assert plain.loras == [] and plain.generate(PROMPT, GREEDY, 12).token_ids == base
    plain.set_loras([LoraSpec(path=adapters / "one", scaling=0.0)])     # a zero scale changes nothing
    assert plain.generate(PROMPT, GREEDY, 12).token_ids == base


def test_bad_adapters_are_one_sentence_and_change_nothing(plain, adapters, replies):
    plain.set_loras([LoraSpec(path=adapters / "one")])
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        plain.set_loras([LoraSpec(path=adapters / "missing")])
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        plain.set_loras([LoraSpec(path=adapters / "notes")])
    assert [a.name for a in plain.loras] == ["one"]
    assert plain.generate(PROMPT, GREEDY, 12).token_ids == replies["one"]
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        LoraSpec(path=adapters / "one", scaling=-1)
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu",
                            loras=[{"path": adapters / "missing"}]))


def test_set_loras_is_refused_while_a_job_runs_or_waits(adapters):
    from exl2.generation.tokenizer import Tokenizer
    from exl2.runtime.loader import load_model
    from exl2.runtime.lora import LoraAdapter

    model, tok = load_model(MODEL, "cpu"), Tokenizer.from_dir(MODEL)
    gen = DynamicGenerator(model, tok, 512, max_batch=1)
    adapter = LoraAdapter.from_dir(adapters / "one", model)
    refusal = "LoRAs can change only while no request is running."
    queued = gen.enqueue(Job(tok.encode(PROMPT), GREEDY, 4))
    with pytest.raises(ConfigError) as e:
        gen.set_loras([adapter])
    assert str(e.value) == refusal
    gen.iterate()                                           # running now
    assert gen.active == [queued]
    with pytest.raises(ConfigError, match=refusal):
        gen.set_loras([adapter])
    while gen.has_work():
        gen.iterate()
    gen.set_loras([adapter])
    from exl2.runtime.lora import active_loras
    assert active_loras(model) == [adapter]


def test_engine_refuses_a_change_while_a_request_runs(plain, adapters, replies):
    """The change runs on the generator's thread between steps: a running request is neither disturbed nor
    changed, and the refusal reaches the caller."""
    events = plain.worker.stream(plain.generator.job(PROMPT, GREEDY, 300, ignore_eos=True))   # a second or so
    next(events)
    with pytest.raises(ConfigError, match="no request is running"):
        plain.set_loras([LoraSpec(path=adapters / "one")])
    result = list(events)[-1].result
    assert len(result.token_ids) == 300 and result.token_ids[:12] == replies["base"]
    assert plain.loras == []
    plain.set_loras([LoraSpec(path=adapters / "one")])       # the worker is idle again
    assert plain.generate(PROMPT, GREEDY, 12).token_ids == replies["one"]


def test_prompt_cache_is_forgotten_when_the_adapters_change(plain, adapters):
    """A prompt longer than a page (256 tokens) is cached; after a change the same prompt is computed again
    under the new adapters (the reply, log-probabilities included, of an engine started with them), not read
    from the cache. The log-probabilities tell: the prompt's end alone can already pick the same tokens."""
    prompt = "The rain in Spain stays mainly in the plain, they say. " * 15

    def reply(engine: Engine):
        r = engine.generate(prompt, GREEDY, 8, logprobs=1)
        return r, (r.token_ids, [t.logprob for t in r.logprobs])

    first, plain_reply = reply(plain)
    again, cached_reply = reply(plain)
    assert first.cached_tokens == 0 and again.cached_tokens >= 256
    assert cached_reply[0] == plain_reply[0] and cached_reply[1] == pytest.approx(plain_reply[1], abs=1e-4)

    fresh = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu",
                                loras=[LoraSpec(path=adapters / "one")]))
    try:
        expected = reply(fresh)[1]
    finally:
        fresh.close()
    assert expected[1] != pytest.approx(plain_reply[1], abs=1e-2)
    plain.set_loras([LoraSpec(path=adapters / "one")])
    pool = plain.dynamic.pool
    assert pool.page_of == {} and pool.available() == pool.num_pages
    changed, changed_reply = reply(plain)
    assert changed.cached_tokens == 0
    assert changed_reply[0] == expected[0] and changed_reply[1] == pytest.approx(expected[1], abs=1e-4)
    plain.set_loras([])
    back, back_reply = reply(plain)
    assert back.cached_tokens == 0
    assert back_reply[0] == plain_reply[0] and back_reply[1] == pytest.approx(plain_reply[1], abs=1e-4)


def test_page_pool_forgets_prefixes_but_keeps_pages_in_use():
    pool = PagePool(4, 2)
    a = pool.acquire([], 2)
    k1, k2 = page_key(None, [1, 2]), page_key(page_key(None, [1, 2]), [3, 4])
    pool.publish(a[0], k1)
    pool.publish(a[1], k2)
    pool.release([a[1]])                        # a[1] cached, nobody uses it; a[0] still in use
    assert pool.available() == 3 and pool.match([1, 2, 3, 4], 2)[0] == a
    pool.forget_prefixes()
    assert pool.match([1, 2, 3, 4], 2) == ([], None) and pool.available() == 3
    assert pool.refs[a[0]] == 1 and a[0] not in pool.free
    pool.release([a[0]])                        # no longer a cache entry: freed
    assert pool.available() == 4 and sorted(pool.free) == [0, 1, 2, 3] and not pool.idle
    assert len(pool.acquire([], 4)) == 4


def test_a_change_drops_the_captured_graphs(monkeypatch, adapters):
    """Graphs replay the forward they captured: set_loras resets the decode and verify graphs (recaptured
    lazily on their next step)."""
    from exl2.generation.tokenizer import Tokenizer
    from exl2.runtime.loader import load_model

    model = load_model(MODEL, "cpu")
    gen = DynamicGenerator(model, Tokenizer.from_dir(MODEL), 512)
    graphs = DecodeGraphs(model, gen.cache, gen.pages_per_seq, scratch_page=gen.scratch)
    graphs.graphs[1], graphs.short[1] = ("graph",), ("short graph",)   # as a capture leaves them
    verify = SimpleNamespace(resets=0)
    verify.reset = lambda: setattr(verify, "resets", verify.resets + 1)
    gen.graphs, gen.verify_graphs = graphs, {4: verify}
    gen.set_loras([])
    assert graphs.graphs == {} and graphs.short == {} and verify.resets == 1


# ---- the command line --------------------------------------------------------------------------------------------

def exl2(*args):
    return subprocess.run([sys.executable, "-m", "exl2.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def assert_one_line_error(r, *words):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_generate_with_lora_flags(adapters):
    flags = ["generate", "-m", str(MODEL), "-p", PROMPT, "-n", "12", "--temperature", "0", "--device", "cpu"]
    one, two = str(adapters / "one"), str(adapters / "two")
    r = exl2(*flags, "--lora", one, "--lora", two, "--lora-scaling", "1", "--lora-scaling", "0.5")
    assert r.returncode == 0, r.stderr
    e = Engine(EngineConfig(model_dir=MODEL, device="cpu", loras=[LoraSpec(path=one), LoraSpec(path=two,
                                                                                                 scaling=0.5)]))
    try:
        expected = e.generate(PROMPT, GREEDY, 12).text
    finally:
        e.close()
    assert r.stdout[:-1] == expected
    base = exl2(*flags)
    assert base.returncode == 0 and base.stdout != r.stdout

    assert_one_line_error(exl2(*flags, "--lora", str(adapters / "missing")), "--lora", "does not exist")
    assert_one_line_error(exl2(*flags, "--lora", str(adapters / "notes")), "adapter_config.json")
    assert_one_line_error(exl2(*flags, "--lora", one, "--lora-scaling", "1", "--lora-scaling", "2"),
                          "--lora-scaling", "position")
    assert_one_line_error(exl2(*flags, "--lora", one, "--lora-scaling", "-1"), "--lora-scaling", "at least 0")


def test_lora_flags_reach_every_command(adapters, tmp_path):
    from exl2.cli.common import engine_settings, lora_specs
    from exl2.cli.main import build_parser

    parser = build_parser()
    for command in (["generate", "-p", "x"], ["chat"], ["serve"], ["mcp", "serve"],
                    ["mcp", "agent", "--server", "x", "-p", "y"]):
        args = parser.parse_args([*command, "-m", str(MODEL), "--lora", str(adapters / "one"),
                                  "--lora", str(adapters / "two"), "--lora_scaling", "0.25"])
        assert lora_specs(args) == [LoraSpec(path=adapters / "one", scaling=0.25),
                                    LoraSpec(path=adapters / "two")]
        assert EngineConfig(**engine_settings(args)).loras == lora_specs(args)
        assert "loras" not in engine_settings(parser.parse_args([*command, "-m", str(MODEL)]))
    r = exl2("chat", "-m", str(MODEL), "--device", "cpu", "--lora", str(tmp_path / "nope"))
    assert_one_line_error(r, "--lora", "does not exist")


def test_serve_lora_flags(monkeypatch, capsys, adapters):
    pytest.importorskip("uvicorn")
    import uvicorn

    from exl2.cli.main import main

    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    assert main(["serve", "-m", str(MODEL), "--device", "cpu", "--port", "0", "-l", "512",
                 "--lora", str(adapters / "one"), "--lora-dir", str(adapters)]) == 0
    assert "Serving b4.0_hb6 with LoRA one at" in capsys.readouterr().err
    app = apps[-1]
    assert app.state.exl2_host.config.lora_dir == adapters
    engine = app.state.exl2.engine
    try:
        assert [a.name for a in engine.loras] == ["one"]
    finally:
        engine.close()
    for argv, words in ((["--model-dir-root", str(MODEL.parent), "--lora", str(adapters / "one")],
                         ("--lora", "POST /v1/lora/load")),
                        (["--model-dir-root", str(MODEL.parent), "--lora-dir", str(adapters / "nope")],
                         ("lora_dir", "does not exist"))):
        assert main(["serve", "--port", "0", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


# ---- the server: TabbyAPI's LoRA endpoints ----------------------------------------------------------------------

@pytest.fixture
def server():
    """(create_app, an httpx client factory) when the serve extra is installed."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from exl2.server.app import create_app

    def client(app):
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    return create_app, client


def bearer(key: str = ADMIN) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def completion(c, prompt: str = PROMPT, key: str = KEY) -> str:
    r = await c.post("/v1/completions", headers=bearer(key),
                     json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_lora_endpoints(server, plain, adapters):
    create_app, client = server
    app = create_app(plain, ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), lora_dir=adapters))
    base = plain.generate(PROMPT, GREEDY, 12).text

    async def go():
        c = client(app)
        listed = (await c.get("/v1/lora/list", headers=bearer(KEY))).json()
        assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == ["one", "two"]
        assert all(x["object"] == "lora" and x["owned_by"] == "exl2" and isinstance(x["created"], int)
                   and x["scaling"] is None for x in listed["data"])
        assert (await c.get("/v1/loras", headers=bearer(KEY))).json() == listed
        assert (await c.get("/v1/lora/list")).status_code == 401
        assert (await c.get("/v1/lora", headers=bearer(KEY))).json() == {"object": "list", "data": []}
        assert await completion(c) == base

        r = await c.post("/v1/lora/load", headers=bearer(), json={"loras": [
            {"name": "one"}, {"name": "missing", "scaling": 1.0}, {"name": "notes"}, {"name": "two", "scaling": 0.5}]})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["success"] == ["one", "two"] and out["failure"] == ["missing", "notes"]
        assert "does not exist" in out["errors"]["missing"] and "adapter_config.json" in out["errors"]["notes"]
        active = (await c.get("/v1/lora", headers=bearer(KEY))).json()["data"]
        assert [(x["id"], x["scaling"], x["object"]) for x in active] == [("one", 1.0, "lora"), ("two", 0.5, "lora")]
        both = plain.generator.generate(PROMPT, GREEDY, 12).text     # the engine itself, adapters active
        assert both != base and await completion(c) == both

        # a load replaces what is active (TabbyAPI unloads first); a null scaling is 1.0
        r = await c.post("/v1/lora/load", headers={"x-admin-key": ADMIN},
                         json={"loras": [{"name": "one", "scaling": None}], "skip_queue": True})
        assert r.json()["success"] == ["one"] and r.json()["failure"] == []
        assert [(a.name, a.scaling) for a in plain.loras] == [("one", 1.0)]
        one = await completion(c)
        assert one not in (base, both)

        # path traversal and other names that are no plain directory name: 400, nothing changes
        for bad in ("../one", "..", ".", ".hidden", str(adapters / "one"), "one/../two", "a\\b", "C:x", ""):
            r = await c.post("/v1/lora/load", headers=bearer(), json={"loras": [{"name": bad}]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "invalid_lora_name", (bad, r.text)
            assert err["param"] == "loras[0].name"
        for body in ({"loras": []}, {"loras": [{"name": "one", "scaling": -1}]}, {}):
            r = await c.post("/v1/lora/load", headers=bearer(), json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] is not None, (body, r.text)
        assert [a.name for a in plain.loras] == ["one"] and await completion(c) == one

        # load and unload need an admin key, as model loads do
        for path, body in (("/v1/lora/load", {"loras": [{"name": "two"}]}), ("/v1/lora/unload", None)):
            assert (await c.post(path, json=body)).status_code == 401
            r = await c.post(path, headers=bearer(KEY), json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert [a.name for a in plain.loras] == ["one"]

        r = await c.post("/v1/lora/unload", headers=bearer())
        assert r.status_code == 200 and r.json() == {"status": "unloaded", "loras": ["one"]}
        assert (await c.get("/v1/lora", headers=bearer(KEY))).json()["data"] == []
        assert await completion(c) == base

    asyncio.run(go())


def test_without_a_lora_dir_or_a_model(server, plain, adapters):
    create_app, client = server
    app = create_app(plain, ServerConfig())          # no keys: local use, every request may manage
    plain.set_loras([LoraSpec(path=adapters / "two", scaling=0.25)])

    async def go():
        c = client(app)
        listed = (await c.get("/v1/lora/list")).json()["data"]     # no directory: the active ones
        assert [(x["id"], x["scaling"]) for x in listed] == [("two", 0.25)]
        r = await c.post("/v1/lora/load", json={"loras": [{"name": "one"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_dir_unset"
        assert "--lora-dir" in r.json()["error"]["message"]
        assert (await c.post("/v1/lora/unload")).json()["loras"] == ["two"] and plain.loras == []

        empty = create_app(None, ServerConfig(lora_dir=adapters))
        c = client(empty)
        assert [x["id"] for x in (await c.get("/v1/lora/list")).json()["data"]] == ["one", "two"]
        for method, path, body in (("GET", "/v1/lora", None), ("POST", "/v1/lora/load", {"loras": [{"name": "one"}]}),
                                   ("POST", "/v1/lora/unload", None)):
            r = await c.request(method, path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded", (path, r.text)
        assert (await client(create_app(None, ServerConfig())).get("/v1/lora/list")).json()["data"] == []

    asyncio.run(go())


class LoraFake:
    """The Engine surface the LoRA endpoints and completions use: each reply streams slowly, a piece every
    20 ms; what happens is logged in order."""

    model_name = "fake"

    def __init__(self):
        from exl2.generation.chat import ChatTemplate

        self.config = EngineConfig(model_dir="fake", max_seq_len=512)
        self.model = SimpleNamespace(spec=SimpleNamespace(arch="fake", max_position=4096))
        self.tokenizer = SimpleNamespace(encode=lambda text, add_bos=None: [1, 2], decode=lambda ids: "x")
        self.template = ChatTemplate()
        self.active: list = []
        self.log: list[str] = []
        self.streaming = 0

    @property
    def loras(self):
        return list(self.active)

    def load_lora(self, spec: LoraSpec):
        if not (Path(spec.path) / "adapter_config.json").is_file():
            raise ModelLoadError(f"The LoRA adapter directory {spec.path} does not exist.")
        return SimpleNamespace(name=Path(spec.path).name, path=spec.path, scaling=spec.scaling)

    def set_loras(self, adapters):
        self.log.append(f"set {[a.name for a in adapters]} while {self.streaming} streaming")
        self.active = list(adapters)

    async def aevent_stream(self, prompt, settings=None, max_new_tokens=256, *args, **kwargs):
        from exl2.generation.generator import GenerationResult
        from exl2.generation.job import Event

        self.streaming += 1
        self.log.append("start")
        try:
            reply = f"reply with {[a.name for a in self.active]}"
            for word in reply.split(" "):
                await asyncio.sleep(0.02)
                yield Event(None, word + " ")
            yield Event(None, "", GenerationResult(reply, [1, 2, 3], "stop", 2))
        finally:
            self.streaming -= 1
            self.log.append("end")


def test_a_change_waits_for_running_requests_and_holds_new_ones(server, adapters):
    """Adapters are global: a load waits until the requests running end (it is not refused), requests arriving
    meanwhile wait for it and run under the new adapters; a model load meanwhile is a 409."""
    create_app, client = server
    fake = LoraFake()
    app = create_app(fake, ServerConfig(lora_dir=adapters, model_dir_root=adapters))

    async def go():
        c = client(app)
        first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "stream": True}))
        while fake.streaming == 0:
            await asyncio.sleep(0.005)
        load = asyncio.create_task(c.post("/v1/lora/load", json={"loras": [{"name": "one"}]}))
        while app.state.exl2_host.lora_task is None:
            await asyncio.sleep(0.005)
        later = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi"}))
        await asyncio.sleep(0.05)
        assert not load.done() and not later.done() and fake.log == ["start"]
        r = await c.post("/v1/model/load", json={"name": "one"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "lora_loading"
        r = await c.post("/v1/lora/unload")
        assert r.status_code == 409 and "being changed" in r.json()["error"]["message"]
        assert (await c.get("/v1/lora")).json()["data"] == []      # reading is never held
        streamed, loaded, answered = await asyncio.gather(first, load, later)
        assert streamed.status_code == 200 and "reply with []" in "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
            if line.startswith("data: {"))
        assert loaded.json()["success"] == ["one"]
        assert answered.json()["choices"][0]["text"] == "reply with ['one']"
        assert fake.log == ["start", "end", "set ['one'] while 0 streaming", "start", "end"]

    asyncio.run(go())


def test_the_engine_refusing_is_a_409(server, adapters):
    create_app, client = server
    fake = LoraFake()

    def busy(adapters):
        raise ConfigError("LoRAs can change only while no request is running.")

    fake.set_loras = busy
    app = create_app(fake, ServerConfig(lora_dir=adapters))

    async def go():
        return await client(app).post("/v1/lora/unload")

    r = asyncio.run(go())
    assert r.status_code == 409 and r.json()["error"] == {
        "message": "LoRAs can change only while no request is running.", "type": "invalid_request_error",
        "param": None, "code": "requests_running"}


def test_engine_changes_before_any_request_from_threads_and_after_close(adapters):
    """Engine.set_loras before any request (no generator thread yet), from several threads at once, and after
    close (a clear error)."""
    e = Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu"))
    assert e.worker._thread is None
    e.set_loras([LoraSpec(path=adapters / "one")])           # run on the calling thread: nothing else runs
    assert e.generate(PROMPT, GREEDY, 2).token_ids
    errors = []

    def change(i):
        try:
            e.set_loras([LoraSpec(path=adapters / ("one" if i % 2 else "two"))])
        except Exception as exc:   # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=change, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and [a.name for a in e.loras] in (["one"], ["two"])
    e.close()
    from exl2.errors import Exl2Error
    with pytest.raises(Exl2Error, match="closed"):
        e.set_loras([])
