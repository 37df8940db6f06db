"""Next-token sampling with the semantics of transformers' logits processors, on CPU or CUDA tensors.

Order: repetition, frequency and presence penalties, then the filters of `truncation` (temperature, top-k, top-p,
min-p and the rest), then a seeded Gumbel-max draw (argmax when greedy). On the GPU the common chain (temperature,
top-k, top-p, min-p) runs as a few fused launches (`kernels.sampling.draw`); `filter_rows` and the draw's PyTorch
twin are the CPU path, the reference, and the path of the other filters.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch

from exl2.config import SamplingSettings
from exl2.generation.truncation import NEG_INF, mirostat_update, skew_point, skewed_draw, truncate, xtc_coin
from exl2.kernels.backend import use_triton
from exl2.kernels.sampling import draw, gumbel_argmax_torch, row_keys
from exl2.runtime.upload import upload

log = logging.getLogger("exl2.sampling")
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
    """Temperature, then top-k, top-p and min-p: removed tokens become -inf. `logits` is float32 [B, V], every row
    with `settings` (`filter_rows`; greedy settings leave the logits as they are)."""
    return filter_rows(logits, [settings] * logits.shape[0])[1]


# ---- batched sampling: one set of launches for a whole decode batch -------------------------------------------
# Each row keeps its own settings and its own seeded random stream, but the whole batch is filtered with a few
# tensor operations and drawn in one launch (kernels.sampling: Gumbel-max over counter-based noise), where a
# per-row sampler took ~5 launches a row.


def fresh_seed() -> int:
    """A random 63-bit seed for a job that gave none."""
    return int(torch.randint(0, 1 << 62, (1,), generator=make_generator(None)).item())


class SeenTokens:
    """Which tokens each job has seen (prompt and sampled) for repetition penalties, and how often its reply has
    each (made when a job first asks for frequency or presence penalties), kept on the device: one row per slot,
    updated in place with a launch or two a step instead of rebuilt from the token lists."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.mask = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.counts: Optional[torch.Tensor] = None
        self.free = list(range(slots))

    def take(self, ids: Sequence[int]) -> int:
        """A free slot, set to the prompt `ids` (and no reply tokens yet)."""
        slot = self.free.pop()
        self.mask[slot].zero_()
        if self.counts is not None:
            self.counts[slot].zero_()
        ids = torch.as_tensor(list(ids), dtype=torch.long, device=self.mask.device)
        self.mask[slot, ids[(ids >= 0) & (ids < self.mask.shape[1])]] = True
        return slot

    def count_replies(self) -> None:
        """Start keeping reply token counts (slots taken before have none: their jobs did not ask)."""
        if self.counts is None:
            self.counts = torch.zeros(self.mask.shape, dtype=torch.float32, device=self.mask.device)

    def add(self, slots: Sequence[int], tokens: torch.Tensor) -> None:
        """Mark tokens[i] (int64 [len(slots)], sampled tokens: inside the vocabulary) seen by slots[i]."""
        index = upload(list(slots), torch.long, self.mask.device)
        self.mask[index, tokens] = True
        if self.counts is not None:
            self.counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def reset(self, slot: int, tokens: Sequence[int], prompt: int) -> None:
        """Set a slot again from a job's tokens (`prompt` of them the prompt's), after its reply was taken back."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.mask.device)
        ids = ids[(ids >= 0) & (ids < self.mask.shape[1])]
        self.mask[slot].zero_()
        self.mask[slot, ids] = True
        if self.counts is not None:
            self.counts[slot].zero_()
            reply = torch.as_tensor(list(tokens[prompt:]), dtype=torch.long, device=self.mask.device)
            self.counts[slot].index_put_((reply,), torch.ones_like(reply, dtype=torch.float32), accumulate=True)

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


def recent_tokens(history: Sequence[int], window: int, decay: int, vocab: int) -> torch.Tensor:
    """float32 [vocab] CPU: how strongly the repetition penalty applies to each token, from its most recent place
    in `history`: 1 within the last `window` tokens, fading linearly over the `decay` tokens before them (d tokens
    back past the window: 1 − (d + 1)/(decay + 1)), 0 for the rest."""
    out = torch.zeros(vocab, dtype=torch.float32)
    h = torch.as_tensor(list(history[-(window + decay):]), dtype=torch.long)
    if not h.numel():
        return out
    back = torch.arange(h.numel() - 1, -1, -1, dtype=torch.float32)        # 0 = the last token
    strength = torch.where(back < window, 1.0, 1.0 - (back - window + 1) / (decay + 1))
    ok = (h >= 0) & (h < vocab)
    return out.scatter_reduce_(0, h[ok], strength[ok], reduce="amax")


def apply_logit_bias(logits: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    """float32 logits with each row's `logit_bias` added (ids past the vocabulary ignored); the logits as they
    are when no row has a bias."""
    rows, cols, vals = [], [], []
    vocab = logits.shape[-1]
    for i, s in enumerate(settings):
        for token, bias in (s.logit_bias or {}).items():
            if token < vocab:
                rows.append(i)
                cols.append(token)
                vals.append(bias)
    if not rows:
        return logits
    x = logits.float().clone()
    dev = x.device
    x.index_put_((upload(rows, torch.long, dev), upload(cols, torch.long, dev)), upload(vals, torch.float32, dev),
                 accumulate=True)
    return x


def forbid(logits: torch.Tensor, cells: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`logits` with the (row, token) cells at -inf, by one index_put on a copy; `logits` itself when there are
    none."""
    if not cells:
        return logits
    rows, cols = zip(*cells)
    dev = logits.device
    return logits.index_put((upload(rows, torch.long, dev), upload(cols, torch.long, dev)),
                            logits.new_full((len(cells),), NEG_INF))


def only_allow(logits: torch.Tensor, rows: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """`logits` with every token of row i but the listed ones at -inf, for each (i, tokens); a copy, or `logits`
    itself when there are none."""
    if not rows:
        return logits
    dev = logits.device
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=dev)
    local = [k for k, (_, ts) in enumerate(rows) for _ in ts]
    cols = [t for _, ts in rows for t in ts]
    keep[upload(local, torch.long, dev), upload(cols, torch.long, dev)] = True
    index = upload([i for i, _ in rows], torch.long, dev)
    out = logits.clone()
    out[index] = out[index].masked_fill(~keep, NEG_INF)
    return out


def apply_token_lists(logits: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    """float32 logits with each row's `banned_tokens` at -inf and, where a row has `allowed_tokens`, every other
    token too (ids past the vocabulary ignored; an allowed list with none inside it restricts nothing); the
    logits as they are when no row has a list."""
    vocab = logits.shape[-1]
    banned = [(i, t) for i, s in enumerate(settings) for t in (s.banned_tokens or ()) if t < vocab]
    allowed = [(i, [t for t in s.allowed_tokens if t < vocab]) for i, s in enumerate(settings) if s.allowed_tokens]
    allowed = [(i, ts) for i, ts in allowed if ts]
    if not banned and not allowed:
        return logits
    return forbid(only_allow(logits.float(), allowed), banned)


def filter_rows(logits: torch.Tensor, settings: Sequence[SamplingSettings], seen: Optional[torch.Tensor] = None,
                counts: Optional[torch.Tensor] = None, coins: Optional[Sequence[float]] = None,
                mus: Optional[Sequence[Optional[float]]] = None, xtc_keep: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(penalized, filtered) float32 [B, V]: row i through settings[i]'s chain (repetition penalty from `seen`
    [B, V] bool or float32 strengths, frequency and presence penalties from `counts` [B, V] float32, the reply's
    token counts; then `truncation.truncate`: temperature, top-k, top-p, min-p and the other filters, with XTC's
    `coins`, Mirostat's `mus` and the tokens XTC keeps; greedy rows are left unfiltered)."""
    x = logits.float()
    dev = x.device
    pen = [s.repetition_penalty for s in settings]
    if seen is not None and any(p != 1.0 for p in pen):
        p = upload(pen, torch.float32, dev)[:, None]
        if seen.dtype != torch.bool:  # strengths (`recent_tokens`): the penalty scaled toward 1
            p = 1.0 + (p - 1.0) * seen
        x = torch.where(seen if seen.dtype == torch.bool else seen > 0, torch.where(x < 0, x * p, x / p), x)
    if counts is not None and any(s.counts_tokens for s in settings):
        fp = upload([[s.frequency_penalty, s.presence_penalty] for s in settings], torch.float32, dev)
        x = x - fp[:, :1] * counts
        x = x - torch.where(counts > 0, fp[:, 1:], 0.0)
    return x, truncate(x, settings, coins, mus, xtc_keep)


def fused_params(settings: Sequence[SamplingSettings], vocab: int) -> list[list[float]]:
    """Rows of `kernels.sampling.draw`'s params: greedy rows keep only their penalty, filters that keep every
    token (top-k ≥ the vocabulary) are off."""
    rows = []
    for s in settings:
        g = s.greedy
        rows.append([s.repetition_penalty, 1.0 if g else s.temperature,
                     float(s.top_k) if not g and 0 < s.top_k < vocab else 0.0, 1.0 if g else s.top_p,
                     0.0 if g else s.min_p, 1.0 if g else 0.0, s.frequency_penalty, s.presence_penalty])
    return rows


def _fused_draw(x: torch.Tensor, settings: Sequence[SamplingSettings], keys: torch.Tensor,
                seen: Optional[torch.Tensor], counts: Optional[torch.Tensor] = None,
                cuts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`sample_rows` through `kernels.sampling.draw`: the filters as cutoffs found without sorting, fused with the
    draw (x float32 [B, V] contiguous)."""
    rows = fused_params(settings, x.shape[1])
    params = upload(rows, torch.float32, x.device)
    return draw(x, params, keys, seen, counts, has_k=any(r[2] > 0 for r in rows),
                has_p=any(r[3] < 1.0 for r in rows), has_min_p=any(r[4] > 0 for r in rows), cuts=cuts)


_FUSED_OK: dict[torch.device, bool] = {}


def fused_ok(device: torch.device) -> bool:
    """Whether the fused kernels compile and draw the PyTorch path's tokens on this device (checked once, on a
    small batch through every filter); where they do not, sampling runs the PyTorch path."""
    ok = _FUSED_OK.get(device)
    if ok is None:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(4, 5000, generator=g) * 3).to(device)
        logits[1, ::3] = float("-inf")
        seen = (torch.rand(4, 5000, generator=g) < 0.05).to(device)
        counts = torch.randint(0, 3, (4, 5000), generator=g).float().to(device)
        settings = [SamplingSettings(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
                    SamplingSettings(temperature=1.1, top_p=0.8, frequency_penalty=0.3, presence_penalty=0.7),
                    SamplingSettings(temperature=0.0),
                    SamplingSettings(temperature=0.7, min_p=0.1, repetition_penalty=0.9)]
        keys = upload(row_keys([1, 2, 3, 4], [0, 5, 9, 2]), torch.int64, device)
        try:
            ok = torch.equal(_fused_draw(logits, settings, keys, seen, counts).cpu(),
                             _twin_draw(logits, settings, keys, seen, counts).cpu())
        except Exception:  # noqa: BLE001 - any compile or launch failure means "use the PyTorch path"
            ok = False
        if not ok:
            log.warning("The fused sampling kernels failed their check on %s; sampling runs the PyTorch path.", device)
        _FUSED_OK[device] = ok
    return ok


def _twin_draw(logits: torch.Tensor, settings: Sequence[SamplingSettings], keys: torch.Tensor,
               seen: Optional[torch.Tensor], counts: Optional[torch.Tensor] = None,
               coins: Optional[Sequence[float]] = None, mus: Optional[list[Optional[float]]] = None,
               xtc_keep: Optional[torch.Tensor] = None, fused: bool = False,
               skew_points: Optional[Sequence[Optional[float]]] = None) -> torch.Tensor:
    """`sample_rows` through `filter_rows` and the draw's PyTorch twin (`fused`: the fused draw with its filters
    off, on the filtered logits: the same noise, in a few launches instead of ~20 tensor operations over [B, V]);
    Mirostat rows' `mus` updated in place."""
    x, y = filter_rows(logits, settings, seen, counts, coins, mus, xtc_keep)
    greedy = [s.greedy for s in settings]
    if all(greedy):
        return x.argmax(dim=-1)
    if fused:  # greedy rows of y are x's rows: the draw's greedy flag takes their argmax
        plain = [[1.0, 1.0, 0.0, 1.0, 0.0, 1.0 if g else 0.0, 0.0, 0.0] for g in greedy]
        drawn = draw(y.contiguous(), upload(plain, torch.float32, y.device), keys)
    else:
        drawn = gumbel_argmax_torch(y, keys)
        if any(greedy):
            drawn = torch.where(upload(greedy, torch.bool, x.device), x.argmax(dim=-1), drawn)
    rows = [i for i, pt in enumerate(skew_points or ()) if pt is not None]
    if rows:   # skewed rows draw by their point in the sorted mass instead of the Gumbel noise
        idx = upload(rows, torch.int64, y.device)
        drawn = drawn.index_copy(0, idx, skewed_draw(y[idx], upload([skew_points[i] for i in rows], torch.float32,
                                                                     y.device)))
    if mus is not None and any(s.mirostat for s in settings):
        mus[:] = mirostat_update(y, drawn, settings, mus)
    return drawn


def sample_rows(logits: torch.Tensor, settings: Sequence[SamplingSettings], seeds: Sequence[int],
                counters: Sequence[int], seen: Optional[torch.Tensor] = None,
                counts: Optional[torch.Tensor] = None, mus: Optional[list[Optional[float]]] = None,
                xtc_keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row of `logits` [B, V], row i sampled with settings[i] (`filter_rows`, after its
    `logit_bias`) from its own stream (seeds[i], counters[i]: `kernels.sampling.row_keys`) by a Gumbel-max draw;
    `seen` [B, V] bool feeds repetition penalties (or float32 strengths in [0, 1] where a row's penalty has a
    range: `recent_tokens`), `counts` [B, V] float32 (the reply's token counts) frequency and presence penalties.
    Returns int64 [B] on the logits' device, without waiting for the GPU unless a row
    uses Mirostat: `mus` (one μ per row, None = the start) is then updated in place from the drawn token's
    probability. XTC never drops the tokens `xtc_keep` (bool [V], or [B, V] per row) marks; its choice per draw
    comes from the seed and counter (`truncation.xtc_coin`). Rows with samplers beyond temperature, top-k, top-p and min-p
    (`SamplingSettings.extended`) take the whole batch to the PyTorch path."""
    greedy = [s.greedy for s in settings]
    if seen is not None and all(s.repetition_penalty == 1.0 for s in settings):
        seen = None
    if counts is not None and not any(s.counts_tokens for s in settings):
        counts = None
    logits = apply_token_lists(apply_logit_bias(logits, settings), settings)
    if all(greedy) and seen is None and counts is None:
        return logits.float().argmax(dim=-1)
    keys = upload(row_keys(seeds, counters), torch.int64, logits.device)
    extended = any(s.extended for s in settings)
    fusable = not extended and (seen is None or seen.dtype == torch.bool)
    if fusable and use_triton(logits) and fused_ok(logits.device):
        return _fused_draw(logits.float().contiguous(), settings, keys, None if seen is None else seen.contiguous(),
                           None if counts is None else counts.float().contiguous())
    coins = [xtc_coin(sd, c) for sd, c in zip(seeds, counters)] if extended else None
    points = [skew_point(sd, c, s.skew) if s.skew and not s.greedy else None
              for s, sd, c in zip(settings, seeds, counters)]
    return _twin_draw(logits, settings, keys, seen, counts, coins, mus, xtc_keep,
                      fused=use_triton(logits) and fused_ok(logits.device), skew_points=points)
