"""POST /v1/chat/completions and /v1/completions, streamed (SSE) or not.

Requests are not serialized here: each choice of a request (n per prompt) is its own `engine.aevent_stream`,
and the engine batches them with every other request's. Closing a stream (`aclose`) is how the engine learns a
client went away, so every path closes all of a request's streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Optional

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from exl2.config import LoraSpec, SamplingSettings
from exl2.errors import ConfigError, Exl2Error
from exl2.generation.budget import DEFAULT_TAGS, ReasoningBudget, ThinkTags, budget_end
from exl2.generation.chat import parse_tool_calls
from exl2.generation.constraints import Grammar
from exl2.generation.generator import GenerationResult
from exl2.generation.harmony import HarmonySplitter, is_harmony
from exl2.generation.harmony import split as harmony_split
from exl2.generation.multimodal import split_images
from exl2.generation.output import TokenLogprob
from exl2.names import plain_name
from exl2.server import params
from exl2.server.errors import APIError, first_problem, from_engine
from exl2.server.host import host, serving, sse_ping
from exl2.server.messages import template_messages, template_variables
from exl2.server.reasoning import ReasoningSplitter, opens_thinking, split_reasoning
from exl2.server.schemas import ChatCompletionRequest, CompletionRequest, RequestLora
from exl2.server.tools import (ToolCallHoldback, as_function_call, content_before_calls, from_functions,
                               openai_tool_calls, template_tools)

log = logging.getLogger("exl2.server")
router = APIRouter()
DISCONNECT_POLL_S = 0.5
Event = tuple[str, Optional[GenerationResult], list[TokenLogprob]]


@dataclass
class Job:
    """What one choice asks the engine for; `param` names the request field blamed for engine errors."""

    prompt: str | list[int]
    settings: SamplingSettings
    max_new_tokens: int
    stop_strings: list[str]
    add_bos: Optional[bool]
    param: str
    grammar: Optional[Grammar] = None
    logprobs: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_new_tokens: int = 0
    ignore_eos: bool = False
    negative_prompt: Optional[str] = None    # classifier-free guidance's (settings.cfg_scale)
    budget: Optional[ReasoningBudget] = None  # chat: close the think block after so many tokens
    images: tuple = ()                       # chat: the images whose tokens `prompt` (ids then) holds
    loras: Optional[tuple] = None            # the request's own adapters ((LoraAdapter, scaling), ...)

    async def events(self, engine) -> AsyncIterator[Event]:
        """(new text, result or None, the new tokens' log-probability records: empty when none) from the
        engine."""
        stream = engine.aevent_stream(self.prompt, self.settings, self.max_new_tokens, self.stop_strings,
                                      self.add_bos, self.grammar, self.logprobs, stop_token_ids=self.stop_token_ids,
                                      min_new_tokens=self.min_new_tokens, ignore_eos=self.ignore_eos,
                                      negative_prompt=self.negative_prompt, budget=self.budget, images=self.images,
                                      loras=self.loras)
        try:
            async for event in stream:
                yield event.text, event.result, event.logprobs
        finally:
            await _close(stream)


class ClientGone(Exception):
    pass


def _jobs(req, engine, prompts: list, add_bos: Optional[bool], param: str, default_max: int,
          per_prompt: Optional[int] = None) -> list[Job]:
    """The request fanned out into one job per choice, prompt-major: choice index = prompt index * n + i.
    Choice i samples with seed + i; each job gets its own grammar, since a grammar holds parse state.
    `per_prompt` candidates instead of n (best_of): they record their tokens' log-probabilities for the ranking."""
    count = per_prompt or req.n
    want = params.logprobs(req)
    if per_prompt is not None and want is None:
        want = 0
    max_new, stops = params.max_new_tokens(req, default_max), params.stop_strings(req)
    vocab = getattr(engine.model.spec, "vocab_size", None)
    bias = params.logit_bias(req, vocab)
    lists = dict(banned=params.token_list(req, "banned_tokens", vocab),
                 allowed=params.token_list(req, "allowed_tokens", vocab))
    ends = dict(stop_token_ids=params.stop_token_ids(req, vocab), min_new_tokens=params.min_new_tokens(req, max_new),
                ignore_eos=params.ignore_eos(req), negative_prompt=req.negative_prompt or None)
    return [Job(prompt, params.sampling(req, i, bias, **lists), max_new, stops, add_bos, param,
                params.response_grammar(engine, req), want, **ends)
            for prompt in prompts for i in range(count)]


def _model_as_lora(root, model: Optional[str], served: str) -> Optional[list[RequestLora]]:
    """vLLM's convention: a `model` that names an adapter directory under --lora-dir (not the served model) asks
    for the served model with that adapter."""
    if root is None or not isinstance(model, str) or model == served or not plain_name(model):
        return None
    return [RequestLora(name=model)] if (root / model / "adapter_config.json").is_file() else None


async def request_loras(request: Request, body, engine, jobs: list[Job]) -> None:
    """Give the jobs the request's own LoRA adapters (`loras`: names under --lora-dir; or a `model` naming one),
    each directory read once for the engine (off the event loop); a bad name or adapter is a 400 blaming
    `loras`."""
    root = host(request).config.lora_dir
    chosen = body.loras if body.loras is not None else _model_as_lora(root, body.model, serving(request).name)
    if chosen is None:
        return
    from exl2.server.admin import lora_path

    specs = [LoraSpec(path=lora_path(root, x.name, "loras"), scaling=x.scaling) for x in chosen]
    try:
        chosen = await asyncio.to_thread(engine.request_loras, specs)
    except Exl2Error as e:
        raise APIError(400, str(e), param="loras", code="invalid_lora") from None
    for job in jobs:
        job.loras = chosen


def best_of(results: list[GenerationResult], per_prompt: int, n: int) -> list[GenerationResult]:
    """OpenAI's best_of: of each prompt's `per_prompt` candidates, the n with the highest log-probability per
    generated token, best first (an empty candidate ranks last)."""
    def score(r: GenerationResult) -> float:
        lps = r.logprobs or []
        return sum(x.logprob for x in lps) / len(lps) if lps else float("-inf")
    out = []
    for start in range(0, len(results), per_prompt):
        group = results[start:start + per_prompt]
        out += sorted(group, key=score, reverse=True)[:n]
    return out


def _token(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(tokenizer, records: Optional[list[TokenLogprob]]) -> Optional[dict[str, Any]]:
    """A chat choice's `logprobs`: each token with its log-probability and top alternatives."""
    if records is None:
        return None
    return {"content": [{**_token(tokenizer, x.token_id, x.logprob),
                         "top_logprobs": [_token(tokenizer, t, lp) for t, lp in x.top]} for x in records],
            "refusal": None}


def _completion_logprobs(tokenizer, records: Optional[list[TokenLogprob]], start: int = 0
                         ) -> Optional[dict[str, Any]]:
    """A text completion choice's legacy `logprobs` object (tokens, their log-probabilities, top alternatives by
    token text, offsets into the text, the first at `start`)."""
    if records is None:
        return None
    tokens = [tokenizer.decode([x.token_id]) for x in records]
    offsets = [start + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in records],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in x.top} for x in records],
            "text_offset": offsets}


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _usage(results: list[GenerationResult], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (every n-th result starts a prompt), completion tokens of every choice, and
    how many prompt tokens the prompt cache held (OpenAI's prompt_tokens_details.cached_tokens). TabbyAPI's timings:
    the choices run together, so the request took as long as its slowest one (each time the largest over the
    choices), and the rates are the request's tokens over those times."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    done = sum(len(r.token_ids) for r in results)
    cached = sum(r.cached_tokens for r in results[::n])
    prompt_time = max(r.time_prefill for r in results)
    completion_time = max(r.time_generate for r in results)
    total_time = max(r.time_queued + r.time_prefill + r.time_generate for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached},
            "prompt_time": prompt_time, "prompt_tokens_per_sec": _rate(prompt, prompt_time),
            "completion_time": completion_time, "completion_tokens_per_sec": _rate(done, completion_time),
            "total_time": total_time}


def log_jobs(config, jobs: list[Job]) -> None:
    """ServerConfig.log_prompt / log_generation_params: a request's prompts and settings, one line each (the
    prompts of a request's several choices are the same: logged once a distinct prompt)."""
    if config.log_prompt:
        seen: list = []
        for job in jobs:
            if job.prompt not in seen:
                seen.append(job.prompt)
                log.info("prompt: %s", json.dumps(job.prompt, ensure_ascii=False))
    if config.log_generation_params:
        job = jobs[0]
        given = job.settings.model_dump(exclude_defaults=True, exclude={"seed"})
        log.info("generation params: %s", json.dumps({**given, "max_tokens": job.max_new_tokens,
                                                       "stop": job.stop_strings, "n": len(jobs)},
                                                      ensure_ascii=False, default=str))


def log_metrics(results: list[GenerationResult]) -> None:
    """One line per finished request for whoever runs the server (TabbyAPI logs the same): its jobs' prompt and
    generated tokens, speeds and times."""
    u = _usage(results, 1)
    reasons = ",".join(sorted({r.finish_reason for r in results}))
    log.info("finished %d job%s: %d prompt tokens (%d cached) in %.2f s (%.0f tok/s), %d generated in %.2f s "
             "(%.0f tok/s), %.2f s in all, finish %s", len(results), "" if len(results) == 1 else "s",
             u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["prompt_time"],
             u["prompt_tokens_per_sec"], u["completion_tokens"], u["completion_time"],
             u["completion_tokens_per_sec"], u["total_time"], reasons)


async def _close(agen) -> None:
    with contextlib.suppress(RuntimeError):      # already running: its task was cancelled and is unwinding
        await agen.aclose()


def engine_error(e: Exception, param: Optional[str]) -> APIError:
    err = from_engine(e, param)
    if err.status >= 500:
        log.error("generation failed", exc_info=e)
    return err


class Choices:
    """A request's jobs running together: one task per choice owns its engine stream and feeds a shared queue,
    so `events()` interleaves the choices as the engine produces them. `close()` cancels the tasks, which
    closes every stream (the engine then cancels the jobs)."""

    def __init__(self, engine, jobs: list[Job]):
        self.engine, self.jobs = engine, jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.results: list[Optional[GenerationResult]] = [None] * len(jobs)
        self.closed = False          # close() was called: streams that end now were ended on purpose

    async def start(self) -> None:
        """Start every job and wait for each one's first event, so a prompt that does not fit is answered with
        a 400 before the 200 and the event stream begin."""
        loop = asyncio.get_running_loop()
        started = [loop.create_future() for _ in self.jobs]
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(started)]
        firsts = await asyncio.gather(*started, return_exceptions=True)
        errors = [e for e in firsts if isinstance(e, BaseException)]
        if errors:
            on_purpose = self.closed     # closed while starting (a Kobold abort): no failure to log
            await self.close()
            err = from_engine(errors[0], self.jobs[0].param) if on_purpose else engine_error(errors[0],
                                                                                              self.jobs[0].param)
            raise err from errors[0]

    async def _pump(self, i: int, started: asyncio.Future) -> None:
        stream = self.jobs[i].events(self.engine)
        try:
            async for text, result, logprobs in stream:
                if not started.done():
                    started.set_result(None)
                self.queue.put_nowait((i, text, result, logprobs, None))
                if result is not None:
                    return
            raise RuntimeError("the engine's event stream ended without a result")
        except BaseException as e:       # start() and events() must hear of every end, a cancellation included
            error = e if isinstance(e, Exception) else RuntimeError(f"the engine stream ended: {e!r}")
            if not started.done():
                started.set_exception(error)
            self.queue.put_nowait((i, "", None, [], error))
            if error is not e:
                raise
        finally:
            await _close(stream)

    async def events(self) -> AsyncIterator[tuple[int, str, Optional[GenerationResult], list]]:
        """(choice index, new text, result or None, new tokens' log-probabilities or None) until every choice
        has its result (then all are in `results`); a choice's error is raised."""
        left = len(self.jobs)
        while left:
            i, text, result, logprobs, error = await self.queue.get()
            if error is not None:
                raise error
            if result is not None:
                self.results[i] = result
                left -= 1
                if not left:
                    log_metrics(self.results)
            yield i, text, result, logprobs

    async def close(self) -> None:
        self.closed = True
        for task in self.tasks:       # synchronous, so it holds even if this coroutine is cancelled at the await
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client hangs up: a non-streamed request has no send to fail on."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _generate(request: Request, engine, jobs: list[Job]) -> list[GenerationResult]:
    """Run the jobs to the end; their final GenerationResults in choice order."""
    choices = Choices(engine, jobs)

    async def collect():
        await choices.start()
        async for _ in choices.events():
            pass
        return choices.results

    try:
        return await unless_disconnected(request, collect())
    except (APIError, ClientGone):
        raise
    except Exception as e:
        raise engine_error(e, jobs[0].param) from e
    finally:
        await choices.close()


async def _stream(request: Request, engine, jobs: list[Job], prelude, on_text, finish, usage_head: Optional[dict],
                  n: int) -> EventSourceResponse:
    """Start the jobs, then stream SSE data: each choice's `prelude(i)` chunks, `on_text(i, text, logprobs)` chunks
    while its tokens arrive and `finish(i, result)` chunks when it ends (choices interleaved as produced), the usage
    chunk (`usage_head` plus `usage`, if given) once all ended, then [DONE]. An error after the 200 can only be
    reported in-band, as an OpenAI error event (the openai client raises it). Closing the event generator
    (client gone) closes every choice's job.
    """
    choices = Choices(engine, jobs)
    await choices.start()

    async def chunks() -> AsyncIterator[str]:
        try:
            for i in range(len(jobs)):
                for chunk in prelude(i):
                    yield chunk
            async for i, text, result, logprobs in choices.events():
                if text or logprobs:
                    for chunk in on_text(i, text, logprobs):
                        yield chunk
                if result is not None:
                    for chunk in finish(i, result):
                        yield chunk
            if usage_head is not None:
                yield json.dumps({**usage_head, "usage": _usage(choices.results, n)})
            yield "[DONE]"
        except Exception as e:
            yield json.dumps(engine_error(e, None).body())
        finally:
            await choices.close()

    return EventSourceResponse(chunks(), ping=sse_ping(request))


def _state(request: Request):
    return serving(request)         # the model pinned to this request when it started (host.acquire)


def _usage_head(body, head: dict) -> Optional[dict]:
    """The usage chunk's fields but `usage`, or None when stream_options.include_usage is off."""
    return {**head, "choices": []} if body.stream_options and body.stream_options.include_usage else None


def _stop_fields(result: GenerationResult) -> dict[str, Any]:
    """TabbyAPI's extra choice fields: why the reply ended (`eos_reason`) and the stop string or token that ended it
    (`stop_str`)."""
    out: dict[str, Any] = {"eos_reason": result.eos_reason}
    if result.stop_str is not None:
        out["stop_str"] = result.stop_str
    return out


def _chat_message(result: GenerationResult, tools, thinking: Optional[bool], prefix: str = "",
                  tags: ThinkTags = DEFAULT_TAGS, legacy: bool = False) -> tuple[dict[str, Any], str]:
    """A finished reply, after the `prefix` it continues (TabbyAPI's response_prefix, part of the reply), as an
    assistant message with its finish_reason. With the reasoning parser on (`thinking`: whether the reply started
    inside a think block; None: off) the block is `reasoning_content`; tool calls are parsed from the rest when
    tools were given (`legacy`: as the pre-tools API's one `function_call`)."""
    text, message = prefix + result.text, {"role": "assistant"}
    if thinking is not None:
        reasoning, text = split_reasoning(text, thinking, tags)
        message["reasoning_content"] = reasoning or None
        if reasoning is not None and not text:
            text = None                   # it only thought (e.g. stopped by max_tokens): no answer yet
    calls = openai_tool_calls(parse_tool_calls(text, tools)) if tools and text else []
    return _with_calls(message, text, content_before_calls(text) if calls else None, calls, legacy,
                       result.finish_reason)


def _harmony_message(result: GenerationResult, tools, prefix: str = "",
                     legacy: bool = False) -> tuple[dict[str, Any], str]:
    """A finished gpt-oss reply read by channel (generation.harmony): analysis as `reasoning_content`, final and
    commentary preambles as `content`, commentary addressed to a function as its tool calls (when tools were
    given)."""
    reasoning, content, calls = harmony_split(prefix + result.text)
    message = {"role": "assistant", "reasoning_content": reasoning or None}
    calls = openai_tool_calls(calls) if tools and calls else []
    return _with_calls(message, content, content or None, calls, legacy, result.finish_reason)


def _with_calls(message: dict[str, Any], content: Optional[str], before: Optional[str], calls: list[dict],
                legacy: bool, finish: str) -> tuple[dict[str, Any], str]:
    """The assistant message and its finish_reason: with (OpenAI-shaped) `calls`, what came `before` them as
    content and the calls as tool_calls (`legacy`: the pre-tools API's one function_call); else `content`."""
    if calls and legacy:
        return {**message, "content": before, "function_call": as_function_call(calls)}, "function_call"
    if calls:
        return {**message, "content": before, "tool_calls": calls}, "tool_calls"
    return {**message, "content": content}, finish


def _delta(reasoning: str, content: str) -> dict[str, str]:
    """A streamed chat delta with the non-empty ones of the two."""
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}


def overridden(request: Request, body):
    """The request with the server's sampler overrides applied (`overrides.Overrides.apply`); a combination the
    schema refuses is a 400 naming the field."""
    try:
        return host(request).overrides.apply(body)
    except ValidationError as e:
        field, msg = first_problem(e)
        raise APIError(400, f"With the server's sampler overrides, '{field}' is invalid: {msg}.", param=field) \
            from None


def _request_template(request: Request, engine, name: Optional[str]):
    """The request's own chat template (TabbyAPI's per-request prompt_template), None for the served one. By name
    only: a client cannot point the server at a file."""
    if name is None:
        return None
    if not plain_name(name) or name.endswith(".jinja"):
        raise APIError(400, "prompt_template must be the name of a template, not a path.", param="prompt_template")
    try:
        return engine.named_template(name, host(request).config.template_dir)
    except ConfigError as e:
        raise APIError(400, str(e), param="prompt_template", code="template_not_found") from None


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = _state(request)
    body, legacy = from_functions(overridden(request, body))
    params.check_supported(body)
    jobs = _jobs(body, st.engine, [""], False, "messages", st.config.max_tokens)   # checks every field first
    await request_loras(request, body, st.engine, jobs)
    tools = template_tools(body.tools, body.tool_choice)
    for job in jobs:  # a grammar holds parse state: one per choice
        job.grammar = params.tool_grammar(st.engine, tools, body.tool_choice) or job.grammar
    messages = template_messages(body.messages, images=st.engine.vision is not None)
    template = _request_template(request, st.engine, body.prompt_template)
    variables = template_variables(body, template or st.engine.template, st.config.template_vars_default,
                                   st.config.template_vars_force)
    opening = body.add_generation_prompt
    if body.continue_final_message:
        if opening and "add_generation_prompt" in body.model_fields_set:
            raise APIError(400, "continue_final_message continues the last message, so add_generation_prompt "
                                "cannot be true with it.", param="add_generation_prompt")
        if messages[-1]["role"] != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's.",
                           param="messages")
        opening = False
    prefix = body.response_prefix or ""
    messages, sources = split_images(messages)
    images: tuple = ()
    try:
        prompt = st.engine.chat_prompt(messages, tools, add_generation_prompt=opening,
                                       continue_final_message=body.continue_final_message, template=template,
                                       **variables)
        if sources:   # encoding the images runs the vision tower: off the event loop
            ids, images = await asyncio.to_thread(st.engine.image_prompt, prompt + prefix, sources)
    except Exl2Error as e:
        raise engine_error(e, "messages") from e
    mode = st.config.start_in_reasoning
    starts_thinking = opens_thinking(prompt, st.tags) if mode == "auto" else mode == "always"
    for job in jobs:
        job.prompt, job.images = (ids, images) if images else (prompt + prefix, ())
        if body.reasoning_budget_tokens is not None:   # one each: a budget follows its own reply
            job.budget = ReasoningBudget(body.reasoning_budget_tokens,
                                         budget_end(st.engine.tokenizer, body.reasoning_budget_message or "",
                                                    st.tags),
                                         inside=starts_thinking, tags=st.tags)
    # A grammar (structured output, a forced tool_choice) holds from the reply's first token, so such a reply cannot
    # think first, even where the prompt opens a think block: it is all content.
    constrained = any(job.grammar is not None for job in jobs)
    thinking = (starts_thinking and not constrained) if st.reasoning else None
    channels = is_harmony((template or st.engine.template).source)   # gpt-oss: reasoning and calls by channel
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": st.name}
    log_jobs(st.config, jobs)

    if not body.stream:
        try:
            results = await _generate(request, st.engine, jobs)
        except ClientGone:
            return Response(status_code=499)
        choices = []
        for i, result in enumerate(results):
            message, finish = _harmony_message(result, tools, prefix, legacy) if channels else \
                _chat_message(result, tools, thinking, prefix, st.tags, legacy)
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": _chat_logprobs(st.engine.tokenizer, result.logprobs), **_stop_fields(result)})
        return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(results, body.n)}

    head["object"] = "chat.completion.chunk"
    holdbacks = [ToolCallHoldback() for _ in jobs] if tools and not channels else None
    if channels:
        splitters = [HarmonySplitter() for _ in jobs]
    else:
        splitters = [ReasoningSplitter(thinking, st.tags) for _ in jobs] if thinking is not None else None

    def chunk(i: int, delta: dict, finish: Optional[str] = None, logprobs: Optional[dict] = None,
              extra: Optional[dict] = None) -> str:
        return json.dumps({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": finish, **(extra or {})}]}, ensure_ascii=False)

    def prelude(i: int):
        yield chunk(i, {"role": "assistant", "content": ""})
        if prefix:                        # the reply's start, split and held back like the text that follows it
            yield from on_text(i, prefix, [])

    def on_text(i: int, text: str, logprobs: list):
        reasoning, content = splitters[i].push(text) if splitters else ("", text)
        out = holdbacks[i].push(content) if holdbacks else content
        lp = _chat_logprobs(st.engine.tokenizer, logprobs) if logprobs else None
        if reasoning or out or lp:
            yield chunk(i, _delta(reasoning, out), None, lp)

    def finish(i: int, result):
        reason = result.finish_reason
        reasoning, content = splitters[i].finish() if splitters else ("", "")
        out = holdbacks[i].push(content) if holdbacks else content
        if reasoning or out:
            yield chunk(i, _delta(reasoning, out))
        if channels or holdbacks:
            calls = splitters[i].calls if channels else parse_tool_calls(holdbacks[i].text, tools)
            calls = calls if tools else []
            if calls and legacy:
                yield chunk(i, {"function_call": as_function_call(openai_tool_calls(calls))})
                reason = "function_call"
            elif calls:
                for k, call in enumerate(openai_tool_calls(calls)):
                    yield chunk(i, {"tool_calls": [{"index": k, **call}]})
                reason = "tool_calls"
            elif holdbacks and holdbacks[i].rest():
                yield chunk(i, {"content": holdbacks[i].rest()})
        yield chunk(i, {}, reason, None, _stop_fields(result))

    return await _stream(request, st.engine, jobs, prelude, on_text, finish, _usage_head(body, head), body.n)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = _state(request)
    body = overridden(request, body)
    params.check_supported(body)
    prompts = params.completion_prompts(body)
    echoes = [p if isinstance(p, str) else st.engine.tokenizer.decode(p) for p in prompts] if body.echo else None
    prompts = params.fill_in_the_middle(body, st.engine.tokenizer, prompts)
    add_bos = body.add_bos_token if isinstance(prompts[0], str) else None
    ranked = (body.best_of or 1) > body.n
    jobs = _jobs(body, st.engine, prompts, add_bos, "prompt", st.config.max_tokens,
                 body.best_of if ranked else None)
    await request_loras(request, body, st.engine, jobs)
    head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": st.name}
    log_jobs(st.config, jobs)

    def echo(i: int) -> str:
        return echoes[i // body.n] if echoes else ""

    def choice(i: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

    if not body.stream:
        try:
            results = await _generate(request, st.engine, jobs)
        except ClientGone:
            return Response(status_code=499)
        usage = _usage(results, body.best_of if ranked else body.n)  # every candidate's tokens count
        if ranked:
            results = best_of(results, body.best_of, body.n)
        shown = body.logprobs is not None
        return {**head, "choices": [{**choice(i, echo(i) + r.text, r.finish_reason,
                                              _completion_logprobs(st.engine.tokenizer, r.logprobs) if shown
                                              else None), **_stop_fields(r)}
                                    for i, r in enumerate(results)],
                "usage": usage}

    def chunk(i: int, text: str, finish: Optional[str] = None, logprobs: Optional[dict] = None) -> str:
        return json.dumps({**head, "choices": [choice(i, text, finish, logprobs)]}, ensure_ascii=False)

    def prelude(i: int):
        if echo(i):
            yield chunk(i, echo(i))

    offsets = [0] * len(jobs)   # where each streamed choice's next token starts in its text

    def on_text(i: int, text: str, logprobs: list):
        lp = _completion_logprobs(st.engine.tokenizer, logprobs, offsets[i]) if logprobs else None
        if lp:
            offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        yield chunk(i, text, None, lp)

    def finish(i: int, result):
        yield json.dumps({**head, "choices": [{**choice(i, "", result.finish_reason), **_stop_fields(result)}]},
                         ensure_ascii=False)

    return await _stream(request, st.engine, jobs, prelude, on_text, finish, _usage_head(body, head), body.n)
