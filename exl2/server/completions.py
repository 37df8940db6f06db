"""POST /v1/chat/completions and /v1/completions, streamed (SSE) or not.

Requests are not serialized here: each one is its own `engine.aevents` stream and the engine batches them.
Closing that stream (`aclose`) is how the engine learns a client went away, so every path closes it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Optional

from fastapi import APIRouter, Request, Response
from sse_starlette.sse import EventSourceResponse

from exl2.config import SamplingSettings
from exl2.errors import Exl2Error
from exl2.generation.chat import parse_tool_calls
from exl2.generation.constraints import Grammar
from exl2.server import params
from exl2.server.errors import APIError, from_engine
from exl2.server.messages import template_messages
from exl2.server.schemas import ChatCompletionRequest, CompletionRequest
from exl2.server.tools import ToolCallHoldback, content_before_calls, openai_tool_calls, template_tools

log = logging.getLogger("exl2.server")
router = APIRouter()
DISCONNECT_POLL_S = 0.5
Event = tuple[str, Any]


@dataclass
class Job:
    """What one request asks the engine for; `param` names the request field blamed for engine errors."""

    prompt: str | list[int]
    settings: SamplingSettings
    max_new_tokens: int
    stop_strings: list[str]
    add_bos: Optional[bool]
    param: str
    grammar: Optional[Grammar] = None

    def events(self, engine) -> AsyncIterator[Event]:
        return engine.aevents(self.prompt, self.settings, self.max_new_tokens, self.stop_strings, self.add_bos,
                              grammar=self.grammar)


class _ClientGone(Exception):
    pass


def _usage(result) -> dict[str, int]:
    done = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": done,
            "total_tokens": result.prompt_tokens + done}


def _job(req, engine, prompt, add_bos: Optional[bool], param: str, default_max: int) -> Job:
    return Job(prompt, params.sampling(req), params.max_new_tokens(req, default_max), params.stop_strings(req),
               add_bos, param, params.response_grammar(engine, req.response_format))


async def _close(agen) -> None:
    with contextlib.suppress(RuntimeError):      # already running: its task was cancelled and is unwinding
        await agen.aclose()


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client hangs up: a non-streamed request has no send to fail on."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _generate(request: Request, engine, job: Job):
    """Run a job to the end; the final GenerationResult."""
    agen = job.events(engine)

    async def collect():
        result = None
        async for _, r in agen:
            result = r or result
        if result is None:
            raise RuntimeError("the engine's event stream ended without a result")
        return result

    try:
        return await _unless_disconnected(request, collect())
    except (APIError, _ClientGone):
        raise
    except Exception as e:
        raise _engine_error(e, job.param) from e
    finally:
        await _close(agen)


def _engine_error(e: Exception, param: str) -> APIError:
    err = from_engine(e, param)
    if err.status >= 500:
        log.error("generation failed", exc_info=e)
    return err


async def _start(engine, job: Job) -> tuple[Optional[Event], AsyncIterator[Event]]:
    """Start a streamed job and wait for its first event, so a prompt that does not fit is answered with a 400
    before the 200 and the event stream begin."""
    agen = job.events(engine)
    try:
        return await agen.__anext__(), agen
    except StopAsyncIteration:
        return None, agen
    except Exception as e:
        await _close(agen)
        raise _engine_error(e, job.param) from e


def _sse(chunks: AsyncIterator[str]) -> EventSourceResponse:
    return EventSourceResponse(chunks, ping=15)


async def _stream(first: Optional[Event], agen: AsyncIterator[Event], prelude: list[str], on_text, finish
                  ) -> AsyncIterator[str]:
    """Drive a started job: the `prelude` chunks, `on_text(text)` chunks while tokens arrive, `finish(result)`
    chunks at the end, then [DONE]. An error after the 200 can only be reported in-band, as an OpenAI error
    event (the openai client raises it). One generator, so closing it (client gone) closes the job.
    """
    try:
        for chunk in prelude:
            yield chunk
        event, result = first, None
        while event is not None:
            text, r = event
            result = r or result
            if text:
                for chunk in on_text(text):
                    yield chunk
            event = None if result is not None else await anext(agen, None)
        if result is None:
            raise RuntimeError("the engine's event stream ended without a result")
        for chunk in finish(result):
            yield chunk
        yield "[DONE]"
    except Exception as e:
        yield json.dumps(_engine_error(e, None).body())
    finally:
        await _close(agen)


def _state(request: Request):
    return request.app.state.exl2


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = _state(request)
    params.check_supported(body)
    job = _job(body, st.engine, "", False, "messages", st.config.max_tokens)      # checks every field before rendering
    tools = template_tools(body.tools, body.tool_choice)
    messages = template_messages(body.messages)
    try:
        job.prompt = st.engine.chat_prompt(messages, tools)
    except Exl2Error as e:
        raise _engine_error(e, "messages") from e
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": st.name}

    if not body.stream:
        try:
            result = await _generate(request, st.engine, job)
        except _ClientGone:
            return Response(status_code=499)
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish = result.finish_reason
        calls = parse_tool_calls(result.text) if tools else []
        if calls:
            message = {"role": "assistant", "content": content_before_calls(result.text),
                       "tool_calls": openai_tool_calls(calls)}
            finish = "tool_calls"
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": _usage(result)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    holdback = ToolCallHoldback() if tools else None

    def chunk(delta: dict, finish: Optional[str] = None) -> str:
        return json.dumps({**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}, ensure_ascii=False)

    def on_text(text: str):
        out = holdback.push(text) if holdback else text
        if out:
            yield chunk({"content": out})

    def finish(result):
        reason = result.finish_reason
        if holdback:
            calls = parse_tool_calls(holdback.text)
            if calls:
                for i, call in enumerate(openai_tool_calls(calls)):
                    yield chunk({"tool_calls": [{"index": i, **call}]})
                reason = "tool_calls"
            elif holdback.rest():
                yield chunk({"content": holdback.rest()})
        yield chunk({}, reason)
        if include_usage:
            yield json.dumps({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(result)})

    first, agen = await _start(st.engine, job)
    return _sse(_stream(first, agen, [chunk({"role": "assistant", "content": ""})], on_text, finish))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = _state(request)
    params.check_supported(body)
    prompt = params.completion_prompt(body)
    job = _job(body, st.engine, prompt, body.add_bos_token if isinstance(prompt, str) else None, "prompt", st.config.max_tokens)
    echo = "" if not body.echo else prompt if isinstance(prompt, str) else st.engine.tokenizer.decode(prompt)
    head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": st.name}

    def choice(text: str, finish: Optional[str]) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    if not body.stream:
        try:
            result = await _generate(request, st.engine, job)
        except _ClientGone:
            return Response(status_code=499)
        return {**head, "choices": [choice(echo + result.text, result.finish_reason)], "usage": _usage(result)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str, finish: Optional[str] = None) -> str:
        return json.dumps({**head, "choices": [choice(text, finish)]}, ensure_ascii=False)

    def on_text(text: str):
        yield chunk(text)

    def finish(result):
        yield chunk("", result.finish_reason)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": _usage(result)})

    first, agen = await _start(st.engine, job)
    return _sse(_stream(first, agen, [chunk(echo)] if echo else [], on_text, finish))
