"""OpenAI chat requests -> chat template input: the message dicts Hugging Face chat templates are written against,
and the extra variables a request passes to the template."""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from exl2.generation.chat import ChatTemplate
from exl2.server.errors import APIError, unsupported
from exl2.server.schemas import ChatCompletionRequest, ChatMessage, ContentPart


MEDIA = ("image_url", "video_url")     # OpenAI's image parts and vLLM's video parts


def _text(content: Optional[Union[str, list[ContentPart]]], param: str, images: bool = False
          ) -> Union[str, list[dict[str, Any]]]:
    """Content as one string (templates expect a string), or with `images` and image_url / video_url parts in it,
    the list of text and media parts (`Engine.chat_input` puts each image and video in place)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts, parts = [], []
    for i, part in enumerate(content):
        if part.type in MEDIA and images:
            ref = (part.model_extra or {}).get(part.type)
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise APIError(400, f"A {part.type} content part needs a {part.type}.url.", param=f"{param}[{i}]")
            parts.append({"type": part.type, part.type: {"url": url}})
            continue
        if part.type != "text":
            what = "text, and images and videos for a model loaded with its vision tower" if part.type in MEDIA \
                else "text"
            raise unsupported(f"{param}[{i}].type", f"Message content of type '{part.type}' (only {what})")
        if part.text is None:
            raise APIError(400, "A text content part needs a 'text' string.", param=f"{param}[{i}].text")
        texts.append(part.text)
        parts.append({"type": "text", "text": part.text})
    if any(p["type"] in MEDIA for p in parts):
        return parts
    return "\n".join(texts)


class Arguments(dict):
    """Tool-call arguments for a template: a mapping (most templates iterate them, e.g. `|items`) that reads as its
    JSON text where a template joins it into a string (DeepSeek's: `'...' + tool['function']['arguments']`)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other

    def __radd__(self, other):
        return other + str(self)


def _arguments(raw: Union[str, dict[str, Any]], param: str) -> dict[str, Any]:
    """Clients send arguments as a JSON string; templates get them as `Arguments`."""
    if isinstance(raw, dict):
        return Arguments(raw)
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise APIError(400, "Tool call arguments must be a JSON object string.", param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, "Tool call arguments must be a JSON object string.", param=param)
    return Arguments(value)


def template_messages(messages: list[ChatMessage], images: bool = False) -> list[dict[str, Any]]:
    """The conversation as chat-template input: text content (with `images`, image_url / video_url parts kept in
    place), 'developer' read as 'system' (HF templates do not know it), assistant tool calls with dict arguments
    and thinking, tool results with their call id."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text(m.content, f"messages[{i}].content", images)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, "Only assistant messages can carry tool_calls.", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [
                {"id": c.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments,
                                                      f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.role == "assistant" and m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content      # Qwen3's template shows it in tool-call turns
            msg["thinking"] = m.reasoning_content               # gpt-oss's reads it under this name
        out.append(msg)
    return out


def template_variables(req: ChatCompletionRequest, template: ChatTemplate, defaults: Optional[dict] = None,
                       forced: Optional[dict] = None) -> dict[str, Any]:
    """The request's extra template variables: the server's `defaults`, then the top-level enable_thinking /
    reasoning_effort, TabbyAPI's `template_vars` and vLLM's `chat_template_kwargs` (which wins where both set a
    name), then the server's `forced` ones over all. Names the server sets itself (messages, tools, bos_token, ...)
    are a 400, so a request cannot silently replace the conversation or a template function."""
    reserved = template.reserved_variables
    out: dict[str, Any] = dict(defaults or {})
    out.update({k: getattr(req, k) for k in ("enable_thinking", "reasoning_effort") if getattr(req, k) is not None})
    for param in ("template_vars", "chat_template_kwargs"):
        given = getattr(req, param) or {}
        clash = next((k for k in given if k in reserved), None)
        if clash is not None:
            raise APIError(400, f"{param} cannot set '{clash}', which the server passes to the chat template itself.",
                           param=f"{param}.{clash}")
        out.update(given)
    out.update(forced or {})
    return out
