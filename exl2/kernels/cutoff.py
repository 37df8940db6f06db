"""Top-k and top-p cutoffs without sorting: a radix search over order keys of the logits, 4 bits a pass.

Row b keeps the tokens with y ≥ its top-k cutoff (the k-th largest y) and y ≥ its top-p cutoff (the largest t with
mass(y ≥ t) ≥ p · mass of the tokens top-k keeps), which are the tokens transformers' TopK and TopP warpers keep,
ties at the cut aside. Both cutoffs are the largest t with F(t) ≥ target for a non-increasing F (a count, a mass),
so both are found the same way over a 32-bit key of y whose integer order is the float order: each pass sorts the
tokens whose key starts with the bits found so far into 16 bins by their next 4 bits and sums F over each bin, in
parallel over chunks of the row; the next pass's programs each read the previous pass's partial bins and pick the
digit. Eight passes over the row find the exact key; they replace a sort of it, which with its cumsum and scatter
took 0.6-0.7 ms a step for 16 x 128,256 logits on an H100 (benchmarks/RESULTS.md, session 21).

The prep kernel writes y (`logit`: the penalties, then the temperature) once for the passes and the draw; the
filtered logits are never written. A pass skips the binning of blocks that hold no token of its interval (most
blocks after the first passes). The kernels are compiled without FMA contraction, so x - f · c rounds as PyTorch's
separate multiply and subtract do in the PyTorch path.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import tl, triton

NB = 16  # bins a pass: 4 bits
PASSES = 8  # 32-bit keys


@triton.jit
def logit(x_ptr, seen_ptr, cnt_ptr, par_ptr, row, idx, ok, V, HAS_SEEN: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """y for tokens idx of a row (-inf where not ok): the repetition penalty on seen tokens, then the frequency
    and presence penalties on the reply's token counts, then the temperature (params row: penalty, temperature,
    ..., frequency, presence), with the same IEEE operations as `sampler.filter_rows`, so the kernels see its
    values bit for bit."""
    base = row.to(tl.int64) * V
    x = tl.load(x_ptr + base + idx, mask=ok, other=-float("inf"))
    if HAS_SEEN:
        penalty = tl.load(par_ptr + row * 8)
        s = tl.load(seen_ptr + base + idx, mask=ok, other=0)
        x = tl.where(s != 0, tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty)), x)
    if HAS_COUNTS:
        c = tl.load(cnt_ptr + base + idx, mask=ok, other=0.0)
        x = x - tl.load(par_ptr + row * 8 + 6) * c
        x = x - tl.where(c > 0, tl.load(par_ptr + row * 8 + 7), 0.0)
    return tl.math.div_rn(x, tl.load(par_ptr + row * 8 + 1))


@triton.jit
def order_key(y):
    """int32 whose signed order is y's float order (negative floats' magnitude bits flipped)."""
    b = y.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def order_key_torch(y: torch.Tensor) -> torch.Tensor:
    """Twin of `order_key` (float32 → int32)."""
    b = y.float().contiguous().view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _nibble_value(d, step):
    """The key bits of digit d found by pass `step` (the first pass's bins run from the most negative keys, so its
    digit's top bit is the sign bit flipped)."""
    top = d ^ 8
    return tl.where(step == 0, tl.where(top >= 8, top - 16, top) * 268435456, d << (28 - 4 * step))


@triton.jit
def resolve(hist_ptr, sti_ptr, stf_ptr, row, B, P, step, top_p, MASS: tl.constexpr, PP: tl.constexpr):
    """(prefix, above, target) after `step` ≥ 1 passes: the key bits found, F of the keys above the interval they
    leave, and the target (for a mass search, set at step 1: p times the first pass's total)."""
    prev = step - 1
    p_idx = tl.arange(0, PP)
    d_idx = tl.arange(0, 16)
    base = (prev * B + row).to(tl.int64) * P * 16
    parts = tl.load(hist_ptr + base + p_idx[:, None] * 16 + d_idx[None, :], mask=(p_idx < P)[:, None], other=0.0)
    bins = tl.sum(parts, axis=0)
    prefix = tl.load(sti_ptr + prev * B + row)
    above = tl.load(stf_ptr + (prev * B + row) * 2)
    target = tl.load(stf_ptr + (prev * B + row) * 2 + 1)
    if MASS:
        if prev == 0:
            target = top_p * tl.sum(bins, axis=0)
    # F(d) = above + sum of bins ≥ d, each sum over the same order with zeros for the rest: float addition is
    # monotone, so F stays non-increasing in d and the count of d with F(d) ≥ target is one past the digit.
    ge = d_idx[None, :] >= d_idx[:, None]
    f = above + tl.sum(tl.where(ge, bins[None, :], 0.0), axis=1)
    digit = tl.maximum(tl.sum((f >= target).to(tl.int32), axis=0) - 1, 0)
    above = above + tl.sum(tl.where(d_idx > digit, bins, 0.0), axis=0)
    return prefix + _nibble_value(digit, prev), above, target


@triton.jit
def final_key(hist_ptr, sti_ptr, stf_ptr, row, B, P, top_p, MASS: tl.constexpr, PP: tl.constexpr):
    """The cutoff's key once all passes have run."""
    prefix, _, _ = resolve(hist_ptr, sti_ptr, stf_ptr, row, B, P, 8, top_p, MASS, PP)
    return prefix


@triton.jit
def row_max(pmax_ptr, row, P, PP: tl.constexpr):
    p_idx = tl.arange(0, PP)
    return tl.max(tl.load(pmax_ptr + row * P + p_idx, mask=p_idx < P, other=-float("inf")), axis=0)


@triton.jit
def _prep_kernel(x_ptr, seen_ptr, cnt_ptr, par_ptr, y_ptr, pmax_ptr, V, P, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_SEEN: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """y (`logit`) written once for the searches and the draw to read, and each chunk's maximum."""
    row = tl.program_id(0)
    pid = tl.program_id(1)
    best = tl.full([BLOCK], -float("inf"), tl.float32)
    for start in range(pid * CHUNK, pid * CHUNK + CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        y = logit(x_ptr, seen_ptr, cnt_ptr, par_ptr, row, idx, idx < V, V, HAS_SEEN, HAS_COUNTS)
        tl.store(y_ptr + row.to(tl.int64) * V + idx, y, mask=idx < V)
        best = tl.maximum(best, y)
    tl.store(pmax_ptr + row * P + pid, tl.max(best, axis=0))


@triton.jit
def _pass_kernel(y_ptr, par_ptr, pmax_ptr, hist_ptr, sti_ptr, stf_ptr, khist_ptr, ksti_ptr, kstf_ptr,
                 V, B, P, step, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PP: tl.constexpr, MASS: tl.constexpr,
                 AFTER_K: tl.constexpr):
    """Pass `step` of a cutoff search over y (MASS: top-p's, weights exp(y - max) over the tokens top-k keeps;
    else top-k's, weights 1)."""
    row = tl.program_id(0)
    pid = tl.program_id(1)
    top_k = tl.load(par_ptr + row * 8 + 2)
    top_p = tl.load(par_ptr + row * 8 + 3)
    if MASS:
        active = top_p < 1.0
        target0 = 0.0
    else:
        active = top_k > 0.0
        target0 = top_k
    if step == 0:
        prefix = 0
        above = 0.0
        target = target0
    else:
        prefix, above, target = resolve(hist_ptr, sti_ptr, stf_ptr, row, B, P, step, top_p, MASS, PP)
    if pid == 0:
        tl.store(sti_ptr + step * B + row, prefix)
        tl.store(stf_ptr + (step * B + row) * 2, above)
        tl.store(stf_ptr + (step * B + row) * 2 + 1, target)
    m = 0.0
    if MASS:
        m = row_max(pmax_ptr, row, P, PP)
    key_k = -2147483647 - 1
    if AFTER_K:
        if top_k > 0.0:
            key_k = final_key(khist_ptr, ksti_ptr, kstf_ptr, row, B, P, top_p, False, PP)
    limit = tl.where(active, V, 0)  # inactive rows read nothing
    shift = 28 - 4 * step
    high = 32 - 4 * step  # bits kept by the interval test (step ≥ 1)
    d_idx = tl.arange(0, 16)
    acc = tl.zeros([BLOCK, 16], tl.float32)  # reduced once after the loop, not once a block
    for start in range(pid * CHUNK, pid * CHUNK + CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < limit
        y = tl.load(y_ptr + row.to(tl.int64) * V + idx, mask=ok, other=-float("inf"))
        key = order_key(y)
        inside = ok & (key >= key_k)
        if step > 0:
            inside = inside & ((key >> high) == (prefix >> high))
        # After the first passes the interval is narrow and most blocks hold none of it: skip their binning.
        if tl.max(inside.to(tl.int32), axis=0) > 0:
            digit = (key >> shift) & 15
            if step == 0:
                digit = digit ^ 8
            if MASS:
                w = tl.where(inside, tl.exp(y - m), 0.0)
            else:
                w = inside.to(tl.float32)
            acc += tl.where(digit[:, None] == d_idx[None, :], w[:, None], 0.0)
    tl.store(hist_ptr + ((step * B + row).to(tl.int64) * P + pid) * 16 + d_idx, tl.sum(acc, axis=0))


class Cutoffs:
    """The searches' buffers for one batch shape (y, chunk maxima, partial bins, resolved states); `run` fills
    them, the draw kernel reads y and the keys from them. Kept between calls of the same shape (`for_shape`), so a
    decode step allocates nothing."""

    def __init__(self, b: int, v: int, p: int, device: torch.device):
        self.y = torch.empty(b, v, dtype=torch.float32, device=device)
        self.pmax = torch.empty(b, p, dtype=torch.float32, device=device)
        self.hist = torch.empty(2, PASSES, b, p, NB, dtype=torch.float32, device=device)
        self.sti = torch.empty(2, PASSES, b, dtype=torch.int32, device=device)
        self.stf = torch.empty(2, PASSES, b, 2, dtype=torch.float32, device=device)
        self.val = torch.empty(b, p, dtype=torch.float32, device=device)
        self.arg = torch.empty(b, p, dtype=torch.int32, device=device)
        self.cuts = torch.empty(b, dtype=torch.int32, device=device)

    @classmethod
    def for_shape(cls, b: int, v: int, p: int, device: torch.device) -> "Cutoffs":
        key = (device, b, v, p)
        ws = _WORKSPACES.pop(key, None) or cls(b, v, p, device)
        _WORKSPACES[key] = ws  # most recent last
        while len(_WORKSPACES) > 8:
            _WORKSPACES.pop(next(iter(_WORKSPACES)))
        return ws

    def run(self, x: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: torch.Tensor, chunk: int,
            block: int, pp: int, has_seen: bool, has_counts: bool, has_k: bool, has_p: bool) -> None:
        """y and the row maxima, then the top-k search, then top-p's."""
        b, p = self.pmax.shape
        v = x.shape[1]
        _prep_kernel[(b, p)](x, seen, counts, params, self.y, self.pmax, v, p, CHUNK=chunk, BLOCK=block,
                             HAS_SEEN=has_seen, HAS_COUNTS=has_counts, num_warps=4, enable_fp_fusion=False)
        for mass, on in ((0, has_k), (1, has_p)):
            if not on:
                continue
            for step in range(PASSES):
                _pass_kernel[(b, p)](self.y, params, self.pmax, self.hist[mass], self.sti[mass], self.stf[mass],
                                     self.hist[0], self.sti[0], self.stf[0], v, b, p, step, CHUNK=chunk,
                                     BLOCK=block, PP=pp, MASS=bool(mass), AFTER_K=bool(mass) and has_k, num_warps=4)


_WORKSPACES: dict[tuple, Cutoffs] = {}
