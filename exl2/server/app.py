"""The OpenAI-compatible HTTP API over one loaded Engine at a time: `create_app(engine, config)`.

One model per server: `/v1/models` lists it, and requests naming any other model id are still served by it
(clients often hard-code an id such as "gpt-4o-mini"); responses always report the served model's id. Admins may
swap the model through TabbyAPI's model management (admin.py), or start with none (`engine` None).
"""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from exl2.config import ServerConfig
from exl2.server import admin, anthropic_api, completions, embeddings, kobold, responses, tokens
from exl2.server.auth import admin_key_check, api_key_check
from exl2.server.errors import APIError, install_handlers
from exl2.server.host import Leases, ModelHost, ServerState, acquire, host, serve_state, serving

__all__ = ["create_app", "ServerState"]


def _context_length(engine) -> int:
    spec_max = getattr(getattr(engine.model, "spec", None), "max_position", None)
    return min(engine.config.max_seq_len, spec_max) if spec_max else engine.config.max_seq_len


def _experts(engine) -> Optional[int]:
    """The experts a mixture-of-experts model routes each token to (None: a dense model)."""
    moe = getattr(getattr(getattr(engine, "model", None), "spec", None), "moe", None)
    return moe.top_k if moe is not None else None


def _models_router() -> APIRouter:
    router = APIRouter()

    def card(st: ServerState) -> dict:
        return {"id": st.name, "object": "model", "created": st.created, "owned_by": "exl2",
                "max_model_len": _context_length(st.engine)}

    def adapter_cards(config: ServerConfig, st: Optional[ServerState]) -> list[dict]:
        """The LoRA directory's adapters as children of the loaded model (a request naming one runs the model
        with that adapter: completions.request_loras)."""
        if config.lora_dir is None or st is None:
            return []
        return [{**card(st), "id": c["id"], "created": c["created"], "parent": st.name}
                for c in admin.lora_cards(config) if c["id"] != st.name]

    @router.get("/v1/models")
    async def list_models(request: Request):
        """The loaded model; with inline loading every model of the root (a request naming one loads it); with a
        LoRA directory its adapters, as the loaded model's children (vLLM's cards: a request naming one runs the
        model with that adapter)."""
        h = host(request)
        st = h.state
        data = [card(st)] if st is not None else []
        embedder = request.app.state.exl2_embedder
        if embedder is not None:
            data.append({"id": embedder.model_name, "object": "model", "created": st.created if st else 0,
                         "owned_by": "exl2", "max_model_len": getattr(embedder, "max_seq_len", None)
                         or _context_length(embedder)})
        if h.config.inline_model_loading:
            data += [c for c in admin.model_cards(h.config) if st is None or c["id"] != st.name]
        return {"object": "list", "data": data + adapter_cards(h.config, st)}

    @router.get("/v1/model")
    async def current_model(request: Request):
        """TabbyAPI's card of the loaded model: the `/v1/models` entry plus how it is served."""
        st = serving(request)
        cfg = st.engine.config
        return {**card(st), "parameters": {
            "max_seq_len": _context_length(st.engine), "cache_size": cfg.cache_size or cfg.max_seq_len,
            "cache_mode": cfg.kv_cache_mode, "max_batch_size": cfg.max_batch_size,
            "prompt_template": admin.template_label(st.engine.template),
            "draft": str(cfg.draft_model_dir) if cfg.draft_model_dir else ("ngram" if cfg.ngram_draft else None),
            "rope_scale": cfg.rope_scale, "rope_alpha": cfg.rope_alpha, "rope_yarn": cfg.rope_yarn,
            "num_experts_per_token": _experts(st.engine), "reasoning_parser": st.reasoning,
            "embedding_pooling": getattr(getattr(st.engine, "pooling", None), "mode", None),
            "prefill_fp8": cfg.prefill_fp8, "use_vision": st.engine.vision is not None}}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        st = host(request).state
        if st is None:
            raise APIError(404, f"The model '{model_id}' does not exist; no model is loaded.", param="model",
                           code="model_not_found")
        if model_id == st.name:
            return card(st)
        found = [c for c in adapter_cards(host(request).config, st) if c["id"] == model_id]
        if not found:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{st.name}'.",
                           param="model", code="model_not_found")
        return found[0]

    return router


def create_app(engine, config: ServerConfig, load_defaults: Optional[dict] = None, embedder=None) -> FastAPI:
    """A FastAPI app serving `engine` (None: no model until an admin loads one); `config` supplies the API and
    admin keys, the model id, the default max_tokens, the reasoning parser's setting (None: on when the chat
    template knows `<think>`), the CORS origins and the model directory. `load_defaults` are the EngineConfig
    fields models loaded through the API inherit (default: `engine`'s device, cache mode, batch size and
    placement; see admin.DEFAULT_FIELDS). `embedder`: an Engine of its own that answers /v1/embeddings (TabbyAPI's
    embedding model) instead of the served model."""
    app = FastAPI(title="exl2", summary="OpenAI-compatible API for one model loaded by the exl2 engine")
    state = serve_state(engine, config, config.model_name) if engine is not None else None
    if load_defaults is None:
        load_defaults = admin.load_defaults_of(engine) if engine is not None else {}
    app.state.exl2_host = ModelHost(app, config, state, dict(load_defaults))   # also sets app.state.exl2
    app.state.exl2_embedder = embedder
    install_handlers(app)
    app.add_middleware(Leases)
    if config.cors_origins:
        # Browser apps on these origins may call the API; preflights are answered before the key check, as
        # browsers send them without credentials. No cookies are involved, so credentials stay off.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    auth = Depends(api_key_check(config))
    engine_routes = [auth, Depends(acquire)]       # after the key check: wait out a load, pin the engine
    app.include_router(_models_router(), dependencies=[auth])
    app.include_router(admin.router(auth, Depends(admin_key_check(config))))
    app.include_router(completions.router, dependencies=[auth, Depends(admin.inline_load), Depends(acquire)])
    app.include_router(responses.router, dependencies=[auth, Depends(admin.inline_load), Depends(acquire)])
    app.include_router(anthropic_api.router, dependencies=[auth, Depends(admin.inline_load), Depends(acquire)])
    app.include_router(tokens.router, dependencies=engine_routes)
    app.include_router(embeddings.router, dependencies=[auth, Depends(embeddings.acquire_unless_embedder)])
    if config.kobold:
        app.include_router(kobold.router(auth, Depends(acquire), _context_length))
    app.include_router(kobold.discovery_router(auth, _context_length))

    @app.get("/health")
    async def health(request: Request):
        """Liveness for load balancers and scripts: no API key needed. `model`: the served model's id (None when
        none is loaded); `loading`: the model being loaded, if any."""
        h = host(request)
        return {"status": "ok", "model": h.state.name if h.state is not None else None, "loading": h.loading}

    return app
