"""Chosen chat templates (TabbyAPI's prompt_template): by file, by name in a template directory, bundled, or named
in tokenizer_config.json; the per-model tabby_template.jinja; the Engine, CLI and server switches."""
import asyncio
import json
import shutil
from pathlib import Path

import pytest

from exl2.config import EngineConfig, ServerConfig
from exl2.errors import ConfigError
from exl2.generation.chat import CHATML_TEMPLATE
from exl2.generation.templates import ALPACA_TEMPLATE, choose_template, template_file, template_names
from exl2.generation.tokenizer import Tokenizer

SRC = Path(__file__).parent / "fixtures" / "golden" / "src"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
MARKER = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SRC)


@pytest.fixture
def tdir(tmp_path):
    d = tmp_path / "templates"
    d.mkdir()
    (d / "marker.jinja").write_text(MARKER)
    (d / "broken.jinja").write_text("{% for m in messages %}")
    (d / ".hidden.jinja").write_text(MARKER)
    return d


def test_the_models_own_template_by_default(tok):
    t = choose_template(tok, None)           # this model has none: the ChatML fallback
    assert tok.chat_template is None and t.is_fallback and t.source == CHATML_TEMPLATE and t.name is None


def test_alpaca_renders_the_instruction_format(tok):
    t = choose_template(tok, "alpaca")
    bos, eos = tok.special_tokens_map.get("bos_token", ""), tok.special_tokens_map.get("eos_token", "")
    assert t.source == ALPACA_TEMPLATE and t.name == "alpaca"
    assert t.render(CHAT) == (f"{bos}Be brief.\n\n### Instruction:\nHi\n\n### Response:\nHello{eos}\n\n"
                              "### Instruction:\nBye\n\n### Response:\n")
    assert t.render(CHAT[:2], add_generation_prompt=False) == f"{bos}Be brief.\n\n### Instruction:\nHi\n\n"


def test_names_files_and_directories(tok, tdir, tmp_path):
    assert choose_template(tok, "chatml").source == CHATML_TEMPLATE
    by_name = choose_template(tok, "marker", tdir)
    assert by_name.name == "marker" and by_name.render(CHAT[1:2]) == "[user] Hi\n>"
    by_file = choose_template(tok, str(tdir / "marker.jinja"))
    assert by_file.source == MARKER and by_file.name == "marker"
    assert template_file(tdir, "marker") == str(tdir / "marker.jinja")
    assert template_file(tdir, "chatml") == "chatml" and template_file(None, "marker") == "marker"
    assert template_names(tdir, tok) == ["alpaca", "broken", "chatml", "marker"]
    with pytest.raises(ConfigError, match="no prompt template named 'nope'; the names are: alpaca, broken, chatml, "
                                          "marker"):
        choose_template(tok, "nope", tdir)
    with pytest.raises(ConfigError, match="does not exist"):
        choose_template(tok, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="syntax error"):
        choose_template(tok, "broken", tdir)
    with pytest.raises(ConfigError, match="file .hidden does not exist"):     # not a name: hidden files are not listed
        choose_template(tok, ".hidden", tdir)


def _model_copy(tmp_path, **tokenizer_config):
    d = tmp_path / "model"
    shutil.copytree(SRC, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_config)
    cfg_path.write_text(json.dumps(cfg))
    return d


def test_tokenizer_config_named_templates(tmp_path):
    d = _model_copy(tmp_path, chat_template=[{"name": "default", "template": "D{{ messages | length }}"},
                                             {"name": "tool_use", "template": "T{{ messages | length }}"}])
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template == "D{{ messages | length }}" and set(tok.named_templates) == {"default", "tool_use"}
    assert choose_template(tok, "tool_use").render(CHAT) == "T4"
    assert "tool_use" in template_names(None, tok)


def test_tabby_template_in_the_model_directory_wins(tmp_path):
    d = _model_copy(tmp_path)
    (d / "tabby_template.jinja").write_text(MARKER)
    assert Tokenizer.from_dir(d).chat_template == MARKER


def test_engine_runs_and_switches_templates(tdir):
    from exl2.engine import Engine

    with pytest.raises(ConfigError, match="no prompt template named"):
        Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu", prompt_template="nope")).close()
    engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu", prompt_template="alpaca"))
    try:
        assert engine.chat_prompt(CHAT).endswith("### Instruction:\nBye\n\n### Response:\n")
        assert engine.set_template(str(tdir / "marker.jinja")).name == "marker"
        assert engine.chat_prompt(CHAT[1:2]) == "[user] Hi\n>"
        assert engine.set_template(None).is_fallback
    finally:
        engine.close()


def test_chat_cli_takes_a_template(capsys, monkeypatch, tdir):
    import io

    from exl2.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    rc = main.main(["chat", "-m", str(SRC), "--device", "cpu", "--temperature", "0", "-maxr", "2",
                    "--prompt-template", "nope"])
    assert rc != 0 and "no prompt template named 'nope'" in capsys.readouterr().err


# ---- server --------------------------------------------------------------------------------------------------

ADMIN, KEY = "sk-admin", "sk-api"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("fastapi")
    import httpx

    from exl2.engine import Engine
    from exl2.server.app import create_app

    d = tmp_path_factory.mktemp("templates")
    (d / "marker.jinja").write_text(MARKER)
    engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))
    app = create_app(engine, ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), template_dir=d))
    yield engine, lambda: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    engine.close()


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_server_lists_and_switches_templates(served):
    engine, client = served

    async def go():
        c = client()
        r = await c.get("/v1/template/list", headers=_auth(KEY))
        assert r.json() == {"object": "list", "data": ["alpaca", "chatml", "marker"]}
        assert (await c.get("/v1/templates", headers=_auth(KEY))).json() == r.json()

        async def encoded():
            r = await c.post("/v1/token/encode", headers=_auth(KEY), json={"text": CHAT[1:2]})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        own = await encoded()
        r = await c.post("/v1/template/switch", headers=_auth(KEY), json={"prompt_template_name": "marker"})
        assert r.status_code in (401, 403)                                   # an admin change
        r = await c.post("/v1/template/switch", headers=_auth(ADMIN), json={"prompt_template_name": "marker"})
        assert r.status_code == 200 and r.json() == {"prompt_template": "marker"}, r.text
        assert await encoded() == engine.tokenizer.encode("[user] Hi\n")
        card = (await c.get("/v1/model", headers=_auth(KEY))).json()
        assert card["parameters"]["prompt_template"] == "marker"
        r = await c.post("/v1/template/switch", headers=_auth(ADMIN), json={"name": "nope"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "template_not_found", r.text
        assert "the names are: alpaca, chatml, marker" in r.json()["error"]["message"]
        r = await c.post("/v1/template/unload", headers=_auth(ADMIN))
        assert r.status_code == 200 and r.json() == {"prompt_template": "fallback (ChatML)"}
        assert await encoded() == own

    asyncio.run(go())
