"""The packed decoders' PTX, run on the CPU by a small interpreter of the instructions they use. The Gluon
kernel's fragment decoders (`mma_dot._BODIES`): for every width, every register j of a step and lane q of a quad,
the fp16 pair the decoder builds must be the dequantized weights at input positions 8j + 2q and 8j + 2q + 1 (the
`mma.m16n8k16` B fragment's rows), bit for bit, where the stored row of each position comes from the class's input
order (`qweight.x_index`) and the codes from `qweight.encode_steps`. The gemv's step decoders (`gemv._words4_asm`,
`gemv._ptx_step`): a step's dot product with its 32 permuted inputs, within the error of its fp16 sums, and
exactly each row's code with one-hot inputs. The GPU runs the same asm text."""
import re

import numpy as np
import pytest
import torch

from exl2.kernels import mma_dot, qweight
from exl2.kernels import gemv as gemv_k


def _value(tok: str, regs: dict) -> int:
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    return int(tok, 0) & 0xFFFFFFFF


def _halves(x: int) -> np.ndarray:
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _pack(h: np.ndarray) -> int:
    u = h.astype(np.float16).view(np.uint16)
    return int(u[0]) | int(u[1]) << 16


def _signed(x: int, bits: int = 32) -> int:
    return x - (1 << bits) if x >> (bits - 1) & 1 else x


def run_ptx(text: str, operands: list[int]) -> int:
    """Execute one decoder: operands are $1, $2, ... (32-bit); returns $0."""
    regs = {f"${i + 1}": v & 0xFFFFFFFF for i, v in enumerate(operands)}
    for line in text.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if args.startswith("{"):  # mov.b32 {lo, hi}, a: the two fp16 halves into 16-bit registers
            lo, hi, src = re.findall(r"[\w$]+", args)
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        a = [s.strip() for s in args.split(",")]
        if op in ("cvt.f32.f16", "add.f32", "mov.f32"):
            f = [float(np.uint16(regs[t]).view(np.float16)) if op == "cvt.f32.f16" else
                 (regs[t] if t in regs else float(np.uint32(int(t[2:], 16)).view(np.float32))) for t in a[1:]]
            regs[a[0]] = float(np.float32(sum(f)))
            continue
        v = [_value(s, regs) for s in a[1:]]
        if op == "shr.u32":
            r = v[0] >> v[1] if v[1] < 32 else 0
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "mul.lo.u32":
            r = (v[0] * v[1]) & 0xFFFFFFFF
        elif op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":
            pool = v[0] | v[1] << 32
            r = 0
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 0x7
                assert not (v[2] >> (4 * i)) & 0x8, "sign-replicating selectors are not used"
                r |= ((pool >> (8 * sel)) & 0xFF) << (8 * i)
        elif op == "lop3.b32":
            lut = v[3]
            r = 0
            for bit in range(32):
                idx = ((v[0] >> bit) & 1) << 2 | ((v[1] >> bit) & 1) << 1 | ((v[2] >> bit) & 1)
                r |= ((lut >> idx) & 1) << bit
        elif op == "sub.f16x2":
            r = _pack(_halves(v[0]) - _halves(v[1]))
        elif op == "mul.rn.f16x2":
            r = _pack(_halves(v[0]) * _halves(v[1]))
        elif op == "add.rn.f16x2":
            r = _pack(_halves(v[0]) + _halves(v[1]))
        elif op == "fma.rn.f16x2":  # one rounding: the fp16 product is exact in float64
            r = _pack(_halves(v[0]).astype(np.float64) * _halves(v[1]) + _halves(v[2]))
        elif op == "shl.b32":
            r = v[0] << v[1] if v[1] < 32 else 0
        elif op == "dp4a.u32.s32":  # unsigned bytes of a times signed bytes of b, plus c
            r = _signed(v[2]) + sum(((v[0] >> 8 * i) & 0xFF) * _signed((v[1] >> 8 * i) & 0xFF, 8) for i in range(4))
        elif op == "mad.lo.s32":
            r = _signed(v[0]) * _signed(v[1]) + _signed(v[2])
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[a[0]] = r & 0xFFFFFFFF
    return regs["$0"]


def _operands(bits: int, words: list[int], j: int, q: int) -> list[int]:
    """The decoder's operands for register j of lane q, as `mma_dot._decode` builds them (word choice and the
    per-lane selectors/shifts), each given twice (the pair of a packed operand)."""
    jhi, jlo, qhi, qlo = j // 2, j % 2, q // 2, q % 2
    if bits == 4:
        ops = [words[j], 4 * q]
    elif bits == 8:
        ops = [words[2 * j + qhi], 0x4140 + 0x0202 * qlo]
    elif bits == 6:
        k = 2 * jlo + qhi
        ops = [words[jhi], words[jhi + 2], words[4], words[5], (4 + k) << 8 | k, 4 * qlo, (4 + j) << 12 | j << 4,
               4 + 2 * q]
    elif bits == 5:
        k = 2 * jlo + qhi
        ops = [words[jhi], words[jhi + 2], words[4], (4 + k) << 8 | k, 4 * qlo, (2 + jhi) << 12 | jhi << 4,
               4 + 4 * jlo + q]
    elif bits == 3:  # `mma_dot._codes3`, in Python
        if j < 3:
            t = (words[j] >> 3 * q) & 0x00070007
        elif q < 3:
            t = (words[q] >> 12) & 0x00070007
        else:
            t = (words[0] >> 15) & 0x00010001 | (words[1] >> 14) & 0x00020002 | (words[2] >> 13) & 0x00040004
        ops = [t | 0x64006400]
    else:
        ops = [words[0], words[1], (4 + j) << 8 | j, 2 * q]
    return [x for o in ops for x in (o, o)]


@pytest.mark.parametrize("bits", [8, 6, 5, 4, 3, 2])
def test_fragment_decoders_give_the_fragment_rows_bit_exact(bits):
    g = torch.Generator().manual_seed(bits)
    order = qweight.ORDERS.get(bits, tuple(range(32)))
    zero = 1 << (bits - 1)
    for trial in range(4):
        codes = torch.randint(0, 1 << bits, (32, 1), generator=g, dtype=torch.uint8)
        if trial == 0:
            codes[:] = (1 << bits) - 1  # every bit set: nothing may leak between fields
        words = [int(w) & 0xFFFFFFFF for w in qweight.encode_steps(codes, bits)[:, 0]]
        assert len(words) == bits
        scale = np.float16(np.random.default_rng(trial).uniform(0.001, 0.02))
        sc = int(np.array([scale, scale], dtype=np.float16).view(np.uint32)[0])
        for j in range(4):
            for q in range(4):
                ops = _operands(bits, words, j, q)
                raw = _halves(run_ptx(mma_dot._decoder(bits, False), ops))
                got = _halves(run_ptx(mma_dot._decoder(bits, True), ops + [sc, sc]))
                for h in range(2):
                    row = order[8 * j + 2 * q + h]
                    c = int(codes[row, 0])
                    assert raw[h] == np.float16(c - zero), (bits, j, q, h)
                    want = np.float16(np.float16(c - zero) * scale)
                    assert got[h].view(np.uint16) == want.view(np.uint16), (bits, j, q, h)


def test_gptq_decoder_subtracts_the_zeros_operand():
    codes = torch.randint(0, 16, (32, 1), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    words = [int(w) & 0xFFFFFFFF for w in qweight.encode_steps(codes, 4)[:, 0]]
    scale, zero = np.float16(0.0123), np.float16(5.0)
    pair = lambda v: int(np.array([v, v], dtype=np.float16).view(np.uint32)[0])  # noqa: E731
    for j in range(4):
        for q in range(4):
            ops = _operands(4, words, j, q) + [pair(scale)] * 2 + [pair(np.float16(zero + 1024))] * 2
            got = _halves(run_ptx(mma_dot._decoder(4, True, zeros=True), ops))
            for h in range(2):
                c = int(codes[qweight.PAIR_ORDER[8 * j + 2 * q + h], 0])
                assert got[h] == np.float16(np.float16(c - zero) * scale)


def test_decoder_text_uses_only_interpreted_instructions():
    known = {"shr.u32", "and.b32", "mul.lo.u32", "mov.b32", "prmt.b32", "lop3.b32", "sub.f16x2", "mul.rn.f16x2"}
    for bits in qweight.WIDTHS:
        for scaled in (False, True):
            ops = set(re.findall(r"^\s*([a-z][\w.]+)\s", mma_dot._decoder(bits, scaled), re.M)) - {".reg"}
            assert ops <= known, ops


@pytest.mark.parametrize("acc16", [False, True])
@pytest.mark.parametrize("bits", [8, 6, 5, 4, 3, 2])
def test_gemv_step_decoders_give_the_step_dot_product(bits, acc16):
    """Each packed gemv decoder returns sum_p (code of row order[p] - zero) * x[p] over one step's 32 permuted
    inputs x (pair i = positions 2i, 2i+1), times `STEP_SCALE`; fp16 sums of 8 (per word) or 16 (per step,
    EXL2_GEMV_ACC16) products per lane bound the error."""
    order, zero = qweight.ORDERS.get(bits, tuple(range(32))), 1 << (bits - 1)
    text = gemv_k._words4_asm(acc16) if bits == 4 else gemv_k._ptx_step(bits, acc16)
    rng = np.random.default_rng(bits + 2 * acc16)
    for trial in range(6):
        codes = torch.from_numpy(rng.integers(0, 1 << bits, (32, 1), dtype=np.uint8))
        if trial == 0:
            codes[:] = (1 << bits) - 1
        elif trial == 1:
            codes[:] = 0  # the most negative weights
        words = [int(w) & 0xFFFFFFFF for w in qweight.encode_steps(codes, bits)[:, 0]]
        x = rng.standard_normal(32).astype(np.float16) * np.float16(4)
        pairs = [_pack(x[2 * i: 2 * i + 2]) for i in range(16)]
        terms = np.array([(int(codes[order[p], 0]) - zero) * float(x[p]) for p in range(32)])
        got = run_ptx(text, words + pairs) * gemv_k.STEP_SCALE.get(bits, 1.0)
        assert abs(got - terms.sum()) <= 4e-3 * np.abs(terms).sum() + 1e-3, (trial, got, terms.sum())


def test_gemv_step_decoders_see_every_row_once():
    """With one input at a time set to 1 (the rest 0), the step sum is exactly that row's code - zero: each
    decoder reads each of the 32 positions from its own row (an error in the pair order or a field would hide in
    a random dot product's tolerance)."""
    for bits in (8, 6, 5, 3, 2):
        order, zero = qweight.ORDERS.get(bits, tuple(range(32))), 1 << (bits - 1)
        for seed in range(3):
            codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 1 << bits, (32, 1), dtype=np.uint8))
            if seed == 0:
                codes[::2] = (1 << bits) - 1
            words = [int(w) & 0xFFFFFFFF for w in qweight.encode_steps(codes, bits)[:, 0]]
            text = gemv_k._ptx_step(bits, True)
            for p in range(32):
                x = np.zeros(32, dtype=np.float16)
                x[p] = 1
                pairs = [_pack(x[2 * i: 2 * i + 2]) for i in range(16)]
                got = run_ptx(text, words + pairs) * gemv_k.STEP_SCALE.get(bits, 1.0)
                assert got == int(codes[order[p], 0]) - zero, (bits, seed, p)
