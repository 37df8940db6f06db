"""Fused small kernels (RMSNorm/LayerNorm, rotary, gated activations): twins vs independent definitions, and
Triton kernels vs twins (interpreter on CPU under TRITON_INTERPRET=1, CUDA on the GPU machine)."""
import math

import pytest
import torch

from exl2.kernels import activation, norm, rotary
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.gpu


def _max_ulp_fp16(a: torch.Tensor, b: torch.Tensor, floor: float = 2.0 ** -14) -> float:
    """Largest difference in units of fp16 resolution at the reference's magnitude (at least `floor`)."""
    ulp = torch.clamp(b.float().abs(), min=floor) * 2.0 ** -10
    return float(((a.float() - b.float()).abs() / ulp).max())


# ---------------------------------------------------------------------------------------------- twins
def test_rms_norm_twin_matches_definition():
    torch.manual_seed(0)
    x, w = torch.randn(7, 96, dtype=torch.float16), torch.randn(96, dtype=torch.float16)
    ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert _max_ulp_fp16(norm.rms_norm_torch(x, w, 1e-6), ref) <= 1.0
    ref_g = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    assert _max_ulp_fp16(norm.rms_norm_torch(x, w, 1e-6, gemma=True), ref_g) <= 1.0


def test_norm_twin_residual_and_layer_norm():
    torch.manual_seed(1)
    x, r = torch.randn(5, 64, dtype=torch.float16), torch.randn(5, 64, dtype=torch.float32)
    w, b = torch.randn(64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    r0 = r.clone()
    y, r_out = norm.rms_norm_torch(x, w, 1e-5, residual=r)
    assert r_out is r and torch.equal(r, x.float() + r0)
    assert _max_ulp_fp16(y, norm.rms_norm_torch(r.to(torch.float16).float(), w, 1e-5).float()) <= 1.0
    ln = torch.nn.functional.layer_norm(x.double(), (64,), w.double(), b.double(), 1e-5)
    assert _max_ulp_fp16(norm.layer_norm_torch(x, w, b, 1e-5), ln) <= 1.0


def test_rotary_twin_matches_complex_rotation():
    torch.manual_seed(2)
    t, h, d, rd = 4, 3, 64, 32
    q = torch.randn(t, h, d, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    cos, sin = rotary.rotary_tables(inv, 50)
    pos = torch.tensor([0, 3, 17, 49])
    for interleaved in (False, True):
        out = q.clone()
        rotary.apply_rotary_torch(out, None, cos, sin, pos, rotary_dim=rd, interleaved=interleaved)
        r = q[..., :rd]
        pairs = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., : rd // 2], r[..., rd // 2:])
        z = torch.complex(pairs[0].double(), pairs[1].double()) * torch.polar(
            torch.ones(t, rd // 2, dtype=torch.float64), pos[:, None].double() * inv.double())[:, None, :]
        o = out[..., :rd]
        got = (o[..., 0::2], o[..., 1::2]) if interleaved else (o[..., : rd // 2], o[..., rd // 2:])
        torch.testing.assert_close(got[0].double(), z.real, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1].double(), z.imag, atol=1e-5, rtol=0)
        assert torch.equal(out[..., rd:], q[..., rd:])


def test_glu_twin_matches_torch_functional():
    torch.manual_seed(3)
    g, u = torch.randn(6, 40, dtype=torch.float32), torch.randn(6, 40, dtype=torch.float32)
    f = torch.nn.functional
    torch.testing.assert_close(activation.glu_torch(g, u, "silu"), f.silu(g) * u)
    torch.testing.assert_close(activation.glu_torch(g, u, "gelu_tanh"), f.gelu(g, approximate="tanh") * u)
    torch.testing.assert_close(activation.glu_torch(torch.cat([g, u], -1), None, "gelu"), f.gelu(g) * u)
    with pytest.raises(ValueError):
        activation.glu_torch(g, u, "relu")


# ---------------------------------------------------------------------------------------------- kernels
@needs_triton
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 256)])
def test_norm_kernels_match_twins(shape):
    torch.manual_seed(4)
    x = torch.randn(*shape, dtype=torch.float16, device=DEV)
    w = torch.randn(shape[-1], dtype=torch.float16, device=DEV)
    b = torch.randn(shape[-1], dtype=torch.float16, device=DEV)
    r = torch.randn(*shape, dtype=torch.float32, device=DEV)
    with force_triton():
        y1 = norm.rms_norm(x, w, 1e-6)
        y2, r2 = norm.rms_norm(x, w, 1e-6, residual=r.clone(), gemma=True)
        y3 = norm.layer_norm(x, w, b, 1e-5)
    assert _max_ulp_fp16(y1, norm.rms_norm_torch(x, w, 1e-6)) <= 1.0
    ry = r.clone()
    ref2, _ = norm.rms_norm_torch(x, w, 1e-6, residual=ry, gemma=True)
    assert torch.equal(r2, ry)
    assert _max_ulp_fp16(y2, ref2) <= 1.0
    assert _max_ulp_fp16(y3, norm.layer_norm_torch(x, w, b, 1e-5)) <= 1.0


@needs_triton
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_kernel_matches_twin_on_fused_qkv_views(interleaved):
    torch.manual_seed(5)
    t, hq, hk, d, rd = 3, 4, 2, 64, 48
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=torch.float16, device=DEV)
    inv = 1.0 / (500000 ** (torch.arange(0, rd, 2).float() / rd))
    cos, sin = rotary.rotary_tables(inv, 64, device=DEV)
    pos = torch.tensor([5, 0, 63], device=DEV)
    a, b = qkv.clone(), qkv.clone()
    views = lambda z: (z[:, : hq * d].view(t, hq, d), z[:, hq * d:(hq + hk) * d].view(t, hk, d))  # noqa: E731
    with force_triton():
        rotary.apply_rotary(*views(a), cos, sin, pos, rotary_dim=rd, interleaved=interleaved)
    rotary.apply_rotary_torch(*views(b), cos, sin, pos, rotary_dim=rd, interleaved=interleaved)
    assert _max_ulp_fp16(a, b) <= 1.0
    assert torch.equal(a[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched


@needs_triton
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
def test_glu_kernel_matches_twin(act):
    torch.manual_seed(6)
    fused = torch.randn(3, 2, 2 * 72, dtype=torch.float16, device=DEV) * 3
    with force_triton():
        y = activation.glu(fused, activation=act)
        y2 = activation.glu(fused[..., :72], fused[..., 72:].contiguous(), activation=act)
    ref = activation.glu_torch(fused, activation=act)
    # erf's cancellation for g << 0 makes tiny outputs differ relatively; 1e-2 floors the scale there
    floor = 1e-2 if act == "gelu" else 2.0 ** -14
    assert _max_ulp_fp16(y, ref, floor) <= 1.0 and _max_ulp_fp16(y2, ref, floor) <= 1.0


# ---------------------------------------------------------------------------------------------- GPU sizes
@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_kernels_real_sizes_gpu():
    torch.manual_seed(7)
    x = torch.randn(2047, 4096, dtype=torch.float16, device="cuda")
    w = torch.randn(4096, dtype=torch.float16, device="cuda")
    r = torch.randn(2047, 4096, dtype=torch.float16, device="cuda")
    y, r1 = norm.rms_norm(x, w, 1e-5, residual=r.clone())
    ref, r2 = norm.rms_norm_torch(x, w, 1e-5, residual=r.clone())
    assert torch.equal(r1, r2) and _max_ulp_fp16(y, ref) <= 1.0
    gu = torch.randn(2047, 2 * 14336, dtype=torch.float16, device="cuda")
    assert _max_ulp_fp16(activation.swiglu(gu), activation.glu_torch(gu)) <= 1.0
    q = torch.randn(2047, 32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(2047, 8, 128, dtype=torch.float16, device="cuda")
    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    cos, sin = rotary.rotary_tables(inv, 8192, device="cuda")
    pos = torch.arange(2047, device="cuda") + 100
    q2, k2 = q.clone(), k.clone()
    rotary.apply_rotary(q, k, cos, sin, pos)
    rotary.apply_rotary_torch(q2, k2, cos, sin, pos)
    assert _max_ulp_fp16(q, q2) <= 1.0 and _max_ulp_fp16(k, k2) <= 1.0
    assert math.isfinite(float(q.float().abs().max()))


@needs_triton
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gather_matches_twin(with_residual):
    """Norm + residual sum + up to three permuted copies (with -1 padding) from one kernel = the twin and the plain
    norm; the sum lands in a new tensor and the old residual is left as it was."""
    from exl2.kernels.norm import rms_norm, rms_norm_gather

    torch.manual_seed(4)
    d = 96
    x = torch.randn(3, d, device=DEV).half()
    w = torch.rand(d, device=DEV).half() + 0.5
    res = torch.randn(3, d, device=DEV).half() if with_residual else None
    padded = torch.cat([torch.randperm(d, device=DEV), torch.full((32,), -1, device=DEV)]).int()
    idx = [torch.randperm(d, device=DEV).int(), padded, torch.arange(d, device=DEV).int()]
    plain = rms_norm(x, w, 1e-5, residual=res.clone()) if with_residual else (rms_norm(x, w, 1e-5), None)
    for g in (1, 3):
        r1 = res.clone() if res is not None else None
        with force_triton():
            got = rms_norm_gather(x, w, 1e-5, idx[:g], residual=r1)
        ref = rms_norm_gather(x, w, 1e-5, idx[:g], residual=res)  # CPU twin outside force_triton
        assert len(got) == len(ref) == (3 if with_residual else 2)
        out, xp = got[:2]
        assert xp.shape == (3, sum(i.numel() for i in idx[:g]))
        torch.testing.assert_close(out, ref[0], atol=2e-3, rtol=0)
        torch.testing.assert_close(out, plain[0], atol=2e-3, rtol=0)
        torch.testing.assert_close(xp, ref[1], atol=2e-3, rtol=0)
        # the copies are computed from gathered inputs, and must equal the written row exactly
        torch.testing.assert_close(xp[:, :d], out[:, idx[0].long()], atol=0, rtol=0)
        if g > 1:
            assert (xp[:, 2 * d:2 * d + 32] == 0).all()  # the second index's padding positions
        if with_residual:
            torch.testing.assert_close(got[2], plain[1], atol=0, rtol=0)
            torch.testing.assert_close(ref[2], plain[1], atol=0, rtol=0)
            torch.testing.assert_close(r1, res, atol=0, rtol=0)


@needs_triton
def test_glu_with_index_writes_the_permuted_output():
    torch.manual_seed(5)
    g, u = torch.randn(2, 3, 80, device=DEV).half(), torch.randn(2, 3, 80, device=DEV).half()
    idx = torch.cat([torch.randperm(80, device=DEV), torch.full((16,), -1, device=DEV)]).int()
    with force_triton():
        got = activation.glu(g, u, "silu", index=idx)
    plain = activation.glu_torch(g, u, "silu")
    assert got.shape == (2, 3, 96)
    torch.testing.assert_close(got[..., :80], plain[..., idx[:80].long()], atol=2e-3, rtol=0)
    assert (got[..., 80:] == 0).all()
    torch.testing.assert_close(activation.glu_torch(g, u, "silu", index=idx), got, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_gather_real_size_gpu():
    """Llama-8B-sized rows, three index vectors: the row's programs run concurrently on the GPU; the new residual
    equals the plain norm's and the old one is only read (repeated)."""
    torch.manual_seed(6)
    d = 4096
    x = torch.randn(2, d, device="cuda").half()
    w = torch.rand(d, device="cuda").half() + 0.5
    res = torch.randn(2, d, device="cuda").half()
    idx = [torch.randperm(d, device="cuda").int() for _ in range(3)]
    for _ in range(3):
        r1, r2 = res.clone(), res.clone()
        out, xp, new = norm.rms_norm_gather(x, w, 1e-5, idx, residual=r1)
        ref_out, _ = norm.rms_norm_torch(x, w, 1e-5, residual=r2)
        torch.testing.assert_close(r1, res, atol=0, rtol=0)
        torch.testing.assert_close(new, r2, atol=0, rtol=0)
        torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=0)
        for g in range(3):
            torch.testing.assert_close(xp[:, g * d:(g + 1) * d], out[:, idx[g].long()], atol=0, rtol=0)


@pytest.mark.parametrize("interleaved,rd", [(False, 32), (True, 32), (False, 16)])
@pytest.mark.parametrize("keep_k", [False, True])
def test_rotary_store_matches_rotary_then_cache_write(interleaved, rd, keep_k):
    """One launch for RoPE and the fp16 cache write (partial rotary: the other features pass through) against
    apply_rotary + index_copy; q is rotated in place, k too with keep_k (a prefill), else left as it was."""
    from exl2.kernels.rotary import apply_rotary_torch, rotary_store

    torch.manual_seed(4)
    t, hq, hk, d, ps = 3, 4, 2, 32, 4
    q, k, v = torch.randn(t, hq, d).half(), torch.randn(t, hk, d).half(), torch.randn(t, hk, d).half()
    cos, sin = (f(torch.randn(50, rd // 2)) for f in (torch.cos, torch.sin))
    pos = torch.tensor([7, 0, 33])
    slots = torch.tensor([5, 2, 9])
    kc, vc = torch.zeros(3, ps, hk, d).half(), torch.zeros(3, ps, hk, d).half()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_torch(q_ref, k_ref, cos, sin, pos, rd, interleaved)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref.view(-1, hk, d)[slots] = k_ref
    vc_ref.view(-1, hk, d)[slots] = v
    k0 = k.clone()
    with force_triton():
        rotary_store(q, k, v, cos, sin, pos, kc, vc, slots, rd, interleaved, keep_k=keep_k)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(kc.float(), kc_ref.float(), atol=2e-3, rtol=0)
    assert torch.equal(vc, vc_ref)
    if keep_k:
        assert torch.equal(k, kc.view(-1, hk, d)[slots])
    else:
        assert torch.equal(k, k0)


@needs_triton
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_pair_matches_two_norms(gemma):
    """q and k heads (different row counts, each with its weight) normed in one launch, as two twin calls."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 8, 64, generator=g).half().to(DEV)
    k = torch.randn(2, 3, 2, 64, generator=g).half().to(DEV)
    wq, wk = (torch.randn(64, generator=g).half().to(DEV) for _ in range(2))
    with force_triton():
        a, b = norm.rms_norm_pair(q, wq, k, wk, 1e-6, gemma=gemma)
    torch.testing.assert_close(a, norm.rms_norm_torch(q, wq, 1e-6, gemma=gemma), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(b, norm.rms_norm_torch(k, wk, 1e-6, gemma=gemma), atol=2e-3, rtol=2e-3)
