"""Quantized KV cache: Hadamard-rotated, per-32-element scaled codes (spec §4), 8/4/3/2 bits per element.

A row `x` of `D` elements (one token, one KV head; `D % 64 == 0`) is processed in 64-element blocks. In each block
the even elements `a[j] = x[2j]` and the odd ones `c[j] = x[2j+1]` are rotated by the unnormalised 32-point
Sylvester Hadamard transform (five fp16 butterfly stages over distances 1, 2, 4, 8, 16; the lane with the
distance bit set takes `partner − self`), giving `y[2j] = (H a)[j]`, `y[2j+1] = (H c)[j]`. Each run of 32
consecutive `y` elements gets `amax = max |y|` (fp16) and codes:

* 8 and 4 bits (exllamav2's Q8/Q4, bit for bit): `code = clamp(rint_even(fp16(fp16(y / amax)·h + h)), 0, 2h − 1)`
  with `h = 2^(b−1)`, scale `amax / h`, value `(code − h) · scale`.
* 3 and 2 bits (ours): `code = clamp(floor(fp16(y / amax)·h + h), 0, 2h − 1)`, scale `amax / h`, value
  `(code − h + ½) · scale` (mid-rise levels; better than the mid-tread rule at so few levels).

`amax = 0` gives code 0 and scale 0. Decoding: value in fp16, the same butterfly, times 1/32.

Packed layout of a row, `D·b/8` bytes, little-endian within each byte:

* 8 bits: element `e` in byte `e`. 4 bits: byte `e/2`, low nibble for even `e` (spec §4). 2 bits: byte `e/4`, bits
  `2·(e mod 4)`.
* 3 bits: 12 bytes per 32-element group `g`: bytes `12g … 12g+7` hold the low 2 bits of element `i` of the group
  at byte `12g + i/4`, bits `2·(i mod 4)`; bytes `12g+8 … 12g+11` hold bit 2 of element `i` at byte
  `12g + 8 + i/8`, bit `i mod 8`.

Scales are fp16 `[..., D/32]`, one per 32 elements in order. Cache modes (key bits, value bits): `KV_MODES`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import next_pow2, pdl_args, pdl_sync, tl, triton, use_triton
from exl2.kernels.rotary import apply_rotary_torch, check_tables, rotate_heads, token_view

KV_MODES = {"fp16": (16, 16), "q8": (8, 8), "q6": (8, 4), "q4": (4, 4), "q3": (3, 3), "q2": (2, 2)}
KV_BITS = (8, 4, 3, 2)


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes per row of `head_dim` elements."""
    return head_dim * bits // 8


def check_head_dim(head_dim: int, bits: int) -> None:
    if bits not in KV_BITS:
        raise ValueError(f"unsupported KV cache width {bits}; expected one of {KV_BITS}.")
    if head_dim % 64:
        raise ValueError(f"a quantized KV cache needs head_dim divisible by 64, got {head_dim}.")


def _zero(bits: int) -> float:
    h = 1 << (bits - 1)
    return float(h) if bits >= 4 else h - 0.5


# --------------------------------------------------------------------------------------------------- twins
def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised 32-point Hadamard along the last dim, five fp16 stages."""
    lead = v.shape[:-1]
    for h in (1, 2, 4, 8, 16):
        v = v.reshape(*lead, 32 // (2 * h), 2, h)
        lo, hi = v[..., 0, :], v[..., 1, :]
        v = torch.stack((lo + hi, lo - hi), dim=-2).reshape(*lead, 32)
    return v


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Even/odd Hadamard rotation of each 64-element block of the last dim (fp16 in, fp16 out)."""
    d = x.shape[-1]
    b = x.reshape(-1, d // 64, 32, 2)
    y = torch.stack((_butterfly(b[..., 0]), _butterfly(b[..., 1])), dim=-1)
    return y.reshape(x.shape)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[R, D]` → packed bytes `[R, D·bits/8]`."""
    r, d = codes.shape
    c = codes.to(torch.int32)
    if bits == 8:
        out = c
    elif bits in (4, 2):
        per = 8 // bits
        sh = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
        out = (c.view(r, d // per, per) << sh).sum(-1)
    else:
        g = c.view(r, d // 32, 32)
        lo = ((g & 3).view(r, d // 32, 8, 4) << (torch.arange(4, device=codes.device, dtype=torch.int32) * 2)).sum(-1)
        hi = (((g >> 2) & 1).view(r, d // 32, 4, 8) << torch.arange(8, device=codes.device, dtype=torch.int32)).sum(-1)
        out = torch.cat((lo, hi), dim=-1).view(r, d * 3 // 8)
    return out.to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of `_pack`: `[R, D·bits/8]` → int32 codes `[R, D]`."""
    r = packed.shape[0]
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    if bits in (4, 2):
        per = 8 // bits
        sh = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
        return ((p.unsqueeze(-1) >> sh) & ((1 << bits) - 1)).view(r, d)
    g = p.view(r, d // 32, 12)
    lo = (g[..., :8].unsqueeze(-1) >> (torch.arange(4, device=packed.device, dtype=torch.int32) * 2)) & 3
    hi = (g[..., 8:].unsqueeze(-1) >> torch.arange(8, device=packed.device, dtype=torch.int32)) & 1
    return (lo.reshape(r, d // 32, 32) | (hi.reshape(r, d // 32, 32) << 2)).view(r, d)


def quantize_kv_torch(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `quantize_kv`."""
    d = x.shape[-1]
    check_head_dim(d, bits)
    rows = x.reshape(-1, d).to(torch.float16)
    g = _rotate(rows).view(rows.shape[0], d // 32, 32)
    amax = g.abs().amax(-1)
    q = (g / amax.unsqueeze(-1)).float()  # fp16 division: NaN where amax == 0
    h = float(1 << (bits - 1))
    if bits >= 4:
        code = torch.round((q * h + h).to(torch.float16).float())
    else:
        code = torch.floor(q * h + h)
    code = torch.nan_to_num(code, nan=0.0).clamp(0, (1 << bits) - 1).to(torch.uint8)
    scales = (amax.float() / h).to(torch.float16)
    packed = _pack(code.view(-1, d), bits)
    return packed.view(*x.shape[:-1], -1), scales.view(*x.shape[:-1], d // 32)


def dequantize_kv_torch(packed: torch.Tensor, scales: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """The twin of `dequantize_kv`."""
    check_head_dim(head_dim, bits)
    p = packed.reshape(-1, packed.shape[-1])
    code = _unpack(p, bits, head_dim).view(-1, head_dim // 32, 32).to(torch.float16)
    v = (code - _zero(bits)) * scales.reshape(-1, head_dim // 32, 1).to(torch.float16)
    x = _rotate(v.view(-1, head_dim)) * (1.0 / 32)
    return x.view(*packed.shape[:-1], head_dim)


def rotation_matrix(head_dim: int, device: torch.device | str = "cpu", dtype=torch.float16) -> torch.Tensor:
    """The rotation as a symmetric `[D, D]` matrix R (entries 0/±1): `y = x·R`, and `R·R = 32·I`."""
    i = torch.arange(head_dim, device=device)
    same_blk = (i[:, None] // 64) == (i[None, :] // 64)
    same_par = (i[:, None] % 2) == (i[None, :] % 2)
    a = (i[:, None] % 64) // 2 & (i[None, :] % 64) // 2
    parity = torch.zeros_like(a)
    for s in range(5):
        parity ^= (a >> s) & 1
    return torch.where(same_blk & same_par, 1 - 2 * parity, 0).to(dtype)


# --------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _butterfly_tl(y, RT: tl.constexpr):
    """Five fp16 butterfly stages on the last dim (32) of y [RT, 32], each an exact ±1 product (two terms)."""
    i = tl.arange(0, 32)[:, None]
    k = tl.arange(0, 32)[None, :]
    for s in tl.static_range(5):
        h = 1 << s
        diag = tl.where((k & h) != 0, -1.0, 1.0)
        m = tl.where(i == k, diag, tl.where(i == (k ^ h), 1.0, 0.0)).to(tl.float16)
        y = tl.dot(y, m).to(tl.float16)
    return y


@triton.jit
def h32_tl():
    """The unnormalised 32×32 Sylvester Hadamard matrix, fp16 (symmetric: H·H = 32·I)."""
    a = tl.arange(0, 32)[:, None] & tl.arange(0, 32)[None, :]
    par = (a ^ (a >> 1) ^ (a >> 2) ^ (a >> 3) ^ (a >> 4)) & 1
    return (1 - 2 * par).to(tl.float16)


@triton.jit
def kv_codes(row_ptr, e, mask, BITS: tl.constexpr):
    """int32 codes of flat elements `e` of packed rows starting at `row_ptr` (shapes broadcast; 0 where masked)."""
    if BITS == 8:
        code = tl.load(row_ptr + e, mask=mask, other=0).to(tl.int32)
    elif BITS == 4:
        code = (tl.load(row_ptr + e // 2, mask=mask, other=0).to(tl.int32) >> (4 * (e % 2))) & 15
    elif BITS == 2:
        code = (tl.load(row_ptr + e // 4, mask=mask, other=0).to(tl.int32) >> (2 * (e % 4))) & 3
    else:
        g = e // 32
        i = e % 32
        lo = (tl.load(row_ptr + 12 * g + i // 4, mask=mask, other=0).to(tl.int32) >> (2 * (i % 4))) & 3
        hi = (tl.load(row_ptr + 12 * g + 8 + i // 8, mask=mask, other=0).to(tl.int32) >> (i % 8)) & 1
        code = lo | (hi << 2)
    return code


@triton.jit
def kv_rows_rotated(row_ptr, srow_ptr, nmask, BITS: tl.constexpr, ZERO: tl.constexpr, NB, NBP: tl.constexpr,
                    BN: tl.constexpr):
    """fp16 [BN, NBP·64] rows of rotated values (still in the rotated domain), column order d' = 64·blk + 32·par + j
    for element e = 64·blk + 2j + par. `row_ptr`/`srow_ptr` [BN] point at each row's packed bytes / scales.
    Contiguous word loads, unpacked with broadcast shifts (no gathers)."""
    R: tl.constexpr = BN * NBP
    r = tl.arange(0, R)
    blk = r % NBP
    rptr = tl.reshape(tl.broadcast_to(row_ptr[:, None], [BN, NBP]), [R])
    sptr = tl.reshape(tl.broadcast_to(srow_ptr[:, None], [BN, NBP]), [R])
    ok = tl.reshape(tl.broadcast_to(nmask[:, None], [BN, NBP]), [R]) & (blk < NB)
    par = tl.arange(0, 2)
    if BITS == 8:
        j = tl.arange(0, 32)
        pp = rptr.to(tl.pointer_type(tl.uint16))[:, None] + blk[:, None] * 32 + j[None, :]
        w = tl.load(pp, mask=ok[:, None], other=0).to(tl.int32)
        code = (w[:, None, :] >> (8 * par)[None, :, None]) & 255
    else:
        # int32 loads (8/6/4 words a 64-element block; byte loads took 46 % longer, benchmarks/RESULTS.md session
        # 27); rotated column d' = 32·par + j, j read from the little-endian words as the byte layout places it
        wptr = rptr.to(tl.pointer_type(tl.int32))
        if BITS == 4:  # word w, byte k: j = 4w + k, nibble par
            w8 = tl.arange(0, 8)
            words = tl.load(wptr[:, None] + blk[:, None] * 8 + w8[None, :], mask=ok[:, None], other=0)
            sh = 8 * tl.arange(0, 4)[None, None, None, :] + 4 * par[None, :, None, None]
            code = tl.reshape((words[:, None, :, None] >> sh) & 15, [R, 2, 32])
        elif BITS == 2:  # word w, field m of 2 bits a pair: j = 8w + m, bits 4m + 2·par
            w4 = tl.arange(0, 4)
            words = tl.load(wptr[:, None] + blk[:, None] * 4 + w4[None, :], mask=ok[:, None], other=0)
            sh = 4 * tl.arange(0, 8)[None, None, None, :] + 2 * par[None, :, None, None]
            code = tl.reshape((words[:, None, :, None] >> sh) & 3, [R, 2, 32])
        else:  # 3 words a group h (the 32 elements 64·blk + 32h …): 2 of low bits, j = 16h + 8w + m; 1 of top bits
            w4 = tl.arange(0, 4)
            words = tl.load(wptr[:, None] + blk[:, None] * 6 + 3 * (w4[None, :] // 2) + w4[None, :] % 2,
                            mask=ok[:, None], other=0)
            lo = tl.reshape(words, [R, 2, 2])
            hi = tl.load(wptr[:, None] + blk[:, None] * 6 + 3 * tl.arange(0, 2)[None, :] + 2, mask=ok[:, None], other=0)
            lsh = 4 * tl.arange(0, 8)[None, None, None, None, :] + 2 * par[None, :, None, None, None]
            hsh = 2 * tl.arange(0, 16)[None, None, None, :] + par[None, :, None, None]
            code = tl.reshape((lo[:, None, :, :, None] >> lsh) & 3, [R, 2, 32]) \
                | (tl.reshape((hi[:, None, :, None] >> hsh) & 1, [R, 2, 32]) << 2)
    half = tl.arange(0, 2)
    sc = tl.load(sptr[:, None] + blk[:, None] * 2 + half[None, :], mask=ok[:, None], other=0.0)
    sc = tl.reshape(tl.broadcast_to(sc[:, None, :, None], [R, 2, 2, 16]), [R, 2, 32])
    val = (code.to(tl.float16) - ZERO) * sc
    return tl.reshape(val, [BN, NBP * 64])


@triton.jit
def _kv_quant_kernel(x_ptr, p_ptr, s_ptr, slot_ptr, ROWS, H, stride_xt, stride_xh, stride_pt, stride_ph,
                     stride_st, stride_sh, NB, HAS_SLOTS: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr,
                     NBP: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        pdl_sync()
    _quant_block(tl.program_id(0), x_ptr, p_ptr, s_ptr, slot_ptr, ROWS, H, stride_xt, stride_xh, stride_pt,
                 stride_ph, stride_st, stride_sh, NB, HAS_SLOTS, BITS, BT, NBP)


@triton.jit
def _kv_quant_pair_kernel(k_ptr, kp_ptr, ks_ptr, v_ptr, vp_ptr, vs_ptr, slot_ptr, ROWS, H, stride_kt, stride_kh,
                          stride_vt, stride_vh, stride_kpt, stride_kph, stride_kst, stride_ksh, stride_vpt, stride_vph,
                          stride_vst, stride_vsh, NB_K, NB_V, K_PROGS, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                          BT_K: tl.constexpr, NBP_K: tl.constexpr, BT_V: tl.constexpr, NBP_V: tl.constexpr,
                          q_ptr=None, cos_ptr=None, sin_ptr=None, pos_ptr=None, HQ=0, stride_qt=0, stride_qh=0,
                          stride_cos=0, HALF_R=0, QBLOCKS=1, Q_PROGS=0, ROPE: tl.constexpr = False,
                          INTERLEAVED: tl.constexpr = False, BLOCK_H: tl.constexpr = 16, BLOCK_R: tl.constexpr = 16,
                          Q_HADAMARD: tl.constexpr = False, PDL: tl.constexpr = False):
    """Keys and values of one write into their cache rows: one launch. With ROPE the first Q_PROGS programs
    rotate q in place and the keys are rotated on their way into the cache (a decode step's RoPE and cache write
    in one launch), with Q_HADAMARD also into the keys' rotated basis, BT_K rows (token, head) a program; then
    the key programs (K_PROGS), then the value programs."""
    if PDL:
        pdl_sync()
    pid = tl.program_id(0)
    if ROPE and Q_HADAMARD and pid < Q_PROGS:
        _rotate_q_rows(pid, q_ptr, cos_ptr, sin_ptr, pos_ptr, ROWS // H * HQ, HQ, stride_qt, stride_qh, stride_cos,
                       HALF_R, NB_K, BT_K, NBP_K, INTERLEAVED)
    elif ROPE and not Q_HADAMARD and pid < Q_PROGS:
        rotate_heads(q_ptr, q_ptr, cos_ptr, sin_ptr, pos_ptr, (pid // QBLOCKS).to(tl.int64), pid % QBLOCKS, 0, HQ, 0,
                     stride_qt, stride_qh, 0, 0, stride_cos, HALF_R, QBLOCKS, q_ptr, 0, INTERLEAVED, BLOCK_H, BLOCK_R,
                     False, 16)
    elif pid < Q_PROGS + K_PROGS:
        _quant_block(pid - Q_PROGS, k_ptr, kp_ptr, ks_ptr, slot_ptr, ROWS, H, stride_kt, stride_kh, stride_kpt,
                     stride_kph, stride_kst, stride_ksh, NB_K, True, K_BITS, BT_K, NBP_K, cos_ptr, sin_ptr, pos_ptr,
                     stride_cos, HALF_R, ROPE, INTERLEAVED)
    else:
        _quant_block(pid - Q_PROGS - K_PROGS, v_ptr, vp_ptr, vs_ptr, slot_ptr, ROWS, H, stride_vt, stride_vh,
                     stride_vpt, stride_vph, stride_vst, stride_vsh, NB_V, True, V_BITS, BT_V, NBP_V)


@triton.jit
def _rotate_q_rows(pid, q_ptr, cos_ptr, sin_ptr, pos_ptr, ROWS, HQ, stride_qt, stride_qh, stride_cos, HALF_R, NB,
                   BT: tl.constexpr, NBP: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Program `pid`'s BT query rows (token, head), in place: RoPE, then each 64-block's even and odd elements
    times H32 / 32, stored in the basis d' = 64·blk + 32·par + j in which attention reads a quantized key cache
    (the product attention would otherwise repeat in every key split)."""
    x, _, blk, par, valid, _, _, rows = _load_rows(pid, q_ptr, ROWS, HQ, stride_qt, stride_qh, NB, BT, NBP, cos_ptr,
                                                   sin_ptr, pos_ptr, stride_cos, HALF_R, True, INTERLEAVED)
    y = tl.dot(x.to(tl.float16), h32_tl()) * 0.03125  # every load of these rows comes before the dot
    tl.store(rows[:, None] + (blk * 64 + par * 32)[:, None] + tl.arange(0, 32)[None, :], y.to(x.dtype),
             mask=valid[:, None])


@triton.jit
def _load_rows(pid, x_ptr, ROWS, H, stride_xt, stride_xh, NB, BT: tl.constexpr, NBP: tl.constexpr, cos_ptr, sin_ptr,
               pos_ptr, stride_cos, HALF_R, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Program `pid`'s BT rows (token, head) of x as a [BT·NBP·2, 32] tile in the quantizer's order (tile row:
    row, 64-block blk, parity par; column j: element e = 64·blk + 2j + par), RoPE applied with ROPE. Returns
    (x, e, blk, par, valid, tok, head, the rows' pointers)."""
    rho = tl.arange(0, BT * NBP * 2)
    blk = (rho // 2) % NBP
    par = rho % 2
    row = pid * BT + rho // (NBP * 2)
    valid = (row < ROWS) & (blk < NB)
    tok = (row // H).to(tl.int64)
    head = row % H
    e = blk[:, None] * 64 + 2 * tl.arange(0, 32)[None, :] + par[:, None]
    x_rows = x_ptr + tok * stride_xt + head * stride_xh
    x = tl.load(x_rows[:, None] + e, mask=valid[:, None], other=0.0)
    if ROPE:
        x = _rope_elements(x, x_rows, e, valid[:, None], pos_ptr, tl.where(valid, tok, 0), cos_ptr, sin_ptr,
                           stride_cos, HALF_R, INTERLEAVED)
    return x, e, blk, par, valid, tok, head, x_rows


@triton.jit
def _rope_elements(x, x_rows, e, ok, pos_ptr, tok, cos_ptr, sin_ptr, stride_cos, HALF_R,
                   INTERLEAVED: tl.constexpr):
    """x [RT, 32] (elements `e` of the rows at `x_rows`) rotated by RoPE at each row's position, in fp32 and rounded
    to x's type as `rotary.apply_rotary` does; features past the rotary ones pass through."""
    if INTERLEAVED:
        first = (e % 2) == 0
        partner = e ^ 1
        idx = e // 2
    else:
        first = e < HALF_R
        partner = tl.where(first, e + HALF_R, e - HALF_R)
        idx = tl.where(first, e, e - HALF_R)
    rot = ok & (e < 2 * HALF_R)
    pos = tl.load(pos_ptr + tok).to(tl.int64)[:, None]
    c = tl.load(cos_ptr + pos * stride_cos + idx, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + idx, mask=rot, other=0.0).to(tl.float32)
    xp = tl.load(x_rows[:, None] + partner, mask=rot, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    y = tl.where(first, xf * c - xp * s, xf * c + xp * s)
    return tl.where(rot, y.to(x.dtype), x)


@triton.jit
def _quant_block(pid, x_ptr, p_ptr, s_ptr, slot_ptr, ROWS, H, stride_xt, stride_xh, stride_pt, stride_ph,
                 stride_st, stride_sh, NB, HAS_SLOTS: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr,
                 NBP: tl.constexpr, cos_ptr=None, sin_ptr=None, pos_ptr=None, stride_cos=0, HALF_R=0,
                 ROPE: tl.constexpr = False, INTERLEAVED: tl.constexpr = False):
    """Program `pid`'s BT rows (token, head) of x: (with ROPE, apply RoPE first), rotate, quantize and store codes
    and scales."""
    RT: tl.constexpr = BT * NBP * 2
    HALF: tl.constexpr = 1 << (BITS - 1)
    x, e, _, _, valid, tok, head, _ = _load_rows(pid, x_ptr, ROWS, H, stride_xt, stride_xh, NB, BT, NBP, cos_ptr,
                                                 sin_ptr, pos_ptr, stride_cos, HALF_R, ROPE, INTERLEAVED)
    j = tl.arange(0, 32)
    y = _butterfly_tl(x.to(tl.float16), RT)
    a4 = tl.reshape(tl.abs(y), [RT // 2, 2, 2, 16])
    amax = tl.max(tl.max(a4, axis=3), axis=1)  # [RT/2, 2 halves]
    am = tl.reshape(tl.broadcast_to(amax[:, None, :, None], [RT // 2, 2, 2, 16]), [RT, 32])
    q = tl.math.div_rn(y.to(tl.float32), am.to(tl.float32)).to(tl.float16).to(tl.float32)
    if BITS >= 4:
        t = (q * HALF + HALF).to(tl.float16).to(tl.float32)
        r = tl.floor(t + 0.5)
        r = tl.where(((r - t) == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)
    else:
        r = tl.floor(q * HALF + HALF)
    r = tl.where(r == r, r, 0.0)
    code = tl.minimum(tl.maximum(r, 0.0), 2 * HALF - 1).to(tl.int32)

    # per 64-element block (row-block rb = (th, blk)) addressing, for the packed bytes and the scales
    rb = tl.arange(0, RT // 2)
    rb_blk = rb % NBP
    rb_row = pid * BT + rb // NBP
    rb_valid = (rb_row < ROWS) & (rb_blk < NB)
    rb_tok = (rb_row // H).to(tl.int64)
    rb_head = rb_row % H
    if HAS_SLOTS:
        rb_slot = tl.load(slot_ptr + rb_tok, mask=rb_valid, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + tok, mask=valid, other=0).to(tl.int64)
    else:
        rb_slot = rb_tok
        slot = tok
    p_row = p_ptr + slot * stride_pt + head * stride_ph
    rb_prow = p_ptr + rb_slot * stride_pt + rb_head * stride_ph
    if BITS == 8:
        tl.store(p_row[:, None] + e, code.to(tl.uint8), mask=valid[:, None])
    elif BITS == 4:
        c3 = tl.reshape(code, [RT // 2, 2, 32]) << (4 * tl.arange(0, 2))[None, :, None]
        byte = tl.sum(c3, axis=1)
        tl.store(rb_prow[:, None] + rb_blk[:, None] * 32 + j[None, :], byte.to(tl.uint8), mask=rb_valid[:, None])
    elif BITS == 2:
        c4 = tl.reshape(code, [RT // 2, 2, 16, 2])
        sh = 2 * (2 * tl.arange(0, 2)[None, None, None, :] + tl.arange(0, 2)[None, :, None, None])
        byte = tl.sum(tl.sum(c4 << sh, axis=3), axis=1)
        j16 = tl.arange(0, 16)
        tl.store(rb_prow[:, None] + rb_blk[:, None] * 16 + j16[None, :], byte.to(tl.uint8), mask=rb_valid[:, None])
    else:
        par5 = tl.arange(0, 2)[None, :, None, None, None]
        lo5 = tl.reshape(code & 3, [RT // 2, 2, 2, 8, 2])
        lo = tl.sum(tl.sum(lo5 << (2 * (2 * tl.arange(0, 2)[None, None, None, None, :] + par5)), axis=4), axis=1)
        hi5 = tl.reshape((code >> 2) & 1, [RT // 2, 2, 2, 4, 4])
        hi = tl.sum(tl.sum(hi5 << (2 * tl.arange(0, 4)[None, None, None, None, :] + par5), axis=4), axis=1)
        gb = 12 * (rb_blk[:, None, None] * 2 + tl.arange(0, 2)[None, :, None])  # [RT/2, 2, 1]
        tl.store(rb_prow[:, None, None] + gb + tl.arange(0, 8)[None, None, :], lo.to(tl.uint8),
                 mask=rb_valid[:, None, None])
        tl.store(rb_prow[:, None, None] + gb + 8 + tl.arange(0, 4)[None, None, :], hi.to(tl.uint8),
                 mask=rb_valid[:, None, None])
    sc = (amax.to(tl.float32) / HALF).to(tl.float16)
    s_ptrs = s_ptr + rb_slot[:, None] * stride_st + rb_head[:, None] * stride_sh + rb_blk[:, None] * 2 \
        + tl.arange(0, 2)[None, :]
    tl.store(s_ptrs, sc, mask=rb_valid[:, None])


@triton.jit
def _kv_dequant_kernel(p_ptr, s_ptr, o_ptr, ROWS, NB, stride_p, stride_s, stride_o, ZERO: tl.constexpr,
                       BITS: tl.constexpr, BT: tl.constexpr, NBP: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        pdl_sync()
    RT: tl.constexpr = BT * NBP * 2
    rho = tl.arange(0, RT)
    th = rho // (NBP * 2)
    blk = (rho // 2) % NBP
    par = rho % 2
    row = (tl.program_id(0) * BT + th).to(tl.int64)
    valid = (row < ROWS) & (blk < NB)
    j = tl.arange(0, 32)
    e = blk[:, None] * 64 + 2 * j[None, :] + par[:, None]
    m = valid[:, None] & (j[None, :] >= 0)
    row_ptr = p_ptr + row[:, None] * stride_p
    code = kv_codes(row_ptr, e, m, BITS)
    sc = tl.load(s_ptr + row[:, None] * stride_s + e // 32, mask=m, other=0.0)
    v = (code.to(tl.float16) - ZERO) * sc
    x = _butterfly_tl(v, RT) * 0.03125
    tl.store(o_ptr + row[:, None] * stride_o + e, x.to(tl.float16), mask=m)


# --------------------------------------------------------------------------------------------------- API
def _block_rows(d: int) -> tuple[int, int]:
    nbp = next_pow2(d // 64)
    bt = max(1, 16 // (2 * nbp))  # at least 16 tile rows for tl.dot
    return bt, nbp


def write_kv_quant(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor | None,
                   bits: int) -> None:
    """Quantize `x` `[T, H, D]` into cache rows: `packed[slot_mapping[t], h]`, `scales[slot_mapping[t], h]`.

    `packed` is uint8 `[slots, H, D·bits/8]` and `scales` fp16 `[slots, H, D/32]` (any leading shape that views as
    slots, e.g. `[pages, page_size, H, ·]`). `slot_mapping=None` writes row t to slot t.
    """
    t, h, d = x.shape
    check_head_dim(d, bits)
    pk = packed.view(-1, h, packed.shape[-1])
    sc = scales.view(-1, h, scales.shape[-1])
    if pk.shape[-1] != packed_dim(d, bits) or sc.shape[-1] != d // 32:
        raise ValueError(f"cache rows of {pk.shape[-1]} bytes / {sc.shape[-1]} scales do not fit D={d} at {bits} bits.")
    if not use_triton(x):
        q, s = quantize_kv_torch(x, bits)
        idx = torch.arange(t, device=x.device) if slot_mapping is None else slot_mapping.reshape(-1).long()
        pk.index_copy_(0, idx, q)
        sc.index_copy_(0, idx, s)
        return
    if t == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    bt, nbp = _block_rows(d)
    rows = t * h
    _kv_quant_kernel[(triton.cdiv(rows, bt),)](
        x, pk, sc, slot_mapping if slot_mapping is not None else x, rows, h, x.stride(0), x.stride(1),
        pk.stride(0), pk.stride(1), sc.stride(0), sc.stride(1), d // 64, HAS_SLOTS=slot_mapping is not None,
        BITS=bits, BT=bt, NBP=nbp, num_warps=4, **pdl_args(x.device, x.shape[0], small=True))


def write_kv_quant_pair(k: torch.Tensor, v: torch.Tensor, k_cache: tuple[torch.Tensor, torch.Tensor],
                        v_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, k_bits: int,
                        v_bits: int, rope: tuple | None = None, hadamard_q: bool = False) -> bool:
    """`write_kv_quant` of keys and values `[T, H, D]` (widths may differ) in one launch; caches as (packed,
    scales). `rope` (q, cos, sin, positions, rotary_dim, interleaved): in the same launch rotate q in place and the
    keys on their way into the cache (`rotary.apply_rotary`'s arithmetic; k itself is left as it was); with
    `hadamard_q` q is left in the keys' rotated basis as well (for `attention.paged_attention(q_rotated=True)`).
    Returns whether it was (only the Triton path does it)."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    if rope is not None:
        q, cos, sin, positions, rotary_dim, interleaved = rope
        rd = check_tables(q, k, cos, sin, positions, rotary_dim)
        if positions.numel() != t:
            raise ValueError(f"{t} key rows but {positions.numel()} positions.")
    if not use_triton(k) or t == 0:
        if rope is not None:
            k = k.clone()
            apply_rotary_torch(q, k, cos, sin, positions, rotary_dim, interleaved)
        write_kv_quant(k, *k_cache, slot_mapping, k_bits)
        write_kv_quant(v, *v_cache, slot_mapping, v_bits)
        return False
    rows = []
    for x, (packed, scales), bits in ((k, k_cache, k_bits), (v, v_cache, v_bits)):
        d = x.shape[-1]
        check_head_dim(d, bits)
        pk, sc = packed.view(-1, h, packed.shape[-1]), scales.view(-1, h, scales.shape[-1])
        if pk.shape[-1] != packed_dim(d, bits) or sc.shape[-1] != d // 32:
            raise ValueError(f"cache rows of {pk.shape[-1]} bytes / {sc.shape[-1]} scales do not fit D={d} at "
                             f"{bits} bits.")
        rows.append((x if x.stride(-1) == 1 else x.contiguous(), pk, sc) + _block_rows(d))
    (k2, kp, ks, bt_k, nbp_k), (v2, vp, vs, bt_v, nbp_v) = rows
    k_progs = triton.cdiv(t * h, bt_k)
    extra, q_progs = {}, 0
    if rope is not None:
        q3 = token_view(q, t)
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        hadamard_q = bool(hadamard_q) and q3.shape[2] == dk
        if hadamard_q:  # BT_K query rows a program, as the keys; the plain RoPE's head blocking is unused
            block_h, block_r, qblocks = 16, 16, 1
            q_progs = triton.cdiv(t * q3.shape[1], bt_k)
        else:
            block_h, block_r = min(16, next_pow2(q3.shape[1])), next_pow2(rd // 2)
            qblocks = triton.cdiv(q3.shape[1], block_h)
            q_progs = t * qblocks
        extra = dict(q_ptr=q3, cos_ptr=cos, sin_ptr=sin, pos_ptr=positions.reshape(-1), HQ=q3.shape[1],
                     stride_qt=q3.stride(0), stride_qh=q3.stride(1), stride_cos=cos.stride(0), HALF_R=rd // 2,
                     QBLOCKS=qblocks, Q_PROGS=q_progs, ROPE=True, INTERLEAVED=bool(interleaved), BLOCK_H=block_h,
                     BLOCK_R=block_r, Q_HADAMARD=hadamard_q)
    _kv_quant_pair_kernel[(q_progs + k_progs + triton.cdiv(t * h, bt_v),)](
        k2, kp, ks, v2, vp, vs, slot_mapping.reshape(-1), t * h, h, k2.stride(0), k2.stride(1), v2.stride(0),
        v2.stride(1), kp.stride(0), kp.stride(1), ks.stride(0), ks.stride(1), vp.stride(0), vp.stride(1),
        vs.stride(0), vs.stride(1), dk // 64, dv // 64, k_progs, K_BITS=k_bits, V_BITS=v_bits, BT_K=bt_k,
        NBP_K=nbp_k, BT_V=bt_v, NBP_V=nbp_v, num_warps=4, **extra, **pdl_args(k.device, t, small=True))
    return rope is not None and hadamard_q


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., D]` → (packed uint8 `[..., D·bits/8]`, scales fp16 `[..., D/32]`); see the module docstring."""
    d = x.shape[-1]
    check_head_dim(d, bits)
    if not use_triton(x):
        return quantize_kv_torch(x, bits)
    lead = x.shape[:-1]
    packed = torch.empty((*lead, packed_dim(d, bits)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*lead, d // 32), dtype=torch.float16, device=x.device)
    write_kv_quant(x.reshape(-1, 1, d), packed.view(-1, 1, packed.shape[-1]), scales.view(-1, 1, d // 32), None,
                   bits)
    return packed, scales


def dequantize_kv(packed: torch.Tensor, scales: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of `quantize_kv` up to the quantization error: fp16 `[..., head_dim]`."""
    check_head_dim(head_dim, bits)
    if not use_triton(packed):
        return dequantize_kv_torch(packed, scales, bits, head_dim)
    p = packed.reshape(-1, packed.shape[-1])
    s = scales.reshape(-1, scales.shape[-1])
    out = torch.empty((p.shape[0], head_dim), dtype=torch.float16, device=packed.device)
    if p.shape[0]:
        bt, nbp = _block_rows(head_dim)
        _kv_dequant_kernel[(triton.cdiv(p.shape[0], bt),)](
            p, s, out, p.shape[0], head_dim // 64, p.stride(0), s.stride(0), out.stride(0), ZERO=_zero(bits),
            BITS=bits, BT=bt, NBP=nbp, num_warps=4, **pdl_args(p.device, p.shape[0], small=True))
    return out.view(*packed.shape[:-1], head_dim)
