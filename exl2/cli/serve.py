"""`exl2 serve`: the OpenAI-compatible HTTP API (docs/server.md) for one model at a time, run by uvicorn."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import socket
import sys
from types import SimpleNamespace

from exl2.cli.common import (KEY_ENV, add_draft_args, add_lora_args, add_model_args, add_template_arg,
                             engine_settings, env_keys, load_bar)
from exl2.errors import ConfigError

_PARSER: argparse.ArgumentParser | None = None   # the serve parser, whose defaults tell which flags were left unset
ADMIN_KEY_ENV = "EXL2_ADMIN_KEY"


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/chat/completions, /v1/completions and /v1/models (streaming, tools, "
                                   "API keys) for one model. See docs/server.md.")
    global _PARSER
    _PARSER = p
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TabbyAPI's config.yml: its network, model, draft_model, lora and sampling settings where no "
                        "flag sets them (docs/server.md)")
    add_model_args(p)
    add_lora_args(p)
    add_draft_args(p)
    p.add_argument("--vision", action="store_true",
                   help="load the model's vision tower, so chat messages may hold images (image_url parts: data URIs "
                        "or http(s) URLs); Mistral 3.1/3.2, Pixtral, Gemma 3, Qwen2-VL, "
                        "Qwen2.5-VL and Qwen3-VL")
    p.add_argument("--pan-and-scan", "--pan_and_scan", dest="pan_and_scan", action="store_true", default=None,
                   help="Gemma 3 with --vision: also read crops of images much wider or taller than square")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=5000, help="TCP port (default 5000; 0 = any free port)")
    p.add_argument("--api-key", "--api_key", dest="api_keys", action="append", default=[], metavar="KEY",
                   help=f"accept this key (repeatable); without any, also read comma-separated keys from ${KEY_ENV}; "
                        "no key at all = no authentication")
    p.add_argument("--admin-key", "--admin_key", dest="admin_keys", action="append", default=[], metavar="KEY",
                   help="accept this key for loading and unloading models (repeatable; it works as an API key "
                        f"too); without any, also read comma-separated keys from ${ADMIN_KEY_ENV}. With no admin "
                        "key, loading and unloading are open when there is no API key either, else disabled")
    p.add_argument("--model-dir-root", "--model_dir_root", dest="model_dir_root", default=None, metavar="DIR",
                   help="directory whose model directories /v1/model/list shows and POST /v1/model/load loads by "
                        "name; with it and no -m the server starts with no model loaded")
    p.add_argument("--inline-model-loading", "--inline_model_loading", dest="inline_model_loading",
                   action="store_true", help="a completion or chat request whose model names another model of "
                                              "--model-dir-root loads it first (TabbyAPI's inline loading)")
    p.add_argument("--lora-dir", "--lora_dir", dest="lora_dir", default=None, metavar="DIR",
                   help="directory whose LoRA adapter directories /v1/lora/list shows and POST /v1/lora/load "
                        "applies by name")
    p.add_argument("--model-name", "--model_name", dest="model_name", default=None,
                   help="model id reported by /v1/models and in responses (default: the model directory's name)")
    p.add_argument("--max-batch-size", "--max_batch_size", dest="max_batch_size", type=int, default=16,
                   help="most requests generated at once (default 16)")
    p.add_argument("--cache-size", "--cache_size", dest="cache_size", type=int, default=None,
                   help="tokens of KV cache all requests share (default: --max_seq_len; more lets more long "
                        "requests run at once and keeps more prompt prefixes cached)")
    p.add_argument("--host-cache", "--host_cache", dest="host_cache_gb", type=float, default=None, metavar="GB",
                   help="host memory for cached prompt pages the KV cache evicts, copied back when a later prompt "
                        "starts with them (default 0: none)")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=1024,
                   help="completion length for requests that give no max_tokens (default 1024)")
    p.add_argument("--reasoning-parser", "--reasoning_parser", dest="reasoning_parser",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="return chat replies' <think>...</think> block as reasoning_content, apart from content "
                        "(default: on when the model's chat template mentions <think> or [THINK])")
    p.add_argument("--reasoning-start-token", "--reasoning_start_token", dest="reasoning_start_token", default=None,
                   metavar="TAG", help="the tag that opens a reply's reasoning, with --reasoning-end-token (default: "
                                       "the chat template's pair, <think> or [THINK], else <think>)")
    p.add_argument("--reasoning-end-token", "--reasoning_end_token", dest="reasoning_end_token", default=None,
                   metavar="TAG", help="the tag that closes a reply's reasoning (default: </think> or [/THINK])")
    p.add_argument("--log-prompt", "--log_prompt", dest="log_prompt", action="store_true",
                   help="log each completion request's prompt (TabbyAPI's log_prompt)")
    p.add_argument("--log-generation-params", "--log_generation_params", dest="log_generation_params",
                   action="store_true", help="log each completion request's sampling settings, max_tokens and stops")
    p.add_argument("--sse-ping-interval", "--sse_ping_interval", dest="sse_ping_interval", type=float, default=15.0,
                   metavar="S", help="seconds between a streamed reply's keep-alive pings (default 15; 0 = none)")
    p.add_argument("--cors-origin", "--cors_origin", dest="cors_origins", action="append", default=[],
                   metavar="ORIGIN", help="let browser apps on this origin call the API, e.g. http://localhost:3000 "
                                          "(repeatable; '*' = any origin; default: no CORS headers)")
    p.add_argument("--sampler-override", "--sampler_override", dest="sampler_override", default=None,
                   metavar="PRESET", help="sampler overrides every request gets (TabbyAPI's presets): a preset name "
                                          "in --sampler-override-dir, or a .yml/.json preset file")
    p.add_argument("--sampler-override-dir", "--sampler_override_dir", dest="sampler_override_dir", default=None,
                   metavar="DIR", help="the presets /v1/sampling/override/switch can put in force by name")
    add_template_arg(p)
    p.add_argument("--embedding-model", "--embedding_model", dest="embedding_model", default=None, metavar="DIR",
                   help="an embedding model loaded beside the served one to answer /v1/embeddings: a decoder "
                        "embedding model (Qwen3-Embedding) or a BERT/RoBERTa/XLM-R sentence-transformers model "
                        "(bge, e5, MiniLM) (TabbyAPI's embedding_model_dir / embedding_model_name)")
    p.add_argument("--embedding-pooling", "--embedding_pooling", dest="embedding_pooling", default=None,
                   choices=["last", "mean", "cls"],
                   help="how /v1/embeddings pools the final hidden states (default: the model's sentence-transformers "
                        "1_Pooling config, else the last token)")
    p.add_argument("--template-var", "--template_var", dest="template_vars", action="append", default=[],
                   metavar="NAME=VALUE", help="a chat-template variable every chat request gets unless it sets its "
                                              "own (VALUE as JSON, else text; e.g. enable_thinking=false; repeatable)")
    p.add_argument("--force-template-var", "--force_template_var", dest="force_template_vars", action="append",
                   default=[], metavar="NAME=VALUE", help="... that no request can change (repeatable)")
    p.add_argument("--start-in-reasoning", "--start_in_reasoning", dest="start_in_reasoning", default="auto",
                   choices=["auto", "always", "never"],
                   help="whether chat replies start inside a think block (default auto: where the rendered prompt "
                        "ends with <think>)")
    p.add_argument("--template-dir", "--template_dir", dest="template_dir", default=None, metavar="DIR",
                   help="directory of chat templates (NAME.jinja) that --prompt-template, /v1/template/switch and "
                        "model loads name (TabbyAPI's templates/)")
    p.add_argument("--kobold", action="store_true",
                   help="also serve the KoboldAI API under /api (KoboldAI Lite, SillyTavern's Kobold mode)")
    p.set_defaults(func=run)


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (tests and embedders swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _log_to_stderr() -> None:
    """The server's own log lines (a line per finished request, model and LoRA changes) beside uvicorn's."""
    logger = logging.getLogger("exl2")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _one_sentence(e: Exception) -> str:
    """A pydantic ValidationError as 'field: message'."""
    errs = getattr(e, "errors", lambda: [])()
    if errs:
        err = errs[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
    return str(e)


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the (slow) model load, so a busy port fails at once and clearly;
    uvicorn then serves on this very socket."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"Cannot resolve --host {host!r} ({e.strerror}).") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"Port {port} on {host} is already in use; pick another with --port.") from None
        if e.errno == errno.EACCES:
            raise ConfigError(f"No permission to listen on {host}:{port}; use a port above 1023.") from None
        raise ConfigError(f"Cannot listen on {host}:{port} ({e.strerror or e}).") from None
    sock.set_inheritable(True)
    return sock


def _name_values(items: list[str], flag: str) -> dict:
    """NAME=VALUE flags as a dict, VALUE read as JSON where it is JSON (true, 3, "x", [..]) and as text otherwise."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{flag} takes NAME=VALUE, not {item!r}.")
        try:
            out[name.strip()] = json.loads(value)
        except ValueError:
            out[name.strip()] = value
    return out


def _load_embedder(args):
    """The --embedding-model: a BERT-family encoder (`EncoderEmbedder`), else an Engine over the decoder embedding
    model (the default context, 4096 tokens or the model's if shorter; no drafts or adapters); on the served
    model's device, with its pooling flag."""
    from exl2.config import EngineConfig
    from exl2.engine import Engine
    from exl2.models.encoder import is_encoder_dir

    if is_encoder_dir(args.embedding_model):
        from exl2.generation.encoder_embeddings import EncoderEmbedder

        return EncoderEmbedder.from_dir(args.embedding_model, args.device, args.embedding_pooling)
    try:
        config = EngineConfig(model_dir=args.embedding_model, device=args.device, max_batch_size=1,
                              embedding_pooling=args.embedding_pooling)
    except ValueError as e:
        raise ConfigError(f"Invalid --embedding-model setting {_one_sentence(e)}.") from None
    with load_bar() as progress:
        return Engine(config, progress)


def run(args) -> int:
    try:
        import uvicorn

        from exl2.server.app import create_app
    except ImportError as e:
        raise ConfigError(f"exl2 serve needs the server extras ({e.name} is missing): pip install 'exl2[serve]'.") \
            from None
    from exl2.config import EngineConfig, ServerConfig
    from exl2.engine import Engine
    from exl2.generation.templates import template_file
    from exl2.server.admin import load_defaults_of

    if args.config:
        from exl2.cli.serve_config import apply_config_file
        args = apply_config_file(args, _PARSER)
    keys = args.api_keys or env_keys(KEY_ENV)
    admin_keys = args.admin_keys or env_keys(ADMIN_KEY_ENV)
    try:
        server_config = ServerConfig(host=args.host, port=args.port, api_keys=tuple(keys),
                                     admin_keys=tuple(admin_keys), model_dir_root=args.model_dir_root,
                                     lora_dir=args.lora_dir, inline_model_loading=args.inline_model_loading,
                                     model_name=args.model_name, max_tokens=args.max_tokens,
                                     reasoning_parser=args.reasoning_parser, cors_origins=tuple(args.cors_origins),
                                     reasoning_start_token=args.reasoning_start_token,
                                     reasoning_end_token=args.reasoning_end_token,
                                     log_prompt=args.log_prompt, log_generation_params=args.log_generation_params,
                                     sse_ping_interval=args.sse_ping_interval,
                                     kobold=args.kobold, sampler_override=args.sampler_override,
                                     sampler_override_dir=args.sampler_override_dir,
                                     template_dir=args.template_dir, start_in_reasoning=args.start_in_reasoning,
                                     template_vars_default=_name_values(args.template_vars, "--template-var"),
                                     template_vars_force=_name_values(args.force_template_vars,
                                                                      "--force-template-var"))
    except ValueError as e:   # pydantic's ValidationError
        raise ConfigError(f"Invalid setting {_one_sentence(e)}.") from None
    from exl2.server.overrides import startup_overrides
    startup_overrides(server_config)   # a preset that cannot be read fails now, before the model loads

    sock = _bind(server_config.host, server_config.port)
    try:
        no_model = args.model_dir is None and server_config.model_dir_root is not None
        if no_model:
            per_model = [f for f, v in (("--draft_model_dir", args.draft_model_dir), ("--rope_scale", args.rope_scale),
                                         ("--rope_alpha", args.rope_alpha), ("--rope_yarn", args.rope_yarn),
                                         ("--prompt-template", args.prompt_template)) if v]
            if per_model:
                raise ConfigError(f"{per_model[0]} applies to the -m model, and none is given; set it in the "
                                  "POST /v1/model/load request instead.")
            if args.loras:
                raise ConfigError("--lora applies to the -m model, and none is given; apply adapters with "
                                  "POST /v1/lora/load once a model is loaded.")
            # the flags still set what loaded models inherit; the root stands in for the model to check them
            args = argparse.Namespace(**{**vars(args), "model_dir": str(server_config.model_dir_root)})
        settings = engine_settings(args)
        settings["prompt_template"] = template_file(server_config.template_dir, settings["prompt_template"])
        if args.embedding_pooling is not None:
            settings["embedding_pooling"] = args.embedding_pooling
        if args.cache_size is not None:
            settings["cache_size"] = args.cache_size
        if args.host_cache_gb is not None:
            settings["host_cache_gb"] = args.host_cache_gb
        if args.vision:
            settings["vision"] = True
        if args.pan_and_scan:
            settings["pan_and_scan"] = True
        try:
            engine_config = EngineConfig(**settings, max_batch_size=args.max_batch_size)
        except ValueError as e:
            raise ConfigError(f"Invalid setting {_one_sentence(e)}.") from None
        # what models loaded through the API inherit: these flags, and -l / --cache-size where given
        load_defaults = load_defaults_of(SimpleNamespace(config=engine_config))
        if no_model:
            engine = None               # no -m: start empty, an admin loads a model from the root
        else:
            with load_bar() as progress:
                engine = Engine(engine_config, progress)
        embedder = _load_embedder(args) if args.embedding_model else None
        app = create_app(engine, server_config, load_defaults, embedder)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        if engine is None:
            print(f"Serving no model yet at {url}; load one of {server_config.model_dir_root} with POST "
                  "/v1/model/load", file=sys.stderr, flush=True)
        else:
            name = server_config.model_name or engine.model_name
            loras = f" with LoRA {', '.join(a.name for a in engine.loras)}" if engine_config.loras else ""
            print(f"Serving {name}{loras} at {url}", file=sys.stderr, flush=True)
        _log_to_stderr()
        config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
