"""L2 lookahead (runtime.lookahead): which matrices a decode step reads next, the byte ranges each gemv prefetches,
and on the GPU that prefetching leaves every output bit unchanged."""
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from exl2.kernels import qweight
from exl2.runtime.linear import Linear
from exl2.runtime.lookahead import decode_stages, lookahead_table, plan_lookahead

from test_exl2_model import GOLDEN


def _weight(k: int, n: int, bits: int = 4, seed: int = 0) -> qweight.QuantWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (k, n), dtype=torch.uint8, generator=g)
    scales = torch.rand(k // 128, n, generator=g).half() * 0.01 + 0.001
    return qweight.build(codes, [(bits, 128)] * (k // 128), scales, None, torch.randperm(k, generator=g))


def _lines(table: torch.Tensor) -> set[int]:
    return {a // 128 + i for a, n in table.tolist() for i in range(n)}


def _row_lines(w: qweight.QuantWeight, lo: int, hi: int) -> set[int]:
    """The 128-byte lines holding word rows [lo, hi) of w, from the tensor's own storage."""
    rows = w.qweight[lo:hi]
    first, end = rows.data_ptr(), rows.data_ptr() + rows.numel() * rows.element_size()
    return set(range(first // 128, -(-end // 128)))


def test_table_covers_the_first_rows_of_every_k_share():
    ws = [_weight(512, 96, seed=1), _weight(512, 32, bits=3, seed=2)]
    everything = set().union(*(_row_lines(w, 0, w.qweight.shape[0]) for w in ws))
    total = sum(w.qweight.numel() * 4 for w in ws)
    assert _lines(lookahead_table(ws, [1, 4], total)) == everything
    assert _lines(lookahead_table(ws, [3, 2], 10 * total)) == everything
    assert lookahead_table(ws, [1, 1], 0) is None

    quarter = lookahead_table(ws, [2, 4], total // 4)
    got = _lines(quarter)
    for w, split in zip(ws, [2, 4]):
        kw = w.qweight.shape[0]
        for k in range(split):
            lo, hi = kw * k // split, kw * (k + 1) // split
            assert _row_lines(w, lo, lo + (hi - lo + 3) // 4) <= got  # the share's first quarter
            assert not _row_lines(w, lo + (hi - lo) // 2, hi - 1) & got  # nor its second half (but a line the
            # next share's first row may share)
    assert len(got) * 128 <= total // 4 + 128 * 2 * quarter.shape[0]


class _Attn(nn.Module):
    def __init__(self, ws):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(w.k, w.n, kernel=w) for w in ws)


class _Mlp(nn.Module):
    def __init__(self, ws):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (Linear(w.k, w.n, kernel=w) for w in ws)


class _Layer(nn.Module):
    def __init__(self, ws, parallel=False):
        super().__init__()
        self.spec = SimpleNamespace(parallel_block=parallel)
        self.self_attn, self.mlp = _Attn(ws[:4]), _Mlp(ws[4:])


def test_decode_stages_follow_the_step_and_stop_at_unknown_layers():
    ws = [_weight(256, 64, seed=i) for i in range(22)]
    model = nn.Module()
    model.layers = nn.ModuleList([_Layer(ws[:7]), _Layer(ws[7:14], parallel=True), _Layer(ws[14:21])])
    model.lm_head = Linear(256, 64, kernel=ws[21])
    stages = decode_stages(model)
    ids = [None if s is None else [id(w) for w in s] for s in stages]
    by = lambda *i: [id(ws[j]) for j in i]  # noqa: E731
    assert ids == [by(0, 1, 2), by(3), by(4, 5), by(6), None, by(14, 15, 16), by(17), by(18, 19), by(20), by(21)]
    assert plan_lookahead(model, 64) == 0  # CPU weights: nothing to prefetch
    assert all(w.lookahead is None for w in ws)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lookahead_leaves_decoding_bit_identical_gpu():
    """Greedy decode of a golden model, eager and through the decode graph, with every gemv prefetching its
    successor (up to 64 MB) and without: the same logits bit for bit."""
    from exl2.runtime.graphs import DecodeGraphs
    from exl2.runtime.loader import load_model
    from exl2.runtime.paged_cache import PagedKVCache

    ids = load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"][:, :48].cuda()
    model = load_model(GOLDEN / "b4.0_hb6", "cuda")
    cache = PagedKVCache(model.spec, num_pages=3, page_size=64, device="cuda", dtype=torch.float16)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device="cuda")

    def decode() -> torch.Tensor:
        graphs = DecodeGraphs(model, cache, max_pages_per_seq=2, scratch_page=2)
        graphs.capture((1,))  # after planning: a graph keeps the kernels' arguments of its capture
        cache.bind(table)
        out = []
        with torch.inference_mode():
            tok = model(ids, cache, 0, last_only=True)[:, -1].argmax(-1)
            for i in range(6):
                if i % 2:
                    logits = graphs.step(tok.view(1, 1), torch.tensor([48 + i], device="cuda"), table)
                else:
                    logits = model(tok.view(1, 1), cache, 48 + i, last_only=True)[:, -1]
                out.append(logits.float())
                tok = logits.argmax(-1)
        return torch.cat(out)

    layers = model.spec.num_layers
    assert plan_lookahead(model, 64) == 4 * layers  # q/k/v, o, gate/up and down of every layer
    assert model.layers[-1].mlp.down_proj.kernel.lookahead is not None  # the last down prefetches the head
    on = decode()
    assert plan_lookahead(model, 0) == 0
    assert model.layers[0].self_attn.q_proj.kernel.lookahead is None
    off = decode()
    assert torch.equal(on, off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequant_ahead_leaves_prefill_bit_identical_gpu(monkeypatch):
    """A 96-token prefill (the dequantize + cuBLAS path) with each prompt matmul's successor dequantized on the
    side stream during its GEMM, and without: the same logits bit for bit, and every chained matmul but the
    first found its matrix ready."""
    from exl2.kernels import dequant_ahead
    from exl2.runtime.loader import load_model
    from exl2.runtime.lookahead import plan_dequant_ahead

    ids = load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"][:, :96].cuda()
    model = load_model(GOLDEN / "b4.0_hb6", "cuda")
    taken = []
    take = dequant_ahead.take
    monkeypatch.setattr(dequant_ahead, "take", lambda ws: taken.append(take(ws)) or taken[-1])
    layers = model.spec.num_layers
    assert plan_dequant_ahead(model, True) == 4 * layers - 1  # the last down has no successor
    with torch.inference_mode():
        on = model(ids).float()
        assert sum(t is not None for t in taken) == 4 * layers - 1
        assert plan_dequant_ahead(model, False) == 0
        taken.clear()
        off = model(ids).float()
    assert not any(t is not None for t in taken)
    assert torch.equal(on, off)
