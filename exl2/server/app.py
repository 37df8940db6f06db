"""The OpenAI-compatible HTTP API over one loaded Engine: `create_app(engine, config)`.

One model per server: `/v1/models` lists it, and requests naming any other model id are still served by it
(clients often hard-code an id such as "gpt-4o-mini"); responses always report the served model's id.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from exl2.config import ServerConfig
from exl2.server import completions, tokens
from exl2.server.errors import APIError, install_handlers
from exl2.server.reasoning import template_thinks


@dataclass(frozen=True)
class ServerState:
    engine: Any
    config: ServerConfig
    name: str
    created: int
    reasoning: bool = False         # split think blocks from the answer (`reasoning_content`)


def _api_key_check(keys: tuple[str, ...]):
    """A dependency accepting `Authorization: Bearer KEY` (what the openai client sends) or `x-api-key: KEY`."""
    wanted = [k.encode() for k in keys]

    async def check(request: Request) -> None:
        if not wanted:
            return
        offered = []
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            offered.append(token.strip())
        if request.headers.get("x-api-key"):
            offered.append(request.headers["x-api-key"].strip())
        if not offered:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        # Compare against every key without stopping early, so timing does not tell which key nearly matched.
        ok = [secrets.compare_digest(o.encode(), k) for o in offered for k in wanted]
        if not any(ok):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check


def _context_length(engine) -> int:
    spec_max = getattr(getattr(engine.model, "spec", None), "max_position", None)
    return min(engine.config.max_seq_len, spec_max) if spec_max else engine.config.max_seq_len


def _models_router() -> APIRouter:
    router = APIRouter()

    def card(st: ServerState) -> dict:
        return {"id": st.name, "object": "model", "created": st.created, "owned_by": "exl2",
                "max_model_len": _context_length(st.engine)}

    @router.get("/v1/models")
    async def list_models(request: Request):
        return {"object": "list", "data": [card(request.app.state.exl2)]}

    @router.get("/v1/model")
    async def current_model(request: Request):
        """TabbyAPI's card of the loaded model: the `/v1/models` entry plus how it is served."""
        st: ServerState = request.app.state.exl2
        cfg = st.engine.config
        return {**card(st), "parameters": {
            "max_seq_len": _context_length(st.engine), "cache_size": cfg.cache_size or cfg.max_seq_len,
            "cache_mode": cfg.kv_cache_mode, "max_batch_size": cfg.max_batch_size,
            "prompt_template": "fallback (ChatML)" if getattr(st.engine.template, "is_fallback", False)
            else "the model's own",
            "draft": str(cfg.draft_model_dir) if cfg.draft_model_dir else ("ngram" if cfg.ngram_draft else None),
            "rope_scale": cfg.rope_scale, "rope_alpha": cfg.rope_alpha, "rope_yarn": cfg.rope_yarn,
            "reasoning_parser": st.reasoning}}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        st: ServerState = request.app.state.exl2
        if model_id != st.name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{st.name}'.",
                           param="model", code="model_not_found")
        return card(st)

    return router


def create_app(engine, config: ServerConfig) -> FastAPI:
    """A FastAPI app serving `engine`; `config` supplies the API keys, the model id, the default max_tokens, the
    reasoning parser's setting (None: on when the chat template knows `<think>`) and the CORS origins."""
    app = FastAPI(title="exl2", summary="OpenAI-compatible API for one model loaded by the exl2 engine")
    reasoning = config.reasoning_parser
    if reasoning is None:
        reasoning = template_thinks(engine.template)
    app.state.exl2 = ServerState(engine, config, config.model_name or engine.model_name, int(time.time()), reasoning)
    install_handlers(app)
    if config.cors_origins:
        # Browser apps on these origins may call the API; preflights are answered before the key check, as
        # browsers send them without credentials. No cookies are involved, so credentials stay off.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    auth = [Depends(_api_key_check(config.api_keys))]
    app.include_router(_models_router(), dependencies=auth)
    app.include_router(completions.router, dependencies=auth)
    app.include_router(tokens.router, dependencies=auth)

    @app.get("/health")
    async def health():
        """Liveness for load balancers and scripts: no API key needed."""
        return {"status": "ok"}

    return app
