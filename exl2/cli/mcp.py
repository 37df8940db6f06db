"""`exl2 mcp`: serve the engine as MCP tools (stdio or HTTP), or run the local model as an agent over MCP servers."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

from exl2.cli.common import (KEY_ENV, add_draft_args, add_lora_args, add_model_args, add_sampling_args,
                             add_template_arg, engine_settings, env_keys, flag_error, load_bar, sampling_from_args)
from exl2.errors import ConfigError, ContextLengthError

# Launchers whose first real argument names the server better than the launcher does (`python weather.py`).
_LAUNCHERS = {"python", "python3", "node", "npx", "uv", "uvx", "bun", "bunx", "deno", "pipx", "docker"}


def register(sub) -> None:
    p = sub.add_parser("mcp", help="MCP tool server and MCP agent",
                       description="Serve the model as Model Context Protocol tools, or let it call the tools of "
                                   "MCP servers to answer a prompt.")
    mcp_sub = p.add_subparsers(dest="mcp_command", metavar="{serve,agent}", required=True)

    s = mcp_sub.add_parser("serve", help="serve generate/chat/tokenize/model_info as MCP tools",
                           description="Run an MCP server whose tools use the model: generate, chat (with progress "
                                       "notifications as tokens arrive), tokenize, detokenize, model_info.")
    add_model_args(s)
    add_template_arg(s)
    add_draft_args(s)
    add_lora_args(s)
    s.add_argument("--vision", action="store_true",
                   help="load the model's vision tower, so the chat tool takes images (Mistral 3, Pixtral, Gemma 3, "
                        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    s.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="stdio (default; the client launches this command) or http (Streamable HTTP at /mcp)")
    s.add_argument("--host", default="127.0.0.1", help="HTTP address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--name", default=None, help="server name shown to clients (default: exl2 (MODEL))")
    s.add_argument("--api-key", "--api_key", dest="api_keys", action="append", default=[], metavar="KEY",
                   help="with --transport http: answer only requests bearing this key (Authorization: Bearer KEY; "
                        "repeatable); without any, comma-separated keys are read from $EXL2_API_KEY; no key at all = "
                        "no authentication")
    s.set_defaults(func=run_serve)

    a = mcp_sub.add_parser("agent", help="answer a prompt, calling the tools of MCP servers",
                           description="Let the model answer a prompt, calling tools of MCP servers through its chat "
                                       "template. Prints the answer to stdout and every tool call to stderr.",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="SPEC is a URL (http/https, Streamable HTTP; ending in /sse: SSE), a command line "
                                  "that starts a stdio server (e.g. 'python weather.py'; it inherits this "
                                  "environment), or a JSON file with {\"mcpServers\": {...}} as Claude Desktop uses. "
                                  "With several servers, tool names get the server's name as a prefix.")
    add_model_args(a)
    add_template_arg(a)
    add_draft_args(a)
    add_lora_args(a)
    a.add_argument("--server", dest="servers", action="append", required=True, metavar="SPEC",
                   help="MCP server: URL, command line or JSON config file (repeatable)")
    a.add_argument("-p", "--prompt", required=True, help="the user's request")
    a.add_argument("-sp", "--system_prompt", "--system-prompt", dest="system_prompt", default=None,
                   help="system prompt")
    a.add_argument("--max-turns", "--max_turns", dest="max_turns", type=int, default=8,
                   help="most model replies before giving up (default 8)")
    a.add_argument("-n", "--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=1024,
                   help="maximum tokens per reply (default 1024)")
    add_sampling_args(a, temperature=0.6)
    a.set_defaults(func=run_agent_cmd)


def load_engine(args):
    """An Engine from the model flags; invalid settings become one-sentence ConfigErrors."""
    from pydantic import ValidationError

    from exl2.config import EngineConfig
    from exl2.engine import Engine

    try:
        config = EngineConfig(**engine_settings(args), vision=getattr(args, "vision", False))  # agent: none
    except ValidationError as e:
        raise flag_error(e) from None
    with load_bar() as progress:
        return Engine(config, progress)


# ---- serve ------------------------------------------------------------------------------------------------------

def run_serve(args) -> int:
    from exl2.mcp.server import build_server

    if not 0 < args.port < 65536:
        raise ConfigError(f"Invalid --port {args.port}: use 1 to 65535.")
    keys = [k.strip() for k in args.api_keys] or env_keys(KEY_ENV)
    if any(not k for k in keys):
        raise ConfigError("--api-key must not be empty.")
    if args.api_keys and args.transport == "stdio":
        raise ConfigError("--api-key protects the HTTP transport; with stdio the client that launches the server "
                          "is the only one talking to it.")
    if args.transport == "stdio":
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the protocol: nothing else may go there
            engine = load_engine(args)
        build_server(engine, args.name).run("stdio", show_banner=False)
        return 0
    engine = load_engine(args)
    server = build_server(engine, args.name, keys)
    auth = f" (API key required: {len(keys)} accepted)" if keys else " (no API key: anyone who can reach it may use it)"
    print(f"exl2 MCP server for {engine.model_name} on http://{args.host}:{args.port}/mcp{auth}", file=sys.stderr)
    server.run("http", show_banner=False, host=args.host, port=args.port)
    return 0


# ---- agent ------------------------------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_") or "server"


def _command_name(argv: list[str]) -> str:
    """A short server name for a command line: the script or package it runs, else the command."""
    name = Path(argv[0]).name
    if re.sub(r"[\d.]+$", "", name) in _LAUNCHERS:
        rest = [x for x in argv[1:] if not x.startswith("-") and x not in ("run", "exec")]
        if rest:
            name = rest[0].rstrip("/").rsplit("/", 1)[-1]
    return _slug(Path(name).stem if name.endswith((".py", ".js", ".ts")) else name)


def _entries(spec: str) -> list[tuple[str, dict]]:
    """(name, MCPConfig server entry) pairs for one --server SPEC."""
    s = spec.strip()
    if not s:
        raise ConfigError("An empty --server was given; pass a URL, a command line or a JSON MCP config file.")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", s):
        url = urlparse(s)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"--server {s!r} is not an http(s) URL with a host.")
        return [(_slug(url.hostname), {"url": s})]
    if s.lower().endswith(".json") and not any(c.isspace() for c in s):
        return list(_config_file(Path(s).expanduser()).items())
    try:
        argv = shlex.split(s)
    except ValueError as e:
        raise ConfigError(f"--server {s!r} is not a valid command line ({e}).") from None
    if not (shutil.which(argv[0]) or (Path(argv[0]).is_file() and os.access(argv[0], os.X_OK))):
        raise ConfigError(f"--server {s!r}: command {argv[0]!r} was not found (nor is it a URL or a .json file).")
    return [(_command_name(argv), {"command": argv[0], "args": argv[1:], "env": dict(os.environ)})]


def _config_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"MCP config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"MCP config file {path} could not be read as JSON ({e}).") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise ConfigError(f"MCP config file {path} has no \"mcpServers\" object.")
    for name, entry in servers.items():
        if not isinstance(entry, dict) or not ("command" in entry or "url" in entry):
            raise ConfigError(f"MCP config file {path}: server {name!r} needs a \"command\" or a \"url\".")
    return servers


def server_config(specs: list[str]) -> dict:
    """An MCPConfig dict for all --server SPECs (names made unique); each entry checked against fastmcp's model."""
    from fastmcp.mcp_config import RemoteMCPServer, StdioMCPServer
    from pydantic import ValidationError

    servers: dict[str, dict] = {}
    for spec in specs:
        for name, entry in _entries(spec):
            key, n = name, 2
            while key in servers:
                key, n = f"{name}_{n}", n + 1
            try:
                (RemoteMCPServer if "url" in entry else StdioMCPServer).model_validate(entry)
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                field = ".".join(str(x) for x in err["loc"])
                raise ConfigError(f"MCP server {name!r}: invalid {field or 'entry'} ({err['msg']}).") from None
            servers[key] = entry
    return {"mcpServers": servers}


def _reason(e: BaseException) -> str:
    """The innermost, first-line message of a connection failure."""
    while getattr(e, "exceptions", None):  # an exception group (Python 3.10 has no builtin name for it)
        e = e.exceptions[0]
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text.removeprefix("Client failed to connect: ").rstrip(".")


def _short(text: str, limit: int = 160) -> str:
    one = " ".join(text.split())
    return one if len(one) <= limit else one[: limit - 1] + "…"


def _print_call(call) -> None:
    args = json.dumps(call.arguments, ensure_ascii=False)
    print(f"[tool] {call.name}({args}) {'failed: ' if call.is_error else '→ '}{_short(call.result)}",
          file=sys.stderr, flush=True)


async def _agent(args, settings, config: dict) -> int:
    from fastmcp import Client
    from mcp.shared.exceptions import McpError

    from exl2.mcp.agent import run_agent

    client = Client(config)
    async with contextlib.AsyncExitStack() as stack:
        try:  # connect before loading the model: a wrong server fails in a second, not after the load
            await stack.enter_async_context(client)
        except Exception as e:
            raise ConfigError(f"Could not connect to the MCP server ({', '.join(args.servers)}): "
                              f"{_reason(e)}.") from None
        engine = await asyncio.to_thread(load_engine, args)
        try:
            result = await run_agent(engine, client, args.prompt, settings, max_turns=args.max_turns,
                                     max_tokens=args.max_new_tokens, system=args.system_prompt,
                                     on_tool_call=_print_call)
        except McpError as e:
            raise ConfigError(f"The MCP server failed: {_reason(e)}.") from None
        except ContextLengthError as e:
            raise ContextLengthError(f"{e} The tools' descriptions are part of every prompt: raise --max-seq-len "
                                     "or connect fewer servers.") from None
    print(result.text)
    if result.finish_reason == "max_turns":
        print(f"note: stopped after {result.turns} turns with the model still calling tools (--max-turns).",
              file=sys.stderr)
    elif result.finish_reason == "length":
        print("note: the answer was cut at --max-new-tokens.", file=sys.stderr)
    return 0


def run_agent_cmd(args) -> int:
    if args.max_turns < 1:
        raise ConfigError("--max-turns must be at least 1.")
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1.")
    settings = sampling_from_args(args)
    config = server_config(args.servers)
    return asyncio.run(_agent(args, settings, config))
