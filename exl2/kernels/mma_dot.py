"""Tensor-core kernel for 5 to 16 input rows of a 4-bit EXL2/GPTQ matrix, written in Gluon (Triton's explicit-layout
dialect) so the decoded weights land directly in the registers the tensor-core instruction reads.

Plain Triton decodes into a layout of its choosing and then moves every fp16 weight through shared memory to
reach the mma operand layout (benchmarks/RESULTS.md, session 7: 10-27 bytes of shared-memory traffic per weight,
the kernel 5-7x off the bandwidth bound). Here each thread loads exactly the words whose codes its `mma.m16n8k16`
B fragment holds. In the fragment a thread owns, per column n and per 16 rows of K, the rows
2q, 2q + 1, 2q + 8, 2q + 9 (q = lane % 4). The permuted input of a 4-bit class (`qweight.PAIR_ORDER`) puts
position 8j + 4·u1 + 2·u0 + u2 on row-in-word u = u0 + 2·u1 + 4·u2 of low word j, so with the positions as K the
lane's q = u0 + 2·u1 picks the code pair (q, q + 4) of every word j of its column: one shift, one `lop3` (the
0x6400 exponent trick) and a packed subtract and multiply give both fp16 weights of one 32-bit fragment register,
bit-exact with the reference dequantizer. Only the input tile goes through shared memory (once per program).

GPU only (Gluon has no interpreter); `quant_matmul` uses it where `available()` and falls back to `_dot_kernel`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import INTERPRET, counters, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAVE_GLUON = not INTERPRET
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6
except Exception:  # noqa: BLE001 - an older Triton (or none): the Triton kernel serves every shape
    HAVE_GLUON = False

if HAVE_GLUON:
    # One instance per fragment register: the code pair (q, q + 4) of low word $1 (shifted right by $3) as two fp16
    # (1024 + code), minus 1024 + the zero point, times the scale, both fp16 pairs ($5, and $7 for the zeros): the
    # low half is row-in-word q, the high half q + 4 (one fp16 rounding, as the reference dequantizer).
    _PAIR_ASM = gl.constexpr("""
    {
    .reg .b32 t, z;
    mov.b32 z, 0x64086408;
    shr.u32 t, $1, $3;
    lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;
    sub.f16x2 t, t, z;
    mul.rn.f16x2 $0, t, $5;
    }
    """)
    _PAIR_ZERO_ASM = gl.constexpr("""
    {
    .reg .b32 t;
    shr.u32 t, $1, $3;
    lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;
    sub.f16x2 t, t, $7;
    mul.rn.f16x2 $0, t, $5;
    }
    """)

    @gluon.jit
    def _pair_bits(v):
        """fp16 tensor -> int32 holding the value in both halves (a packed-fp16 operand)."""
        b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return b | (b << 16)

    @gluon.jit
    def _mma4_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                     M, N, stride_xm, stride_om, SPLIT, first_step, n_steps, first_word,
                     HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_ON: gl.constexpr,
                     BS: gl.constexpr, V: gl.constexpr):
        """out[:M, tile] (or this split's partial) = x · W over a 4-bit class, BS steps of 32 rows per iteration
        and a tile of BN = 32·V columns, the next iteration's words, scales and input loaded before this one's
        math. The fragment's column n is stored column (n % 32)·V + n // 32 of the tile, so each thread's V
        columns are adjacent in memory (one V-word load per word row)."""
        gl.static_assert(gl.num_warps() == 4)
        BN: gl.constexpr = 32 * V
        K: gl.constexpr = BS * 32
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # [step, low word j, lane pair q, column / V, column % V, code pair]: q on lanes 0-1 (the fragment's k bits
        # 1-2), columns / V on lanes 2-4 and the warps, the rest in registers.
        W6: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, V, 2], [1, 1, 4, 8, 1, 1], [1, 1, 1, 4, 1, 1],
                                            [5, 4, 2, 1, 0, 3])
        L5: gl.constexpr = gl.SliceLayout(5, W6)  # [s, j, q, c, v]
        L4: gl.constexpr = gl.SliceLayout(2, L5)  # [s, j, c, v]: the words (a quad's lanes load the same ones)
        L3: gl.constexpr = gl.SliceLayout(1, L4)  # [s, c, v]: the scales
        LS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))  # [s]
        LC: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, L3))  # [c]
        LV: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, L3))  # [v]
        X_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        O_L: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        s_lo = first_step + (n_steps * pid_k) // SPLIT
        s_hi = first_step + (n_steps * (pid_k + 1)) // SPLIT

        st = gl.arange(0, BS, layout=LS)
        col = (pid_n * BN + gl.expand_dims(gl.arange(0, 32, layout=LC) * V, 1)
               + gl.expand_dims(gl.arange(0, V, layout=LV), 0))  # [c, v] stored column
        col3 = gl.expand_dims(col, 0)  # [1, c, v]
        ok_n3 = col3 < N
        SJ: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))  # [s, j]
        st4 = gl.arange(0, BS, layout=gl.SliceLayout(1, SJ))
        jj = gl.arange(0, 4, layout=gl.SliceLayout(0, SJ))
        w_row = gl.expand_dims(gl.expand_dims(gl.expand_dims(st4 * 4, 1) + gl.expand_dims(jj, 0), 2), 3)  # [s,j,1,1]
        w_off = w_row * N + gl.expand_dims(col3, 1)  # [s, j, c, v]
        qq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4,
                                                                                                          L5)))))
        shift = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(qq * 4, 0), 1), 3), 4),
                               5)  # [1, 1, q, 1, 1, 1]
        xm = gl.arange(0, 16, layout=gl.SliceLayout(1, X_L))
        xk = gl.arange(0, K, layout=gl.SliceLayout(0, X_L))
        x_rows = x_ptr + gl.expand_dims(xm, 1) * stride_xm
        mask_m = gl.expand_dims(xm < M, 1)
        w_ptr = qw_ptr + (first_word + (s_lo - first_step) * 4).to(gl.int64) * N

        # the first iteration's operands
        ok_s = s_lo + st < s_hi
        ok3 = gl.expand_dims(gl.expand_dims(ok_s, 1), 2) & ok_n3
        w_n = gl.load(w_ptr + w_off, mask=gl.expand_dims(ok3, 1))
        grp = gl.load(sg_ptr + s_lo + st, mask=ok_s, other=0)
        g_off = gl.expand_dims(gl.expand_dims(grp, 1), 2) * N + col3
        sc_n = gl.load(sc_ptr + g_off, mask=ok3, other=0.0)
        if HAS_ZEROS:
            z_n = gl.load(zr_ptr + g_off, mask=ok3, other=0.0) + 1024.0
        x_n = gl.load(x_rows + gl.expand_dims(s_lo * 32 + xk, 0),
                      mask=mask_m & gl.expand_dims(s_lo * 32 + xk < s_hi * 32, 0), other=0.0)

        acc = gl.zeros([16, BN], gl.float32, MMA)
        for s0 in range(s_lo, s_hi, BS):
            w = w_n
            sc = sc_n
            xt = x_n
            if HAS_ZEROS:
                z = z_n
            # the next iteration's operands, in flight during this one's math
            s1 = s0 + BS
            w_ptr += 4 * BS * N
            ok_s = s1 + st < s_hi
            ok3 = gl.expand_dims(gl.expand_dims(ok_s, 1), 2) & ok_n3
            w_n = gl.load(w_ptr + w_off, mask=gl.expand_dims(ok3, 1))
            grp = gl.load(sg_ptr + s1 + st, mask=ok_s, other=0)
            g_off = gl.expand_dims(gl.expand_dims(grp, 1), 2) * N + col3
            sc_n = gl.load(sc_ptr + g_off, mask=ok3, other=0.0)
            if HAS_ZEROS:
                z_n = gl.load(zr_ptr + g_off, mask=ok3, other=0.0) + 1024.0
            x_n = gl.load(x_rows + gl.expand_dims(s1 * 32 + xk, 0),
                          mask=mask_m & gl.expand_dims(s1 * 32 + xk < s_hi * 32, 0), other=0.0)

            pair = gl.full([BS, 4, 4, 32, V, 2], 0, gl.int32, W6)
            w6 = gl.broadcast(gl.expand_dims(gl.expand_dims(w, 2), 5), pair)[0]
            sh6 = gl.broadcast(shift, pair)[0]
            sc6 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(_pair_bits(sc), 1), 2), 5), pair)[0]
            if HAS_ZEROS:
                z6 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(_pair_bits(z), 1), 2), 5), pair)[0]
                d = gl.inline_asm_elementwise(_PAIR_ZERO_ASM, "=r,r,r,r,r,r,r,r,r", [w6, sh6, sc6, z6],
                                              dtype=gl.float16, is_pure=True, pack=2)
            else:
                d = gl.inline_asm_elementwise(_PAIR_ASM, "=r,r,r,r,r,r,r", [w6, sh6, sc6], dtype=gl.float16,
                                              is_pure=True, pack=2)
            # rows s·32 + 8j + 2q + pair (the input's positions), columns v·32 + c
            b = gl.reshape(gl.permute(d, (0, 1, 2, 5, 4, 3)), [K, BN])
            b = gl.convert_layout(b, B_L, assert_trivial=True)
            a = gl.convert_layout(xt.to(gl.float16), A_L)
            acc = mma_v2(a, b, acc)

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
            # as `quant_matmul._store_out`: publish the partial; the last program of the tile adds them all up
            p_off = gl.expand_dims(om, 1).to(gl.int64) * N + gl.expand_dims(on, 0)
            gl.store(part_ptr + pid_k * M * N + p_off, res, mask=mask)
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


def supports(w, m: int) -> bool:
    """Whether `mma4` can run this call: 1-16 rows of a matrix that is a single 4-bit class, on a CUDA GPU with
    tensor cores (sm_80+) and Gluon."""
    if not HAVE_GLUON or not 0 < m <= 16 or len(w.classes) != 1 or w.classes[0].bits != 4:
        return False
    dev = w.qweight.device
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 8


def mma4(xp: torch.Tensor, w, bs: int = 4, v: int = 2, split: int = 1) -> torch.Tensor:
    """`xp · W + bias` for xp `[M ≤ 16, S·32]` fp16, the input permuted for w (`gather_input`); w a single 4-bit
    class. bs steps of 32 rows per iteration, 32·v columns per program, K split `split` ways."""
    m = xp.shape[0]
    out = torch.empty((m, w.n), dtype=xp.dtype, device=xp.device)
    c = w.classes[0]
    grid_n = triton.cdiv(w.n, 32 * v)
    part = torch.empty((split, m, w.n), dtype=torch.float32, device=xp.device) if split > 1 else out
    zeros = w.zeros if w.zeros is not None else w.scales
    bias = w.bias if w.bias is not None else w.scales
    _mma4_kernel[(grid_n, split)](
        xp, out, part, counters(xp.device), bias, w.qweight, w.scales, zeros, w.step_group,
        m, w.n, xp.stride(0), out.stride(0), split, c.first_step, c.n_steps, c.first_word,
        HAS_ZEROS=w.zeros is not None, HAS_BIAS=w.bias is not None, SPLIT_ON=split > 1, BS=bs, V=v, num_warps=4)
    return out
