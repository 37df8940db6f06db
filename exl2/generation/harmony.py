"""OpenAI's harmony format (gpt-oss): what a reply says on each channel.

A gpt-oss reply is a run of messages, each `<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`,
ended by `<|end|>` (then the next opens with `<|start|>assistant`), `<|call|>` (a tool call) or `<|return|>`
(done). The `analysis` channel is the reasoning, `final` the answer, and `commentary` either a tool call (with a
`to=functions.NAME` recipient, its body the JSON arguments) or a preamble the user may see. `HarmonySplitter`
reads streamed text into (reasoning, content) pieces and the calls, holding back only what may be a marker, so a
streamed reply and the whole one split alike.
"""
from __future__ import annotations

import json
import re
from typing import Optional

MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    return CHANNEL in template_source and MESSAGE in template_source


def _held(text: str) -> int:
    """Length of the longest tail of `text` that begins a marker (held until the rest arrives)."""
    for n in range(min(len(text), max(len(m) for m in ENDS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in ENDS):
            return n
    return 0


class HarmonySplitter:
    """Streamed harmony text → (reasoning, content) pieces, and `calls` ([{'name', 'arguments'}]) at the end."""

    def __init__(self) -> None:
        self.buf = ""
        self.header: Optional[str] = ""     # the current message's header while it is read; None inside a body
        self.kind = "final"                 # where the current body goes: reasoning, content or a call
        self.call: Optional[dict] = None
        self.calls: list[dict] = []

    def _open(self, header: str) -> None:
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else header
        name = channel.split()[0] if channel.split() else ""
        to = _RECIPIENT.search(header)
        if to and to.group(1).startswith("functions."):
            self.kind, self.call = "call", {"name": to.group(1)[len("functions."):], "arguments": ""}
        else:
            self.kind, self.call = ("reasoning" if name == "analysis" else "content"), None

    def _close(self) -> None:
        if self.call is not None:
            self.calls.append(_parsed(self.call))
            self.call = None

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        while self.buf:
            if self.header is not None:                     # reading a header, up to <|message|>
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if not any(m.startswith(self.buf) or self.buf.startswith(m) for m in (CHANNEL, START)):
                        self.header, self.kind = None, "content"     # no harmony header: plain text
                        continue
                    break
                self._open(self.buf[:at])
                self.buf, self.header = self.buf[at + len(MESSAGE):], None
                continue
            ends = [(i, m) for m in ENDS if (i := self.buf.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                body, self.buf = self.buf[:at], self.buf[at + (0 if marker == START else len(marker)):]
                self.header = ""
            else:
                keep = _held(self.buf)
                body, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            if self.kind == "reasoning":
                reasoning += body
            elif self.kind == "call":
                self.call["arguments"] += body
            else:
                content += body
            if self.header == "":
                self._close()
            if not ends:
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the reply ends (an unclosed message counts as ended)."""
        rest, self.buf = self.buf, ""
        reasoning = content = ""
        if self.header is None:
            if self.kind == "reasoning":
                reasoning = rest
            elif self.kind == "call":
                self.call["arguments"] += rest
            else:
                content = rest
        self._close()
        return reasoning, content


def _parsed(call: dict) -> dict:
    """A call's arguments as a dict (text that is not a JSON object: {} — the model wrote no usable arguments)."""
    try:
        args = json.loads(call["arguments"]) if call["arguments"].strip() else {}
    except ValueError:
        args = {}
    return {"name": call["name"], "arguments": args if isinstance(args, dict) else {}}


def split(text: str) -> tuple[str, str, list[dict]]:
    """A whole harmony reply as (reasoning, content, calls)."""
    splitter = HarmonySplitter()
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2, splitter.calls
