"""The gate/up gemv writing act(gate)·up itself (`GemvGroup.gated`, batch-1 decode): of a column tile's gate and
up programs, the second to finish applies the activation to both fp16 outputs and writes the down projection's
permuted input. It must equal, bit for bit, the unfused path (the grouped gemv, then the GLU kernel with down's
input order), and the PyTorch twin within the gemv's rounding; where K is split it must decline."""
import pytest
import torch

from exl2.kernels import gemv as gemv_k
from exl2.kernels import permute, qweight
from exl2.kernels.activation import ACTIVATIONS, glu, glu_torch
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.models import layers
from exl2.models.layers import GatedMLP
from exl2.runtime.linear import Linear

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")


def _weight(k: int, n: int, seed: int) -> qweight.QuantWeight:
    """A random EXL2-style weight of 6/4/3-bit groups under a random act-order permutation."""
    g = torch.Generator().manual_seed(seed)
    layout = [(6, k // 4), (4, k // 2), (3, k // 4)]
    codes = torch.cat([torch.randint(0, 1 << b, (r, n), generator=g) for b, r in layout]).to(torch.uint8)
    scales = (torch.rand(len(layout), n, generator=g) * 0.01 + 0.001).half()
    perm = torch.randperm(k, generator=g)
    return qweight.build(codes.to(DEV), layout, scales.to(DEV), None, perm.to(DEV), None)


def _mlp(k: int, inter: int) -> tuple[list[qweight.QuantWeight], qweight.QuantWeight]:
    gate, up = _weight(k, inter, 1), _weight(k, inter, 2)
    up.x_index = gate.x_index = gate.x_index.clone()
    up.row_index = gate.row_index  # gate and up read one permuted input, as a converted model's do
    return [gate, up], _weight(inter, k, 3)


@needs_triton
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("m", [1, 2])
def test_gated_gemv_equals_the_gemv_then_the_glu_kernel(act, m):
    ws, down = _mlp(256, 128)
    torch.manual_seed(m)
    x = torch.randn(m, 256, device=DEV).half()
    inv = down.scatter_index()
    assert inv is not None
    with force_triton():
        buf = permute.gather_input(x, ws, whole=True)
        group = gemv_k.GemvGroup(ws)
        gate, up = group(buf, fast4=False)
        ref = glu(gate, up, act, index=down.x_index)
        fused = group.gated(buf, act, inv, fast4=False)
    assert fused is not None and fused.shape == (m, 128)
    assert torch.equal(fused, ref)
    twin = glu_torch(qweight.matmul_torch(x, ws[0]), qweight.matmul_torch(x, ws[1]), act, index=down.x_index)
    err = (fused.float() - twin.float()).abs().max()
    assert err <= 5e-3 * twin.float().abs().max() + 1e-3


@needs_triton
def test_gated_gemv_declines_where_k_is_split():
    ws, down = _mlp(1024, 128)
    x = torch.randn(1, 1024, device=DEV).half()
    with force_triton():
        group = gemv_k.GemvGroup(ws)
        assert group.gated(permute.gather_input(x, ws, whole=True), "silu", down.scatter_index(), fast4=False) \
            is None
    assert group._splits[1] != (1, 1)


@needs_triton
@pytest.mark.parametrize("fused", [True, False])
def test_mlp_forward_takes_the_fused_path_and_matches_the_twin(monkeypatch, fused):
    ws, down = _mlp(256, 128)
    mlp = GatedMLP(*(Linear(w.k, w.n, kernel=w) for w in ws + [down]), "silu")
    x = torch.randn(1, 1, 256, device=DEV).half()
    calls = []
    monkeypatch.setattr(gemv_k, "FUSED_GLU", fused)
    monkeypatch.setattr(layers, "glu", lambda *a, **kw: calls.append(1) or glu(*a, **kw))
    with force_triton():
        y = mlp(x)
    assert calls == ([] if fused else [1])  # the GLU launch happens only on the unfused path
    twin = qweight.matmul_torch(glu_torch(qweight.matmul_torch(x[0], ws[0]), qweight.matmul_torch(x[0], ws[1])),
                                down)
    assert y.shape == (1, 1, 256)
    assert (y[0].float() - twin.float()).abs().max() <= 5e-3 * twin.float().abs().max() + 1e-3
