"""Tool calling: which tools the template sees, and model replies translated into OpenAI `tool_calls`.

The model writes calls as text in its own format (Hermes/Qwen `<tool_call>`, Qwen3-Coder `<function=...>`,
DeepSeek `<｜tool▁call▁begin｜>`, Mistral `[TOOL_CALLS]`, Llama-3.1 bare JSON, a pythonic `[f(a=1)]` list);
`parse_tool_calls` reads them at the end of the turn. While streaming, text that may turn out to be
a call is held back so a client never receives half a call as content.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Optional, Union

from exl2.generation.chat import CALL_MARKERS
from exl2.server.errors import APIError
from exl2.server.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool, ToolCall

MARKERS = CALL_MARKERS   # where a call starts, in every format parse_tool_calls reads

ToolChoice = Union[str, NamedToolChoice, None]


def template_tools(tools: Optional[list[Tool]], choice: ToolChoice) -> Optional[list[dict[str, Any]]]:
    """The tools to render into the prompt, or None (no tools, or tool_choice 'none').

    'required' and a named function render all tools like 'auto'; their grammar (`params.tool_grammar`) then
    allows only calls.
    """
    names = [t.function.name for t in tools or ()]
    if not names:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise APIError(400, "tool_choice asks for a tool call but the request lists no tools.",
                           param="tool_choice")
        return None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names '{choice.function.name}', which is not among the tools.",
                       param="tool_choice")
    out = []
    for t in tools:
        fn = t.function.model_dump(exclude_none=True)
        fn.setdefault("parameters", {"type": "object", "properties": {}})   # templates read it unconditionally
        out.append({"type": "function", "function": fn})
    return out


def from_functions(body: ChatCompletionRequest) -> tuple[ChatCompletionRequest, bool]:
    """The request with OpenAI's deprecated function calling in the tools form: `functions` as tools,
    `function_call` as tool_choice, an assistant message's `function_call` as its one tool call and a `function`
    message as the result of the call before it. True when the request lists `functions` (its replies then
    carry `function_call` too: `as_function_call`)."""
    legacy = [m for m in body.messages if m.role == "function" or m.function_call is not None]
    if not body.functions and body.function_call is None and not legacy:
        return body, False
    if body.functions and body.tools:
        raise APIError(400, "Send tools or the deprecated functions, not both.", param="functions")
    if body.function_call is not None and not body.functions:
        raise APIError(400, "function_call needs the functions it chooses from.", param="function_call")
    if body.function_call is not None and body.tool_choice is not None:
        raise APIError(400, "Send tool_choice or the deprecated function_call, not both.", param="function_call")
    messages, last = [], None
    for i, m in enumerate(body.messages):
        if m.function_call is not None:
            if m.role != "assistant" or m.tool_calls:
                raise APIError(400, "Only an assistant message without tool_calls can carry a function_call.",
                               param=f"messages[{i}].function_call")
            last = f"call_{i}_0"
            m = m.model_copy(update={"function_call": None,
                                     "tool_calls": [ToolCall(id=last, function=m.function_call)]})
        elif m.role == "function":
            m = ChatMessage(role="tool", content=m.content, name=m.name, tool_call_id=last)
        messages.append(m)
    update: dict[str, Any] = {"messages": messages, "function_call": None, "functions": None}
    if body.functions:
        update["tools"] = [Tool(function=f) for f in body.functions]
        choice = body.function_call
        update["tool_choice"] = NamedToolChoice(function=choice) if not isinstance(choice, (str, type(None))) \
            else choice
    return body.model_copy(update=update), bool(body.functions)


def as_function_call(calls: list[dict]) -> dict:
    """The first of OpenAI tool_calls as the pre-tools API's `function_call` (it has one call a message)."""
    return dict(calls[0]["function"])


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    """parse_tool_calls' [{'name', 'arguments': dict}] -> OpenAI tool_calls with ids and JSON-string arguments."""
    return [{"id": call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def content_before_calls(text: str) -> Optional[str]:
    """What the model said before its first call (None when it said nothing), the `content` of a call reply."""
    cuts = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
    head = text[:min(cuts)] if cuts else ""
    return head.strip() or None


class ToolCallHoldback:
    """Passes streamed text through until it could be a tool call, then keeps everything for the end of the turn.

    A call may start with a marker anywhere, or be the whole reply as JSON (Llama 3.1) or a Python list of calls
    (pythonic): so leading whitespace waits, a reply opening with '{' or '[' is held entirely, and a tail that
    could begin a marker waits.
    """

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.holding = False

    def push(self, piece: str) -> str:
        """Add streamed text; return the part that is safe to send as content now."""
        self.text += piece
        if self.holding:
            return ""
        pending = self.text[self.sent:]
        if not self.text[:self.sent].strip():
            start = pending.lstrip()
            if not start:
                return ""
            if start[0] in "{[":
                self.holding = True
                return ""
        cuts = [i for i in (pending.find(m) for m in MARKERS) if i >= 0]
        if cuts:
            self.holding = True
            out = pending[:min(cuts)]
        else:
            out = pending[:len(pending) - _marker_prefix_len(pending)]
        self.sent += len(out)
        return out

    def rest(self) -> str:
        """The text not sent yet."""
        return self.text[self.sent:]


def _marker_prefix_len(text: str) -> int:
    """Length of the longest tail of `text` that is the beginning of a marker."""
    best = 0
    for m in MARKERS:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best
