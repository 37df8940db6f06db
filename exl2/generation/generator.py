"""Streaming text generation for one prompt: prefill, then one token at a time, with stop tokens and strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from exl2.config import SamplingSettings
from exl2.errors import ContextLengthError
from exl2.generation.sampler import make_generator, sample
from exl2.generation.tokenizer import Tokenizer
from exl2.models.decoder import DecoderModel
from exl2.runtime.session import Session


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"          # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0


class StopMatcher:
    """Holds back streamed text that might be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
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


class Generator:
    """Single-sequence generator over a paged KV cache (fp16 or quantized), CUDA graphs on the GPU."""

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, max_seq_len: Optional[int] = None,
                 cache_mode: str = "fp16"):
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = max_seq_len or min(model.spec.max_position, 4096)
        self.cache_mode = cache_mode
        self._session: Optional[Session] = None

    def _new_session(self) -> Session:
        """Reuse the cache (and captured graphs) across requests; only the sequence length is reset."""
        if self._session is None:
            self._session = Session(self.model, self.max_seq_len, self.cache_mode)
        self._session.length = 0
        return self._session

    def stream(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
               stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None,
               stop_token_ids: Sequence[int] = ()) -> Iterator[tuple[str, Optional[GenerationResult]]]:
        """Yield (new text, None) while generating and finally ("", result)."""
        settings = settings or SamplingSettings()
        ids = self.tokenizer.encode(prompt, add_bos=add_bos) if isinstance(prompt, str) else list(prompt)
        if not ids:
            ids = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        if len(ids) >= self.max_seq_len:
            raise ContextLengthError(
                f"The prompt is {len(ids)} tokens long but the context holds {self.max_seq_len} tokens.")
        max_new = min(max_new_tokens, self.max_seq_len - len(ids))
        stops = set(self.tokenizer.eos_ids) | set(stop_token_ids)
        dev = self.model.device
        gen = make_generator(settings.seed, dev)
        session = self._new_session()
        seq = torch.tensor([ids], dtype=torch.long, device=dev)
        decoder = self.tokenizer.stream_decoder()
        matcher = StopMatcher(stop_strings)
        out_ids: list[int] = []
        reason, hit = "length", False
        with torch.inference_mode():
            logits = session.prefill(ids)
            for i in range(max_new):
                tok = sample(logits, settings, gen, seq)
                t = int(tok[0])
                if t in stops:
                    reason = "stop"
                    break
                out_ids.append(t)
                seq = torch.cat([seq, tok.view(1, 1)], dim=1)
                text, hit = matcher.push(decoder.push(t))
                if text:
                    yield text, None
                if hit:
                    reason = "stop"
                    break
                if i + 1 < max_new:
                    logits = session.step(tok)
        if not hit:
            tail, _ = matcher.push(decoder.flush())
            tail += matcher.flush()
            if tail:
                yield tail, None
        text = self.tokenizer.decode(out_ids)
        for s in stop_strings:
            if s and s in text:
                text = text[: text.index(s)]
        yield "", GenerationResult(text, out_ids, reason, len(ids))

    def generate(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None,
                 max_new_tokens: int = 256, stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None
                 ) -> GenerationResult:
        result = None
        for _, r in self.stream(prompt, settings, max_new_tokens, stop_strings, add_bos):
            result = r or result
        return result
