"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), served through the chat
completions path: input items become chat messages, the reply becomes output items (reasoning, message, function
calls), and streamed chat chunks become the Responses events clients follow (`response.output_text.delta` ...).

Responses are kept (store, the default: the last KEEP_RESPONSES, in memory) with the conversation they end, so a
request naming `previous_response_id` continues it, as OpenAI's stateful mode does; `instructions` apply to their own
request only. Built-in tools (web search, file search, computer use) do not exist here: a request for one is a 400.
"""
from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Request, Response
from pydantic import Field
from sse_starlette.sse import EventSourceResponse

from exl2.server import completions
from exl2.server.chunk_events import ChatChunks
from exl2.server.errors import APIError, validated
from exl2.server.host import sse_ping
from exl2.server.schemas import ChatCompletionRequest, _Body

KEEP_RESPONSES = 256
router = APIRouter()


class ResponsesRequest(_Body):
    """The fields of a Responses request this server reads; the sampling extensions of chat completions (top_k,
    min_p, repetition_penalty ...) pass through under their own names."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: bool = True
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None

    model_config = {"extra": "allow"}


class Stored:
    """Kept responses by id, with the chat messages their conversation ends with (oldest dropped first)."""

    def __init__(self, keep: int = KEEP_RESPONSES):
        self.keep, self.items = keep, OrderedDict()

    def put(self, response: dict, messages: list[dict]) -> None:
        self.items[response["id"]] = (response, messages)
        while len(self.items) > self.keep:
            self.items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]]:
        if rid not in self.items:
            raise APIError(404, f"No stored response has the id {rid!r}.", param="previous_response_id",
                           code="response_not_found")
        return self.items[rid]


def _stored(request: Request) -> Stored:
    """The app's kept responses (made on first use)."""
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = Stored()
    return state.responses


def _content(content: Any, param: str) -> Union[str, list[dict]]:
    """A message's or a tool output's content as chat completions take it: input_text / output_text parts as text
    parts, input_image parts as image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "A message's content must be a string or a list of content parts.", param=param)
    parts = []
    for i, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": p.get("text", p.get("refusal", ""))})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, "An input_image part needs an image_url (file ids are not stored here).",
                               param=f"{param}[{i}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise APIError(400, f"Content parts of type {kind!r} are not supported (input_text, output_text and "
                                "input_image are).", param=f"{param}[{i}]")
    return parts


def input_messages(items: Union[str, list[dict]]) -> list[dict]:
    """The input as chat messages: message items by role, function calls as the tool calls of the assistant message
    just before them (or of a new one), function_call_output items as tool messages; reasoning items go with the
    next assistant message as its reasoning_content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: Optional[str] = None
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"Messages have the role system, developer, user or assistant, not {role!r}.",
                               param=f"{param}.role")
            msg = {"role": role, "content": _content(item.get("content", ""), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            # a string, or input_text / input_image parts (a tool that returns a screenshot, a chart ...); text alone
            # stays a string, which every chat template renders in a tool turn
            output = _content(item.get("output", ""), f"{param}.output")
            if isinstance(output, list) and all(p["type"] == "text" for p in output):
                output = "".join(p["text"] for p in output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
            reasoning = "".join(texts) or None
        else:
            raise APIError(400, f"Input items of type {kind!r} are not supported (message, function_call, "
                                "function_call_output and reasoning are).", param=f"{param}.type")
    return out


def _tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"Only function tools exist here, not {t.get('type')!r}.", param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(400, "tool_choice names a function as {\"type\": \"function\", \"name\": ...}.",
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError(400, f"text.format type {fmt.get('type')!r} is not one of text, json_object, json_schema.",
                   param="text.format")


def chat_request(body: ResponsesRequest, history: list[dict], stream: bool) -> tuple[ChatCompletionRequest, list]:
    """(the chat completion request for `body` after the stored conversation `history`, the conversation's
    messages without the instructions)."""
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fields = {k: v for k, v in (body.model_extra or {}).items() if k in ChatCompletionRequest.model_fields}
    fields.update(model=body.model, messages=messages, tools=_tools(body.tools), stream=stream,
                  tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
                  response_format=_response_format(body.text), max_tokens=body.max_output_tokens,
                  reasoning_effort=(body.reasoning or {}).get("effort"))
    for key in ("temperature", "top_p"):
        if getattr(body, key) is not None:
            fields[key] = getattr(body, key)
    if stream:
        fields["stream_options"] = {"include_usage": True}
    return validated(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None}), conversation


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _usage(usage: Optional[dict]) -> Optional[dict]:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def reasoning_item(text: str, rid: Optional[str] = None, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": rid or _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, mid: Optional[str] = None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict, fid: Optional[str] = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": fid or _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def output_items(message: dict) -> list[dict]:
    """A chat reply's assistant message as output items: its reasoning, its text, its function calls."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(message["content"]))
    out += [call_item(c) for c in message.get("tool_calls") or ()]
    return out


def response_object(body: ResponsesRequest, rid: str, created: int, model: str, output: list[dict],
                    finish: Optional[str], usage: Optional[dict], status: Optional[str] = None) -> dict:
    """The Response object: status completed, or incomplete with the reason when the reply hit its length."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "output_text": "".join(c["text"] for item in output if item["type"] == "message"
                                                     for c in item["content"]),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
            "store": body.store, "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": "disabled", "usage": _usage(usage)}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    store = _stored(request)
    history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
    chat, conversation = chat_request(body, history, body.stream)
    rid, created = _id("resp"), int(time.time())
    result = await completions.chat_completions(chat, request)
    if not body.stream:
        if isinstance(result, Response):
            return result
        choice = result["choices"][0]
        output = output_items(choice["message"])
        response = response_object(body, rid, created, result["model"], output, choice["finish_reason"],
                                   result["usage"])
        if body.store:
            store.put(response, conversation + input_messages(output))
        return response
    events = _Events(body, rid, created, store, conversation)
    return EventSourceResponse(events.translate(result.body_iterator), ping=sse_ping(request))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return _stored(request).get(response_id)[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    store = _stored(request)
    store.get(response_id)
    del store.items[response_id]
    return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Events(ChatChunks):
    """Streamed chat chunks → Responses events: an item opens when its first text arrives (reasoning, then the
    message) or whole (a function call), and closes when the next opens or the reply ends."""

    def __init__(self, body: ResponsesRequest, rid: str, created: int, store: Stored, conversation: list[dict]):
        super().__init__()
        self.body, self.rid, self.created, self.store, self.conversation = body, rid, created, store, conversation
        self.seq = 0
        self.output: list[dict] = []
        self.open: Optional[dict] = None       # the item receiving text
        self.model = body.model or ""

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq, **fields},
                                                  ensure_ascii=False)}

    def _response(self, status: Optional[str] = None) -> dict:
        return response_object(self.body, self.rid, self.created, self.model, self.output, self.finish, self.usage,
                               status)

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            done = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text)]
        else:
            part = item["content"][0]
            done = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
        return done + [self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, kind: str, delta: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = reasoning_item("", status="in_progress") if kind == "reasoning" else \
                message_item("", status="in_progress")
            self.output.append(self.open)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=self.open))
            if kind == "message":
                events.append(self._event("response.content_part.added", item_id=self.open["id"],
                                          output_index=index, content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))
        self.open["content"][0]["text"] += delta
        index = len(self.output) - 1
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._event(name, item_id=self.open["id"], output_index=index, content_index=0,
                                     delta=delta, **extra)]

    def on_text(self, kind: str, text: str) -> list[dict]:
        return self._text("reasoning" if kind == "reasoning" else "message", text)

    def on_finish(self) -> list[dict]:
        return self._close()

    def on_call(self, call: dict) -> list[dict]:
        events = self._close()
        item = call_item(call)
        self.output.append(item)
        index = len(self.output) - 1
        return events + [
            self._event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"]),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"]),
            self._event("response.output_item.done", output_index=index, item=item)]

    def _chunk(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            return [self._event("error", code=chunk["error"].get("code"), message=chunk["error"].get("message"),
                                param=chunk["error"].get("param")),
                    self._event("response.failed", response={**self._response("failed"), "error": chunk["error"]})]
        self.model = chunk.get("model", self.model)
        return self.events(chunk)

    async def translate(self, chunks: AsyncIterator) -> AsyncIterator[dict]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        failed = False
        async for data in chunks:
            if data == "[DONE]":
                break
            events = self._chunk(json.loads(data))
            failed = failed or any(e["event"] == "error" for e in events)
            for event in events:
                yield event
        if failed:
            return
        for event in self._close():
            yield event
        response = self._response()
        if self.body.store:
            self.store.put(response, self.conversation + input_messages(self.output))
        yield self._event(f"response.{response['status']}", response=response)
