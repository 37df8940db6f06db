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

GPU only (Gluon has no interpreter); `quant_matmul` uses it where `supports()` and falls back to `_dot_kernel`.
"""
from __future__ import annotations

import torch

from exl2.kernels.backend import INTERPRET, counters, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAVE_GLUON = not INTERPRET
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6
except Exception:  # noqa: BLE001 - an older Triton (or none): the Triton kernel serves every shape
    HAVE_GLUON = False

if HAVE_GLUON:
    # One instance per fragment register: the code pair (q, q + 4) of low word $1 (shifted right by $3) as two fp16
    # (1024 + code), minus 1024 + the zero point, times the scale, both fp16 pairs ($5, and $7 for the zeros): the
    # low half is row-in-word q, the high half q + 4 (one fp16 rounding, as the reference dequantizer). The RAW
    # variant leaves the scale to be applied after the mma.
    _PAIR_CODES = """
    .reg .b32 t, z;
    shr.u32 t, $1, $3;
    lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;
    """
    _PAIR_ASM = gl.constexpr("{" + _PAIR_CODES + """
    mov.b32 z, 0x64086408;
    sub.f16x2 t, t, z;
    mul.rn.f16x2 $0, t, $5;
    }""")
    _PAIR_RAW_ASM = gl.constexpr("{" + _PAIR_CODES + """
    mov.b32 z, 0x64086408;
    sub.f16x2 $0, t, z;
    }""")
    _PAIR_ZERO_ASM = gl.constexpr("{" + _PAIR_CODES + """
    sub.f16x2 t, t, $7;
    mul.rn.f16x2 $0, t, $5;
    }""")

    # Register layouts of the cp.async copies (16 bytes a thread): words [BS·4, 32·V] int32, scales [BS, 32·V]
    # fp16, input [16, 32·BS] fp16. The pointer tensors built once per program and the masks built per issue
    # must share them.
    @gluon.constexpr_function
    def _copy_words(v):
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
    def _issue(wbuf, sbuf, zbuf, xbuf, stage, w_ptrs, x_ptrs, sc_ptr, zr_ptr, grp, s0, s_lo, s_hi, N, M, col0,
               HAS_ZEROS: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr, POST: gl.constexpr):
        """cp.async of the iteration at step s0 into `stage` of the shared-memory rings (zeros past s_hi): words
        [BS·4, BN] (`w_ptrs` point at s_lo's), scales (and zeros) [BS, BN] of groups `grp`, or with POST the one
        scale row [1, BN] of group `grp`, and the input [16, BS·32] (`x_ptrs` at s_lo's)."""
        V: gl.constexpr = BN // 32
        K: gl.constexpr = BS * 32
        CW: gl.constexpr = _copy_words(V)
        CS: gl.constexpr = _copy_scales(V)
        CX: gl.constexpr = _copy_input(BS)
        wr = gl.arange(0, BS * 4, layout=gl.SliceLayout(1, CW))
        wc = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, CW))
        ok_w = gl.expand_dims(s0 + wr // 4 < s_hi, 1) & gl.expand_dims(wc < N, 0)
        async_copy.async_copy_global_to_shared(wbuf.index(stage), w_ptrs + (s0 - s_lo).to(gl.int64) * 4 * N,
                                               mask=ok_w)
        scn = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, CS))
        if POST:
            g_off = gl.expand_dims(gl.zeros([1], gl.int64, gl.SliceLayout(1, CS)) + grp.to(gl.int64) * N, 1)
            ok_s = gl.expand_dims(gl.full([1], 1, gl.int1, gl.SliceLayout(1, CS)) & (s0 < s_hi), 1) & \
                gl.expand_dims(scn < N, 0)
            async_copy.async_copy_global_to_shared(sbuf.index(stage), sc_ptr + g_off + gl.expand_dims(scn, 0),
                                                   mask=ok_s)
        else:
            sr = gl.arange(0, BS, layout=gl.SliceLayout(1, CS))
            g_off = gl.expand_dims(grp.to(gl.int64) * N, 1) + gl.expand_dims(scn, 0)
            ok_s = gl.expand_dims(s0 + sr < s_hi, 1) & gl.expand_dims(scn < N, 0)
            async_copy.async_copy_global_to_shared(sbuf.index(stage), sc_ptr + g_off, mask=ok_s)
            if HAS_ZEROS:
                async_copy.async_copy_global_to_shared(zbuf.index(stage), zr_ptr + g_off, mask=ok_s)
        xm = gl.arange(0, 16, layout=gl.SliceLayout(1, CX))
        xk = s0 * 32 + gl.arange(0, K, layout=gl.SliceLayout(0, CX))
        ok_x = gl.expand_dims(xm < M, 1) & gl.expand_dims(xk < s_hi * 32, 0)
        async_copy.async_copy_global_to_shared(xbuf.index(stage), x_ptrs + (s0 - s_lo) * 32, mask=ok_x)
        async_copy.commit_group()

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
    def _mma4_tile(pid_n, pid_k, x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                   M, N, stride_xm, stride_om, SPLIT, first_step, n_steps, first_word,
                   HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_ON: gl.constexpr,
                   BS: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, POST: gl.constexpr):
        """out[:M, tile] (or this split's partial) = x · W over a 4-bit class, BS steps of 32 rows per iteration
        and a tile of BN = 32·V columns. Words, scales and input reach shared memory by cp.async, STAGES - 1
        iterations ahead; each thread then reads the words of its fragment (a quad's lanes share them). The
        fragment's column n is stored column (n % 32)·V + n // 32 of the tile, so each thread's V columns are
        adjacent in memory (one V-word read per word row). POST (every iteration's steps share one group, no
        zeros): the codes enter the mma as exact (code - 8) and each iteration's product is scaled in fp32
        (4·V multiplies a thread instead of one packed multiply per weight pair)."""
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
        L4: gl.constexpr = gl.SliceLayout(2, L5)  # [s, j, c, v]: the words (a quad's lanes read the same ones)
        L3: gl.constexpr = gl.SliceLayout(1, L4)  # [s, c, v]: the scales
        O_L: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XS: gl.constexpr = gl.SwizzledSharedLayout(8, max(1, 64 // K), 8, [1, 0])

        nb = gl.cdiv(n_steps, BS)  # splits at iteration boundaries, so POST's iterations stay inside groups
        s_lo = first_step + (nb * pid_k) // SPLIT * BS
        s_hi = gl.minimum(first_step + (nb * (pid_k + 1)) // SPLIT * BS, first_step + n_steps)
        col0 = pid_n * BN

        wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, BS * 4, BN], PLAIN)
        sbuf = gl.allocate_shared_memory(gl.float16, [STAGES, 1 if POST else BS, BN], PLAIN)
        zbuf = gl.allocate_shared_memory(gl.float16, [STAGES if HAS_ZEROS else 1, BS, BN], PLAIN)
        xbuf = gl.allocate_shared_memory(gl.float16, [STAGES, 16, K], XS)
        CW: gl.constexpr = _copy_words(V)
        CX: gl.constexpr = _copy_input(BS)
        wr = gl.arange(0, BS * 4, layout=gl.SliceLayout(1, CW))
        wc = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, CW))
        w_ptrs = (qw_ptr + (first_word + (s_lo - first_step) * 4).to(gl.int64) * N
                  + gl.expand_dims(wr * N, 1) + gl.expand_dims(wc, 0))
        xm = gl.arange(0, 16, layout=gl.SliceLayout(1, CX))
        x_ptrs = (x_ptr + gl.expand_dims(xm * stride_xm, 1)
                  + gl.expand_dims(s_lo * 32 + gl.arange(0, K, layout=gl.SliceLayout(0, CX)), 0))
        for p in gl.static_range(STAGES - 1):
            _issue(wbuf, sbuf, zbuf, xbuf, p, w_ptrs, x_ptrs, sc_ptr, zr_ptr,
                   _groups(sg_ptr, s_lo + p * BS, s_hi, BS, V, POST), s_lo + p * BS, s_lo, s_hi, N, M, col0,
                   HAS_ZEROS, BS, BN, POST)
        grp_n = _groups(sg_ptr, s_lo + (STAGES - 1) * BS, s_hi, BS, V, POST)

        qq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4,
                                                                                                          L5)))))
        shift = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(qq * 4, 0), 1), 3), 4),
                               5)  # [1, 1, q, 1, 1, 1]
        acc = gl.zeros([16, BN], gl.float32, MMA)
        n_it = gl.cdiv(s_hi - s_lo, BS)
        for it in range(0, n_it):
            stage = it % STAGES
            async_copy.wait_group(STAGES - 2)
            _barrier()  # every warp's copies of this stage landed, and every warp is done with the stage reused next
            s_next = s_lo + (it + STAGES - 1) * BS
            _issue(wbuf, sbuf, zbuf, xbuf, (it + STAGES - 1) % STAGES, w_ptrs, x_ptrs, sc_ptr, zr_ptr, grp_n, s_next,
                   s_lo, s_hi, N, M, col0, HAS_ZEROS, BS, BN, POST)
            grp_n = _groups(sg_ptr, s_next + BS, s_hi, BS, V, POST)  # in flight until the next iteration's issue
            w = wbuf.index(stage).reshape([BS, 4, 32, V]).load(L4)
            xt = xbuf.index(stage).load(A_L)

            pair = gl.full([BS, 4, 4, 32, V, 2], 0, gl.int32, W6)
            w6 = gl.broadcast(gl.expand_dims(gl.expand_dims(w, 2), 5), pair)[0]
            sh6 = gl.broadcast(shift, pair)[0]
            if POST:
                row = sbuf.index(stage).reshape([32, V]).load(_row_layout(V))
                row = gl.convert_layout(gl.reshape(gl.permute(row, (1, 0)), [BN]), gl.SliceLayout(0, MMA),
                                        assert_trivial=True)
                d = gl.inline_asm_elementwise(_PAIR_RAW_ASM, "=r,r,r,r,r", [w6, sh6], dtype=gl.float16,
                                              is_pure=True, pack=2)
            elif HAS_ZEROS:
                sc = sbuf.index(stage).reshape([BS, 32, V]).load(L3)
                sc6 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(_pair_bits(sc), 1), 2), 5),
                                   pair)[0]
                z = zbuf.index(stage).reshape([BS, 32, V]).load(L3) + 1024.0
                z6 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(_pair_bits(z), 1), 2), 5), pair)[0]
                d = gl.inline_asm_elementwise(_PAIR_ZERO_ASM, "=r,r,r,r,r,r,r,r,r", [w6, sh6, sc6, z6],
                                              dtype=gl.float16, is_pure=True, pack=2)
            else:
                sc = sbuf.index(stage).reshape([BS, 32, V]).load(L3)
                sc6 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(_pair_bits(sc), 1), 2), 5),
                                   pair)[0]
                d = gl.inline_asm_elementwise(_PAIR_ASM, "=r,r,r,r,r,r,r", [w6, sh6, sc6], dtype=gl.float16,
                                              is_pure=True, pack=2)
            # rows s·32 + 8j + 2q + pair (the input's positions), columns v·32 + c
            b = gl.reshape(gl.permute(d, (0, 1, 2, 5, 4, 3)), [K, BN])
            b = gl.convert_layout(b, B_L, assert_trivial=True)
            if POST:
                part = mma_v2(xt, b, gl.zeros([16, BN], gl.float32, MMA))
                acc += part * gl.expand_dims(row.to(gl.float32), 0)
            else:
                acc = mma_v2(xt, b, acc)
        async_copy.wait_group(0)

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

    @gluon.jit
    def _mma4_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr, zr_ptr, sg_ptr,
                     M, N, stride_xm, stride_om, SPLIT, first_step, n_steps, first_word,
                     HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_ON: gl.constexpr,
                     BS: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, POST: gl.constexpr):
        _mma4_tile(gl.program_id(0), gl.program_id(1), x_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, qw_ptr, sc_ptr,
                   zr_ptr, sg_ptr, M, N, stride_xm, stride_om, SPLIT, first_step, n_steps, first_word, HAS_ZEROS,
                   HAS_BIAS, SPLIT_ON, BS, V, STAGES, POST)

    @gluon.jit
    def _mma4_group_kernel(x_ptr, M, stride_xm,
                           x0, o0, p0, c0, b0, q0, s0, z0, g0, N0, SP0, fs0, ns0, fw0, P0,
                           x1, o1, p1, c1, b1, q1, s1, z1, g1, N1, SP1, fs1, ns1, fw1, P1,
                           x2, o2, p2, c2, b2, q2, s2, z2, g2, N2, SP2, fs2, ns2, fw2,
                           THREE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
                           ON0: gl.constexpr, ON1: gl.constexpr, ON2: gl.constexpr, BS: gl.constexpr,
                           V: gl.constexpr, STAGES: gl.constexpr, POST0: gl.constexpr, POST1: gl.constexpr,
                           POST2: gl.constexpr):
        """`_mma4_kernel` for 2-3 weights sharing one input (q/k/v, gate/up) in one launch: programs [0, P0) take
        weight 0 (tile pid // SP0, split pid % SP0), [P0, P0 + P1) weight 1, the rest weight 2. x0..x2 point at
        each weight's permuted input inside one buffer."""
        pid = gl.program_id(0)
        if pid < P0:
            _mma4_tile(pid // SP0, pid % SP0, x0, o0, p0, c0, b0, q0, s0, z0, g0, M, N0, stride_xm, N0, SP0, fs0,
                       ns0, fw0, HAS_ZEROS, HAS_BIAS, ON0, BS, V, STAGES, POST0)
        else:
            pid -= P0
            if THREE:
                if pid < P1:
                    _mma4_tile(pid // SP1, pid % SP1, x1, o1, p1, c1, b1, q1, s1, z1, g1, M, N1, stride_xm, N1, SP1,
                               fs1, ns1, fw1, HAS_ZEROS, HAS_BIAS, ON1, BS, V, STAGES, POST1)
                else:
                    pid -= P1
                    _mma4_tile(pid // SP2, pid % SP2, x2, o2, p2, c2, b2, q2, s2, z2, g2, M, N2, stride_xm, N2, SP2,
                               fs2, ns2, fw2, HAS_ZEROS, HAS_BIAS, ON2, BS, V, STAGES, POST2)
            else:
                _mma4_tile(pid // SP1, pid % SP1, x1, o1, p1, c1, b1, q1, s1, z1, g1, M, N1, stride_xm, N1, SP1, fs1,
                           ns1, fw1, HAS_ZEROS, HAS_BIAS, ON1, BS, V, STAGES, POST1)


def supports(w, m: int) -> bool:
    """Whether `mma4` can run this call: 1-16 rows of a matrix that is a single 4-bit class with a width that
    keeps its scale rows 16-byte aligned, on a CUDA GPU with tensor cores (sm_80+) and Gluon."""
    if not HAVE_GLUON or not 0 < m <= 16 or len(w.classes) != 1 or w.classes[0].bits != 4 or w.n % 8:
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
    """Whether every aligned run of `bs` steps of w's class lies in one quantization group (then the kernel scales
    after the mma, `POST`). Checked once per (weight, bs) on the host; during CUDA graph capture an unchecked
    weight answers False (the per-weight scaling is always correct)."""
    key = ("groups_align", bs)
    if key not in w._cache:
        if w.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        c = w.classes[0]
        sg = w.step_group[c.first_step:c.first_step + c.n_steps].cpu()
        w._cache[key] = c.n_steps % bs == 0 and bool((sg.view(-1, bs) == sg.view(-1, bs)[:, :1]).all())
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


def mma4(xp: torch.Tensor, w, bs: int = 4, v: int = 2, split: int = 1, stages: int = 3,
         post: bool | None = None) -> torch.Tensor:
    """`xp · W + bias` for xp `[M ≤ 16, S·32]` fp16, the input permuted for w (`gather_input`); w a single 4-bit
    class. bs steps of 32 rows per iteration, 32·v columns per program, K split `split` ways, a ring of `stages`
    iterations in shared memory; `post` scales after the mma (None: where `groups_align` and w has no zeros)."""
    out, part, bias, zeros, post = _operands(xp, w, split, bs, post)
    c = w.classes[0]
    _mma4_kernel[(triton.cdiv(w.n, 32 * v), split)](
        xp, out, part, counters(xp.device), bias, w.qweight, w.scales, zeros, w.step_group,
        xp.shape[0], w.n, xp.stride(0), out.stride(0), split, c.first_step, c.n_steps, c.first_word,
        HAS_ZEROS=w.zeros is not None, HAS_BIAS=w.bias is not None, SPLIT_ON=split > 1, BS=bs, V=v, STAGES=stages,
        POST=post, num_warps=4)
    return out


def mma4_group(xp: torch.Tensor, ws, offsets, bs: int = 4, v: int = 2, splits=None, stages: int = 3
               ) -> list[torch.Tensor]:
    """`[xp_i · W_i + bias_i]` for 2-3 weights `supports` accepts, in one launch: xp `[M ≤ 16, ...]` holds each
    weight's permuted input at column `offsets[i]` (`gather_input(whole=True)`); `splits` the K split of each
    (default 1). The weights must agree on zeros and bias being present."""
    m = xp.shape[0]
    splits = list(splits or [1] * len(ws))
    cnt = counters(xp.device)
    args, tile0, programs = [], 0, []
    outs, flags, posts = [], [], []
    for w, off, split in zip(ws, offsets, splits):
        c = w.classes[0]
        tiles = triton.cdiv(w.n, 32 * v)
        out, part, bias, zeros, post = _operands(xp, w, split, bs, None)
        args += [xp[:, off:], out, part, cnt[tile0:], bias, w.qweight, w.scales, zeros, w.step_group, w.n, split,
                 c.first_step, c.n_steps, c.first_word]
        programs.append(tiles * split)
        args.append(tiles * split)
        tile0 += tiles
        outs.append(out)
        flags.append(split > 1)
        posts.append(post)
    three = len(ws) == 3
    if not three:  # a never-taken third slot
        args += args[-15:-1]
        flags.append(False)
        posts.append(False)
    else:
        args.pop()
    _mma4_group_kernel[(sum(programs),)](
        xp, m, xp.stride(0), *args, THREE=three, HAS_ZEROS=ws[0].zeros is not None,
        HAS_BIAS=ws[0].bias is not None, ON0=flags[0], ON1=flags[1], ON2=flags[2], BS=bs, V=v, STAGES=stages,
        POST0=posts[0], POST1=posts[1], POST2=posts[2], num_warps=4)
    return outs
