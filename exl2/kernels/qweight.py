"""Load-time layout of a quantized `[K, N]` matrix, shared by the EXL2 and GPTQ kernels, and its PyTorch decoder.

Rows are grouped by bit width into *width classes* (8, 6, 5, 4, 3, 2 bits, in that order). Each class is cut into
*steps* of 32 stored rows that all belong to one quantization group (a group whose row count is not a multiple of
32 is padded with rows that decode to zero and read no input). A step of a `b`-bit class is `b` int32 words per
column, laid out so that every code is a shift-and-mask of at most two words, with no code straddling words:

* `LB` "low" words hold the low `LB` bits of the codes (`LB` = 2 for 2-bit, 4 for 4/5/6-bit, 8 for 8-bit):
  row `r` of the step sits in low word `r // (32/LB)` at bit `LB·(r % (32/LB))`.
* `HB = b − LB` "high" words (0, 1 or 2) hold the remaining bits: row `r` sits in high word `r // (32/HB)` at bit
  `HB·(r % (32/HB))`.

For 2-, 4- and 8-bit classes this is exactly the on-disk EXL2/GPTQ packing. 3-bit classes instead keep each code
whole inside one 16-bit half (`THREE_BIT_FIELDS`): row `r + 16h` (`r` < 15) of a step sits in word `k`, bits
`16h + 3f`, where rows `4k..4k+3` are fields `f` = 0-3 of word `k` and row `12 + k` is its field 4; row 15 (+16)
spreads its three bits over bit 15 (+16) of words 0, 1, 2. So most codes are one shift and mask of one word (the
split 2 + 1-bit layout cost the decoders twice the instructions a byte of the 4-bit one; RESULTS.md, session 28).

Tensors:

* `qweight` int32 `[Σ steps·b, N]`: the classes one after another, step-major, then word, then column.
* `scales` fp16 `[G, N]`: effective per-(group, column) scale; `zeros` fp16 `[G, N]` or None (then the zero point
  is the class's `2^(b−1)`, EXL2's convention).
* `step_group` int32 `[S]`: the group of each step. `row_index` int32 `[S·32]`: the input feature (column of x,
  row of the natural-order weight) of each stored row, −1 for padding rows. The kernels gather x through it, so
  act-order needs no separate permutation pass.
* `x_index` int32 `[S·32]`: the same map in the order the small-batch kernels read their permuted input
  (`gather_input`): inside each 8-row block of a 4-bit class the rows come as (0, 4, 1, 5, 2, 6, 3, 7), inside
  each step of a 6/5/3/2-bit class as (0, 16, 1, 17, …, 15, 31), 8-bit classes keep the stored order, so one
  32-bit load yields the input pair that one packed-fp16 instruction needs (`PAIR_ORDER`, `PAIR_ORDER16`).

Dequantization of stored row `k'`, column `n`: `fp16((code − zero) · scale)`, one fp16 rounding, exactly as
exllamav2's reconstruct kernel (spec §1.6).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from exl2.kernels.permute import take_columns

WIDTHS = (8, 6, 5, 4, 3, 2)


def split_bits(bits: int) -> tuple[int, int]:
    """(LB, HB): low and high field widths of a `bits`-bit code in this layout. For 3 bits, (2, 1) only sizes the
    kernels' tiles (words 0-1 as the "low" words, word 2 as the "high" one); the codes are `THREE_BIT_FIELDS`."""
    if bits not in WIDTHS:
        raise ValueError(f"unsupported bit width {bits}; expected one of {WIDTHS}.")
    lb = 2 if bits <= 3 else (8 if bits == 8 else 4)
    return lb, bits - lb


@dataclass(frozen=True)
class WidthClass:
    bits: int
    first_step: int
    n_steps: int
    first_word: int  # row of `qweight` where this class starts


@dataclass
class QuantWeight:
    """A quantized linear weight repacked for the kernels (see the module docstring); y = x · W + bias."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    step_group: torch.Tensor
    row_index: torch.Tensor
    classes: tuple[WidthClass, ...]
    k: int
    n: int
    bias: torch.Tensor | None = None
    out_features: int | None = None
    x_index: torch.Tensor | None = None
    # prompt-sized matmuls through e4m3 (`fp8_prefill`, EngineConfig.prefill_fp8)
    prefill_fp8: bool = field(default=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.x_index is None:
            self.x_index = input_order(self.row_index, self.classes)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def n_steps(self) -> int:
        return self.step_group.numel()

    def class_of(self, bits: int) -> WidthClass | None:
        return next((c for c in self.classes if c.bits == bits), None)

    def scatter_index(self) -> torch.Tensor | None:
        """Inverse of `x_index` (int32 `[K]`: where natural input column c sits in the permuted input), or None
        when x_index has padding and so is not a permutation. Lets the producer of this weight's input write it
        straight in the permuted order (the attention kernel for o_proj). Cached."""
        if "scatter_index" not in self._cache:
            idx = self.x_index
            inv = None
            if idx.numel() == self.k and bool((idx >= 0).all()):
                inv = torch.empty_like(idx)
                inv[idx.long()] = torch.arange(idx.numel(), dtype=idx.dtype, device=idx.device)
            self._cache["scatter_index"] = inv
        return self._cache["scatter_index"]

    def weight_bytes(self) -> int:
        """Bytes the matmul kernels must read for the weight: packed codes, scales, zeros, maps, bias."""
        t = [self.qweight, self.scales, self.step_group, self.x_index]
        t += [x for x in (self.zeros, self.bias) if x is not None]
        return sum(x.numel() * x.element_size() for x in t)

    def to(self, device: torch.device | str) -> "QuantWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantWeight(mv(self.qweight), mv(self.scales), mv(self.zeros), mv(self.step_group),
                           mv(self.row_index), self.classes, self.k, self.n, mv(self.bias), self.out_features,
                           mv(self.x_index))


# Position p = 8j + 2i + h inside a step of a 4-bit class holds stored row 8j + i + 4h.
PAIR_ORDER = tuple(8 * (p // 8) + (p % 8) // 2 + 4 * (p % 2) for p in range(32))


# Position p of a step of a 6-, 5-, 3- or 2-bit class holds stored row p // 2 + 16 (p % 2): rows r and r + 16 sit
# at the same bits of two low words (j and j + 2, or 0 and 1) and of the high words (6-bit: words 0 and 1, bits 2r;
# 5/3-bit: bits r and r + 16 of the one high word), so one byte permute puts both under one fp16 pair.
PAIR_ORDER16 = tuple(p // 2 + 16 * (p % 2) for p in range(32))
ORDERS = {4: PAIR_ORDER, 6: PAIR_ORDER16, 5: PAIR_ORDER16, 3: PAIR_ORDER16, 2: PAIR_ORDER16}


def input_order(row_index: torch.Tensor, classes: tuple[WidthClass, ...]) -> torch.Tensor:
    """`x_index` from `row_index` (see the module docstring)."""
    out = row_index.clone()
    for c in classes:
        if c.bits in ORDERS:
            order = torch.tensor(ORDERS[c.bits], device=row_index.device)
            lo, hi = c.first_step * 32, (c.first_step + c.n_steps) * 32
            out[lo:hi] = row_index[lo:hi].view(-1, 32)[:, order].reshape(-1)
    return out


def gather_torch(x: torch.Tensor, w: "QuantWeight") -> torch.Tensor:
    """The twin of `gather_input`: `x [M, K]` → `[M, S·32]` in the kernels' input order, 0 for padding rows."""
    return take_columns(x, w.x_index)


# (word, first bit) of each whole 3-bit code of a step, rows 0-14 and 16-30; rows 15 and 31 are bit 15 (+16) of
# words 0, 1, 2 (their bits 0, 1, 2).
THREE_BIT_FIELDS = {16 * h + t: ((t // 4, 16 * h + 3 * (t % 4)) if t < 12 else (t - 12, 16 * h + 12))
                    for h in range(2) for t in range(15)}


def _encode3(codes: torch.Tensor) -> torch.Tensor:
    c = codes.view(-1, 32, codes.shape[1]).to(torch.int64)
    words = torch.zeros((c.shape[0], 3, c.shape[2]), dtype=torch.int64, device=codes.device)
    for row, (k, bit) in THREE_BIT_FIELDS.items():
        words[:, k] |= c[:, row] << bit
    for h in range(2):
        for b in range(3):
            words[:, b] |= ((c[:, 16 * h + 15] >> b) & 1) << (16 * h + 15)
    return words


def _decode3(words: torch.Tensor) -> torch.Tensor:
    w = words.view(-1, 3, words.shape[1])
    code = torch.zeros((w.shape[0], 32, w.shape[2]), dtype=torch.int32, device=words.device)
    for row, (k, bit) in THREE_BIT_FIELDS.items():
        code[:, row] = (w[:, k] >> bit) & 7
    for h in range(2):
        code[:, 16 * h + 15] = sum(((w[:, b] >> (16 * h + 15)) & 1) << b for b in range(3))
    return code


def encode_steps(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[S·32, N]` of one class → int32 words `[S·bits, N]` in this layout."""
    lb, hb = split_bits(bits)
    if bits == 3:
        words = _encode3(codes)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)
        return words.to(torch.int32).reshape(-1, codes.shape[1])
    n = codes.shape[1]
    c = codes.view(-1, 32, n).to(torch.int64)
    s = c.shape[0]
    parts = []
    for width, shift_in, count in ((lb, 0, lb), (hb, lb, hb)):
        if not width:
            continue
        per = 32 // width
        f = ((c >> shift_in) & ((1 << width) - 1)).view(s, count, per, n)
        sh = (torch.arange(per, device=codes.device, dtype=torch.int64) * width).view(1, 1, per, 1)
        parts.append((f << sh).sum(dim=2))
    words = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).reshape(s * bits, n)


def decode_steps(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `encode_steps`: int32 words `[S·bits, N]` → int32 codes `[S·32, N]`."""
    lb, hb = split_bits(bits)
    if bits == 3:
        return _decode3(words).reshape(-1, words.shape[1])
    n = words.shape[1]
    w = words.view(-1, bits, n)
    s = w.shape[0]

    def field_(ws: torch.Tensor, width: int) -> torch.Tensor:
        per = 32 // width
        sh = (torch.arange(per, device=words.device, dtype=torch.int32) * width).view(1, 1, per, 1)
        return ((ws.unsqueeze(2) >> sh) & ((1 << width) - 1)).reshape(s, 32, n)

    code = field_(w[:, :lb], lb)
    if hb:
        code = code | (field_(w[:, lb:], hb) << lb)
    return code.reshape(s * 32, n)


def build(codes: torch.Tensor, groups: list[tuple[int, int]], scales: torch.Tensor, zeros: torch.Tensor | None,
          perm: torch.Tensor | None, bias: torch.Tensor | None = None, out_features: int | None = None) -> QuantWeight:
    """Repack stored-order codes into a `QuantWeight`.

    `codes` `[K, N]` (stored row order), `groups` the (bits, rows) of each group in stored order, `scales` (and
    optional `zeros`) fp16 `[G, N]`, `perm[k']` = input feature of stored row k' (None: identity).
    """
    k, n = codes.shape
    dev = codes.device
    if sum(r for _, r in groups) != k:
        raise ValueError(f"the groups hold {sum(r for _, r in groups)} rows but the codes have {k}.")
    starts, row = [], 0
    for _, rows in groups:
        starts.append(row)
        row += rows
    perm_t = torch.arange(k, device=dev) if perm is None else perm.to(dev, torch.int64)

    words, step_group, row_index, classes = [], [], [], []
    step = word = 0
    for bits in WIDTHS:
        members = [g for g, (b, _) in enumerate(groups) if b == bits]
        if not members:
            continue
        src_parts, sg_parts = [], []
        for g in members:
            rows = groups[g][1]
            padded = -(-rows // 32) * 32
            idx = torch.arange(starts[g], starts[g] + padded, device=dev)
            src_parts.append(torch.where(idx < starts[g] + rows, idx, -1))
            sg_parts.append(torch.full((padded // 32,), g, dtype=torch.int32, device=dev))
        src = torch.cat(src_parts)
        contiguous = bool((src[1:] - src[:-1] == 1).all()) if src.numel() > 1 else True
        if contiguous and int(src[0]) >= 0:
            cls_codes = codes[int(src[0]):int(src[0]) + src.numel()]
        else:
            cls_codes = codes.index_select(0, src.clamp(min=0))
            cls_codes[src < 0] = 1 << (bits - 1)
        words.append(encode_steps(cls_codes.contiguous(), bits))
        step_group += sg_parts
        row_index.append(torch.where(src >= 0, perm_t.index_select(0, src.clamp(min=0)), -1).to(torch.int32))
        s_c = src.numel() // 32
        classes.append(WidthClass(bits, step, s_c, word))
        step += s_c
        word += s_c * bits
    return QuantWeight(
        qweight=torch.cat(words).contiguous(), scales=scales.to(dev, torch.float16).contiguous(),
        zeros=None if zeros is None else zeros.to(dev, torch.float16).contiguous(),
        step_group=torch.cat(step_group).contiguous(), row_index=torch.cat(row_index).contiguous(),
        classes=tuple(classes), k=k, n=n, bias=None if bias is None else bias.to(dev, torch.float16).contiguous(),
        out_features=out_features)


def stored_weight(w: QuantWeight) -> torch.Tensor:
    """fp16 `[S·32, N]`: the weight in stored row order, padding rows included (what the kernels decode)."""
    out = torch.empty((w.n_steps * 32, w.n), dtype=torch.float16, device=w.device)
    for c in w.classes:
        code = decode_steps(w.qweight[c.first_word:c.first_word + c.n_steps * c.bits], c.bits)
        grp = w.step_group[c.first_step:c.first_step + c.n_steps].long().repeat_interleave(32)
        zero = w.zeros.index_select(0, grp) if w.zeros is not None else float(1 << (c.bits - 1))
        out[c.first_step * 32:(c.first_step + c.n_steps) * 32] = (code.to(torch.float16) - zero) * \
            w.scales.index_select(0, grp)
    return out


def dequantize_torch(w: QuantWeight) -> torch.Tensor:
    """fp16 `[K, N]` weight in natural input order (the reference dequantizer of this layout)."""
    out = torch.zeros((w.k, w.n), dtype=torch.float16, device=w.device)
    ri = w.row_index.long()
    keep = ri >= 0
    out.index_copy_(0, ri[keep], stored_weight(w)[keep])
    return out


def matmul_torch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The twin of the quantized matmul: dequantize, then a plain matmul (fp32 on CPU, fp16 on GPU)."""
    wd = dequantize_torch(w)
    if x.is_cuda:
        y = torch.matmul(x.to(torch.float16), wd)
        if w.bias is not None:
            y = y + w.bias
    else:
        y = x.float() @ wd.float()
        if w.bias is not None:
            y = y + w.bias.float()
    return y.to(x.dtype)


# ---- shards of a weight (tensor parallelism: runtime.tp) ---------------------------------------------------------

def _derived(w: QuantWeight, **fields) -> QuantWeight:
    """A new weight of w's class with some fields replaced and an empty launch-plan cache."""
    return dataclasses.replace(w, _cache={}, **fields)


def take_outputs(w: QuantWeight, cols: torch.Tensor) -> QuantWeight:
    """The weight of the output columns `cols` (a column slice: q/k/v by head, gate/up by the features a down
    share reads), the rows and their act-order untouched."""
    c = cols.to(w.device, torch.long)
    pick = lambda t: None if t is None else t.index_select(-1, c).contiguous()  # noqa: E731
    return _derived(w, qweight=pick(w.qweight), scales=pick(w.scales), zeros=pick(w.zeros), bias=pick(w.bias),
                    n=c.numel(), out_features=None)


def step_shares(counts: list[int], part: int, parts: int) -> list[tuple[int, int]]:
    """Steps [a, b) of each width class (of `counts[i]` steps) that share `part` of `parts` holds: q or q + 1 of
    every class, the extra steps of one class going to the shares after the previous class's, so the shares'
    totals differ by one step at most."""
    out, offset = [], 0
    for n in counts:
        q, rem = divmod(n, parts)
        sizes = [q + int((r - offset) % parts < rem) for r in range(parts)]
        a = sum(sizes[:part])
        out.append((a, a + sizes[part]))
        offset = (offset + rem) % parts
    return out


def slice_steps(w: QuantWeight, part: int, parts: int) -> QuantWeight:
    """Share `part` of `parts` of w's input rows, as the kernels' split-K cuts K: an even share of the steps of
    every width class, with their rows' `row_index`/`x_index` and the scale rows their steps use. Inputs stay
    global (k unchanged), so the shares' products sum to the whole: Σ_r x·slice_steps(w, r, n) = x·W; the bias
    goes with share 0 only."""
    if not 0 <= part < parts:
        raise ValueError(f"share {part} of {parts} does not exist.")
    words, steps, classes = [], [], []
    step = word = 0
    for c, (a, b) in zip(w.classes, step_shares([c.n_steps for c in w.classes], part, parts)):
        if a == b:
            continue
        words.append(w.qweight[c.first_word + a * c.bits:c.first_word + b * c.bits])
        steps.append(torch.arange(c.first_step + a, c.first_step + b, device=w.device))
        classes.append(WidthClass(c.bits, step, b - a, word))
        step += b - a
        word += (b - a) * c.bits
    s = torch.cat(steps) if steps else torch.zeros(0, dtype=torch.long, device=w.device)
    rows = (s[:, None] * 32 + torch.arange(32, device=w.device)).reshape(-1)
    used, step_group = torch.unique(w.step_group.index_select(0, s).long(), return_inverse=True)
    qweight = torch.cat(words) if words else w.qweight[:0]
    pick = lambda t: None if t is None else t.index_select(0, used).contiguous()  # noqa: E731
    return _derived(w, qweight=qweight.contiguous(), scales=pick(w.scales), zeros=pick(w.zeros),
                    step_group=step_group.to(torch.int32).contiguous(),
                    row_index=w.row_index.index_select(0, rows).contiguous(),
                    x_index=w.x_index.index_select(0, rows).contiguous(), classes=tuple(classes),
                    bias=w.bias if part == 0 else None)


def input_features(w: QuantWeight) -> torch.Tensor:
    """The input features w's rows read (padding rows excluded), ascending: what a share of steps needs of x."""
    ri = w.row_index.long()
    return torch.sort(ri[ri >= 0]).values


def with_inputs(w: QuantWeight, features: torch.Tensor) -> QuantWeight:
    """w reading `x[..., features]` instead of x: `row_index`/`x_index` renumbered to positions in `features`,
    k = len(features). Every feature a row reads must be listed (a down share and the gate/up columns made of
    its `input_features`)."""
    f = features.to(w.device, torch.long)
    local = torch.full((w.k,), -1, dtype=torch.long, device=w.device)
    local[f] = torch.arange(f.numel(), device=w.device)

    def renumber(index: torch.Tensor) -> torch.Tensor:
        i = index.long()
        out = torch.where(i >= 0, local.index_select(0, i.clamp(min=0)), -1)
        if bool(((out < 0) & (i >= 0)).any()):
            raise ValueError("the weight reads input features outside the given ones.")
        return out.to(index.dtype).contiguous()
    return _derived(w, row_index=renumber(w.row_index), x_index=renumber(w.x_index), k=f.numel())
