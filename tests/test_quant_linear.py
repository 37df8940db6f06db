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
