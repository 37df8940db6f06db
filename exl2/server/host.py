"""The model slot behind the API: which engine serves requests now, and how loads and unloads swap it.

Every request that generates or tokenizes pins the engine that serves it when it starts (`acquire`); a load or an
unload only changes which engine later requests get. So requests already running finish on the engine they
started on; a replaced engine is closed (its memory released) when the last of them has ended (`Leases`).
While a load runs, requests that need the engine wait for it, then go to the new model (or, if the load failed,
to the old one). A LoRA change cannot leave running requests on an engine of their own (adapters are global to
the model): it waits for the requests running to end, requests arriving meanwhile wait for it, as for a load.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request

from exl2.config import ServerConfig
from exl2.server.errors import APIError
from exl2.server.overrides import startup_overrides
from exl2.generation.budget import DEFAULT_TAGS, ThinkTags, template_tags
from exl2.server.reasoning import template_thinks

log = logging.getLogger("exl2.server")
NO_MODEL = "No model is loaded; load one with POST /v1/model/load."
_LEASES = "exl2.leases"          # the request scope's list of the slots the request pinned


@dataclass(frozen=True)
class ServerState:
    engine: Any
    config: ServerConfig
    name: str
    created: int
    reasoning: bool = False         # split think blocks from the answer (`reasoning_content`)
    tags: ThinkTags = DEFAULT_TAGS  # ... written between these tags


def serve_state(engine, config: ServerConfig, name: Optional[str] = None) -> ServerState:
    """How `engine` is served: its id (`name`, default the model directory's name), whether the reasoning
    parser is on (ServerConfig.reasoning_parser; None: when the chat template knows think tags) and its tags."""
    return ServerState(engine, config, name or engine.model_name, int(time.time()),
                       reasoning_on(config, engine.template), think_tags(config, engine.template))


def think_tags(config: ServerConfig, template) -> ThinkTags:
    """The reasoning tags: the server's (reasoning_start_token / _end_token), else the template's, else
    `<think>…</think>`."""
    if config.reasoning_start_token is not None:
        return ThinkTags(config.reasoning_start_token, config.reasoning_end_token)
    return template_tags(template.source) or DEFAULT_TAGS


def reasoning_on(config: ServerConfig, template) -> bool:
    """Whether the reasoning parser runs for chats rendered with `template`: ServerConfig.reasoning_parser, or
    where that is None, whether the template knows `<think>`."""
    if config.reasoning_parser is not None:
        return config.reasoning_parser
    return template_thinks(template) or (config.reasoning_start_token is not None
                                         and config.reasoning_start_token in template.source)


class Slot:
    """One loaded engine and the requests running on it."""

    def __init__(self, state: ServerState):
        self.state = state
        self.running = 0
        self.retired = False        # replaced or unloaded: close the engine once `running` is 0
        self.closed = False
        self._drain: list[asyncio.Future] = []     # `drained()` callers waiting for `running` to reach 0

    def release(self) -> None:
        """One request running on it has ended; the last one on a retired slot closes it (off the event loop)."""
        self.running -= 1
        if self.running == 0:
            for waiter in self._drain:
                if not waiter.done():
                    waiter.set_result(None)
            self._drain.clear()
        if self.retired and self.running == 0:
            asyncio.get_running_loop().run_in_executor(None, close_slot, self)

    async def drained(self) -> None:
        """Return once no request runs on this engine (new ones must be held off meanwhile, or it may never)."""
        while self.running:
            waiter = asyncio.get_running_loop().create_future()
            self._drain.append(waiter)
            await waiter


class ModelHost:
    """The app's current model (or none), the load in progress, and the engines still finishing requests."""

    def __init__(self, app, config: ServerConfig, state: Optional[ServerState], load_defaults: dict):
        self.app, self.config, self.load_defaults = app, config, load_defaults
        self.current: Optional[Slot] = Slot(state) if state is not None else None
        self.loading: Optional[str] = None          # the name of the model being loaded
        self.load_task: Optional[asyncio.Task] = None
        self.lora_task: Optional[asyncio.Task] = None   # a LoRA change, waiting for requests to end or applying
        self.overrides = startup_overrides(config)     # the sampler override preset in force
        self.inline_lock = asyncio.Lock()              # one inline model load at a time (admin.inline_load)
        self._mirror()

    @property
    def state(self) -> Optional[ServerState]:
        return self.current.state if self.current is not None else None

    def restate(self, state: ServerState) -> None:
        """The served model's state changed in place (its chat template was switched)."""
        if self.current is not None:
            self.current.state = state
        self._mirror()

    def _mirror(self) -> None:
        self.app.state.exl2 = self.state            # `app.state.exl2`: the served model's state, None when none

    def pending(self) -> list[asyncio.Task]:
        """The model load and LoRA change in progress, which requests must wait for."""
        return [t for t in (self.load_task, self.lora_task) if t is not None and not t.done()]

    def swap(self, state: Optional[ServerState]) -> Optional[Slot]:
        """Serve `state` (None: nothing) from now on; the previous slot, now retired, is returned."""
        old = self.current
        self.current = Slot(state) if state is not None else None
        self._mirror()
        if old is not None:
            old.retired = True
        return old


def close_slot(slot: Slot) -> None:
    """Close a retired slot's engine (once): stops its generator thread and frees its memory."""
    if slot.closed:
        return
    slot.closed = True
    close = getattr(slot.state.engine, "close", None)
    try:
        if close is not None:
            close()
        else:
            free_memory()
    except Exception:
        log.exception("closing the engine of %s failed", slot.state.name)
    else:
        log.info("released %s", slot.state.name)


def free_memory() -> None:
    import gc

    gc.collect()
    import torch
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def host(request: Request) -> ModelHost:
    return request.app.state.exl2_host


def sse_ping(request: Request) -> float:
    """Seconds between a stream's keep-alive pings (`ServerConfig.sse_ping_interval`; 0: none)."""
    return host(request).config.sse_ping_interval


async def acquire(request: Request) -> None:
    """A dependency for routes that use the engine: waits for a load or LoRA change in progress, then pins the
    engine serving now to the request until its response has been sent; 503 when no model is loaded."""
    h = host(request)
    while h.pending():
        await asyncio.wait(h.pending())
    slot = h.current
    if slot is None:
        raise no_model()
    slot.running += 1
    request.scope.setdefault(_LEASES, []).append(slot)


def no_model() -> APIError:
    return APIError(503, NO_MODEL, type="server_error", code="model_not_loaded")


def serving(request: Request) -> ServerState:
    """The state of the model that serves this request: the one `acquire` pinned, else the current one."""
    pinned = request.scope.get(_LEASES)
    if pinned:
        return pinned[-1].state
    state = host(request).state
    if state is None:
        raise no_model()
    return state


class Leases:
    """ASGI middleware: when a request's response has ended (streamed ones included), the engines it pinned are
    released, and a retired engine whose last request this was is closed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[_LEASES] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for slot in scope[_LEASES]:
                slot.release()
