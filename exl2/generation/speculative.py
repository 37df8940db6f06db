"""Draft tokens for speculative decoding: cheap guesses at the next few tokens, which the model then checks in one
forward pass (generation.dynamic). A batch-1 decode step reads every weight for one token; checking four guessed
tokens reads them once too, so each accepted guess is a token for (almost) free.

Two drafters: n-grams of the sequence itself (prompt lookup: code edits, quotes, summaries repeat their input) and
a small draft model with the same vocabulary.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from exl2.errors import ConfigError
from exl2.models.decoder import DecoderModel
from exl2.models.rope import RopeOverride, ntk_alpha
from exl2.runtime.graphs import DecodeGraphs, graph_safe
from exl2.runtime.paged_cache import paged_cache_for

log = logging.getLogger("exl2.speculative")


Request = tuple[int, Sequence[int], int]   # (job id, its prompt and reply so far, how many guesses at most)


class Drafter(Protocol):
    reads_images: bool   # whether it can guess for prompts holding image tokens (ids past the vocabulary)

    def propose_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """For each request, up to k guesses at the tokens after its tokens (one list per request, maybe empty)."""

    def forget(self, job_id: int) -> None:
        """The job has ended."""


class PerJobDraft:
    """A drafter that guesses for one job at a time (`propose`), with nothing to gain from a batch."""

    reads_images = True

    def propose(self, job_id: int, tokens: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        return [self.propose(*r) if r[2] > 0 else [] for r in requests]

    def forget(self, job_id: int) -> None:
        pass


class NgramDraft(PerJobDraft):
    """The tokens that followed the latest earlier occurrence of the sequence's last n tokens (longest n first).

    Each job's tokens are kept in a growing int64 array and searched with whole-array comparisons, so a guess costs
    a few passes over the text in C (about a millisecond at 128k tokens) rather than a Python loop over it."""

    CHECK = 32

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.texts: dict[int, tuple[np.ndarray, int]] = {}   # job id -> (buffer, tokens in it)

    def _array(self, job_id: int, tokens: Sequence[int]) -> np.ndarray:
        """The job's tokens as an array, extended by what was added since the last call; rebuilt when its last
        CHECK tokens differ from the text's (taken back and regrown since: a stale copy would only make worse
        guesses, never wrong output)."""
        buf, n = self.texts.get(job_id, (np.empty(0, np.int64), 0))
        size = len(tokens)
        w = min(n, self.CHECK)
        if size < n or not np.array_equal(buf[n - w:n], np.fromiter(tokens[n - w:n], np.int64, w)):
            n = 0
        if size > buf.shape[0]:
            grown = np.empty(max(size, 2 * buf.shape[0], 256), np.int64)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:size] = np.fromiter(tokens[n:size], np.int64, size - n)
        self.texts[job_id] = (buf, size)
        return buf[:size]

    def propose(self, job_id: int, tokens: Sequence[int], k: int) -> list[int]:
        text = self._array(job_id, tokens)
        size = text.shape[0]
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            hit = np.ones(size - n, dtype=bool)    # candidate starts 0 .. size - n - 1 (before the suffix itself)
            for j in range(n):
                hit &= text[j:size - n + j] == text[size - n + j]
            found = np.flatnonzero(hit)
            if found.size:
                start = int(found[-1]) + n
                return text[start:start + k].tolist()
        return []

    def forget(self, job_id: int) -> None:
        self.texts.pop(job_id, None)


# A sequence whose draft cache lags by more than this many tokens (a new prompt) catches up alone, CATCH_UP_CHUNK
# tokens a forward; shorter lags (the last step's token and kept guesses) catch up together, right-padded.
CATCH_UP_ALONE, CATCH_UP_CHUNK = 32, 2048


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)   # page i holds positions [i·page_size, (i+1)·page_size)
    cached: list[int] = field(default_factory=list)  # the tokens whose keys/values those pages hold, in order


class ModelDraft:
    """A small model drafts greedily for up to `max_batch` sequences at once (one batched forward a guess), each in
    its own pages of a paged cache sized like the model's (`cache_tokens`). A sequence's pages follow its tokens:
    where they part from what is cached (a rejected guess), it is re-fed from there. When pages run short, the
    least recently drafted sequences not in the batch give theirs up; a sequence that still finds none gets no
    guesses that step (decoding stays exact, only slower)."""

    reads_images = False   # a prompt's image tokens are the vision model's embeddings, not the draft model's

    def __init__(self, model: DecoderModel, max_seq_len: int, cache_mode: str = "fp16", page_size: int = 256,
                 cache_tokens: Optional[int] = None, max_batch: int = 1):
        self.model, self.page_size = model, page_size
        per_seq = -(-max_seq_len // page_size)
        pages = max(-(-(cache_tokens or 0) // page_size), per_seq) + max_batch
        self.free = list(range(pages - 1, -1, -1))
        self.scratch = pages  # where the padding of shorter rows lands
        self.cache = paged_cache_for(model, pages + 1, page_size, cache_mode)
        self.width = -(-(max_seq_len + CATCH_UP_ALONE) // page_size)  # block-table columns: room for the padding
        model.prepare_rope(self.width * page_size)
        self.graphs = None
        if model.device.type == "cuda" and graph_safe(model):
            sizes = tuple(b for b in (1, 2, 4, 8, 16) if b < max_batch) + (max_batch,)
            self.graphs = DecodeGraphs(model, self.cache, self.width, batch_sizes=sizes, scratch_page=self.scratch)
        self.seqs: OrderedDict[int, _Sequence] = OrderedDict()   # least recently drafted first

    def propose(self, job_id: int, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_batch([(job_id, tokens, k)])[0]

    def propose_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        busy = {r[0] for r in requests}
        rows = []   # (request index, sequence, tokens, cached prefix kept)
        for i, (job_id, tokens, k) in enumerate(requests):
            seq = self._sequence(job_id, len(tokens) + k - 1, busy) if k > 0 and tokens else None
            if seq is None:
                continue
            same = 0
            for a, b in zip(seq.cached, tokens):
                if a != b:
                    break
                same += 1
            same = min(same, len(tokens) - 1)  # the last token is always fed: its logits give the first guess
            del seq.cached[same:]
            rows.append((i, seq, tokens, same))
        if not rows:
            return out
        dev = self.model.device
        table = torch.tensor([s.pages + [self.scratch] * (self.width - len(s.pages)) for _, s, _, _ in rows],
                             dtype=torch.int32, device=dev)
        with torch.inference_mode():
            picks = [self._catch_up(rows, table).argmax(-1)]
            pos = [len(t) for _, _, t, _ in rows]
            for _ in range(max(requests[i][2] for i, *_ in rows) - 1):
                ids, at = picks[-1][:, None], torch.tensor(pos, dtype=torch.long, device=dev)
                if self.graphs is not None:
                    logits = self.graphs.step(ids, at, table, max_len=max(pos) + 1, lazy=True)
                else:
                    self.cache.bind(table)
                    logits = self.model(ids, self.cache, at, last_only=True, fresh=False)[:, -1]
                picks.append(logits.argmax(-1))
                pos = [p + 1 for p in pos]
            guesses = torch.stack(picks, 1).tolist()
        for (i, seq, tokens, _), row in zip(rows, guesses):
            k = requests[i][2]
            seq.cached = list(tokens) + row[:k - 1]   # every guess but the last was fed
            out[i] = row[:k]
        return out

    def _catch_up(self, rows: list, table: torch.Tensor) -> torch.Tensor:
        """Feed each row's tokens past its cached prefix; the logits [rows, V] after each row's last token."""
        dev = self.model.device
        last: list[Optional[torch.Tensor]] = [None] * len(rows)
        short = []
        for r, (_, _, tokens, same) in enumerate(rows):
            if len(tokens) - same <= CATCH_UP_ALONE:
                short.append(r)
                continue
            self.cache.bind(table[r:r + 1])
            for start in range(same, len(tokens), CATCH_UP_CHUNK):
                part = torch.tensor([list(tokens[start:start + CATCH_UP_CHUNK])], dtype=torch.long, device=dev)
                last[r] = self.model(part, self.cache, start, last_only=True)[0, -1]
        if short:
            width = max(len(rows[r][2]) - rows[r][3] for r in short)
            fed = [list(rows[r][2][rows[r][3]:]) for r in short]
            part = torch.tensor([f + [f[-1]] * (width - len(f)) for f in fed], dtype=torch.long, device=dev)
            starts = [rows[r][3] for r in short]
            self.cache.bind(table[short] if len(short) < len(rows) else table)
            logits = self.model(part, self.cache, torch.tensor(starts, dtype=torch.long, device=dev),
                                last_only=torch.tensor([len(f) - 1 for f in fed], dtype=torch.long, device=dev),
                                fresh=not any(starts))[:, -1]
            for j, r in enumerate(short):
                last[r] = logits[j]
        return torch.stack(last)

    def _sequence(self, job_id: int, positions: int, busy: set) -> Optional[_Sequence]:
        """The job's sequence (made the most recently drafted) with pages for `positions` positions; None when
        there are not enough pages even after taking back those of sequences outside the batch."""
        seq = self.seqs.pop(job_id, None) or _Sequence()
        self.seqs[job_id] = seq
        while len(seq.pages) * self.page_size < positions:
            if not self.free:
                idle = next((j for j in self.seqs if j not in busy), None)
                if idle is None:
                    return None
                self.free.extend(self.seqs.pop(idle).pages)
            seq.pages.append(self.free.pop())
        return seq

    def forget(self, job_id: int) -> None:
        seq = self.seqs.pop(job_id, None)
        if seq is not None:
            self.free.extend(seq.pages)


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
                 cache_mode: str = "fp16", num_draft_tokens: int = 4, rope: Optional[RopeOverride] = None,
                 cache_tokens: Optional[int] = None, max_batch: int = 1) -> Optional[Drafter]:
    """The drafter the settings ask for (None: no speculative decoding); `rope`: the draft model's RoPE
    override (`draft_rope`); a draft model's cache holds `cache_tokens` (default max_seq_len) and drafts for up to
    `max_batch` sequences at once."""
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
    return ModelDraft(draft, length, cache_mode, cache_tokens=cache_tokens and cache_tokens + num_draft_tokens,
                      max_batch=max_batch)
