"""The gate/up gemv with the GLU in its epilogue (`kernels/gemv_glu.py`) against the two launches it replaces (the
grouped gemv, then the gathering GLU kernel) and against the PyTorch twin; and the MLP's use of it."""
import pytest
import torch

from exl2.kernels import gemv_glu
from exl2.kernels import permute
from exl2.kernels import quant_matmul as qm
from exl2.kernels import qweight
from exl2.kernels.activation import glu, glu_torch
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.kernels.exl2_matmul import Exl2Weight
from exl2.kernels.gemv import GemvGroup
from exl2.models.layers import GatedMLP
from exl2.runtime.linear import Linear
from tests.test_kernels_quant_matmul import MIXED, rand_exl2

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")

# gate and up of one input with different width mixes (as real EXL2 files have), N = 64; down reads 64 columns
GATE_MIX, UP_MIX = MIXED, [(4, 128), (4, 128), (2, 48)]


def _weights(n: int = 64, seed: int = 0):
    gate = Exl2Weight.from_tensors(rand_exl2(GATE_MIX, n, bias=False, seed=seed), "L", device=DEV)
    up = Exl2Weight.from_tensors(rand_exl2(UP_MIX, n, bias=False, seed=seed + 1), "L", device=DEV)
    down = Exl2Weight.from_tensors(rand_exl2([(6, 32), (4, 32)], 32, bias=False, seed=seed + 2), "L", device=DEV)
    assert gate.k == up.k and down.k == n
    return gate, up, down


@needs_triton
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bn", [16, 32])
def test_fused_glu_gemv_equals_group_then_glu(act, bn):
    gate, up, down = _weights()
    permute.share_input_orders([gate, up])
    x = torch.randn(2, gate.k, device=DEV).half()
    with force_triton():
        buf = permute.gather_input(x, [gate, up], whole=True)
        fused = gemv_glu.GemvGlu(gate, up, down, act, bn=bn)(buf, fast4=False)
        g, u = GemvGroup([gate, up])(buf, fast4=False)
        apart = glu(g, u, act, index=down.x_index)
    assert fused.shape == (2, down.k)
    if DEV == "cpu":  # the same per-column sums in the same order, each rounded before the activation
        torch.testing.assert_close(fused, apart, rtol=0, atol=0)
    else:  # another column tile may reduce a step's products in another order: an fp16 ulp
        torch.testing.assert_close(fused, apart, rtol=2e-3, atol=2e-3)
    twin = glu_torch(qweight.matmul_torch(x, gate), qweight.matmul_torch(x, up), act, index=down.x_index)
    err = (fused.float() - twin.float()).abs().max()
    assert err <= 4e-3 * twin.float().abs().max() + 2e-3, float(err)


def test_fused_glu_gemv_refuses_what_it_cannot_write():
    gate, up, down = _weights()
    assert gemv_glu.GemvGlu.accepts(gate, up, down)
    biased = Exl2Weight.from_tensors(rand_exl2(UP_MIX, 64, bias=True, seed=7), "L", device=DEV or "cpu")
    assert not gemv_glu.GemvGlu.accepts(gate, biased, down)
    wide = Exl2Weight.from_tensors(rand_exl2([(6, 64), (4, 32)], 32, bias=False, seed=8), "L", device=DEV or "cpu")
    assert not gemv_glu.GemvGlu.accepts(gate, up, wide)  # down reads 96 columns, gate/up give 64
    with pytest.raises(ValueError, match="activation"):
        gemv_glu.GemvGlu(gate, up, down, "relu")


@needs_triton
@pytest.mark.parametrize("rows", [1, 3])
def test_mlp_takes_the_fused_launch(rows, monkeypatch):
    """GatedMLP at 1-4 rows: one fused launch, the same output as the grouped gemv + GLU path and the twin."""
    gate, up, down = _weights(seed=3)
    permute.share_input_orders([gate, up])
    mlp = GatedMLP(*(Linear(w.k, w.n, kernel=w) for w in (gate, up, down)), "silu")
    x = torch.randn(1, rows, gate.k, device=DEV).half()
    calls = []
    real = gemv_glu.GemvGlu.__call__
    monkeypatch.setattr(gemv_glu.GemvGlu, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    monkeypatch.setattr(qm, "FUSE_SHARED_INPUT", True)
    monkeypatch.setattr(qm, "gemv_via_mma", lambda w, m, dtype: False)  # the gemv path, as on a GPU at batch 1
    with force_triton():
        monkeypatch.setattr(qm, "GLU_GEMV", True)
        fused = mlp(x)
        monkeypatch.setattr(qm, "GLU_GEMV", False)
        apart = mlp(x)
    assert calls == [1]
    assert fused.shape == (1, rows, down.n)
    torch.testing.assert_close(fused, apart, rtol=2e-3, atol=2e-3)
    x2 = x.view(rows, -1)
    h = glu_torch(qweight.matmul_torch(x2, gate), qweight.matmul_torch(x2, up), "silu")
    ref = qweight.matmul_torch(h, down)
    err = (fused.view(rows, -1).float() - ref.float()).abs().max()
    assert err <= 4e-3 * ref.float().abs().max() + 2e-3, float(err)
