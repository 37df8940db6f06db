"""Opt-in FP8 prompt matmuls (`kernels.fp8_prefill`, EngineConfig.prefill_fp8): the e4m3 operand kernels against
their PyTorch twin (bit exact, on the CPU interpreter and the GPU), the twin against the exact matmul (the error
e4m3 is expected to add), the scaled GEMM on the GPU, and the opt-in's plumbing."""
import logging

import pytest
import torch
from safetensors.torch import load_file

from exl2.config import EngineConfig
from exl2.formats.exl2 import group_layout
from exl2.kernels import qweight
from exl2.kernels import quant_matmul as qm
from exl2.kernels.backend import INTERPRET, triton_usable
from exl2.kernels.fp8_prefill import (E4M3_MAX, column_scales, fp8_applies, fp8_available, fp8_input,
                                      fp8_matmul_group, fp8_twin, fp8_weight)
from exl2.runtime.loader import load_model, use_prefill_fp8

from test_exl2_model import GOLDEN

DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(DEV is None or not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")


def on_gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(f))
# groups of every width, some not a multiple of 32 rows (their steps have padding rows)
MIXED = [(8, 32), (6, 48), (5, 32), (4, 64), (4, 24), (3, 32), (2, 48)]


def _weights(groups, widths, zeros=False, bias=False, seed=0, device="cpu"):
    """Weights of the given output widths sharing one act-order permutation (as q/k/v do)."""
    g = torch.Generator().manual_seed(seed)
    k = sum(r for _, r in groups)
    perm = torch.randperm(k, generator=g)
    out = []
    for n in widths:
        codes = torch.cat([torch.randint(0, 1 << b, (r, n), generator=g) for b, r in groups]).to(torch.uint8)
        scales = (torch.rand(len(groups), n, generator=g) * 0.01 + 0.001).half()
        z = (torch.rand(len(groups), n, generator=g) * 15).round().half() if zeros else None
        b = torch.randn(n, generator=g).half() if bias else None
        out.append(qweight.build(codes, groups, scales, z, perm, b).to(device))
        out[-1].bias = b.to(device) if b is not None else None
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_triton
@pytest.mark.parametrize("groups,zeros", [(MIXED, False), ([(4, 128)] * 3, True)], ids=["exl2-mixed", "gptq"])
def test_operands_match_the_twin_bit_for_bit(groups, zeros):
    """The e4m3 input (stored order, padding rows zero, one scale a row) and weight (stored order, transposed, one
    scale a column) kernels write exactly the twin's e4m3 values; the stacked weight holds each member's rows."""
    ws = _weights(groups, (96, 32, 64), zeros=zeros, device=DEV)
    x = (torch.randn(7, ws[0].k, generator=torch.Generator().manual_seed(1)) * 3).half().to(DEV)
    x[2] = 0  # an all-zero row keeps a finite scale
    _, ref = fp8_twin(x, ws)
    xq, xs = fp8_input(x, ws[0])
    wq, cs = fp8_weight(ws)
    assert xq.shape == (7, ws[0].n_steps * 32) and wq.shape == (192, ws[0].n_steps * 32)
    assert torch.equal(xq.view(torch.uint8), ref["xq"].view(torch.uint8))
    assert torch.equal(wq.view(torch.uint8), ref["wq"].view(torch.uint8))
    assert torch.allclose(xs, ref["xs"], rtol=1e-6, atol=0) and torch.equal(cs, ref["cs"])
    assert bool((xq.float()[:, (ws[0].row_index < 0)] == 0).all())  # padding rows read no input
    big = (x.float() * 3000).to(torch.bfloat16)  # past fp16's range: read in its own type
    assert torch.equal(fp8_input(big, ws[0])[0].view(torch.uint8), fp8_twin(big, ws)[1]["xq"].view(torch.uint8))


def test_column_scales_bound_the_weight_and_the_twin_adds_only_e4m3_error():
    """Every |W| fits its column's e4m3 range, and uses its top two binades at least (the scale is the power of
    two over a bound from the group scales that the widest code reaches); the FP8 result is within the error of two e4m3 roundings of the exact one (3.4-3.8 % here), not
    equal to it."""
    for zeros, groups in ((False, MIXED), (True, [(4, 128)] * 2)):
        ws = _weights(groups, (80, 48), zeros=zeros, bias=True)
        for w in ws:
            mag = qweight.stored_weight(w).float().abs()
            cs = column_scales(w)
            assert bool((mag <= cs * E4M3_MAX * (1 + 1e-6)).all())
            assert (mag.amax(0) / (cs * E4M3_MAX)).min().item() > 0.25  # the bound is not loose
            assert bool((torch.frexp(cs)[0] == 0.5).all())  # powers of two
        x = torch.randn(9, ws[0].k, generator=torch.Generator().manual_seed(2)).half()
        got, _ = fp8_twin(x, ws)
        for y, w in zip(got, ws):
            err = _rel(y, qweight.matmul_torch(x, w))
            assert 0.005 < err < 0.06


def test_cpu_and_unsupported_devices_keep_the_exact_path(caplog):
    """On the CPU the opt-in changes nothing: no FP8 there, the large-M matmul stays exact, and loading with it
    says so in one warning line."""
    w = _weights([(4, 64)], (32,))[0]
    w.prefill_fp8 = True
    x = torch.randn(80, w.k).half()
    assert not fp8_available("cpu") and not fp8_applies(x, [w])
    assert torch.equal(qm.quant_matmul(x, w), qweight.matmul_torch(x, w))
    with caplog.at_level(logging.WARNING, logger="exl2.model"):
        model = load_model(GOLDEN / "b4.0_hb6", "cpu", prefill_fp8=True)
    assert "prefill_fp8 needs CUDA GPUs" in caplog.text
    assert not use_prefill_fp8(model)


def test_the_opt_in_is_a_config_field_and_a_flag():
    from exl2.cli.main import build_parser
    from exl2.cli.common import model_settings

    assert not EngineConfig(model_dir="m").prefill_fp8 and EngineConfig(model_dir="m", prefill_fp8=True).prefill_fp8
    args = build_parser().parse_args(["generate", "-m", str(GOLDEN / "b4.0_hb6"), "--prefill-fp8", "-p", "hi"])
    assert model_settings(args)["prefill_fp8"] is True
    assert build_parser().parse_args(["bench", "--prefill-fp8"]).prefill_fp8


@pytest.mark.parametrize("m", [1, 300, 2047])
@pytest.mark.parametrize("groups,widths", [([(4, 128)] * 32, (4096, 1024, 1024)),
                                           (group_layout(4096, [5, 4, 3], [0.1, 0.7, 0.2], [128] * 3), (2048,))],
                         ids=["qkv-4bit", "mixed"])
@on_gpu
def test_scaled_gemm_matches_the_twin_on_the_gpu(m, groups, widths):
    """Real widths on the GPU: the scaled e4m3 GEMM against the twin (same operands, fp32 products; the GEMM's
    accumulation order and output rounding differ: within 0.5 %), and through `prompt_matmul` when opted in."""
    if not fp8_available("cuda"):
        pytest.skip("this GPU has no e4m3 tensor cores")
    ws = _weights(groups, widths, bias=True, device="cuda")
    x = torch.randn(m, ws[0].k, device="cuda").half()
    got = fp8_matmul_group(x, ws)
    ref, _ = fp8_twin(x, ws)
    for y, r, w in zip(got, ref, ws):
        assert y.dtype == torch.float16 and y.shape == (m, w.n)
        assert _rel(y, r) < 5e-3
        assert _rel(y, qweight.matmul_torch(x, w)) < 0.06
    for w in ws:
        w.prefill_fp8 = True
    routed = qm.prompt_matmul(x, ws)
    assert all(torch.equal(a, b) for a, b in zip(routed, got))


@on_gpu
def test_golden_prefill_in_fp8_stays_near_the_exact_one():
    """A 96-token prompt through an exllamav2 file with prompt matmuls in FP8: logits within 2 % of their range of
    the exact GPU prefill on average and 10 % at most, ≥ 75 % of the greedy choices equal (H100, session 25: 1.05 %,
    6.0 %, 80 %; the file is a random tiny model whose logits are nearly flat, so small shifts flip near-ties)."""
    if not fp8_available("cuda"):
        pytest.skip("this GPU has no e4m3 tensor cores")
    ids = load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"][:, :96].cuda()
    exact = load_model(GOLDEN / "b4.0_hb6", "cuda")
    fp8 = load_model(GOLDEN / "b4.0_hb6", "cuda", prefill_fp8=True)
    with torch.inference_mode():
        a, b = exact(ids)[0].float(), fp8(ids)[0].float()
    span = (a.max() - a.min()).item()
    diff = (a - b).abs()
    print(f"fp8 prefill against exact: mean {diff.mean().item() / span:.2%}, max {diff.max().item() / span:.2%} of "
          f"the logits' range, greedy agreement {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.1%}")
    assert 0 < diff.max().item() <= 0.1 * span and diff.mean().item() <= 0.02 * span
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75


@on_gpu
def test_bench_measures_both_prefills_and_leaves_the_model_as_it_was():
    """`exl2 bench --prefill-fp8`: a second prefill row with FP8 matmuls; the model's opt-in is restored."""
    from exl2.runtime.benchmark import run_benchmark
    from exl2.runtime.linear import quant_kernels

    if not fp8_available("cuda"):
        pytest.skip("this GPU has no e4m3 tensor cores")
    model = load_model(GOLDEN / "b4.0_hb6", "cuda")
    rows = run_benchmark(model, 1, ("fp16",), (128,), 256, (2,), iters=2, log=lambda r: None, fp8_prefill=True)
    names = [r.name for r in rows]
    assert names[:2] == ["prefill 256 tokens (fp16 cache)", "prefill 256 tokens, FP8 matmuls (fp16 cache)"]
    assert all(r.tokens_per_s > 0 for r in rows)
    assert not any(w.prefill_fp8 for w in quant_kernels(model))
