"""Quality of a (quantized) model: perplexity, and against a reference model the mean KL divergence KL(ref ‖ model)
and top-1 agreement of the next-token distributions on the same tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from exl2.quantize.calibration import heldout_text, read_texts, rows_from_texts

DEFAULT_ROWS, DEFAULT_LENGTH = 16, 512


@dataclass
class EvalResult:
    tokens: int                    # predicted positions
    perplexity: float
    ref_perplexity: Optional[float] = None
    kl: Optional[float] = None     # mean over positions of KL(ref ‖ model), nats
    top1: Optional[float] = None   # fraction of positions where both models' most likely token agree

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def eval_rows(tokenizer, data: Optional[str], rows: int, length: int) -> tuple[torch.Tensor, Optional[str]]:
    """Token rows of the evaluation text: a user file, or the built-in held-out text (never used for calibration)."""
    texts = read_texts(data) if data else [heldout_text()]
    return rows_from_texts(texts, tokenizer, rows, length, what="evaluation")


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids.to(model.device)).float(), dim=-1)


def evaluate(model, ids: torch.Tensor, ref=None, tick: Optional[Callable[[], None]] = None) -> EvalResult:
    """Evaluate `model` (a DecoderModel: ids [B, T] → logits) on rows `ids`, optionally against `ref`."""
    nll = ref_nll = kl = 0.0
    agree = count = 0
    for r in range(ids.shape[0]):
        row = ids[r:r + 1]
        target = row[0, 1:].to(model.device)
        lp = _logprobs(model, row)[0, :-1]
        nll -= float(lp.gather(1, target[:, None]).sum())
        count += target.numel()
        if ref is not None:
            lr = _logprobs(ref, row)[0, :-1].to(lp.device)
            ref_nll -= float(lr.gather(1, target[:, None]).sum())
            kl += float((lr.exp() * (lr - lp)).sum())
            agree += int((lr.argmax(-1) == lp.argmax(-1)).sum())
        if tick is not None:
            tick()
    res = EvalResult(count, math.exp(nll / max(1, count)))
    if ref is not None:
        res.ref_perplexity = math.exp(ref_nll / max(1, count))
        res.kl = kl / max(1, count)
        res.top1 = agree / max(1, count)
    return res
