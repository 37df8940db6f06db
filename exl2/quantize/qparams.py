"""Candidate quantization options (spec EXL2.md §3.4, §2.4): exllamav2's option tables and their storage cost.

A `QParams` is one way to quantize one matrix: widths in descending order, the fraction of (act-order) rows at each
width, a group size per width and 4-bit scales. Costs come from `exl2.formats.exl2`, so the bits counted here are
exactly the bytes the packed layer takes on disk.
"""
from __future__ import annotations

from dataclasses import dataclass

from exl2.formats.exl2 import group_layout, layer_storage_bits


@dataclass(frozen=True)
class QParams:
    group_size: tuple[tuple[int, int], ...]   # ((bits, group size), ...) in the order of `bits`
    bits: tuple[int, ...]
    bits_prop: tuple[float, ...]
    scale_bits: int = 4

    @property
    def sizes(self) -> dict[int, int]:
        return dict(self.group_size)

    @property
    def desc(self) -> str:
        """exllamav2's descriptor, e.g. `0.05:3b_64g/0.95:2b_64g s4`."""
        parts = [f"{p:g}:{b}b_{self.sizes[b]}g" for b, p in zip(self.bits, self.bits_prop)]
        return "/".join(parts) + f" s{self.scale_bits}"

    def layout(self, rows: int) -> list[tuple[int, int]]:
        """(bits, rows) per group for a matrix with `rows` input features (§1.10 step 1)."""
        return group_layout(rows, list(self.bits), list(self.bits_prop), self.sizes)

    def total_bits(self, rows: int, cols: int, bias_len: int = 0) -> int:
        """Storage of the packed layer in bits; `cols` is padded up to a multiple of 32 as the writer does."""
        cols = -(-cols // 32) * 32
        return layer_storage_bits(rows, cols, self.layout(rows), bias_len)

    def bpw(self, rows: int, cols: int, bias_len: int = 0) -> float:
        return self.total_bits(rows, cols, bias_len) / (rows * cols + bias_len)

    def to_dict(self) -> dict:
        """The JSON form used in measurement.json and job strategies (group_size keys are strings there)."""
        return {"group_size": {str(b): g for b, g in self.group_size}, "bits": list(self.bits),
                "bits_prop": list(self.bits_prop), "scale_bits": self.scale_bits}

    @classmethod
    def from_dict(cls, d: dict) -> "QParams":
        bits = tuple(int(b) for b in d["bits"])
        gs = {int(k): int(v) for k, v in d["group_size"].items()} if isinstance(d["group_size"], dict) \
            else dict(zip(bits, (int(g) for g in d["group_size"])))
        return cls(tuple((b, gs[b]) for b in bits), bits, tuple(float(p) for p in d["bits_prop"]),
                   int(d.get("scale_bits", 4)))


def qp(*parts: tuple[float, int, int]) -> QParams:
    """Shorthand: qp((fraction, bits, group size), ...)."""
    return QParams(tuple((b, g) for _, b, g in parts), tuple(b for _, b, _ in parts), tuple(p for p, _, _ in parts))


def _two(hi: int, lo: int, frac: float, gs: int) -> QParams:
    return qp((frac, hi, gs), (round(1 - frac, 10), lo, gs))


def _one(bits: int, gs: int) -> QParams:
    return qp((1.0, bits, gs))


# Attention rows: (q_proj, k_proj, v_proj, o_proj).
_a32_64 = _two(3, 2, 0.1, 64)
_a43_128 = _two(4, 3, 0.1, 128)
_a54_128 = _two(5, 4, 0.1, 128)
_a54_64 = _two(5, 4, 0.1, 64)
_a54_32 = _two(5, 4, 0.1, 32)
QPARAMS_ATTN: tuple[tuple[QParams, QParams, QParams, QParams], ...] = (
    (_two(3, 2, 0.05, 64),) * 4,
    (_a32_64, _a32_64, _two(3, 2, 0.25, 64), _a32_64),
    (_a32_64, _a32_64, _a43_128, _a32_64),
    (_a32_64, _a32_64, _a43_128, _a43_128),
    (_a43_128,) * 4,
    (_a43_128, _a43_128, _two(4, 3, 0.1, 64), _a43_128),
    (_one(4, 128),) * 4,
    (_one(4, 128), _one(4, 128), _one(4, 64), _one(4, 128)),
    (_one(4, 64), _one(4, 64), _one(4, 32), _one(4, 64)),
    (_one(4, 32),) * 4,
    (_a54_128, _a54_128, _a54_64, _a54_128),
    (_a54_64, _a54_64, _a54_32, _a54_64),
    (_a54_64, _a54_64, _one(5, 64), _a54_64),
    (_a54_32, _a54_32, _one(5, 32), _a54_32),
    (_two(6, 5, 0.1, 128), _two(6, 5, 0.1, 128), _one(6, 128), _two(6, 5, 0.1, 128)),
    (_two(6, 5, 0.1, 32), _two(6, 5, 0.1, 32), _one(6, 32), _two(6, 5, 0.1, 32)),
    (_one(6, 128),) * 4,
    (_one(6, 32), _one(6, 32), _one(8, 32), _one(6, 32)),
    (_one(8, 128),) * 4,
)

# MLP rows: (gate_proj, up_proj, down_proj); MoE experts use the same rows (w1, w3, w2).
QPARAMS_MLP: tuple[tuple[QParams, QParams, QParams], ...] = (
    (_two(3, 2, 0.05, 64), _two(3, 2, 0.05, 64), qp((0.05, 6, 32), (0.2, 3, 64), (0.75, 2, 64))),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.25, 64), qp((0.05, 6, 32), (0.2, 3, 64), (0.75, 2, 64))),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.3, 64), qp((0.05, 5, 32), (0.95, 3, 32))),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.3, 64), qp((0.05, 5, 32), (0.95, 4, 32))),
    (_two(4, 3, 0.1, 128), _two(4, 3, 0.25, 128), qp((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128))),
    (_two(4, 3, 0.1, 32), _two(4, 3, 0.25, 32), qp((0.05, 8, 32), (0.1, 4, 32), (0.85, 3, 32))),
    (_two(4, 3, 0.1, 32), _two(4, 3, 0.25, 32), qp((0.05, 8, 32), (0.95, 4, 128))),
    (_one(4, 128), _one(4, 32), qp((0.05, 8, 32), (0.95, 4, 128))),
    (_one(4, 32), _one(4, 32), qp((0.05, 8, 32), (0.95, 4, 32))),
    (_two(5, 4, 0.1, 128), _two(5, 4, 0.25, 128), qp((0.05, 8, 32), (0.1, 5, 128), (0.85, 4, 128))),
    (_two(5, 4, 0.1, 32), _two(5, 4, 0.25, 32), qp((0.05, 8, 32), (0.1, 5, 32), (0.85, 4, 32))),
    (_two(6, 5, 0.1, 128), _two(6, 5, 0.25, 128), qp((0.05, 8, 32), (0.1, 6, 128), (0.85, 5, 128))),
    (_two(6, 5, 0.1, 32), _two(6, 5, 0.25, 32), qp((0.05, 8, 32), (0.1, 6, 32), (0.85, 5, 32))),
    (_one(6, 128), _one(6, 128), qp((0.05, 8, 32), (0.95, 6, 128))),
    (_two(8, 6, 0.1, 128), _two(8, 6, 0.1, 128), _two(8, 6, 0.15, 128)),
    (_two(8, 6, 0.1, 128), _two(8, 6, 0.1, 128), _one(8, 128)),
    (_one(8, 128),) * 3,
)

# lm_head options by -hb (§2.4).
QPARAMS_HEAD: dict[int, QParams] = {
    2: _two(4, 2, 0.3, 32),
    3: _two(4, 3, 0.15, 32),
    4: _two(6, 4, 0.15, 32),
    5: _two(6, 5, 0.15, 128),
    6: _two(8, 6, 0.15, 128),
    8: _one(8, 128),
}

ATTN_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_ROLES = ("gate_proj", "up_proj", "down_proj")


def table(kind: str) -> tuple[tuple[QParams, ...], ...]:
    """The option rows of a block kind ("attn" or "mlp")."""
    return QPARAMS_ATTN if kind == "attn" else QPARAMS_MLP


def roles(kind: str) -> tuple[str, ...]:
    return ATTN_ROLES if kind == "attn" else MLP_ROLES
