"""The decode kernels' programmatic-dependent-launch variants (L2 prefetch before `griddepcontrol.wait`) compiled
for sm_90 on this machine, GPU or not: the interpreter never runs them, so shapes only the GPU path meets (MLA head
dims, narrow tiles) are checked here, and the prefetches must come before the wait to be of any use. The sampling
kernels are compiled too, checked for IEEE division (their values must equal the PyTorch path's bit for bit). The
compiler runs in a child process without TRITON_INTERPRET (under it, kernels are not compilable objects)."""
import json
import os
import subprocess
import sys

import pytest

ATTENTION = [(128, 16), (192, 16), (96, 16), (128, 4)]
# (columns a program, the one width class): every packed decoder (FAST4 = all of them)
GEMV = [(64, "HAS4"), (16, "HAS4"), (128, "HAS6"), (128, "HAS8"), (64, "HAS5"), (64, "HAS3"), (64, "HAS2")]
# (width mask (bit i: qweight.WIDTHS[i]), steps an iteration, V, scale after the mma, zeros): the 4-bit body, GPTQ,
# the 8/6-bit head, a mixed 5/4/3 body, every width in one matrix
MMA = [(8, 4, 2, True, False), (8, 1, 1, False, True), (8, 8, 4, False, False), (8, 2, 4, True, False),
       (3, 4, 2, True, False), (3, 4, 2, False, False), (28, 4, 2, True, False), (63, 2, 1, False, False),
       (63, 4, 2, True, False)]
# the decode step's RoPE + quantized cache write: (key bits, value bits, q left in the keys' rotated basis)
ROPE_WRITE = [(4, 4, True), (8, 4, True), (4, 4, False)]


def _compile_all() -> dict:
    """Child process: {case: "ok" | "no prefetch before the wait" | error} for every case."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from exl2.kernels import attention as at
    from exl2.kernels import gemv as gemv_k

    def ptx(fn, ptrs, consts, warps, stages, div=()):
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n in div}
        src = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as src
        k = triton.compile(src(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        return k.asm["ptx"]

    def verdict(make):
        try:
            text = make()
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        first, wait = text.find("prefetch.global.L2"), text.find("griddepcontrol.wait")
        return "ok" if 0 <= first < wait else "no prefetch before the wait"

    out = {}
    aptrs = {n: "*fp16" for n in ["q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "o_ptr", "out_ptr"]}
    aptrs.update({"bt_ptr": "*i32", "seq_ptr": "*i32", "cuq_ptr": "*i32", "cuk_ptr": "*i32", "lse_ptr": "*fp32",
                  "perm_ptr": "*i32", "cnt_ptr": "*i32", "scale": "fp32", "softcap": "fp32"})
    for dk, bits in ATTENTION:
        ptrs = dict(aptrs, **({"k_ptr": "*u8", "v_ptr": "*u8"} if bits != 16 else {}))
        consts = dict(GROUP=4, DK=dk, DV=128, BDK=triton.next_power_of_2(dk), BDV=128, BM=16, BN=64, PAGED=True,
                      CAUSAL=True, HAS_WINDOW=False, HAS_SOFTCAP=False, K_BITS=bits, V_BITS=bits, KZERO=0.0,
                      VZERO=0.0, SPLIT=32, PARTIAL=True, MERGE=False, MR=16, MCH=8, PERM=True, V_EARLY=at.V_EARLY,
                      Q_ROT=bits != 16, PDL=True, PREFETCH=True)
        warps = at.TUNING[("decode", "fp16" if bits == 16 else "quant")][1]
        out[f"attention-{dk}-{bits}"] = verdict(lambda: ptx(at._attn_kernel, ptrs, consts, warps, 2))
    gptrs = {n: "*fp16" for n in ["x_ptr", "out_ptr", "bias_ptr", "sc_ptr", "zr_ptr"]}
    gptrs.update({"x32_ptr": "*i32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "qw_ptr": "*i32", "sg_ptr": "*i32"})
    for bn, width in GEMV:
        consts = dict(HAS8=False, HAS6=False, HAS5=False, HAS4=False, HAS3=False, HAS2=False, HAS_ZEROS=False,
                      HAS_BIAS=False, SPLIT_ON=True, BM=1, BS=8, BN=bn, RED=4, FAST4=63, STAGES=3, PDL=True,
                      PREFETCH=64, PART_ONLY=False)
        consts[width] = True
        packed = "lop3.b32" if width in ("HAS4", "HAS3") else "prmt.b32"  # only the packed decoders' asm has these

        def gemv_ptx():
            text = ptx(gemv_k._gemv_kernel, gptrs, consts, 4, 3)
            if packed not in text:
                raise AssertionError("the packed decoder is not in the kernel")
            return text
        out[f"gemv-{bn}-{width}"] = verdict(gemv_ptx)
    grp = {n: "*fp16" for n in ["x_ptr"] + [f"{a}{i}" for a in ("out", "bias", "sc", "zr") for i in range(3)]}
    grp.update({"x32_ptr": "*i32", "meta_ptr": "*i32", "part_ptr": "*fp32", "cnt_ptr": "*i32"})
    grp.update({f"{a}{i}": "*i32" for a in ("qw", "sg") for i in range(3)})
    consts = dict(G=3, MASK=63, HAS_ZEROS=False, B0=False, B1=False, B2=False, BS=8, BN=64, RED=4, FAST4=63,
                  STAGES=3, PDL=True, PREFETCH=64)
    out["gemv-group-all-widths"] = verdict(lambda: ptx(gemv_k._gemv_group_kernel, grp, consts, 4, 3))

    def one_body_ptx():
        """EXL2_GEMV_GROUP_SELECT's mixed 5/4/3 q/k/v kernel: one copy of each width's loop instead of three."""
        split = ptx(gemv_k._gemv_group_kernel, grp, dict(consts, MASK=14), 4, 3)
        one = ptx(gemv_k._gemv_group_kernel, grp, dict(consts, MASK=14, ONE_BODY=True), 4, 3)
        if not 0 < one.count("lop3.b32") * 2 < split.count("lop3.b32"):
            raise AssertionError("the one-body kernel does not hold fewer copies of the decoders")
        return one
    out["gemv-group-one-body"] = verdict(one_body_ptx)

    def switched_ptx(switch, mask, check, why):
        """The group gemv of the widths in `mask` with the module switch `switch` on (its environment variable)."""
        default = getattr(gemv_k, switch)
        setattr(gemv_k, switch, triton.language.constexpr(True))
        try:
            text = ptx(gemv_k._gemv_group_kernel, grp, dict(consts, MASK=mask), 4, 3)
        finally:
            setattr(gemv_k, switch, default)
        if not check(text):
            raise AssertionError(why)
        return text
    out["gemv-group-masked-prefetch"] = verdict(lambda: switched_ptx(  # EXL2_GEMV_PREFETCH_MASKED=1
        "_PREFETCH_MASKED", 12, lambda t: "@p prefetch.global.L2" in t, "the prefetch is not predicated"))
    out["gemv-group-register-prefetch"] = verdict(lambda: switched_ptx(  # EXL2_GEMV_RPF=1
        "_GEMV_RPF", 4, lambda t: "cp.async" not in t and "lop3.b32" in t,
        "the 4-bit loop still copies through shared memory, or lost its packed decoder"))
    from exl2.kernels import mma_dot
    mptrs = {n: "*fp16" for n in ["x_ptr", "out_ptr", "bias_ptr", "sc_ptr", "zr_ptr"]}
    mptrs.update({"part_ptr": "*fp32", "cnt_ptr": "*i32", "qw_ptr": "*i32", "sg_ptr": "*i32"})
    for mask, bs, v, post, zeros in MMA:
        for split in (False, True):
            # the split variants are also the programmatic-dependent-launch ones (the first weight copies are issued
            # before the wait, the input's after it)
            consts = dict(MASK=mask, HAS_ZEROS=zeros, HAS_BIAS=True, SPLIT_ON=split, BS=bs, V=v, STAGES=3, POST=post,
                          PDL=split, PART_ONLY=False)
            key = f"mma-{mask}-{bs}-{v}-{post}-{zeros}-{split}"
            try:
                # the decoded tile must already sit in the mma operand layout (assert_trivial in the kernel)
                text = ptx(mma_dot._mma_kernel, mptrs, consts, 4, 1, div=("N", "stride_xm", "stride_om"))
                wait = text.find("griddepcontrol.wait")
                pdl_ok = 0 <= text.find("cp.async") < wait < text.rfind("cp.async") if split else wait < 0
                out[key] = ("ok" if "mma.sync" in text and "cp.async" in text and pdl_ok
                            else "no mma.sync / cp.async, or the PDL wait misplaced")
            except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
                out[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    gptrs = {}
    for i in range(3):
        gptrs.update({f"x{i}": "*fp16", f"o{i}": "*fp16", f"p{i}": "*fp32", f"c{i}": "*i32", f"b{i}": "*fp16",
                      f"q{i}": "*i32", f"s{i}": "*fp16", f"z{i}": "*fp16", f"g{i}": "*i32"})
    gptrs["x_ptr"] = "*fp16"
    for three in (True, False):
        consts = dict(THREE=three, HAS_ZEROS=False, HAS_BIAS=True, ON0=False, ON1=True, ON2=True, BS=4, V=2,
                      STAGES=4, POST0=True, POST1=False, POST2=True, MASK0=8, MASK1=28, MASK2=8, PDL=three)
        try:
            text = ptx(mma_dot._mma_group_kernel, gptrs, consts, 4, 1, div=("N0", "N1", "N2", "stride_xm"))
            pdl_ok = ("griddepcontrol.wait" in text) == three
            out[f"mma-group-{three}"] = "ok" if text.count("mma.sync") >= 2 and pdl_ok else "no mma.sync, or PDL"
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[f"mma-group-{three}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        one_consts = dict(consts, ON0=True, POST1=True, MASK0=28, MASK1=12, MASK2=8, ONE_BODY=True)
        try:  # EXL2_GEMV_GROUP_SELECT: one tile body over the union of the members' widths
            text = ptx(mma_dot._mma_group_kernel, gptrs, one_consts, 4, 1, div=("N0", "N1", "N2", "stride_xm"))
            each = ptx(mma_dot._mma_group_kernel, gptrs, dict(one_consts, ONE_BODY=False), 4, 1,
                       div=("N0", "N1", "N2", "stride_xm"))
            pdl_ok = ("griddepcontrol.wait" in text) == three
            out[f"mma-group-one-{three}"] = ("ok" if 0 < text.count("mma.sync") < each.count("mma.sync") and pdl_ok
                                             else "no fewer mma.sync than a body a member, or PDL")
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[f"mma-group-one-{three}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    from exl2.kernels import activation as act
    from exl2.kernels import norm

    def constants_first(make):
        """The index (and norm weight) loads before the wait, the loads of what the previous kernel wrote after."""
        try:
            text = make()
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        wait = text.find("griddepcontrol.wait")
        return "ok" if 0 <= text.find("ld.global") < wait < text.rfind("ld.global") else "no load before the wait"

    nptrs = {n: "*fp16" for n in ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "xp_ptr"]}
    nptrs.update({"i0": "*i32", "i1": "*i32", "i2": "*i32", "eps": "fp32", "ro_ptr": "*fp16"})
    out["norm-gather"] = constants_first(lambda: ptx(norm._norm_gather_kernel, nptrs, dict(
        HAS_RES=True, HAS_W=True, GEMMA=False, BLOCK=4096, GBLOCK=1024, PDL=True, NPART=0), 16, 1))
    out["norm-gather-parts"] = constants_first(lambda: ptx(norm._norm_gather_kernel, dict(nptrs, x_ptr="*fp32"), dict(
        HAS_RES=True, HAS_W=True, GEMMA=False, BLOCK=4096, GBLOCK=1024, PDL=True, NPART=4), 16, 1))
    consts = dict(HAS8=False, HAS6=False, HAS5=False, HAS4=True, HAS3=False, HAS2=False, HAS_ZEROS=False,
                  HAS_BIAS=False, SPLIT_ON=True, BM=1, BS=8, BN=64, RED=4, FAST4=63, STAGES=3, PDL=True,
                  PREFETCH=64, PART_ONLY=True)
    gemv_ptrs = {n: "*fp16" for n in ["x_ptr", "out_ptr", "bias_ptr", "sc_ptr", "zr_ptr"]}
    gemv_ptrs.update({"x32_ptr": "*i32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "qw_ptr": "*i32", "sg_ptr": "*i32"})
    mma_consts = dict(MASK=8, HAS_ZEROS=False, HAS_BIAS=False, SPLIT_ON=True, BS=4, V=2, STAGES=3, POST=True, PDL=True,
                      PART_ONLY=True)
    for key, make in (("gemv-part-only", lambda: ptx(gemv_k._gemv_kernel, gemv_ptrs, consts, 4, 3)),
                      ("mma-part-only", lambda: ptx(mma_dot._mma_kernel, mptrs, mma_consts, 4, 1,
                                                    div=("N", "stride_xm", "stride_om")))):
        try:  # the partials stored, and no arrival counter (atomic) or sum after them
            text = make()
            out[key] = "ok" if "st.global" in text and "atom." not in text else "no store, or an atomic left"
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    from exl2.kernels import dot as dot_k
    for bits in (4, 6):  # the packed 4-bit decoder (inline PTX) and the portable one, into tensor-core dots
        consts = dict(HAS8=False, HAS6=bits == 6, HAS5=False, HAS4=bits == 4, HAS3=False, HAS2=False,
                      HAS_ZEROS=False, HAS_BIAS=True, SPLIT_ON=True, BM=16, BS=4, BN=64, RED=4, FAST4=1, PDL=True)
        try:
            text = ptx(dot_k._dot_kernel, gemv_ptrs, consts, 4, 4)
            out[f"dot-{bits}"] = "ok" if "mma.sync" in text and ("lop3" in text) == (bits == 4) else "no mma / lop3"
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[f"dot-{bits}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out["glu-gather"] = constants_first(lambda: ptx(act._glu_kernel, {
        "g_ptr": "*fp16", "u_ptr": "*fp16", "o_ptr": "*fp16", "idx_ptr": "*i32"}, dict(
        ACT=0, BLOCK=512, GATHER=True, PDL=True), 4, 1))
    from exl2.kernels import kv_quant as kq
    qptrs = {n: "*fp16" for n in ["k_ptr", "v_ptr", "q_ptr", "ks_ptr", "vs_ptr"]}
    qptrs.update({"kp_ptr": "*u8", "vp_ptr": "*u8", "slot_ptr": "*i64", "pos_ptr": "*i64", "cos_ptr": "*fp32",
                  "sin_ptr": "*fp32"})
    for kb, vb, had in ROPE_WRITE:
        consts = dict(K_BITS=kb, V_BITS=vb, BT_K=4, NBP_K=2, BT_V=4, NBP_V=2, ROPE=True, INTERLEAVED=False,
                      BLOCK_H=16, BLOCK_R=64, Q_HADAMARD=had, PDL=True)
        try:
            text = ptx(kq._kv_quant_pair_kernel, qptrs, consts, 4, 1)
            out[f"rope-write-{kb}-{vb}-{had}"] = "ok" if "griddepcontrol.wait" in text else "no PDL wait"
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[f"rope-write-{kb}-{vb}-{had}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    from exl2.kernels import fp8_prefill as f8
    fptrs = {"out_ptr": "*fp8e4nv", "x_ptr": "*fp16", "ri_ptr": "*i32", "scale_ptr": "*fp32"}
    for i in range(3):
        fptrs.update({f"qw{i}": "*i32", f"sc{i}": "*fp16", f"zr{i}": "*fp16", f"sg{i}": "*i32", f"inv{i}": "*fp32"})
    for key, make, want in (
            ("fp8-weight", lambda: ptx(f8._weight_kernel, fptrs, dict(BITS=5, LB=4, HB=1, HAS_ZEROS=False, BS=4,
                                                                      BN=128), 4, 1, div=("stride_o",)),
             "st.global.v4"),
            ("fp8-input", lambda: ptx(f8._input_kernel, fptrs, dict(BK=16384), 16, 1, div=("stride_x", "KS")),
             "st.global.v")):
        try:  # the e4m3 operands are written in whole vectors along K, not a byte at a time
            text = make()
            out[key] = "ok" if want in text and "cvt.rn.satfinite.e4m3x2" in text else f"no {want} / e4m3 cvt"
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    from exl2.kernels import cutoff, sampling
    sptrs = {"x_ptr": "*fp32", "y_ptr": "*fp32", "seen_ptr": "*u8", "cnt_ptr": "*fp32", "par_ptr": "*fp32", "pmax_ptr": "*fp32", "hist_ptr": "*fp32",
             "sti_ptr": "*i32", "stf_ptr": "*fp32", "khist_ptr": "*fp32", "ksti_ptr": "*i32", "kstf_ptr": "*fp32",
             "phist_ptr": "*fp32", "psti_ptr": "*i32", "pstf_ptr": "*fp32", "key_ptr": "*i64", "val_ptr": "*fp32", "arg_ptr": "*i32", "cut_ptr": "*i32", "out_ptr": "*i64"}
    on = dict(HAS_SEEN=True, HAS_COUNTS=True)
    cases = {"sample-prep": (cutoff._prep_kernel, dict(CHUNK=4096, BLOCK=512, **on)),
             "sample-pass-k": (cutoff._pass_kernel, dict(CHUNK=4096, BLOCK=512, PP=32, MASS=False, AFTER_K=False)),
             "sample-pass-p": (cutoff._pass_kernel, dict(CHUNK=4096, BLOCK=512, PP=32, MASS=True, AFTER_K=True)),
             "sample-draw": (sampling._draw_kernel, dict(CHUNK=4096, BLOCK=512, PP=32, HAS_K=True, HAS_P=True,
                                                         HAS_MIN_P=True, PREPPED=False, **on)),
             "sample-pick": (sampling._pick_kernel, dict(PP=32))}
    for key, (fn, consts) in cases.items():
        try:  # the penalty and temperature divide exactly (div.rn), as PyTorch does in the sampler's PyTorch path
            text = ptx(fn, sptrs, consts, 1 if key == "sample-pick" else 4, 1)
            exact = key in ("sample-pick", "sample-pass-k", "sample-pass-p") or "div.rn.f32" in text
            out[key] = "ok" if exact else "no div.rn.f32"
        except Exception as e:  # noqa: BLE001 - reported to the test as the case's result
            out[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return out


@pytest.fixture(scope="module")
def compiled() -> dict:
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dk,bits", ATTENTION)
def test_decode_attention_prefetches_before_its_wait(compiled, dk, bits):
    assert compiled[f"attention-{dk}-{bits}"] == "ok"


@pytest.mark.parametrize("bn,width", GEMV)
def test_gemv_prefetches_its_weights_before_its_wait(compiled, bn, width):
    assert compiled[f"gemv-{bn}-{width}"] == "ok"


def test_grouped_gemv_compiles_every_packed_decoder(compiled):
    """q/k/v of a mixed-width model: one launch whose runtime class branches hold all six decoders."""
    assert compiled["gemv-group-all-widths"] == "ok"


def test_grouped_gemv_one_body_holds_one_copy_of_its_loops(compiled):
    """`EXL2_GEMV_GROUP_SELECT`: the mixed q/k/v kernel inlines one member body (a third of the decoders)."""
    assert compiled["gemv-group-one-body"] == "ok"


@pytest.mark.parametrize("kernel", ["fp8-weight", "fp8-input"])
def test_fp8_operand_kernels_store_whole_vectors(compiled, kernel):
    """The FP8 prompt operands (`fp8_prefill`): the transposed weight and the gathered 14,336-wide input row
    compile for sm_90 with vector stores along K and the hardware e4m3 conversion."""
    assert compiled[kernel] == "ok"


def test_gemv_masked_prefetch_is_predicated(compiled):
    """EXL2_GEMV_PREFETCH_MASKED: each lane's prefetch is issued under its own predicate, before the wait."""
    assert compiled["gemv-group-masked-prefetch"] == "ok"


def test_gemv_register_prefetch_compiles_without_the_copy_ring(compiled):
    """EXL2_GEMV_RPF: the 4-bit loop loads straight into registers (no cp.async), still with the packed decoder."""
    assert compiled["gemv-group-register-prefetch"] == "ok"


@pytest.mark.parametrize("mask,bs,v,post,zeros", MMA)
@pytest.mark.parametrize("split", [False, True])
def test_gluon_mma_compiles_with_its_fragment_layouts(compiled, mask, bs, v, post, zeros, split):
    assert compiled[f"mma-{mask}-{bs}-{v}-{post}-{zeros}-{split}"] == "ok"


@pytest.mark.parametrize("three", [True, False])
def test_gluon_mma_group_compiles(compiled, three):
    assert compiled[f"mma-group-{three}"] == "ok"


@pytest.mark.parametrize("three", [True, False])
def test_gluon_mma_group_one_body_compiles(compiled, three):
    """`EXL2_GEMV_GROUP_SELECT`'s Gluon group kernel: one tile body for members of different width mixes."""
    assert compiled[f"mma-group-one-{three}"] == "ok"


@pytest.mark.parametrize("kernel", ["norm-gather", "norm-gather-parts", "glu-gather"])
def test_constant_loads_come_before_the_pdl_wait(compiled, kernel):
    assert compiled[kernel] == "ok"


@pytest.mark.parametrize("kernel", ["gemv-part-only", "mma-part-only"])
def test_matmuls_leaving_their_partials_have_no_counter(compiled, kernel):
    assert compiled[kernel] == "ok"


@pytest.mark.parametrize("bits", [4, 6])
def test_triton_tensor_core_kernel_compiles(compiled, bits):
    """4-bit: the packed decoder's PTX (lop3) feeding mma; 6-bit: the portable decoder."""
    assert compiled[f"dot-{bits}"] == "ok"


@pytest.mark.parametrize("kb,vb,hadamard", ROPE_WRITE)
def test_rope_into_quantized_cache_compiles(compiled, kb, vb, hadamard):
    assert compiled[f"rope-write-{kb}-{vb}-{hadamard}"] == "ok"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))


@pytest.mark.parametrize("kernel", ["sample-prep", "sample-pass-k", "sample-pass-p", "sample-draw", "sample-pick"])
def test_sampling_kernels_compile_with_exact_division(compiled, kernel):
    assert compiled[kernel] == "ok"
