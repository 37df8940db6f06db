"""Weights that read one input (q/k/v, gate/up) and have equal input orders share one `x_index` tensor after
load (`share_input_orders`), and every producer and consumer of the permuted-input buffer then holds one copy for
them (`input_layout`): same outputs as separate copies and as the PyTorch twin, at the unique width."""
import pytest
import torch

from exl2.kernels import qweight
from exl2.kernels import quant_matmul as qm
from exl2.kernels import gemv as gemv_k
from exl2.kernels import permute
from exl2.kernels.backend import INTERPRET, force_triton, triton_usable
from exl2.kernels.norm import rms_norm_gather
from exl2.runtime.linear import Linear, permuted_indices, project, share_inputs

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")

K = 256
LAYOUT = [(6, 64), (4, 128), (3, 64)]  # 6- and 4-bit classes: x_index is not plain stored order


def _weight(perm: torch.Tensor, n: int, seed: int, layout=LAYOUT, bias: bool = True) -> qweight.QuantWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.cat([torch.randint(0, 1 << b, (r, n), generator=g) for b, r in layout]).to(torch.uint8)
    scales = (torch.rand(len(layout), n, generator=g) * 0.01 + 0.001).half()
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    dev = DEV or "cpu"
    return qweight.build(codes.to(dev), layout, scales.to(dev), None, perm.to(dev), b)


def _perm(seed: int) -> torch.Tensor:
    return torch.randperm(K, generator=torch.Generator().manual_seed(100 + seed))


def _qkv(perms=(0, 0, 0), ns=(64, 32, 32), layouts=(LAYOUT,) * 3) -> list[qweight.QuantWeight]:
    return [_weight(_perm(p), n, seed=i, layout=lay) for i, (p, n, lay) in enumerate(zip(perms, ns, layouts))]


def _separate(ws: list[qweight.QuantWeight]) -> list[qweight.QuantWeight]:
    """The same weights, each with its own x_index tensor (the layout before aliasing)."""
    return [qweight.QuantWeight(w.qweight, w.scales, w.zeros, w.step_group, w.row_index, w.classes, w.k, w.n,
                                w.bias, w.out_features, x_index=w.x_index.clone()) for w in ws]


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    y, ref = y.float(), ref.float()
    assert y.shape == ref.shape
    assert (y - ref).abs().max() <= 2e-3 * ref.abs().max() + 1e-3


# ------------------------------------------------------------------------------------------ (a) aliasing
def test_equal_input_orders_are_aliased_and_others_are_not():
    ws = _qkv()
    assert len({id(w.x_index) for w in ws}) == 3
    assert permute.share_input_orders(ws) == 2
    assert ws[1].x_index is ws[0].x_index and ws[2].x_index is ws[0].x_index
    assert permute.share_input_orders(ws) == 0  # idempotent
    unique, offsets, total = permute.input_layout(ws)
    assert len(unique) == 1 and offsets == [0, 0, 0] and total == ws[0].x_index.numel()

    other = _qkv(perms=(0, 1, 2))
    assert permute.share_input_orders(other) == 0
    assert len({id(w.x_index) for w in other}) == 3
    assert permute.input_layout(other)[1] == [0, K, 2 * K]

    # the same permutation with another width-class layout gives another input order: no aliasing
    layouts = (LAYOUT, LAYOUT, [(4, 128), (4, 128)])
    ws = _qkv(layouts=layouts)
    assert not torch.equal(ws[0].x_index, ws[2].x_index)
    assert permute.share_input_orders(ws) == 1
    assert ws[1].x_index is ws[0].x_index and ws[2].x_index is not ws[0].x_index
    assert permute.input_layout(ws)[1:] == ([0, 0, K], 2 * K)
    assert permuted_indices([Linear(w.k, w.n, kernel=w) for w in ws]) == [ws[0].x_index, ws[2].x_index]


def test_aliasing_keeps_the_weights_caches_consistent():
    """Launch plans hold offsets into the buffer, so aliasing drops them; the scatter index (from the values,
    which are equal) stays valid."""
    ws = _qkv()
    ws[0]._cache[("group", tuple(map(id, ws)))] = "stale plan"
    inv = ws[1].scatter_index()
    permute.share_input_orders(ws)
    assert not any(isinstance(k, tuple) for w in ws for k in w._cache)
    assert torch.equal(ws[1].scatter_index(), inv)


def test_the_model_load_aliases_q_k_v_and_gate_up_of_the_synthetic_model(monkeypatch):
    """The synthetic bench model shares one act-order permutation within q/k/v and gate/up like exllamav2's files,
    so the decoder's construction aliases them (not across the groups, nor with EXL2_SHARED_INPUT=0)."""
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import spec_from_config
    from exl2.runtime.synthetic import LLAMA3_8B, DictSource, llama_exl2_tensors
    from exl2.runtime.weights import WeightLoader

    cfg = dict(LLAMA3_8B, num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300)
    tensors = DictSource(llama_exl2_tensors(cfg))
    for p in ("model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"):
        assert torch.equal(tensors[f"{p}.q_invperm"], tensors["model.layers.1.self_attn.q_proj.q_invperm"])
    assert torch.equal(tensors["model.layers.0.mlp.up_proj.q_invperm"],
                       tensors["model.layers.0.mlp.gate_proj.q_invperm"])
    assert not torch.equal(tensors["model.layers.0.mlp.gate_proj.q_invperm"],
                           tensors["model.layers.0.self_attn.q_proj.q_invperm"])

    def build():
        return DecoderModel(spec_from_config(cfg), WeightLoader(tensors, "cpu", torch.float16, use_kernels=True))

    model = build()
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        assert a.k_proj.kernel.x_index is a.q_proj.kernel.x_index is a.v_proj.kernel.x_index
        assert m.up_proj.kernel.x_index is m.gate_proj.kernel.x_index
        assert m.gate_proj.kernel.x_index is not a.q_proj.kernel.x_index
        assert len(a.permuted_indices()) == 1 and len(m.permuted_indices()) == 1
    monkeypatch.setattr(qm, "SHARED_INPUT", False)
    a = build().layers[0].self_attn
    assert len({id(lin.kernel.x_index) for lin in a.shared_input_linears()}) == 3
    assert len(a.permuted_indices()) == 3
    assert share_inputs(build()) == 0  # the switch also gates later calls


# ------------------------------------------------------------------------------------------ (b) outputs
@needs_triton
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("alias", ["all", "partial"])
def test_grouped_outputs_with_aliased_orders_equal_separate_copies_and_the_twin(m, alias):
    """M = 1: one gather + one grouped gemv launch; M = 8: one gather, the tensor-core kernel per weight (what
    runs here). Aliased = separate copies bit for bit, and both = the twin."""
    ws = _qkv(perms=(0, 0, 0) if alias == "all" else (0, 0, 1))
    permute.share_input_orders(ws)
    apart = _separate(ws)
    width = permute.input_layout(ws)[2]
    assert width == (1 if alias == "all" else 2) * K and permute.input_layout(apart)[2] == 3 * K
    x = torch.randn(m, K, device=DEV).half()
    refs = [qweight.matmul_torch(x, w) for w in ws]
    lin_s, lin_a = [Linear(w.k, w.n, kernel=w) for w in ws], [Linear(w.k, w.n, kernel=w) for w in apart]
    with force_triton():
        assert permute.gather_input(x, ws, whole=True).shape == (m, width)
        shared, separate = project(x, lin_s), project(x, lin_a)
        if m == 1:
            grouped = qm.grouped_matmul(x, ws)
            assert grouped is not None
            for y, y2 in zip(grouped, shared):
                assert torch.equal(y, y2)
    for y, y2, ref in zip(shared, separate, refs):
        assert torch.equal(y, y2)
        _close(y, ref)
    for y, ref in zip(project(x, lin_s), refs):  # the CPU twin path with aliased orders
        _close(y, ref)


@needs_triton
@pytest.mark.parametrize("m", [1, 8])
def test_norm_writes_one_copy_per_distinct_order(m):
    """`rms_norm_gather` fed `permuted_indices` writes the unique width, and the projections reading that buffer
    give what separate copies give (kernel and twin)."""
    ws = _qkv(perms=(0, 0, 1))
    permute.share_input_orders(ws)
    apart = _separate(ws)
    lin_s, lin_a = [Linear(w.k, w.n, kernel=w) for w in ws], [Linear(w.k, w.n, kernel=w) for w in apart]
    idx_s, idx_a = permuted_indices(lin_s), permuted_indices(lin_a)
    assert [i.numel() for i in idx_s] == [K, K] and len(idx_a) == 3
    x = torch.randn(1, m, K, device=DEV).half()
    w = (torch.rand(K, device=DEV) + 0.5).half()
    res_s = torch.randn_like(x)
    res_a = res_s.clone()
    with force_triton():
        h, xp, _ = rms_norm_gather(x, w, 1e-5, idx_s, residual=res_s)
        h2, xp2, _ = rms_norm_gather(x, w, 1e-5, idx_a, residual=res_a)
        assert xp.shape == (m, 2 * K) and xp2.shape == (m, 3 * K)
        assert torch.equal(h, h2) and torch.equal(xp, torch.cat([xp2[:, :K], xp2[:, 2 * K:]], dim=1))
        from_buf = project(h, lin_s, xp)
        from_sep = project(h2, lin_a, xp2)
    _, twin_xp = rms_norm_gather(x, w, 1e-5, idx_s)  # the twin (outside force_triton): the same width
    assert twin_xp.shape == (m, 2 * K)
    for y, y2, lin in zip(from_buf, from_sep, lin_s):
        assert torch.equal(y, y2)
        _close(y, qweight.matmul_torch(h.reshape(m, K), lin.kernel).view(1, m, -1))


# ------------------------------------------------------------------------------------------ (c) offsets
@needs_triton
def test_consumers_read_each_weights_copy_at_its_layout_offset():
    """q and k share an order, v has its own: the buffer is [q's copy | v's copy], 2·K wide. Cumulative offsets
    (0, K, 2K) would hand k v's copy and v a copy past the end; every consumer must read (0, 0, K)."""
    ws = _qkv(perms=(0, 0, 1))
    permute.share_input_orders(ws)
    x = torch.randn(2, K, device=DEV).half()
    refs = [qweight.matmul_torch(x, w) for w in ws]
    with force_triton():
        buf = permute.gather_input(x, ws, whole=True)
        views = permute.split_permuted(buf, ws)
        per_weight = permute.gather_input(x, ws)
        outs = gemv_k.GemvGroup(ws)(buf, fast4=False)
        with pytest.raises(ValueError):  # a buffer in the old layout (one copy per weight) is refused
            gemv_k.GemvGroup(ws)(torch.cat([qweight.gather_torch(x, w) for w in ws], dim=1), fast4=False)
    assert buf.shape == (2, 2 * K)
    for i, w in enumerate(ws):
        assert torch.equal(views[i], qweight.gather_torch(x, w))
        assert torch.equal(per_weight[i], qweight.gather_torch(x, w))
        _close(outs[i], refs[i])
    assert views[1].data_ptr() == views[0].data_ptr()
    with pytest.raises(ValueError):
        permute.split_permuted(torch.cat([buf, buf[:, :K]], dim=1), ws)

