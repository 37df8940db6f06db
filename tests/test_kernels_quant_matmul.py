"""EXL2/GPTQ quantized matmul: load-time repacking vs the format readers (bit exact, incl. exllamav2 golden
files), Triton dequant / gemv / dot kernels vs the PyTorch twin."""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl2.formats import exl2 as fmt
from exl2.formats.gptq import dequantize_gptq, pack_gptq
from exl2.kernels import qweight
from exl2.kernels import quant_matmul as qm
from exl2.kernels.matmul_launch import MatmulConfig
from exl2.kernels import dequant
from exl2.kernels import dot as dot_k
from exl2.kernels import gemv as gemv_k
from exl2.kernels import permute
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.kernels.exl2_matmul import Exl2Weight, exl2_matmul
from exl2.kernels.gptq_matmul import GptqWeight

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
GOLDEN = Path(__file__).parent / "fixtures" / "golden"


def rand_exl2(k_groups, n, bias=True, seed=0, device="cpu"):
    """Random EXL2 layer via the format's own writer: codes, scale codes, act-order permutation, bias."""
    g = torch.Generator().manual_seed(seed)
    k = sum(r for _, r in k_groups)
    codes = torch.cat([torch.randint(0, 1 << b, (r, n), generator=g) for b, r in k_groups]).to(torch.uint8)
    sc = torch.randint(1, 17, (len(k_groups), n), generator=g)
    smax = (torch.rand(len(k_groups), generator=g) * 0.05 + 0.005).half()
    b = torch.randn(n, generator=g).half() if bias else None
    t = fmt.pack(codes, k_groups, sc, smax, torch.randperm(k, generator=g), b)
    return {f"L.{key}": v.to(device) for key, v in t.items()}


MIXED = [(8, 32), (6, 32), (6, 16), (6, 16), (5, 32), (4, 64), (4, 8), (4, 24), (3, 32), (2, 48)]


def _bits_equal(a, b):
    """Bit-for-bit equality; the reference may sit on the CPU while the kernel's result is on the GPU."""
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


# ---------------------------------------------------------------------------------------------- layout
def test_repack_roundtrip_every_width():
    torch.manual_seed(0)
    for bits in qweight.WIDTHS:
        codes = torch.randint(0, 1 << bits, (96, 40), dtype=torch.uint8)
        words = qweight.encode_steps(codes, bits)
        assert words.shape == (3 * bits, 40) and words.dtype == torch.int32
        assert torch.equal(qweight.decode_steps(words, bits), codes.to(torch.int32))
    # 2/4/8-bit steps are the on-disk packing itself (no repacking cost at load)
    for bits in (2, 4, 8):
        codes = torch.randint(0, 1 << bits, (64, 32), dtype=torch.uint8)
        disk = fmt.pack(codes, [(bits, 64)], torch.ones(1, 32), torch.ones(1).half(), torch.arange(64))
        assert torch.equal(qweight.encode_steps(codes, bits), disk["q_weight"])


def test_exl2_twin_dequant_bit_exact_mixed_widths_and_odd_groups():
    t = rand_exl2(MIXED, 64)
    w = Exl2Weight.from_tensors(t, "L")
    assert [c.bits for c in w.classes] == [8, 6, 5, 4, 3, 2]
    assert (w.row_index < 0).sum() > 0  # the 16- and 8/24-row groups forced padding
    assert _bits_equal(qweight.dequantize_torch(w), fmt.dequantize(t, "L"))
    x = torch.randn(3, w.k, dtype=torch.float16)
    ref = x.double() @ fmt.dequantize(t, "L").double() + t["L.bias"].double()
    torch.testing.assert_close(exl2_matmul(x, w).double(), ref, atol=2e-2, rtol=2e-3)


def test_exl2_prescale_and_errors():
    t = rand_exl2([(4, 64)], 32, bias=False)
    w = Exl2Weight.from_tensors(t, "L", prescale=0.5)
    assert _bits_equal(qweight.dequantize_torch(w), (fmt.dequantize(t, "L").float() * 0.5).half())
    bad = dict(t)
    bad["L.q_invperm"] = torch.zeros_like(t["L.q_invperm"])
    from exl2.errors import FormatError
    with pytest.raises(FormatError, match="permutation"):
        Exl2Weight.from_tensors(bad, "L")
    with pytest.raises(FormatError, match="no q_scale"):
        Exl2Weight.from_tensors({k: v for k, v in t.items() if "q_scale" != k.split(".")[-1]}, "L")


@pytest.mark.parametrize("folder", ["b3.0_hb6", "b4.0_hb6", "b6.0_hb6"])
def test_exl2_golden_files_reproduce_exllamav2_hashes(folder):
    path = GOLDEN / folder
    if not path.exists():
        pytest.skip("golden fixtures missing")
    tensors = load_file(path / "output.safetensors")
    hashes = json.loads((path / "reference_dequant_sha256.json").read_text())
    for prefix, ref in hashes.items():
        w = Exl2Weight.from_tensors(tensors, prefix)
        d = qweight.dequantize_torch(w)[:, : ref["shape"][1]].contiguous()
        assert list(d.shape) == ref["shape"]
        assert hashlib.sha256(d.numpy().tobytes()).hexdigest() == ref["sha256"], prefix


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_twin_matches_reference_dequant(bits, act_order):
    g = torch.Generator().manual_seed(bits)
    k, n, groups = 256, 64, 4
    codes = torch.randint(0, 1 << bits, (k, n), generator=g)
    zeros = torch.randint(1, 1 << bits, (groups, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) * 0.02).half()
    g_idx = torch.randint(0, groups, (k,), generator=g) if act_order else None
    for fmt_name in ("gptq", "gptq_v2"):
        z = zeros if fmt_name == "gptq" else zeros - 1
        t = {f"P.{key}": v for key, v in pack_gptq(codes, z, scales, g_idx, bits, fmt_name).items()}
        w = GptqWeight.from_tensors(t, "P", checkpoint_format=fmt_name, bits=bits)
        assert _bits_equal(qweight.dequantize_torch(w), dequantize_gptq(t, "P", fmt_name, bits))


# ---------------------------------------------------------------------------------------------- kernels
@needs_triton
def test_triton_dequant_bit_exact():
    t = rand_exl2(MIXED, 64, device=DEV)
    w = Exl2Weight.from_tensors(t, "L", device=DEV)
    with force_triton():
        d = dequant.dequantize_triton(w)
    assert _bits_equal(d, fmt.dequantize(t, "L"))


def _check_close(y, ref):
    # fp32 accumulation in a different order, one fp16 rounding of the output
    err = (y.float() - ref.float()).abs().max()
    assert err <= 2e-3 * ref.float().abs().max() + 1e-3, float(err)


@needs_triton
@pytest.mark.parametrize("m,split", [(1, 1), (1, 3), (2, 2), (1, 7)])
def test_gemv_matches_twin(m, split):
    """Every width in one matrix; K splits cut its words into runs that start and end inside classes."""
    t = rand_exl2(MIXED, 96, seed=1, device=DEV)
    w = Exl2Weight.from_tensors(t, "L", device=DEV)
    x = torch.randn(m, w.k, dtype=torch.float16, device=DEV)
    with force_triton():
        y = gemv_k.gemv(x, w, MatmulConfig(bs=2, bn=32, split=split))
        y2 = gemv_k.gemv(x, w, MatmulConfig(bs=4, bn=64, split=1))
        y3 = gemv_k.gemv(x, w, MatmulConfig(bs=2, bn=32, split=split, num_stages=3))
    ref = qweight.matmul_torch(x, w)
    _check_close(y, ref)
    _check_close(y2, ref)
    _check_close(y3, ref)


@needs_triton
def test_dot_kernel_matches_twin_with_split_and_bias():
    t = rand_exl2(MIXED, 64, seed=2, device=DEV)
    w = Exl2Weight.from_tensors(t, "L", device=DEV)
    x = torch.randn(5, w.k, dtype=torch.float16, device=DEV)
    with force_triton():
        y = dot_k.dot(x, w, MatmulConfig(bm=16, bs=1, bn=32, split=2))
    _check_close(y, qweight.matmul_torch(x, w))


@needs_triton
def test_gptq_kernels_with_act_order():
    g = torch.Generator().manual_seed(9)
    k, n, groups = 128, 64, 4
    t = pack_gptq(torch.randint(0, 16, (k, n), generator=g), torch.randint(1, 16, (groups, n), generator=g),
                  (torch.rand(groups, n, generator=g) * 0.02).half(), torch.randint(0, groups, (k,), generator=g))
    t = {f"P.{key}": v.to(DEV) for key, v in t.items()}
    w = GptqWeight.from_tensors(t, "P", device=DEV)
    x = torch.randn(2, k, dtype=torch.float16, device=DEV)
    ref = qweight.matmul_torch(x, w)
    with force_triton():
        _check_close(gemv_k.gemv(x, w, MatmulConfig(bs=2, bn=32, split=2)), ref)
        _check_close(dot_k.dot(x, w, MatmulConfig(bm=16, bs=1, bn=32, split=1)), ref)
        assert _bits_equal(dequant.dequantize_triton(w), dequantize_gptq({k_: v.cpu() for k_, v in t.items()}, "P"))


@needs_triton
def test_golden_layer_through_kernels():
    path = GOLDEN / "b3.0_hb6" / "output.safetensors"
    if not path.exists():
        pytest.skip("golden fixtures missing")
    tensors = load_file(path)
    w = Exl2Weight.from_tensors(tensors, "model.layers.1.mlp.down_proj", device=DEV)  # 8/4/3-bit mix, K=768
    x = torch.randn(1, w.k, dtype=torch.float16, device=DEV)
    with force_triton():
        y = gemv_k.gemv(x, w, MatmulConfig(bs=8, bn=128, split=2))
    _check_close(y, qweight.matmul_torch(x, w))


# ---------------------------------------------------------------------------------------------- GPU sizes
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
def test_quant_matmul_real_sizes_gpu(m):
    layout = [(6, 128)] * 2 + [(5, 128)] * 4 + [(4, 128)] * 20 + [(3, 128)] * 6
    t = rand_exl2(layout, 4096, seed=m, device="cuda")
    w = Exl2Weight.from_tensors(t, "L", device="cuda")
    assert _bits_equal(dequant.dequantize_triton(w), fmt.dequantize(t, "L"))
    x = torch.randn(m, w.k, dtype=torch.float16, device="cuda")
    for _ in range(2):  # the second call reuses the split-K counters reset by the first
        _check_close(exl2_matmul(x, w), qweight.matmul_torch(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequant_group_real_sizes_gpu():
    """The prefill's shared-input GEMM at Llama-3-8B sizes: q/k/v (one class layout: one dequantization launch per
    class), gate/up, and q/k/v of different layouts (one launch per weight), each output against the twin."""
    mixed = [(6, 128)] * 2 + [(5, 128)] * 4 + [(4, 128)] * 20 + [(3, 128)] * 6
    cases = [([[(4, 128)] * 32] * 3, (4096, 1024, 1024)), ([[(4, 128)] * 32] * 2, (14336, 14336)),
             ([mixed, [(4, 128)] * 32, mixed], (4096, 1024, 1024))]
    for seed, (layouts, ns) in enumerate(cases):
        ws = [Exl2Weight.from_tensors(rand_exl2(lay, n, bias=False, seed=seed * 3 + i, device="cuda"), "L",
                                      device="cuda") for i, (lay, n) in enumerate(zip(layouts, ns))]
        x = torch.randn(300, ws[0].k, dtype=torch.float16, device="cuda")
        for y, w in zip(dequant.dequant_matmul_group(x, ws), ws):
            _check_close(y, qweight.matmul_torch(x, w))


def test_gluon_kernel_eligibility_and_group_alignment():
    """Which weights the Gluon kernel takes (CUDA only, at most 16 rows) and where it may scale after the mma:
    every aligned run of bs steps of every class inside one group."""
    from exl2.kernels import mma_dot

    aligned = Exl2Weight.from_tensors(rand_exl2([(4, 128)] * 4, 64), "L")
    odd = Exl2Weight.from_tensors(rand_exl2([(4, 128), (4, 64), (4, 128)], 64), "L")
    shifted = Exl2Weight.from_tensors(rand_exl2([(4, 32), (4, 128), (4, 96)], 64), "L")
    mixed = Exl2Weight.from_tensors(rand_exl2([(5, 128), (4, 128)], 64), "L")
    assert [mma_dot.groups_align(aligned, bs) for bs in (1, 2, 4, 8)] == [True, True, True, False]
    assert [mma_dot.groups_align(odd, bs) for bs in (1, 2, 4)] == [True, True, False]  # 4 + 2 + 4 steps
    assert [mma_dot.groups_align(shifted, bs) for bs in (1, 2, 4)] == [True, False, False]  # 1 + 4 + 3
    assert [mma_dot.groups_align(mixed, bs) for bs in (1, 2, 4, 8)] == [True, True, True, False]
    assert not mma_dot.groups_align(Exl2Weight.from_tensors(rand_exl2([(5, 128), (4, 96)], 64), "L"), 4)
    assert mma_dot.class_steps(mixed) == (0b1100, [0, 0, 4, 4, 0, 0])
    assert not mma_dot.supports(aligned, 8)  # on the CPU
    assert not mma_dot.supports(mixed, 8) and not mma_dot.supports(aligned, 17)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gluon_mma_matches_twin_gpu(m):
    """The Gluon tensor-core kernel: 4-bit EXL2 (with bias) and GPTQ (zeros, act order), a K whose steps divide
    neither the iteration nor the split, a width that fills no tile, a matrix of every width (8/6/5/4/3/2-bit
    groups of odd sizes), an 8/6-bit head-like one and a 5/4/3-bit body, every tile/split variant, and twice per
    variant (the split counters reset themselves)."""
    from exl2.kernels import mma_dot

    layout = [(4, 128)] * 31 + [(4, 96)]
    ws = [Exl2Weight.from_tensors(rand_exl2(layout, 4096 + 96, seed=m, device="cuda"), "L", device="cuda"),
          Exl2Weight.from_tensors(rand_exl2([(4, 128)] * 32, 2048 + 32, seed=m, device="cuda"), "L", device="cuda")]
    # groups of 4 steps: scaled after the mma (POST) at 1, 2 and 4 steps an iteration, not at 8 nor on the odd K
    assert [mma_dot.groups_align(w, bs) for w in ws for bs in (2, 4, 8)] == [False] * 3 + [True, True, False]
    g = torch.Generator().manual_seed(m)
    k, n, groups = 4096, 1056, 32
    t = pack_gptq(torch.randint(0, 16, (k, n), generator=g), torch.randint(1, 16, (groups, n), generator=g),
                  (torch.rand(groups, n, generator=g) * 0.02).half(), torch.randint(0, groups, (k,), generator=g))
    ws.append(GptqWeight.from_tensors({f"P.{key}": v.cuda() for key, v in t.items()}, "P", device="cuda"))
    for layout, n in [([g for g in MIXED for _ in range(8)], 520), ([(8, 128)] * 5 + [(6, 128)] * 27, 2048),
                      ([(5, 128)] * 4 + [(4, 128)] * 22 + [(3, 128)] * 6, 1024)]:
        ws.append(Exl2Weight.from_tensors(rand_exl2(layout, n, seed=m + n, device="cuda"), "L", device="cuda"))
    assert [len(w.classes) for w in ws[3:]] == [6, 2, 3]
    for w in ws:
        assert mma_dot.supports(w, m)
        x = torch.randn(m, w.k, dtype=torch.float16, device="cuda")
        xp = permute.gather_input(x, [w])[0]
        ref = qweight.matmul_torch(x, w)
        for bs, v, split, stages in [(4, 2, 1, 3), (2, 1, 3, 2), (8, 4, 5, 4), (4, 4, 2, 6), (1, 2, 1, 3)]:
            for _ in range(2):
                _check_close(mma_dot.mma(xp, w, bs, v, split, stages), ref)
        _check_close(qm.quant_matmul(x, w), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [5, 16])
def test_gluon_mma_group_matches_twin_gpu(m):
    """q/k/v-like (three 4-bit weights with bias, one with groups that no iteration aligns with), gate/up-like
    (two) and mixed-width q/k/v-like weights in one grouped launch, each against the twin, with and without a K
    split; twice each."""
    from exl2.kernels import mma_dot

    qkv = [Exl2Weight.from_tensors(rand_exl2(layout, n, seed=m + i, device="cuda"), "L", device="cuda")
           for i, (layout, n) in enumerate([([(4, 128)] * 16, 2048), ([(4, 128)] * 15 + [(4, 96), (4, 32)], 512),
                                            ([(4, 128)] * 16, 512)])]
    gu = [Exl2Weight.from_tensors(rand_exl2([(4, 128)] * 16, 4096, bias=False, seed=m + 5 + i, device="cuda"), "L",
                                  device="cuda") for i in range(2)]
    mixed = [Exl2Weight.from_tensors(rand_exl2(layout, n, seed=m + 9 + i, device="cuda"), "L", device="cuda")
             for i, (layout, n) in enumerate([([(5, 128)] * 3 + [(4, 128)] * 11 + [(3, 128)] * 2, 2048),
                                              ([(6, 128)] * 2 + [(4, 128)] * 14, 512),
                                              ([(4, 128)] * 16, 512)])]
    for ws in (qkv, gu, mixed):
        x = torch.randn(m, ws[0].k, dtype=torch.float16, device="cuda")
        refs = [qweight.matmul_torch(x, w) for w in ws]
        buf = permute.gather_input(x, ws, whole=True)
        offsets = permute.input_layout(ws)[1]
        for splits in (None, [2, 4, 3][:len(ws)]):
            for _ in range(2):
                for y, ref in zip(mma_dot.mma_group(buf, ws, offsets, 4, 2, splits, 4), refs):
                    _check_close(y, ref)
        for y, ref in zip(qm.grouped_matmul(x, ws), refs):
            _check_close(y, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 16])
def test_gluon_mma_group_one_body_equals_a_body_a_member_gpu(m):
    """`mma_group(one_body=True)` (`EXL2_GEMV_GROUP_SELECT`): members of different width mixes through one tile body
    over the union of their widths give bit for bit what a body a member gives, split or not, three members or
    two."""
    from exl2.kernels import mma_dot

    ws = [Exl2Weight.from_tensors(rand_exl2(layout, n, seed=m + 9 + i, device="cuda"), "L", device="cuda")
          for i, (layout, n) in enumerate([([(5, 128)] * 3 + [(4, 128)] * 11 + [(3, 128)] * 2, 2048),
                                           ([(6, 128)] * 2 + [(4, 128)] * 14, 512),
                                           ([(4, 128)] * 16, 512)])]
    for group in (ws, ws[:2]):
        x = torch.randn(m, group[0].k, dtype=torch.float16, device="cuda")
        buf = permute.gather_input(x, group, whole=True)
        offsets = permute.input_layout(group)[1]
        for splits in (None, [2, 4, 3][:len(group)]):
            one = mma_dot.mma_group(buf, group, offsets, 4, 2, splits, 4, one_body=True)
            each = mma_dot.mma_group(buf, group, offsets, 4, 2, splits, 4)
            for a, b, w in zip(one, each, group):
                assert torch.equal(a, b)
                _check_close(a, qweight.matmul_torch(x, w))


# ---------------------------------------------------------------------------------------------- permuted input
def test_input_order_pairs_rows_for_the_packed_decoders():
    """x_index puts rows (u, u+4) of each 4-bit word and rows (r, r+16) of each 6/5/3/2-bit step side by side,
    and leaves 8-bit classes in stored order."""
    w = Exl2Weight.from_tensors(rand_exl2(MIXED, 32), "L")
    assert {c.bits for c in w.classes} == {8, 6, 5, 4, 3, 2}
    for c in w.classes:
        lo, hi = c.first_step * 32, (c.first_step + c.n_steps) * 32
        ri, xi = w.row_index[lo:hi].view(-1, 32), w.x_index[lo:hi].view(-1, 32)
        if c.bits == 4:
            for p in range(32):
                j, i, h = p // 8, (p % 8) // 2, p % 2
                assert torch.equal(xi[:, p], ri[:, 8 * j + i + 4 * h])
        elif c.bits == 8:
            assert torch.equal(xi, ri)
        else:
            for p in range(32):
                assert torch.equal(xi[:, p], ri[:, p // 2 + 16 * (p % 2)])


@needs_triton
def test_gather_input_matches_twin_for_several_weights():
    ws = [Exl2Weight.from_tensors(rand_exl2(MIXED, 32, seed=s), "L", device=DEV) for s in range(3)]
    x = torch.randn(3, ws[0].k, device=DEV).half()
    with force_triton():
        got = permute.gather_input(x, ws)
    for g, w in zip(got, ws):
        ref = qweight.gather_torch(x, w)
        assert torch.equal(g, ref)
        assert (ref[:, w.x_index < 0] == 0).all()
        # and the kernels fed with it agree with feeding them x
        with force_triton():
            _check_close(gemv_k.gemv(x, w, MatmulConfig(bs=2, bn=32, split=2), xp=g), qweight.matmul_torch(x, w))


@needs_triton
def test_project_large_batch_one_gemm_equals_separate_calls():
    """Beyond DOT_MAX_M rows the weights of one input are dequantized side by side into one matrix and multiplied
    once: each output equals its own dequantize + matmul (bias or not, padding rows or a full permutation; one
    dequantization launch per class for weights of one class layout, one per weight otherwise)."""
    from exl2.runtime.linear import Linear, project

    for layouts in ([MIXED, MIXED, MIXED], [[(4, 128)] * 2, [(4, 128)] * 2], [[(4, 128)] * 2, [(6, 128), (4, 128)]],
                    [[(4, 128)] * 2, [(4, 128)] * 2, [(8, 128), (4, 128)]]):
        ws = [Exl2Weight.from_tensors(rand_exl2(mix, 32 * (i + 1), bias=i != 1, seed=i), "L", device=DEV)
              for i, mix in enumerate(layouts)]
        lin = [Linear(w.k, w.n, kernel=w) for w in ws]
        x = torch.randn(1, qm.DOT_MAX_M + 6, ws[0].k, device=DEV).half()
        with force_triton():
            assert qm.uses_dequant(x.shape[1], x)
            together = project(x, lin)
            apart = [m(x) for m in lin]
        for a, b, w in zip(together, apart, ws):
            assert a.shape == (1, x.shape[1], w.n)
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_project_shares_one_gather_and_equals_separate_calls():
    from exl2.runtime.linear import Linear, project

    ws = [Exl2Weight.from_tensors(rand_exl2(MIXED, 32, seed=s), "L", device=DEV) for s in range(3)]
    lin = [Linear(w.k, w.n, kernel=w) for w in ws]
    x = torch.randn(1, 2, ws[0].k, device=DEV).half()
    with force_triton():
        together = project(x, lin)
        apart = [m(x) for m in lin]
    for a, b in zip(together, apart):
        assert a.shape == (1, 2, 32)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("split,bs,bn", [(1, None, 64), (2, None, 64), (2, 16, 64), (2, None, 32)])
def test_gemv_group_equals_separate_gemvs(split, bs, bn, monkeypatch):
    """One launch for 2-3 weights (different widths, sizes, bias or not) equals the twin of each; also with 16
    steps an iteration (`EXL2_GEMV_BS`) and 32-column tiles."""
    monkeypatch.setattr(gemv_k, "auto_split", lambda w, programs, device, min_steps, per_sm=2: split)
    mixes = [MIXED, [(4, 128), (4, 128), (2, 48)], [(8, 32), (6, 64), (4, 128), (2, 80)]]
    ns = [64, 32, 96]
    ws = [Exl2Weight.from_tensors(rand_exl2(mix, n, bias=i != 1, seed=i), "L", device=DEV)
          for i, (mix, n) in enumerate(zip(mixes, ns))]
    for g in (2, 3):
        x = torch.randn(2, ws[0].k, device=DEV).half()
        with force_triton():
            buf = permute.gather_input(x, ws[:g], whole=True)
            outs = gemv_k.GemvGroup(ws[:g], bn=bn, bs=bs)(buf, fast4=False)
        for w, y in zip(ws[:g], outs):
            assert y.shape == (2, w.n)
            _check_close(y, qweight.matmul_torch(x, w))


@needs_triton
@pytest.mark.parametrize("g,bias,per_sm", [(3, True, 1), (3, False, 3), (2, False, 2)])
def test_gemv_group_one_body_equals_twin(g, bias, per_sm, monkeypatch):
    """`EXL2_GEMV_GROUP_SELECT`: a mixed-width group runs one member body with its pointers picked at run time, and
    each member's output (bias, K splits) still equals the twin; a one-width group or one whose members differ in
    bias keeps a body a member."""
    monkeypatch.setattr(gemv_k, "GEMV_GROUP_SELECT", True)
    mixes = [MIXED, [(4, 128), (4, 128), (2, 48)], [(8, 32), (6, 64), (4, 128), (2, 80)]]
    ws = [Exl2Weight.from_tensors(rand_exl2(mix, n, bias=bias, seed=i), "L", device=DEV)
          for i, (mix, n) in enumerate(zip(mixes[:g], [48, 32, 64]))]
    group = gemv_k.GemvGroup(ws, bs=2, per_sm=per_sm)
    assert group.one_body
    x = torch.randn(2, ws[0].k, device=DEV).half()
    with force_triton():
        outs = group(permute.gather_input(x, ws, whole=True), fast4=False)
    for w, y in zip(ws, outs):
        _check_close(y, qweight.matmul_torch(x, w))
    four = [Exl2Weight.from_tensors(rand_exl2([(4, 256)], 32, seed=i), "L", device=DEV) for i in range(2)]
    assert not gemv_k.GemvGroup(four).one_body
    mixed_bias = [Exl2Weight.from_tensors(rand_exl2(MIXED, 32, bias=i == 0, seed=i), "L", device=DEV)
                  for i in range(2)]
    assert not gemv_k.GemvGroup(mixed_bias).one_body


@needs_triton
def test_narrow_gemv_group_settings(monkeypatch):
    """`EXL2_GEMV_NARROW`: a one-width group of fewer 64-column tiles than SMs (4 on the CPU) takes 32-column
    tiles, 16 steps and ~2 programs an SM, and still equals the twin; a wider or a mixed-width group keeps the
    defaults."""
    monkeypatch.setattr(gemv_k, "GEMV_NARROW", True)
    four = [(4, 256)]
    narrow = [Exl2Weight.from_tensors(rand_exl2(four, n, seed=i), "L", device=DEV) for i, n in enumerate([64, 32])]
    group = gemv_k.GemvGroup(narrow)
    assert (group.BN, group.BS, group.per_sm) == (32, 16, 2)
    x = torch.randn(1, narrow[0].k, device=DEV).half()
    with force_triton():
        outs = group(permute.gather_input(x, narrow, whole=True), fast4=False)
    for w, y in zip(narrow, outs):
        _check_close(y, qweight.matmul_torch(x, w))
    defaults = (gemv_k.GEMV_BN, gemv_k.GEMV_BS, gemv_k.GROUP_PER_SM)
    wide = [Exl2Weight.from_tensors(rand_exl2(four, 128, seed=i), "L", device=DEV) for i in range(2)]
    assert (lambda g: (g.BN, g.BS, g.per_sm))(gemv_k.GemvGroup(wide)) == defaults
    mixed = [Exl2Weight.from_tensors(rand_exl2(MIXED, n, seed=i), "L", device=DEV) for i, n in enumerate([64, 32])]
    assert (lambda g: (g.BN, g.BS, g.per_sm))(gemv_k.GemvGroup(mixed)) == defaults


_RPF_CHILD = """
import torch
from exl2.kernels import gemv as gemv_k, permute, qweight
from exl2.kernels.exl2_matmul import Exl2Weight
from exl2.kernels.matmul_launch import MatmulConfig
from tests.test_kernels_quant_matmul import MIXED, _check_close, rand_exl2
assert gemv_k.GEMV_RPF and gemv_k.fast4_available(torch.device("cuda")) & 1, "the 4-bit self-check failed"
ws = [Exl2Weight.from_tensors(rand_exl2(mix, n, seed=i), "L", device="cuda")
      for i, (mix, n) in enumerate([([(4, 4096)], 256), (MIXED, 64), ([(4, 256), (2, 48)], 96)])]
for m in (1, 3):
    x = torch.randn(m, 4096, device="cuda").half()
    for split in (1, 3):
        _check_close(gemv_k.gemv(x, ws[0], MatmulConfig(bs=8, bn=64, split=split, num_stages=3)),
                     qweight.matmul_torch(x, ws[0]))
    x = torch.randn(m, ws[1].k, device="cuda").half()
    outs = gemv_k.GemvGroup(ws[1:])(permute.gather_input(x, ws[1:], whole=True))
    for w, y in zip(ws[1:], outs):
        _check_close(y, qweight.matmul_torch(x, w))
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_register_prefetch_matches_twin_gpu():
    """EXL2_GEMV_RPF=1 (a module constant, so in a child process): the 4-bit loop with register prefetch passes its
    self-check and matches the twin, alone (split or not, 1 and 3 rows) and in a mixed-width group."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, EXL2_GEMV_RPF="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _RPF_CHILD], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@needs_triton
def test_project_uses_the_grouped_gemv_when_enabled(monkeypatch):
    from exl2.runtime.linear import Linear, project

    monkeypatch.setattr(qm, "FUSE_SHARED_INPUT", True)
    calls = []
    cls = gemv_k.GemvGroup
    real = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    ws = [Exl2Weight.from_tensors(rand_exl2(MIXED, 32, seed=s), "L", device=DEV) for s in range(3)]
    lin = [Linear(w.k, w.n, kernel=w) for w in ws]
    x = torch.randn(1, 1, ws[0].k, device=DEV).half()
    with force_triton():
        together = project(x, lin)
    assert calls == [1]
    for y, w in zip(together, ws):
        _check_close(y.view(1, -1), qweight.matmul_torch(x.view(1, -1), w))


@needs_triton
def test_dot_with_large_row_tiles_matches_twin():
    """The tensor-core kernel with 64-row tiles over several row blocks (the candidate prefill path)."""
    w = Exl2Weight.from_tensors(rand_exl2(MIXED, 64, seed=5), "L", device=DEV)
    x = torch.randn(70, w.k, device=DEV).half()
    with force_triton():
        y = dot_k.dot(x, w, MatmulConfig(bm=64, bs=1, bn=32, split=2))
    _check_close(y, qweight.matmul_torch(x, w))


@needs_triton
def test_permuted_matmul_from_the_permuted_input_alone():
    w = Exl2Weight.from_tensors(rand_exl2(MIXED, 64, seed=6), "L", device=DEV)
    x = torch.randn(3, w.k, device=DEV).half()
    xp = qweight.gather_torch(x, w).contiguous()
    ref = qweight.matmul_torch(x, w)
    _check_close(qm.permuted_matmul(xp, w), ref)      # the twin (un-permutes)
    with force_triton():
        _check_close(qm.permuted_matmul(xp, w), ref)  # the kernels
    with pytest.raises(ValueError):
        qm.permuted_matmul(xp[:, :-32], w)



def test_rows_past_gemv_max_take_the_tensor_core_kernel(monkeypatch):
    """Where the Gluon kernel runs, 2-4 rows of a matrix leave the gemv (EXL2_GEMV_MAX_M, 1); 1 stays where the
    gemv has a packed decoder for every class, and a matrix with a class whose decoder failed the device's check
    (3-bit here) leaves it at any row count (EXL2_MMA_GEMV)."""
    from exl2.kernels import mma_dot

    monkeypatch.setattr(qm, "MMA4", True)
    monkeypatch.setattr(mma_dot, "supports", lambda w, m: 0 < m <= 16)
    monkeypatch.setattr(qm, "fast4_available", lambda device: 63)
    four = Exl2Weight.from_tensors(rand_exl2([(4, 128)], 64, bias=False), "L")
    mixed = Exl2Weight.from_tensors(rand_exl2([(4, 64), (3, 64)], 64, bias=False), "L")
    assert [qm.gemv_via_mma(four, m, torch.float16) for m in (1, 2, 3, 4)] == [False, True, True, True]
    assert [qm.gemv_via_mma(mixed, m, torch.float16) for m in (1, 2, 3, 4)] == [False, True, True, True]
    monkeypatch.setattr(qm, "fast4_available", lambda device: 63 & ~gemv_k.PACKED_FLAG[3])
    assert not qm.gemv_via_mma(four, 1, torch.float16)
    assert all(qm.gemv_via_mma(mixed, m, torch.float16) for m in (1, 2, 3, 4))
    assert not qm.gemv_via_mma(four, 3, torch.bfloat16)  # the Gluon kernel takes fp16 only
    monkeypatch.setattr(qm, "GEMV_MAX_M", 4)
    assert not any(qm.gemv_via_mma(four, m, torch.float16) for m in (1, 2, 3, 4))
