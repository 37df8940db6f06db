"""A reasoning budget (TabbyAPI's `reasoning_budget_tokens`, Qwen3's thinking budget): a reply that has thought for
`tokens` tokens inside its `<think>` block is made to close it, by feeding the end of the block (an optional
message, then the closing tag) instead of what the model would sample, so that it answers from what it has thought.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningBudget:
    """`tokens` reply tokens of thinking at most, then `end_ids` are fed (the generator's `Job.forced`).
    `inside`: the prompt leaves the reply inside a think block (the template opened it); otherwise the block
    counts from the reply's own opening tag. A reply that closes its block in time is left alone."""

    tokens: int
    end_ids: list[int]
    inside: bool = False
    start: Optional[int] = None      # reply tokens before the block began (0 when the prompt opened it)
    done: bool = False               # the block was closed, by the model or by the budget
    _tail: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.inside:
            self.start = 0

    def step(self, text: str, reply_tokens: int) -> Optional[list[int]]:
        """After a token: `text` the reply's new text, `reply_tokens` its length in tokens. The tokens to feed
        now that the budget is spent (None: go on sampling)."""
        if self.done:
            return None
        tail = self._tail + text
        if self.start is None:
            at = tail.find(OPEN)
            if at < 0:
                self._tail = tail[-(len(OPEN) - 1):]
                return None
            self.start = reply_tokens
            tail = tail[at + len(OPEN):]
        if CLOSE in tail:
            self.done = True
            return None
        self._tail = tail[-(len(CLOSE) - 1):]
        if reply_tokens - self.start >= self.tokens:
            self.done = True
            return list(self.end_ids)
        return None


def budget_end(tokenizer, message: str = "") -> list[int]:
    """The tokens that end a think block: `message` (a last thought, e.g. that time is up), then the closing tag
    on a line of its own, as the templates write it."""
    text = (message.rstrip() + "\n" if message.strip() else "\n") + CLOSE + "\n\n"
    return tokenizer.encode(text, add_bos=False)
