"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served through the chat
completions path, for clients and agent tools written against Anthropic's SDK: content blocks become chat
messages (tool_use as tool calls, tool_result as tool messages, thinking as reasoning_content), the reply becomes
content blocks with Anthropic's stop reasons, and streamed chat chunks become its events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors use Anthropic's shape. `x-api-key` is
one of the key headers the server already reads; `anthropic-version` is accepted and ignored.
"""
from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field
from sse_starlette.sse import EventSourceResponse

from exl2.errors import Exl2Error
from exl2.server import completions
from exl2.server.chunk_events import ChatChunks
from exl2.server.errors import APIError, validated
from exl2.server.host import serving, sse_ping
from exl2.server.messages import template_messages
from exl2.server.schemas import ChatCompletionRequest, ChatMessage, _Body

router = APIRouter()
# OpenAI-shaped error types → Anthropic's
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(_Body):
    """The fields of a Messages request this server reads; the sampling extensions of chat completions (min_p,
    repetition_penalty, seed ...) pass through under their own names."""

    model: Optional[str] = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None     # {"format": {"type": "json_schema", "schema"}, "effort"}
    metadata: Optional[dict[str, Any]] = None

    model_config = {"extra": "allow"}


class CountRequest(_Body):
    model: Optional[str] = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None


def _error(e: APIError) -> JSONResponse:
    kind = _ERROR_TYPES.get(e.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=e.headers)


def _text(content: Any, param: str) -> str:
    """A system prompt's or a tool result's text: a string, or its text blocks joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise APIError(400, "Only text blocks can stand here.", param=f"{param}[{i}]")
            texts.append(block.get("text", ""))
        return "\n".join(texts)
    raise APIError(400, "Expected a string or a list of text blocks.", param=param)


def _image(source: Any, param: str) -> dict:
    if isinstance(source, dict) and source.get("type") == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type', 'image/png')};base64,"
                                                          f"{source.get('data', '')}"}}
    if isinstance(source, dict) and source.get("type") == "url" and source.get("url"):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise APIError(400, "An image's source is base64 data or a url.", param=f"{param}.source")


def _result(content: Any, error: bool, param: str) -> Union[str, list[dict]]:
    """A tool_result's content as a tool message's: its text, or text and image parts where it holds images (a
    screenshot, a chart); "Error: " before it when the tool failed."""
    if not isinstance(content, list) or not any(isinstance(b, dict) and b.get("type") == "image" for b in content):
        text = _text(content, param)
        return f"Error: {text}" if error else text
    parts: list[dict] = [{"type": "text", "text": "Error:"}] if error else []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append(_image(block.get("source"), f"{param}[{i}]"))
        else:
            raise APIError(400, "A tool result holds text and image blocks.", param=f"{param}[{i}]")
    return parts


def chat_messages(messages: list[dict]) -> list[dict]:
    """Anthropic messages as chat messages: a user message's tool_result blocks become tool messages before its
    other content; an assistant message's tool_use blocks its tool calls and its thinking its reasoning_content."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(400, f"Messages have the role user or assistant, not {role!r}.", param=f"{param}.role")
        content = m.get("content", "")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, "A message's content is a string or a list of blocks.", param=f"{param}.content")
        parts, calls, results, thinking = [], [], [], []
        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                parts.append(_image(block.get("source"), where))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": _result(block.get("content"), bool(block.get("is_error")),
                                                   f"{where}.content")})
            elif kind == "thinking" and role == "assistant":
                thinking.append(block.get("thinking", ""))
            elif kind == "redacted_thinking":
                continue
            else:
                raise APIError(400, f"Content blocks of type {kind!r} are not supported here.", param=where)
        out += results
        if parts or calls or thinking or not results:
            msg: dict[str, Any] = {"role": role, "content": parts or ("" if not calls else None)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def _tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom"):
            raise APIError(400, f"Server tools such as {t.get('type')!r} do not exist here; only custom tools do.",
                           param=f"tools[{i}].type")
        out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                      "parameters": t.get("input_schema") or {"type": "object"}}})
    return out


def _tool_choice(choice: Optional[dict]) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise APIError(400, f"tool_choice type {kind!r} is not one of auto, any, tool, none.", param="tool_choice.type")


def _system(system: Any) -> list[dict]:
    text = _text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    fields = {k: v for k, v in (body.model_extra or {}).items() if k in ChatCompletionRequest.model_fields}
    fields.update(model=body.model, messages=_system(body.system) + chat_messages(body.messages),
                  max_tokens=body.max_tokens, tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice),
                  top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences, stream=body.stream)
    fields["temperature"] = 1.0 if body.temperature is None else body.temperature   # Anthropic's default
    thinking = body.thinking or {}
    if thinking.get("type") == "enabled":
        fields["enable_thinking"] = True
        if thinking.get("budget_tokens"):
            fields["reasoning_budget_tokens"] = thinking["budget_tokens"]
    elif thinking.get("type") == "disabled":
        fields["enable_thinking"] = False
    output = body.output_config or {}
    fmt = output.get("format")
    if fmt:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format is {\"type\": \"json_schema\", \"schema\": {...}}.",
                           param="output_config.format")
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if output.get("effort"):
        fields["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(output["effort"], output["effort"])
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    return validated(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None})


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise APIError(400, "The request body is not valid JSON.") from None


def stop_reason(finish: Optional[str], stop_str: Optional[str],
                stops: Optional[list[str]]) -> tuple[str, Optional[str]]:
    """Anthropic's (stop_reason, stop_sequence) for a chat finish_reason and the stop string that ended it."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop_str is not None and stop_str in (stops or ()):
        return "stop_sequence", stop_str
    return "end_turn", None


def content_blocks(message: dict) -> list[dict]:
    """A chat reply's assistant message as content blocks: thinking, text, tool_use."""
    out: list[dict] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"] or "{}")})
    return out


def usage(chat_usage: Optional[dict]) -> dict:
    """Anthropic's usage: input tokens not read from the prompt cache, those that were, output tokens."""
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": chat_usage["completion_tokens"]}


@router.post("/v1/messages")
async def create_message(request: Request):
    try:
        body = validated(MessagesRequest, await _json(request))
        result = await completions.chat_completions(chat_request(body), request)
    except APIError as e:
        return _error(e)
    mid = "msg_" + secrets.token_hex(12)
    if body.stream:
        return EventSourceResponse(_Events(body, mid).translate(result.body_iterator), ping=sse_ping(request))
    if isinstance(result, Response):
        return result
    choice = result["choices"][0]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_str"), body.stop_sequences)
    return {"id": mid, "type": "message", "role": "assistant", "model": result["model"],
            "content": content_blocks(choice["message"]), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(result["usage"])}


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """The prompt's token count as the chat template renders these messages, system prompt and tools."""
    try:
        body = validated(CountRequest, await _json(request))
        st = serving(request)
        messages = [ChatMessage.model_validate(m)
                    for m in _system(body.system) + chat_messages(body.messages)]
        chat = template_messages(messages, images=st.engine.vision is not None)
        tools = _tools(body.tools)
        try:
            prompt, _ = await asyncio.to_thread(st.engine.chat_input, chat, tools)
        except Exl2Error as e:
            raise completions.engine_error(e, "messages") from e
    except APIError as e:
        return _error(e)
    ids = prompt if isinstance(prompt, list) else st.engine.tokenizer.encode(prompt, add_bos=False)
    return {"input_tokens": len(ids)}


class _Events(ChatChunks):
    """Streamed chat chunks → Anthropic's events: a content block opens when its first piece arrives (thinking,
    then text) or whole (a tool_use, its input as one input_json_delta), and stops when the next opens or the
    reply ends."""

    def __init__(self, body: MessagesRequest, mid: str):
        super().__init__()
        self.body, self.mid = body, mid
        self.index = -1
        self.open: Optional[str] = None       # the type of the block receiving text

    @staticmethod
    def _event(kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}

    def _stop(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.index)]

    def _piece(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open != kind:
            events += self._stop()
            self.index += 1
            self.open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append(self._event("content_block_start", index=self.index, content_block=block))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [self._event("content_block_delta", index=self.index, delta=delta)]

    def on_text(self, kind: str, text: str) -> list[dict]:
        return self._piece("thinking" if kind == "reasoning" else "text", text)

    def on_finish(self) -> list[dict]:
        return self._stop()

    def on_call(self, call: dict) -> list[dict]:
        events = self._stop()
        self.index += 1
        block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
        return events + [
            self._event("content_block_start", index=self.index, content_block=block),
            self._event("content_block_delta", index=self.index,
                        delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
            self._event("content_block_stop", index=self.index)]

    async def translate(self, chunks: AsyncIterator) -> AsyncIterator[dict]:
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.body.model or "",
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        yield self._event("message_start", message=message)
        async for data in chunks:
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                yield self._event("error", error={"type": "api_error", "message": chunk["error"].get("message")})
                return
            for event in self.events(chunk):
                yield event
        for event in self._stop():
            yield event
        reason, sequence = stop_reason(self.finish, self.stop_str, self.body.stop_sequences)
        yield self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                          usage=usage(self.usage))
        yield self._event("message_stop")
