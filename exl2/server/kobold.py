"""TabbyAPI's KoboldAI API (`ServerConfig.kobold`, `exl2 serve --kobold`) for KoboldAI Lite, SillyTavern's Kobold
mode and other Kobold clients, and two discovery endpoints every server has: `/.well-known/serviceinfo` and
llama.cpp's `/props`.

A Kobold generation is one engine job built like a `/v1/completions` choice (`completions.Job`, its sampling
fields mapped and checked by `params`), so it batches with every other request. Running generations are kept by
genkey in the app's state, for `/api/extra/abort` and `/api/extra/generate/check`, and dropped when they end.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from importlib import metadata
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import APIRouter, Request, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse

from exl2.generation.generator import GenerationResult
from exl2.server import params
from exl2.server.completions import Choices, ClientGone, Job, engine_error, overridden, unless_disconnected
from exl2.server.errors import APIError
from exl2.server.host import host, serving, sse_ping
from exl2.server.schemas import SamplingFields

KAI_VERSION = "1.2.5"        # KoboldAI United's API version and the KoboldCpp release impersonated: clients
KCPP_VERSION = "1.74"        # enable features (streaming, abort, token counts) by them
ContextLength = Callable[[Any], int]


class KoboldGenerate(BaseModel):
    """A generate request with KoboldAI's and KoboldCpp's field names; unknown fields are ignored. Bounds are the
    OpenAI routes' for the same samplers, so a bad value is a 400 naming the Kobold field."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    memory: str = ""                 # KoboldCpp's: text put before the prompt and never trimmed away
    max_length: Optional[int] = Field(None, ge=1)   # None: the server's --max-tokens, as /config/max_length says
    max_context_length: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_a: float = Field(0.0, ge=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical: float = Field(1.0, ge=0.0, le=1.0)
    tfs: float = Field(1.0, ge=0.0, le=1.0)
    rep_pen: float = Field(1.0, gt=0.0)
    rep_pen_range: int = Field(0, ge=-1)
    rep_pen_slope: Optional[float] = None          # accepted, not applied: the penalty is flat over its range
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    smoothing_factor: float = Field(0.0, ge=0.0)
    dynatemp_range: float = Field(0.0, ge=0.0)
    dynatemp_exponent: float = Field(1.0, gt=0.0)
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0)
    dry_multiplier: float = Field(0.0, ge=0.0)
    dry_base: float = Field(1.75, ge=0.0)           # 0: the engine's default, as on the OpenAI routes
    dry_allowed_length: int = Field(2, ge=0)
    dry_penalty_last_n: int = Field(0, ge=-1)      # -1 or 0: the whole text
    dry_sequence_breakers: Optional[Union[list[str], str]] = None
    mirostat: int = Field(0, ge=0, le=2, validation_alias=AliasChoices("mirostat", "mirostat_mode"))
    mirostat_tau: float = Field(5.0, gt=0.0)        # KoboldCpp's defaults
    mirostat_eta: float = Field(0.1, gt=0.0)
    sampler_seed: Optional[int] = None              # negative: a random seed
    stop_sequence: Optional[Union[list[str], str]] = None
    banned_tokens: Optional[Union[list[str], str]] = None    # KoboldCpp's: strings, like banned_strings
    banned_strings: Optional[Union[list[str], str]] = None
    use_default_badwordsids: bool = False
    genkey: Optional[str] = None
    trim_stop: bool = True


class KoboldKey(BaseModel):
    model_config = ConfigDict(extra="ignore")

    genkey: Optional[str] = None


class KoboldText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str


# which Kobold fields each sampling field comes from: a field the request sent counts as sent for the server's
# sampler overrides (an `override` fills in only what a request leaves out)
_SOURCES = {"temperature": ("temperature",), "top_k": ("top_k",), "top_p": ("top_p",), "top_a": ("top_a",),
            "min_p": ("min_p",), "typical": ("typical",), "tfs": ("tfs",), "repetition_penalty": ("rep_pen",),
            "penalty_range": ("rep_pen_range",), "presence_penalty": ("presence_penalty",),
            "smoothing_factor": ("smoothing_factor",), "min_temp": ("dynatemp_range",),
            "max_temp": ("dynatemp_range",), "temp_exponent": ("dynatemp_exponent",),
            "xtc_probability": ("xtc_probability",), "xtc_threshold": ("xtc_threshold",),
            "dry_multiplier": ("dry_multiplier",), "dry_base": ("dry_base",),
            "dry_allowed_length": ("dry_allowed_length",), "dry_range": ("dry_penalty_last_n",),
            "dry_sequence_breakers": ("dry_sequence_breakers",), "mirostat_mode": ("mirostat",),
            "mirostat_tau": ("mirostat_tau",), "mirostat_eta": ("mirostat_eta",), "seed": ("sampler_seed",),
            "banned_strings": ("banned_tokens", "banned_strings")}


def _fields(body: KoboldGenerate) -> SamplingFields:
    """The request in TabbyAPI's sampling fields, so that `params` maps and checks them as for /v1/completions.
    dynatemp_range spreads TabbyAPI's min_temp/max_temp around the temperature (the low end clamped at 0)."""
    low = high = 1.0                                # equal: dynamic temperature off
    if body.dynatemp_range > 0:
        low, high = max(body.temperature - body.dynatemp_range, 0.0), body.temperature + body.dynatemp_range
        if high > 10.0:
            raise APIError(400, f"temperature + dynatemp_range must be at most 10, not {high:g}.",
                           param="dynatemp_range")
    banned = (params.banned_strings(body.banned_tokens) or ()) + (params.banned_strings(body.banned_strings) or ())
    seed = body.sampler_seed if body.sampler_seed is not None and body.sampler_seed >= 0 else None
    sent = {name for name, kobold in _SOURCES.items() if any(f in body.model_fields_set for f in kobold)}
    return SamplingFields.model_construct(
        sent,
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, top_a=body.top_a, min_p=body.min_p,
        typical=body.typical, tfs=body.tfs, repetition_penalty=body.rep_pen, penalty_range=body.rep_pen_range,
        presence_penalty=body.presence_penalty, smoothing_factor=body.smoothing_factor, min_temp=low, max_temp=high,
        temp_exponent=body.dynatemp_exponent, xtc_probability=body.xtc_probability,
        xtc_threshold=body.xtc_threshold, dry_multiplier=body.dry_multiplier, dry_base=body.dry_base,
        dry_allowed_length=body.dry_allowed_length, dry_range=max(body.dry_penalty_last_n, 0),
        dry_sequence_breakers=body.dry_sequence_breakers, mirostat_mode=body.mirostat,
        mirostat_tau=body.mirostat_tau, mirostat_eta=body.mirostat_eta, seed=seed, banned_strings=banned or None)


def _stops(body: KoboldGenerate) -> list[str]:
    """stop_sequence's strings: no cap of 4 as on the OpenAI routes, since Kobold clients send a stop per
    speaker."""
    stops = [body.stop_sequence] if isinstance(body.stop_sequence, str) else body.stop_sequence or []
    return [s for s in stops if s]


def _fit(tokenizer, prompt: str, limit: int, memory: str = "") -> list[int]:
    """The tokens of `memory` + `prompt`, with only the prompt's last tokens (memory and BOS kept) when they are
    more than `limit`: Kobold clients send the whole story and expect the server to keep its end."""
    if memory:
        ids = tokenizer.encode(memory + prompt)
        head = tokenizer.encode(memory)
        if ids[:len(head)] != head:   # the two texts merge into one token at the seam: trim without memory
            head = []
    else:
        ids = tokenizer.encode(prompt)
        head = []
    if len(ids) <= limit:
        return ids
    bos = getattr(tokenizer, "bos_id", None)
    if not head and bos is not None and ids and ids[0] == bos:
        head = ids[:1]
    keep = max(limit - len(head), 0)
    return head + (ids[len(ids) - keep:] if keep else [])


def _stop_suffix(tokenizer, result: Optional[GenerationResult], stops: list[str]) -> str:
    """The stop string that ended `result` (the engine cuts it from the text), for trim_stop false: the text of
    all the reply's tokens goes on with it."""
    if result is None or result.finish_reason != "stop" or not stops:
        return ""
    rest = tokenizer.decode(result.token_ids)[len(result.text):]
    return max((s for s in stops if rest.startswith(s)), key=len, default="")


@dataclass
class _Generation:
    """A running Kobold generation: its engine job (for abort) and the text so far (for check)."""

    choices: Choices
    text: str = ""
    aborted: bool = False

    async def abort(self) -> None:
        self.aborted = True
        await self.choices.close()          # cancels the engine job; `pieces` then ends the reply as it stands

    async def pieces(self) -> AsyncIterator[tuple[str, Optional[str], Optional[GenerationResult]]]:
        """(new text, finish_reason or None, result or None) as the engine produces them; an abort ends the reply
        with the text so far and finish_reason "stop"."""
        try:
            async for _, text, result, _ in self.choices.events():
                self.text += text
                yield text, result.finish_reason if result is not None else None, result
        except Exception:
            if not self.aborted:
                raise
            yield "", "stop", None


def _registry(request: Request) -> dict[str, _Generation]:
    state = request.app.state
    if not hasattr(state, "kobold_generations"):
        state.kobold_generations = {}
    return state.kobold_generations


def _find(request: Request, genkey: Optional[str]) -> Optional[_Generation]:
    """The running generation with this genkey; without one, the latest started (KoboldCpp's single-user form)."""
    running = _registry(request)
    if genkey is None:
        return next(reversed(running.values()), None)
    return running.get(genkey)


def _forget(request: Request, genkey: str, gen: _Generation) -> None:
    running = _registry(request)
    if running.get(genkey) is gen:          # a later request may have reused the genkey
        del running[genkey]


async def _start(request: Request, body: KoboldGenerate, context_length: ContextLength
                 ) -> tuple[str, _Generation, list[str]]:
    """Check the request, start its engine job and register it: (genkey, generation, stop strings). The prompt
    keeps its last tokens that fit min(max_context_length, the context) less max_length, as KoboldCpp does, so a
    long story never fails on the context."""
    st = serving(request)
    fields = overridden(request, _fields(body))
    params.check_supported(fields)
    settings = params.sampling(fields)
    stops = _stops(body)
    window = min(body.max_context_length or context_length(st.engine), context_length(st.engine))
    new_tokens = body.max_length or st.config.max_tokens
    prompt = _fit(st.engine.tokenizer, body.prompt, max(window - new_tokens, 1), body.memory)
    job = Job(prompt, settings, new_tokens, stops, None, "prompt", ignore_eos=body.use_default_badwordsids)
    gen = _Generation(Choices(st.engine, [job]))
    genkey = body.genkey or f"kobold-{secrets.token_hex(8)}"
    _registry(request)[genkey] = gen
    try:
        await gen.choices.start()
    except BaseException as e:
        if isinstance(e, APIError) and gen.aborted:
            return genkey, gen, stops       # aborted while starting: `pieces` ends the empty reply
        _forget(request, genkey, gen)       # a 400, or this request cancelled: no generation runs
        await gen.choices.close()
        raise
    return genkey, gen, stops


def _event(data: dict, event: str = "message") -> dict:
    return {"event": event, "data": json.dumps(data, ensure_ascii=False)}


def router(auth, engine, context_length: ContextLength) -> APIRouter:
    """The Kobold routes; `auth` is the API-key dependency, `engine` the one that pins the model (host.acquire).
    `context_length(engine)` is the context the server reports (app.py's)."""
    r = APIRouter()
    served = [auth, engine]

    @r.post("/api/v1/generate", dependencies=served)
    @r.post("/api/latest/generate", dependencies=served)
    async def generate(body: KoboldGenerate, request: Request):
        """`{"results": [{"text", "finish_reason"}]}`; an abort returns the text generated until then."""
        genkey, gen, stops = await _start(request, body, context_length)

        async def collect() -> tuple[str, Optional[GenerationResult]]:
            reason, last = "length", None
            async for _, finish, result in gen.pieces():
                reason, last = finish or reason, result or last
            return reason, last

        try:
            reason, result = await unless_disconnected(request, collect())
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as e:
            raise engine_error(e, "prompt") from e
        finally:
            _forget(request, genkey, gen)       # first: a cancelled request stops at the await below
            await gen.choices.close()
        text = gen.text + ("" if body.trim_stop else _stop_suffix(serving(request).engine.tokenizer, result, stops))
        return {"results": [{"text": text, "finish_reason": reason}]}

    @r.post("/api/extra/generate/stream", dependencies=served)
    async def generate_stream(body: KoboldGenerate, request: Request):
        """KoboldCpp's stream: `event: message` with `{"token", "finish_reason"}` per piece, the last one carrying
        the finish_reason; an error after the start is an `event: error` with the OpenAI error body."""
        genkey, gen, stops = await _start(request, body, context_length)
        tokenizer = serving(request).engine.tokenizer

        async def events() -> AsyncIterator[dict]:
            try:
                async for text, finish, result in gen.pieces():
                    if finish is not None and not body.trim_stop:
                        text += _stop_suffix(tokenizer, result, stops)
                    if text or finish is not None:
                        yield _event({"token": text, "finish_reason": finish})
            except Exception as e:
                yield _event(engine_error(e, None).body(), "error")
            finally:
                _forget(request, genkey, gen)  # first: a client gone cancels this at the await below
                await gen.choices.close()      # the engine cancels the job

        # "\n" line ends, as KoboldCpp sends them: some Kobold clients split events on "\n\n"
        return EventSourceResponse(events(), ping=sse_ping(request), sep="\n")

    @r.post("/api/extra/abort", dependencies=[auth])
    async def abort(request: Request, body: Optional[KoboldKey] = None):
        """Stop the generation with this genkey; `success` false when none runs."""
        gen = _find(request, body.genkey if body else None)
        if gen is None:
            return {"success": False}
        await gen.abort()
        return {"success": True}

    @r.get("/api/extra/generate/check", dependencies=[auth])
    @r.post("/api/extra/generate/check", dependencies=[auth])
    async def check(request: Request, body: Optional[KoboldKey] = None):
        """The text a running generation has produced so far ("" when none runs with this genkey)."""
        gen = _find(request, body.genkey if body else None)
        return {"results": [{"text": gen.text if gen is not None else ""}]}

    @r.get("/api/v1/model", dependencies=served)
    async def model(request: Request):
        return {"result": f"exl2/{serving(request).name}"}

    @r.post("/api/extra/tokencount", dependencies=served)
    async def tokencount(body: KoboldText, request: Request):
        """The prompt's tokens as a generate request would count them (the tokenizer's own BOS rule)."""
        ids = serving(request).engine.tokenizer.encode(body.prompt)
        return {"value": len(ids), "ids": ids}

    @r.get("/api/v1/config/max_length", dependencies=served)
    async def max_length(request: Request):
        return {"value": host(request).config.max_tokens}    # what a generate request without max_length gets

    @r.get("/api/v1/config/max_context_length", dependencies=served)
    @r.get("/api/extra/true_max_context_length", dependencies=served)
    async def max_context_length(request: Request):
        return {"value": context_length(serving(request).engine)}

    @r.get("/api/v1/info/version", dependencies=[auth])
    async def kai_version():
        return {"result": KAI_VERSION}

    @r.get("/api/extra/version", dependencies=[auth])
    async def kcpp_version():
        return {"result": "KoboldCpp", "version": KCPP_VERSION}

    return r


def _package_version() -> str:
    try:
        return metadata.version("exl2")
    except metadata.PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown"


def discovery_router(auth, context_length: ContextLength) -> APIRouter:
    """`/.well-known/serviceinfo` (no key: it says which APIs to call, with which keys being their business) and
    llama.cpp's `/props` (API key; 503 without a model, like /v1/model)."""
    r = APIRouter()

    @r.get("/.well-known/serviceinfo")
    async def serviceinfo(request: Request):
        """The service descriptor TabbyAPI and KoboldCpp serve: the software and its APIs, each by its URL as this
        request reached the server (`base_url`) and its path (`rel_url`, right behind a proxy too)."""
        root = str(request.base_url).rstrip("/")

        def api(name: str, path: str, **extra) -> dict:
            return {"name": name, "base_url": root + path, "rel_url": path, **extra}

        apis = {"openai": api("OpenAI API", "/v1")}
        if host(request).config.kobold:
            apis["koboldai"] = api("KoboldAI API", "/api", version=KAI_VERSION)
        return {"version": 0.2, "software": {"name": "exl2", "version": _package_version()}, "api": apis}

    @r.get("/props", dependencies=[auth])
    async def props(request: Request):
        """llama.cpp's server properties: batch slots, the context and the chat template the server renders
        with."""
        engine = serving(request).engine
        template = getattr(engine, "template", None)
        return {"total_slots": engine.config.max_batch_size,
                "default_generation_settings": {"n_ctx": context_length(engine)},
                "chat_template": getattr(template, "source", None) or ""}

    return r
