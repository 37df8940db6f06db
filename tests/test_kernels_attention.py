"""Paged attention (decode, chunked prefill, GQA, window, soft-cap, quantized caches) and prefill attention:
twins vs PyTorch SDPA with explicit masks, Triton kernels vs twins."""
import pytest
import torch

from exl2.kernels import attention as at
from exl2.kernels import kv_quant as kq
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")


def make_paged(lens, hkv, dk, dv, page, seed=0, device="cpu", spare=3):
    """Random fp16 K/V scattered over shuffled pages; returns (k_cache, v_cache, block_table)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    pages = sum(need) + spare
    order = torch.randperm(pages, generator=g)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = order[i:i + n]
        i += n
    k = torch.randn(pages, page, hkv, dk, generator=g).half()
    v = torch.randn(pages, page, hkv, dv, generator=g).half()
    return k.to(device), v.to(device), bt.to(device)


def sdpa_reference(q, k, v, qpos, scale, window=0):
    """Independent definition: SDPA (math) with an explicit boolean mask, GQA by repeating KV heads."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    kpos = torch.arange(k.shape[0])
    mask = kpos[None, :] <= qpos[:, None]
    if window:
        mask &= kpos[None, :] > qpos[:, None] - window
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), kk.double().transpose(0, 1), vv.double().transpose(0, 1),
        attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def cu(lens):
    return torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("window", [0, 9])
def test_paged_twin_matches_sdpa(window):
    lens, qlens, page = [37, 20], [5, 20], 8
    k, v, bt = make_paged(lens, 2, 64, 64, page)
    q = torch.randn(sum(qlens), 6, 64).half()
    out = at.paged_attention_torch(q, k, v, bt, torch.tensor(lens), cu(qlens), 20, sliding_window=window)
    start = 0
    for b, (n, L) in enumerate(zip(qlens, lens)):
        pages = bt[b, : -(-L // page)].long()
        slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:L]
        kb, vb = k.view(-1, 2, 64)[slots], v.view(-1, 2, 64)[slots]
        ref = sdpa_reference(q[start:start + n], kb, vb, torch.arange(L - n, L), 64 ** -0.5, window)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=2e-3, rtol=0)
        start += n


def test_varlen_twin_matches_sdpa_and_softcap_definition():
    q, k, v = torch.randn(30, 4, 32).half(), torch.randn(30, 2, 32).half(), torch.randn(30, 2, 32).half()
    out = at.varlen_attention(q, k, v, [0, 12, 30])
    for s, e in ((0, 12), (12, 30)):
        ref = sdpa_reference(q[s:e], k[s:e], v[s:e], torch.arange(e - s), 32 ** -0.5)
        torch.testing.assert_close(out[s:e].double(), ref, atol=2e-3, rtol=0)
    capped = at.varlen_attention(q, k, v, None, softcap=2.0)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, 1)) * 32 ** -0.5
    s = (2.0 * torch.tanh(s / 2.0)).masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double().repeat_interleave(2, 1))
    torch.testing.assert_close(capped.double(), ref, atol=2e-3, rtol=0)


def test_write_kv_and_slot_mapping_agree_with_contiguous_attention():
    """Prefill written through write_kv/slot_mapping and attended through the pages = plain causal attention."""
    lens, page = [13, 6], 4
    k_cache = torch.zeros(8, page, 2, 64).half()
    v_cache = torch.zeros(8, page, 2, 64).half()
    bt = torch.tensor([[5, 1, 7, 2], [0, 3, 0, 0]], dtype=torch.int32)
    cu_q = cu(lens)
    slots = at.slot_mapping(bt, torch.tensor(lens), cu_q, page)
    assert slots[:5].tolist() == [20, 21, 22, 23, 4]
    q, k, v = torch.randn(19, 4, 64).half(), torch.randn(19, 2, 64).half(), torch.randn(19, 2, 64).half()
    at.write_kv(k, v, k_cache, v_cache, slots)
    paged = at.paged_attention_torch(q, k_cache, v_cache, bt, torch.tensor(lens), cu_q, 13)
    torch.testing.assert_close(paged, at.varlen_attention_torch(q, k, v, [0, 13, 19]), atol=1e-3, rtol=0)


CASES = [  # lens, q_lens, hq, hkv, dk, dv, page, window, softcap, splits
    ([5, 40], [1, 1], 4, 2, 64, 64, 16, 0, 0.0, None),
    ([5, 40], [1, 1], 4, 2, 64, 64, 16, 0, 0.0, 3),
    ([37, 20], [5, 20], 6, 2, 64, 64, 16, 7, 5.0, None),
    ([37, 20], [5, 20], 6, 2, 96, 64, 8, 0, 0.0, 2),
    ([70], [3], 8, 1, 64, 64, 32, 30, 0.0, 2),
]


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_paged_kernel_matches_twin(case):
    lens, qlens, hq, hkv, dk, dv, page, window, softcap, splits = case
    k, v, bt = make_paged(lens, hkv, dk, dv, page, device=DEV)
    q = torch.randn(sum(qlens), hq, dk).half().to(DEV)
    kw = dict(sliding_window=window, softcap=softcap)
    args = (q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), cu(qlens).to(DEV), max(qlens))
    with force_triton():
        out = at.paged_attention(*args, num_splits=splits, **kw)
    ref = at.paged_attention_torch(*args, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)


@needs_triton
@pytest.mark.parametrize("kb,vb", [(4, 4), (8, 4), (8, 8), (3, 3), (2, 2)])
def test_paged_kernel_quantized_cache_matches_twin(kb, vb):
    lens, qlens = [40, 9], [1, 3]
    k, v, bt = make_paged(lens, 2, 128, 128, 16, seed=kb * 10 + vb, device=DEV)
    kc, ks = kq.quantize_kv_torch(k, kb)
    vc, vs = kq.quantize_kv_torch(v, vb)
    q = torch.randn(4, 4, 128).half().to(DEV)
    args = (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), cu(qlens).to(DEV), 3)
    kw = dict(k_bits=kb, v_bits=vb, k_scales=ks, v_scales=vs)
    with force_triton():
        out = at.paged_attention(*args, num_splits=2, **kw)
    ref = at.paged_attention_torch(*args, **kw)
    # the kernel rotates q instead of un-rotating keys: same math, different fp16 rounding points
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=0)


@needs_triton
def test_varlen_triton_matches_twin_with_window():
    q, k, v = (torch.randn(45, h, 64).half().to(DEV) for h in (4, 2, 2))
    with force_triton():
        out = at.varlen_attention(q, k, v, [0, 30, 45], sliding_window=11, softcap=20.0, backend="triton")
    ref = at.varlen_attention_torch(q, k, v, [0, 30, 45], sliding_window=11, softcap=20.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)


# ---------------------------------------------------------------------------------------------- GPU sizes
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp16", "q8", "q6", "q4", "q3", "q2"])
def test_paged_decode_and_chunked_prefill_real_sizes_gpu(mode):
    kb, vb = kq.KV_MODES[mode]
    lens, qlens = [2048, 700, 3000, 1], [1, 1, 300, 1]
    k, v, bt = make_paged(lens, 8, 128, 128, 256, device="cuda")
    kc, vc, ks, vs = k, v, None, None
    if kb != 16:
        kc, ks = kq.quantize_kv(k, kb)
        vc, vs = kq.quantize_kv(v, vb)
    q = torch.randn(sum(qlens), 32, 128, device="cuda").half()
    args = (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device="cuda"), cu(qlens).cuda(), 300)
    kw = dict(k_bits=kb, v_bits=vb, k_scales=ks, v_scales=vs)
    out = at.paged_attention(*args, **kw)
    ref = at.paged_attention_torch(*args, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=0)
    out_w = at.paged_attention(*args, sliding_window=512, softcap=30.0, **kw)
    ref_w = at.paged_attention_torch(*args, sliding_window=512, softcap=30.0, **kw)
    torch.testing.assert_close(out_w.float(), ref_w.float(), atol=4e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_backends_real_sizes_gpu():
    q, k, v = (torch.randn(2047, h, 128, device="cuda").half() for h in (32, 8, 8))
    ref = at.varlen_attention_torch(q, k, v)
    for backend in ("sdpa", "triton"):
        torch.testing.assert_close(at.varlen_attention(q, k, v, backend=backend).float(), ref.float(),
                                   atol=2e-3, rtol=0)
    ref_w = at.varlen_attention_torch(q, k, v, [0, 1000, 2047], sliding_window=256, softcap=50.0)
    out_w = at.varlen_attention(q, k, v, [0, 1000, 2047], sliding_window=256, softcap=50.0)
    torch.testing.assert_close(out_w.float(), ref_w.float(), atol=2e-3, rtol=0)


@needs_triton
def test_fp16_write_kv_one_launch_matches_index_copy():
    """Keys and values of different widths (MLA-style) into scattered page rows, from strided views."""
    torch.manual_seed(3)
    t, hkv, dk, dv, pages, ps = 5, 2, 24, 16, 3, 4
    qkv = torch.randn(t, hkv * (dk + dv) + 8, device=DEV).half()
    k = qkv[:, :hkv * dk].view(t, hkv, dk)
    v = qkv[:, hkv * dk:hkv * (dk + dv)].view(t, hkv, dv)
    slots = torch.tensor([7, 0, 11, 3, 4], device=DEV)
    kc = torch.zeros(pages, ps, hkv, dk, device=DEV).half()
    vc = torch.zeros(pages, ps, hkv, dv, device=DEV).half()
    kr, vr = kc.clone(), vc.clone()
    with force_triton():
        at.write_kv(k, v, kc, vc, slots)
    kr.view(-1, hkv, dk).index_copy_(0, slots, k)
    vr.view(-1, hkv, dv).index_copy_(0, slots, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@needs_triton
@pytest.mark.parametrize("kb,vb,splits,fused", [(16, 16, 3, True), (16, 16, 1, True), (4, 4, 2, True),
                                                (8, 4, 1, True), (16, 16, 3, False), (4, 4, 2, False)])
def test_paged_kernel_permuted_output_and_merge_paths(kb, vb, splits, fused, monkeypatch):
    """Output written straight into a permuted column order (o_proj's input), with the merge done by the last
    split and values loaded before the first dot (fused), or by the separate merge launch with values loaded
    after the softmax update; against the twin, permuted the same way."""
    monkeypatch.setattr(at, "FUSED_MERGE", fused)
    monkeypatch.setattr(at, "V_EARLY", fused)
    lens, qlens, hq, hkv, d = [40, 9], [1, 2], 4, 2, 128
    k, v, bt = make_paged(lens, hkv, d, d, 16, seed=kb + vb + splits, device=DEV)
    kw = {}
    if kb != 16:
        k, ks = kq.quantize_kv_torch(k, kb)
        v, vs = kq.quantize_kv_torch(v, vb)
        kw = dict(k_bits=kb, v_bits=vb, k_scales=ks, v_scales=vs)
    q = torch.randn(sum(qlens), hq, d).half().to(DEV)
    perm = torch.randperm(hq * d, generator=torch.Generator().manual_seed(1)).int().to(DEV)
    args = (q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), cu(qlens).to(DEV), max(qlens))
    with force_triton():
        out = at.paged_attention(*args, num_splits=splits, out_index=perm, **kw)
        plain = at.paged_attention(*args, num_splits=splits, **kw)
    ref = at.paged_attention_torch(*args, **kw)
    assert out.shape == (sum(qlens), hq * d)
    torch.testing.assert_close(out.float(), at.scatter_columns(ref, perm).float(), atol=4e-3, rtol=0)
    torch.testing.assert_close(plain.float(), ref.float(), atol=4e-3, rtol=0)
    assert torch.equal(at.scatter_columns(plain, perm), out)


@needs_triton
@pytest.mark.parametrize("kb,vb,splits,fused", [(16, 16, 1, True), (16, 16, 3, True), (16, 16, 3, False),
                                                (4, 4, 2, True), (8, 4, 1, True)])
def test_paged_kernel_with_attention_sinks(kb, vb, splits, fused, monkeypatch):
    """gpt-oss's sink logits (one per query head) in the denominator: in one split, in the fused merge and in
    the separate merge launch, over fp16 and quantized caches, decode and chunked prefill with a sliding window;
    against the twin, and the twin against the reference attention's definition (the sink a key with no
    value)."""
    from exl2.models.layers import attention

    monkeypatch.setattr(at, "FUSED_MERGE", fused)
    lens, qlens, hq, hkv, d = [40, 9], [1, 3], 4, 2, 64
    k, v, bt = make_paged(lens, hkv, d, d, 16, seed=kb + vb + splits, device=DEV)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], device=DEV)
    kw = dict(sinks=sinks, sliding_window=24)
    if kb != 16:
        k, ks = kq.quantize_kv_torch(k, kb)
        v, vs = kq.quantize_kv_torch(v, vb)
        kw.update(k_bits=kb, v_bits=vb, k_scales=ks, v_scales=vs)
    q = torch.randn(sum(qlens), hq, d).half().to(DEV)
    args = (q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), cu(qlens).to(DEV), max(qlens))
    with force_triton():
        out = at.paged_attention(*args, num_splits=splits, **kw)
    ref = at.paged_attention_torch(*args, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=0)
    no_sink = at.paged_attention_torch(*args, **{**kw, "sinks": None})
    assert (ref.float() - no_sink.float()).abs().max() > 0.05          # the sinks matter
    if kb == 16:   # sequence 0's decode row by the model's attention with sinks
        ps = k.shape[1]
        slots = (bt[0, :3].long()[:, None] * ps + torch.arange(ps, device=DEV)).reshape(-1)[:40]
        kk, vv = k.reshape(-1, hkv, d)[slots][None], v.reshape(-1, hkv, d)[slots][None]
        want = attention(q[:1][None].float(), kk.float(), vv.float(), torch.tensor([[39]], device=DEV), d ** -0.5,
                         window=24, sinks=sinks)[0]
        torch.testing.assert_close(ref[:1].float(), want.float(), atol=2e-3, rtol=0)
