"""DRY ("Don't Repeat Yourself") penalties: discourage the token that would extend a verbatim repeat of the text.

A token that, if sampled next, would continue a repeat of n ≥ allowed_length tokens loses
multiplier · base^(n − allowed_length) from its logit. Sequence breakers (punctuation, newlines, special tokens)
end a repeat, so ordinary structure such as "...\\n\\n" is never penalized.
"""
from __future__ import annotations

import re
import weakref
from array import array
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from exl2.config import SamplingSettings
    from exl2.generation.tokenizer import Tokenizer

DEFAULT_BREAKERS: tuple[str, ...] = (".", ",", "!", "?", "<", ">", "[", "]", "(", ")", "{", "}", "\n", "\t", '"')

# tokenizer -> {tuple(strings) or None: mask}; weak so a dropped model does not keep its masks alive.
_BREAKER_CACHE: "weakref.WeakKeyDictionary[Tokenizer, dict[Optional[tuple[str, ...]], torch.Tensor]]" = (
    weakref.WeakKeyDictionary()
)


def sequence_breakers(tokenizer: "Tokenizer", strings: Optional[Sequence[str]]) -> torch.Tensor:
    """bool [vocab_size] CPU mask of breaker tokens: those whose text contains any of `strings`.

    None means DEFAULT_BREAKERS plus every special token. Cached per tokenizer and string set, since every
    request with DRY asks for it.
    """
    key = None if strings is None else tuple(strings)
    per_tok = _BREAKER_CACHE.setdefault(tokenizer, {})
    mask = per_tok.get(key)
    if mask is not None:
        return mask
    texts = tokenizer.token_texts()
    subs = DEFAULT_BREAKERS if key is None else key
    if subs:
        # One alternation regex scans a 128k vocabulary far faster than a substring test per (token, string).
        pattern = re.compile("|".join(re.escape(s) for s in subs))
        flags = [pattern.search(t) is not None for t in texts]
    else:
        flags = [False] * len(texts)
    mask = torch.tensor(flags, dtype=torch.bool)
    if key is None:
        special = [i for i in tokenizer.special_ids if 0 <= i < len(flags)]
        if special:
            mask[torch.tensor(special, dtype=torch.long)] = True
    per_tok[key] = mask
    return mask


class TokenHistory:
    """A job's text as an int64 tensor that grows as tokens come, so DRY reads it without converting the whole
    token list every step (that conversion cost more than the matching)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.long)
        self.n = 0

    def sync(self, tokens: Sequence[int]) -> torch.Tensor:
        """The tensor of `tokens`, which extend what it last saw, or are shorter; a list cut short and then
        extended again between two calls needs `truncate` at the cut."""
        n = len(tokens)
        self.n = min(self.n, n)
        if n > self.buf.numel():
            grown = torch.empty(max(2 * n, 256), dtype=torch.long)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if self.n < n:
            self.buf[self.n:n] = torch.tensor(tokens[self.n:n], dtype=torch.long)
            self.n = n
        return self.buf[:n]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)


def _empty() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float32)


def dry_penalties(history: Sequence[int], breakers: torch.Tensor, multiplier: float, base: float,
                  allowed_length: int, dry_range: int = 0, max_ngram: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [n], penalties float32 [n]) to subtract from the next token's logits.

    For each earlier position j, the match length is how many of the text's last tokens (none a breaker, at most
    max_ngram) also occur right before j; the token at j gets the longest match over its positions. Ids outside
    the breaker mask count as breakers and get no penalty. One row of `_batch_penalties`.
    """
    if multiplier == 0 or breakers.numel() == 0:
        return _empty()
    _, ids, pens = _batch_penalties([(history, breakers, multiplier, base, allowed_length, dry_range, max_ngram)],
                                    breakers.numel())
    return ids, pens


# one row of DRY's input: (history, breaker mask, multiplier, base, allowed length, range, longest n-gram)
_Row = tuple[Sequence[int], torch.Tensor, float, float, int, int, int]


def _batch_penalties(rows: Sequence[_Row], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row indices, token ids, penalties) of several rows' DRY penalties at once (ids below `vocab`, sorted
    within a row): the histories right-aligned in one [B, L] tensor (padding -1, which matches nothing), then one
    pass per n-gram length over all positions, so a batch costs one set of tensor operations and a 32k-token
    history milliseconds."""
    hists, brks = [], []
    for history, breakers, _, _, _, dry_range, _ in rows:
        if not isinstance(history, torch.Tensor):
            history = list(history)  # frombuffer: several times faster than torch.tensor for long lists
            history = torch.frombuffer(array("q", history), dtype=torch.int64) if history else torch.empty(0)
        h = history.detach().to("cpu", torch.long).flatten()
        if dry_range > 0:
            h = h[-dry_range:]
        ok = (h >= 0) & (h < breakers.numel())
        hists.append(h)
        brks.append(torch.where(ok, breakers.to("cpu", torch.bool)[h.clamp(0, max(breakers.numel() - 1, 0))], True))
    L = max(h.numel() for h in hists)
    b = len(rows)
    h = torch.full((b, L), -1, dtype=torch.long)
    brk = torch.ones((b, L), dtype=torch.bool)
    for i, (hi, bi) in enumerate(zip(hists, brks)):
        if hi.numel():
            h[i, L - hi.numel():] = hi
            brk[i, L - hi.numel():] = bi
    empty = torch.empty(0, dtype=torch.long)
    if L < 2:
        return empty, empty, torch.empty(0)
    prev = h[:, :-1]                        # column m: the token before position j = m + 1
    alive = torch.ones(b, L - 1, dtype=torch.bool)
    length = torch.zeros(b, L - 1, dtype=torch.long)
    going = torch.ones(b, dtype=torch.bool)
    longest = torch.tensor([r[6] for r in rows])
    for k in range(min(int(longest.max()), L - 1)):
        going &= ~brk[:, L - 1 - k] & (k < longest)   # a breaker among the last tokens ends every match there
        alive[:, :k] = False                 # positions with nothing k tokens back
        alive[:, k:] &= (prev[:, : L - 1 - k] == h[:, L - 1 - k: L - k]) & going[:, None]
        if not alive.any():
            break
        length += alive
    allowed = torch.tensor([r[4] for r in rows])
    cand = h[:, 1:]
    hit = (length >= allowed[:, None]) & (cand >= 0) & (cand < vocab)
    r, m = hit.nonzero(as_tuple=True)
    if not r.numel():
        return empty, empty, torch.empty(0)
    keys, inverse = torch.unique(r * vocab + cand[r, m], return_inverse=True)
    best = torch.zeros(keys.numel(), dtype=torch.long).scatter_reduce_(0, inverse, length[r, m], reduce="amax",
                                                                       include_self=False)
    kr = keys // vocab
    mult = torch.tensor([row[2] for row in rows], dtype=torch.float64)[kr]
    base = torch.tensor([row[3] for row in rows], dtype=torch.float64)[kr]
    pens = mult * base.pow((best - allowed[kr]).to(torch.float64))
    return kr, keys % vocab, pens.to(torch.float32)


def apply_dry(logits: torch.Tensor,
              rows: Sequence[tuple[int, Sequence[int], "SamplingSettings", torch.Tensor]]) -> torch.Tensor:
    """logits [B, V] (any device, float) with DRY penalties subtracted: for each (row index, history, settings,
    breakers) the row's penalties (`dry_penalties`), all rows computed together on the CPU and sent to the device
    in one index_put_.

    Returns `logits` itself when nothing is penalized, else a float32 copy.
    """
    rows = [r for r in rows if r[2].dry_multiplier > 0 and r[3].numel()]
    if not rows:
        return logits
    local, ids, pens = _batch_penalties([(h, brk, s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_range,
                                          s.dry_max_ngram) for _, h, s, brk in rows], logits.shape[1])
    if not ids.numel():
        return logits
    dev = logits.device
    index = torch.tensor([r[0] for r in rows], dtype=torch.long)[local]
    out = logits.to(torch.float32, copy=True)
    out.index_put_((index.to(dev), ids.to(dev)), pens.neg().to(dev), accumulate=True)
    return out
