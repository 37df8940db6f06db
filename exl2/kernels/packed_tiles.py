"""Reading packed EXL2/GPTQ weights inside Triton kernels (layout: `qweight`): tiles of a width class's words,
scales and zeros, and the PTX that unpacks a 4-bit word into exact fp16 pairs. Shared by the gemv, the Triton
tensor-core kernel and the dequantizer."""
from __future__ import annotations

from exl2.kernels.backend import tl, triton


@triton.jit
def load_class(qw_ptr, sc_ptr, zr_ptr, sg_ptr, N, s0, s_hi, first_step, first_word, jj, offs_n, mask_n,
                BITS: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, HAS_ZEROS: tl.constexpr, BS: tl.constexpr):
    """Low words, high words (the low words again if HB = 0), scales and zeros (the scales again without zero
    tensors), each [BS, LB, BN] in one layout, of BS steps from s0; zeros past s_hi."""
    PER: tl.constexpr = 32 // LB
    HPER: tl.constexpr = 32 // HB if HB > 0 else 32
    offs_s = s0 + tl.arange(0, BS)
    mask_s = offs_s < s_hi
    m3 = mask_s[:, None, None] & mask_n[None, None, :]
    wrow = first_word + (offs_s - first_step) * BITS
    w = tl.load(qw_ptr + (wrow[:, None] + jj[None, :])[:, :, None].to(tl.int64) * N + offs_n[None, None, :],
                mask=m3, other=0)
    if HB > 0:
        hrow = wrow[:, None] + LB + (jj * PER // HPER)[None, :]
        h = tl.load(qw_ptr + hrow[:, :, None].to(tl.int64) * N + offs_n[None, None, :], mask=m3, other=0)
    else:
        h = w
    grp = tl.load(sg_ptr + offs_s, mask=mask_s, other=0)
    g_off = grp[:, None, None].to(tl.int64) * N + (jj * 0)[None, :, None] + offs_n[None, None, :]
    sc = tl.load(sc_ptr + g_off, mask=m3, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zr_ptr + g_off, mask=m3, other=0.0)
    else:
        z = sc
    return w, h, sc, z


@triton.jit
def code3(w0, w1, w2, row):
    """The code of stored row `row` (0-31, broadcasting against the words) of a 3-bit step from its three words
    (`qweight.THREE_BIT_FIELDS`)."""
    t = row % 16
    half = row - t
    k = tl.where(t < 12, t // 4, t - 12)
    w = tl.where(k == 0, w0, tl.where(k == 1, w1, w2))
    code = (w >> (half + tl.where(t < 12, 3 * (t % 4), 12))) & 7
    top = half + 15
    spread = ((w0 >> top) & 1) | (((w1 >> top) & 1) << 1) | (((w2 >> top) & 1) << 2)
    return tl.where(t == 15, spread, code)


@triton.jit
def words3(w, h):
    """A 3-bit class's `load_class` words ([BS, 2, BN] words 0-1, [BS, 2, BN] word 2 twice) as three [BS, 1, BN]
    tensors for `code3`."""
    w0, w1 = tl.split(tl.permute(w, (0, 2, 1)))
    w2, _ = tl.split(tl.permute(h, (0, 2, 1)))
    return w0[:, None, :], w1[:, None, :], w2[:, None, :]


@triton.jit
def step_rows(qw_ptr, N, first_step, first_word, offs_s, mask_s, offs_n, mask_n, BITS: tl.constexpr):
    """For the steps offs_s of a class of BITS words a step: pointers [BS, BN] to each step's first word row (word
    i is `+ i·N`) and the mask of those loads."""
    m2 = mask_s[:, None] & mask_n[None, :]
    return qw_ptr + (first_word + (offs_s - first_step) * BITS)[:, None].to(tl.int64) * N + offs_n[None, :], m2


@triton.jit
def step_scales(sc_ptr, sg_ptr, N, offs_s, mask_s, offs_n, m2):
    """The scales [BS, BN] of the steps offs_s (their groups' rows)."""
    grp = tl.load(sg_ptr + offs_s, mask=mask_s, other=0)
    return tl.load(sc_ptr + grp[:, None].to(tl.int64) * N + offs_n[None, :], mask=m2, other=0.0)


# lop3 puts codes (u, u+4) of a word under the fp16 exponent of 1024, the odd ones (mask 0x00F000F0) 16x too
# large, which the fma by 1/16 that removes 1024 + the zero point (8) also undoes, so a word costs one shift.
def ptx_unpack4(word: str) -> str:
    """PTX that leaves a 4-bit word's codes minus 8 as exact fp16 pairs: q0 = (0, 4), q1 = (1, 5), q2 = (2, 6),
    q3 = (3, 7). Needs registers q0-q3, s and the constants z = 1032 (x2), c = 1/16 (x2), d = -72 (x2)."""
    return f"""
lop3.b32 q0, {word}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q1, {word}, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 s, {word}, 8;
lop3.b32 q2, s, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q3, s, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 q0, q0, z;
fma.rn.f16x2 q1, q1, c, d;
sub.f16x2 q2, q2, z;
fma.rn.f16x2 q3, q3, c, d;"""


PTX_UNPACK4_CONSTANTS = """
mov.b32 z, 0x64086408;
mov.b32 c, 0x2C002C00;
mov.b32 d, 0xD480D480;"""
