"""K-split partial sums left to the norm-gather (`SplitSum`, EXL2_SPLIT_SUM): the gemv's partials add up to its
ordinary output, the norm-gather fed them equals the one fed the summed output, and a decoder routing o_proj and
down through them gives the logits of one that does not."""
import pytest
import torch

from exl2.formats.safetensors_io import TensorSource
from exl2.kernels import qweight
from exl2.kernels import quant_matmul as qm
from exl2.kernels.split_sum import SplitSum
from exl2.kernels import permute
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.kernels.norm import rms_norm_gather
from exl2.runtime.weights import WeightLoader

from test_exl2_model import GOLDEN

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")

K, N = 512, 128  # 16 steps, two 64-column tiles: the gemv splits K in two (sm_count 4 on CPU)


def _weight(bias: bool) -> qweight.QuantWeight:
    g = torch.Generator().manual_seed(3)
    layout = [(4, 384), (6, 128)]
    codes = torch.cat([torch.randint(0, 1 << b, (r, N), generator=g) for b, r in layout]).to(torch.uint8)
    scales = (torch.rand(len(layout), N, generator=g) * 0.01 + 0.001).half()
    perm = torch.randperm(K, generator=g)
    b = (torch.randn(N, generator=g) * 0.1).half() if bias else None
    return qweight.build(codes.to(DEV), layout, scales.to(DEV), None, perm.to(DEV), b)


def _cpu_sm_count(monkeypatch):
    """The K splits these tests expect are those of the interpreter's 4 "SMs", on a GPU too."""
    monkeypatch.setattr("exl2.kernels.matmul_launch.sm_count", lambda device: 4)
    monkeypatch.setattr("exl2.kernels.quant_matmul.sm_count", lambda device: 4)


@needs_triton
def test_gemv_partials_add_up_to_its_output(monkeypatch):
    _cpu_sm_count(monkeypatch)
    w = _weight(bias=False)
    rows = 2 if INTERPRET else 1  # on a GPU two rows take the Gluon kernel (GEMV_MAX_M), which splits otherwise
    xp = permute.gather_input(torch.randn(rows, K, device=DEV).half(), [w])[0]
    with force_triton():
        assert qm.choose_config(rows, w)[1].split == 2
        plain = qm.permuted_matmul(xp, w)
        split = qm.permuted_matmul(xp, w, split_sum=True)
    assert isinstance(split, SplitSum) and split.parts.shape == (2, rows, N)
    assert split.parts.dtype == torch.float32
    torch.testing.assert_close(split.total(torch.float16), plain, atol=0, rtol=0)  # two fp32 terms: one order
    with force_triton():  # a bias is added by the summing program: such a weight keeps its plain output
        assert isinstance(qm.permuted_matmul(xp, _weight(bias=True), split_sum=True), torch.Tensor)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="the Gluon kernel needs a GPU")
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gluon_partials_add_up_to_its_output(m):
    """The tensor-core kernel (batch 5-16, and 1-4 for mixed widths) leaving its partials: they sum to its
    output. (Not marked gpu: `device.sh s18` runs this file by name, `-k partials`.)"""
    from exl2.kernels import mma_dot

    w = _weight(bias=False)
    if not mma_dot.supports(w, m):
        pytest.skip("the Gluon kernel does not take this weight here")
    xp = permute.gather_input(torch.randn(m, K, device=DEV).half(), [w])[0]
    for split in (2, 3):
        plain = mma_dot.mma(xp, w, 4, 2, split, 3)
        parts = mma_dot.mma(xp, w, 4, 2, split, 3, part_only=True)
        assert isinstance(parts, SplitSum) and parts.parts.shape == (split, m, N)
        torch.testing.assert_close(parts.total(torch.float16), plain, atol=1e-3 * plain.abs().max().item(), rtol=0)
    assert isinstance(mma_dot.mma(xp, _weight(bias=True), 4, 2, 2, 3, part_only=True), torch.Tensor)


@needs_triton
def test_norm_gather_adds_the_partials():
    torch.manual_seed(8)
    d = 96
    parts = torch.randn(3, 2, d, device=DEV) * 0.5
    res = torch.randn(2, d, device=DEV).half()
    w = torch.rand(d, device=DEV).half() + 0.5
    idx = [torch.randperm(d, device=DEV).int(), torch.cat([torch.randperm(d, device=DEV),
                                                            torch.full((32,), -1, device=DEV)]).int()]
    summed = parts.sum(0).half()
    with force_triton():
        ref_out, ref_xp, _ = rms_norm_gather(summed, w, 1e-5, idx, residual=res.clone())
        out, xp, new_p = rms_norm_gather(SplitSum(parts, (2,)), w, 1e-5, idx, residual=res.clone())
    twin_out, twin_xp, _ = rms_norm_gather(SplitSum(parts, (2,)), w, 1e-5, idx, residual=res.clone())
    # the kernel adds the partials to the residual in fp32 (one rounding), the reference rounds their sum first
    torch.testing.assert_close(new_p, (parts.sum(0) + res.float()).half(), atol=0, rtol=0)
    for got in (out, twin_out):
        torch.testing.assert_close(got, ref_out, atol=4e-3, rtol=0)
    for got in (xp, twin_xp):
        torch.testing.assert_close(got, ref_xp, atol=4e-3, rtol=0)
    torch.testing.assert_close(xp[:, :d], out[:, idx[0].long()], atol=0, rtol=0)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_gather(SplitSum(parts, (2,)), w, 1e-5, idx)


@needs_triton
def test_decoder_routing_split_sums_keeps_the_logits(monkeypatch):
    _cpu_sm_count(monkeypatch)
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import read_config, spec_from_config

    d = GOLDEN / "b3.0_hb6"
    spec = spec_from_config(read_config(d))
    model = DecoderModel(spec, WeightLoader(TensorSource(d), DEV, torch.float16, use_kernels=True)).eval()
    ids = torch.tensor([[45]], device=DEV)  # one row: down (K 768) splits K in two on 4 "SMs"; o_proj (K 256) not
    made = []
    real = qm.permuted_matmul

    def counting(xp, w, split_sum=False):
        y = real(xp, w, split_sum)
        made.append(isinstance(y, SplitSum))
        return y
    monkeypatch.setattr("exl2.runtime.linear.permuted_matmul", counting)
    with torch.no_grad(), force_triton():
        assert model.route_split_sums(False) == 0
        plain = model(ids)
        assert not any(made)
        # o_proj of every layer, down of all but the last (the final norm reads it)
        assert model.route_split_sums(True) == 2 * spec.num_layers - 1
        routed = model(ids)
    assert any(made)
    assert (routed - plain).abs().max() <= 1e-2 * plain.abs().max()
    with torch.no_grad():  # the twins (CPU path) never see the flag's partials
        torch.testing.assert_close(model(ids), model(ids))


@needs_triton
@pytest.mark.parametrize("gblock,warps", [(16, 4), (64, 8), (256, 16)])
def test_norm_gather_launch_settings_give_the_same_rows(gblock, warps):
    """`rms_norm_gather(gblock=, num_warps=)` (the kernels.py sweep): other copy chunks a program and warp counts
    write exactly the default launch's rows; a chunk that is not a power of two is refused."""
    torch.manual_seed(9)
    d = 96
    parts = torch.randn(4, 1, d, device=DEV) * 0.5
    res = torch.randn(1, d, device=DEV).half()
    w = torch.rand(d, device=DEV).half() + 0.5
    idx = [torch.randperm(d, device=DEV).int()]
    with force_triton():
        ref = rms_norm_gather(SplitSum(parts, (1,)), w, 1e-5, idx, residual=res.clone())
        got = rms_norm_gather(SplitSum(parts, (1,)), w, 1e-5, idx, residual=res.clone(), gblock=gblock,
                              num_warps=warps)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_gather(SplitSum(parts, (1,)), w, 1e-5, idx, residual=res.clone(), gblock=48)
