"""Quality of a (quantized) model: perplexity, and against a reference model the mean KL divergence KL(ref ‖ model)
and top-1 agreement of the next-token distributions on the same tokens.

With a cache mode the model reads each row in chunks through a paged KV cache of that mode, so that every chunk
after the first attends to keys/values read back from the (quantized) pages: what a quantized cache costs in
quality. One uncached forward per row (the default) never reads a cache at all."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from exl2.errors import ConfigError
from exl2.quantize.calibration import heldout_text, read_texts, rows_from_texts

DEFAULT_ROWS, DEFAULT_LENGTH = 16, 512
DEFAULT_CHUNK = 256   # tokens per forward through the cache
PAGE_SIZE = 256


@dataclass
class EvalResult:
    tokens: int                    # predicted positions
    perplexity: float
    ref_perplexity: Optional[float] = None
    kl: Optional[float] = None     # mean over positions of KL(ref ‖ model), nats
    top1: Optional[float] = None   # fraction of positions where both models' most likely token agree
    cache_mode: str = "fp16"       # the model's KV cache (the reference always runs uncached)
    chunk: Optional[int] = None    # tokens per forward through the cache; None: one uncached forward per row

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def eval_rows(tokenizer, data: Optional[str], rows: int, length: int) -> tuple[torch.Tensor, Optional[str]]:
    """Token rows of the evaluation text: a user file, or the built-in held-out text (never used for calibration)."""
    texts = read_texts(data) if data else [heldout_text()]
    return rows_from_texts(texts, tokenizer, rows, length, what="evaluation")


def _logprobs(model, ids: torch.Tensor, cache=None, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Log-probabilities of row `ids` [1, T]: one uncached forward, or with `cache` (bound to the row's pages)
    consecutive chunks of `chunk` tokens, each placed after the ones already in the cache."""
    ids = ids.to(model.device)
    with torch.no_grad():
        if cache is None:
            logits = model(ids)
        else:
            logits = torch.cat([model(ids[:, s:s + chunk], cache, s) for s in range(0, ids.shape[1], chunk)], 1)
        return torch.log_softmax(logits.float(), dim=-1)


def row_cache(model, mode: str, length: int):
    """A paged cache of `mode` for one row of `length` tokens, bound to its pages (a row overwrites the last from
    position 0). Raises ConfigError where the model cannot use the mode (head dims not a multiple of 64)."""
    from exl2.runtime.paged_cache import paged_cache_for

    pages = -(-length // PAGE_SIZE)
    cache = paged_cache_for(model, pages, PAGE_SIZE, mode)
    cache.bind(torch.arange(pages, dtype=torch.int32).view(1, -1))
    return cache


def evaluate(model, ids: torch.Tensor, ref=None, tick: Optional[Callable[[], None]] = None,
             cache_mode: Optional[str] = None, chunk: int = DEFAULT_CHUNK) -> EvalResult:
    """Evaluate `model` (a DecoderModel: ids [B, T] → logits) on rows `ids`, optionally against `ref` (always
    uncached). `cache_mode` (fp16, q8, …): feed `model` each row in chunks of `chunk` tokens through a paged cache
    of that mode; None: one uncached forward per row."""
    if chunk < 1:
        raise ConfigError(f"The chunk must be at least 1 token, not {chunk}.")
    cache = row_cache(model, cache_mode, ids.shape[1]) if cache_mode is not None else None
    nll = ref_nll = kl = 0.0
    agree = count = 0
    for r in range(ids.shape[0]):
        row = ids[r:r + 1]
        target = row[0, 1:].to(model.device)
        lp = _logprobs(model, row, cache, chunk)[0, :-1]
        nll -= float(lp.gather(1, target[:, None]).sum())
        count += target.numel()
        if ref is not None:
            lr = _logprobs(ref, row)[0, :-1].to(lp.device)
            ref_nll -= float(lr.gather(1, target[:, None]).sum())
            kl += float((lr.exp() * (lr - lp)).sum())
            agree += int((lr.argmax(-1) == lp.argmax(-1)).sum())
        if tick is not None:
            tick()
    res = EvalResult(count, math.exp(nll / max(1, count)), cache_mode=cache_mode or "fp16",
                     chunk=chunk if cache is not None else None)
    if ref is not None:
        res.ref_perplexity = math.exp(ref_nll / max(1, count))
        res.kl = kl / max(1, count)
        res.top1 = agree / max(1, count)
    return res
