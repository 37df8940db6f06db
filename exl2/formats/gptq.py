"""GPTQ checkpoints (loading only, spec EXL2.md §1.14): dequantize `qweight`/`qzeros`/`scales`/`g_idx` to fp16.

`pack_gptq` is the inverse, used to build test files from known codes.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from exl2.errors import ConfigError, FormatError
from exl2.formats.exl2 import _as_int32, _decode_run, _encode_run

FORMATS = ("gptq", "gptq_v2")
BITS = (2, 4, 8)


def _check_args(checkpoint_format: str, bits: int) -> None:
    if checkpoint_format not in FORMATS:
        raise ConfigError(f"Unknown GPTQ checkpoint_format {checkpoint_format!r}; expected 'gptq' or 'gptq_v2'.")
    if bits not in BITS:
        raise ConfigError(f"GPTQ checkpoints with {bits}-bit weights are not supported (only 2, 4 and 8 bits).")


def _unpack_cols(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[G, N·bits/32]` with codes packed along columns (code i at bits·i) → int16 `[G, N]`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    vals = (_as_int32(words).unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    return vals.to(torch.int16).view(words.shape[0], -1)


def _group_index(g_idx: torch.Tensor | None, k: int, groups: int, prefix: str) -> torch.Tensor:
    """Group of each input row: `g_idx` when present and not all zero, else `k // gs` (gs: power of two, gs·G ≥ K)."""
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise FormatError(f"GPTQ layer {prefix}: g_idx has shape {list(g_idx.shape)}, expected [{k}].")
        idx = g_idx.to(torch.int64)
        if bool(idx.any()):
            if int(idx.min()) < 0 or int(idx.max()) >= groups:
                raise FormatError(f"GPTQ layer {prefix}: g_idx refers to groups outside 0..{groups - 1}.")
            return idx
    gs = 1
    while gs * groups < k:
        gs *= 2
    return torch.arange(k) // gs


def dequantize_gptq(tensors: Mapping[str, torch.Tensor] | Any, prefix: str, checkpoint_format: str = "gptq",
                    bits: int = 4) -> torch.Tensor:
    """fp16 `[K, N]` weight of a GPTQ layer in natural order: `W[k, n] = (q − z) · scales[g(k), n]`.

    v1 ("gptq") stores each zero point minus one, so z = stored + 1; "gptq_v2" stores z itself. (exllamav2 converts
    v2 by subtracting 0x11111111 per word, which would borrow across a stored zero of 0; this reader does not.)
    `q − z` is an exact integer and the product is rounded to fp16 once.
    """
    _check_args(checkpoint_format, bits)
    names = {key: f"{prefix}.{key}" for key in ("qweight", "qzeros", "scales", "g_idx")}
    for key in ("qweight", "qzeros", "scales"):
        if names[key] not in tensors:
            raise FormatError(f"GPTQ layer {prefix} has no {key} tensor.")
    qweight, qzeros, scales = (tensors[names[k]] for k in ("qweight", "qzeros", "scales"))
    g_idx = tensors[names["g_idx"]] if names["g_idx"] in tensors else None
    per_word = 32 // bits
    if qweight.dim() != 2 or qweight.dtype not in (torch.int32, torch.uint32):
        raise FormatError(f"GPTQ layer {prefix}: qweight must be a 2-D int32 tensor, got {qweight.dtype} "
                          f"{list(qweight.shape)}.")
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != n or scales.shape[0] == 0:
        raise FormatError(f"GPTQ layer {prefix}: scales has shape {list(scales.shape)}, expected [groups, {n}].")
    groups = scales.shape[0]
    if qzeros.dim() != 2 or n % per_word or tuple(qzeros.shape) != (groups, n // per_word):
        raise FormatError(f"GPTQ layer {prefix}: qzeros has shape {list(qzeros.shape)}, expected "
                          f"[{groups}, {n / per_word:g}] for {bits}-bit zeros of {n} columns.")

    codes = torch.empty((k, n), dtype=torch.int16, device=qweight.device)
    _decode_run(_as_int32(qweight), bits, codes)
    zeros = _unpack_cols(qzeros, bits)
    if checkpoint_format == "gptq":
        zeros += 1
    gidx = _group_index(g_idx, k, groups, prefix).to(qweight.device)
    level = (codes - zeros.index_select(0, gidx)).to(torch.float16)
    return level * scales.to(torch.float16).index_select(0, gidx)


def _pack_cols(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_unpack_cols`."""
    return _encode_run(vals.to(torch.uint8).t().contiguous(), bits).t().contiguous()


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None,
              bits: int = 4, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """GPTQ tensors (`qweight`, `qzeros`, `scales`, optional `g_idx`; keys without prefix) from known values.

    `codes` `[K, N]` in natural order (0..2^b−1), `zeros` `[G, N]` the true zero points (v1 stores z − 1, so it
    needs z in 1..2^b; v2 needs 0..2^b−1), `scales` `[G, N]` (stored fp16), `g_idx` `[K]` group per row.
    """
    _check_args(checkpoint_format, bits)
    per_word = 32 // bits
    k, n = codes.shape
    if k % per_word or n % per_word:
        raise ValueError(f"K = {k} and N = {n} must be multiples of {per_word} for {bits}-bit GPTQ packing.")
    if zeros.shape != scales.shape or zeros.shape[1] != n:
        raise ValueError(f"zeros {list(zeros.shape)} and scales {list(scales.shape)} must both be [groups, {n}].")
    if int(codes.min()) < 0 or int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes must lie in 0..{(1 << bits) - 1}.")
    stored = zeros.to(torch.int64) - (1 if checkpoint_format == "gptq" else 0)
    if int(stored.min()) < 0 or int(stored.max()) >= 1 << bits:
        raise ValueError(f"zero points do not fit {bits} bits in the {checkpoint_format} convention.")
    out = {
        "qweight": _encode_run(codes.to(torch.uint8).contiguous(), bits),
        "qzeros": _pack_cols(stored, bits),
        "scales": scales.to(torch.float16).contiguous(),
    }
    if g_idx is not None:
        out["g_idx"] = g_idx.to(torch.int32).contiguous()
    return out
