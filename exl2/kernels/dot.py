"""The Triton tensor-core kernel for 5–64 rows of `x · W + bias` where the Gluon kernel (`mma_dot`) does not run:
codes decoded one row-in-word at a time, so each decoded [steps·words, BN] tile feeds `tl.dot` from its own
register layout, bit-exact with the reference dequantizer (EXL2 4-bit: all eight rows of a word per packed-fp16 asm
call). Reads the permuted input (`permute.gather_input`).
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import pdl_sync, tl, triton
from exl2.kernels.gemv import fast4_available
from exl2.kernels.matmul_launch import MatmulConfig, launch, store_tile
from exl2.kernels.packed_tiles import PTX_UNPACK4_CONSTANTS, code3, load_class, ptx_unpack4, words3
from exl2.kernels.permute import permuted_for
from exl2.kernels.qweight import QuantWeight


# The 4-bit EXL2 decoder of the tensor-core path: one word and its scale in, the word's 8 dequantized weights
# out (row-in-word order), 4 packed operations per pair of codes instead of ~6 scalar ones per code. Codes (u,
# u+4) come out as in `_WORDS4_ASM`; (code - 8) is exact in fp16, so the one rounding (the scale product) is
# the reference dequantizer's.
_DEQ4_ASM = tl.constexpr("""
{
.reg .b32 q0, q1, q2, q3, s, z, c, d, sc;""" + PTX_UNPACK4_CONSTANTS + """
mov.b32 sc, {$9, $9};""" + ptx_unpack4("$8") + """
mul.rn.f16x2 q0, q0, sc;
mul.rn.f16x2 q1, q1, sc;
mul.rn.f16x2 q2, q2, sc;
mul.rn.f16x2 q3, q3, sc;
mov.b32 {$0, $4}, q0;
mov.b32 {$1, $5}, q1;
mov.b32 {$2, $6}, q2;
mov.b32 {$3, $7}, q3;
}
""")


@triton.jit
def _dot_u(acc, deq, xt, u: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, K: tl.constexpr,
           BN: tl.constexpr):
    """acc + (the input columns of row-in-word u) · (the decoded [.., BN] rows of row-in-word u)."""
    pp = tl.arange(0, PER)
    if BITS == 4:
        sel = pp == (u % 4) * 2 + u // 4
    else:
        sel = pp == u
    xu = tl.sum(tl.where(sel[None, None, :], xt, 0.0), axis=2)
    return tl.dot(xu, tl.reshape(deq, [K, BN]), acc)


@triton.jit
def _dot_x(x_ptr, stride_xm, offs_m, mask_m, s0, s_hi, LB: tl.constexpr, PER: tl.constexpr, BSC: tl.constexpr,
           BITS: tl.constexpr = 0):
    """Input tile [BM, BSC·LB, PER] of BSC steps from s0, indexed (step·LB + low word, row-in-word): one contiguous
    run of PER positions per word for 8-bit (stored order) and 4-bit classes; in the 6/5/3/2-bit classes'
    `PAIR_ORDER16`, word j, row u sits at position 16·(j % 2) + 2u + j // 2 (LB = 4) or 2u + j (LB = 2)."""
    offs = s0 * 32 + tl.arange(0, BSC * 32)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs[None, :]
    t = tl.load(ptrs, mask=mask_m[:, None] & (offs < s_hi * 32)[None, :], other=0.0).to(tl.float16)
    BM: tl.constexpr = offs_m.shape[0]
    if BITS == 6 or BITS == 5:
        t = tl.permute(tl.reshape(t, [BM, BSC, 2, PER, 2]), (0, 1, 4, 2, 3))  # (m, s, j // 2, j % 2, u)
    elif BITS == 3 or BITS == 2:
        t = tl.permute(tl.reshape(t, [BM, BSC, PER, 2]), (0, 1, 3, 2))  # (m, s, j, u)
    return tl.reshape(t, [BM, BSC * LB, PER])


@triton.jit
def _deq_row(w, h, row0, zero, sc, u: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr):
    """Row-in-word u of low words w, dequantized; its HB high bits sit in h at bit HB·((row0 + u) % (32 / HB)),
    row0 the word's first row (broadcast against w; 0 where h is already shifted to it). 0x6400 | code is the
    fp16 number 1024 + code, exact, so the one rounding (the scale product) is the reference dequantizer's;
    `zero` is 1024 + the zero point."""
    HPER: tl.constexpr = 32 // HB if HB > 0 else 32
    if LB == 2 and HB == 1:  # 3-bit: w holds words 0-1 and h word 2 (`words3`); row0 + u is the stored row
        w0, w1, w2 = words3(w, h)
        code = code3(w0, w1, w2, row0 + u)
    else:
        code = (w >> (u * LB)) & ((1 << LB) - 1)
    if HB > 0 and not (LB == 2 and HB == 1):
        code = code | (((h >> (HB * ((row0 + u) % HPER))) & ((1 << HB) - 1)) << LB)
    cf = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return (cf - zero) * sc


@triton.jit
def _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps,
               first_word, pid_k, offs_m, offs_n, mask_n, SPLIT, BITS: tl.constexpr,
               LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
               BN: tl.constexpr, FAST4: tl.constexpr = False):
    """acc + x·W over this program's share of one width class's steps.

    The codes are decoded one row-in-word u at a time: the rows (s, j, u) of all steps s and low words j form a
    [BS·LB, BN] tile in the words' own register layout (no reshuffling of the decoded tile), which feeds one
    tensor-core dot against the matching input columns. Those are picked out of the input tile, loaded once per
    iteration (and one iteration ahead) with one-hot sums over its last axis. EXL2 4-bit words (FAST4) are
    decoded by `_DEQ4_ASM`, all eight rows at once."""
    PER: tl.constexpr = 32 // LB
    BSC: tl.constexpr = BS if BS * LB >= 16 else 16 // LB
    s_lo = first_step + (n_steps * pid_k) // SPLIT
    s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT
    mask_m = offs_m < M
    jj = tl.arange(0, LB)
    row0 = (jj * PER)[None, :, None]
    zero: tl.constexpr = 1024.0 + (1 << (BITS - 1))
    xt_n = _dot_x(x_ptr, stride_xm, offs_m, mask_m, s_lo, s_hi, LB, PER, BSC, BITS)
    for s0 in range(s_lo, s_hi, BSC):
        xt = xt_n
        xt_n = _dot_x(x_ptr, stride_xm, offs_m, mask_m, s0 + BSC, s_hi, LB, PER, BSC, BITS)
        w, h, sc, z = load_class(qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, s0, s_hi, first_step, first_word, jj, offs_n,
                                  mask_n, BITS, LB, HB, HAS_ZEROS, BSC)
        if BITS == 4 and (FAST4 & 1) != 0 and not HAS_ZEROS:
            d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
                _DEQ4_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, sc.to(tl.float16)], dtype=(tl.float16,) * 8,
                is_pure=True, pack=1)
            acc = _dot_u(acc, d0, xt, 0, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d1, xt, 1, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d2, xt, 2, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d3, xt, 3, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d4, xt, 4, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d5, xt, 5, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d6, xt, 6, BITS, PER, BSC * LB, BN)
            acc = _dot_u(acc, d7, xt, 7, BITS, PER, BSC * LB, BN)
        else:
            for u in tl.static_range(PER):
                deq = _deq_row(w, h, row0, zero if not HAS_ZEROS else z + 1024.0, sc, u, LB, HB)
                acc = _dot_u(acc, deq, xt, u, BITS, PER, BSC * LB, BN)
    return acc


@triton.jit
def _dot_kernel(x_ptr, x32_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                M, N, stride_xm, stride_om, SPLIT,
                fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2,
                HAS8: tl.constexpr, HAS6: tl.constexpr, HAS5: tl.constexpr, HAS4: tl.constexpr,
                HAS3: tl.constexpr, HAS2: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                SPLIT_ON: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                RED: tl.constexpr, FAST4: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:
        pdl_sync()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if HAS8:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 8, 8, 0, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS6:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs6, ns6, fw6,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 6, 4, 2, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS5:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs5, ns5, fw5,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 5, 4, 1, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS4:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs4, ns4, fw4,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 4, 4, 0, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS3:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs3, ns3, fw3,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 3, 2, 1, HAS_ZEROS, BM, BS, BN, FAST4)
    if HAS2:
        acc = _dot_class(acc, x_ptr, stride_xm, M, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs2, ns2, fw2,
                         pid_k, offs_m, offs_n, mask_n, SPLIT, 2, 2, 0, HAS_ZEROS, BM, BS, BN, FAST4)
    store_tile(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, cnt_ptr, bias_ptr,
               pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT, HAS_BIAS, SPLIT_ON, RED)


def dot(x: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, xp: torch.Tensor | None = None,
        fast4: bool | None = None) -> torch.Tensor:
    """Tensor-core path with in-register dequantization; cfg.bm ≥ 16 and cfg.bs ≥ 1. `fast4` as in `gemv`."""
    return permuted_dot(permuted_for(x, w, xp), w, cfg, fast4)


def permuted_dot(xp: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, fast4: bool | int | None = None
                 ) -> torch.Tensor:
    """`dot` on the permuted input xp."""
    fast4 = fast4_available(xp.device) if fast4 is None else fast4
    return launch(_dot_kernel, xp, w, cfg, fast4, rows=cfg.bm)
