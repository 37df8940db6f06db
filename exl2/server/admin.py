"""TabbyAPI's model management: `GET /v1/model/list` (and `/v1/model/draft/list`), `POST /v1/model/load`,
`POST /v1/model/unload` and `GET /v1/auth/permission`; and its LoRA management: `GET /v1/lora/list` (and
`/v1/loras`), `GET /v1/lora`, `POST /v1/lora/load` and `POST /v1/lora/unload`.

Models are the directories with a config.json directly under `ServerConfig.model_dir_root`, named by their
directory name. A load builds the new Engine on a worker thread while the current model keeps serving, then swaps
it in (host.py says what happens to requests around the swap); if it fails, the current model stays.
LoRA adapters are the directories with an adapter_config.json under `ServerConfig.lora_dir`. They apply to every
request, so a change waits for the requests running to end and holds new ones until it is done.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import traceback
from pathlib import Path
from typing import Any, Callable, Literal, Optional, TypeVar, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from exl2.config import EngineConfig, LoraSpec, ServerConfig
from exl2.errors import ConfigError, Exl2Error
from exl2.generation.multimodal import has_vision_tower
from exl2.generation.templates import template_file, template_names
from exl2.models.rope import ntk_alpha
from exl2.runtime.loader import native_context
from exl2.server.auth import permission
from exl2.server.errors import APIError, unsupported
from exl2.names import plain_name
from exl2.server.host import (ModelHost, ServerState, close_slot, free_memory, host, no_model, reasoning_on,
                              serve_state, serving, think_tags)
from exl2.server.overrides import Overrides, find_preset, preset_names

log = logging.getLogger("exl2.server")
T = TypeVar("T")

# The EngineConfig fields that `exl2 serve`'s flags set for every model, so loads through the API inherit them.
DEFAULT_FIELDS = ("device", "kv_cache_mode", "max_batch_size", "gpu_split", "tensor_parallel", "ngram_draft",
                  "num_draft_tokens", "max_draft_batch", "flash_attention_enabled", "prefill_fp8", "chunk_size",
                  "cuda_graphs", "vision", "host_cache_gb")
# EngineConfig field -> the load request's name for it, for error messages
_REQUEST_NAMES = {"kv_cache_mode": "cache_mode", "draft_model_dir": "draft_model.draft_model_name",
                  "num_draft_tokens": "draft_model.draft_num_tokens", "flash_attention_enabled": "no_flash_attention",
                  "draft_rope_scale": "draft_model.draft_rope_scale",
                  "draft_rope_alpha": "draft_model.draft_rope_alpha",
                  "model_dir": "model_name", "experts_per_token": "num_experts_per_token"}


def build_engine(config: EngineConfig, progress=None):
    """The Engine a load builds (tests replace this with a fake); `progress(kind, done, total)` as Engine's."""
    from exl2.engine import Engine

    return Engine(config, progress)


def load_defaults_of(engine) -> dict:
    """The settings of `engine` that a later load inherits (see DEFAULT_FIELDS), plus max_seq_len and cache_size
    where they were set explicitly."""
    cfg = getattr(engine, "config", None)
    if not isinstance(cfg, EngineConfig):
        return {}
    out = {k: getattr(cfg, k) for k in DEFAULT_FIELDS}
    out.update({k: getattr(cfg, k) for k in ("max_seq_len", "cache_size") if k in cfg.model_fields_set})
    return out


class DraftLoadRequest(BaseModel):
    """TabbyAPI's `draft_model` (older clients: `draft`) object."""

    model_config = ConfigDict(extra="ignore")

    draft_model_name: Optional[str] = None
    draft_num_tokens: Optional[int] = None
    # TabbyAPI's per-draft settings: this server runs the draft with the main model's cache mode and placement and
    # its config.json's RoPE, so only their neutral values are accepted
    draft_rope_scale: Optional[float] = None
    draft_rope_alpha: Optional[Union[float, Literal["auto"]]] = None
    draft_cache_mode: Optional[str] = None
    draft_gpu_split: Optional[list[float]] = None


class ModelLoadRequest(BaseModel):
    """TabbyAPI's load request. Fields it has that change nothing here (fasttensors, skip_queue,
    autosplit_reserve, backend, ...) are ignored; those that would change the model's replies in a way this
    server cannot are refused when set."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    name: str = Field(validation_alias=AliasChoices("model_name", "name"))
    max_seq_len: Optional[int] = None
    cache_size: Optional[int] = None
    cache_mode: Optional[Union[str, int]] = None
    max_batch_size: Optional[int] = None
    chunk_size: Optional[int] = None
    gpu_split_auto: Optional[bool] = None
    gpu_split: Optional[list[float]] = None
    tensor_parallel: Optional[bool] = None
    rope_scale: Optional[float] = None
    rope_alpha: Optional[Union[float, Literal["auto"]]] = None
    rope_yarn: Optional[float] = None
    no_flash_attention: Optional[bool] = None
    use_cfg: Optional[bool] = None     # TabbyAPI's: no effect here, guidance is always available (cfg_scale)
    num_experts_per_token: Optional[int] = None
    prefill_fp8: Optional[bool] = None   # this engine's: prompt matmuls in FP8 (EngineConfig.prefill_fp8)
    # the context rope_alpha "auto" stretches from (TabbyAPI's; default: the model's own)
    override_base_seq_len: Optional[int] = Field(None, ge=1)
    draft_model: Optional[DraftLoadRequest] = Field(None, validation_alias=AliasChoices("draft_model", "draft"))
    prompt_template: Optional[str] = None   # a name in --template-dir, bundled or the model's own list
    vision: Optional[bool] = None           # load the vision tower (images in chat messages)


class TemplateSwitchRequest(BaseModel):
    """TabbyAPI's template switch: the template's name (older clients: `name`)."""

    model_config = ConfigDict(extra="ignore")

    prompt_template_name: str = Field(validation_alias=AliasChoices("prompt_template_name", "name"))


class OverrideSwitchRequest(BaseModel):
    """TabbyAPI's override switch: a preset of the preset directory, or rules given inline."""

    model_config = ConfigDict(extra="ignore")

    preset: Optional[str] = None
    overrides: Optional[dict[str, Any]] = None


class LoraLoadInfo(BaseModel):
    """One adapter of TabbyAPI's LoRA load request."""

    model_config = ConfigDict(extra="ignore")

    name: str
    scaling: Optional[float] = Field(1.0, ge=0.0, allow_inf_nan=False)    # None: 1.0, as in TabbyAPI


class LoraLoadRequest(BaseModel):
    """TabbyAPI's LoRA load request: the adapters that replace the active ones (skip_queue is ignored)."""

    model_config = ConfigDict(extra="ignore")

    loras: list[LoraLoadInfo] = Field(min_length=1)


def model_dir(root: Optional[Path], name: str, param: str) -> Path:
    """The directory of model `name` under `root`: a plain directory name, never a path; 400 for a name that is
    not one (or a directory without config.json), 404 for one that does not exist."""
    if root is None:
        raise APIError(400, "Loading models by name needs a model directory; start the server with "
                            "--model-dir-root DIR.", param=param, code="model_dir_root_unset")
    if not plain_name(name):
        raise APIError(400, f"'{name}' is not the name of a model directory; use a name GET /v1/model/list shows.",
                       param=param, code="invalid_model_name")
    path = root / name
    if not path.is_dir():
        raise APIError(404, f"The model '{name}' does not exist in the model directory.", param=param,
                       code="model_not_found")
    if not (path / "config.json").is_file():
        raise APIError(400, f"'{name}' has no config.json, so it is not a model directory.", param=param,
                       code="invalid_model_name")
    return path


def _neutral(v) -> bool:
    """TabbyAPI clients send 1.0 (or "auto") for "the model's own" RoPE setting."""
    return v is None or v == 1.0 or v == "auto"


def _cuda_gpus(device: Optional[str]) -> int:
    if device is not None and not device.startswith("cuda"):
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _refuse_unsupported(body: ModelLoadRequest) -> None:
    d = body.draft_model
    if d is not None:
        if d.draft_gpu_split:
            raise unsupported("draft_model.draft_gpu_split", "Placing the draft model apart from the model")


def _auto_rope_alpha(settings: dict, body: ModelLoadRequest) -> None:
    """TabbyAPI's automatic RoPE alpha: a max_seq_len past the model's context (or `override_base_seq_len`) with
    no RoPE setting from the request or the server gets the NTK alpha for the ratio, instead of being capped."""
    if body.rope_alpha not in (None, "auto") or any(settings.get(k) is not None
                                                     for k in ("rope_scale", "rope_alpha", "rope_yarn")):
        return
    length = settings.get("max_seq_len")
    base = body.override_base_seq_len
    if base is None and length is not None:
        try:
            base = native_context(settings["model_dir"])
        except Exception:  # noqa: BLE001 - an unreadable or unsupported model: its load reports that
            return
    if length is not None and base is not None and length > base:
        settings["rope_alpha"] = round(ntk_alpha(length / base), 4)
        log.info("max_seq_len %d is past the model's %d positions: RoPE alpha %.4f (rope_alpha 'auto').", length,
                 base, settings["rope_alpha"])


def engine_config(h: ModelHost, body: ModelLoadRequest) -> EngineConfig:
    """The EngineConfig a load request asks for: the request's fields over the server's defaults."""
    root = h.config.model_dir_root
    _refuse_unsupported(body)
    settings = dict(h.load_defaults)
    settings["model_dir"] = model_dir(root, body.name, "model_name")
    if body.max_seq_len is not None:
        settings["max_seq_len"] = body.max_seq_len
        if body.cache_size is None and (settings.get("cache_size") or body.max_seq_len) < body.max_seq_len:
            del settings["cache_size"]        # the server's default cache is too small for it: max_seq_len's
    for field, key in (("cache_size", "cache_size"), ("cache_mode", "kv_cache_mode"),
                       ("max_batch_size", "max_batch_size"), ("tensor_parallel", "tensor_parallel"),
                       ("num_experts_per_token", "experts_per_token"), ("prefill_fp8", "prefill_fp8"),
                       ("chunk_size", "chunk_size")):
        if getattr(body, field) is not None:
            settings[key] = getattr(body, field)
    if body.vision is not None:
        settings["vision"] = body.vision
    if settings.get("vision") and not has_vision_tower(settings["model_dir"]):
        if body.vision:
            raise APIError(400, f"{body.name} has no vision tower, so it cannot be loaded with vision.",
                           param="vision")
        settings["vision"] = False     # the server's --vision: for the models that have a tower
    if body.gpu_split:
        settings["gpu_split"] = body.gpu_split
    elif body.gpu_split_auto and settings.get("gpu_split") is None and _cuda_gpus(settings.get("device")) > 1:
        settings["gpu_split"] = "auto"
    if body.prompt_template:
        settings["prompt_template"] = template_file(h.config.template_dir, body.prompt_template)
    if body.no_flash_attention is not None:
        settings["flash_attention_enabled"] = not body.no_flash_attention
    for field in ("rope_scale", "rope_alpha"):
        if not _neutral(getattr(body, field)):
            settings[field] = getattr(body, field)
    if body.rope_yarn is not None:
        settings["rope_yarn"] = body.rope_yarn
    _auto_rope_alpha(settings, body)
    d = body.draft_model
    if d is not None and d.draft_model_name:
        settings["draft_model_dir"] = model_dir(root, d.draft_model_name, "draft_model.draft_model_name")
        settings["ngram_draft"] = False
        if d.draft_num_tokens is not None:
            settings["num_draft_tokens"] = d.draft_num_tokens
        for field in ("draft_rope_scale", "draft_rope_alpha"):   # "auto" or 1: the draft model's own (or NTK)
            if not _neutral(getattr(d, field)):
                settings[field] = getattr(d, field)
        mode = settings.get("kv_cache_mode", "fp16")
        if d.draft_cache_mode is not None and str(d.draft_cache_mode).lower() != str(mode).lower():
            raise unsupported("draft_model.draft_cache_mode", "A cache mode for the draft model other than the "
                                                              "model's")
    try:
        return EngineConfig(**settings)
    except ValueError as e:                    # pydantic's ValidationError: one sentence naming the field
        errs = getattr(e, "errors", lambda: [])()
        if not errs:
            raise APIError(400, f"Invalid load settings: {e}.") from None
        field = ".".join(str(p) for p in errs[0]["loc"]) or None
        field = _REQUEST_NAMES.get(field, field)
        msg = errs[0]["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{field}': {msg}." if field else f"Invalid load settings: {msg}.",
                       param=field) from None


def _load_error(e: Exception, name: str, current: Optional[ServerState]) -> APIError:
    """A failed load as the client hears it: the engine's sentence for the model's own problems (400), a clear
    one for memory, a generic one for anything else (details in the log)."""
    if isinstance(e, Exl2Error):
        return APIError(400, str(e), param="model_name", code="model_load_failed")
    if type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower():
        hint = (f" while '{current.name}' is loaded; unload it first with POST /v1/model/unload" if current
                else "")
        return APIError(500, f"There is not enough memory to load '{name}'{hint}.", type="server_error",
                        code="out_of_memory")
    return APIError(500, f"Loading '{name}' failed; see the server log.", type="server_error",
                    code="model_load_failed")


async def _load(h: ModelHost, config: EngineConfig, name: str, progress=None) -> ServerState:
    """Build the engine on a thread, then serve it; the engine it replaces is closed once its requests ended."""
    try:
        return await _build_and_swap(h, config, name, progress)
    finally:
        h.loading = None


async def _build_and_swap(h: ModelHost, config: EngineConfig, name: str, progress=None) -> ServerState:
    error = None
    try:
        engine = await asyncio.to_thread(build_engine, config, progress)
    except Exception as e:
        error = _load_error(e, name, h.state)
        if isinstance(e, Exl2Error):
            log.warning("loading %s failed: %s", name, e)
        else:                   # formatted here: a logged exception would keep the half-built model alive
            log.error("loading %s failed:\n%s", name, "".join(traceback.format_exception(e)))
    if error is not None:       # raised outside the except block, so the failure's traceback is not kept
        await asyncio.to_thread(free_memory)
        raise error
    state = serve_state(engine, h.config)
    old = h.swap(state)
    log.info("serving %s", state.name)
    if old is not None and old.running == 0:
        await asyncio.to_thread(close_slot, old)
    return state


def _begin_load(h: ModelHost, config: EngineConfig, name: str, progress=None) -> asyncio.Task:
    """Start loading `config` as the load in progress (requests arriving meanwhile wait for it); a client that
    goes away does not stop it."""
    h.loading = name
    h.load_task = asyncio.ensure_future(_load(h, config, name, progress))
    h.load_task.add_done_callback(_retrieve)
    return h.load_task


async def _start_load(h: ModelHost, config: EngineConfig, name: str) -> None:
    """`_begin_load`, then wait until the model serves."""
    await asyncio.shield(_begin_load(h, config, name))


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def _load_events(draft: bool) -> list[dict]:
    """TabbyAPI's closing load events: one "finished" per model loaded."""
    return [{"model_type": k, "module": 1, "modules": 1, "status": "finished"}
            for k in (["draft"] if draft else []) + ["model"]]


async def _next_event(events: asyncio.Queue, task: asyncio.Task) -> Optional[dict]:
    """The next progress event, or None once the load ended with none left (the task is not cancelled)."""
    get = asyncio.ensure_future(events.get())
    await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None if events.empty() else events.get_nowait()


async def _progress_stream(first: dict, events: asyncio.Queue, task: asyncio.Task, draft: bool):
    """The load reply once a layer has loaded: every progress event, then "finished" per model, or the load's
    error as an event (the status line is sent by then)."""
    yield _sse(first)
    while (event := await _next_event(events, task)) is not None:
        yield _sse(event)
    error = task.exception()
    if error is None:
        for event in _load_events(draft):
            yield _sse(event)
    else:
        body = error.body() if isinstance(error, APIError) else \
            APIError(500, "Loading the model failed.", type="server_error", code="model_load_failed").body()
        yield _sse(body)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()        # a load whose client went away: its error was logged already


def _loading(h: ModelHost) -> bool:
    return h.load_task is not None and not h.load_task.done()


def _finished(draft: bool) -> Response:
    """TabbyAPI's load reply in one piece: server-sent events of ModelLoadResponse, one "finished" per model
    loaded."""
    return Response("".join(map(_sse, _load_events(draft))), media_type="text/event-stream")


def _card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "exl2"}


def _listed(root: Path, marker: str, what: str) -> list[tuple[str, int]]:
    """(name, modification time) of the directories under `root` that hold a file `marker`, by name."""
    try:
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise APIError(500, f"The {what} directory {root} cannot be read ({e.strerror or e}).",
                       type="server_error") from None
    found = []
    for p in entries:
        try:
            if not p.name.startswith(".") and p.is_dir() and (p / marker).is_file():
                found.append((p.name, int(p.stat().st_mtime)))
        except OSError:
            continue
    return found


def model_cards(config: ServerConfig) -> list[dict]:
    """The model directories (those with a config.json) under the root, by name."""
    return [_card(name, created) for name, created in _listed(config.model_dir_root, "config.json", "model")]


def _lora_card(name: str, created: int, scaling: Optional[float] = None) -> dict:
    """TabbyAPI's LoraCard; `scaling` is set for active adapters only."""
    return {"id": name, "object": "lora", "created": created, "owned_by": "exl2", "scaling": scaling}


def lora_cards(config: ServerConfig) -> list[dict]:
    """The adapter directories (those with an adapter_config.json) under the LoRA directory, by name."""
    return [_lora_card(name, created) for name, created in _listed(config.lora_dir, "adapter_config.json", "LoRA")]


def active_lora_cards(engine) -> list[dict]:
    """The adapters active on `engine`, with the scaling each was applied with."""
    def created(path: Path) -> int:
        try:
            return int(path.stat().st_mtime)
        except OSError:
            return 0

    return [_lora_card(a.name, created(Path(a.path)), a.scaling) for a in engine.loras]


def lora_path(root: Optional[Path], name: str, param: str) -> Path:
    """The directory of adapter `name` under `root`; 400 for a name that is not a plain directory name (it could
    reach outside `root`). One that does not exist fails to load, as TabbyAPI reports it."""
    if root is None:
        raise APIError(400, "Loading LoRAs by name needs a LoRA directory; start the server with --lora-dir DIR.",
                       param=param, code="lora_dir_unset")
    if not plain_name(name):
        raise APIError(400, f"'{name}' is not the name of a LoRA directory; use a name GET /v1/lora/list shows.",
                       param=param, code="invalid_lora_name")
    return root / name


def _refuse_while_busy(h: ModelHost) -> None:
    """409 while a model load or a LoRA change is in progress: one change at a time."""
    if _loading(h):
        raise APIError(409, f"The model '{h.loading}' is being loaded; wait until that load has finished.",
                       code="model_loading")
    if h.lora_task is not None and not h.lora_task.done():
        raise APIError(409, "The LoRAs are being changed; wait until that change has finished.", code="lora_loading")


async def _change_loras(h: ModelHost, change: Callable[[Any], T]) -> T:
    """`change(engine)` on a thread once the requests running on the served model have ended; requests arriving
    meanwhile wait for it (host.acquire). A client that goes away does not stop it."""
    _refuse_while_busy(h)
    slot = h.current
    if slot is None:
        raise no_model()

    async def run() -> T:
        await slot.drained()
        return await asyncio.to_thread(change, slot.state.engine)

    h.lora_task = asyncio.ensure_future(run())
    h.lora_task.add_done_callback(_retrieve)
    return await asyncio.shield(h.lora_task)


def _set_loras(engine, adapters: list) -> None:
    try:
        engine.set_loras(adapters)
    except ConfigError as e:    # the engine still runs a request this server did not start
        raise APIError(409, str(e), code="requests_running") from None


def _apply_loras(engine, specs: list[tuple[str, LoraSpec]]) -> dict:
    """TabbyAPI's load: the adapters that load replace the active ones (all of them go), those that fail are
    listed in `failure`, with why in `errors`."""
    adapters, success, failure, errors = [], [], [], {}
    for name, spec in specs:
        try:
            adapters.append(engine.load_lora(spec))
            success.append(name)
        except Exception as e:
            failure.append(name)
            if isinstance(e, Exl2Error):
                errors[name] = str(e)
                log.warning("loading LoRA %s failed: %s", name, e)
            else:
                errors[name] = f"Loading the LoRA '{name}' failed; see the server log."
                log.error("loading LoRA %s failed:\n%s", name, "".join(traceback.format_exception(e)))
    _set_loras(engine, adapters)
    log.info("LoRAs: %s", ", ".join(a.name for a in adapters) or "none")
    return {"success": success, "failure": failure, "errors": errors}


def _unload_loras(engine) -> list[str]:
    names = [a.name for a in engine.loras]
    _set_loras(engine, [])
    log.info("unloaded LoRAs %s", ", ".join(names) or "(none were active)")
    return names


def template_label(template) -> Optional[str]:
    """How /v1/model and /v1/template/switch name a chat template."""
    if getattr(template, "name", None):
        return template.name
    return "fallback (ChatML)" if getattr(template, "is_fallback", False) else "the model's own"


def _switch_template(h: ModelHost, choice: Optional[str], param: str) -> dict:
    """Render the served model's chats with `choice` (None: its own template) from now on; the reasoning parser
    follows the new template unless the server fixed it."""
    st = h.state
    if st is None:
        raise no_model()
    try:
        template = st.engine.set_template(template_file(h.config.template_dir, choice), h.config.template_dir)
    except ConfigError as e:
        raise APIError(400, str(e), param=param, code="template_not_found") from None
    h.restate(dataclasses.replace(st, reasoning=reasoning_on(h.config, template),
                                  tags=think_tags(h.config, template)))
    log.info("chat template: %s", template_label(template))
    return {"prompt_template": template_label(template)}


async def inline_load(request: Request) -> None:
    """A dependency of the completion routes (TabbyAPI's inline loading, `ServerConfig.inline_model_loading`):
    a request whose `model` names another model directory of the root loads that model, with the load
    defaults, before the request is pinned to an engine. Other names (a client's default such as "gpt-4o") are
    answered by the loaded model, as without inline loading. Loads triggered this way run one at a time."""
    h = host(request)
    if not h.config.inline_model_loading:
        return
    try:
        name = (await request.json()).get("model")
    except Exception:  # noqa: BLE001 - not a JSON object: the endpoint reports that
        return
    root = h.config.model_dir_root
    if not isinstance(name, str) or not plain_name(name) or not (root / name / "config.json").is_file():
        return
    async with h.inline_lock:
        while h.pending():
            await asyncio.wait(h.pending())
        if h.state is not None and h.state.name == name:
            return
        log.info("loading %s for a request that names it", name)
        await _start_load(h, engine_config(h, ModelLoadRequest(name=name)), name)


def router(auth, admin) -> APIRouter:
    """The routes; `auth` and `admin` are the API-key and admin-key dependencies."""
    r = APIRouter()

    @r.get("/v1/model/list", dependencies=[auth])
    @r.get("/v1/model/draft/list", dependencies=[auth])
    async def list_models(request: Request):
        """The models /v1/model/load can load (drafts come from the same directory); without a model directory,
        the loaded model."""
        h = host(request)
        if h.config.model_dir_root is not None:
            return {"object": "list", "data": model_cards(h.config)}
        st = h.state
        return {"object": "list", "data": [_card(st.name, st.created)] if st is not None else []}

    @r.get("/v1/lora/list", dependencies=[auth])
    @r.get("/v1/loras", dependencies=[auth])
    async def list_loras(request: Request):
        """The adapters /v1/lora/load can apply; without a LoRA directory, the active ones."""
        h = host(request)
        if h.config.lora_dir is not None:
            return {"object": "list", "data": lora_cards(h.config)}
        st = h.state
        return {"object": "list", "data": active_lora_cards(st.engine) if st is not None else []}

    @r.get("/v1/lora", dependencies=[auth])
    async def current_loras(request: Request):
        """The adapters active on the served model, with their scaling."""
        return {"object": "list", "data": active_lora_cards(serving(request).engine)}

    @r.post("/v1/lora/load", dependencies=[admin])
    async def load_loras(body: LoraLoadRequest, request: Request):
        """Apply these adapters (by directory name) in place of the active ones, once no request runs."""
        root = host(request).config.lora_dir
        specs = [(x.name, LoraSpec(path=lora_path(root, x.name, f"loras[{i}].name"),
                                   scaling=1.0 if x.scaling is None else x.scaling))
                 for i, x in enumerate(body.loras)]
        return await _change_loras(host(request), lambda engine: _apply_loras(engine, specs))

    @r.post("/v1/lora/unload", dependencies=[admin])
    async def unload_loras(request: Request):
        """Remove every active adapter, once no request runs."""
        return {"status": "unloaded", "loras": await _change_loras(host(request), _unload_loras)}

    @r.get("/v1/sampling/overrides", dependencies=[auth])
    @r.get("/v1/sampling/override/list", dependencies=[auth])
    async def sampler_overrides(request: Request):
        """The sampler override preset in force (TabbyAPI's); admins also see the presets they can switch to."""
        h = host(request)
        out: dict[str, Any] = {"selected_preset": h.overrides.name, "overrides": h.overrides.describe()}
        if permission(request, h.config) == "admin":
            out["presets"] = preset_names(h.config.sampler_override_dir)
        return out

    @r.post("/v1/sampling/override/switch", dependencies=[admin])
    async def switch_sampler_overrides(body: OverrideSwitchRequest, request: Request):
        """Put a preset by name, or rules sent inline, in force for the requests that arrive from now on."""
        h = host(request)
        if (body.preset is None) == (body.overrides is None):
            raise APIError(400, "Send either a preset name or overrides, not both or neither.", param="preset")
        try:
            h.overrides = Overrides.from_file(find_preset(h.config.sampler_override_dir, body.preset)) \
                if body.preset is not None else Overrides.parse(body.overrides)
        except ConfigError as e:
            raise APIError(400, str(e), param="preset" if body.preset is not None else "overrides") from None
        log.info("sampler overrides: %s", h.overrides.name or "inline")
        return {"selected_preset": h.overrides.name, "overrides": h.overrides.describe()}

    @r.post("/v1/sampling/override/unload", dependencies=[admin])
    async def unload_sampler_overrides(request: Request):
        """Requests get no overrides from now on."""
        host(request).overrides = Overrides({})
        return {"selected_preset": None, "overrides": {}}

    @r.get("/v1/templates", dependencies=[auth])
    @r.get("/v1/template/list", dependencies=[auth])
    async def list_templates(request: Request):
        """The chat template names /v1/template/switch and model loads accept: the template directory's, the
        bundled ones and those the served model's tokenizer_config.json lists."""
        h = host(request)
        tokenizer = getattr(h.state.engine, "tokenizer", None) if h.state is not None else None
        return {"object": "list", "data": template_names(h.config.template_dir, tokenizer)}

    @r.post("/v1/template/switch", dependencies=[admin])
    async def switch_template(body: TemplateSwitchRequest, request: Request):
        """Render chats with this template from now on (requests already running keep their prompt)."""
        return _switch_template(host(request), body.prompt_template_name, "prompt_template_name")

    @r.post("/v1/template/unload", dependencies=[admin])
    async def unload_template(request: Request):
        """Back to the model's own chat template (TabbyAPI turns chat off instead; a model always has one here:
        its own, or ChatML)."""
        return _switch_template(host(request), None, "prompt_template_name")

    @r.get("/v1/auth/permission", dependencies=[auth])
    async def key_permission(request: Request):
        """TabbyAPI's: "admin" for a key that may load models, else "api"."""
        return {"permission": permission(request, host(request).config)}

    @r.post("/v1/model/load", dependencies=[admin])
    async def load_model(body: ModelLoadRequest, request: Request):
        """Load a model by its directory name. From the first decoder layer loaded the reply streams TabbyAPI's
        progress events ("processing", module of modules, per model: the model's layers and head, then the
        draft's), then "finished" per model; a load that fails before that is answered with its error."""
        h = host(request)
        _refuse_while_busy(h)
        config = engine_config(h, body)
        draft = config.draft_model_dir is not None
        if h.state is not None and getattr(h.state.engine, "config", None) == config:
            return _finished(draft)             # already served with these settings, as TabbyAPI does
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def progress(kind: str, done: int, total: int) -> None:  # on the loading thread
            event = {"model_type": kind, "module": done, "modules": total, "status": "processing"}
            loop.call_soon_threadsafe(events.put_nowait, event)

        task = _begin_load(h, config, body.name, progress)
        first = await asyncio.shield(_next_event(events, task))
        if first is None:                       # done, or failed, before any layer loaded
            await asyncio.shield(task)
            return _finished(draft)
        return StreamingResponse(_progress_stream(first, events, task, draft), media_type="text/event-stream")

    @r.post("/v1/model/unload", dependencies=[admin])
    async def unload_model(request: Request):
        """Stop serving the model; its memory is released now, or when the requests still running on it end."""
        h = host(request)
        _refuse_while_busy(h)
        old = h.swap(None)
        if old is None:
            return {"status": "unloaded", "model": None, "running_requests": 0}
        running = old.running
        log.info("unloaded %s", old.state.name)
        if running == 0:
            await asyncio.to_thread(close_slot, old)
        return {"status": "unloaded", "model": old.state.name, "running_requests": running}

    return r
