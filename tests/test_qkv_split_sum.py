"""The q/k/v gemv's K-split partial sums left to a decode step's RoPE + cache-write launch (EXL2_QKV_SPLIT_SUM):
the fp16 (`rotary_store`) and quantized (`write_kv_quant_pair`) writes fed the partials equal the ones fed their
sum, and a decoder decoding through them over a paged cache gives the logits of one that does not."""
import pytest
import torch

from exl2.formats.safetensors_io import TensorSource
from exl2.kernels import gemv as gemv_k
from exl2.kernels import kv_quant as kq
from exl2.kernels import quant_matmul as qm
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.kernels.rotary import rotary_store
from exl2.kernels.split_sum import SplitSum
from exl2.runtime.weights import WeightLoader

from test_exl2_model import GOLDEN

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")

T, HQ, HK, D, S = 2, 4, 2, 64, 3


def _parts(g: torch.Generator, heads: int, d: int = D) -> SplitSum:
    return SplitSum((torch.randn(S, T, heads * d, generator=g) * 0.7).to(DEV), (T,))


def _summed(x: SplitSum, d: int = D) -> torch.Tensor:
    """What the gemv's own tail would have stored: the fp32 sum rounded to fp16, as [T, H, D]."""
    return x.total(torch.float16).view(T, -1, d)


def _tables(g: torch.Generator, rd: int):
    ang = torch.rand(16, rd // 2, generator=g) * 6.0
    return torch.cos(ang).to(DEV), torch.sin(ang).to(DEV), torch.tensor([3, 11], device=DEV)


@needs_triton
@pytest.mark.parametrize("rd,interleaved", [(D, False), (32, True)])
def test_rotary_store_adds_the_partials(rd, interleaved):
    g = torch.Generator().manual_seed(rd)
    q, k, v = _parts(g, HQ), _parts(g, HK), _parts(g, HK)
    cos, sin, pos = _tables(g, rd)
    slots = torch.tensor([5, 9], device=DEV)

    def caches():
        return (torch.zeros(2, 8, HK, D, dtype=torch.float16, device=DEV),
                torch.zeros(2, 8, HK, D, dtype=torch.float16, device=DEV))
    (kc0, vc0), (kc1, vc1) = caches(), caches()
    with force_triton():
        q_ref = _summed(q)
        assert rotary_store(q_ref, _summed(k), _summed(v), cos, sin, pos, kc0, vc0, slots, rd, interleaved) is q_ref
        q_out = rotary_store(q, k, v, cos, sin, pos, kc1, vc1, slots, rd, interleaved)
    assert q_out.shape == (T, HQ, D) and q_out.dtype == torch.float16
    # sequential fp32 sums against the tail's: the same value before the fp16 rounding but for the last bit
    for got, ref in ((q_out, q_ref), (kc1, kc0), (vc1, vc0)):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    assert int((kc1 != 0).sum()) == int((kc0 != 0).sum())  # nothing written elsewhere


@needs_triton
@pytest.mark.parametrize("kb,vb,hadamard,rd", [(4, 4, True, 128), (8, 4, False, 128), (4, 8, False, 64)])
def test_quantized_write_adds_the_partials(kb, vb, hadamard, rd):
    g = torch.Generator().manual_seed(kb + vb)
    q, k, v = _parts(g, HQ, 128), _parts(g, HK, 128), _parts(g, HK, 128)
    cos, sin, pos = _tables(g, rd)
    slots = torch.tensor([5, 9], device=DEV)

    def cache(bits):
        return (torch.zeros(2, 8, HK, kq.packed_dim(128, bits), dtype=torch.uint8, device=DEV),
                torch.zeros(2, 8, HK, 128 // 32, dtype=torch.float16, device=DEV))
    kc0, vc0, kc1, vc1 = cache(kb), cache(vb), cache(kb), cache(vb)
    q_sum = _summed(q, 128)
    with force_triton():
        q_ref, rot_ref = kq.write_kv_quant_pair(_summed(k, 128), _summed(v, 128), kc0, vc0, slots, kb, vb,
                                                rope=(q_sum, cos, sin, pos, rd, False), hadamard_q=hadamard)
        q_out, rot = kq.write_kv_quant_pair(k, v, kc1, vc1, slots, kb, vb, rope=(q, cos, sin, pos, rd, False),
                                            hadamard_q=hadamard)
    assert q_ref is q_sum and rot == rot_ref == hadamard
    torch.testing.assert_close(q_out.view(T, HQ, 128), q_ref, atol=2e-3, rtol=1e-3)
    for (p1, s1), (p0, s0) in ((kc1, kc0), (vc1, vc0)):
        torch.testing.assert_close(s1, s0, atol=1e-3, rtol=1e-3)
        # a code may round the other way where the partials' last bit differs: a handful at most
        assert (p1 != p0).float().mean().item() < 0.02


@pytest.mark.skipif(not INTERPRET or not triton_usable(), reason="runs the kernels on CPU tensors (interpreter)")
@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_decode_through_qkv_partials_keeps_the_logits(mode, monkeypatch):
    """A golden model's decode steps over a paged cache with q/k/v split in two and their partials added by the
    cache write (counted) against the same steps with the gemv's own sum."""
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import read_config, spec_from_config
    from exl2.runtime.paged_cache import PagedKVCache

    d = GOLDEN / "b3.0_hb6"
    spec = spec_from_config(read_config(d))
    model = DecoderModel(spec, WeightLoader(TensorSource(d), "cpu", torch.float16, use_kernels=True)).eval()
    monkeypatch.setattr(gemv_k, "auto_split", lambda w, programs, device, min_steps, per_sm=2: 2)
    monkeypatch.setattr(qm, "gemv_via_mma", lambda w, m, dtype: False)
    seen = []
    real = gemv_k.GemvGroup.__call__

    def counting(self, xp, fast4=None, part_only=False):
        outs = real(self, xp, fast4, part_only)
        seen.append(isinstance(outs[0], SplitSum))
        return outs
    monkeypatch.setattr(gemv_k.GemvGroup, "__call__", counting)
    ids = torch.tensor([[1, 45, 74, 9, 33]])
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(qm, "QKV_SPLIT_SUM", on)
        cache = PagedKVCache(spec, num_pages=2, page_size=16, mode=mode, device="cpu", dtype=torch.float16)
        cache.bind(torch.tensor([[1, 0]], dtype=torch.int32))
        seen.clear()
        with torch.no_grad(), force_triton():
            model(ids[:, :3], cache, 0)
            logits[on] = torch.cat([model(ids[:, i:i + 1], cache, i) for i in (3, 4)], 1)
        assert any(seen) == on  # the decode steps' q/k/v gemvs, and only with the switch
    ref = logits[False]
    assert (logits[True] - ref).abs().max() <= 1e-2 * ref.abs().max()
