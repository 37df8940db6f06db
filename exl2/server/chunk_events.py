"""Streamed chat completion chunks re-framed for another API's events (exl2.server.responses, .anthropic_api):
each choice's delta dispatched by kind, its finish noted, the usage kept."""
from __future__ import annotations

from typing import Optional


class ChatChunks:
    """Walks chat chunks: `on_text(kind, text)` (kind "reasoning" or "content"), `on_call(call)` and `on_finish()`
    (subclasses) return the events each becomes; `finish`, `stop_str` and `usage` hold what the chunks said last."""

    def __init__(self) -> None:
        self.finish: Optional[str] = None
        self.stop_str: Optional[str] = None
        self.usage: Optional[dict] = None

    def on_text(self, kind: str, text: str) -> list[dict]:
        raise NotImplementedError

    def on_call(self, call: dict) -> list[dict]:
        raise NotImplementedError

    def on_finish(self) -> list[dict]:
        raise NotImplementedError

    def events(self, chunk: dict) -> list[dict]:
        """The events of one chat chunk (its usage, when it carries one, kept)."""
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.on_text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self.on_text("content", delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self.on_call(call)
            if choice.get("finish_reason"):
                self.finish, self.stop_str = choice["finish_reason"], choice.get("stop_str")
                out += self.on_finish()
        return out
