"""A request to the dynamic generator (`Job`: what to generate, and the generator's bookkeeping of it) and what
it streams back (`Event`)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import AbstractSet, Optional, Sequence

from exl2.config import SamplingSettings
from exl2.generation.budget import ReasoningBudget
from exl2.generation.constraints import Grammar
from exl2.generation.output import GenerationResult, Reply, TokenLogprob
from exl2.generation.tokenizer import Tokenizer

_ids = itertools.count()


class Job:
    """One request: a prompt's token ids, how to sample and when to stop. The generator fills in the rest."""

    def __init__(self, ids: Sequence[int], settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                 stop_strings: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 grammar: Optional[Grammar] = None, logprobs: Optional[int] = None, min_new_tokens: int = 0,
                 ignore_eos: bool = False, negative_ids: Optional[Sequence[int]] = None,
                 budget: Optional[ReasoningBudget] = None, loras: Optional[tuple] = None):
        self.id = next(_ids)
        self.logprobs = logprobs         # None: off; k: each token's log-probability and the k likeliest tokens
        self.token_logprobs: list[TokenLogprob] = []
        self.logprobs_sent = 0           # records already in an Event
        self.grammar = grammar           # structured output: only tokens it allows are sampled
        self.ids = list(ids)
        self.settings = settings or SamplingSettings()
        self.max_new_tokens = max_new_tokens
        self.stop_strings, self.stop_token_ids = tuple(stop_strings), tuple(stop_token_ids)
        # vLLM's min_tokens: before this many reply tokens no end token is sampled and no stop string counts
        self.min_new_tokens = max(0, min_new_tokens)
        self.ignore_eos = ignore_eos     # the model's EOS tokens are never sampled (stop_token_ids still end it)
        # classifier-free guidance (settings.cfg_scale ≠ 1): the negative prompt (None: the BOS token alone) runs
        # as a second sequence, the job's `guide`, fed the same reply tokens; `guided` is the guide's job
        self.negative_ids = None if negative_ids is None else list(negative_ids)
        self.guide: Optional[Job] = None
        self.guided: Optional[Job] = None
        self.budget = budget             # a reasoning budget: the think block is closed after so many tokens
        # ((LoraAdapter, scaling), ...): this request's own adapters (() the base model); None: the generator's
        self.loras = None if loras is None else tuple((ad, float(s)) for ad, s in loras)
        self.images: tuple = ()          # the images.ImageTokens whose aliases the prompt holds (a vision model's)
        self.rope = None                 # M-RoPE models, prompts with images: images.mrope_positions' pair
        self.forced: list[int] = []      # tokens to feed next instead of sampling (the budget's end of the block)
        self.cached_tokens = 0           # prompt tokens found in the cache, not computed again
        self.done = False
        self.cancelled = False
        # set on admission
        self.tokens: list[int] = []      # prompt + sampled tokens (what repetition penalties look at)
        self.pages: list[int] = []
        self.length = 0                  # tokens written to the cache
        self.pending: Optional[int] = None   # sampled, not yet fed back
        self.reply: Optional[Reply] = None
        self.seed = 0                    # its random stream (settings.seed, or a fresh one)
        self.slot: Optional[int] = None  # its row of the generator's seen-token mask (repetition penalty)
        self.mirostat_mu: Optional[float] = None  # Mirostat 2.0's μ (None: the start, 2·tau)
        self.string_bans: dict[int, set[int]] = {}  # draw index -> tokens a banned string took back there
        self.history = None                  # DRY's tensor of `tokens` (dry.TokenHistory), made on first use
        # token healing: the text of the prompt token taken off, and the tokens the reply may begin with
        self.heal: Optional[tuple[str, tuple[int, ...]]] = None
        self.key: Optional[bytes] = None     # prefix key of the last full page published
        self.published = 0
        self.drafted = self.accepted = 0     # speculative decoding: guesses checked, guesses kept
        self.spec_kept: Optional[float] = None   # guesses kept a check, averaged over recent checks
        self.spec_pause = 0                      # plain steps left before drafting again (adaptive_draft)
        self.skipped = 0                     # times younger jobs were admitted past it (see DynamicGenerator)
        self.times = [0.0, 0.0, 0.0, 0.0]   # enqueued, admitted, first token, finished (time.perf_counter)

    @property
    def banned_strings(self) -> tuple[str, ...]:
        """The settings' banned strings; none with a grammar, which already decides what the text may be."""
        return (self.settings.banned_strings or ()) if self.grammar is None else ()

    @property
    def host_sampling(self) -> bool:
        """Whether sampling its next token needs the tokens before it on the host (a grammar, DRY's history,
        Mirostat's μ, a repetition penalty's window, banned strings), so its steps are never launched ahead of
        reading the last one, nor speculated. So do guided pairs and jobs with a reasoning budget (whose fed
        tokens may not be the sampled ones)."""
        s = self.settings
        return self.grammar is not None or s.dry or s.mirostat or s.ranged_penalty or bool(self.banned_strings) \
            or self.paired or self.budget is not None

    @property
    def cfg(self) -> bool:
        return self.settings.cfg_scale != 1.0

    @property
    def paired(self) -> bool:
        """One of a guided job's two sequences (classifier-free guidance)."""
        return self.guide is not None or self.guided is not None

    @property
    def prompt_end(self) -> int:
        """Prompt tokens a prefill computes: all, or for a guided pair all but the last, which a decode step feeds
        so that both sequences' first logits come out of one forward."""
        return len(self.ids) - (1 if self.paired else 0)

    @property
    def stable_tokens(self) -> int:
        """Prompt and reply tokens that can no longer be taken back (what may be offered to later prompts)."""
        return len(self.ids) + self.reply.confirmed if self.reply is not None else len(self.tokens)

    def __repr__(self) -> str:
        return f"Job({self.id}, {len(self.ids)} prompt tokens, {'done' if self.done else 'running'})"

    def banned(self, drawn: int, eos_ids: AbstractSet[int]) -> tuple[int, ...]:
        """The tokens this job may not sample as its reply's token `drawn` (0-based): end tokens before
        min_new_tokens or under ignore_eos, and tokens a banned string was taken back from there; masked rather than
        sampled and then ignored, so the reply goes on with the model's best other token."""
        ends = tuple(eos_ids) + self.stop_token_ids if drawn < self.min_new_tokens else \
            tuple(eos_ids) if self.ignore_eos else ()
        return ends + tuple(self.string_bans.get(drawn, ()))

    def new_reply(self, tokenizer: Tokenizer) -> Reply:
        """The Reply that turns this job's tokens into text (stop strings counted from min_new_tokens on)."""
        return Reply(tokenizer, self.stop_strings, self.stop_token_ids, self.min_new_tokens, self.banned_strings,
                     self.heal[0] if self.heal else "")


@dataclass
class Event:
    """New text of a job; `result` is set on its last event; `logprobs`, for a job that asked for them, the
    records of the tokens added since its previous event (text a stop string may still claim is held back, its
    tokens' records are not)."""

    job: Job
    text: str
    result: Optional[GenerationResult] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
