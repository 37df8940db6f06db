"""The CUDA-core gemv for 1–4 rows of `x · W + bias`, W a `QuantWeight` (EXL2 or GPTQ): one permuted input row a
program (`permute.gather_input`), each program owning BN output columns and a 1/SPLIT share of the matrix's word
rows (`_word_share`). The loop is a plain `tl.range` that Triton software-pipelines `num_stages` tiles deep through
shared memory (cp.async). EXL2 classes of every width decode two codes per instruction in packed fp16 (inline PTX,
behind a one-time self-check per width, `fast4_available`); GPTQ (zero tensors) and any width whose check failed
shift, mask and use the 2^23 exponent trick in fp32. `GemvGroup` runs the gemvs of 2–3 weights sharing an input
(q/k/v, gate/up) as one launch.
"""
from __future__ import annotations

import struct
from typing import Sequence

import torch

from exl2.kernels.backend import (PREFETCH_ROWS, counters, env_choice, next_pow2, pdl_args, pdl_sync, prefetch_l2,
                                  prefetch_l2_where, sm_count, tl, triton)
from exl2.kernels.matmul_launch import (PACKED_FLAG, MatmulConfig, auto_split, class_args, launch, mixed_widths,
                                        pairs_view, store_tile, width_mask)
from exl2.kernels.packed_tiles import (PTX_UNPACK4_CONSTANTS, code3, load_class, ptx_unpack4, step_rows, step_scales,
                                      words3)
from exl2.kernels.permute import buffer_offsets, gather_input, input_layout, permuted_for
from exl2.kernels.qweight import QuantWeight, matmul_torch
from exl2.kernels.split_sum import SplitSum

# EXL2_GEMV_PREFETCH_MASKED=1 (off): the L2 prefetch before the PDL wait asks only for the lines of the program's
# own rows, where the plain one sends its masked-off lanes (rows past the share) to the weight's first line;
# mixed-width weights then prefetch too (`prefetch_rows`). Measured neutral on the mixed bench body before programs
# skipped their empty classes (H100: 328-329 tok/s either way, benchmarks/RESULTS.md session 26).
PREFETCH_MASKED = env_choice("EXL2_GEMV_PREFETCH_MASKED", 0, range(0, 2)) == 1
_PREFETCH_MASKED = tl.constexpr(PREFETCH_MASKED)
# Software-pipelining depth of the gemv loop (EXL2_GEMV_STAGES).
GEMV_STAGES = env_choice("EXL2_GEMV_STAGES", 3, range(1, 6))
# K splits of the grouped gemv (q/k/v, gate/up) up to about this many programs per SM (EXL2_GEMV_GROUP_PER_SM):
# 4 splits q/k/v 4 ways instead of 2 (9.1 -> 8.2 us on the H200) and leaves gate/up unsplit (session 11).
GROUP_PER_SM = env_choice("EXL2_GEMV_GROUP_PER_SM", 4, range(1, 9))
# 32-row steps an iteration and warps a program of the one-row gemvs (EXL2_GEMV_BS, EXL2_GEMV_WARPS): the H100
# sweep found 8 and 4 best (session 23, bandwidth-bound there); on the H200 the gemv is issue-bound (session 28),
# where 16 steps spread the loop's overhead over twice the words and 8 warps give the schedulers twice the warps.
GEMV_BS = env_choice("EXL2_GEMV_BS", 8, (4, 8, 16))
GEMV_WARPS = env_choice("EXL2_GEMV_WARPS", 4, (4, 8))
# Columns a program of the grouped gemv and of the one-row gemv on matrices narrower than the SMs' 128-column tiles
# (EXL2_GEMV_BN): 32 doubles the programs over the same K, more warps for the H200's issue-bound gemv without
# the partial sums of a deeper K split.
GEMV_BN = env_choice("EXL2_GEMV_BN", 64, (32, 64))
# EXL2_GEMV_NARROW (1, on): a grouped gemv of one width whose 64-column tiles number fewer than the SMs (q/k/v of
# an 8B model) runs 32-column tiles, 16 steps an iteration and K split to ~2 programs an SM instead: the q/k/v gemv
# of the synthetic 8B took 7.90 against 8.85 µs from DRAM (H100, benchmarks/RESULTS.md session 31), gate/up (448
# tiles) lost 4 % with the same setting. End to end (session 32, H100): 4-bit body at batch 1 +2.5 % (416/418 ->
# 427/428 tok/s), but a 5/4/3-bit body -4 % (371 -> 357), so mixed-width groups keep the defaults.
GEMV_NARROW = env_choice("EXL2_GEMV_NARROW", 1, range(0, 2)) == 1
# EXL2_GEMV_RPF=1 (off): the packed 4-bit loop loads the next iteration's words, scales and input pairs straight
# into registers instead of Triton's cp.async ring through shared memory: no shared-memory loads, commits, waits or
# barriers in the loop (the H200's issue-bound gemv spent ~30 of its 335 instructions an iteration and most of
# its barrier stalls on the ring, benchmarks/RESULTS.md session 28), the global loads' latency hidden by one
# iteration of decoding instead.
GEMV_RPF = env_choice("EXL2_GEMV_RPF", 0, range(0, 2)) == 1
_GEMV_RPF = tl.constexpr(GEMV_RPF)
# EXL2_GEMV_GROUP_SELECT (on; 0 turns it off): a grouped gemv of mixed widths inlines its member body once, the
# member's pointers picked at run time, where it inlined one copy a member (2-3) of every width's pipelined loop: the
# 5/4/3-bit q/k/v kernel's code 97 KB -> 33 KB (sm_90). ncu found that kernel stalled most on instruction fetch
# (no_instruction 4.2 a issue, its top stall; H100, benchmarks/RESULTS.md session 32). H100, session 33: the 5/4/3
# body 369 -> 382 tok/s at batch 1 and 4,177-4,203 -> 4,333 at batch 16; the option-table body 393 -> 396-400 and
# 4,173 -> 4,153-4,157. The Gluon group kernel (batches 2-16, `mma_dot.mma_group(one_body=...)`) takes the switch.
GEMV_GROUP_SELECT = env_choice("EXL2_GEMV_GROUP_SELECT", 1, range(0, 2)) == 1


@triton.jit
def _share(first_step, n_steps, first_word, w_lo, w_hi, BITS: tl.constexpr):
    """The steps [s_lo, s_hi) of one width class whose first word lies in this program's words [w_lo, w_hi)
    (`_word_share`)."""
    s_lo = first_step + tl.minimum(n_steps, tl.cdiv(tl.maximum(w_lo - first_word, 0), BITS))
    s_hi = first_step + tl.minimum(n_steps, tl.cdiv(tl.maximum(w_hi - first_word, 0), BITS))
    return s_lo, s_hi


@triton.jit
def _has_share(first_step, n_steps, first_word, w_lo, w_hi, BITS: tl.constexpr, MIXED: tl.constexpr):
    """Whether this program has steps of the class (`_share`); always for a one-width kernel. A mixed-width program
    branches past the loops of the classes it has no steps of: a pipelined loop of no iterations still runs its
    prologue's masked loads and waits, and a split mixed matrix leaves most classes empty in most programs."""
    if MIXED:
        s_lo, s_hi = _share(first_step, n_steps, first_word, w_lo, w_hi, BITS)
        return s_hi > s_lo
    else:
        return True


@triton.jit
def _word_share(fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2, pid_k,
                SPLIT):
    """Where K is split, program pid_k takes the word rows [w_lo, w_hi) of the matrix, an equal share of all of
    them, and of each class the steps starting there: a program mostly walks one width class in one long loop
    instead of a short loop in every class (a split mixed-width matrix had a few steps a class, under one
    pipelined iteration)."""
    words = tl.maximum(tl.maximum(tl.maximum(fw8 + 8 * ns8, fw6 + 6 * ns6), tl.maximum(fw5 + 5 * ns5, fw4 + 4 * ns4)),
                       tl.maximum(fw3 + 3 * ns3, fw2 + 2 * ns2))
    return (words * pid_k) // SPLIT, (words * (pid_k + 1)) // SPLIT


@triton.jit
def _gemv_class(x_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                offs_n, mask_n, BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr,
                BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr = 2):
    """Partial x·W over this program's steps of one width class (`_share`), for BN columns ([BN] fp32).

    x is the permuted input (`gather_input`). Tiles are [steps, low word j, row-in-word u, columns]; stored row
    of (s, j, u) is 32·s + PER·j + u, read from input position 32·s + `pos`; Triton pipelines the loop STAGES
    deep."""
    PER: tl.constexpr = 32 // LB
    HPER: tl.constexpr = 32 // HB if HB > 0 else 32
    MAGIC: tl.constexpr = 8388608.0 + (1 << (BITS - 1))
    jj = tl.arange(0, LB)
    uu = tl.arange(0, PER)
    row = jj[:, None] * PER + uu[None, :]  # [LB, PER]
    if BITS == 4:
        pos = jj[:, None] * 8 + (uu % 4)[None, :] * 2 + (uu // 4)[None, :]
    elif BITS == 8:
        pos = row
    else:  # PAIR_ORDER16
        pos = 2 * (row % 16) + row // 16
    lo_sh = (uu * LB)[None, None, :, None]
    hi_sh = (HB * (row % HPER))[None, :, :, None]
    s_lo, s_hi = _share(first_step, n_steps, first_word, w_lo, w_hi, BITS)
    acc = tl.zeros([BS, LB, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        w, h, sc, z = load_class(qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, s0, s_hi, first_step, first_word, jj, offs_n,
                                  mask_n, BITS, LB, HB, HAS_ZEROS, BS)
        offs_s = s0 + tl.arange(0, BS)
        if BITS == 3:
            w0, w1, w2 = words3(w, h)
            code = code3(w0[:, :, None, :], w1[:, :, None, :], w2[:, :, None, :], row[None, :, :, None])
        else:
            code = (w[:, :, None, :] >> lo_sh) & ((1 << LB) - 1)
        if HB > 0 and BITS != 3:
            code = code | (((h[:, :, None, :] >> hi_sh) & ((1 << HB) - 1)) << LB)
        xv = tl.load(x_ptr + offs_s[:, None, None] * 32 + pos[None, :, :], mask=(offs_s < s_hi)[:, None, None],
                     other=0.0).to(tl.float32)
        if HAS_ZEROS:
            cf = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            cf = (code | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC
        t = tl.sum(xv[:, :, :, None] * cf, axis=2)
        if HAS_ZEROS:
            t = t - tl.sum(xv, axis=2)[:, :, None] * z.to(tl.float32)
        acc += t * sc.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


# The packed gemv decoders sum a whole step (32 products, two fp16x2 chains of 16) before converting to fp32,
# instead of every word (8): 12 of a 4-bit step's 68 instructions fewer, and the gemv is instruction-bound (H200,
# batch 1: 392 -> 415 tok/s at ctx 2048, benchmarks/RESULTS.md session 11). exllamav2's kernels sum at least as
# long in fp16. EXL2_GEMV_ACC16=0 restores the per-word sums.
GEMV_ACC16 = env_choice("EXL2_GEMV_ACC16", 1, range(0, 2)) == 1


def _ptx_add_f32(acc: str, first: bool) -> list[str]:
    """PTX adding both fp16 lanes of `acc` into the fp32 sum r (`first`: r is set instead)."""
    lines = [f"mov.b32 {{lo, hi}}, {acc};", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;"]
    return lines + (["add.f32 r, flo, fhi;"] if first else ["add.f32 r, r, flo;", "add.f32 r, r, fhi;"])


def _ptx_close(acc16: bool, a: str, b: str) -> list[str]:
    """The end of a packed step decoder: with whole-step fp16 sums the two chains a and b added and converted
    into r; then r is the result."""
    tail = [f"add.rn.f16x2 {a}, {a}, {b};"] + _ptx_add_f32(a, True) if acc16 else []
    return tail + ["mov.f32 $0, r;", "}"]


def _words4_asm(acc16: bool) -> str:
    """The 4-bit step decoder: $1-$4 the words, $5-$20 the input pairs (4 per word), $0 the fp32 sum."""
    lines = ["{", ".reg .b32 q0, q1, q2, q3, s, a, b, z, c, d;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi, r;",
             PTX_UNPACK4_CONSTANTS, "mov.f32 r, 0f00000000;"]
    for j in range(4):
        acc = ("a" if j < 2 else "b") if acc16 else "a"
        first = j % 2 == 0 if acc16 else True
        lines.append(ptx_unpack4(f"${1 + j}"))
        lines.append(f"mul.rn.f16x2 {acc}, q0, ${5 + 4 * j};" if first
                     else f"fma.rn.f16x2 {acc}, q0, ${5 + 4 * j}, {acc};")
        lines += [f"fma.rn.f16x2 {acc}, q{i}, ${5 + 4 * j + i}, {acc};" for i in (1, 2, 3)]
        if not acc16:
            lines += _ptx_add_f32("a", False)
    return "\n".join(lines + _ptx_close(acc16, "a", "b"))


_WORDS4_ASM = tl.constexpr(_words4_asm(GEMV_ACC16))
_WORDS4_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 20))


@triton.jit
def _by_word(t):
    """[BS, 2, 2] indexed (j // 2, j % 2) -> its four [BS, 1] slices for j = 0..3 (words, or quarters of a step's
    input pairs)."""
    even, odd = tl.split(t)
    j0, j2 = tl.split(even)
    j1, j3 = tl.split(odd)
    return j0[:, None], j1[:, None], j2[:, None], j3[:, None]


@triton.jit
def _step_pairs(x32_ptr, offs_s, mask_s):
    """Each step's 16 input pairs (int32 4j + k: word j, codes k and k+4), split by k: four [BS, 2, 2] tensors
    for `_by_word`."""
    BS: tl.constexpr = offs_s.shape[0]
    xw = tl.load(x32_ptr + offs_s[:, None] * 16 + tl.arange(0, 16)[None, :], mask=mask_s[:, None], other=0)
    k_even, k_odd = tl.split(tl.reshape(xw, [BS, 2, 2, 2, 2]))  # axes: step, j // 2, j % 2, k // 2, k % 2
    k0, k2 = tl.split(k_even)
    k1, k3 = tl.split(k_odd)
    return k0, k1, k2, k3


@triton.jit
def step_words4(qw_ptr, sc_ptr, sg_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n):
    """A 4-bit class's four words [BS, BN] of the steps offs_s (zeros past the masks) and their scales."""
    w_ptrs, m2 = step_rows(qw_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n, 4)
    w0, w1 = tl.load(w_ptrs, mask=m2, other=0), tl.load(w_ptrs + N, mask=m2, other=0)
    w2, w3 = tl.load(w_ptrs + 2 * N, mask=m2, other=0), tl.load(w_ptrs + 3 * N, mask=m2, other=0)
    return w0, w1, w2, w3, step_scales(sc_ptr, sg_ptr, N, offs_s, mask_s, offs_n, m2)


@triton.jit
def _gemv_class4_pipe(x32_ptr, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                      offs_n, mask_n, BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """`_gemv_class` for a 4-bit class without zero tensors (EXL2), with packed fp16x2 arithmetic: x32 is the
    permuted fp16 input read as int32 pairs; a step's four words per asm call, each scale loaded once; Triton
    pipelines the loop STAGES deep."""
    s_lo, s_hi = _share(first_step, n_steps, first_word, w_lo, w_hi, 4)
    acc = tl.zeros([BS, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        offs_s = s0 + tl.arange(0, BS)
        mask_s = offs_s < s_hi
        w0, w1, w2, w3, sc = step_words4(qw_ptr, sc_ptr, sg_ptr, N, first_step, first_word, offs_s, mask_s, offs_n,
                                         mask_n)
        k0, k1, k2, k3 = _step_pairs(x32_ptr, offs_s, mask_s)
        acc += _words4_part(w0, w1, w2, w3, k0, k1, k2, k3) * sc.to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _words4_part(w0, w1, w2, w3, k0, k1, k2, k3):
    """The packed 4-bit step decoder (`_WORDS4_ASM`) over [BS, BN] words and a step's input pairs split by k."""
    x00, x10, x20, x30 = _by_word(k0)
    x01, x11, x21, x31 = _by_word(k1)
    x02, x12, x22, x32 = _by_word(k2)
    x03, x13, x23, x33 = _by_word(k3)
    return tl.inline_asm_elementwise(
        _WORDS4_ASM, _WORDS4_CONSTRAINTS,
        [w0, w1, w2, w3, x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gemv_class4_rpf(x32_ptr, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                     offs_n, mask_n, BS: tl.constexpr, BN: tl.constexpr):
    """`_gemv_class4_pipe` with the next iteration's operands loaded into registers during this one's decoding
    (`GEMV_RPF`); the loop itself is not pipelined."""
    s_lo, s_hi = _share(first_step, n_steps, first_word, w_lo, w_hi, 4)
    offs_s = s_lo + tl.arange(0, BS)
    mask_s = offs_s < s_hi
    w0, w1, w2, w3, sc = step_words4(qw_ptr, sc_ptr, sg_ptr, N, first_step, first_word, offs_s, mask_s, offs_n,
                                     mask_n)
    k0, k1, k2, k3 = _step_pairs(x32_ptr, offs_s, mask_s)
    acc = tl.zeros([BS, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=1):
        offs_s = s0 + BS + tl.arange(0, BS)
        mask_s = offs_s < s_hi
        v0, v1, v2, v3, sc_n = step_words4(qw_ptr, sc_ptr, sg_ptr, N, first_step, first_word, offs_s, mask_s,
                                           offs_n, mask_n)
        j0, j1, j2, j3 = _step_pairs(x32_ptr, offs_s, mask_s)
        acc += _words4_part(w0, w1, w2, w3, k0, k1, k2, k3) * sc.to(tl.float32)
        w0, w1, w2, w3, sc = v0, v1, v2, v3, sc_n
        k0, k1, k2, k3 = j0, j1, j2, j3
    return tl.sum(acc, axis=0)


# 6-bit classes: the permuted input pairs rows r and r + 16 (`PAIR_ORDER16`), which sit at the same bits of low
# words j and j + 2 and of high words 0 and 1. One prmt per byte of a low-word pair puts both rows' nibbles in the
# two fp16 lanes (the odd row of the byte comes out 16x, as in the 4-bit decoder), one prmt per byte of the high
# words does the same for the top two bits, a shift and a lop3 merge them under the exponent of 1024, and one
# packed subtraction (or fma) removes 1024 + 32. ~3 instructions per weight instead of ~10.
def _ptx_words6(acc16: bool = False) -> str:
    lines = ["{", ".reg .b32 a, b, c, t, acc, acc2, z, q, d;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi, r;",
             "mov.b32 z, 0x64206420;", "mov.b32 q, 0x2C002C00;", "mov.b32 d, 0xD600D600;", "mov.f32 r, 0f00000000;"]
    for jp in range(2):
        for k in range(4):
            lines.append(f"prmt.b32 a, ${1 + jp}, ${3 + jp}, {((4 + k) << 8) | k:#x};")
            if k % 2 == 0:
                byte = 2 * jp + k // 2
                lines.append(f"prmt.b32 b, $5, $6, {((4 + byte) << 8) | byte:#x};")
            for e in range(2):
                pair = 8 * jp + 2 * k + e
                lo_mask, hi_mask = ("0x000F000F", "0x00300030") if e == 0 else ("0x00F000F0", "0x03000300")
                shift = (4 if e == 0 else 6) - 4 * (k % 2)
                lines.append(f"lop3.b32 t, a, {lo_mask}, 0x64006400, 0xEA;")
                lines.append(f"shl.b32 c, b, {shift};")
                lines.append(f"lop3.b32 t, c, {hi_mask}, t, 0xEA;")
                lines.append("sub.f16x2 t, t, z;" if e == 0 else "fma.rn.f16x2 t, t, q, d;")
                run = 8 if acc16 else 4  # products summed in fp16 before the conversion
                acc = "acc2" if acc16 and pair >= 8 else "acc"
                if pair % run == 0:
                    lines.append(f"mul.rn.f16x2 {acc}, t, ${7 + pair};")
                else:
                    lines.append(f"fma.rn.f16x2 {acc}, t, ${7 + pair}, {acc};")
                if pair % 4 == 3 and not acc16:
                    lines += _ptx_add_f32("acc", False)
    return "\n".join(lines + _ptx_close(acc16, "acc", "acc2"))


def _f16x2(v: float) -> str:
    """A packed-fp16 constant: v in both halves."""
    h = int.from_bytes(struct.pack("<e", v), "little")
    return f"{h << 16 | h:#010x}"


# The other widths decode one input pair in a few instructions, the code 4^f or 16^f too large where its field sits
# higher in its byte (as the 4-bit decoder's odd codes), which the fma that removes 1024 + the zero point also
# scales back:
# * 8-bit (stored order): pair i is bytes 2(i % 2) and 2(i % 2) + 1 of word i / 2, one byte permute under 0x64
#   bytes; the fma leaves (code - 128) / 128, so the fp16 products stay as small as the input (`STEP_SCALE`).
# * 5-bit (`PAIR_ORDER16`): pair i is rows i and i + 16, the same nibble of low words i / 8 and i / 8 + 2 (one byte
#   permute per two pairs), and bits i and i + 16 of the high word (one shift to bit 4 or 8 of each lane).
# * 2-bit (`PAIR_ORDER16`): rows i and i + 16 are the same 2-bit field of low words 0 and 1 (one byte permute per
#   four pairs).
# * 3-bit (`qweight.THREE_BIT_FIELDS`): rows i and i + 16 are the same field of one word, one lop3 where the field
#   lies below the exponent's bits (fields 0-2), else one lop3 of the word shifted right by 6 (one shift a word);
#   row 15's three bits come from three words.
STEP_SCALE = {8: 128.0}  # what a step decoder's result is multiplied by (1 for the others)
_STEP8_SCALE = tl.constexpr(STEP_SCALE[8])


# The factors by which a field sits too high in its lane (the fma's m1-m3 undo them), by width.
_FIELD_SCALES = {5: (16.0,), 3: (8.0, 64.0, 128.0), 2: (4.0, 16.0, 64.0)}


def _ptx_pair3(i: int) -> list[str]:
    """`_ptx_pair` of a 3-bit class: e_k (word k shifted right by 6) is made where first needed."""
    fix = lambda f: ["sub.f16x2 t, t, z;" if f == 0 else f"fma.rn.f16x2 t, t, m{f}, d{f};"]  # noqa: E731
    if i == 15:  # bit b of the code is bit 15 of word b: to bits 7, 8, 9 (the code times 128)
        return ["shr.u32 c, $1, 8;", "lop3.b32 t, c, 0x00800080, 0x64006400, 0xEA;", "shr.u32 c, $2, 7;",
                "lop3.b32 t, c, 0x01000100, t, 0xEA;", "lop3.b32 t, e2, 0x02000200, t, 0xEA;"] + fix(3)
    k, f = (i // 4, i % 4) if i < 12 else (i - 12, 4)
    if f < 3:  # bits 3f of word k, in place: the code times 8^f
        return [f"lop3.b32 t, ${1 + k}, {0x00070007 << 3 * f:#010x}, 0x64006400, 0xEA;"] + fix(f)
    lines = [f"shr.u32 e{k}, ${1 + k}, 6;"] if f == 3 else []
    mask, scale = (0x00380038, 1) if f == 3 else (0x01C001C0, 2)  # bits 9 / 12 of the word, now 3 / 6
    return lines + [f"lop3.b32 t, e{k}, {mask:#010x}, 0x64006400, 0xEA;"] + fix(scale)


def _ptx_pair(bits: int, i: int) -> list[str]:
    """PTX leaving input pair i's two codes minus the zero point (8-bit: divided by 128) as fp16 in t."""
    if bits == 3:
        return _ptx_pair3(i)
    if bits == 8:
        return [f"prmt.b32 t, ${1 + i // 2}, k, {0x4140 + 0x0202 * (i % 2):#x};", "fma.rn.f16x2 t, t, m0, d0;"]
    lines = []
    if bits == 5:
        lw, (b, f) = i // 8, divmod(i % 8, 2)
        if f == 0:
            lines.append(f"prmt.b32 p, ${1 + lw}, ${3 + lw}, {(4 + b) << 8 | b:#x};")
        lo_mask, hi_bit, high = 0x000F000F << 4 * f, 4 + 4 * f, "$5"
    else:
        b, f = divmod(i, 4)
        if f == 0:
            lines.append(f"prmt.b32 p, $1, $2, {(4 + b) << 8 | b:#x};")
        lo_mask, hi_bit, high = 0x00030003 << 2 * f, 2 + 2 * f, None
    lines.append(f"lop3.b32 t, p, {lo_mask:#010x}, 0x64006400, 0xEA;")
    if high is not None:  # bits i and i + 16 of the high word to bit hi_bit of each lane
        shift = hi_bit - i
        if shift > 0:
            lines.append(f"shl.b32 c, {high}, {shift};")
        elif shift < 0:
            lines.append(f"shr.u32 c, {high}, {-shift};")
        lines.append(f"lop3.b32 t, {high if shift == 0 else 'c'}, {0x00010001 << hi_bit:#010x}, t, 0xEA;")
    lines.append("sub.f16x2 t, t, z;" if f == 0 else f"fma.rn.f16x2 t, t, m{f}, d{f};")
    return lines


def _ptx_step(bits: int, acc16: bool) -> str:
    """The gemv step decoder of an 8/6/5/3/2-bit class: $1..$bits the step's words, the next 16 operands its input
    pairs in order, $0 the fp32 sum of the 32 products (to be multiplied by `STEP_SCALE`)."""
    if bits == 6:
        return _ptx_words6(acc16)
    zero = 1 << (bits - 1)
    lines = ["{", ".reg .b32 p, t, c, k, z, s0, s1, e0, e1, e2, m0, d0, m1, d1, m2, d2, m3, d3;",
             ".reg .b16 lo, hi;", ".reg .f32 flo, fhi, r;", "mov.f32 r, 0f00000000;"]
    if bits == 8:
        lines += ["mov.b32 k, 0x64646464;", f"mov.b32 m0, {_f16x2(1 / 128)};", f"mov.b32 d0, {_f16x2(-9.0)};"]
    else:
        lines.append(f"mov.b32 z, {_f16x2(1024 + zero)};")
        for f, scale in enumerate(_FIELD_SCALES[bits], 1):
            lines += [f"mov.b32 m{f}, {_f16x2(1 / scale)};", f"mov.b32 d{f}, {_f16x2(-(1024 / scale + zero))};"]
    run = 8 if acc16 else 4  # input pairs of one fp16 chain before the conversion to fp32
    for i in range(16):
        lines += _ptx_pair(bits, i)
        acc = "s1" if acc16 and i >= 8 else "s0"
        lines.append(f"mul.rn.f16x2 {acc}, t, ${bits + 1 + i};" if i % run == 0
                     else f"fma.rn.f16x2 {acc}, t, ${bits + 1 + i}, {acc};")
        if not acc16 and i % run == run - 1:
            lines += _ptx_add_f32("s0", False)
    return "\n".join(lines + _ptx_close(acc16, "s0", "s1"))


_STEP8_ASM = tl.constexpr(_ptx_step(8, GEMV_ACC16))
_STEP6_ASM = tl.constexpr(_ptx_step(6, GEMV_ACC16))
_STEP5_ASM = tl.constexpr(_ptx_step(5, GEMV_ACC16))
_STEP3_ASM = tl.constexpr(_ptx_step(3, GEMV_ACC16))
_STEP2_ASM = tl.constexpr(_ptx_step(2, GEMV_ACC16))


@triton.jit
def _pairs16(x32_ptr, offs_s, mask_s):
    """A step's 16 input pairs (int32), each [BS, 1], in order."""
    BS: tl.constexpr = offs_s.shape[0]
    xw = tl.load(x32_ptr + offs_s[:, None] * 16 + tl.arange(0, 16)[None, :], mask=mask_s[:, None], other=0)
    d0, d1 = tl.split(tl.reshape(xw, [BS, 2, 2, 2, 2]))  # pair p = 8a + 4b + 2c + d
    c0d0, c1d0 = tl.split(d0)
    c0d1, c1d1 = tl.split(d1)
    x0, x4, x8, x12 = _by_word(c0d0)
    x1, x5, x9, x13 = _by_word(c0d1)
    x2, x6, x10, x14 = _by_word(c1d0)
    x3, x7, x11, x15 = _by_word(c1d1)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _step_asm(ASM: tl.constexpr, words, x32_ptr, offs_s, mask_s):
    """One packed step decoder (`_ptx_step`) over a [BS, BN] tile: `words` the step's words, then its 16 input
    pairs."""
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _pairs16(x32_ptr, offs_s, mask_s)
    return tl.inline_asm_elementwise(
        ASM, "=f" + ",r" * (len(words) + 16),
        words + (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gemv_class_pipe(x32_ptr, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                     offs_n, mask_n, BITS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """`_gemv_class4_pipe` for an 8/6/5/3/2-bit class without zero tensors (EXL2): a step's words and 16 input
    pairs per asm call."""
    s_lo, s_hi = _share(first_step, n_steps, first_word, w_lo, w_hi, BITS)
    acc = tl.zeros([BS, BN], dtype=tl.float32)
    for s0 in tl.range(s_lo, s_hi, BS, num_stages=STAGES):
        offs_s = s0 + tl.arange(0, BS)
        mask_s = offs_s < s_hi
        w_ptrs, m2 = step_rows(qw_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n, BITS)
        w0, w1 = tl.load(w_ptrs, mask=m2, other=0), tl.load(w_ptrs + N, mask=m2, other=0)
        sc = step_scales(sc_ptr, sg_ptr, N, offs_s, mask_s, offs_n, m2).to(tl.float32)
        if BITS == 2:
            part = _step_asm(_STEP2_ASM, (w0, w1), x32_ptr, offs_s, mask_s)
        else:
            w2 = tl.load(w_ptrs + 2 * N, mask=m2, other=0)
            if BITS == 3:
                part = _step_asm(_STEP3_ASM, (w0, w1, w2), x32_ptr, offs_s, mask_s)
            else:
                w3, w4 = tl.load(w_ptrs + 3 * N, mask=m2, other=0), tl.load(w_ptrs + 4 * N, mask=m2, other=0)
                if BITS == 5:
                    part = _step_asm(_STEP5_ASM, (w0, w1, w2, w3, w4), x32_ptr, offs_s, mask_s)
                else:
                    w5 = tl.load(w_ptrs + 5 * N, mask=m2, other=0)
                    if BITS == 6:
                        part = _step_asm(_STEP6_ASM, (w0, w1, w2, w3, w4, w5), x32_ptr, offs_s, mask_s)
                    else:
                        tl.static_assert(BITS == 8)
                        w6, w7 = tl.load(w_ptrs + 6 * N, mask=m2, other=0), tl.load(w_ptrs + 7 * N, mask=m2, other=0)
                        part = _step_asm(_STEP8_ASM, (w0, w1, w2, w3, w4, w5, w6, w7), x32_ptr, offs_s,
                                         mask_s) * _STEP8_SCALE
        acc += part * sc
    return tl.sum(acc, axis=0)


@triton.jit
def _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi, offs_n,
                mask_n, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                FAST4: tl.constexpr, STAGES: tl.constexpr):
    """One width class's partial sums: the packed-fp16 decoders for EXL2 (where FAST4 has the width's
    `PACKED_FLAG`), the portable one otherwise (field widths as in `qweight.split_bits`). x32r is the permuted
    input row read as int32 pairs."""
    LB: tl.constexpr = 2 if BITS <= 3 else (8 if BITS == 8 else 4)
    FLAG: tl.constexpr = 1 if BITS == 4 else (2 if BITS == 6 else (4 if BITS == 5 else (8 if BITS == 3 else (
        16 if BITS == 2 else 32))))  # PACKED_FLAG
    if BITS == 4 and (FAST4 & 1) != 0 and not HAS_ZEROS and _GEMV_RPF:
        return _gemv_class4_rpf(x32r, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                                offs_n, mask_n, BS, BN)
    elif BITS == 4 and (FAST4 & 1) != 0 and not HAS_ZEROS:
        return _gemv_class4_pipe(x32r, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                                 offs_n, mask_n, BS, BN, STAGES)
    elif (FAST4 & FLAG) != 0 and not HAS_ZEROS:
        return _gemv_class_pipe(x32r, qw_ptr, sc_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                                offs_n, mask_n, BITS, BS, BN, STAGES)
    else:
        return _gemv_class(xr, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, first_step, n_steps, first_word, w_lo, w_hi,
                           offs_n, mask_n, BITS, LB, BITS - LB, HAS_ZEROS, BS, BN, min(STAGES, 2))


@triton.jit
def _prefetch_class(qw_ptr, N, first_step, n_steps, first_word, w_lo, w_hi, col0, BITS: tl.constexpr,
                    BN: tl.constexpr, ROWS: tl.constexpr):
    """L2 prefetch of the first ROWS word rows of this program's share of one width class (its BN columns)."""
    s_lo, s_hi = _share(first_step, n_steps, first_word, w_lo, w_hi, BITS)
    rows = first_word + (s_lo - first_step) * BITS + tl.arange(0, ROWS)
    LINES: tl.constexpr = BN // 32 if BN >= 32 else 1
    cols = col0 + tl.arange(0, LINES) * 32  # one address per 128-byte line
    ok = (rows < first_word + (s_hi - first_step) * BITS)[:, None] & (cols < N)[None, :]
    off = tl.where(ok, rows[:, None].to(tl.int64) * N + cols[None, :], 0)
    if _PREFETCH_MASKED:
        prefetch_l2_where(qw_ptr + off, ok)
    else:
        prefetch_l2(qw_ptr + off)


@triton.jit
def _prefetch_widths(qw_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3,
                     fs2, ns2, fw2, pid_k, SPLIT, col0, MASK: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr):
    """`_prefetch_class` for each width class in MASK (classes of no steps prefetch nothing)."""
    w_lo, w_hi = _word_share(fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3,
                             fs2, ns2, fw2, pid_k, SPLIT)
    MIXED: tl.constexpr = (MASK & (MASK - 1)) != 0
    if (MASK & 32) != 0 and _has_share(fs8, ns8, fw8, w_lo, w_hi, 8, MIXED):
        _prefetch_class(qw_ptr, N, fs8, ns8, fw8, w_lo, w_hi, col0, 8, BN, ROWS)
    if (MASK & 16) != 0 and _has_share(fs6, ns6, fw6, w_lo, w_hi, 6, MIXED):
        _prefetch_class(qw_ptr, N, fs6, ns6, fw6, w_lo, w_hi, col0, 6, BN, ROWS)
    if (MASK & 8) != 0 and _has_share(fs5, ns5, fw5, w_lo, w_hi, 5, MIXED):
        _prefetch_class(qw_ptr, N, fs5, ns5, fw5, w_lo, w_hi, col0, 5, BN, ROWS)
    if (MASK & 4) != 0 and _has_share(fs4, ns4, fw4, w_lo, w_hi, 4, MIXED):
        _prefetch_class(qw_ptr, N, fs4, ns4, fw4, w_lo, w_hi, col0, 4, BN, ROWS)
    if (MASK & 2) != 0 and _has_share(fs3, ns3, fw3, w_lo, w_hi, 3, MIXED):
        _prefetch_class(qw_ptr, N, fs3, ns3, fw3, w_lo, w_hi, col0, 3, BN, ROWS)
    if (MASK & 1) != 0 and _has_share(fs2, ns2, fw2, w_lo, w_hi, 2, MIXED):
        _prefetch_class(qw_ptr, N, fs2, ns2, fw2, w_lo, w_hi, col0, 2, BN, ROWS)


@triton.jit
def _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5,
                 fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2, pid_k, SPLIT, offs_n, mask_n,
                 MASK: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BS: tl.constexpr, BN: tl.constexpr, FAST4: tl.constexpr, STAGES: tl.constexpr):
    """Sum of `_gemv_width` over the width classes in MASK (`width_mask`) that this program has steps of
    (`_has_share`)."""
    w_lo, w_hi = _word_share(fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3,
                             fs2, ns2, fw2, pid_k, SPLIT)
    HAS8: tl.constexpr = (MASK & 32) != 0
    HAS6: tl.constexpr = (MASK & 16) != 0
    HAS5: tl.constexpr = (MASK & 8) != 0
    HAS4: tl.constexpr = (MASK & 4) != 0
    HAS3: tl.constexpr = (MASK & 2) != 0
    HAS2: tl.constexpr = (MASK & 1) != 0
    MIXED: tl.constexpr = (MASK & (MASK - 1)) != 0
    res = tl.zeros([BN], dtype=tl.float32)
    if HAS8 and _has_share(fs8, ns8, fw8, w_lo, w_hi, 8, MIXED):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, w_lo, w_hi, offs_n, mask_n,
                           8, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS6 and _has_share(fs6, ns6, fw6, w_lo, w_hi, 6, MIXED):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs6, ns6, fw6, w_lo, w_hi, offs_n, mask_n,
                           6, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS5 and _has_share(fs5, ns5, fw5, w_lo, w_hi, 5, MIXED):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs5, ns5, fw5, w_lo, w_hi, offs_n, mask_n,
                           5, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS4 and _has_share(fs4, ns4, fw4, w_lo, w_hi, 4, MIXED):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs4, ns4, fw4, w_lo, w_hi, offs_n, mask_n,
                           4, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS3 and _has_share(fs3, ns3, fw3, w_lo, w_hi, 3, MIXED):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs3, ns3, fw3, w_lo, w_hi, offs_n, mask_n,
                           3, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS2 and _has_share(fs2, ns2, fw2, w_lo, w_hi, 2, MIXED):
        res += _gemv_width(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs2, ns2, fw2, w_lo, w_hi, offs_n, mask_n,
                           2, HAS_ZEROS, BS, BN, FAST4, STAGES)
    return res


@triton.jit
def _gemv_kernel(x_ptr, x32_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                 M, N, stride_xm, stride_om, SPLIT,
                 fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2,
                 HAS8: tl.constexpr, HAS6: tl.constexpr, HAS5: tl.constexpr, HAS4: tl.constexpr,
                 HAS3: tl.constexpr, HAS2: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT_ON: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                 RED: tl.constexpr, FAST4: tl.constexpr = False, STAGES: tl.constexpr = 2,
                 PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                 PART_ONLY: tl.constexpr = False):
    """One permuted input row per program (grid axis 2); rows beyond the first re-read the weights, mostly from
    L2. With PDL the first PREFETCH word rows of each class are requested before waiting for the input.
    PART_ONLY: split K, every program leaves its partial sum (`SplitSum`) and none adds them."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if PDL:
        if PREFETCH > 0:
            _prefetch_widths(qw_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5, fs4, ns4, fw4, fs3, ns3, fw3,
                             fs2, ns2, fw2, pid_k, SPLIT, pid_n * BN,
                             HAS8 * 32 + HAS6 * 16 + HAS5 * 8 + HAS4 * 4 + HAS3 * 2 + HAS2, BN, PREFETCH)
        pdl_sync()
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    xr = x_ptr + pid_m.to(tl.int64) * stride_xm
    x32r = x32_ptr + pid_m.to(tl.int64) * (stride_xm // 2)
    res = _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, fs8, ns8, fw8, fs6, ns6, fw6, fs5, ns5, fw5,
                       fs4, ns4, fw4, fs3, ns3, fw3, fs2, ns2, fw2, pid_k, SPLIT, offs_n, mask_n,
                       HAS8 * 32 + HAS6 * 16 + HAS5 * 8 + HAS4 * 4 + HAS3 * 2 + HAS2, HAS_ZEROS, BS, BN,
                       FAST4, STAGES)
    offs_m = pid_m + tl.arange(0, 1)
    store_tile(res[None, :], offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, cnt_ptr, bias_ptr,
               pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT, HAS_BIAS, SPLIT_ON, RED, PART_ONLY)


@triton.jit
def _group_member(x_ptr, x32_ptr, stride_xm, meta, part_ptr, cnt_ptr, M, pid, pid_m, out_ptr, bias_ptr, qw_ptr,
                  sc_ptr, zr_ptr, sg_ptr, MASK: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BS: tl.constexpr, BN: tl.constexpr, RED: tl.constexpr, FAST4: tl.constexpr,
                  STAGES: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """One program of `_gemv_group_kernel` for the matrix whose metadata row is `meta` (see `GemvGroup`): the
    classes of the widths in MASK are runtime branches, so one compiled kernel serves every mix of them. The
    metadata and the weights are not written by the previous kernel, so they are read (and, PREFETCH rows of
    each class, prefetched) before waiting for it."""
    N = tl.multiple_of(tl.load(meta + 18), 16)  # GemvGroup only takes N % 16 == 0: keeps loads vectorized
    tiles = tl.load(meta + 19)
    split = tl.load(meta + 20)
    local = pid - tl.load(meta + 21)
    pid_n = local % tiles
    pid_k = local // tiles
    if PDL:
        if PREFETCH > 0:
            _prefetch_widths(qw_ptr, N, tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3),
                             tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6), tl.load(meta + 7),
                             tl.load(meta + 8), tl.load(meta + 9), tl.load(meta + 10), tl.load(meta + 11),
                             tl.load(meta + 12), tl.load(meta + 13), tl.load(meta + 14), tl.load(meta + 15),
                             tl.load(meta + 16), tl.load(meta + 17), pid_k, split, pid_n * BN, MASK, BN, PREFETCH)
        pdl_sync()
    xoff = tl.multiple_of(tl.load(meta + 23), 32)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    xr = x_ptr + pid_m.to(tl.int64) * stride_xm + xoff
    x32r = x32_ptr + pid_m.to(tl.int64) * (stride_xm // 2) + xoff // 2
    res = _gemv_widths(xr, x32r, qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, tl.load(meta + 0), tl.load(meta + 1),
                       tl.load(meta + 2), tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6),
                       tl.load(meta + 7), tl.load(meta + 8), tl.load(meta + 9), tl.load(meta + 10),
                       tl.load(meta + 11), tl.load(meta + 12), tl.load(meta + 13), tl.load(meta + 14),
                       tl.load(meta + 15), tl.load(meta + 16), tl.load(meta + 17), pid_k, split, offs_n, mask_n,
                       MASK, HAS_ZEROS, BS, BN, FAST4, STAGES)
    offs_m = pid_m + tl.arange(0, 1)
    tile = tl.load(meta + 22) + pid_m * tiles + pid_n
    part = part_ptr + tl.multiple_of(tl.load(meta + 24), 16).to(tl.int64)
    if split > 1:
        store_tile(res[None, :], offs_m, offs_n, M, N, out_ptr, N, part, cnt_ptr, bias_ptr, tile, pid_k, split,
                   HAS_BIAS, True, RED)
    else:
        store_tile(res[None, :], offs_m, offs_n, M, N, out_ptr, N, part, cnt_ptr, bias_ptr, tile, pid_k, split,
                   HAS_BIAS, False, RED)


@triton.jit
def _gemv_group_kernel(x_ptr, x32_ptr, stride_xm, meta_ptr, part_ptr, cnt_ptr, M,
                       out0, bias0, qw0, sc0, zr0, sg0, out1, bias1, qw1, sc1, zr1, sg1,
                       out2, bias2, qw2, sc2, zr2, sg2, G: tl.constexpr, MASK: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                       RED: tl.constexpr, FAST4: tl.constexpr, STAGES: tl.constexpr = 2,
                       PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0, ONE_BODY: tl.constexpr = False):
    """The gemv of up to three weights that read the same input (q/k/v, gate/up) in one launch: grid axis 0 runs
    over every (matrix, column tile, K split) program, axis 2 over the input rows. ONE_BODY (the members agree on
    bias): one inlined member body whose matrix pointers and metadata row are picked at run time, instead of one
    copy of every width's loop a member (`GEMV_GROUP_SELECT`)."""
    pid = tl.program_id(0)
    pid_m = tl.program_id(2)
    if ONE_BODY:
        sel = pid * 0
        if G > 1:
            sel += (pid >= tl.load(meta_ptr + 25 + 21)).to(tl.int32)
        if G > 2:
            sel += (pid >= tl.load(meta_ptr + 2 * 25 + 21)).to(tl.int32)
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr + sel * 25, part_ptr, cnt_ptr, M, pid, pid_m,
                      _pick(sel, out0, out1, out2), _pick(sel, bias0, bias1, bias2), _pick(sel, qw0, qw1, qw2),
                      _pick(sel, sc0, sc1, sc2), _pick(sel, zr0, zr1, zr2), _pick(sel, sg0, sg1, sg2), MASK,
                      HAS_ZEROS, B0, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)
    elif G > 2 and pid >= tl.load(meta_ptr + 2 * 25 + 21):
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr + 2 * 25, part_ptr, cnt_ptr, M, pid, pid_m, out2, bias2,
                      qw2, sc2, zr2, sg2, MASK, HAS_ZEROS, B2, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)
    elif G > 1 and pid >= tl.load(meta_ptr + 25 + 21):
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr + 25, part_ptr, cnt_ptr, M, pid, pid_m, out1, bias1,
                      qw1, sc1, zr1, sg1, MASK, HAS_ZEROS, B1, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)
    else:
        _group_member(x_ptr, x32_ptr, stride_xm, meta_ptr, part_ptr, cnt_ptr, M, pid, pid_m, out0, bias0,
                      qw0, sc0, zr0, sg0, MASK, HAS_ZEROS, B0, BS, BN, RED, FAST4, STAGES, PDL, PREFETCH)


@triton.jit
def _pick(sel, p0, p1, p2):
    """Member sel's pointer of a gemv group."""
    return tl.where(sel == 2, p2, tl.where(sel == 1, p1, p0))


def gemv(x: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, fast4: bool | None = None,
         xp: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA-core path (small M); x `[M, K]` with a contiguous last dim (or its permuted form `xp` from
    `gather_input`). `fast4` selects the packed-fp16 4-bit decoder (inline PTX; None: use it where the one-time
    self-check passed)."""
    return permuted_gemv(permuted_for(x, w, xp), w, cfg, fast4)


def permuted_gemv(xp: torch.Tensor, w: QuantWeight, cfg: MatmulConfig, fast4: bool | int | None = None,
                  part_only: bool = False) -> torch.Tensor | SplitSum:
    """`gemv` on the permuted input xp; `part_only`: where K is split, the partial sums as a `SplitSum`."""
    fast4 = fast4_available(xp.device) if fast4 is None else fast4
    return launch(_gemv_kernel, xp, w, cfg, fast4, part_only=part_only, prefetch=prefetch_rows([w]),
                  STAGES=cfg.num_stages)


def prefetch_rows(ws: Sequence[QuantWeight]) -> int:
    """Word rows a gemv prefetches into L2 before its PDL wait: `PREFETCH_ROWS` for weights of one width, none
    for mixed widths, where prefetching cost 11 % at batch 1 (H100, a 5/4/3-bit body: 281 tok/s with it, 315
    without; benchmarks/RESULTS.md, session 24), unless the prefetch is predicated (`PREFETCH_MASKED`)."""
    return PREFETCH_ROWS if PREFETCH_MASKED or all(len(w.classes) == 1 for w in ws) else 0


class GemvGroup:
    """Launch plan of `_gemv_group_kernel` for 2–3 weights sharing an input: per matrix a 25-int metadata row —
    (first step, steps, first word) of the 8/6/5/4/3/2-bit classes, N, column tiles, K split, first program,
    first counter tile, offset of its permuted input, offset of its split-K partials (per input row count M)."""

    MAX = 3

    def __init__(self, ws: Sequence[QuantWeight], bn: int | None = None, bs: int | None = None,
                 stages: int | None = None, per_sm: int | None = None, num_warps: int | None = None):
        """Defaults from the H200 sweeps (benchmarks/RESULTS.md, session 4 run 13 and session 11): 64-column tiles
        (`GEMV_BN`; q/k/v 12.4 → 10.2 µs, gate/up 24.4 → 21.5 µs against 128 columns), K split up to
        `GROUP_PER_SM` programs per SM; narrow one-width groups as `GEMV_NARROW` says."""
        if not self.accepts(ws):
            raise ValueError("a gemv group needs 2-3 weights with the same input size and zero-point kind and "
                             "outputs a multiple of 16 wide.")
        self.ws = list(ws)
        self.mask = width_mask(self.ws)
        narrow = (GEMV_NARROW and bn is None and bs is None and per_sm is None and not mixed_widths(self.mask)
                  and sum(triton.cdiv(w.n, 64) for w in ws) < sm_count(ws[0].device))
        bn, bs, per_sm = (32, 16, 2) if narrow else (bn, bs, per_sm)
        self.BN = GEMV_BN if bn is None else bn
        self.BS = GEMV_BS if bs is None else bs
        self.num_warps = GEMV_WARPS if num_warps is None else num_warps
        self.stages = GEMV_STAGES if stages is None else stages
        self.per_sm = GROUP_PER_SM if per_sm is None else per_sm
        # one member body for mixed widths only: for one width its ~8 more instructions a loop iteration (the
        # picked pointers' address arithmetic) would cost more than its smaller code saves
        self.one_body = (GEMV_GROUP_SELECT and mixed_widths(self.mask)
                         and len({w.bias is not None for w in self.ws}) == 1)
        self._plans: dict[int, tuple] = {}

    @classmethod
    def accepts(cls, ws: Sequence[QuantWeight]) -> bool:
        return (1 < len(ws) <= cls.MAX and len({w.k for w in ws}) == 1 and len({w.zeros is None for w in ws}) == 1
                and all(w.n % 16 == 0 for w in ws))

    def plan(self, m: int, device: torch.device) -> tuple[torch.Tensor, int, int, int]:
        """(metadata, programs, partial floats, RED) for m input rows, cached per m."""
        cached = self._plans.get(m)
        if cached is not None:
            return cached
        tiles = [triton.cdiv(w.n, self.BN) for w in self.ws]
        total = sum(tiles) * m
        rows, start, tile_base, part = [], 0, 0, 0
        max_split = 1
        for w, t, xoff in zip(self.ws, tiles, input_layout(self.ws)[1]):
            split = auto_split(w, total, w.device, 8, self.per_sm)
            cls, _ = class_args(w)
            rows.append(cls + [w.n, t, split, start, tile_base, xoff, part])
            start += t * split
            tile_base += t * m
            part += split * m * w.n if split > 1 else 0
            max_split = max(max_split, split)
        meta = torch.tensor(rows, dtype=torch.int32, device=device).contiguous()
        red = min(next_pow2(max_split), max(1, 8192 // self.BN))
        self._plans[m] = (meta, start, part, red)
        return self._plans[m]

    def __call__(self, xp: torch.Tensor, fast4: bool | None = None) -> list[torch.Tensor]:
        """Outputs `[M, N_i]` for the permuted inputs `xp` `[M, total]` laid out by `input_layout` (the buffer
        `gather_input` returns its views of)."""
        buffer_offsets(xp, self.ws)
        m = xp.shape[0]
        outs = [torch.empty((m, w.n), dtype=xp.dtype, device=xp.device) for w in self.ws]
        if m == 0:
            return outs
        meta, programs, part_n, red = self.plan(m, xp.device)
        fast4, x32 = pairs_view(xp, fast4_available(xp.device) if fast4 is None else fast4)
        part = torch.empty(max(1, part_n), dtype=torch.float32, device=xp.device)
        args = []
        for i in range(self.MAX):
            w = self.ws[min(i, len(self.ws) - 1)]
            out = outs[min(i, len(self.ws) - 1)]
            args += [out, w.bias if w.bias is not None else w.scales, w.qweight, w.scales,
                     w.zeros if w.zeros is not None else w.scales, w.step_group]
        has_bias = [w.bias is not None for w in self.ws] + [False] * (self.MAX - len(self.ws))
        _gemv_group_kernel[(programs, 1, m)](
            xp, x32, xp.stride(0), meta, part, counters(xp.device), m, *args,
            G=len(self.ws), MASK=self.mask, HAS_ZEROS=self.ws[0].zeros is not None, B0=has_bias[0],
            B1=has_bias[1], B2=has_bias[2], BS=self.BS, BN=self.BN, RED=red, FAST4=fast4,
            STAGES=self.stages, num_warps=self.num_warps, num_stages=self.stages,
            ONE_BODY=self.one_body,
            **pdl_args(xp.device, m, prefetch=prefetch_rows(self.ws)))
        return outs


_FAST4: dict[torch.device, int] = {}


def _packed_check(device: torch.device, bits: int, flag: int) -> bool:
    """Whether the packed decoder of `bits`-bit classes compiles and agrees with the twin on a small random layer."""
    from exl2.kernels.qweight import build

    g = torch.Generator(device=device).manual_seed(bits)
    k, n = 512, 256
    codes = torch.randint(0, 1 << bits, (k, n), device=device, dtype=torch.uint8, generator=g)
    scales = (torch.rand(k // 128, n, device=device, generator=g) * 0.01 + 0.001).half()
    perm = torch.randperm(k, device=device, generator=g)
    w = build(codes, [(bits, 128)] * (k // 128), scales, None, perm)
    x = torch.randn(1, k, device=device, dtype=torch.float16, generator=g)
    ref = matmul_torch(x, w).float()
    got = permuted_gemv(gather_input(x, [w])[0], w, MatmulConfig(bs=4, bn=128, split=2), flag).float()
    return bool(torch.allclose(got, ref, atol=2e-3 * ref.abs().max().item() + 1e-4, rtol=0))


def fast4_available(device: torch.device) -> int:
    """The packed decoders (inline PTX) that compile and agree with the twin on this device, as the kernels'
    FAST4 mask (`PACKED_FLAG`; checked once each, on a small random layer); the others use the portable
    decoder."""
    if device.type != "cuda" or triton.__class__.__name__ == "_Stub":
        return 0
    ok = _FAST4.get(device)
    if ok is None:
        _FAST4[device] = 0  # in case the check itself recurses or fails
        ok = 0
        for bits, flag in PACKED_FLAG.items():
            try:
                ok |= flag if _packed_check(device, bits, flag) else 0
            except Exception:  # noqa: BLE001 - any compile/launch failure means "use the portable path"
                pass
        _FAST4[device] = ok
    return ok
