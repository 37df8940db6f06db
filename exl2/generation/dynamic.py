"""Continuous batching: jobs share one paged KV cache, join and leave between steps, and decode together.

Each `iterate()` admits queued jobs while the batch and the cache have room (a job reserves the pages of its
whole prompt and completion up front, so a running job never waits for memory), prefills up to `chunk` prompt
tokens (a long prompt takes several steps, so the running jobs keep decoding meanwhile), then runs one decode
step for every job past its prompt: a single batched forward, a CUDA graph on the GPU. Prompts that start with
pages already in the cache reuse them (runtime.page_pool).
"""
from __future__ import annotations

import time
from collections import deque
from itertools import takewhile
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from exl2.config import SamplingSettings
from exl2.errors import ConfigError, ContextLengthError, ModelLoadError
from exl2.generation.images import image_limits, mrope_positions, rope_span, whole_images
from exl2.generation.images import split as split_images
from exl2.generation.job import Event, Job
from exl2.generation.output import GenerationResult, TokenLogprob
from exl2.generation.dry import TokenHistory, apply_dry, sequence_breakers
from exl2.generation.sampler import SeenTokens, forbid, fresh_seed, only_allow, recent_tokens, sample_rows
from exl2.generation.speculative import Drafter
from exl2.generation.tokenizer import Tokenizer
from exl2.models.decoder import NO_HEAD, DecoderModel
from exl2.runtime import lora
from exl2.generation.request_loras import RequestLoras, check_choice, choice_key
from exl2.runtime.host_pages import HostPages
from exl2.runtime.graphs import DecodeGraphs, graph_safe
from exl2.runtime.page_pool import PagePool, page_key
from exl2.runtime.paged_cache import paged_cache_for
from exl2.runtime.upload import upload

MAX_SKIPS = 4  # how often younger jobs may start before a waiting one (exllamav2's max_skips)
# A check of 1 + k tokens costs ~1.35-1.55 plain steps (H100/H200, k = 2-8; benchmarks/RESULTS.md, sessions 18-21),
# so drafting loses where fewer than ~0.5 guesses a check are kept: with `adaptive_draft`, a job whose recent checks
# kept fewer than SPEC_MIN_KEPT on average decodes plainly for SPEC_PAUSE steps, then tries drafts again.
SPEC_MIN_KEPT, SPEC_PAUSE = 0.5, 16
# A check of B sequences feeds B·(1 + k) rows. Up to CHECK_ROWS rows the small-batch matmuls take them for little more
# than a plain step (H100: 1.13-1.21x at B = 2, 1.16x at B = 4, k = 2), past it the step costs about 3x (B = 2, k = 8;
# B = 4, k = 4; B = 8, k = 2): benchmarks/serving.py, RESULTS.md session 34. So a batch checks
# min(num_draft_tokens, CHECK_ROWS / B - 1) guesses a sequence, and batches past MAX_DRAFT_BATCH decode plainly.
CHECK_ROWS, MAX_DRAFT_BATCH = 16, 8
# New prompts prefill together while the padded forward has at most PAD_SLACK x their tokens + PAD_TOKENS.
PAD_SLACK, PAD_TOKENS = 1.5, 64


@dataclass
class _Step:
    """A decode step on its way: its jobs, sampled tokens (on the GPU and, once `done` fires, on the host), the
    positions it fed and the stream positions it drew from."""

    jobs: list[Job]
    picks: torch.Tensor
    pos: torch.Tensor
    draws: list[int]
    host: tuple               # (sampled tokens, log-probability tensors or None), readable once `done` fires
    done: Optional[torch.cuda.Event]


class DynamicGenerator:
    """`cache_tokens` (at least max_seq_len) sizes the cache all jobs share; `max_batch` bounds the decode batch;
    `overlap` (default: on a GPU) lets decode steps run ahead of the host's text handling (see `iterate`);
    `flash_attention` False keeps prompt attention off PyTorch's SDPA and the flash_attn package;
    `host_cache_bytes` keeps cached prompt pages the GPU cache evicts in host memory (`runtime.host_pages`)."""

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, max_seq_len: int, cache_mode: str = "fp16",
                 cache_tokens: Optional[int] = None, max_batch: int = 16, page_size: int = 256, chunk: int = 2048,
                 use_graphs: bool = True, draft: Optional[Drafter] = None, num_draft_tokens: int = 4,
                 overlap: Optional[bool] = None, flash_attention: bool = True, adaptive_draft: bool = True,
                 max_draft_batch: int = MAX_DRAFT_BATCH, host_cache_bytes: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.draft, self.num_draft_tokens, self.adaptive_draft = draft, num_draft_tokens, adaptive_draft
        # batch size (rounded up to these) -> guesses a sequence a check feeds
        buckets = tuple(b for b in (1, 2, 4, 8, 16, 32) if b < max_draft_batch) + (max_draft_batch,)
        self.check_guesses = {b: g for b in buckets if b <= max_batch and (g := min(num_draft_tokens,
                                                                                   CHECK_ROWS // b - 1)) >= 1}
        self.max_draft_batch = max(self.check_guesses, default=0)
        self.max_seq_len, self.max_batch, self.chunk, self.page_size = max_seq_len, max_batch, chunk, page_size
        self.pages_per_seq = -(-max_seq_len // page_size)
        num_pages = max(-(-(cache_tokens or 0) // page_size), self.pages_per_seq)
        self.pool = PagePool(num_pages, page_size)
        self.scratch = num_pages  # one spare page: where padded rows of a decode graph write
        self.cache = paged_cache_for(model, num_pages + 1, page_size, cache_mode)
        self.host_pages = HostPages(self.cache, host_cache_bytes) if host_cache_bytes else None
        if self.host_pages is not None:
            self.pool.on_evict = self.host_pages.save
        for shard in getattr(self.cache, "shards", [self.cache]):  # EngineConfig.flash_attention_enabled
            shard.prefill_backend = "auto" if flash_attention else "triton"
        # a check feeds up to num_draft_tokens positions past a job's end (never kept): extra scratch columns
        self.spec_pages = -(-num_draft_tokens // page_size) if draft is not None else 0
        model.prepare_rope((self.pages_per_seq + self.spec_pages) * page_size)
        self.graphs = None
        self.verify_graphs: dict[int, DecodeGraphs] = {}   # guesses a sequence -> the check steps' graphs
        if use_graphs and model.device.type == "cuda" and graph_safe(model):
            sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch) + (max_batch,)
            self.graphs = DecodeGraphs(model, self.cache, self.pages_per_seq, batch_sizes=sizes,
                                       scratch_page=self.scratch)
            if draft is not None:  # each sequence checks its drafts: its last token and its guesses
                for g in set(self.check_guesses.values()):
                    sizes = tuple(b for b, n in self.check_guesses.items() if n == g)
                    self.verify_graphs[g] = DecodeGraphs(model, self.cache, self.pages_per_seq + self.spec_pages,
                                                         batch_sizes=sizes, scratch_page=self.scratch, tokens=g + 1)
        self.loras = RequestLoras(model, max(chunk, max_seq_len, max_batch * (num_draft_tokens + 1)))
        self.queue: deque[Job] = deque()
        self.active: list[Job] = []
        self._decode_table: tuple = ((), None, None)   # (job ids, block table, RoPE shifts)
        self.seen: Optional[SeenTokens] = None  # made when a job first asks for a penalty on seen tokens
        self._xtc_mask: Optional[torch.Tensor] = None
        self._heals: dict[int, tuple[int, ...]] = {}    # token healing: prompt token -> the tokens that may follow
        self.overlap = model.device.type == "cuda" if overlap is None else overlap
        self._inflight: Optional[_Step] = None  # a decode step launched, its tokens not read yet
        self.chained = 0                          # decode steps launched before the previous one's tokens were read

    # ---- jobs ----------------------------------------------------------------------------------------------

    def enqueue(self, job: Job) -> Job:
        """Queue a job; raises ContextLengthError when its prompt does not fit the context."""
        if getattr(self.model, "lm_head", True) is None:
            raise ModelLoadError(NO_HEAD)
        if not job.ids:
            job.ids = self._bos_only()
        if len(job.ids) >= self.max_seq_len:
            raise ContextLengthError(
                f"The prompt is {len(job.ids)} tokens long but the context holds {self.max_seq_len} tokens.")
        if job.loras is not None:
            check_choice(job.loras)
        if job.settings.token_healing and job.grammar is None:
            self._take_last_token(job)
        if job.images and self.model.spec.mrope_section is not None:
            job.rope = mrope_positions(job.ids, job.images, self.model.spec.vocab_size)
        job.max_new_tokens = max(1, min(job.max_new_tokens, self.max_seq_len - len(job.ids)))
        if job.cfg:
            self._make_guide(job)
        job.times[0] = time.perf_counter()
        self.queue.append(job)
        return job

    def _make_guide(self, job: Job) -> None:
        """Classifier-free guidance: the job's second sequence, its negative prompt, which is fed the job's reply
        tokens and whose logits `_guided` mixes into the job's. Both start together (`_start`)."""
        if self.max_batch < 2:
            raise ConfigError("Classifier-free guidance runs two sequences, and this generator decodes one at a time.")
        ids = job.negative_ids or self._bos_only()
        if len(ids) >= self.max_seq_len:
            raise ContextLengthError(
                f"The negative prompt is {len(ids)} tokens long but the context holds {self.max_seq_len} tokens.")
        job.max_new_tokens = max(1, min(job.max_new_tokens, self.max_seq_len - len(ids)))
        guide = Job(ids, SamplingSettings(temperature=0.0), job.max_new_tokens, loras=job.loras)
        need = self._pages_needed(job) + self._pages_needed(guide)
        if need > self.pool.num_pages:
            raise ContextLengthError(
                f"Classifier-free guidance keeps the prompt and the negative prompt, each with the reply, in the "
                f"cache: {need * self.page_size} tokens, and the cache holds {self.pool.num_pages * self.page_size}; "
                "give a larger cache_size or ask for fewer tokens.")
        job.guide, guide.guided = guide, job

    def _bos_only(self) -> list[int]:
        """The prompt of a job given none (and the default negative prompt): the BOS token alone."""
        return [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else [0]

    def _take_last_token(self, job: Job) -> None:
        """Token healing: take the prompt's last token off and let the reply begin only with a token whose text
        begins with its text (the allowed sets are kept per token). Not for a prompt of one token, a special
        token, or one whose text is empty."""
        last = job.ids[-1]
        texts = self.tokenizer.token_texts()
        if len(job.ids) < 2 or last in self.tokenizer.special_ids or not 0 <= last < len(texts) or not texts[last]:
            return
        allowed = self._heals.get(last)
        if allowed is None:
            head = texts[last]
            allowed = self._heals[last] = tuple(t for t, s in enumerate(texts) if s.startswith(head))
        job.ids = job.ids[:-1]
        job.heal = (texts[last], allowed)

    def cancel(self, job: Job) -> None:
        """Stop a job now; its pages go back to the pool (those holding a full prefix stay cached)."""
        job.cancelled = True
        if job in self.queue:
            self.queue.remove(job)
            job.done = True
        elif job in self.active:
            self._finish(job)
        if self.draft is not None:   # a draft model's pages for it go back too
            self.draft.forget(job.id)

    def has_work(self) -> bool:
        return bool(self.queue or self.active)

    def set_loras(self, adapters: Sequence[lora.LoraAdapter]) -> None:
        """Make exactly `adapters` active on the model ([]: none). They are global, as in exllamav2: every job
        runs with them, so they change only between jobs (a running job's cache was computed without them).
        The CUDA graphs and the prompt cache hold the previous weights' work, so the graphs are freed (captured
        again lazily) and every cached prefix forgotten. The draft model keeps its own weights."""
        if self.has_work():
            raise ConfigError("LoRAs can change only while no request is running.")
        if self._inflight is not None:  # a step of jobs cancelled since: nothing waits for its tokens
            if self._inflight.done is not None:
                self._inflight.done.synchronize()
            self._inflight = None
        self.loras.set_globals(adapters)   # checks everything before it changes anything
        self._reset_graphs()
        self.pool.forget_prefixes()
        if self.host_pages is not None:
            self.host_pages.clear()

    def _reset_graphs(self) -> None:
        for graphs in (self.graphs, *self.verify_graphs.values()):
            if graphs is not None:
                graphs.reset()

    def _pages_needed(self, job: Job) -> int:
        # The last sampled token is never fed back, so it takes no cache slot.
        return -(-(len(job.ids) + job.max_new_tokens - 1) // self.page_size)

    def _admit(self) -> None:
        """Start queued jobs, oldest first, while the batch and the cache have room. A job whose pages are not free
        yet lets younger jobs that fit go first, at most MAX_SKIPS times; then it blocks the queue until it fits,
        so a long request is delayed but never starved. Adapters no running job uses any more are detached."""
        if self.loras.attach([j.loras for j in self.active]):
            self._reset_graphs()
        waiting: list[Job] = []
        for job in list(self.queue):
            if len(self.active) >= self.max_batch or any(w.skipped >= MAX_SKIPS for w in waiting):
                return
            if self._start(job):
                for w in waiting:
                    w.skipped += 1
            else:
                waiting.append(job)

    def _start(self, job: Job) -> bool:
        seqs = [job] + ([job.guide] if job.guide is not None else [])
        if len(self.active) + len(seqs) > self.max_batch:
            return False
        root = choice_key(job.loras)
        limit = (len(job.ids) - 1) // self.page_size    # the prompt's last token is always computed
        matches = [self.pool.match(j.ids, (len(j.ids) - 1) // self.page_size, root) for j in seqs]
        new = [self._pages_needed(j) - len(shared) for j, (shared, _) in zip(seqs, matches)]
        if sum(new) > self.pool.room(list({p for shared, _ in matches for p in shared})):
            return False  # wait for running jobs to free pages
        stored: list[bytes] = []   # the job's next pages that the host tier holds: copied in, not computed
        if self.host_pages is not None:
            keys = self.pool.keys_after(job.ids, matches[0][1], len(matches[0][0]), limit)
            stored = keys[:self.host_pages.run(keys)]
        held = [self.host_pages.take(k) for k in stored]   # out of the tier before acquiring may evict into it
        self.queue.remove(job)
        if self.loras.attach([j.loras for j in self.active] + [job.loras]):
            self._reset_graphs()
        for shared, _ in matches[1:]:  # the guide's cached pages are taken first, so that the job's cannot evict them
            self.pool.acquire(shared, 0)
        for i, (j, (shared, key), n) in enumerate(zip(seqs, matches, new)):
            j.pages = self.pool.acquire(shared if i == 0 else [], n)
            if i > 0:
                j.pages = shared + j.pages
            j.length = j.cached_tokens = len(shared) * self.page_size
            j.key, j.published = key, len(shared)
            if i == 0 and stored:
                for k, data in zip(stored, held):
                    page = j.pages[j.published]
                    self.host_pages.write(page, data)
                    self.pool.publish(page, k)
                    j.published += 1
                j.key, j.length = stored[-1], j.published * self.page_size
                j.cached_tokens = j.length
            j.tokens = list(j.ids)
            j.reply = j.new_reply(self.tokenizer)
            j.seed = j.settings.seed if j.settings.seed is not None else fresh_seed()
            j.times[1] = time.perf_counter()
            self.active.append(j)
            self._prompt_done(j)
        return True

    @staticmethod
    def _prompt_done(job: Job) -> None:
        """A guided pair's sequence whose prefill is complete gets its prompt's last token to feed (see
        `Job.prompt_end`)."""
        if job.paired and job.pending is None and job.length >= job.prompt_end:
            job.pending = job.ids[-1]

    @staticmethod
    def _ready(job: Job) -> bool:
        """Whether a job decodes this step: it has a token to feed, and so has the other sequence of its pair."""
        other = job.guide or job.guided
        return job.pending is not None and (other is None or other.pending is not None)

    def _table(self, jobs: list[Job], extra: int = 0) -> torch.Tensor:
        """Block tables [B, pages_per_seq + extra], the columns past each job's pages on the scratch page."""
        rows = [j.pages + [self.scratch] * (self.pages_per_seq + extra - len(j.pages)) for j in jobs]
        return torch.tensor(rows, dtype=torch.int32, device=self.model.device)

    def _publish(self, job: Job) -> None:
        """Offer each page the job has filled to later prompts."""
        while (job.published + 1) * self.page_size <= min(job.length, len(job.tokens), job.stable_tokens):
            i = job.published
            job.key = page_key(job.key, job.tokens[i * self.page_size:(i + 1) * self.page_size])
            self.pool.publish(job.pages[i], job.key)
            job.published += 1

    def _finish(self, job: Job) -> None:
        job.done = True
        if job.guide is not None and not job.guide.done:
            self._finish(job.guide)
        self.active.remove(job)
        self.pool.release(job.pages)
        job.pages = []
        if job.slot is not None:
            self.seen.give_back(job.slot)
            job.slot = None

    # ---- one step ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def iterate(self) -> list[Event]:
        """Admit, prefill a chunk, decode one token for every running job; the events of this step.

        With `overlap`, a decode step whose batch can go on unchanged is left running on the GPU: the next call
        launches the step after it (fed the sampled tokens straight from the GPU) before reading its tokens, so
        the host's text handling runs while the GPU computes. Its events come one call later."""
        events: list[Event] = []
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            if self._can_chain(step):
                self._inflight = self._launch(step.jobs, step)
                self.chained += 1
            self._land(step, events)
            if self._inflight is not None:
                return events
        self._admit()
        budget = self.chunk
        for group in self._prefill_groups():
            blocks = self.model.spec.image_blocks and any(j.images for j in group)
            if len(group) == 1:  # a prompt alone, from where it stands, as much of it as the budget allows
                job = group[0]
                start = job.length
                width = min(budget, job.prompt_end - start)
                if blocks:   # an image's tokens all see each other: one chunk holds the whole image
                    width = min(whole_images(job.ids, start, width, self.model.spec.vocab_size),
                                job.prompt_end - start)
                    if width > budget and budget < self.chunk:
                        break      # the next step starts with it
                    budget = max(budget, width)
                rows, ends, last = [job.ids[start:start + width]], [start + width], True
            else:  # new prompts, sorted by length, right-padded to the longest: each row's own last position
                start, width = 0, group[-1].prompt_end
                rows = [j.ids[:j.prompt_end] + [j.ids[j.prompt_end - 1]] * (width - j.prompt_end) for j in group]
                ends = [j.prompt_end for j in group]
                last = True if ends[0] == width else torch.tensor([e - 1 for e in ends], dtype=torch.long,
                                                                  device=self.model.device)
            if width <= 0 or width * len(rows) > budget:
                break
            extra, limits = {}, None
            if any(j.images for j in group):   # image tokens: their embeddings go in place of token 0's
                vocab = self.model.spec.vocab_size
                if blocks:
                    limits = image_limits(rows, [start] * len(rows), vocab, self.model.device)
                rows, found = split_images(rows, [j.images for j in group], vocab, self.model.device)
                extra = {"inject": found} if found is not None else {}
                if any(j.rope for j in group):   # M-RoPE: image tokens rotate by their (t, h, w) places
                    extra["mrope"] = torch.stack([rope_span(j.rope, start, width) for j in group],
                                                  1).to(self.model.device)
            part = torch.tensor(rows, dtype=torch.long, device=self.model.device)
            self.cache.bind(self._table(group)[:, :max(len(j.pages) for j in group)])
            self.cache.limits = limits
            self.loras.set_rows([j.loras for j in group], part.shape[1])
            logits = self.model(part, self.cache, start, last_only=last, **extra)[:, -1]
            budget -= width * len(rows)
            for job, end in zip(group, ends):
                job.length = end
                self._publish(job)
                self._prompt_done(job)
            if all(j.length == j.prompt_end for j in group):
                rows = [i for i, j in enumerate(group) if not j.paired]
                if len(rows) == len(group):
                    self._accept(group, logits, events)
                elif rows:
                    self._accept([group[i] for i in rows], logits[rows], events)
        running = [j for j in self.active if self._ready(j)]
        if self._drafts(running) and self._speculate(running, events):
            return events
        if running and self.overlap and not any(j.host_sampling for j in running):
            self._inflight = self._launch(running)
        elif running:
            self._accept(running, self._decode(running, *self._feed(running)), events)
        return events

    def _drafts(self, jobs: list[Job]) -> bool:
        """Whether this decode step checks drafts: a drafter, at most max_draft_batch jobs, and none that samples
        on the host (`Job.host_sampling`) or wants log-probabilities."""
        return self.draft is not None and 0 < len(jobs) <= self.max_draft_batch and \
            not any(j.host_sampling or j.logprobs is not None for j in jobs)

    def _feed(self, jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids [B, 1] a decode step feeds (each job's pending token) and their positions [B]."""
        dev = self.model.device
        return upload([[j.pending] for j in jobs], torch.long, dev), upload([j.length for j in jobs], torch.long, dev)

    def _decode(self, jobs: list[Job], ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One batched decode step feeding ids [B, 1] at positions pos [B]; its logits [B, V]."""
        key = tuple(j.id for j in jobs)
        if self._decode_table[0] != key:  # pages are reserved up front: the table changes only with the batch
            self._decode_table = (key, self._table(jobs), self._rope_shift(jobs))
        _, table, shift = self._decode_table
        self.loras.set_rows([j.loras for j in jobs], 1)
        if self.graphs is not None:
            logits = self.graphs.step(ids, pos, table, max_len=max(j.length for j in jobs) + 1, lazy=True,
                                      shift=shift)
        else:
            self.cache.bind(table)
            logits = self.model(ids, self.cache, pos, last_only=True, rope_shift=shift)[:, -1]
        for j in jobs:
            j.length += 1
            self._publish(j)
        return logits

    def _rope_shift(self, jobs: list[Job]) -> Optional[torch.Tensor]:
        """[B] what each job's RoPE positions add to its cache positions (M-RoPE prompts with images: the images
        took fewer positions than tokens); None when none does."""
        if not any(j.rope and j.rope[1] for j in jobs):
            return None
        return upload([j.rope[1] if j.rope else 0 for j in jobs], torch.long, self.model.device)

    def _launch(self, jobs: list[Job], prev: Optional["_Step"] = None) -> "_Step":
        """Queue a decode step and its sampling without waiting for them; `prev`, the step still in flight before
        it, gives the tokens to feed (on the GPU) and the stream positions to draw from."""
        if prev is None:
            (ids, pos), draws = self._feed(jobs), [self._drawn(j) for j in jobs]
        else:
            ids, pos, draws = prev.picks[:, None], prev.pos + 1, [d + 1 for d in prev.draws]
        picks, lp = self._sample(jobs, self._decode(jobs, ids, pos).float(), draws)
        host, done = (picks, lp), None
        if self.model.device.type == "cuda":
            host = (picks.to("cpu", non_blocking=True),   # pinned copies, valid once `done` fires
                    None if lp is None else tuple(t.to("cpu", non_blocking=True) for t in lp))
            done = torch.cuda.Event()
            done.record()
        return _Step(jobs, picks, pos, draws, host, done)

    def _can_chain(self, step: "_Step") -> bool:
        """Whether the next step can be launched before `step`'s tokens are read: same batch (nobody waiting to
        join, prefilling, cancelled or at its last token), no grammar, no speculation."""
        if self.queue and len(self.active) < self.max_batch or self._drafts(step.jobs):
            return False
        if len(self.active) != len(step.jobs) or any(j.done for j in step.jobs):
            return False
        # the token `step` samples must not be a job's last (the last token is never fed: no cache slot for it)
        return all(not j.host_sampling and len(j.reply.ids) + 2 <= j.max_new_tokens for j in step.jobs)

    def _land(self, step: "_Step", events: list[Event]) -> None:
        """Read a launched step's tokens and stream them (jobs that ended meanwhile are skipped)."""
        if step.done is not None:
            step.done.synchronize()
        picks, lp = step.host
        tokens = picks.tolist()
        for job, token, record in zip(step.jobs, tokens, self._records(step.jobs, lp, tokens)):
            if not job.done:
                self._take(job, token, record, events)
                self._publish(job)

    def _prefill_groups(self) -> list[list[Job]]:
        """The jobs still in their prompt: prompts under way or starting from cached pages one by one, then new
        prompts that fit a chunk grouped shortest first into shared forwards (a burst of requests, a request's n
        choices), each group right-padded to its longest prompt as long as the padding stays small
        (PAD_SLACK, PAD_TOKENS): one forward instead of one per prompt, which at short prompts costs about the
        same."""
        groups: list[list[Job]] = []
        fresh = []
        for job in self.active:
            if job.pending is not None:
                continue
            if job.length == 0 and job.prompt_end <= self.chunk:
                fresh.append(job)
            else:
                groups.append([job])
        group: list[Job] = []
        real = 0
        for job in sorted(fresh, key=lambda j: j.prompt_end):
            size = job.prompt_end * (len(group) + 1)  # padded tokens with this job, the longest so far
            if group and (size > self.chunk or size > PAD_SLACK * (real + job.prompt_end) + PAD_TOKENS):
                groups.append(group)
                group, real = [], 0
            group.append(job)
            real += job.prompt_end
        if group:
            groups.append(group)
        return groups

    def _accept(self, jobs: list[Job], logits: torch.Tensor, events: list[Event]) -> None:
        """Sample one token for each job (row of `logits`) in one batched draw, stream its text, end the jobs that
        are done."""
        logits = self._guided(jobs, logits.float())
        failed = set()
        raw = None   # the model's own logits, for log-probabilities, when grammars mask them
        if any(j.grammar is not None for j in jobs):
            raw, logits = logits, logits.clone()
            for i, job in enumerate(jobs):
                if job.grammar is None:
                    continue
                allowed = job.grammar.allowed(logits.shape[-1], logits.device)
                if allowed is None:
                    failed.add(i)
                else:
                    logits[i].masked_fill_(~allowed, float("-inf"))
        picks, lp = self._sample(jobs, logits, [self._drawn(j) for j in jobs], raw)
        tokens = picks.tolist()
        records = self._records(jobs, lp, tokens)
        forced = [i for i, job in enumerate(jobs) if job.forced]
        for i in forced:   # a reasoning budget closes the think block: its tokens, not the sampled one
            tokens[i], records[i] = jobs[i].forced.pop(0), None
        for i, (job, token) in enumerate(zip(jobs, tokens)):
            if job.guided is not None:
                continue   # a guide takes its job's token (`_follow`)
            if i in failed:  # the grammar allows nothing more: end the reply where it is
                self._emit(job, job.reply.close("stop"), events)
            else:
                self._take(job, token, records[i], events)
            if job.guide is not None and not job.done:
                self._follow(job)
        for i in forced:   # the seen-token row holds the sampled token: rebuild it from the text fed
            if jobs[i].slot is not None:
                self.seen.reset(jobs[i].slot, jobs[i].tokens, len(jobs[i].ids))

    @staticmethod
    def _guided(jobs: list[Job], logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] (float32) with each guided job's row replaced by classifier-free guidance's mix of its
        own and its guide's log-probabilities: s·log p(x | prompt) + (1 − s)·log p(x | negative prompt), as
        exllamav2 mixes them; `logits` itself when no job is guided."""
        pairs = [(i, jobs.index(j.guide)) for i, j in enumerate(jobs) if j.guide is not None]
        if not pairs:
            return logits
        rows, guides = (torch.tensor(x, device=logits.device) for x in zip(*pairs))
        scale = torch.tensor([jobs[i].settings.cfg_scale for i, _ in pairs], device=logits.device)[:, None]
        mixed = scale * torch.log_softmax(logits[rows], -1) + (1 - scale) * torch.log_softmax(logits[guides], -1)
        out = logits.clone()
        out[rows] = mixed
        return out

    @staticmethod
    def _follow(job: Job) -> None:
        """The guide of `job` takes the job's text: its negative prompt, then the job's reply tokens; the last one
        is the token it feeds next (after a banned string's take-back too)."""
        guide = job.guide
        guide.tokens = guide.ids + job.tokens[len(job.ids):]
        guide.pending = guide.tokens[-1]
        guide.length = len(guide.tokens) - 1

    def _sample(self, jobs: list[Job], logits: torch.Tensor, draws: list[int], raw: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[tuple]]:
        """Each job's next token from its row of `logits` (float32) at stream position draws[i], noted in the
        seen-token rows, and the log-probability tensors of `raw` (the model's own logits; default `logits`) for
        the jobs that asked (`_logprob_tensors`); nothing waits for the GPU. End tokens a job may not sample yet
        are masked first (`_ban_stops`), DRY's penalties subtracted (`_dry`)."""
        settings = [j.settings for j in jobs]
        mirostat = any(s.mirostat for s in settings)
        mus = [j.mirostat_mu for j in jobs] if mirostat else None
        xtc_keep = self._xtc_keep(jobs, logits.shape[-1])
        logits = self._healed(jobs, self._ban_stops(jobs, logits, draws), draws)
        picks = sample_rows(self._dry(jobs, logits), settings, [j.seed for j in jobs],
                            draws, *self._seen_rows(jobs, logits.shape[-1]), mus=mus, xtc_keep=xtc_keep)
        if mirostat:
            for job, mu in zip(jobs, mus):
                job.mirostat_mu = mu
        self._mark_seen(jobs, picks)
        return picks, self._logprob_tensors(jobs, logits if raw is None else raw, picks)

    def _ban_stops(self, jobs: list[Job], logits: torch.Tensor, draws: list[int]) -> torch.Tensor:
        """`logits` [B, V] with the tokens row i's job may not sample at its draw draws[i] (`Job.banned`: EOS
        and stop_token_ids before min_new_tokens, EOS under ignore_eos, tokens a banned string was taken back
        from) set to -inf by one index_put on a copy; `logits` itself when no row bans any."""
        vocab = logits.shape[-1]
        return forbid(logits, [(i, t) for i, (job, d) in enumerate(zip(jobs, draws))
                               for t in job.banned(d, self.tokenizer.eos_ids) if 0 <= t < vocab])

    def _healed(self, jobs: list[Job], logits: torch.Tensor, draws: list[int]) -> torch.Tensor:
        """`logits` with every token but those a healing job's reply may begin with at -inf, in the rows of
        such jobs at their first draw; `logits` itself when there are none."""
        return only_allow(logits, [(i, j.heal[1]) for i, (j, d) in enumerate(zip(jobs, draws))
                                   if j.heal is not None and d == 0])

    def _dry(self, jobs: list[Job], logits: torch.Tensor) -> torch.Tensor:
        """`logits` with DRY's penalties subtracted for the jobs that ask, from their text so far (prompt and reply:
        `Job.tokens`); `logits` itself when none asks."""
        rows = [(i, self._history(j), j.settings, sequence_breakers(self.tokenizer, j.settings.dry_sequence_breakers))
                for i, j in enumerate(jobs) if j.settings.dry]
        return apply_dry(logits, rows) if rows else logits

    @staticmethod
    def _history(job: Job) -> torch.Tensor:
        """The job's text (`Job.tokens`) as a tensor kept up to date step by step (`dry.TokenHistory`)."""
        if job.history is None:
            job.history = TokenHistory()
        return job.history.sync(job.tokens)

    def _xtc_keep(self, jobs: list[Job], vocab: int) -> Optional[torch.Tensor]:
        """What XTC never drops, on the model's device: bool [vocab] (exllamav2's set: the tokens whose text has a
        newline, and the special tokens; made once), or [B, vocab] where a job names its own (`xtc_ignore_tokens`);
        None when no job uses XTC."""
        if not any(j.settings.xtc_probability > 0 for j in jobs):
            return None
        if self._xtc_mask is None or self._xtc_mask.shape[0] != vocab:
            newline = sequence_breakers(self.tokenizer, ("\n",))[:vocab]   # tokens whose text holds one
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[:newline.numel()] = newline
            keep[[i for i in self.tokenizer.special_ids if 0 <= i < vocab]] = True
            self._xtc_mask = keep.to(self.model.device)
        own = [(i, j.settings.xtc_ignore_tokens) for i, j in enumerate(jobs)
               if j.settings.xtc_ignore_tokens is not None]
        if not own:
            return self._xtc_mask
        rows = self._xtc_mask.expand(len(jobs), vocab).clone()
        for i, ids in own:
            rows[i] = False
            rows[i, [t for t in ids if t < vocab]] = True
        return rows

    @staticmethod
    def _logprob_tensors(jobs: list[Job], logits: torch.Tensor, picks: torch.Tensor) -> Optional[tuple]:
        """(sampled token's log-probability [B], top-k values [B, k], top-k ids [B, k]) of the model's log-softmax,
        k the most any job asked for; None when no job asked."""
        want = [j.logprobs for j in jobs]
        if all(k is None for k in want):
            return None
        lp = torch.log_softmax(logits.float(), dim=-1)
        top_v, top_i = lp.topk(max(w or 0 for w in want), dim=-1)
        return lp.gather(1, picks[:, None])[:, 0], top_v, top_i

    @staticmethod
    def _records(jobs: list[Job], tensors: Optional[tuple], tokens: list[int]) -> list[Optional[TokenLogprob]]:
        """Each job's TokenLogprob of its sampled token (None where it asked for none), from `_logprob_tensors`."""
        if tensors is None:
            return [None] * len(jobs)
        chosen, top_v, top_i = (t.tolist() for t in tensors)
        return [None if j.logprobs is None else
                TokenLogprob(t, chosen[i], list(zip(top_i[i][:j.logprobs], top_v[i][:j.logprobs])))
                for i, (j, t) in enumerate(zip(jobs, tokens))]

    def _take(self, job: Job, token: int, record: Optional[TokenLogprob], events: list[Event]) -> None:
        """Push a sampled token (and its log-probability record, unless it ended the reply) and stream it."""
        kept = len(job.reply.ids)
        text = self._push(job, token)
        if record is not None and len(job.reply.ids) > kept:
            job.token_logprobs.append(record)
        if job.budget is not None and not job.forced and job.reply.finish_reason is None:
            job.forced = job.budget.step(text, len(job.reply.ids)) or []
        self._emit(job, text, events)

    @staticmethod
    def _drawn(job: Job) -> int:
        """Tokens the job has sampled so far: the counter of its next draw."""
        return len(job.tokens) - len(job.ids)

    def _seen_rows(self, jobs: list[Job], vocab: int, extra: int = 1
                   ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """[len(jobs) · extra, vocab] rows (each job's row `extra` times) of seen tokens when any job has a
        repetition penalty, and of reply token counts when any has a frequency or presence penalty (None for what
        no job needs); gives such jobs a slot the first time."""
        rep = any(j.settings.repetition_penalty != 1.0 for j in jobs)
        cnt = any(j.settings.counts_tokens for j in jobs)
        if not (rep or cnt):
            return None, None
        if self.seen is None:
            self.seen = SeenTokens(self.max_batch, vocab, self.model.device)
        if cnt:
            self.seen.count_replies()
        for job in jobs:
            if job.slot is None and (job.settings.repetition_penalty != 1.0 or job.settings.counts_tokens):
                job.slot = self.seen.take(job.tokens)
        index = upload([j.slot or 0 for j in jobs for _ in range(extra)], torch.long, self.model.device)
        seen = self.seen.mask[index] if rep else None
        ranged = [i for i, j in enumerate(jobs) if j.settings.ranged_penalty]
        if ranged:  # their rows become strengths over their windows (such jobs never speculate: extra is 1)
            seen = seen.float()
            for i in ranged:
                s = jobs[i].settings
                seen[i] = recent_tokens(jobs[i].tokens, s.repetition_range, s.repetition_decay, vocab).to(seen.device)
        return seen, self.seen.counts[index] if cnt else None

    def _mark_seen(self, jobs: list[Job], picks: torch.Tensor) -> None:
        rows = [i for i, j in enumerate(jobs) if j.slot is not None]
        if rows:
            self.seen.add([jobs[i].slot for i in rows], picks[upload(rows, torch.long, picks.device)])

    def _push(self, job: Job, token: int) -> str:
        """Add a sampled token to a job; its new text. Sets the reply's finish reason when the job is done."""
        if not job.times[2]:
            job.times[2] = time.perf_counter()
        text = job.reply.push(token)
        job.tokens.append(token)
        job.pending = token
        if job.reply.rewind_to is not None:
            self._take_back(job)
            return text
        if job.grammar is not None and job.reply.finish_reason is None:
            job.grammar.advance(token)
            if job.grammar.finished:  # complete: no need to wait for the model's end token
                text += job.reply.close("stop")
        if job.reply.finish_reason is None and len(job.reply.ids) >= job.max_new_tokens:
            text += job.reply.close("length")
        return text

    def _take_back(self, job: Job) -> None:
        """A banned string appeared: take the reply back to the token where it began and ban that token at that
        draw (its later draws' bans belonged to text that is gone). The cache keeps the keys/values before it;
        the token before it is fed again."""
        index = job.reply.rewind_to
        token = job.reply.rewind()
        job.string_bans = {d: b for d, b in job.string_bans.items() if d <= index}
        job.string_bans.setdefault(index, set()).add(token)
        del job.tokens[len(job.ids) + index:]
        if job.history is not None:
            job.history.truncate(len(job.tokens))
        del job.token_logprobs[index:]
        job.pending = job.tokens[-1]
        job.length = len(job.tokens) - 1
        if job.slot is not None:
            self.seen.reset(job.slot, job.tokens, len(job.ids))
        if job.guide is not None:
            self._follow(job)

    def _emit(self, job: Job, text: str, events: list[Event]) -> None:
        # log-probabilities go out only for tokens no banned string can take back
        sent = job.logprobs_sent
        job.logprobs_sent = max(sent, min(len(job.token_logprobs), job.reply.confirmed))
        new = job.token_logprobs[sent:job.logprobs_sent]
        if job.reply.finish_reason is not None:
            self._finish(job)
            if self.draft is not None:
                self.draft.forget(job.id)
            events.append(Event(job, text, self._result(job), new))
        elif text or new:
            events.append(Event(job, text, None, new))

    def _result(self, job: Job) -> GenerationResult:
        r = job.reply.result(len(job.ids))
        queued, admitted, first, _ = job.times
        job.times[3] = end = time.perf_counter()
        first = first or end
        r.cached_tokens, r.draft_tokens, r.accepted_draft_tokens = job.cached_tokens, job.drafted, job.accepted
        r.time_queued, r.time_prefill, r.time_generate = admitted - queued, first - admitted, end - first
        if job.logprobs is not None:
            r.logprobs = list(job.token_logprobs)
        return r

    def _speculate(self, jobs: list[Job], events: list[Event]) -> bool:
        """Decode with drafts: feed each job's last token and k guesses in one forward (`check_guesses`), keep the
        guesses the model's own sampler agrees with, plus the model's token after them. Each position draws what
        plain decoding would draw there (same stream position, same seen tokens), so the output is plain
        decoding's, token for token. Rows whose drafter guessed fewer are padded with guesses that are checked
        all the same; a job near its end keeps no more than its reply has room for.
        False when no job has anything to guess (plain decoding then)."""
        k = self.check_guesses[next(b for b in sorted(self.check_guesses) if b >= len(jobs))]
        rooms = [j.max_new_tokens - len(j.reply.ids) - 1 for j in jobs]
        asks = []
        for job, room in zip(jobs, rooms):
            paused = self.adaptive_draft and job.spec_pause > 0
            if paused:
                job.spec_pause -= 1
            blind = job.images and not self.draft.reads_images
            asks.append(0 if paused or blind else min(k, room))
        vocab = self.model.spec.vocab_size   # a guess copied from a prompt's image tokens is no token to feed
        proposals = [list(takewhile(lambda t: 0 <= t < vocab, d))
                     for d in self.draft.propose_batch([(j.id, j.tokens, a) for j, a in zip(jobs, asks)])]
        if not any(proposals):
            return False
        dev, n = self.model.device, k + 1
        fed = [[j.pending] + (d[:a] + [(d[:a] or [j.pending])[-1]] * k)[:k]
               for j, d, a in zip(jobs, proposals, asks)]
        ids = torch.tensor(fed, dtype=torch.long, device=dev)
        pos = torch.tensor([j.length for j in jobs], dtype=torch.long, device=dev)
        table = self._table(jobs, self.spec_pages)
        shift = self._rope_shift(jobs)
        self.loras.set_rows([j.loras for j in jobs], n)
        if k in self.verify_graphs:
            logits = self.verify_graphs[k].step(ids, pos, table, lazy=True, shift=shift)
        else:
            self.cache.bind(table)
            logits = self.model(ids, self.cache, pos, fresh=False, rope_shift=shift)
        # Position i's token only counts if the guesses before it were all kept, so its draw can assume them:
        # every position is sampled at once, from the stream position plain decoding would use for it.
        rows = [j for j in jobs for _ in range(n)]
        draws = [self._drawn(j) + i for j in jobs for i in range(n)]
        seen, counts = self._seen_rows(jobs, logits.shape[-1], extra=n)
        for b, row in enumerate(fed):
            for i in range(1, n):
                if seen is not None:
                    seen[b * n + i, row[1:i + 1]] = True
                if counts is not None:
                    guessed = torch.tensor(row[1:i + 1], dtype=torch.long, device=dev)
                    counts[b * n + i].index_put_((guessed,), torch.ones(i, device=dev), accumulate=True)
        # the verify rows mask end tokens as plain decoding would at their draws (min_new_tokens, ignore_eos)
        keep = self._xtc_keep(rows, logits.shape[-1])
        flat = logits.float().reshape(len(jobs) * n, -1)
        picks = sample_rows(self._ban_stops(rows, flat, draws), [j.settings for j in rows], [j.seed for j in rows],
                            draws, seen, counts, xtc_keep=keep)
        choices = picks.view(len(jobs), n).tolist()
        for b, (job, row, room, ask) in enumerate(zip(jobs, fed, rooms, asks)):
            drafts, picked = row[1:], choices[b]
            kept = min(next((i for i, d in enumerate(drafts) if picked[i] != d), k), room)
            text = ""
            for token in picked[:kept + 1]:
                text += self._push(job, token)
                if job.reply.finish_reason is not None:
                    break
            if job.slot is not None:
                self.seen.add([job.slot] * (kept + 1), picks[b * n:b * n + kept + 1])
            guessed = len(proposals[b][:ask])
            if guessed:
                job.drafted += guessed
                job.accepted += min(kept, guessed)
                if self.adaptive_draft:
                    job.spec_kept = kept if job.spec_kept is None else 0.7 * job.spec_kept + 0.3 * kept
                    if job.spec_kept < SPEC_MIN_KEPT:   # not paying: plain steps for a while, then a fresh start
                        job.spec_pause, job.spec_kept = SPEC_PAUSE, None
            job.length += 1 + kept  # the last token and the kept guesses now hold valid cache entries
            self._publish(job)
            self._emit(job, text, events)
        return True

    # ---- conveniences --------------------------------------------------------------------------------------

    def stream(self, job: Job) -> Iterator[Event]:
        """Run one job (and whatever else is queued) to its end, yielding its events."""
        self.enqueue(job)
        try:
            while not job.done:
                for event in self.iterate():
                    if event.job is job:
                        yield event
        finally:
            if not job.done:
                self.cancel(job)

    def generate(self, jobs: Sequence[Job]) -> list[GenerationResult]:
        """Run several jobs together to their ends; their results in order."""
        results: dict[int, GenerationResult] = {}
        for job in jobs:
            self.enqueue(job)
        while any(not j.done for j in jobs):
            for event in self.iterate():
                if event.result is not None:
                    results[event.job.id] = event.result
        return [results[j.id] for j in jobs]

