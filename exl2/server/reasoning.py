"""Reasoning output: a reply's `<think>…</think>` block as `reasoning_content`, the rest as `content`.

Reasoning models (Qwen3, DeepSeek-R1/V3, QwQ) think inside `<think>…</think>` (Magistral: `[THINK]…[/THINK]`;
`budget.ThinkTags`) before answering; clients (like
those of vLLM and TabbyAPI) expect the thinking apart, so they can show or hide it and never take it for the
answer. Some templates end the prompt with `<think>` themselves, so the reply only closes the block:
whether a reply starts inside one is read from the rendered prompt. Streamed or not, a reply goes through the same
`ReasoningSplitter`, so both give the same split.
"""
from __future__ import annotations

from typing import Optional

from exl2.generation.budget import CLOSE, DEFAULT_TAGS, OPEN, ThinkTags, template_tags
from exl2.generation.chat import ChatTemplate

__all__ = ["CLOSE", "OPEN", "ReasoningSplitter", "opens_thinking", "split_reasoning", "template_thinks"]
_START, _THINK, _AFTER, _CONTENT = range(4)


def template_thinks(template: ChatTemplate) -> bool:
    """Whether the chat template knows think blocks: the default for the server's reasoning parser."""
    return template_tags(template.source) is not None


def opens_thinking(prompt: str, tags: ThinkTags = DEFAULT_TAGS) -> bool:
    """Whether the rendered prompt leaves the reply inside a think block (it ends with an open tag)."""
    return prompt.rstrip().endswith(tags.open)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (a tag split across pieces waits for the rest)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) pieces.

    A reply opening with `<think>` (after whitespace), or starting inside the block (`thinking`), is reasoning up to
    `</think>`; the rest is content. The reasoning is stripped at both ends and the whitespace after `</think>`
    dropped, so text that may be whitespace or a partial tag is held until it is known. A reply without a think
    block is content, unchanged.
    """

    def __init__(self, thinking: bool = False, tags: ThinkTags = DEFAULT_TAGS) -> None:
        self.open, self.close = tags
        self.state = _THINK if thinking else _START
        self.found = thinking            # a think block was opened (by the prompt or the reply)
        self.buf = ""                    # received, not yet sent
        self.said = False                # some reasoning was sent: whitespace inside it is kept from now on

    def push(self, piece: str) -> tuple[str, str]:
        """Add streamed text; return the (reasoning, content) that can be sent now."""
        self.buf += piece
        reasoning = content = ""
        while self.buf:
            if self.state == _START:
                head = self.buf.lstrip()
                if head.startswith(self.open):
                    self.buf, self.state, self.found = head[len(self.open):], _THINK, True
                elif self.open.startswith(head):          # whitespace or a partial `<think>` so far
                    break
                else:
                    self.state = _CONTENT
            elif self.state == _THINK:
                if not self.said:
                    self.buf = self.buf.lstrip()
                    if self.buf.startswith(self.open):      # the reply repeats the prompt's `<think>`
                        self.buf = self.buf[len(self.open):]
                        continue
                    if self.open.startswith(self.buf):
                        break
                end = self.buf.find(self.close)
                if end >= 0:
                    reasoning += self.buf[:end].rstrip()
                    self.buf, self.state = self.buf[end + len(self.close):], _AFTER
                    continue
                out = self.buf[:len(self.buf) - _tag_prefix_len(self.buf, self.close)].rstrip()
                reasoning += out
                self.buf = self.buf[len(out):]
                self.said = self.said or bool(out)
                break
            elif self.state == _AFTER:
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = _CONTENT
            else:
                content += self.buf
                self.buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) still held when the reply ends: an unclosed block is all reasoning."""
        rest, self.buf = self.buf, ""
        if self.state == _THINK:            # the reply ended inside the block (e.g. at max_tokens)
            return rest.rstrip(), ""
        if self.state == _AFTER:
            return "", ""
        return "", rest


def split_reasoning(text: str, thinking: bool = False, tags: ThinkTags = DEFAULT_TAGS
                    ) -> tuple[Optional[str], str]:
    """A whole reply as (reasoning or None when there was no think block, content)."""
    splitter = ReasoningSplitter(thinking, tags)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.found else None), c1 + c2
