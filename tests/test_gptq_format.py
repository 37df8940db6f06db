"""GPTQ checkpoints: files built from known codes dequantize to the dense weight computed directly from the codes."""
from __future__ import annotations

import pytest
import torch

from exl2.errors import ConfigError, FormatError
from exl2.formats.gptq import dequantize_gptq, pack_gptq

PREFIX = "model.layers.0.self_attn.q_proj"


def _dense(codes, zeros, scales, group_of_row):
    """(q − z) · s per element, exact in float64, then one rounding to fp16."""
    z = zeros.double()[group_of_row]
    s = scales.half().double()[group_of_row]
    return ((codes.double() - z) * s).half()


def _build(k, n, gs, bits, fmt, sym, act_order, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // gs)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)
    if sym:
        zeros = torch.full((groups, n), 1 << (bits - 1))
    else:
        lo = 1 if fmt == "gptq" else 0
        zeros = torch.randint(lo, (1 << bits) - 1 + lo + 1, (groups, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen).half() * 0.02
    if act_order:  # rows assigned to groups in a scrambled order, as act-order GPTQ writes them
        g_idx = (torch.randperm(k, generator=gen) // gs).to(torch.int32)
    else:
        g_idx = None
    group_of_row = g_idx.long() if act_order else torch.arange(k) // gs
    tensors = {f"{PREFIX}.{key}": t for key, t in pack_gptq(codes, zeros, scales, g_idx, bits, fmt).items()}
    return tensors, _dense(codes, zeros, scales, group_of_row)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits, gs", [(4, 32), (4, 128), (8, 64), (2, 32)])
def test_dequant_matches_dense(fmt, sym, act_order, bits, gs):
    tensors, ref = _build(256, 64, gs, bits, fmt, sym, act_order)
    assert tensors[f"{PREFIX}.qweight"].shape == (256 * bits // 32, 64)
    assert tensors[f"{PREFIX}.qzeros"].shape == (256 // gs, 64 * bits // 32)
    w = dequantize_gptq(tensors, PREFIX, checkpoint_format=fmt, bits=bits)
    assert w.dtype == torch.float16 and w.shape == (256, 64)
    assert w.view(torch.int16).equal(ref.view(torch.int16))


def test_group_size_is_smallest_power_of_two_covering_k():
    # K = 192 with 2 groups: gs = 128, so rows 0..127 use group 0 and rows 128..191 group 1
    tensors, ref = _build(192, 32, 128, 4, "gptq", False, False, seed=5)
    assert tensors[f"{PREFIX}.scales"].shape[0] == 2
    assert dequantize_gptq(tensors, PREFIX).view(torch.int16).equal(ref.view(torch.int16))


def test_all_zero_g_idx_means_sequential_groups():
    tensors, ref = _build(256, 32, 64, 4, "gptq", True, False, seed=6)
    tensors[f"{PREFIX}.g_idx"] = torch.zeros(256, dtype=torch.int32)
    assert dequantize_gptq(tensors, PREFIX).view(torch.int16).equal(ref.view(torch.int16))


def test_packing_layout_by_hand():
    """qweight: code i of a word at bits 4i along K; qzeros: column n at nibble n mod 8 (v1 stores z − 1)."""
    k, n = 16, 16
    codes = torch.arange(k * n).view(k, n) % 16
    zeros = (torch.arange(n) % 15 + 1).view(1, n)
    out = pack_gptq(codes, zeros, torch.ones(1, n), None, 4, "gptq")
    for row in range(2):
        for col in range(n):
            word = sum(int(codes[8 * row + i, col]) << (4 * i) for i in range(8))
            assert out["qweight"][row, col].item() & 0xFFFFFFFF == word
    for col_word in range(2):
        word = sum((int(zeros[0, 8 * col_word + i]) - 1) << (4 * i) for i in range(8))
        assert out["qzeros"][0, col_word].item() & 0xFFFFFFFF == word
    out8 = pack_gptq(codes * 16 + 3, zeros, torch.ones(1, n), None, 8, "gptq_v2")
    word = sum(int(codes[i, 0] * 16 + 3) << (8 * i) for i in range(4))
    assert out8["qweight"][0, 0].item() & 0xFFFFFFFF == word


@pytest.mark.parametrize("key, bad", [("qzeros", lambda t: t[:, :-1]), ("scales", lambda t: t[:, :-1]),
                                      ("g_idx", lambda t: t[:-1]), ("qzeros", lambda t: t[:-1])])
def test_inconsistent_shapes(key, bad):
    tensors, _ = _build(128, 32, 32, 4, "gptq", False, True)
    tensors[f"{PREFIX}.{key}"] = bad(tensors[f"{PREFIX}.{key}"])
    with pytest.raises(FormatError, match=key) as err:
        dequantize_gptq(tensors, PREFIX)
    assert PREFIX in str(err.value)


def test_g_idx_out_of_range_and_missing_tensor():
    tensors, _ = _build(128, 32, 32, 4, "gptq", False, True)
    tensors[f"{PREFIX}.g_idx"] = tensors[f"{PREFIX}.g_idx"] + 1
    with pytest.raises(FormatError, match="g_idx") as err:
        dequantize_gptq(tensors, PREFIX)
    assert PREFIX in str(err.value)
    del tensors[f"{PREFIX}.scales"]
    with pytest.raises(FormatError, match="scales"):
        dequantize_gptq(tensors, PREFIX)


def test_unsupported_settings():
    tensors, _ = _build(128, 32, 32, 4, "gptq", False, False)
    with pytest.raises(ConfigError):
        dequantize_gptq(tensors, PREFIX, checkpoint_format="awq")
    with pytest.raises(ConfigError):
        dequantize_gptq(tensors, PREFIX, bits=3)
    with pytest.raises(ValueError, match="zero points"):
        pack_gptq(torch.zeros(32, 32, dtype=torch.long), torch.zeros(1, 32, dtype=torch.long), torch.ones(1, 32),
                  None, 4, "gptq")
