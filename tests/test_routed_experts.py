"""The routed expert matmuls (`kernels.routed_gemv`) and the MoE block's routed path (`models.routed_experts`)
against the plain PyTorch twins: each slot's expert picked from device tables, experts of different width
layouts, K splits, zero points and bias; the block's output against the grouped path it replaces for small
batches; CUDA-graph decoding of a quantized MoE model on the GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl2.formats.gptq import pack_gptq
from exl2.kernels.backend import INTERPRET, force_torch, force_triton, triton_usable
from exl2.kernels.exl2_matmul import Exl2Weight
from exl2.kernels.gptq_matmul import GptqWeight
from exl2.kernels.routed_gemv import RoutedWeights, routed_matmul_torch
from exl2.models.registry import spec_from_config
from exl2.models.routed_experts import prepare_routed
from exl2.runtime.benchmark import weight_bytes
from exl2.runtime.synthetic import MIXED_BODY_OPTION, QWEN3_30B_A3B, DictSource, llama_exl2_tensors
from graph_decode import greedy_graph_decode, three_prompts
from test_kernels_quant_matmul import _check_close, rand_exl2

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")

# four EXL2 layouts of a 256-row matrix: every width, 4-bit only, 4/3-bit, 5/4/2-bit (padded input orders differ)
LAYOUTS = [[(8, 32), (6, 16), (6, 16), (5, 32), (4, 64), (4, 8), (4, 24), (3, 32), (2, 32)], [(4, 256)],
           [(4, 128), (3, 128)], [(5, 64), (4, 64), (4, 64), (2, 64)]]
TINY_MOE = dict(QWEN3_30B_A3B, hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=3,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512)


def _experts(n=5, cols=96, bias=True):
    return [Exl2Weight.from_tensors(rand_exl2(LAYOUTS[i % 4], cols, bias=bias, seed=i, device=DEV), "L", device=DEV)
            for i in range(n)]


@needs_triton
@pytest.mark.parametrize("split", [1, 4, None])
def test_routed_gemv_matches_the_twin(split):
    """Slots of three tokens (two a token) over five experts of four layouts, expert 2 picked twice."""
    ws = _experts()
    r = RoutedWeights(ws)
    x = torch.randn(3, 256, dtype=torch.float16, device=DEV)
    sel = torch.tensor([4, 0, 2, 2, 1, 3], dtype=torch.int32, device=DEV)
    ref = routed_matmul_torch(x, sel, ws, row_div=2)
    with force_triton():
        y = r(r.gather(x, sel, 2), sel, split=split)
    if y.dim() == 3:
        y = y.sum(0)
    _check_close(y, ref)
    twin = r(r.gather(x.cpu(), sel.cpu(), 2), sel.cpu()) if DEV == "cpu" else None
    if twin is not None:   # the module's own twin (outside force_triton) is the same reference
        _check_close(twin, ref)


@needs_triton
@pytest.mark.parametrize("shared_input", [True, False])
def test_routed_gemv_copies_and_slot_weights(shared_input):
    """Two copies of int64 choices over a table of ten (copy 1 offset by 5, as gate's experts then up's), and
    each slot's output scaled by its router weight: ten distinct experts read one gathered copy each; five listed
    twice (equal input orders) share one."""
    ws = _experts(5, bias=False) * 2 if shared_input else _experts(10, bias=False)
    r = RoutedWeights(ws)
    x = torch.randn(2, 256, dtype=torch.float16, device=DEV)
    sel = torch.tensor([[3, 1], [0, 3]], device=DEV)
    wt = torch.rand(2, 2, device=DEV)
    flat = sel.reshape(-1).tolist()
    ref = torch.cat([routed_matmul_torch(x, torch.tensor([e + c for e in flat]), ws, row_div=2) for c in (0, 5)])
    ref = ref * wt.reshape(-1).repeat(2).to(ref.device)[:, None]
    with force_triton():
        xp = r.gather(x, sel, 2) if shared_input else r.gather(x, sel, 2, copies=2, e_step=5)
        y = r(xp, sel, split=1, weight=wt, copies=2, e_step=5)
    assert y.shape == (8, 96)
    _check_close(y, ref)


@needs_triton
def test_routed_gemv_gptq_zero_points():
    g = torch.Generator().manual_seed(3)
    ws = []
    for e in range(3):
        t = pack_gptq(torch.randint(0, 16, (128, 64), generator=g), torch.randint(1, 16, (4, 64), generator=g),
                      (torch.rand(4, 64, generator=g) * 0.02).half(), torch.randint(0, 4, (128,), generator=g))
        ws.append(GptqWeight.from_tensors({f"P.{k}": v.to(DEV) for k, v in t.items()}, "P", device=DEV))
    r = RoutedWeights(ws)
    x = torch.randn(4, 128, dtype=torch.float16, device=DEV)
    sel = torch.tensor([2, 0, 1, 2], dtype=torch.int32, device=DEV)
    with force_triton():
        y = r(r.gather(x, sel), sel, split=2).sum(0)
    _check_close(y, routed_matmul_torch(x, sel, ws))


def test_routed_weights_refuse_mismatched_experts():
    a = Exl2Weight.from_tensors(rand_exl2(LAYOUTS[1], 96, seed=0), "L")
    b = Exl2Weight.from_tensors(rand_exl2(LAYOUTS[1], 64, seed=1), "L")
    assert RoutedWeights.problem([a, b]) is not None
    with pytest.raises(ValueError, match="agree on shape"):
        RoutedWeights([a, b])
    assert RoutedWeights.problem([a, a]) is None


def _tiny_moe_model(device, dtype=torch.float16, use_kernels=True):
    from exl2.models.decoder import DecoderModel
    from exl2.runtime.weights import WeightLoader

    src = DictSource(llama_exl2_tensors(TINY_MOE, device="cpu", body=MIXED_BODY_OPTION, seed=4))
    with torch.inference_mode():
        return DecoderModel(spec_from_config(TINY_MOE), WeightLoader(src, device, dtype,
                                                                      use_kernels=use_kernels)).eval()


@needs_triton
@pytest.mark.parametrize("router,shared", [("softmax", True), ("softmax", False), ("sigmoid_input", True)])
def test_moe_block_routed_path_matches_the_grouped_path(router, shared):
    """The block's output through the routed kernels against the grouped path on the PyTorch twins (one matmul
    an active expert); gate and up with their own copies of one input order (no shared gather); Llama 4's rule
    (the experts read w·x, one expert a token)."""
    model = _tiny_moe_model(DEV)
    moe = model.layers[0].mlp
    if not shared:
        for e in moe.experts:
            e.up_proj.kernel.x_index = e.up_proj.kernel.x_index.clone()
        moe.prepare_routed()
    assert moe.routed is not None and moe.routed.shared_order == shared
    if router != "softmax":
        moe.spec = dataclasses.replace(moe.spec, router=router, top_k=1)
    x = torch.randn(5, TINY_MOE["hidden_size"], dtype=torch.float16, device=DEV) * 4
    with torch.no_grad():
        routed = moe.routed
        moe.routed = None
        ref = moe(x).float()
        moe.routed = routed
        with force_triton():
            assert routed.applies(x)
            got = moe(x).float()
    assert (got - ref).abs().max() <= 5e-3 * ref.abs().max()


def test_moe_routed_tables_follow_kernels_and_loras():
    """Dense experts (no kernels) and experts with LoRA adapters keep the grouped path, and the model decodes
    eagerly; quantized experts without adapters let it be captured."""
    from exl2.runtime.graphs import graph_safe

    dense = _tiny_moe_model("cpu", torch.float32, use_kernels=False)
    assert dense.layers[0].mlp.routed is None and not graph_safe(dense)
    quant = _tiny_moe_model("cpu", torch.float16)
    assert graph_safe(quant)
    lin = quant.layers[1].mlp.experts[3].down_proj
    lin.loras = [object()]
    assert prepare_routed(quant) == 1 and quant.layers[1].mlp.routed is None and not graph_safe(quant)
    lin.loras = []
    assert prepare_routed(quant) == 2 and graph_safe(quant)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_model_decodes_through_cuda_graphs(monkeypatch):
    """A quantized Qwen3-MoE-shaped model (mixed widths) on the GPU: 12 greedy steps at batch 1 through the
    decode graph against the CPU twin of the same files (logits within 3 % of their span, argmax equal for 10+),
    and batch 3 through the batch-4 graph against eager decoding on the grouped path."""
    from exl2.models import routed_experts
    from exl2.runtime.graphs import DecodeGraphs, graph_safe
    from exl2.runtime.paged_cache import PagedKVCache

    gpu = _tiny_moe_model("cuda")
    cpu = _tiny_moe_model("cpu", torch.float32, use_kernels=False)
    assert graph_safe(gpu)
    cache = PagedKVCache(gpu.spec, num_pages=13, page_size=64, device="cuda", dtype=torch.float16)
    graphs = DecodeGraphs(gpu, cache, max_pages_per_seq=4, scratch_page=12)
    graphs.capture((1, 4))
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device="cuda")
    got, toks = greedy_graph_decode(gpu, cache, graphs, ids, 12, table)
    with torch.no_grad():
        ref = cpu(torch.cat([ids, toks], 1))[0, 39:]
    span = (ref.max() - ref.min()).item()
    assert (got - ref).abs().max().item() <= 0.03 * span
    assert (got.argmax(-1) == ref.argmax(-1)).sum().item() >= 10

    table, pos, step_ids = three_prompts(gpu, cache, 512)
    a = graphs.step(step_ids, pos, table).float()
    monkeypatch.setattr(routed_experts, "ROUTED_MAX_ROWS", 0)   # eager: the grouped path
    cache.bind(table)
    with torch.inference_mode():
        b = gpu(step_ids, cache, pos, last_only=True)[:, -1].float()
    assert (a - b).abs().max().item() <= 0.02 * (b.max() - b.min()).item()

    # an adapter on an expert takes the block off the routed path: the graphs go and steps run eagerly
    gpu.layers[1].mlp.experts[0].down_proj.loras = [object()]
    prepare_routed(gpu)
    graphs.reset()
    assert not graphs.enabled and not graph_safe(gpu)
    gpu.layers[1].mlp.experts[0].down_proj.loras = []
    prepare_routed(gpu)
    graphs.reset()
    assert graphs.enabled
    torch.testing.assert_close(graphs.step(step_ids, pos, table, lazy=True).float(), a, atol=1e-3, rtol=0)


def test_weight_bytes_count_the_experts_a_token_picks():
    """A decode step of a MoE model reads top_k / num_experts of its routed experts (the bench's bound)."""
    src = DictSource(llama_exl2_tensors(TINY_MOE, device="cpu", body=MIXED_BODY_OPTION, seed=4))
    spec = spec_from_config(TINY_MOE)
    experts = sum(t.numel() * t.element_size() for k, t in src.items() if ".experts." in k)
    assert weight_bytes(src) - weight_bytes(src, spec) == pytest.approx(experts * (1 - 3 / 8), abs=2)


@needs_triton
@pytest.mark.parametrize("k,norm,bias,n,e", [(3, True, False, 5, 40), (8, False, True, 5, 40), (1, True, False, 5, 40),
                                             (8, True, True, 40, 128)])
def test_fused_softmax_router_matches_the_reference(k, norm, bias, n, e):
    """The two-launch softmax router: the same experts as softmax + top-k (as sets: the order is free) and their
    weights within fp32 rounding, renormalised or not (one expert a program for few tokens; 16, the row in two
    steps, for 40 tokens over 128 experts)."""
    from exl2.kernels.router import softmax_topk_route

    g = torch.Generator().manual_seed(k)
    x = torch.randn(n, 300, generator=g).half().to(DEV)
    w = (torch.randn(e, 300, generator=g) * 0.1).half().to(DEV)
    b = torch.randn(e, generator=g).to(DEV) if bias else None
    probs = torch.softmax(torch.nn.functional.linear(x.float(), w.float(), b), -1)
    ref_w, ref_i = torch.topk(probs, k)
    if norm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    with force_triton():
        idx, wts = softmax_topk_route(x, w, b, k, norm)
    order = idx.argsort(-1)
    assert torch.equal(idx.gather(1, order), ref_i.gather(1, ref_i.argsort(-1)))
    torch.testing.assert_close(wts.gather(1, order), ref_w.gather(1, ref_i.argsort(-1)), atol=1e-5, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("act", ["silu", "gptoss"])
def test_routed_glu_writes_each_slots_down_order(act):
    """The gated activation of gate rows 0..S-1 and up rows S..2S-1 (wider than K: padded outputs) written in
    each slot's expert's input order, orders of different lengths padded with zeros, as glu then gather."""
    from exl2.kernels.activation import glu_torch

    ws = _experts(5, bias=False)
    r = RoutedWeights(ws)
    sel = torch.tensor([3, 0, 4, 3], device=DEV)
    gu = (torch.randn(8, 288, generator=torch.Generator().manual_seed(1)) * 4).half().to(DEV)
    with force_triton():
        got = r.glu_gather(gu, sel, act)
    with force_torch():
        ref = r.gather(glu_torch(gu[:4, :256], gu[4:, :256], act), sel)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


@needs_triton
@pytest.mark.parametrize("bias,weighted", [(False, True), (True, False)])
def test_routed_dense_matches_the_twin(bias, weighted):
    """Dense experts stacked (their own tensors now views of the stack), two copies of the choices (gate's
    experts then up's), bias and slot weights, against the per-slot matmul."""
    from exl2.kernels.routed_dense import RoutedDense
    from exl2.runtime.linear import Linear

    g = torch.Generator().manual_seed(2)
    lin = [Linear(300, 40, torch.randn(40, 300, generator=g).half().to(DEV),
                  torch.randn(40, generator=g).half().to(DEV) if bias else None) for _ in range(6)]
    dense = [(m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in lin]
    r = RoutedDense.stack(lin)
    assert lin[4].weight.data_ptr() == r.weight[4].data_ptr()
    assert RoutedDense.stack(lin).weight is r.weight   # stacked again (after a LoRA change): no copy
    assert RoutedDense.stack(lin[:3]).weight is not r.weight
    x = torch.randn(2, 300, generator=g).half().to(DEV)
    sel = torch.tensor([[2, 0], [1, 2]], device=DEV)
    wt = torch.rand(2, 2, generator=g).to(DEV) if weighted else None
    with force_triton():
        y = r(r.gather(x, sel, 2), sel, weight=wt, copies=2, e_step=3)
    for s, e in enumerate([2, 0, 1, 2, 5, 3, 4, 5]):
        w, b = dense[e]
        ref = x[(s % 4) // 2].float() @ w.float().t() + (0 if b is None else b.float())
        if weighted:
            ref = ref * wt.reshape(-1)[s % 4]
        torch.testing.assert_close(y[s].float(), ref, atol=3e-2, rtol=3e-3)


@needs_triton
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_dense_experts_take_the_routed_path_where_the_kernels_run(tmp_path, arch):
    """A model whose experts stay dense (Qwen3-MoE; gpt-oss: biased experts, the clamped SwiGLU) gets stacked
    routed tables where the kernels run, and the block's output matches the grouped path on the twins."""
    from tiny_models import build_tiny

    from exl2.runtime.loader import load_model

    model = load_model(build_tiny(arch, tmp_path), DEV)
    moe = next(layer.mlp for layer in model.layers if getattr(layer.mlp, "experts", None) is not None)
    assert (moe.routed is None) == (DEV == "cpu")   # the CPU twins: no kernels, no stacks
    x = torch.randn(3, model.spec.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEV, model.dtype)
    with torch.no_grad():
        with force_torch():
            moe.routed = None
            ref = moe(x)
        with force_triton():
            assert moe.prepare_routed() and moe.routed.applies(x)
            got = moe(x)
    tol = 1e-4 if model.dtype == torch.float32 else 4e-3     # fp16 on a GPU: the kernels' sums round otherwise
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=10 * tol)


@needs_triton
@pytest.mark.parametrize("split", [1, 3])
def test_slot_sum_adds_each_tokens_slots_and_drops_padding(split):
    """The down gemv's slots (or its K-split partials) summed per token in one launch, padded columns dropped."""
    from exl2.kernels.routed_gemv import sum_slots

    g = torch.Generator().manual_seed(split)
    y = torch.randn(split, 3 * 6, 160, generator=g).to(DEV)
    y = y[0].half() if split == 1 else y
    with force_triton():
        got = sum_slots(y, 6, 150, torch.float16)
    want = (y.float() if split == 1 else y.sum(0)).reshape(3, 6, 160).sum(1)[:, :150]
    assert got.dtype == torch.float16 and got.shape == (3, 150)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
