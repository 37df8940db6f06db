"""Next-token sampling with the semantics of transformers' logits processors, on CPU or CUDA tensors.

Order: repetition penalty, temperature, top-k, top-p, min-p, then a seeded multinomial draw (argmax when greedy).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from exl2.config import SamplingSettings

PastIds = Union[torch.Tensor, Sequence[Sequence[int]], None]


def make_generator(seed: Optional[int], device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed` (a random seed when None)."""
    gen = torch.Generator(device=torch.device(device))
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def _seen_mask(past_ids: PastIds, batch: int, vocab: int, device: torch.device) -> Optional[torch.Tensor]:
    """[B, V] bool: which tokens each row has already seen; negative ids (padding) and ids >= V are ignored."""
    if past_ids is None:
        return None
    if isinstance(past_ids, torch.Tensor):
        ids = past_ids.to(device=device, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0).expand(batch, -1)
        # Invalid ids land in a spare last column that is cut off afterwards.
        ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
        mask = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
        mask.scatter_(1, ids, True)
        return mask[:, :vocab]
    mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    if len(past_ids) != batch:
        raise ValueError(f"past_ids has {len(past_ids)} rows for a batch of {batch}")
    for row, seq in enumerate(past_ids):
        ids = torch.as_tensor(list(seq), dtype=torch.long, device=device)
        ids = ids[(ids >= 0) & (ids < vocab)]
        if ids.numel():
            mask[row, ids] = True
    return mask


def apply_repetition_penalty(logits: torch.Tensor, penalty: float, past_ids: PastIds) -> torch.Tensor:
    """HF semantics: seen tokens' positive logits are divided by the penalty, negative ones multiplied."""
    if penalty == 1.0 or past_ids is None:
        return logits
    seen = _seen_mask(past_ids, logits.shape[0], logits.shape[1], logits.device)
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: removed tokens become -inf. `logits` is float32 [B, V]."""
    neg_inf = float("-inf")
    if settings.temperature not in (0.0, 1.0):
        logits = logits / settings.temperature
    vocab = logits.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if settings.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - settings.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if settings.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = settings.min_p * probs.max(dim=-1, keepdim=True).values
        drop = probs < threshold
        drop.scatter_(-1, logits.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(drop, neg_inf)
    return logits


def sample(logits: torch.Tensor, settings: SamplingSettings, generator: Optional[torch.Generator] = None,
           past_ids: PastIds = None) -> torch.Tensor:
    """One token id per row of `logits` [B, V] -> int64 [B] on the same device."""
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    x = logits.float()
    x = apply_repetition_penalty(x, settings.repetition_penalty, past_ids)
    if settings.greedy:
        return x.argmax(dim=-1)
    x = filter_logits(x, settings)
    probs = x.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
