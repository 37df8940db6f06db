"""What a sequence's sampled tokens become: streamed text with stop tokens and stop strings applied, and the
final result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from exl2.generation.tokenizer import Tokenizer


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model's own distribution (its raw logits, before penalties,
    temperature and filters), and the `top` most likely tokens at that step as (id, log-probability)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"          # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0                 # prompt tokens whose keys/values came from the prompt cache
    draft_tokens: int = 0                  # speculative decoding: guesses checked
    accepted_draft_tokens: int = 0         # ... and kept
    time_queued: float = 0.0               # seconds waiting for a batch slot and cache pages
    time_prefill: float = 0.0              # seconds from admission to the first token
    time_generate: float = 0.0             # seconds from the first token to the end
    logprobs: Optional[list[TokenLogprob]] = None   # one per token id, when the job asked for them
    # what ended a "stop" reply (TabbyAPI's stop_str and eos_reason): the stop string, or the stop token's text;
    # eos_reason "stop_string", "stop_token", "end_filter" (a grammar ended it) or (finish_reason "length")
    # "max_new_tokens"
    stop_str: Optional[str] = None
    eos_reason: str = "max_new_tokens"


class StopMatcher:
    """Holds back streamed text that might be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit: Optional[str] = None     # the stop string found, once one is

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            i, self.hit = min(found, key=lambda f: f[0])   # the earliest in the text
            out, self.pending = self.pending[:i], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class BanGuard:
    """Holds back whole tokens while their text could still become a banned string (ignoring case), so that a
    reply can be taken back to where one began without taking back text already streamed."""

    def __init__(self, banned: Sequence[str]):
        self.banned = [b.lower() for b in banned if b]
        self.text = ""                 # the held tokens' text
        self.spans: list[int] = []     # each held token's share of it
        self.first = 0                 # reply index of the first held token

    def push(self, piece: str) -> tuple[str, Optional[int]]:
        """Add the next token's text: (text now safe to release, reply index of the token where a banned string
        begins, or None)."""
        self.text += piece
        self.spans.append(len(piece))
        low = self.text.lower()
        if len(low) != len(self.text):  # a character whose lower case is longer: match that text as it is
            low = self.text
        hits = [i for i in (low.find(b) for b in self.banned) if i >= 0]
        if hits:
            at, k, end = min(hits), 0, self.spans[0]
            while end <= at:
                k += 1
                end += self.spans[k]
            return "", self.first + k
        keep = max((n for b in self.banned for n in range(min(len(b) - 1, len(low)), 0, -1)
                    if low.endswith(b[:n])), default=0)
        cut, out, n = len(self.text) - keep, 0, 0
        while n < len(self.spans) and out + self.spans[n] <= cut:
            out += self.spans[n]
            n += 1
        released, self.text = self.text[:out], self.text[out:]
        self.spans, self.first = self.spans[n:], self.first + n
        return released, None

    def rewind(self, index: int) -> None:
        """Forget the held tokens from reply index `index` on."""
        k = index - self.first
        self.text = self.text[:sum(self.spans[:k])]
        self.spans = self.spans[:k]

    def flush(self) -> str:
        out, self.text = self.text, ""
        self.first += len(self.spans)
        self.spans = []
        return out


class Reply:
    """One sequence's output: tokens in, text safe to show out (a possible stop string's start is held back).
    Stop strings count only in the text from the `min_tokens`-th token on (vLLM's min_tokens)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 min_tokens: int = 0, banned_strings: Sequence[str] = (), healed: str = ""):
        self.tokenizer = tokenizer
        self.healed = healed                        # token healing: prompt text the first tokens repeat
        self._skip = healed                         # ... and the part of it not yet cut from the stream
        self.guard = BanGuard(banned_strings) if any(banned_strings) else None
        self.rewind_to: Optional[int] = None       # set by push: a banned string began at this reply token
        self.stop_ids = set(tokenizer.eos_ids) | set(stop_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.decoder = tokenizer.stream_decoder()
        self.matcher = StopMatcher(self.stop_strings)
        self.ids: list[int] = []
        self.finish_reason: Optional[str] = None   # set once the reply is over: "stop" or "length"
        self._hit = False
        self.stop_token: Optional[int] = None       # the stop token that ended the reply
        self.min_tokens = min_tokens
        self.unchecked = 0                          # characters streamed before stop strings counted

    def push(self, token: int) -> str:
        """Add a sampled token; returns the new text. A stop token or stop string ends the reply."""
        if token in self.stop_ids:
            self.finish_reason = "stop"
            self.stop_token = token
            return self._tail()
        self.ids.append(token)
        piece = self.decoder.push(token)
        if self._skip and piece:
            piece = self._cut_healed(piece)
        if self.guard is not None:
            piece, self.rewind_to = self.guard.push(piece)
        if len(self.ids) < self.min_tokens:
            return self._unchecked(piece)
        text, self._hit = self.matcher.push(piece)
        if self._hit:
            self.finish_reason = "stop"
        return text

    def close(self, reason: str = "length") -> str:
        """End the reply (if a stop did not) and return the text still held back."""
        if self.finish_reason is not None:
            return ""
        self.finish_reason = reason
        return self._tail()

    def _cut_healed(self, piece: str) -> str:
        """`piece` without the start that repeats healed prompt text (what the prompt already shows)."""
        if piece.startswith(self._skip):
            piece, self._skip = piece[len(self._skip):], ""
        elif self._skip.startswith(piece):
            piece, self._skip = "", self._skip[len(piece):]
        else:  # the text went another way than the healed token's: nothing more to cut
            self._skip = ""
        return piece

    @property
    def confirmed(self) -> int:
        """Reply tokens that can no longer be taken back (all but those a BanGuard holds)."""
        return len(self.ids) if self.guard is None else self.guard.first

    def rewind(self) -> int:
        """Take the reply back to the token where a banned string began (`rewind_to`); returns that token."""
        index, self.rewind_to = self.rewind_to, None
        token = self.ids[index]
        del self.ids[index:]
        self.guard.rewind(index)
        if index == 0:
            self._skip = self.healed
        self.decoder = self.tokenizer.stream_decoder()
        for t in self.ids[-64:]:  # the decoder's context: what it emitted is already out (or held by the guard)
            self.decoder.push(t)
        return token

    def _unchecked(self, text: str) -> str:
        self.unchecked += len(text)
        return text

    def _tail(self) -> str:
        if self._hit:
            return ""
        rest = self.decoder.flush()
        if self.guard is not None:
            rest = self.guard.flush() + rest
        if len(self.ids) < self.min_tokens:
            return self._unchecked(rest)
        tail, _ = self.matcher.push(rest)
        return tail + self.matcher.flush()

    def result(self, prompt_tokens: int) -> GenerationResult:
        text = self.tokenizer.decode(self.ids)
        if self.healed and text.startswith(self.healed):
            text = text[len(self.healed):]
        head, text = text[:self.unchecked], text[self.unchecked:]
        for s in self.stop_strings:
            if s in text:
                text = text[: text.index(s)]
        result = GenerationResult(head + text, list(self.ids), self.finish_reason or "length", prompt_tokens)
        if self.stop_token is not None:
            result.stop_str, result.eos_reason = self.tokenizer.decode([self.stop_token]), "stop_token"
        elif self.matcher.hit is not None and result.finish_reason == "stop":
            result.stop_str, result.eos_reason = self.matcher.hit, "stop_string"
        elif result.finish_reason == "stop":
            result.eos_reason = "end_filter"     # a grammar was complete (or allowed nothing more)
        return result
