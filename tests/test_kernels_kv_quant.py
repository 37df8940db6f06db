"""Quantized KV cache: q4/q8 codes equal a literal transcription of spec §4, round-trip error per mode, the
3/2-bit packing layout, and the Triton quantize/dequantize/write kernels equal the twins bit for bit."""
import numpy as np
import pytest
import torch

from exl2.kernels import kv_quant as kq
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0/0 for all-zero blocks, by design


def spec_quantize_block(x: np.ndarray, bits: int):
    """Spec §4, one 64-element block, written lane by lane: returns (codes[64], scales[2])."""
    h = np.float16
    lanes = [[h(x[2 * t]), h(x[2 * t + 1])] for t in range(32)]  # lane t holds elements 2t, 2t+1
    for dist in (1, 2, 4, 8, 16):
        new = []
        for t in range(32):
            self_, partner = lanes[t], lanes[t ^ dist]
            if t & dist:
                new.append([h(partner[i] - self_[i]) for i in range(2)])
            else:
                new.append([h(self_[i] + partner[i]) for i in range(2)])
        lanes = new
    y = [lanes[j][0] if e % 2 == 0 else lanes[j][1] for e in range(64) for j in [e // 2]]
    half = 1 << (bits - 1)
    codes, scales = [], []
    for g in range(2):
        grp = y[32 * g:32 * g + 32]
        amax = max(abs(v) for v in grp)
        scales.append(h(amax * h(1.0 / half)))
        for v in grp:
            with np.errstate(invalid="ignore", divide="ignore"):
                q = h(v / amax)
                t = h(q * h(half) + h(half))
            code = 0 if np.isnan(t) else int(np.clip(np.rint(np.float32(t)), 0, 2 * half - 1))
            codes.append(code)
    return codes, scales


def _unpack_nibbles(packed: torch.Tensor) -> list[int]:
    out = []
    for byte in packed.tolist():
        out += [byte & 15, byte >> 4]
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_match_spec_transcription(bits):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(6, 128, generator=g) * torch.rand(6, 1, generator=g) * 8).half()
    x[1, :64] = 0  # amax = 0: code 0, scale 0
    x[2, 5] = 60000.0  # a wide dynamic range inside one block
    packed, scales = kq.quantize_kv_torch(x, bits)
    for r in range(6):
        codes = _unpack_nibbles(packed[r]) if bits == 4 else packed[r].tolist()
        for b in range(2):
            want_codes, want_scales = spec_quantize_block(x[r, 64 * b:64 * b + 64].numpy(), bits)
            assert codes[64 * b:64 * b + 64] == want_codes, (r, b)
            got_s = scales[r, 2 * b:2 * b + 2].numpy()
            assert np.array_equal(got_s.view(np.uint16), np.array(want_scales, dtype=np.float16).view(np.uint16))


def test_rotation_is_symmetric_hadamard():
    r = kq.rotation_matrix(128).double()
    assert torch.equal(r, r.T) and torch.equal(r @ r, 32 * torch.eye(128, dtype=torch.float64))
    x = torch.randn(3, 128).half()
    torch.testing.assert_close(kq._rotate(x).double(), x.double() @ r, atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("bits,bound", [(8, 0.012), (4, 0.12), (3, 0.25), (2, 0.45)])
def test_roundtrip_error_per_mode(bits, bound):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4, 128, generator=g) * torch.rand(64, 4, 1, generator=g) * 4).half()
    x[..., 7] *= 20  # an outlier channel, as keys have: the rotation spreads it over the block
    p, s = kq.quantize_kv_torch(x, bits)
    assert p.shape == (64, 4, 128 * bits // 8) and p.dtype == torch.uint8 and s.shape == (64, 4, 4)
    back = kq.dequantize_kv_torch(p, s, bits, 128)
    rel = float((back.float() - x.float()).norm() / x.float().norm())
    assert rel < bound, rel
    # each step of precision must help: the next wider mode is clearly better
    if bits < 8:
        wider = {2: 3, 3: 4, 4: 8}[bits]
        p2, s2 = kq.quantize_kv_torch(x, wider)
        rel2 = float((kq.dequantize_kv_torch(p2, s2, wider, 128).float() - x.float()).norm() / x.float().norm())
        assert rel2 < 0.7 * rel


def test_low_bit_packing_layout():
    codes = torch.randint(0, 8, (2, 64), dtype=torch.uint8)
    p3 = kq._pack(codes, 3)
    assert p3.shape == (2, 24)
    for r in range(2):
        for e in range(64):
            g, i = divmod(e, 32)
            lo = (int(p3[r, 12 * g + i // 4]) >> (2 * (i % 4))) & 3
            hi = (int(p3[r, 12 * g + 8 + i // 8]) >> (i % 8)) & 1
            assert lo | hi << 2 == int(codes[r, e])
    c2 = codes & 3
    p2 = kq._pack(c2, 2)
    assert all((int(p2[r, e // 4]) >> (2 * (e % 4))) & 3 == int(c2[r, e]) for r in range(2) for e in range(64))
    assert torch.equal(kq._unpack(p3, 3, 64), codes.int()) and torch.equal(kq._unpack(p2, 2, 64), c2.int())


def test_head_dim_must_be_multiple_of_64():
    with pytest.raises(ValueError, match="divisible by 64"):
        kq.quantize_kv_torch(torch.zeros(2, 96).half(), 4)


@needs_triton
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("d", [64, 192])
def test_triton_quantize_dequantize_equal_twins(bits, d):
    g = torch.Generator().manual_seed(bits + d)
    x = (torch.randn(3, 2, d, generator=g) * 3).half().to(DEV)
    x[0, 1] = 0
    with force_triton():
        p, s = kq.quantize_kv(x, bits)
        back = kq.dequantize_kv(p, s, bits, d)
    p0, s0 = kq.quantize_kv_torch(x, bits)
    assert torch.equal(p, p0) and torch.equal(s.view(torch.int16), s0.view(torch.int16))
    assert torch.equal(back, kq.dequantize_kv_torch(p0, s0, bits, d))  # (±0 may differ in sign)


@needs_triton
def test_write_kv_quant_into_pages():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 128, generator=g).half().to(DEV)
    pages = torch.zeros(4, 8, 2, 64, dtype=torch.uint8, device=DEV)
    scales = torch.zeros(4, 8, 2, 4, dtype=torch.float16, device=DEV)
    slots = torch.tensor([9, 0, 31, 17, 18], device=DEV)
    with force_triton():
        kq.write_kv_quant(x, pages, scales, slots, 4)
    p0, s0 = kq.quantize_kv_torch(x, 4)
    flat, fs = pages.view(-1, 2, 64), scales.view(-1, 2, 4)
    assert torch.equal(flat[slots], p0) and torch.equal(fs[slots], s0)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert int(flat[untouched.to(DEV)].sum()) == 0


@needs_triton
@pytest.mark.parametrize("kb,vb,dk,dv", [(8, 4, 128, 128), (2, 2, 64, 64), (4, 3, 192, 64)])
def test_write_kv_quant_pair_one_launch_equals_twin(kb, vb, dk, dv):
    """Keys and values of different widths (and head dims) quantized into their pages by one launch."""
    g = torch.Generator().manual_seed(kb * 10 + vb)
    k = torch.randn(5, 2, dk, generator=g).half().to(DEV)
    v = torch.randn(5, 2, dv, generator=g).half().to(DEV)
    slots = torch.tensor([9, 0, 31, 17, 18], device=DEV)

    def cache(d, bits):
        return (torch.zeros(4, 8, 2, kq.packed_dim(d, bits), dtype=torch.uint8, device=DEV),
                torch.zeros(4, 8, 2, d // 32, dtype=torch.float16, device=DEV))
    kc, vc = cache(dk, kb), cache(dv, vb)
    with force_triton():
        kq.write_kv_quant_pair(k, v, kc, vc, slots, kb, vb)
    for x, (p, s), bits in ((k, kc, kb), (v, vc, vb)):
        p0, s0 = kq.quantize_kv_torch(x, bits)
        assert torch.equal(p.view(32, 2, -1)[slots], p0) and torch.equal(s.view(32, 2, -1)[slots], s0)
        assert int(p.view(32, -1).sum()) == int(p0.long().sum())  # nothing written elsewhere


@needs_triton
@pytest.mark.parametrize("kb,vb,d,rd,interleaved", [(4, 4, 128, 128, False), (8, 4, 64, 64, True),
                                                     (3, 2, 128, 64, False)])
def test_rope_into_quantized_cache_one_launch_equals_rotary_then_write(kb, vb, d, rd, interleaved):
    """A decode step's RoPE (q in place, keys on their way in; partial rotary passes the rest through) and the
    quantized cache write in one launch against apply_rotary_torch + the quantize twin: the same codes and scales,
    q rotated as the twin rotates it, k itself untouched."""
    from exl2.kernels.rotary import apply_rotary_torch

    g = torch.Generator().manual_seed(kb * 100 + rd)
    t, hq, hk = 3, 8, 2
    q = torch.randn(t, hq, d, generator=g).half().to(DEV)
    k = torch.randn(t, hk, d, generator=g).half().to(DEV)
    v = torch.randn(t, hk, d, generator=g).half().to(DEV)
    ang = torch.rand(40, rd // 2, generator=g) * 6.0
    cos, sin = torch.cos(ang).to(DEV), torch.sin(ang).to(DEV)
    pos = torch.tensor([5, 39, 0], device=DEV)
    slots = torch.tensor([3, 17, 30], device=DEV)

    def cache(bits):
        return (torch.zeros(4, 8, hk, kq.packed_dim(d, bits), dtype=torch.uint8, device=DEV),
                torch.zeros(4, 8, hk, d // 32, dtype=torch.float16, device=DEV))
    kc, vc = cache(kb), cache(vb)
    q_ref, k_ref, k0 = q.clone(), k.clone(), k.clone()
    apply_rotary_torch(q_ref, k_ref, cos, sin, pos, rd, interleaved)
    with force_triton():
        kq.write_kv_quant_pair(k, v, kc, vc, slots, kb, vb, rope=(q, cos, sin, pos, rd, interleaved))
    assert torch.equal(q, q_ref) and torch.equal(k, k0)
    for x, (p, s), bits in ((k_ref, kc, kb), (v, vc, vb)):
        p0, s0 = kq.quantize_kv_torch(x, bits)
        assert torch.equal(p.view(32, hk, -1)[slots], p0) and torch.equal(s.view(32, hk, -1)[slots], s0)
        assert int(p.view(32, -1).sum()) == int(p0.long().sum())  # nothing written elsewhere


@needs_triton
@pytest.mark.parametrize("kb,vb,interleaved", [(4, 4, False), (8, 4, True)])
def test_query_left_in_the_key_basis_gives_the_same_attention(kb, vb, interleaved):
    """The decode write with `hadamard_q` leaves q in the quantized keys' rotated basis, and attention told so
    (`q_rotated`) equals RoPE + the write twin + the reference attention over the same cache (fp16 tolerance)."""
    from exl2.kernels import attention as at
    from exl2.kernels.rotary import apply_rotary_torch

    g = torch.Generator().manual_seed(kb + vb)
    b, hq, hk, d, ps, ctx = 2, 8, 2, 128, 16, 40
    k_old = torch.randn(4 * ps, hk, d, generator=g).half().to(DEV)
    v_old = torch.randn(4 * ps, hk, d, generator=g).half().to(DEV)
    q, k, v = (torch.randn(b, h, d, generator=g).half().to(DEV) for h in (hq, hk, hk))
    ang = torch.rand(64, d // 2, generator=g) * 6.0
    cos, sin = torch.cos(ang).to(DEV), torch.sin(ang).to(DEV)
    pos = torch.tensor([ctx - 1, ctx - 8], device=DEV)
    bt = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32, device=DEV)
    slots = (bt[torch.arange(b), pos // ps].long() * ps + pos % ps).to(DEV)
    lens = (pos + 1).to(torch.int32)

    def caches():
        kc = [t.view(4, ps, hk, -1) for t in kq.quantize_kv_torch(k_old, kb)]
        vc = [t.view(4, ps, hk, -1) for t in kq.quantize_kv_torch(v_old, vb)]
        return kc, vc
    (kc0, vc0), (kc1, vc1) = caches(), caches()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_torch(q_ref, k_ref, cos, sin, pos, d, interleaved)
    kq.write_kv_quant_pair(k_ref, v, kc0, vc0, slots, kb, vb)
    ref = at.paged_attention_torch(q_ref, kc0[0], vc0[0], bt, lens, k_bits=kb, v_bits=vb, k_scales=kc0[1],
                                   v_scales=vc0[1])
    with force_triton():
        rotated = kq.write_kv_quant_pair(k, v, kc1, vc1, slots, kb, vb, rope=(q, cos, sin, pos, d, interleaved),
                                         hadamard_q=True)
        out = at.paged_attention(q, kc1[0], vc1[0], bt, lens, k_bits=kb, v_bits=vb, k_scales=kc1[1],
                                 v_scales=vc1[1], q_rotated=True)
    assert rotated and not torch.allclose(q.float(), q_ref.float(), atol=1e-2)  # q really is in the other basis
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_kv_quant_real_sizes_gpu(bits):
    x = torch.randn(4096, 8, 128, device="cuda").half()
    p, s = kq.quantize_kv(x, bits)
    p0, s0 = kq.quantize_kv_torch(x, bits)
    mism = (p != p0).float().mean().item()
    assert mism < 1e-4 and torch.equal(s, s0), mism  # butterfly sums of two fp16 values: rounding must agree
    back = kq.dequantize_kv(p0, s0, bits, 128)
    ref = kq.dequantize_kv_torch(p0, s0, bits, 128)
    assert float((back.float() - ref.float()).abs().max()) <= 1e-3 * float(ref.float().abs().max())
