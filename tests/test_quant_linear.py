"""Quantized layers through the kernel path (Triton interpreter on CPU) equal the dense reference path."""
import pytest
import torch

from exl2.formats.safetensors_io import TensorSource
from exl2.kernels.backend import force_triton, triton_usable
from exl2.runtime.weights import WeightLoader

from test_exl2_model import GOLDEN


@pytest.mark.skipif(not triton_usable(), reason="needs Triton (the interpreter on CPU)")
@pytest.mark.parametrize("prefix,k,n", [("model.layers.1.mlp.down_proj", 768, 256),
                                        ("model.layers.0.self_attn.v_proj", 256, 128)])
def test_exl2_kernel_linear_matches_dequantized_dense(prefix, k, n):
    """Tolerance: fp16 accumulation-order differences, 1 % of the output range."""
    src = TensorSource(GOLDEN / "b3.0_hb6")
    dense = WeightLoader(src, "cpu", torch.float16, use_kernels=False).linear(prefix, k, n, False)
    fast = WeightLoader(src, "cpu", torch.float16, use_kernels=True).linear(prefix, k, n, False)
    assert fast.kernel is not None and dense.kernel is None
    x = torch.randn(2, k, dtype=torch.float16)
    with force_triton():
        y = fast(x)
    ref = x.float() @ dense.weight.float().t()
    assert y.shape == (2, n)
    assert torch.allclose(y.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=0)


@pytest.mark.skipif(not triton_usable(), reason="needs Triton (the interpreter on CPU)")
def test_norm_written_permuted_inputs_give_the_same_logits(monkeypatch):
    """The decoder's norm kernels writing q/k/v and gate/up inputs (one launch fewer per group) = separate
    gathers, bit for bit; and both match the dense model within fp16 tolerance."""
    from exl2.models import decoder as dec
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import read_config, spec_from_config

    d = GOLDEN / "b3.0_hb6"
    spec = spec_from_config(read_config(d))
    fast = DecoderModel(spec, WeightLoader(TensorSource(d), "cpu", torch.float16, use_kernels=True)).eval()
    dense = DecoderModel(spec, WeightLoader(TensorSource(d), "cpu", torch.float16, use_kernels=False)).eval()
    ids = torch.tensor([[1, 45, 74, 31]])
    calls = []
    real = dec.DecoderLayer._norm_into
    monkeypatch.setattr(dec.DecoderLayer, "_norm_into",
                        staticmethod(lambda norm, delta, x, module, *a: calls.append(1) or real(norm, delta, x, module, *a)))
    with torch.no_grad(), force_triton():
        fused = fast(ids)
        monkeypatch.setattr(dec, "uses_permuted_input", lambda rows, x: False)
        separate = fast(ids)
    with torch.no_grad():
        ref = dense(ids)
    assert calls  # the fused path ran
    assert torch.equal(fused, separate)
    assert (fused - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.skipif(not triton_usable(), reason="needs Triton (the interpreter on CPU)")
def test_grouped_gemv_in_the_model_matches(monkeypatch):
    """The whole decoder with q/k/v and gate/up as grouped launches (EXL2_FUSE_SHARED_INPUT) = one launch each."""
    from exl2.kernels import gemv as gemv_k
    from exl2.kernels import quant_matmul as qm
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import read_config, spec_from_config

    d = GOLDEN / "b3.0_hb6"
    spec = spec_from_config(read_config(d))
    model = DecoderModel(spec, WeightLoader(TensorSource(d), "cpu", torch.float16, use_kernels=True)).eval()
    ids = torch.tensor([[1, 45, 74]])
    launches = []
    real = gemv_k.GemvGroup.__call__
    monkeypatch.setattr(gemv_k.GemvGroup, "__call__", lambda self, *a, **k: launches.append(1) or real(self, *a, **k))
    with torch.no_grad(), force_triton():
        monkeypatch.setattr(qm, "FUSE_SHARED_INPUT", False)
        separate = model(ids)
        assert not launches
        monkeypatch.setattr(qm, "FUSE_SHARED_INPUT", True)
        grouped = model(ids)
    assert len(launches) == 2 * spec.num_layers
    assert (grouped - separate).abs().max() <= 1e-2 * separate.abs().max()
