"""Draft tokens for speculative decoding: cheap guesses at the next few tokens, which the model then checks in one
forward pass (generation.dynamic). A batch-1 decode step reads every weight for one token; checking four guessed
tokens reads them once too, so each accepted guess is a token for (almost) free.

Two drafters: n-grams of the sequence itself (prompt lookup: code edits, quotes, summaries repeat their input) and
a small draft model with the same vocabulary.
"""
from __future__ import annotations

import logging
from typing import Optional, Protocol, Sequence

import torch

from exl2.errors import ConfigError
from exl2.models.decoder import DecoderModel
from exl2.models.rope import RopeOverride, ntk_alpha
from exl2.runtime.graphs import DecodeGraphs, graph_safe
from exl2.runtime.paged_cache import paged_cache_for

log = logging.getLogger("exl2.speculative")


class Drafter(Protocol):
    def propose(self, job_id: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k guesses at the tokens after `tokens` (a job's prompt and reply so far)."""

    def forget(self, job_id: int) -> None:
        """The job has ended."""


class NgramDraft:
    """The tokens that followed the latest earlier occurrence of the sequence's last n tokens (longest n first)."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, job_id: int, tokens: Sequence[int], k: int) -> list[int]:
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            tail = list(tokens[n_tokens - n:])
            for start in range(n_tokens - n - 1, -1, -1):
                if list(tokens[start:start + n]) == tail:
                    follow = list(tokens[start + n:start + n + k])
                    if follow:
                        return follow
        return []

    def forget(self, job_id: int) -> None:
        pass


class ModelDraft:
    """A small model drafts greedily. Its cache follows one sequence at a time: the one being decoded alone;
    a different sequence (or tokens that differ from what it cached) is re-fed from where they part."""

    def __init__(self, model: DecoderModel, max_seq_len: int, cache_mode: str = "fp16", page_size: int = 256):
        self.model = model
        pages = -(-max_seq_len // page_size)
        self.cache = paged_cache_for(model, pages + 1, page_size, cache_mode)
        self.table = torch.arange(pages, dtype=torch.int32, device=model.device).view(1, -1)
        model.prepare_rope(pages * page_size)
        self.graphs = None
        if model.device.type == "cuda" and graph_safe(model):
            self.graphs = DecodeGraphs(model, self.cache, pages, batch_sizes=(1,), scratch_page=pages)
        self.job_id: Optional[int] = None
        self.cached: list[int] = []   # the tokens whose keys/values the draft cache holds, in order

    def propose(self, job_id: int, tokens: Sequence[int], k: int) -> list[int]:
        if job_id != self.job_id:
            self.job_id, self.cached = job_id, []
        same = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)  # the last token is always fed: its logits give the first guess
        dev = self.model.device
        with torch.inference_mode():
            self.cache.bind(self.table)
            part = torch.tensor([list(tokens[same:])], dtype=torch.long, device=dev)
            logits = self.model(part, self.cache, same, last_only=True)[:, -1]
            self.cached = list(tokens)
            drafts = [int(logits.argmax(-1))]
            while len(drafts) < k:
                pos = len(self.cached)
                ids = torch.tensor([[drafts[-1]]], dtype=torch.long, device=dev)
                if self.graphs is not None:
                    logits = self.graphs.step(ids, torch.tensor([pos], device=dev), self.table, max_len=pos + 1,
                                              lazy=True)
                else:
                    self.cache.bind(self.table)
                    logits = self.model(ids, self.cache, pos, last_only=True)[:, -1]
                self.cached.append(drafts[-1])
                drafts.append(int(logits.argmax(-1)))
        return drafts

    def forget(self, job_id: int) -> None:
        if job_id == self.job_id:
            self.job_id, self.cached = None, []



def draft_rope(draft_model_dir, length: int, rope: Optional[RopeOverride] = None) -> Optional[RopeOverride]:
    """The RoPE override a draft model runs with: `rope` when it sets one, else, where the draft model's native
    context is shorter than the `length` it must cover, an NTK alpha for the ratio (its guesses past its native
    context would otherwise be noise: speculation stays exact, only slower); else none."""
    if rope is not None and rope.active:
        return rope
    from exl2.runtime.loader import native_context

    native = native_context(draft_model_dir)
    if length <= native:
        return None
    alpha = ntk_alpha(length / native)
    log.info("The draft model's context (%d) is shorter than %d tokens: it runs with RoPE alpha %.2f.", native,
             length, alpha)
    return RopeOverride(alpha=alpha, context=length)


def make_drafter(model: DecoderModel, ngram: bool = False, draft_model_dir=None, max_seq_len: int = 4096,
                 cache_mode: str = "fp16", num_draft_tokens: int = 4,
                 rope: Optional[RopeOverride] = None) -> Optional[Drafter]:
    """The drafter the settings ask for (None: no speculative decoding); `rope`: the draft model's RoPE
    override (`draft_rope`)."""
    if ngram and draft_model_dir:
        raise ConfigError("Choose n-gram drafting or a draft model, not both.")
    if ngram:
        return NgramDraft()
    if not draft_model_dir:
        return None
    from exl2.runtime.loader import load_model

    length = max_seq_len + num_draft_tokens
    draft = load_model(draft_model_dir, str(model.device), rope=draft_rope(draft_model_dir, length, rope))
    if abs(draft.spec.vocab_size - model.spec.vocab_size) > 1024:
        raise ConfigError(f"The draft model's vocabulary ({draft.spec.vocab_size} tokens) does not match the "
                          f"model's ({model.spec.vocab_size}); a draft model must share the tokenizer.")
    return ModelDraft(draft, max_seq_len + num_draft_tokens, cache_mode)
