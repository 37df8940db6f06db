"""Tensor-core kernel for 5 to 16 input rows of an EXL2 (any mix of 2/3/4/5/6/8-bit classes) or 4-bit GPTQ matrix,
written in Gluon (Triton's explicit-layout dialect) so the decoded weights land directly in the registers the
tensor-core instruction reads.

Plain Triton decodes into a layout of its choosing and then moves every fp16 weight through shared memory to
reach the mma operand layout (benchmarks/RESULTS.md, session 7: 10-27 bytes of shared-memory traffic per weight,
the kernel 5-7x off the bandwidth bound). Here each thread loads exactly the words whose codes its `mma.m16n8k16`
B fragment holds. In the fragment a thread owns, per column and per 16 rows of K, the rows 2q, 2q + 1, 2q + 8,
2q + 9 (q = lane % 4): with the permuted input's positions as K, register j of a 32-row step holds positions
8j + 2q and 8j + 2q + 1. Which stored rows those are depends on the class's input order (`qweight.x_index`:
`PAIR_ORDER` for 4-bit, stored order for 8-bit, `PAIR_ORDER16` otherwise), and each width has a decoder that
builds that register from the words holding them with a few shifts, byte permutes and `lop3`s, plus the 0x6400
exponent trick and one packed subtract (and multiply by the scale): bit-exact with the reference dequantizer.
`convert_layout(assert_trivial=True)` proves at compile time that the decoded tile is the fragment. Only the
input tile goes through shared memory (once per program).

GPU only (Gluon has no interpreter); `quant_matmul` uses it where `supports()` and falls back to `dot`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import INTERPRET, counters, pdl_args, triton
from exl2.kernels.matmul_launch import mixed_widths
from exl2.kernels.qweight import WIDTHS
from exl2.kernels.split_sum import SplitSum

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAVE_GLUON = not INTERPRET
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6
except Exception:  # noqa: BLE001 - an older Triton (or none): the Triton kernel serves every shape
    HAVE_GLUON = False


def _asm(body: str, zero: int | None, scaled: bool) -> str:
    """One fragment register from `body` (which leaves the two codes in the low 10 bits of each half of `t`, OR-ed
    with 0x6400: fp16 1024 + code), minus 1024 + the class's zero point (or the zeros operand `$7`), times the
    scale (the last operand) unless the scale is applied after the mma."""
    sub = f"mov.b32 z, {0x64006400 | zero << 16 | zero:#x};\n    sub.f16x2 t, t, z;" if zero is not None else \
        "sub.f16x2 t, t, $7;"
    tail = "mul.rn.f16x2 $0, t, $SC;" if scaled else "mov.b32 $0, t;"
    return "{\n    .reg .b32 t, z, u, y;\n    " + body.strip() + "\n    " + sub + "\n    " + tail + "\n}"


# Decoders, one per width: operand registers are $1, $3, $5, ... (each operand is packed in pairs; the second
# register of a pair is the same value). Register j of a step holds positions p = 8j + 2q + h (h the half).
_BODIES = {
    # PAIR_ORDER: p holds row 8j + q + 4h: the code pair (q, q + 4) of low word j, bits 4q and 4q + 16. ($1 word,
    # $3 = 4q)
    4: ("shr.u32 t, $1, $3;\n    lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;", 2),
    # stored order: rows 8j + 2q + h are bytes 2(q % 2) + h of word 2j + q / 2; one byte permute puts them under
    # 0x64 bytes. ($1 word, $3 the selector)
    8: ("mov.b32 u, 0x64646464;\n    prmt.b32 t, $1, u, $3;", 2),
    # PAIR_ORDER16: p holds row r + 16h, r = 4j + q: its low nibble in low word j / 2 + 2h, byte 2(j % 2) + q / 2,
    # nibble q % 2; its top 2 bits in high word h, byte j, bits 2q. ($1, $3 low words h = 0, 1; $5, $7 high words;
    # $9 low-byte selector, $11 = 4(q % 2); $13 high-byte selector (to bytes 1, 3), $15 = 4 + 2q)
    6: ("prmt.b32 t, $1, $3, $9;\n    shr.u32 t, t, $11;\n    prmt.b32 y, $5, $7, $13;\n    shr.u32 y, y, $15;\n"
        "    lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;\n    lop3.b32 t, y, 0x00300030, t, 0xEA;", 8),
    # PAIR_ORDER16: the low nibbles as for 6 bits; the top bit of row r + 16h is bit r + 16h of the high word, in
    # byte 2h + j / 2. ($1, $3 low words h = 0, 1; $5 high word; $7 low-byte selector, $9 = 4(q % 2); $11 high-byte
    # selector (to bytes 1, 3), $13 = 4 + 4(j % 2) + q)
    5: ("prmt.b32 t, $1, $3, $7;\n    shr.u32 t, t, $9;\n    prmt.b32 y, $5, $5, $11;\n    shr.u32 y, y, $13;\n"
        "    lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;\n    lop3.b32 t, y, 0x00100010, t, 0xEA;", 7),
    # PAIR_ORDER16, `qweight.THREE_BIT_FIELDS`: row r + 16h, r = 4j + q, is one 3-bit field of one word (row 15:
    # bit 15 of three words). `_codes3` builds the register in Gluon, where the word choice and the row-15 case fold
    # away in the registers of j < 3. ($1 the codes | 0x6400 in both halves)
    3: ("mov.b32 t, $1;", 1),
    # PAIR_ORDER16, as the 3-bit low words. ($1, $3 the words; $5 the byte selector, $7 = 2q)
    2: ("prmt.b32 t, $1, $3, $5;\n    shr.u32 t, t, $7;\n    lop3.b32 t, t, 0x00030003, 0x64006400, 0xEA;", 4),
}


def _decoder(bits: int, scaled: bool, zeros: bool = False) -> str:
    body, n_ops = _BODIES[bits]
    return _asm(body, None if zeros else 1 << (bits - 1), scaled).replace("$SC", f"${2 * n_ops + 1}")


if HAVE_GLUON:
    _D8, _D8R = gl.constexpr(_decoder(8, True)), gl.constexpr(_decoder(8, False))
    _D6, _D6R = gl.constexpr(_decoder(6, True)), gl.constexpr(_decoder(6, False))
    _D5, _D5R = gl.constexpr(_decoder(5, True)), gl.constexpr(_decoder(5, False))
    _D4, _D4R = gl.constexpr(_decoder(4, True)), gl.constexpr(_decoder(4, False))
    _D3, _D3R = gl.constexpr(_decoder(3, True)), gl.constexpr(_decoder(3, False))
    _D2, _D2R = gl.constexpr(_decoder(2, True)), gl.constexpr(_decoder(2, False))
    # GPTQ (4-bit with zeros): the zeros operand ($5) replaces the class's zero point, the scale is $7
    # GPTQ (4-bit with zeros): operands word, shift, scale ($5), zeros + 1024 ($7)
    _D4Z = gl.constexpr(_decoder(4, True, zeros=True))

    # The decoded tile's dimensions: [step s, jhi, jlo, qhi, qlo, column / V, column % V, half h], register
    # j = 2·jhi + jlo of the step, lane q = 2·qhi + qlo (the fragment's k bits 1-2), columns / V on lanes 2-4 and
    # the warps; s, j, the V adjacent columns and h in registers (h fastest: one packed fp16 pair).
    @gluon.constexpr_function
    def _tile_layout(v):
        return gl.BlockedLayout([1, 1, 1, 1, 1, 1, int(getattr(v, "value", v)), 2], [1, 1, 1, 2, 2, 8, 1, 1], [1, 1, 1, 1, 1, 4, 1, 1],
                                [7, 6, 4, 3, 2, 1, 0, 5])

    @gluon.constexpr_function
    def _sub(keep, v):
        """`_tile_layout` with the dimensions not in the bit mask `keep` sliced away (what an operand that does
        not depend on them is loaded or computed in; `_widen` puts them back)."""
        lay = _tile_layout(v)
        for d in reversed(range(8)):
            if not int(getattr(keep, "value", keep)) >> d & 1:
                lay = gl.SliceLayout(d, lay)
        return lay

    @gluon.constexpr_function
    def _width(i):
        return WIDTHS[int(getattr(i, "value", i))]

    @gluon.jit
    def _widen(t, KEEP: gl.constexpr):
        for d in gl.static_range(8):
            if (KEEP >> d) & 1 == 0:
                t = gl.expand_dims(t, d)
        return t

    @gluon.constexpr_function
    def _staged(shape, stages):
        return [int(getattr(stages, "value", stages))] + [int(getattr(d, "value", d)) for d in shape]

    @gluon.jit
    def _ring(dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr, STAGES: gl.constexpr):
        """A ring of STAGES shared-memory buffers of `shape`: one allocation, indexed by stage."""
        return gl.allocate_shared_memory(dtype, _staged(shape, STAGES), layout)

    @gluon.jit
    def _coord(D: gl.constexpr, V: gl.constexpr):
        """0/1 along tile dimension D (jhi 1, jlo 2, qhi 3, qlo 4), size 1 elsewhere."""
        return _widen(gl.arange(0, 2, layout=_sub(1 << D, V)), 1 << D)

    @gluon.jit
    def _words(view, KEEP: gl.constexpr, V: gl.constexpr):
        """A [.., BS, 32·V] word view (leading word dims as in KEEP's order) loaded with each thread holding
        what its fragment needs, widened to the tile's 8 dimensions."""
        return _widen(view.load(_sub(KEEP, V)), KEEP)

    # Register layouts of the cp.async copies (16 bytes a thread): words [rows, BS, 32·V] int32, scales
    # [BS, 32·V] fp16, input [16, 32·BS] fp16. The pointer tensors built once per program and the masks built per
    # issue must share them.
    @gluon.constexpr_function
    def _copy_words(v):
        v = int(getattr(v, "value", v))
        return gl.BlockedLayout([1, 1, 4], [1, 4 // v, 8 * v], [4, 1, 1], [2, 1, 0])

    @gluon.constexpr_function
    def _copy_row(v):
        v = int(getattr(v, "value", v))
        return gl.BlockedLayout([1, 4], [4 // v, 8 * v], [4, 1], [1, 0])

    @gluon.constexpr_function
    def _copy_scales(v):
        v = int(getattr(v, "value", v))
        return gl.BlockedLayout([1, 8], [8 // v, 4 * v], [4, 1], [1, 0])

    @gluon.constexpr_function
    def _copy_input(bs):
        t = min(32, 4 * int(getattr(bs, "value", bs)))
        return gl.BlockedLayout([1, 8], [32 // t, t], [4, 1], [1, 0])

    @gluon.jit
    def _pair_bits(v):
        """fp16 tensor -> int32 holding the value in both halves (a packed-fp16 operand)."""
        b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return b | (b << 16)

    @gluon.constexpr_function
    def _row_layout(v):
        """[32, V] layout of a scale row (stored columns c·V + v) that, permuted and flattened to the logical column
        v·32 + c, is exactly the accumulator's column layout: each thread reads 2·V adjacent halves."""
        v = int(getattr(v, "value", v))
        return gl.DistributedLinearLayout(reg_bases=[[1, 0]] + [[0, 1 << i] for i in range(v.bit_length() - 1)],
                                          lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
                                          warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[32, v])

    @gluon.jit
    def _copy_rows(buf, ptrs, s0, s_hi, N, col0, BS: gl.constexpr, V: gl.constexpr):
        """cp.async of word rows [R, BS, 32·V] (or one row [BS, 32·V]) of the iteration at s0 (`ptrs` already at
        it) into `buf`, zeros for the steps past s_hi and the columns past N."""
        if len(ptrs.shape) == 3:
            CW: gl.constexpr = _copy_words(V)
            sr = gl.arange(0, BS, layout=gl.SliceLayout(0, gl.SliceLayout(2, CW)))
            wc = col0 + gl.arange(0, 32 * V, layout=gl.SliceLayout(0, gl.SliceLayout(1, CW)))
            ok = gl.expand_dims(gl.expand_dims(s0 + sr < s_hi, 0), 2) & gl.expand_dims(gl.expand_dims(wc < N, 0), 1)
            ok = ok & (gl.zeros([ptrs.shape[0], 1, 1], gl.int32, CW) == 0)
        else:
            CR: gl.constexpr = _copy_row(V)
            sr = gl.arange(0, BS, layout=gl.SliceLayout(1, CR))
            wc = col0 + gl.arange(0, 32 * V, layout=gl.SliceLayout(0, CR))
            ok = gl.expand_dims(s0 + sr < s_hi, 1) & gl.expand_dims(wc < N, 0)
        async_copy.async_copy_global_to_shared(buf, ptrs, mask=ok)

    @gluon.jit
    def _word_ptrs(qw_ptr, word0, row0, col0, N, ROWS: gl.constexpr, BITS: gl.constexpr, BS: gl.constexpr,
                   V: gl.constexpr):
        """Pointers to words row0 + r (r < ROWS; ROWS = 0: the one row row0, 2-d) of each step s from word0, the
        columns from col0: [ROWS, BS, 32·V] or [BS, 32·V]."""
        if ROWS == 0:
            CR: gl.constexpr = _copy_row(V)
            s = gl.arange(0, BS, layout=gl.SliceLayout(1, CR))
            c = col0 + gl.arange(0, 32 * V, layout=gl.SliceLayout(0, CR))
            row = gl.expand_dims(row0 + s * BITS, 1)
            ptrs = qw_ptr + word0.to(gl.int64) * N + row.to(gl.int64) * N + gl.expand_dims(c, 0)
        else:
            CW: gl.constexpr = _copy_words(V)
            r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, CW)))
            s = gl.arange(0, BS, layout=gl.SliceLayout(0, gl.SliceLayout(2, CW)))
            c = col0 + gl.arange(0, 32 * V, layout=gl.SliceLayout(0, gl.SliceLayout(1, CW)))
            row = gl.expand_dims(gl.expand_dims(row0 + r, 1), 2) + gl.expand_dims(gl.expand_dims(s * BITS, 0), 2)
            ptrs = qw_ptr + word0.to(gl.int64) * N + row.to(gl.int64) * N + gl.expand_dims(gl.expand_dims(c, 0), 1)
        return ptrs

    @gluon.jit
    def _issue(wb, sbuf, zbuf, xbuf, stage, wp, x_ptrs, sc_ptr, zr_ptr, grp, s0, s_lo, s_hi, N, M, col0,
               BITS: gl.constexpr, HAS_ZEROS: gl.constexpr, BS: gl.constexpr, V: gl.constexpr, POST: gl.constexpr,
               PARTS: gl.constexpr = 3):
        """cp.async of the iteration at step s0 into `stage` of the shared-memory rings (zeros past s_hi): the
        class's word rings `wb` from the pointers `wp` (`_word_bufs`, pointing at s_lo's), scales (and zeros)
        [BS, BN] of groups `grp`, or with POST the one scale row [1, BN] of group `grp` (PARTS bit 0), and the
        input [16, BS·32] (`x_ptrs` at s_lo's) closing the commit group (bit 1)."""
        BN: gl.constexpr = 32 * V
        K: gl.constexpr = BS * 32
        CS: gl.constexpr = _copy_scales(V)
        CX: gl.constexpr = _copy_input(BS)
        if PARTS & 1:
            step = (s0 - s_lo).to(gl.int64) * BITS * N
            for i in gl.static_range(len(wb)):
                _copy_rows(wb[i].index(stage), wp[i] + step, s0, s_hi, N, col0, BS, V)
            scn = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, CS))
            if POST:
                g_off = gl.expand_dims(gl.zeros([1], gl.int64, gl.SliceLayout(1, CS)) + grp.to(gl.int64) * N, 1)
                ok_s = gl.expand_dims(gl.full([1], 1, gl.int1, gl.SliceLayout(1, CS)) & (s0 < s_hi), 1) & \
                    gl.expand_dims(scn < N, 0)
                async_copy.async_copy_global_to_shared(sbuf.index(stage),
                                                       sc_ptr + g_off + gl.expand_dims(scn, 0), mask=ok_s)
            else:
                sr = gl.arange(0, BS, layout=gl.SliceLayout(1, CS))
                g_off = gl.expand_dims(grp.to(gl.int64) * N, 1) + gl.expand_dims(scn, 0)
                ok_s = gl.expand_dims(s0 + sr < s_hi, 1) & gl.expand_dims(scn < N, 0)
                async_copy.async_copy_global_to_shared(sbuf.index(stage), sc_ptr + g_off, mask=ok_s)
                if HAS_ZEROS:
                    async_copy.async_copy_global_to_shared(zbuf.index(stage), zr_ptr + g_off, mask=ok_s)
        if PARTS & 2:
            xm = gl.arange(0, 16, layout=gl.SliceLayout(1, CX))
            xk = s0 * 32 + gl.arange(0, K, layout=gl.SliceLayout(0, CX))
            ok_x = gl.expand_dims(xm < M, 1) & gl.expand_dims(xk < s_hi * 32, 0)
            async_copy.async_copy_global_to_shared(xbuf.index(stage), x_ptrs + (s0 - s_lo) * 32, mask=ok_x)
            async_copy.commit_group()

    @gluon.jit
    def _word_bufs(qw_ptr, word0, col0, N, BITS: gl.constexpr, BS: gl.constexpr, V: gl.constexpr,
                   STAGES: gl.constexpr):
        """The class's shared-memory word rings and the pointers that fill them, one ring per run of words the
        decoder views as one tensor: 8/4-bit: all words; 6/5-bit: low words 0-1 and 2-3, then each high word;
        3/2-bit: each word."""
        BN: gl.constexpr = 32 * V
        R3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        R2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if BITS == 8:
            wb = (_ring(gl.int32, [8, BS, BN], R3, STAGES),)
            wp = (_word_ptrs(qw_ptr, word0, 0, col0, N, 8, BITS, BS, V),)
        elif BITS == 6:
            wb = (_ring(gl.int32, [2, BS, BN], R3, STAGES),
                  _ring(gl.int32, [2, BS, BN], R3, STAGES),
                  _ring(gl.int32, [BS, BN], R2, STAGES),
                  _ring(gl.int32, [BS, BN], R2, STAGES))
            wp = (_word_ptrs(qw_ptr, word0, 0, col0, N, 2, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 2, col0, N, 2, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 4, col0, N, 0, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 5, col0, N, 0, BITS, BS, V))
        elif BITS == 5:
            wb = (_ring(gl.int32, [2, BS, BN], R3, STAGES),
                  _ring(gl.int32, [2, BS, BN], R3, STAGES),
                  _ring(gl.int32, [BS, BN], R2, STAGES))
            wp = (_word_ptrs(qw_ptr, word0, 0, col0, N, 2, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 2, col0, N, 2, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 4, col0, N, 0, BITS, BS, V))
        elif BITS == 4:
            wb = (_ring(gl.int32, [4, BS, BN], R3, STAGES),)
            wp = (_word_ptrs(qw_ptr, word0, 0, col0, N, 4, BITS, BS, V),)
        elif BITS == 3:
            wb = (_ring(gl.int32, [BS, BN], R2, STAGES),
                  _ring(gl.int32, [BS, BN], R2, STAGES),
                  _ring(gl.int32, [BS, BN], R2, STAGES))
            wp = (_word_ptrs(qw_ptr, word0, 0, col0, N, 0, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 1, col0, N, 0, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 2, col0, N, 0, BITS, BS, V))
        else:
            wb = (_ring(gl.int32, [BS, BN], R2, STAGES),
                  _ring(gl.int32, [BS, BN], R2, STAGES))
            wp = (_word_ptrs(qw_ptr, word0, 0, col0, N, 0, BITS, BS, V),
                  _word_ptrs(qw_ptr, word0, 1, col0, N, 0, BITS, BS, V))
        return wb, wp

    @gluon.jit
    def _groups(sg_ptr, s0, s_hi, BS: gl.constexpr, V: gl.constexpr, POST: gl.constexpr):
        """The group index of the iteration at s0 (POST: one, else one per step), for `_issue`."""
        CS: gl.constexpr = _copy_scales(V)
        if POST:
            g = gl.load(sg_ptr + s0, mask=s0 < s_hi, other=0)
        else:
            sr = s0 + gl.arange(0, BS, layout=gl.SliceLayout(1, CS))
            g = gl.load(sg_ptr + sr, mask=sr < s_hi, other=0)
        return g

    @gluon.jit
    def _asm2(ASM: gl.constexpr, ops, full):
        """One decoder over the tile: every operand broadcast to `full`, one packed fp16 pair per register."""
        return gl.inline_asm_elementwise(ASM, "=r" + ",r" * (2 * len(ops)), [gl.broadcast(o, full)[0] for o in ops],
                                         dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _codes3(w0, w1, w2, j, q):
        """Register j of lane q of a 3-bit step: rows 4j + q (+16) as their codes | 0x6400 in the two halves. Row
        4j + q (j < 3) is field q of word j; row 12 + q (q < 3) field 4 of word q; row 15 bit 15 of words 0-2.
        j is a register coordinate, so in the registers of j < 3 the compiler keeps one shift and one lop3."""
        c = (gl.where(j == 0, w0, gl.where(j == 1, w1, w2)) >> (3 * q)) & 0x00070007
        last = (gl.where(q == 0, w0, gl.where(q == 1, w1, w2)) >> 12) & 0x00070007
        spread = ((w0 >> 15) & 0x00010001) | ((w1 >> 14) & 0x00020002) | ((w2 >> 13) & 0x00040004)
        return gl.where(j == 3, gl.where(q == 3, spread, last), c) | 0x64006400

    @gluon.jit
    def _decode(wb, stage, sc, zr, full, BITS: gl.constexpr, BS: gl.constexpr, V: gl.constexpr,
                SCALED: gl.constexpr, HAS_ZEROS: gl.constexpr):
        """The step tile [BS, 2, 2, 2, 2, 32, V, 2] of fp16 weights (see `_tile_layout`) from `stage` of the class's
        word rings `wb` (`_word_bufs`); `sc` (`zr`) the packed scales (zeros) when SCALED."""
        qhi = _coord(3, V)
        qlo = _coord(4, V)
        jhi = _coord(1, V)
        jlo = _coord(2, V)
        q = 2 * qhi + qlo
        j = 2 * jhi + jlo
        S: gl.constexpr = 1 | 1 << 5 | 1 << 6  # step and columns: what every word operand depends on
        if BITS == 4:
            w = _words(wb[0].index(stage).reshape([2, 2, BS, 32, V]).permute([2, 0, 1, 3, 4]), S | 6, V)
            if HAS_ZEROS:
                d = _asm2(_D4Z, (w, 4 * q, sc, zr), full)
            elif SCALED:
                d = _asm2(_D4, (w, 4 * q, sc), full)
            else:
                d = _asm2(_D4R, (w, 4 * q), full)
        elif BITS == 8:
            w = _words(wb[0].index(stage).reshape([2, 2, 2, BS, 32, V]).permute([3, 0, 1, 2, 4, 5]), S | 14, V)
            if SCALED:
                d = _asm2(_D8, (w, 0x4140 + qlo * 0x0202, sc), full)
            else:
                d = _asm2(_D8R, (w, 0x4140 + qlo * 0x0202), full)
        elif BITS == 6:
            lo0 = _words(wb[0].index(stage).reshape([2, BS, 32, V]).permute([1, 0, 2, 3]), S | 2, V)
            lo1 = _words(wb[1].index(stage).reshape([2, BS, 32, V]).permute([1, 0, 2, 3]), S | 2, V)
            hi0 = _words(wb[2].index(stage).reshape([BS, 32, V]), S, V)
            hi1 = _words(wb[3].index(stage).reshape([BS, 32, V]), S, V)
            k = 2 * jlo + qhi
            sel_lo = ((4 + k) << 8) | k
            sel_hi = ((4 + j) << 12) | (j << 4)
            if SCALED:
                d = _asm2(_D6, (lo0, lo1, hi0, hi1, sel_lo, 4 * qlo, sel_hi, 4 + 2 * q, sc), full)
            else:
                d = _asm2(_D6R, (lo0, lo1, hi0, hi1, sel_lo, 4 * qlo, sel_hi, 4 + 2 * q), full)
        elif BITS == 5:
            lo0 = _words(wb[0].index(stage).reshape([2, BS, 32, V]).permute([1, 0, 2, 3]), S | 2, V)
            lo1 = _words(wb[1].index(stage).reshape([2, BS, 32, V]).permute([1, 0, 2, 3]), S | 2, V)
            hi = _words(wb[2].index(stage).reshape([BS, 32, V]), S, V)
            k = 2 * jlo + qhi
            sel_lo = ((4 + k) << 8) | k
            sel_hi = ((2 + jhi) << 12) | (jhi << 4)
            if SCALED:
                d = _asm2(_D5, (lo0, lo1, hi, sel_lo, 4 * qlo, sel_hi, 4 + 4 * jlo + q, sc), full)
            else:
                d = _asm2(_D5R, (lo0, lo1, hi, sel_lo, 4 * qlo, sel_hi, 4 + 4 * jlo + q), full)
        elif BITS == 3:
            w0 = _words(wb[0].index(stage).reshape([BS, 32, V]), S, V)
            w1 = _words(wb[1].index(stage).reshape([BS, 32, V]), S, V)
            w2 = _words(wb[2].index(stage).reshape([BS, 32, V]), S, V)
            t = _codes3(w0, w1, w2, j, q)
            if SCALED:
                d = _asm2(_D3, (t, sc), full)
            else:
                d = _asm2(_D3R, (t,), full)
        else:
            gl.static_assert(BITS == 2)
            w0 = _words(wb[0].index(stage).reshape([BS, 32, V]), S, V)
            w1 = _words(wb[1].index(stage).reshape([BS, 32, V]), S, V)
            if SCALED:
                d = _asm2(_D2, (w0, w1, ((4 + j) << 8) | j, 2 * q, sc), full)
            else:
                d = _asm2(_D2R, (w0, w1, ((4 + j) << 8) | j, 2 * q), full)
        return d

    @gluon.jit
    def _mma_step(acc, grp_n, it, stage, nxt, wb, wp, sbuf, zbuf, xbuf, x_ptrs, sc_ptr, zr_ptr, sg_ptr, s_lo, s_hi,
                  N, M, col0, full, BITS: gl.constexpr, HAS_ZEROS: gl.constexpr, BS: gl.constexpr, V: gl.constexpr,
                  STAGES: gl.constexpr, POST: gl.constexpr):
        """Iteration `it` of `_mma_class` (its data in ring `stage`; issues iteration it + STAGES - 1 into `nxt`):
        returns the accumulator and the next issue's groups."""
        BN: gl.constexpr = 32 * V
        K: gl.constexpr = BS * 32
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        async_copy.wait_group(STAGES - 2)
        _barrier()  # every warp's copies of this stage landed, and every warp is done with the stage reused next
        s_next = s_lo + (it + STAGES - 1) * BS
        _issue(wb, sbuf, zbuf, xbuf, nxt, wp, x_ptrs, sc_ptr, zr_ptr, grp_n, s_next, s_lo, s_hi, N, M, col0, BITS,
               HAS_ZEROS, BS, V, POST, 3)
        grp_n = _groups(sg_ptr, s_next + BS, s_hi, BS, V, POST)  # in flight until the next iteration's issue
        xt = xbuf.index(stage).load(A_L)
        if POST:
            row = sbuf.index(stage).reshape([32, V]).load(_row_layout(V))
            row = gl.convert_layout(gl.reshape(gl.permute(row, (1, 0)), [BN]), gl.SliceLayout(0, MMA),
                                    assert_trivial=True)
            d = _decode(wb, stage, full, full, full, BITS, BS, V, False, False)
        else:
            S: gl.constexpr = 1 | 1 << 5 | 1 << 6
            sc = _widen(_pair_bits(sbuf.index(stage).reshape([BS, 32, V]).load(_sub(S, V))), S)
            zr = sc
            if HAS_ZEROS:
                zr = _widen(_pair_bits(zbuf.index(stage).reshape([BS, 32, V]).load(_sub(S, V)) + 1024.0), S)
            d = _decode(wb, stage, sc, zr, full, BITS, BS, V, True, HAS_ZEROS)
        # rows s·32 + 8j + 2q + h (the input's positions), columns v·32 + c
        b = gl.reshape(gl.permute(d, (0, 1, 2, 3, 4, 7, 6, 5)), [K, BN])
        b = gl.convert_layout(b, B_L, assert_trivial=True)
        if POST:
            part = mma_v2(xt, b, gl.zeros([16, BN], gl.float32, MMA))
            acc += part * gl.expand_dims(row.to(gl.float32), 0)
        else:
            acc = mma_v2(xt, b, acc)
        return acc, grp_n

    @gluon.jit
    def _class_bound(x, first_word, n_steps, BITS: gl.constexpr, BS: gl.constexpr):
        """The first step of a class (counted from its start) whose first word lies at or past word x of the
        matrix, rounded up to a whole iteration of BS steps (so POST's iterations stay inside groups)."""
        return gl.minimum(n_steps, gl.cdiv(gl.maximum(x - first_word, 0), BITS * BS) * BS)

    @gluon.jit
    def _mma_class(acc, sbuf, zbuf, xbuf, x_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, M, N, stride_xm, col0,
                   w_lo, w_hi, first_step, n_steps, first_word, BITS: gl.constexpr, HAS_ZEROS: gl.constexpr,
                   BS: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, POST: gl.constexpr,
                   PDL: gl.constexpr = False):
        """acc += this program's share of x · W over one width class (its steps whose first word lies in the
        program's word range [w_lo, w_hi), see `_mma_tile`): BS steps of 32 rows per iteration, words,
        scales and input brought to shared memory by cp.async STAGES - 1 iterations ahead. POST (every
        iteration's steps share one group, no zeros): the codes enter the mma as exact (code - zero point) and
        each iteration's product is scaled in fp32 (4·V multiplies a thread instead of one per weight pair).
        With PDL (the kernel's first class) the first iterations' weights and scales, which no kernel writes, are
        requested before waiting for the previous kernel, and only the input after."""
        K: gl.constexpr = BS * 32
        T8: gl.constexpr = _tile_layout(V)
        CX: gl.constexpr = _copy_input(BS)

        s_lo = first_step + _class_bound(w_lo, first_word, n_steps, BITS, BS)
        s_hi = first_step + _class_bound(w_hi, first_word, n_steps, BITS, BS)
        word0 = first_word + (s_lo - first_step) * BITS
        wb, wp = _word_bufs(qw_ptr, word0, col0, N, BITS, BS, V, STAGES)
        xm = gl.arange(0, 16, layout=gl.SliceLayout(1, CX))
        x_ptrs = (x_ptr + gl.expand_dims(xm * stride_xm, 1)
                  + gl.expand_dims(s_lo * 32 + gl.arange(0, K, layout=gl.SliceLayout(0, CX)), 0))
        for p in gl.static_range(STAGES - 1):
            grp = _groups(sg_ptr, s_lo + p * BS, s_hi, BS, V, POST)
            _issue(wb, sbuf, zbuf, xbuf, p, wp, x_ptrs, sc_ptr, zr_ptr, grp, s_lo + p * BS, s_lo, s_hi, N, M, col0,
                   BITS, HAS_ZEROS, BS, V, POST, 1 if PDL else 3)
        if PDL:
            _pdl_sync()
            for p in gl.static_range(STAGES - 1):
                _issue(wb, sbuf, zbuf, xbuf, p, wp, x_ptrs, sc_ptr, zr_ptr, 0, s_lo + p * BS, s_lo, s_hi, N, M, col0,
                       BITS, HAS_ZEROS, BS, V, POST, 2)
        grp_n = _groups(sg_ptr, s_lo + (STAGES - 1) * BS, s_hi, BS, V, POST)

        full = gl.full([BS, 2, 2, 2, 2, 32, V, 2], 0, gl.int32, T8)
        n_it = gl.cdiv(s_hi - s_lo, BS)
        for it in range(0, n_it):
            acc, grp_n = _mma_step(acc, grp_n, it, it % STAGES, (it + STAGES - 1) % STAGES, wb, wp, sbuf, zbuf,
                                   xbuf, x_ptrs, sc_ptr, zr_ptr, sg_ptr, s_lo, s_hi, N, M, col0, full, BITS,
                                   HAS_ZEROS, BS, V, STAGES, POST)
        async_copy.wait_group(0)
        _barrier()  # the next class reuses the rings
        return acc

    @gluon.jit
    def _mma_tile(pid_n, pid_k, x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                  M, N, stride_xm, stride_om, SPLIT, n8, n6, n5, n4, n3, n2,
                  MASK: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_ON: gl.constexpr,
                  BS: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, POST: gl.constexpr,
                  PDL: gl.constexpr = False, PART_ONLY: gl.constexpr = False):
        """out[:M, tile] (or this split's partial) = x · W over a tile of BN = 32·V columns: each width class of
        MASK (bit i: WIDTHS[i], n8..n2 their step counts, classes stored in that order) in turn, one accumulator;
        PDL: launched as a programmatic dependent (the first class waits, see `_mma_class`). PART_ONLY (split, no
        bias): only this split's partial, for a consumer that adds them (`SplitSum`).
        The fragment's column n is stored column (n % 32)·V + n // 32 of the tile, so each thread's V columns are
        adjacent in memory (one V-word read per word row)."""
        gl.static_assert(gl.num_warps() == 4)
        BN: gl.constexpr = 32 * V
        K: gl.constexpr = BS * 32
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        O_L: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XS: gl.constexpr = gl.SwizzledSharedLayout(8, max(1, 64 // K), 8, [1, 0])

        col0 = pid_n * BN
        sbuf = _ring(gl.float16, [1 if POST else BS, BN], PLAIN, STAGES)
        zbuf = _ring(gl.float16, [BS, BN], PLAIN, STAGES if HAS_ZEROS else 1)
        xbuf = _ring(gl.float16, [16, K], XS, STAGES)

        acc = gl.zeros([16, BN], gl.float32, MMA)
        steps = (n8, n6, n5, n4, n3, n2)
        # The K split cuts the matrix's words (all classes, stored one after another) into equal runs, so a
        # program of a mixed-width matrix mostly walks one class: each class it touches costs a pipeline fill
        # and drain, where a share of every class cost one per class.
        words = n8 * 8 + n6 * 6 + n5 * 5 + n4 * 4 + n3 * 3 + n2 * 2
        w_lo = (words * pid_k) // SPLIT
        w_hi = (words * (pid_k + 1)) // SPLIT
        s0 = 0
        w0 = 0
        for c in gl.static_range(6):
            if MASK >> c & 1:
                # A class this program has no steps of is skipped: its empty loop would still fill and drain the
                # rings (the first class present still waits for the previous kernel).
                if MASK == 1 << c:
                    run = True
                else:
                    run = (_class_bound(w_hi, w0, steps[c], _width(c), BS)
                           > _class_bound(w_lo, w0, steps[c], _width(c), BS))
                if run:
                    acc = _mma_class(acc, sbuf, zbuf, xbuf, x_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, M, N, stride_xm,
                                     col0, w_lo, w_hi, s0, steps[c], w0, _width(c), HAS_ZEROS, BS, V, STAGES, POST,
                                     PDL and (MASK & ((1 << c) - 1)) == 0)
                elif PDL and (MASK & ((1 << c) - 1)) == 0:
                    _pdl_sync()
            s0 += steps[c]
            w0 += steps[c] * _width(c)

        res = gl.convert_layout(acc, O_L)
        om = gl.arange(0, 16, layout=gl.SliceLayout(1, O_L))
        on_ = gl.arange(0, BN, layout=gl.SliceLayout(0, O_L))
        on = pid_n * BN + (on_ % 32) * V + on_ // 32
        mask = gl.expand_dims(om < M, 1) & gl.expand_dims(on < N, 0)
        o_ptrs = out_ptr + gl.expand_dims(om, 1).to(gl.int64) * stride_om + gl.expand_dims(on, 0)
        if not SPLIT_ON:
            if HAS_BIAS:
                res += gl.expand_dims(gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32), 0)
            gl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # as `matmul_launch.store_tile`: publish the partial; the last program of the tile adds them all up
            p_off = gl.expand_dims(om, 1).to(gl.int64) * N + gl.expand_dims(on, 0)
            gl.store(part_ptr + pid_k * M * N + p_off, res, mask=mask)
            if not PART_ONLY:
                _barrier()
                count = gl.atomic_add(cnt_ptr + pid_n, 1)
                if count == SPLIT - 1:
                    tot = gl.zeros([16, BN], gl.float32, O_L)
                    for i in range(0, SPLIT):
                        tot += gl.load(part_ptr + i * M * N + p_off, mask=mask, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        tot += gl.expand_dims(gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32), 0)
                    gl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=mask)
                    gl.atomic_xchg(cnt_ptr + pid_n, 0)

    @gluon.jit
    def _pick3(sel, a, b, c):
        """Member sel's value (pointer or size) of a group."""
        return gl.where(sel == 2, c, gl.where(sel == 1, b, a))

    @gluon.jit
    def _pdl_sync():
        """`backend.pdl_sync` in Gluon: wait for the previous kernel's writes, then let the next one launch."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _mma_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                    M, N, stride_xm, stride_om, SPLIT, n8, n6, n5, n4, n3, n2,
                    MASK: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_ON: gl.constexpr,
                    BS: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, POST: gl.constexpr,
                    PDL: gl.constexpr = False, PART_ONLY: gl.constexpr = False):
        _mma_tile(gl.program_id(0), gl.program_id(1), x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr,
                  zr_ptr, sg_ptr, M, N, stride_xm, stride_om, SPLIT, n8, n6, n5, n4, n3, n2, MASK, HAS_ZEROS,
                  HAS_BIAS, SPLIT_ON, BS, V, STAGES, POST, PDL, PART_ONLY)

    @gluon.jit
    def _mma_group_kernel(x_ptr, M, stride_xm,
                          x0, o0, p0, c0, b0, q0, s0, z0, g0, N0, SP0, n8_0, n6_0, n5_0, n4_0, n3_0, n2_0, P0,
                          x1, o1, p1, c1, b1, q1, s1, z1, g1, N1, SP1, n8_1, n6_1, n5_1, n4_1, n3_1, n2_1, P1,
                          x2, o2, p2, c2, b2, q2, s2, z2, g2, N2, SP2, n8_2, n6_2, n5_2, n4_2, n3_2, n2_2,
                          THREE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
                          ON0: gl.constexpr, ON1: gl.constexpr, ON2: gl.constexpr, BS: gl.constexpr,
                          V: gl.constexpr, STAGES: gl.constexpr, POST0: gl.constexpr, POST1: gl.constexpr,
                          POST2: gl.constexpr, MASK0: gl.constexpr, MASK1: gl.constexpr, MASK2: gl.constexpr,
                          PDL: gl.constexpr = False, ONE_BODY: gl.constexpr = False):
        """`_mma_kernel` for 2-3 weights sharing one input (q/k/v, gate/up) in one launch: programs [0, P0) take
        weight 0 (tile pid // SP0, split pid % SP0), [P0, P0 + P1) weight 1, the rest weight 2. x0..x2 point at
        each weight's permuted input inside one buffer; n8_i..n2_i weight i's step counts per width. ONE_BODY
        (members agreeing on ON and POST): one inlined tile body over the union of their widths, the member's
        pointers and sizes picked at run time, instead of a copy a member (`gemv.GEMV_GROUP_SELECT`)."""
        pid = gl.program_id(0)
        if ONE_BODY:
            sel = (pid >= P0).to(gl.int32)
            first = gl.where(sel == 1, P0, 0)
            if THREE:
                sel += (pid >= P0 + P1).to(gl.int32)
                first = gl.where(sel == 2, P0 + P1, first)
            pid -= first
            n = _pick3(sel, N0, N1, N2)
            sp = _pick3(sel, SP0, SP1, SP2)
            _mma_tile(pid // sp, pid % sp, _pick3(sel, x0, x1, x2), _pick3(sel, o0, o1, o2), _pick3(sel, p0, p1, p2),
                      _pick3(sel, c0, c1, c2), _pick3(sel, b0, b1, b2), _pick3(sel, q0, q1, q2),
                      _pick3(sel, s0, s1, s2), _pick3(sel, z0, z1, z2), _pick3(sel, g0, g1, g2), M, n, stride_xm, n,
                      sp, _pick3(sel, n8_0, n8_1, n8_2), _pick3(sel, n6_0, n6_1, n6_2), _pick3(sel, n5_0, n5_1, n5_2),
                      _pick3(sel, n4_0, n4_1, n4_2), _pick3(sel, n3_0, n3_1, n3_2), _pick3(sel, n2_0, n2_1, n2_2),
                      MASK0 | MASK1 | MASK2, HAS_ZEROS, HAS_BIAS, ON0, BS, V, STAGES, POST0, PDL)
        elif pid < P0:
            _mma_tile(pid // SP0, pid % SP0, x0, o0, p0, c0, b0, q0, s0, z0, g0, M, N0, stride_xm, N0, SP0,
                      n8_0, n6_0, n5_0, n4_0, n3_0, n2_0, MASK0, HAS_ZEROS, HAS_BIAS, ON0, BS, V, STAGES, POST0, PDL)
        else:
            pid -= P0
            if THREE:
                if pid < P1:
                    _mma_tile(pid // SP1, pid % SP1, x1, o1, p1, c1, b1, q1, s1, z1, g1, M, N1, stride_xm, N1, SP1,
                              n8_1, n6_1, n5_1, n4_1, n3_1, n2_1, MASK1, HAS_ZEROS, HAS_BIAS, ON1, BS, V, STAGES,
                              POST1, PDL)
                else:
                    pid -= P1
                    _mma_tile(pid // SP2, pid % SP2, x2, o2, p2, c2, b2, q2, s2, z2, g2, M, N2, stride_xm, N2, SP2,
                              n8_2, n6_2, n5_2, n4_2, n3_2, n2_2, MASK2, HAS_ZEROS, HAS_BIAS, ON2, BS, V, STAGES,
                              POST2, PDL)
            else:
                _mma_tile(pid // SP1, pid % SP1, x1, o1, p1, c1, b1, q1, s1, z1, g1, M, N1, stride_xm, N1, SP1,
                          n8_1, n6_1, n5_1, n4_1, n3_1, n2_1, MASK1, HAS_ZEROS, HAS_BIAS, ON1, BS, V, STAGES, POST1,
                          PDL)


def class_steps(w) -> tuple[int, list[int]]:
    """(MASK, step count per width of WIDTHS) of w's classes, as the kernels take them. The classes must be
    stored in WIDTHS order from step 0 and word 0 (`qweight.build` does so)."""
    mask, steps = 0, [0] * len(WIDTHS)
    for c in w.classes:
        i = WIDTHS.index(c.bits)
        mask |= 1 << i
        steps[i] = c.n_steps
    return mask, steps


def supports(w, m: int) -> bool:
    """Whether `mma` can run this call: 1-16 rows of an EXL2 matrix (any widths) or a 4-bit GPTQ one (zeros), with
    a width that keeps its scale rows 16-byte aligned, on a CUDA GPU with tensor cores (sm_80+) and Gluon."""
    if not HAVE_GLUON or not 0 < m <= 16 or w.n % 8:
        return False
    if w.zeros is not None and (len(w.classes) != 1 or w.classes[0].bits != 4):
        return False
    if "mma_layout" not in w._cache:  # classes in WIDTHS order from step 0 and word 0, as the kernel walks them
        step = word = 0
        ok = True
        for c in sorted(w.classes, key=lambda c: WIDTHS.index(c.bits)):
            ok &= c.first_step == step and c.first_word == word
            step, word = step + c.n_steps, word + c.n_steps * c.bits
        w._cache["mma_layout"] = ok
    if not w._cache["mma_layout"]:
        return False
    dev = w.qweight.device
    if dev.type != "cuda":
        return False
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SM80:
        _SM80[idx] = torch.cuda.get_device_capability(idx)[0] >= 8
    return _SM80[idx]


_SM80: dict[int, bool] = {}


def groups_align(w, bs: int) -> bool:
    """Whether every aligned run of `bs` steps of each of w's classes lies in one quantization group (then the
    kernel scales after the mma, `POST`). Checked once per (weight, bs) on the host; during CUDA graph capture an
    unchecked weight answers False (the per-weight scaling is always correct)."""
    key = ("groups_align", bs)
    if key not in w._cache:
        if w.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        ok = True
        for c in w.classes:
            sg = w.step_group[c.first_step:c.first_step + c.n_steps].cpu()
            ok &= c.n_steps % bs == 0 and bool((sg.view(-1, bs) == sg.view(-1, bs)[:, :1]).all())
        w._cache[key] = ok
    return w._cache[key]


def _operands(xp: torch.Tensor, w, split: int, bs: int, post: bool | None):
    """(output, split-K partials, bias, zeros, post) of one weight's launch; absent bias and zeros are stood in
    for by the scales (the kernel never reads them)."""
    m = xp.shape[0]
    out = torch.empty((m, w.n), dtype=xp.dtype, device=xp.device)
    part = torch.empty((split, m, w.n), dtype=torch.float32, device=xp.device) if split > 1 else out
    if post is None:
        post = w.zeros is None and groups_align(w, bs)
    return (out, part, w.bias if w.bias is not None else w.scales, w.zeros if w.zeros is not None else w.scales,
            post)


def mma(xp: torch.Tensor, w, bs: int = 4, v: int = 2, split: int = 1, stages: int = 3,
        post: bool | None = None, part_only: bool = False) -> torch.Tensor | SplitSum:
    """`xp · W + bias` for xp `[M ≤ 16, S·32]` fp16, the input permuted for w (`gather_input`). bs steps of 32 rows
    per iteration, 32·v columns per program, K split `split` ways, a ring of `stages` iterations in shared memory;
    `post` scales after the mma (None: where `groups_align` and w has no zeros). `part_only` (split > 1, no bias):
    the split's partial sums as a `SplitSum`, not added."""
    part_only = part_only and split > 1 and w.bias is None
    out, part, bias, zeros, post = _operands(xp, w, split, bs, post)
    mask, steps = class_steps(w)
    _mma_kernel[(triton.cdiv(w.n, 32 * v), split)](
        xp, out, part, counters(xp.device), bias, w.qweight, w.scales, zeros, w.step_group,
        xp.shape[0], w.n, xp.stride(0), out.stride(0), split, *steps,
        MASK=mask, HAS_ZEROS=w.zeros is not None, HAS_BIAS=w.bias is not None, SPLIT_ON=split > 1, BS=bs, V=v,
        STAGES=stages, POST=post, PART_ONLY=part_only, num_warps=4,
        **pdl_args(xp.device, xp.shape[0]))
    return SplitSum(part, (xp.shape[0],)) if part_only else out


def mma_group(xp: torch.Tensor, ws, offsets, bs: int = 4, v: int = 2, splits=None, stages: int = 3,
              one_body: bool = False) -> list[torch.Tensor]:
    """`[xp_i · W_i + bias_i]` for 2-3 weights `supports` accepts, in one launch: xp `[M ≤ 16, ...]` holds each
    weight's permuted input at column `offsets[i]` (`gather_input(whole=True)`); `splits` the K split of each
    (default 1). The weights must agree on zeros and bias being present. `one_body`: where they mix widths and
    agree on the split being on and on the scale's place, the kernel inlines one tile body for all of them."""
    m = xp.shape[0]
    splits = list(splits or [1] * len(ws))
    cnt = counters(xp.device)
    args, tile0, programs = [], 0, []
    outs, flags, posts, masks = [], [], [], []
    for w, off, split in zip(ws, offsets, splits):
        tiles = triton.cdiv(w.n, 32 * v)
        out, part, bias, zeros, post = _operands(xp, w, split, bs, None)
        mask, steps = class_steps(w)
        args += [xp[:, off:], out, part, cnt[tile0:], bias, w.qweight, w.scales, zeros, w.step_group, w.n, split,
                 *steps]
        programs.append(tiles * split)
        args.append(tiles * split)
        tile0 += tiles
        outs.append(out)
        flags.append(split > 1)
        posts.append(post)
        masks.append(mask)
    three = len(ws) == 3
    if not three:  # a never-taken third slot
        args += args[-18:-1]
        flags.append(False)
        posts.append(False)
        masks.append(masks[-1])
    else:
        args.pop()
    _mma_group_kernel[(sum(programs),)](
        xp, m, xp.stride(0), *args, THREE=three, HAS_ZEROS=ws[0].zeros is not None,
        HAS_BIAS=ws[0].bias is not None, ON0=flags[0], ON1=flags[1], ON2=flags[2], BS=bs, V=v, STAGES=stages,
        POST0=posts[0], POST1=posts[1], POST2=posts[2], MASK0=masks[0], MASK1=masks[1], MASK2=masks[2],
        ONE_BODY=one_body and len(set(flags[:len(ws)])) == 1 and len(set(posts[:len(ws)])) == 1
        and mixed_widths(masks[0] | masks[1] | masks[2]),
        num_warps=4, **pdl_args(xp.device, m))
    return outs
