"""GPTQ quantized linear layers on the same kernels as EXL2 (spec §1.14), loading only.

`qweight` int32 `[K·b/32, N]` (codes packed along K as a little-endian bit stream per column), `qzeros` int32
`[G, N·b/32]` (packed along N), `scales` `[G, N]`, optional `g_idx` `[K]`, optional `bias`. Dequantization:
`W[k, n] = (q − zero) · scale` with `zero = stored + 1` for `checkpoint_format="gptq"` (v1) and `zero = stored`
for "gptq_v2". Act-order (`g_idx` not equal to `k // group_size`): rows are stably sorted by group, giving a
stored order with contiguous groups and a permutation that the kernels apply to x. Widths 2, 4 and 8 bits.
(exllamav2 only runs 4-bit; v2 zero nibbles of 0, on which it would borrow, are taken literally here.)
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from exl2.errors import FormatError
from exl2.kernels.qweight import QuantWeight, build
from exl2.kernels.quant_matmul import quant_matmul

GPTQ_BITS = (2, 4, 8)


def unpack_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[R, C]` holding a little-endian `bits`-bit stream down each column → int64 codes `[R·32/bits, C]`."""
    r, c = words.shape
    unit = 32 if bits == 3 else 32 // bits  # codes per unit of `unit·bits/32` words
    nw = unit * bits // 32
    if r % nw:
        raise FormatError(f"a {bits}-bit GPTQ tensor has {r} packed rows, not a multiple of {nw}.")
    u = (words.to(torch.int64) & 0xFFFFFFFF).view(-1, nw, c)
    out = torch.empty((u.shape[0], unit, c), dtype=torch.int64, device=words.device)
    mask = (1 << bits) - 1
    for i in range(unit):
        wi, s = divmod(i * bits, 32)
        v = u[:, wi] >> s
        if s + bits > 32:
            v = v | (u[:, wi + 1] << (32 - s))
        out[:, i] = v & mask
    return out.view(-1, c)


class GptqWeight(QuantWeight):
    """A loaded GPTQ layer (a `QuantWeight` with per-group zero points)."""

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor] | Any, prefix: str,
                     device: torch.device | str = "cpu", checkpoint_format: str = "gptq", bits: int = 4,
                     prescale: float = 1.0) -> "GptqWeight":
        """Build from `<prefix>.qweight`, `qzeros`, `scales` (and `g_idx`, `bias` if present)."""
        if bits not in GPTQ_BITS:
            raise FormatError(f"GPTQ layer {prefix}: {bits}-bit weights are not supported (2, 4 or 8).")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise FormatError(f"GPTQ layer {prefix}: unknown checkpoint_format {checkpoint_format!r}.")

        def get(key: str, required: bool = True) -> torch.Tensor | None:
            name = f"{prefix}.{key}"
            if name not in tensors:
                if required:
                    raise FormatError(f"GPTQ layer {prefix} has no {key} tensor.")
                return None
            return tensors[name].to(device)

        qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
        g_idx, bias = get("g_idx", False), get("bias", False)
        if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
            raise FormatError(f"GPTQ layer {prefix}: qweight, qzeros and scales must be 2-D.")
        codes = unpack_stream(qweight.to(torch.int32), bits)
        k, n = codes.shape
        g = scales.shape[0]
        if scales.shape[1] != n:
            raise FormatError(f"GPTQ layer {prefix}: scales has {scales.shape[1]} columns, qweight has {n}.")
        zeros = unpack_stream(qzeros.to(torch.int32).t().contiguous(), bits).t()
        if tuple(zeros.shape) != (g, n):
            raise FormatError(f"GPTQ layer {prefix}: qzeros has shape {list(qzeros.shape)}, expected "
                              f"[{g}, {n * bits // 32}].")
        if checkpoint_format == "gptq":
            zeros = zeros + 1
        gs = 1
        while gs * g < k:
            gs *= 2
        natural = torch.arange(k, device=codes.device) // gs
        perm = None
        if g_idx is not None and bool(g_idx.any()):
            g_idx = g_idx.to(torch.int64)
            if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= g:
                raise FormatError(f"GPTQ layer {prefix}: g_idx must hold {k} group indices below {g}.")
            if not torch.equal(g_idx, natural):
                perm = torch.sort(g_idx, stable=True).indices
            group_of = g_idx
        else:
            group_of = natural
        counts = torch.bincount(group_of, minlength=g).tolist()
        keep = [i for i, c in enumerate(counts) if c]
        keep_t = torch.tensor(keep, device=codes.device)
        stored = codes if perm is None else codes.index_select(0, perm)
        sc = (scales.float() * prescale).to(torch.float16).index_select(0, keep_t)
        if bias is not None and not bool(bias.any()):
            bias = None
        qw = build(stored.to(torch.uint8), [(bits, counts[i]) for i in keep], sc,
                   zeros.to(torch.float16).index_select(0, keep_t), perm, bias)
        return cls(**{f: getattr(qw, f) for f in ("qweight", "scales", "zeros", "step_group", "row_index", "x_index",
                                                  "classes", "k", "n", "bias", "out_features")})


def gptq_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """`x · W + bias`, x `[..., K]` → `[..., N]` (see `quant_matmul`)."""
    return quant_matmul(x, w)
