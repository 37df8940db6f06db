"""MCP: the engine's tool server (in memory and over stdio), the agent loop, and the `exl2 mcp` command."""
import asyncio
import copy
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fastmcp import Client, FastMCP
from fastmcp.client.transports import StdioTransport
from fastmcp.exceptions import ToolError

from exl2.cli.main import main
from exl2.cli.mcp import server_config
from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.generation.generator import GenerationResult
from exl2.mcp import server as mcp_server
from exl2.mcp.agent import ToolCall, run_agent
from exl2.mcp.server import build_server

from test_cli import SRC

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingSettings(temperature=0)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))


@pytest.fixture(scope="module")
def server(engine):
    return build_server(engine)


async def _call(server, name, args, progress=None):
    async def on_progress(p, total, message):
        progress.append((p, total))

    async with Client(server, progress_handler=on_progress if progress is not None else None) as client:
        return await client.call_tool(name, args)


def _check_progress(progress, completion_tokens, max_tokens):
    assert progress, "no progress notification arrived"
    counts = [p for p, _ in progress]
    assert counts == sorted(set(counts)), counts              # strictly increasing
    assert counts[-1] == completion_tokens
    assert all(total == max_tokens for _, total in progress)


# ---- the tool server ------------------------------------------------------------------------------------------

def test_generate_tool_matches_engine_and_reports_progress(engine, server, monkeypatch):
    monkeypatch.setattr(mcp_server, "PROGRESS_INTERVAL_S", 0.0)  # one notification per streamed piece
    prompt, n = "The quick brown fox", 12
    progress = []
    out = asyncio.run(_call(server, "generate", {"prompt": prompt, "max_tokens": n, "temperature": 0}, progress))
    ref = engine.generate(prompt, GREEDY, n)
    assert out.structured_content == {"text": ref.text, "finish_reason": ref.finish_reason,
                                      "prompt_tokens": len(engine.tokenizer.encode(prompt)),
                                      "completion_tokens": len(ref.token_ids)}
    assert len(progress) > 1
    _check_progress(progress, len(ref.token_ids), n)


def test_chat_tool_renders_the_template(engine, server):
    msgs = [{"role": "user", "content": "Hello, who are you?"}]
    progress = []
    out = asyncio.run(_call(server, "chat", {"messages": msgs, "system": "Be terse.", "max_tokens": 10,
                                            "temperature": 0}, progress))
    prompt = engine.chat_prompt([{"role": "system", "content": "Be terse."}, *msgs])
    ref = engine.generator.generate(prompt, GREEDY, 10, add_bos=False)
    assert out.structured_content["text"] == ref.text
    assert out.structured_content["prompt_tokens"] == ref.prompt_tokens
    assert out.structured_content["completion_tokens"] == len(ref.token_ids)
    _check_progress(progress, len(ref.token_ids), 10)


def test_structured_output_and_repetition_penalty(engine, server):
    """json_schema holds the reply to JSON matching the schema (chat and generate); repetition_penalty reaches the
    sampler (the greedy reply equals the engine's with the same penalty)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}}}
    msgs = [{"role": "user", "content": "Plan a trip."}]
    out = asyncio.run(_call(server, "chat", {"messages": msgs, "max_tokens": 120, "temperature": 1.0, "seed": 1,
                                             "json_schema": schema})).structured_content
    value = json.loads(out["text"])
    assert set(value) == {"city", "days"} and isinstance(value["days"], int) and len(value["city"]) <= 10
    assert out["finish_reason"] == "stop"
    out = asyncio.run(_call(server, "generate", {"prompt": "Data:", "max_tokens": 60, "temperature": 0.8,
                                                 "seed": 4, "json_schema": {}})).structured_content
    if out["finish_reason"] == "stop":     # the tiny model may pad with whitespace until max_tokens
        assert isinstance(json.loads(out["text"]), dict)
    else:
        assert out["text"].lstrip().startswith("{")
    prompt = "one one one one one"
    out = asyncio.run(_call(server, "generate", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                 "repetition_penalty": 1.5})).structured_content
    ref = engine.generate(prompt, SamplingSettings(temperature=0, repetition_penalty=1.5), 12)
    assert out["text"] == ref.text and ref.text != engine.generate(prompt, GREEDY, 12).text


def test_http_transport_takes_api_keys(engine):
    """With api_keys the Streamable HTTP transport answers only requests bearing one (401 otherwise)."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    app = build_server(engine, api_keys=["k1", "k2"]).http_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{port}/mcp"

        async def tools(key):
            async with Client(url, auth=key) as client:
                return sorted(t.name for t in await client.list_tools())

        assert "generate" in asyncio.run(tools("k2"))
        hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                 "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                            "clientInfo": {"name": "t", "version": "1"}}}
        head = {"Accept": "application/json, text/event-stream"}
        assert httpx.post(url, json=hello, headers=head).status_code == 401
        assert httpx.post(url, json=hello, headers={**head, "Authorization": "Bearer nope"}).status_code == 401
    finally:
        server.should_exit = True
        thread.join(5)



def test_api_key_with_stdio_is_one_sentence(capsys):
    assert main(["mcp", "serve", "--api-key", "k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "protects the HTTP transport" in err[0]


def test_tokenize_detokenize_and_model_info(engine, server):
    text = "Tokens, please: 12345 ünïcode"
    ids = engine.tokenizer.encode(text)
    assert asyncio.run(_call(server, "tokenize", {"text": text})).structured_content == {"ids": ids,
                                                                                        "count": len(ids)}
    assert asyncio.run(_call(server, "detokenize", {"ids": ids})).data == engine.tokenizer.decode(ids)
    info = asyncio.run(_call(server, "model_info", {})).structured_content
    spec = engine.model.spec
    assert info["name"] == "src" and info["architecture"] == spec.arch == "LlamaForCausalLM"
    assert (info["layers"], info["hidden_size"], info["vocab_size"]) == (spec.num_layers, spec.hidden_size,
                                                                         spec.vocab_size)
    assert info["context_length"] == 512 and info["cache_mode"] == "fp16" and info["weight_format"] == "fp16"


def test_embed_tool(engine, server):
    texts = ["first text", "a second one"]
    out = asyncio.run(_call(server, "embed", {"texts": texts, "dimensions": 16})).structured_content
    want = engine.embed(texts, 16)
    assert out["tokens"] == want.tokens
    assert torch.allclose(torch.tensor(out["embeddings"]), want.vectors, atol=1e-6)


@pytest.mark.parametrize("name,args,match", [
    ("generate", {"prompt": "word " * 600}, r"^The prompt is \d+ tokens long but the context holds 512 tokens\.$"),
    ("generate", {"prompt": "x", "temperature": -1}, r"^Invalid temperature: input should be"),
    ("generate", {"prompt": "x", "max_tokens": 0}, r"^Invalid max_tokens: input should be"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, r"^Invalid top_p: "),
    ("chat", {"messages": [{"role": "system", "content": "a"}], "system": "b"}, r"^Give the system prompt"),
    ("detokenize", {"ids": [5, 10**6]}, r"^Token id 1000000 is outside the vocabulary"),
    ("embed", {"texts": ["word " * 600]}, r"^Input 0 is \d+ tokens long but the context holds 512 tokens\.$"),
    ("embed", {"texts": ["x"], "dimensions": 100000}, r"^dimensions must be between 1 and"),
    ("embed", {"texts": []}, r"^Invalid texts: "),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "json_schema": {"type": "nonsense"}},
     r"^The output format is invalid: "),
    ("generate", {"prompt": "x", "repetition_penalty": 0}, r"^Invalid repetition_penalty: "),
])
def test_user_errors_are_one_sentence_tool_errors(server, name, args, match):
    with pytest.raises(ToolError, match=match) as e:
        asyncio.run(_call(server, name, args))
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


# ---- the agent loop -------------------------------------------------------------------------------------------

def _call_text(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class FakeEngine:
    """Engine stand-in: canned replies in turn (the last repeats), every rendered conversation recorded."""

    model_name = "fake"

    def __init__(self, replies):
        self.replies, self.prompts, self.add_bos = list(replies), [], []

    def chat_prompt(self, messages, tools=None):
        self.prompts.append({"messages": copy.deepcopy(messages), "tools": tools})
        return f"prompt {len(self.prompts)}"

    async def aevents(self, prompt, settings=None, max_new_tokens=256, stop_strings=(), add_bos=None):
        self.add_bos.append(add_bos)
        text = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        for i in range(0, len(text), 7):
            yield text[i:i + 7], None
        yield "", GenerationResult(text, [1] * 5, "stop", 3)


def _tool_server():
    s = FastMCP("tools")

    @s.tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @s.tool
    def weather(city: str) -> str:
        """Weather in a city."""
        raise ValueError(f"no weather station in {city}")

    return s


def test_agent_calls_a_tool_and_answers():
    fake = FakeEngine([_call_text("add", a=2, b=3), "2 + 3 = 5."])
    seen = []
    result = asyncio.run(run_agent(fake, Client(_tool_server()), "What is 2 + 3?", GREEDY, on_tool_call=seen.append))
    assert result.text == "2 + 3 = 5." and result.finish_reason == "stop" and result.turns == 2
    assert result.tool_calls == seen == [ToolCall("add", {"a": 2, "b": 3}, "5")]
    first, second = fake.prompts
    add = next(t for t in first["tools"] if t["function"]["name"] == "add")
    assert add["type"] == "function" and add["function"]["description"] == "Add two integers."
    assert set(add["function"]["parameters"]["properties"]) == {"a", "b"}
    assert first["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assistant, tool = second["messages"][1:]
    assert assistant["role"] == "assistant"
    assert [c["function"] for c in assistant["tool_calls"]] == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert tool["role"] == "tool" and tool["name"] == "add" and tool["content"] == "5"
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert result.messages[-1] == {"role": "assistant", "content": "2 + 3 = 5."}
    assert fake.add_bos == [False, False]


def test_agent_reports_tool_errors_to_the_model():
    fake = FakeEngine([_call_text("weather", city="Atlantis") + _call_text("teleport", to="Mars"),
                       "I could not find out."])
    result = asyncio.run(run_agent(fake, Client(_tool_server()), "Weather in Atlantis?", GREEDY))
    assert result.text == "I could not find out." and result.finish_reason == "stop"
    tool_msgs = [m for m in fake.prompts[1]["messages"] if m["role"] == "tool"]
    assert [m["name"] for m in tool_msgs] == ["weather", "teleport"]
    assert tool_msgs[0]["content"].startswith("Error") and "no weather station in Atlantis" in tool_msgs[0]["content"]
    assert tool_msgs[1]["content"].startswith("Error") and "teleport" in tool_msgs[1]["content"]
    assert all(c.is_error for c in result.tool_calls)


def test_agent_stops_at_max_turns():
    fake = FakeEngine(["Let me add. " + _call_text("add", a=1, b=1)])
    result = asyncio.run(run_agent(fake, Client(_tool_server()), "Add forever.", GREEDY, max_turns=3))
    assert result.finish_reason == "max_turns" and result.turns == 3 and len(fake.prompts) == 3
    assert len(result.tool_calls) == 2          # the last turn's call is not made
    assert result.text == "Let me add."


def test_agent_with_the_real_engine_terminates(engine):
    result = asyncio.run(run_agent(engine, Client(_tool_server()), "What is 2 + 3?", GREEDY, max_turns=2,
                                   max_tokens=16))
    assert result.finish_reason in ("stop", "length", "max_turns") and 1 <= result.turns <= 2
    assert result.messages[0] == {"role": "user", "content": "What is 2 + 3?"}


# ---- the command --------------------------------------------------------------------------------------------------

def test_server_specs_become_an_mcp_config(tmp_path):
    cfg_file = tmp_path / "servers.json"
    cfg_file.write_text(json.dumps({"mcpServers": {"files": {"command": "npx", "args": ["-y", "fs-server"]}}}))
    servers = server_config(["https://example.com/mcp", f"{sys.executable} '{tmp_path}/weather.py' --x 1",
                             str(cfg_file), "http://example.com:8080/sse"])["mcpServers"]
    assert servers["example_com"] == {"url": "https://example.com/mcp"}
    assert servers["example_com_2"] == {"url": "http://example.com:8080/sse"}
    assert servers["weather"]["command"] == sys.executable
    assert servers["weather"]["args"] == [f"{tmp_path}/weather.py", "--x", "1"]
    assert servers["files"] == {"command": "npx", "args": ["-y", "fs-server"]}


@pytest.mark.parametrize("spec", ["no-such-command-xyz --stdio", "ftp://example.com/mcp", "missing.json", "  ",
                                  "http://127.0.0.1:1/mcp"])
def test_cli_agent_bad_server_is_one_line_error(spec, capsys):
    rc = main(["mcp", "agent", "-m", str(SRC), "--device", "cpu", "-l", "512", "--server", spec, "-p", "hi"])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_cli_agent_runs_against_a_stdio_server(tmp_path, capfd):  # capfd: the server inherits stderr's fd
    script = tmp_path / "calc.py"
    script.write_text(textwrap.dedent("""
        from fastmcp import FastMCP
        s = FastMCP("calc")

        @s.tool
        def add(a: int, b: int) -> int:
            return a + b

        s.run(show_banner=False)
    """))
    rc = main(["mcp", "agent", "-m", str(SRC), "--device", "cpu", "-l", "512", "--server",
               f"{sys.executable} {script}", "-p", "What is 2 + 3?", "--max-turns", "2", "-n", "8", "-temp", "0"])
    out, err = capfd.readouterr()
    assert rc == 0 and out.endswith("\n"), err


def test_cli_serve_over_stdio(engine):
    transport = StdioTransport(sys.executable, ["-m", "exl2.cli.main", "mcp", "serve", "-m", str(SRC), "--device",
                                                "cpu", "-l", "512"],
                               env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=str(REPO))

    async def drive():
        async with Client(transport, init_timeout=300, timeout=300) as client:  # a loaded CI machine starts slowly
            names = {t.name for t in await client.list_tools()}
            return names, (await client.call_tool("tokenize", {"text": "Hello world"})).structured_content

    names, tokens = asyncio.run(drive())
    assert names == {"generate", "chat", "tokenize", "detokenize", "embed", "model_info"}
    assert tokens["ids"] == engine.tokenizer.encode("Hello world")
