"""One request at a time, the way the command line generates: a prompt in, streamed text out.

It runs on the dynamic generator (so a chat's earlier turns stay in the cache and are not computed again), either
driven on the calling thread or, given a BatchWorker, as one job among the worker's batch.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from exl2.config import CHUNK_DEFAULT, SamplingSettings
from exl2.generation.budget import ReasoningBudget
from exl2.generation.constraints import Grammar
from exl2.generation.dynamic import DynamicGenerator, Event, Job
from exl2.generation.output import GenerationResult, StopMatcher
from exl2.generation.speculative import Drafter
from exl2.generation.tokenizer import Tokenizer
from exl2.generation.worker import BatchWorker
from exl2.models.decoder import DecoderModel

__all__ = ["GenerationResult", "Generator", "StopMatcher"]


class Generator:
    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, max_seq_len: Optional[int] = None,
                 cache_mode: str = "fp16", worker: Optional[BatchWorker] = None, draft: Optional[Drafter] = None,
                 num_draft_tokens: int = 4, chunk: int = CHUNK_DEFAULT, use_graphs: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.draft, self.num_draft_tokens, self.chunk = draft, num_draft_tokens, chunk
        self.use_graphs = use_graphs
        self.max_seq_len = max_seq_len or min(model.spec.max_position, 4096)
        self.cache_mode = cache_mode
        self.worker = worker
        self._dynamic: Optional[DynamicGenerator] = None

    def job(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
            stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None, stop_token_ids: Sequence[int] = (),
            grammar: Optional[Grammar] = None, logprobs: Optional[int] = None, min_new_tokens: int = 0,
            ignore_eos: bool = False, negative_prompt: str | list[int] | None = None,
            budget: Optional[ReasoningBudget] = None, loras: Optional[tuple] = None) -> Job:
        """A job for the dynamic generator; `grammar` (generation.constraints) restricts the reply's format;
        `logprobs` (k) puts each token's log-probability and the k likeliest alternatives in the result;
        `stop_token_ids` end the reply like EOS; before `min_new_tokens` tokens neither they, EOS nor a stop string
        can end it; `ignore_eos` never samples EOS; `negative_prompt` is what classifier-free guidance
        (settings.cfg_scale ≠ 1) steers away from (None: the BOS token alone; text gets the tokenizer's BOS rule,
        whatever `add_bos` says for a chat prompt); `budget` closes a think block after so many tokens (see
        Job); `loras` ((adapter, scaling), ...) this request's own LoRA adapters (see Job)."""
        ids = self._ids(prompt, add_bos)
        negative = None if negative_prompt is None else self._ids(negative_prompt, None)  # the tokenizer's BOS rule
        return Job(ids, settings, max_new_tokens, stop_strings, stop_token_ids, grammar, logprobs, min_new_tokens,
                   ignore_eos, negative, budget, loras)

    def _ids(self, prompt: str | list[int], add_bos: Optional[bool]) -> list[int]:
        return self.tokenizer.encode(prompt, add_bos=add_bos) if isinstance(prompt, str) else list(prompt)

    def events(self, job: Job) -> Iterator[Event]:
        if self.worker is not None:
            return self.worker.stream(job)
        rows = 2 if job.cfg else 1    # classifier-free guidance runs a second sequence beside the prompt
        if self._dynamic is None or self._dynamic.max_batch < rows:
            self._dynamic = DynamicGenerator(self.model, self.tokenizer, self.max_seq_len, self.cache_mode,
                                             cache_tokens=rows * self.max_seq_len, max_batch=rows, draft=self.draft,
                                             num_draft_tokens=self.num_draft_tokens, chunk=self.chunk,
                                             use_graphs=self.use_graphs)
        return self._dynamic.stream(job)

    def stream(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
               stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None,
               stop_token_ids: Sequence[int] = (), grammar: Optional[Grammar] = None,
               logprobs: Optional[int] = None, min_new_tokens: int = 0, ignore_eos: bool = False,
               negative_prompt: str | list[int] | None = None, images: Sequence = (),
               loras: Optional[tuple] = None) -> Iterator[tuple[str, Optional[GenerationResult]]]:
        """Yield (new text, None) while generating and finally ("", result); `images`: the images.ImageTokens
        whose tokens the prompt's ids hold."""
        job = self.job(prompt, settings, max_new_tokens, stop_strings, add_bos, stop_token_ids, grammar, logprobs,
                       min_new_tokens, ignore_eos, negative_prompt, loras=loras)
        job.images = tuple(images)
        for event in self.events(job):
            if event.text:
                yield event.text, None
            if event.result is not None:
                yield "", event.result

    def generate(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None,
                 max_new_tokens: int = 256, stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None,
                 grammar: Optional[Grammar] = None, logprobs: Optional[int] = None, *,
                 stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0,
                 ignore_eos: bool = False, negative_prompt: str | list[int] | None = None,
                 loras: Optional[tuple] = None) -> GenerationResult:
        result = None
        for _, r in self.stream(prompt, settings, max_new_tokens, stop_strings, add_bos, stop_token_ids, grammar,
                                logprobs, min_new_tokens, ignore_eos, negative_prompt, loras=loras):
            result = r or result
        return result
