"""EXL2 tensor format: parse, unpack, dequantize and pack one quantized linear layer (spec EXL2.md §1).

Pure tensor code, device-agnostic, no runtime knowledge. Matrices are `[K, N]` (input features × output features);
"stored order" is the act-order permuted row order of the file, "natural order" is `W = Wstored[q_invperm]`.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from exl2.errors import FormatError

WIDTHS = (8, 6, 5, 4, 3, 2)
LAYER_KEYS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
_MAX_K = 65536  # exllamav2 reads permutations as uint16
_MAX_PACKED_OFFSET = 32767  # q_groups is int16
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass
class Exl2Group:
    """One group of a layer, in stored order: its width, packed-row range in q_weight and weight-row range."""

    bits: int
    packed_start: int
    packed_end: int
    row_start: int
    rows: int


def _unit(bits: int) -> tuple[int, int]:
    """(rows, int32 words) of the smallest bit-stream chunk that ends on a word boundary."""
    rows = 32 // math.gcd(32, bits)
    return rows, rows * bits // 32


def parse_groups(q_groups: torch.Tensor, q_weight_rows: int, prefix: str) -> list[Exl2Group]:
    """Decode `q_groups` (pairs of width, first packed row) into groups, rejecting anything the format forbids."""
    if q_groups.dim() != 1 or q_groups.numel() < 2 or q_groups.numel() % 2:
        raise FormatError(f"EXL2 layer {prefix}: q_groups must be a non-empty 1-D tensor of (bits, offset) pairs, "
                          f"got shape {list(q_groups.shape)}.")
    pairs = q_groups.to("cpu", torch.int64).view(-1, 2).tolist()
    groups: list[Exl2Group] = []
    row = 0
    for g, (bits, start) in enumerate(pairs):
        end = pairs[g + 1][1] if g + 1 < len(pairs) else q_weight_rows
        if bits not in WIDTHS:
            raise FormatError(f"EXL2 layer {prefix}: group {g} has bit width {bits}, expected one of 2, 3, 4, 5, 6, 8.")
        if g == 0 and start != 0:
            raise FormatError(f"EXL2 layer {prefix}: the first group starts at packed row {start} instead of 0.")
        if g > 0 and bits > groups[-1].bits:
            raise FormatError(f"EXL2 layer {prefix}: group {g} ({bits}-bit) follows a {groups[-1].bits}-bit group, "
                              f"but widths must be in descending order.")
        if not start < end <= q_weight_rows:
            raise FormatError(f"EXL2 layer {prefix}: group {g} spans packed rows {start}..{end}, which is empty or "
                              f"outside q_weight's {q_weight_rows} rows.")
        if (end - start) * 32 % bits:
            raise FormatError(f"EXL2 layer {prefix}: group {g} has {end - start} packed rows, not a whole number of "
                              f"{bits}-bit weight rows.")
        rows = (end - start) * 32 // bits
        groups.append(Exl2Group(bits, start, end, row, rows))
        row += rows
    return groups


def _runs(groups: Sequence[Exl2Group]) -> list[Exl2Group]:
    """Merge consecutive groups of one width into contiguous runs (one vectorized decode per width)."""
    runs: list[Exl2Group] = []
    for g in groups:
        last = runs[-1] if runs else None
        if last and last.bits == g.bits and last.packed_end == g.packed_start and last.row_start + last.rows == g.row_start:
            runs[-1] = Exl2Group(g.bits, last.packed_start, g.packed_end, last.row_start, last.rows + g.rows)
        else:
            runs.append(Exl2Group(g.bits, g.packed_start, g.packed_end, g.row_start, g.rows))
    return runs


def _decode_run(words: torch.Tensor, bits: int, out: torch.Tensor, use_bytes: bool = _LITTLE_ENDIAN) -> None:
    """Decode contiguous int32 packed rows `[P, N]` of one width into codes `out` `[P·32/bits, N]` (§1.4).

    `out` may be uint8 or int16. The byte path reads each word's bytes (a code spans at most two bytes since
    b ≤ 8), a quarter of the memory traffic of int32 arithmetic; the int32 path is the big-endian fallback.
    """
    n = words.shape[1]
    unit_rows, unit_words = _unit(bits)
    dst = out.view(-1, unit_rows, n)
    if use_bytes:
        by = words.view(torch.uint8).view(-1, unit_words, n, 4)
        for r in range(unit_rows):
            t, s = divmod(r * bits, 8)
            lo = by[:, t // 4, :, t % 4]
            if s + bits <= 8:
                part = lo >> s if s else lo
            else:  # uint8 shifts wrap, which drops exactly the bits above this code
                hi = by[:, (t + 1) // 4, :, (t + 1) % 4]
                part = (lo >> s) | (hi << (8 - s))
            if s + bits == 8:
                dst[:, r].copy_(part)
            else:
                torch.bitwise_and(part, (1 << bits) - 1, out=dst[:, r])
        return
    u = words.view(-1, unit_words, n)
    for r in range(unit_rows):
        w, s = divmod(r * bits, 32)
        low_bits = min(bits, 32 - s)
        code = (u[:, w] >> s) & ((1 << low_bits) - 1)
        if low_bits < bits:  # straddles two words: the high part comes from the next word's low bits
            code |= (u[:, w + 1] & ((1 << (bits - low_bits)) - 1)) << low_bits
        dst[:, r] = code


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    if words.dtype == torch.int32:
        return words.contiguous()
    if words.dtype == torch.uint32:
        return words.contiguous().view(torch.int32)
    return words.to(torch.int32).contiguous()


def _decode(q_weight: torch.Tensor, groups: list[Exl2Group], dtype: torch.dtype) -> torch.Tensor:
    k = sum(g.rows for g in groups)
    out = torch.empty((k, q_weight.shape[1]), dtype=dtype, device=q_weight.device)
    for run in _runs(groups):
        _decode_run(_as_int32(q_weight[run.packed_start:run.packed_end]), run.bits,
                    out[run.row_start:run.row_start + run.rows])
    return out


def unpack_codes(q_weight: torch.Tensor, groups: list[Exl2Group]) -> torch.Tensor:
    """Integer codes `[K, N]` (uint8, 0 … 2^b−1) in stored row order."""
    return _decode(q_weight, groups, torch.uint8)


def unpack_scale_codes(q_scale: torch.Tensor, n: int) -> torch.Tensor:
    """Scale indices `[G, N]` (uint8, 1 … 16): stored nibbles plus one (§1.5)."""
    if q_scale.dim() != 2 or q_scale.shape[1] * 8 != n:
        raise FormatError(f"q_scale has shape {list(q_scale.shape)}, expected [groups, {n // 8}] for {n} columns.")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q_scale.device)
    nib = (q_scale.to(torch.int32).unsqueeze(2) >> shifts.view(1, 1, -1)) & 15
    return (nib + 1).to(torch.uint8).view(q_scale.shape[0], n)


def unpack_scales(q_scale: torch.Tensor, q_scale_max: torch.Tensor, n: int, prescale: float = 1.0) -> torch.Tensor:
    """Effective fp16 scales `[G, N]`: `S = fp16((nib+1)² · fp16(M·prescale/256))`, bit exact with exllamav2.

    `prescale` is the model-level factor exllamav2 folds in at load (spec §1.5); a file reader uses 1."""
    codes = unpack_scale_codes(q_scale, n)
    if q_scale_max.shape != (q_scale.shape[0],):
        raise FormatError(f"q_scale_max has shape {list(q_scale_max.shape)}, expected [{q_scale.shape[0]}].")
    # Both products are exact in fp32 (scaling by 2^-8; 9-bit × 11-bit mantissas), so one fp16 rounding each.
    m = (q_scale_max.to(torch.float32) * prescale / 256).to(torch.float16)
    sq = codes.to(torch.float32).square()
    return (sq * m.to(torch.float32).unsqueeze(1)).to(torch.float16)


def _get(tensors: Mapping[str, torch.Tensor] | Any, prefix: str, key: str) -> torch.Tensor:
    name = f"{prefix}.{key}"
    if name not in tensors:
        raise FormatError(f"EXL2 layer {prefix} has no {key} tensor.")
    return tensors[name]


def read_layer(tensors: Mapping[str, torch.Tensor] | Any, prefix: str, prescale: float = 1.0):
    """Load and cross-check the five tensors of a layer; returns (q_weight, groups, S [G, N] fp16, q_invperm)."""
    q_weight, q_scale, q_scale_max, q_groups, q_invperm = (_get(tensors, prefix, k) for k in LAYER_KEYS)
    if q_weight.dim() != 2 or q_weight.dtype not in (torch.int32, torch.uint32):
        raise FormatError(f"EXL2 layer {prefix}: q_weight must be a 2-D int32 tensor, got {q_weight.dtype} "
                          f"{list(q_weight.shape)}.")
    groups = parse_groups(q_groups, q_weight.shape[0], prefix)
    n = q_weight.shape[1]
    k = sum(g.rows for g in groups)
    if q_scale.dim() != 2 or tuple(q_scale.shape) != (len(groups), n // 8) or n % 8:
        raise FormatError(f"EXL2 layer {prefix}: q_scale has shape {list(q_scale.shape)}, expected "
                          f"[{len(groups)}, {n / 8:g}] for {len(groups)} groups and {n} columns.")
    if tuple(q_scale_max.shape) != (len(groups),):
        raise FormatError(f"EXL2 layer {prefix}: q_scale_max has shape {list(q_scale_max.shape)}, expected "
                          f"[{len(groups)}].")
    if tuple(q_invperm.shape) != (k,):
        raise FormatError(f"EXL2 layer {prefix}: q_invperm has shape {list(q_invperm.shape)}, but the groups hold "
                          f"{k} rows.")
    inv = q_invperm.to(torch.int64)
    if k and (inv.min() < 0 or inv.max() >= k or torch.bincount(inv, minlength=k).ne(1).any()):
        raise FormatError(f"EXL2 layer {prefix}: q_invperm is not a permutation of 0..{k - 1}.")
    scales = unpack_scales(q_scale, q_scale_max, n, prescale)
    return q_weight, groups, scales, inv


def _dequant_stored(q_weight: torch.Tensor, groups: list[Exl2Group], scales: torch.Tensor) -> torch.Tensor:
    # Decode into int16 and set the fp16 exponent bits 0x6400: each element then reads as exactly 1024 + code.
    w = _decode(q_weight, groups, torch.int16)
    w |= 0x6400
    w = w.view(torch.float16)
    for run in _runs(groups):
        w[run.row_start:run.row_start + run.rows] -= 1024 + (1 << (run.bits - 1))
    # (code − zero) is an exact small integer; one fp16 rounding of its product, like exllamav2's __hmul.
    for g, grp in enumerate(groups):
        w[grp.row_start:grp.row_start + grp.rows] *= scales[g]
    return w


def dequantize_stored(tensors: Mapping[str, torch.Tensor] | Any, prefix: str) -> torch.Tensor:
    """fp16 `[K, N]` weight in stored (act-order permuted) row order."""
    q_weight, groups, scales, _ = read_layer(tensors, prefix)
    return _dequant_stored(q_weight, groups, scales)


def dequantize(tensors: Mapping[str, torch.Tensor] | Any, prefix: str) -> torch.Tensor:
    """fp16 `[K, N]` weight in natural input order (`Wstored[q_invperm]`), bit-identical to exllamav2's reconstruct.

    N is the stored (32-padded) width; slice columns for the true output width.
    """
    q_weight, groups, scales, inv = read_layer(tensors, prefix)
    w = _dequant_stored(q_weight, groups, scales)
    return w.index_select(0, inv.to(w.device))


def _wrap_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns → int32 with the same bits."""
    return (((x + (1 << 31)) % (1 << 32)) - (1 << 31)).to(torch.int32)


def _encode_run(codes: torch.Tensor, bits: int, use_bytes: bool = _LITTLE_ENDIAN) -> torch.Tensor:
    """Inverse of `_decode_run`: uint8 codes `[R, N]` (already range-checked) → int32 packed rows `[R·bits/32, N]`."""
    unit_rows, unit_words = _unit(bits)
    n = codes.shape[1]
    u = codes.view(-1, unit_rows, n)
    if use_bytes:
        by = torch.zeros((u.shape[0], unit_words, n, 4), dtype=torch.uint8, device=codes.device)
        for r in range(unit_rows):
            t, s = divmod(r * bits, 8)
            by[:, t // 4, :, t % 4] |= u[:, r] << s  # uint8 shift wraps: keeps the bits that fit this byte
            if s + bits > 8:
                by[:, (t + 1) // 4, :, (t + 1) % 4] |= u[:, r] >> (8 - s)
        return by.view(torch.int32).view(-1, n)
    u = u.to(torch.int64)
    words = torch.zeros((u.shape[0], unit_words, n), dtype=torch.int64, device=codes.device)
    for r in range(unit_rows):
        w, s = divmod(r * bits, 32)
        words[:, w] |= (u[:, r] << s) & 0xFFFFFFFF
        if s + bits > 32:
            words[:, w + 1] |= u[:, r] >> (32 - s)
    return _wrap_int32(words.view(-1, n))


def _check_groups(groups: Sequence[tuple[int, int]], k: int) -> None:
    if not groups:
        raise ValueError("pack needs at least one group.")
    prev = 99
    for g, (bits, rows) in enumerate(groups):
        if bits not in WIDTHS:
            raise ValueError(f"group {g} has bit width {bits}, expected one of 2, 3, 4, 5, 6, 8.")
        if bits > prev:
            raise ValueError(f"group {g} ({bits}-bit) follows a {prev}-bit group; widths must be descending.")
        if rows <= 0 or rows * bits % 32:
            raise ValueError(f"group {g} has {rows} rows of {bits} bits, which is not a whole number of int32 words.")
        prev = bits
    if sum(r for _, r in groups) != k:
        raise ValueError(f"the groups hold {sum(r for _, r in groups)} rows but the codes have {k}.")
    for bits in {b for b, _ in groups}:
        class_rows = sum(r for b, r in groups if b == bits)
        step = 16 if bits == 2 else 32
        if class_rows % step:
            raise ValueError(f"the {bits}-bit groups hold {class_rows} rows, not a multiple of {step} as the "
                             f"exllamav2 kernels require.")


def pack(codes: torch.Tensor, groups: list[tuple[int, int]], scale_codes: torch.Tensor, scale_max: torch.Tensor,
         perm: torch.Tensor, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Build the on-disk tensors of one EXL2 layer (keys without the layer prefix).

    `codes` `[K, N]` in stored order (row k' is input feature `perm[k']`), `groups` (bits, rows) in stored order with
    descending widths, `scale_codes` `[G, N]` in 1..16, `scale_max` `[G]` (converted to fp16). If N is not a
    multiple of 32 the columns are padded as exllamav2's packer does (§1.2): weight code 2^(b−1) (dequantizes to
    zero), scale code 16, bias 0; readers then see N rounded up to 32. Raises ValueError on inconsistent input.
    """
    if codes.dim() != 2:
        raise ValueError(f"codes must be [K, N], got shape {list(codes.shape)}.")
    k, n = codes.shape
    _check_groups(groups, k)
    g_count = len(groups)
    if k > _MAX_K:
        raise ValueError(f"K = {k} exceeds {_MAX_K}, the largest input width exllamav2 can index.")
    if tuple(scale_codes.shape) != (g_count, n):
        raise ValueError(f"scale_codes has shape {list(scale_codes.shape)}, expected [{g_count}, {n}].")
    if tuple(scale_max.shape) != (g_count,):
        raise ValueError(f"scale_max has shape {list(scale_max.shape)}, expected [{g_count}].")
    perm = perm.to(torch.int64)
    if tuple(perm.shape) != (k,) or not torch.equal(torch.sort(perm.cpu()).values, torch.arange(k)):
        raise ValueError(f"perm must be a permutation of 0..{k - 1}.")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {list(bias.shape)}, expected [{n}].")
    if int(scale_codes.min()) < 1 or int(scale_codes.max()) > 16:
        raise ValueError("scale_codes must lie in 1..16.")

    layout, row = [], 0
    for bits, rows in groups:
        layout.append(Exl2Group(bits, 0, 0, row, rows))
        row += rows
    for run in _runs(layout):
        part = codes[run.row_start:run.row_start + run.rows]
        if int(part.min()) < 0 or int(part.max()) >= 1 << run.bits:
            raise ValueError(f"codes of the {run.bits}-bit rows must lie in 0..{(1 << run.bits) - 1}.")
    codes = codes.to(torch.uint8)
    scale_codes = scale_codes.to(torch.int64)
    pad = -n % 32
    if pad:
        zero = torch.cat([codes.new_full((r, 1), 1 << (b - 1)) for b, r in groups]).expand(k, pad)
        codes = torch.cat([codes, zero], dim=1)
        scale_codes = torch.cat([scale_codes, scale_codes.new_full((g_count, pad), 16)], dim=1)
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(pad)])

    packed = [_encode_run(codes[r.row_start:r.row_start + r.rows].contiguous(), r.bits) for r in _runs(layout)]
    q_groups, offset = [], 0
    for bits, rows in groups:
        q_groups += [bits, offset]
        offset += rows * bits // 32
    if q_groups[-1] > _MAX_PACKED_OFFSET:
        raise ValueError(f"the last group starts at packed row {q_groups[-1]}, beyond the int16 range of q_groups.")

    shifts = torch.arange(0, 32, 4, device=codes.device)
    nibbles = (scale_codes - 1).view(g_count, -1, 8)
    out = {
        "q_weight": torch.cat(packed, dim=0),
        "q_scale": _wrap_int32((nibbles << shifts).sum(dim=2)),
        "q_scale_max": scale_max.to(torch.float16).contiguous(),
        "q_groups": torch.tensor(q_groups, dtype=torch.int16, device=codes.device),
        "q_invperm": torch.argsort(perm).to(torch.int32),
    }
    if bias is not None:
        out["bias"] = bias.to(torch.float16).contiguous()
    return out


def layer_storage_bits(rows: int, cols: int, groups: list[tuple[int, int]], bias_len: int = 0) -> int:
    """Size in bits of a layer's tensors (§3.4 `total_bits`): weights, scales, q_groups, q_invperm, bias."""
    g = len(groups)
    weight_bits = sum(r * cols * b for b, r in groups)
    return weight_bits + g * 16 + g * 32 + g * cols * 4 + rows * 32 + 16 * bias_len


def bit_mix(tensors: Mapping[str, torch.Tensor] | Any, prefix: str) -> dict[int, int]:
    """Number of weight rows per bit width, e.g. {8: 128, 6: 640} (for `exl2 info`)."""
    q_weight = _get(tensors, prefix, "q_weight")
    mix: dict[int, int] = {}
    for g in parse_groups(_get(tensors, prefix, "q_groups"), q_weight.shape[0], prefix):
        mix[g.bits] = mix.get(g.bits, 0) + g.rows
    return mix


def layer_bpw(tensors: Mapping[str, torch.Tensor] | Any, prefix: str, out_features: int | None = None) -> float:
    """Bits per weight: bytes of the layer's tensors present × 8 / (K · out_features); N defaults to the stored width."""
    q_weight = _get(tensors, prefix, "q_weight")
    groups = parse_groups(_get(tensors, prefix, "q_groups"), q_weight.shape[0], prefix)
    k = sum(g.rows for g in groups)
    n = out_features or q_weight.shape[1]
    total = 0
    for key in (*LAYER_KEYS, "bias"):
        name = f"{prefix}.{key}"
        if name in tensors:
            t = tensors[name]
            total += t.numel() * t.element_size() * 8
    return total / (k * n)


def group_layout(k: int, bits: list[int], bits_prop: list[float],
                 group_size: dict[int, int] | list[int]) -> list[tuple[int, int]]:
    """(bits, rows) per group in stored order, as exllamav2's converter lays them out (§1.10 step 1).

    For each width b with proportion p: n_b = ceil(min(K·p, remaining) / gs_b) groups of gs_b rows; the final group
    of the matrix is cut at K. `group_size` maps width → size, or lists sizes in the order of `bits`.
    """
    if len(bits) != len(bits_prop):
        raise ValueError("bits and bits_prop must have the same length.")
    sizes = dict(zip(bits, group_size)) if isinstance(group_size, (list, tuple)) else {int(b): g for b, g in group_size.items()}
    if isinstance(group_size, (list, tuple)) and len(group_size) != len(bits):
        raise ValueError("group_size as a list needs one entry per width.")
    layout: list[tuple[int, int]] = []
    remaining, left = k, k
    for b, p in zip(bits, bits_prop):
        gs = sizes[b]
        count = max(0, math.ceil(min(k * p, remaining) / gs))
        remaining -= count * gs
        for _ in range(count):
            rows = min(gs, left)
            if rows > 0:
                layout.append((b, rows))
            left -= rows
    if left > 0:
        raise ValueError(f"the proportions {bits_prop} cover only {k - left} of {k} rows.")
    return layout
