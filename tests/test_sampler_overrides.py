"""TabbyAPI's sampler overrides (server.overrides): preset files, how override / force / additive change a request,
the admin endpoints that switch them, and the settings that reach the engine."""
import json

import httpx
import pytest

from exl2.config import ServerConfig
from exl2.errors import ConfigError
from exl2.server.app import create_app
from exl2.server.overrides import Overrides, find_preset, preset_names
from exl2.server.schemas import ChatCompletionRequest, CompletionRequest

from test_server import KEY, SettingsFake, aclient, run

ADMIN = "sk-admin"
HI = [{"role": "user", "content": "hi"}]


def _presets(tmp_path):
    d = tmp_path / "presets"
    d.mkdir()
    (d / "calm.yml").write_text("temperature: 0.5\n"
                                "top_p: {override: 0.9, force: true}\n"
                                "stop: {override: ['###'], additive: true}\n"
                                "banned_strings: ['shivers']\n")
    (d / "dry.json").write_text(json.dumps({"dry_multiplier": {"override": 0.8, "force": True}}))
    (d / "notes.txt").write_text("not a preset")
    return d


def test_override_force_and_additive_on_a_request(tmp_path):
    o = Overrides.from_file(_presets(tmp_path) / "calm.yml")
    assert o.name == "calm"
    sent = CompletionRequest(prompt="x", temperature=1.2, top_p=0.5, stop=["END"])
    got = o.apply(sent)
    assert (got.temperature, got.top_p, got.stop, got.banned_strings) == (1.2, 0.9, ["###", "END"], ["shivers"])
    bare = o.apply(CompletionRequest(prompt="x"))
    assert (bare.temperature, bare.top_p, bare.stop) == (0.5, 0.9, ["###"])
    one = o.apply(ChatCompletionRequest(messages=HI, stop="END"))       # a single stop string joins the list
    assert one.stop == ["###", "END"] and isinstance(one, ChatCompletionRequest)
    assert Overrides({}).apply(sent) is sent


@pytest.mark.parametrize("data,words", [({"temprature": 1}, "'temprature'"), ({"n": 2}, "'n'"),
                                        ({"temperature": -1}, "'temperature'"),
                                        ({"top_p": {"override": 0.9, "forced": True}}, "'top_p'"),
                                        ({"temperature": {"override": 0.5, "additive": True}}, "list"),
                                        ([1, 2], "mapping")])
def test_bad_presets_are_one_sentence(data, words):
    with pytest.raises(ConfigError) as e:
        Overrides.parse(data, "p")
    assert words in str(e.value) and str(e.value).count(". ") == 0


def test_preset_files_and_names(tmp_path):
    d = _presets(tmp_path)
    assert preset_names(d) == ["calm", "dry"] and preset_names(None) == []
    assert find_preset(d, "dry") == d / "dry.json"
    for name, words in (("../calm", "not the name"), ("nope", "no sampler override preset"), ("", "not the name")):
        with pytest.raises(ConfigError, match=words):
            find_preset(d, name)
    (d / "broken.yml").write_text("temperature: [0.5\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Overrides.from_file(d / "broken.yml")


def test_the_server_applies_the_preset_and_admins_switch_it(tmp_path):
    """A server started with a preset applies it to both endpoints; GET shows it (admins also see the presets);
    an admin switches to another preset or to inline rules and unloads them; others may not; a bad switch is a
    400 and keeps the preset in force."""
    d = _presets(tmp_path)
    fake = SettingsFake()
    app = create_app(fake, ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), sampler_override="calm",
                                        sampler_override_dir=d))
    c = aclient(app)

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
        await c.chat.completions.create(model="m", messages=HI, max_tokens=2, temperature=1.5, top_p=0.2)
        await c.completions.create(model="m", prompt="x", max_tokens=2)
        seen = [(await http.get("/v1/sampling/overrides", headers=h)).json() for h in (user, admin)]
        refused = await http.post("/v1/sampling/override/switch", json={"preset": "dry"}, headers=user)
        bad = await http.post("/v1/sampling/override/switch", json={"preset": "nope"}, headers=admin)
        both = await http.post("/v1/sampling/override/switch", json={"preset": "dry", "overrides": {}},
                               headers=admin)
        switched = await http.post("/v1/sampling/override/switch", json={"preset": "dry"}, headers=admin)
        await c.completions.create(model="m", prompt="x", max_tokens=2, extra_body={"dry_multiplier": 0.1})
        inline = await http.post("/v1/sampling/override/switch", json={"overrides": {"min_p": 0.2}},
                                 headers=admin)
        await c.completions.create(model="m", prompt="x", max_tokens=2)
        unloaded = await http.post("/v1/sampling/override/unload", headers=admin)
        await c.completions.create(model="m", prompt="x", max_tokens=2)
        return seen, refused, bad, both, switched, inline, unloaded

    seen, refused, bad, both, switched, inline, unloaded = run(go())
    chat, plain, dry, minp, free = fake.settings
    assert (chat.temperature, chat.top_p, chat.banned_strings) == (1.5, 0.9, ("shivers",))
    assert (plain.temperature, plain.top_p) == (0.5, 0.9)
    assert seen[0]["selected_preset"] == "calm" and "presets" not in seen[0]
    assert seen[1]["presets"] == ["calm", "dry"] and seen[1]["overrides"]["top_p"]["force"] is True
    assert refused.status_code == 403 and bad.status_code == 400 and both.status_code == 400
    assert switched.json()["selected_preset"] == "dry" and dry.dry_multiplier == 0.8
    assert inline.status_code == 200 and minp.min_p == 0.2 and minp.dry_multiplier == 0.0
    assert unloaded.json() == {"selected_preset": None, "overrides": {}} and free.min_p == 0.0


def test_an_override_the_request_makes_invalid_is_a_400(tmp_path):
    """A forced value that clashes with the rest of the request (here: two constraints) is the request's 400."""
    fake = SettingsFake()
    app = create_app(fake, ServerConfig())
    app.state.exl2_host.overrides = Overrides.parse({"regex_pattern": {"override": "[0-9]+", "force": True}})

    async def go():
        import openai
        with pytest.raises(openai.BadRequestError) as e:
            await aclient(app).completions.create(model="m", prompt="x", max_tokens=2,
                                                   extra_body={"grammar_string": 'start: "a"'})
        return e.value.body

    body = run(go())
    assert "cannot be combined" in body["message"]


@pytest.mark.parametrize("flags,words", [(["--sampler-override", "calm"], "preset directory"),
                                         (["--sampler-override", "nope", "--sampler-override-dir", "{d}"],
                                          "no sampler override preset"),
                                         (["--sampler-override-dir", "{d}/missing"], "does not exist")])
def test_serve_reports_a_bad_preset_in_one_line_before_loading(tmp_path, capsys, flags, words):
    from exl2.cli.main import main

    d = _presets(tmp_path)
    rc = main(["serve", "-m", str(tmp_path / "no-model"), "--port", "0", *[f.format(d=d) for f in flags]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and err.count("\n") == 0 and "Traceback" not in err


def test_kobold_requests_get_the_overrides_too(tmp_path):
    """A Kobold request's sampling fields count as sent only if its Kobold field was: an override fills in what
    it left out (temperature), a forced value replaces what it sent (top_p)."""
    fake = SettingsFake()
    app = create_app(fake, ServerConfig(kobold=True, sampler_override=str(_presets(tmp_path) / "calm.yml")))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            for body in ({"prompt": "x", "max_length": 2, "temperature": 1.3, "top_p": 0.3},
                         {"prompt": "x", "max_length": 2, "rep_pen": 1.1}):
                assert (await c.post("/api/v1/generate", json=body)).status_code == 200

    run(go())
    sent, bare = fake.settings
    assert (sent.temperature, sent.top_p) == (1.3, 0.9) and (bare.temperature, bare.top_p) == (0.5, 0.9)
    assert bare.repetition_penalty == 1.1 and bare.banned_strings == ("shivers",)
