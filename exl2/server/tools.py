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
from exl2.server.schemas import NamedToolChoice, Tool

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
