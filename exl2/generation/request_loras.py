"""LoRA adapters chosen per request: requests batched together may each run with other adapters.

The generator's global adapters (`DynamicGenerator.set_loras`) apply to every job that names none. A job with
its own list (`Job.loras`: adapters and scalings; empty for the base model) runs with exactly those. Every adapter
some running job needs is attached to the model at once; before each forward, each attached adapter gets one
multiplier per token row of the batch (its scaling for the rows of jobs that use it, 0 for the others), which the
linears apply to its delta (`runtime.linear.RowScales`). An adapter stays attached while a job uses it, and
changing the attached set re-captures the decode graphs, so a steady mix of adapters costs nothing per step but
the deltas themselves.

Cached prompt pages are keyed by the adapters that computed them, so a prefix is shared only between requests
with the same adapters and scalings.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from exl2.errors import ConfigError
from exl2.runtime import lora
from exl2.runtime.lora import LoraAdapter

Choice = tuple[tuple[LoraAdapter, float], ...]


def check_choice(choice: Choice) -> None:
    """A request's adapter list must name each adapter once and none that changes MoE experts (an expert's rows
    are the tokens routed to it, which the per-row multipliers do not follow)."""
    seen: set[int] = set()
    for ad, _ in choice:
        if not isinstance(ad, LoraAdapter):
            raise ConfigError(f"A request's LoRA list takes LoraAdapter objects, not {type(ad).__name__}.")
        if id(ad) in seen:
            raise ConfigError(f"LoRA adapter {ad.name!r} is listed twice for one request.")
        seen.add(id(ad))
        if ad.targets_experts:
            raise ConfigError(f"LoRA adapter {ad.name!r} changes MoE experts, so it cannot be chosen per request; "
                              "load it for every request instead.")


def choice_key(choice: Optional[Choice]) -> Optional[bytes]:
    """The root of a job's prompt-page keys: None for the global adapters, else a digest of its own choice."""
    if choice is None:
        return None
    h = hashlib.blake2b(b"lora", digest_size=16)
    for ad, scale in choice:
        h.update(f"{id(ad)}:{ad.path}:{ad.scaling!r}:{scale!r};".encode())
    return h.digest()


class RequestLoras:
    """Which adapters are attached to the model, and the per-row multipliers of the next forward."""

    def __init__(self, model, capacity: int):
        self.model, self.capacity = model, capacity
        self.globals: list[LoraAdapter] = lora.active_loras(model)
        self.attached: list[LoraAdapter] = list(self.globals)
        self._rows_key: Optional[tuple] = None

    @property
    def per_row(self) -> bool:
        """Whether forwards scale deltas per row (some attached adapter is a job's own choice)."""
        return any(ad.rows.scales is not None for ad in self.attached)

    def set_globals(self, adapters: Sequence[LoraAdapter]) -> None:
        """The adapters of jobs that choose none (called with no job running). A ConfigError from attaching them
        (an adapter listed twice, one made for another model) changes nothing."""
        self._attach(list(adapters), [])
        self.globals = list(adapters)

    def attach(self, choices: Sequence[Optional[Choice]]) -> bool:
        """Attach the global adapters and those `choices` name (no others); True when the attached set changed
        (the caller's CUDA graphs then hold stale work)."""
        return self._attach(self.globals, choices)

    def _attach(self, globals_: list[LoraAdapter], choices: Sequence[Optional[Choice]]) -> bool:
        want = list(globals_)
        for choice in choices:
            for ad, _ in choice or ():
                if ad not in want:
                    want.append(ad)
        per_row = bool(want) and any(c is not None for c in choices)
        if want == self.attached and per_row == self.per_row:
            return False
        lora.set_loras(self.model, want)
        for ad in want:
            ad.rows.scales = None
            if per_row:
                dev = next(lw.b.device for _, lw in ad.parts)
                ad.rows.scales = torch.zeros(self.capacity, device=dev)
        for ad in self.attached:
            if ad not in want:
                ad.rows.scales = None
        self.attached, self._rows_key = want, None
        return True

    def set_rows(self, choices: Sequence[Optional[Choice]], tokens: int) -> None:
        """The multipliers for a forward over jobs with these choices (batch order), `tokens` rows each."""
        if not self.per_row:
            return
        key = (tuple(choices), tokens)     # adapters compare by identity: no hashing on the decode path
        if key == self._rows_key:
            return
        if len(choices) * tokens > self.capacity:
            raise ValueError(f"a forward of {len(choices)} x {tokens} rows is past the LoRA row capacity")
        for ad in self.attached:
            per_job = []
            for choice in choices:
                scale = 1.0 if choice is None and ad in self.globals else 0.0
                for other, s in choice or ():
                    if other is ad:
                        scale = s
                per_job.append(scale)
            values = torch.zeros(self.capacity)
            values[: len(per_job) * tokens] = torch.tensor(per_job).repeat_interleave(tokens)
            ad.rows.scales.copy_(values)
        self._rows_key = key
