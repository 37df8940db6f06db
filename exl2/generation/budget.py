"""A reasoning budget (TabbyAPI's `reasoning_budget_tokens`, Qwen3's thinking budget): a reply that has thought for
`tokens` tokens inside its `<think>` block is made to close it, by feeding the end of the block (an optional
message, then the closing tag) instead of what the model would sample, so that it answers from what it has thought.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class ThinkTags(NamedTuple):
    """The tags around a reply's reasoning: `<think>…</think>` (Qwen3, DeepSeek-R1, QwQ) or another model's pair."""

    open: str
    close: str


DEFAULT_TAGS = ThinkTags("<think>", "</think>")
# pairs a chat template may use, first match wins (Magistral writes [THINK]…[/THINK])
KNOWN_TAGS = (DEFAULT_TAGS, ThinkTags("[THINK]", "[/THINK]"), ThinkTags("<|begin_of_thought|>", "<|end_of_thought|>"))
OPEN, CLOSE = DEFAULT_TAGS


def template_tags(source: str) -> Optional[ThinkTags]:
    """The think tags a chat template's source writes (None: it knows none of `KNOWN_TAGS`)."""
    return next((t for t in KNOWN_TAGS if t.open in source), None)


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
    tags: ThinkTags = DEFAULT_TAGS
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
        opening, closing = self.tags
        if self.start is None:
            at = tail.find(opening)
            if at < 0:
                self._tail = tail[-(len(opening) - 1):]
                return None
            self.start = reply_tokens
            tail = tail[at + len(opening):]
        if closing in tail:
            self.done = True
            return None
        self._tail = tail[-(len(closing) - 1):]
        if reply_tokens - self.start >= self.tokens:
            self.done = True
            return list(self.end_ids)
        return None


def budget_end(tokenizer, message: str = "", tags: ThinkTags = DEFAULT_TAGS) -> list[int]:
    """The tokens that end a think block: `message` (a last thought, e.g. that time is up), then the closing tag
    on a line of its own, as the templates write it."""
    text = (message.rstrip() + "\n" if message.strip() else "\n") + tags.close + "\n\n"
    return tokenizer.encode(text, add_bos=False)
