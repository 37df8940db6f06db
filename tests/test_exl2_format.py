"""EXL2 tensor format: bit exactness against exllamav2 golden files, pack/unpack round trips, malformed input."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from exl2.errors import FormatError
from exl2.formats import exl2 as fmt
from exl2.formats.exl2 import (Exl2Group, bit_mix, dequantize, dequantize_stored, group_layout, layer_bpw,
                               layer_storage_bits, pack, parse_groups, unpack_codes, unpack_scale_codes,
                               unpack_scales)

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
FOLDERS = ["b3.0_hb6", "b4.0_hb6", "b6.0_hb6"]
SHAPES = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
          "gate_proj": (256, 768), "up_proj": (256, 768), "down_proj": (768, 256)}


@pytest.fixture(scope="module", params=FOLDERS)
def golden(request):
    folder = GOLDEN / request.param
    tensors = load_file(folder / "output.safetensors")
    hashes = json.loads((folder / "reference_dequant_sha256.json").read_text())
    return tensors, hashes


def _layout(tensors, prefix):
    groups = parse_groups(tensors[f"{prefix}.q_groups"], tensors[f"{prefix}.q_weight"].shape[0], prefix)
    return [(g.bits, g.rows) for g in groups]


# ---------------------------------------------------------------- golden files (exllamav2 0.3.2 output)

def test_golden_dequant_is_bit_exact(golden):
    tensors, hashes = golden
    assert len(hashes) == 29
    for prefix, ref in hashes.items():
        w = dequantize(tensors, prefix).contiguous()
        assert list(w.shape) == ref["shape"] and w.dtype == torch.float16
        assert hashlib.sha256(w.numpy().tobytes()).hexdigest() == ref["sha256"], prefix


def test_golden_stored_order_is_permuted_natural_order(golden):
    tensors, hashes = golden
    prefix = "model.layers.1.mlp.down_proj"
    inv = tensors[f"{prefix}.q_invperm"].long()
    assert torch.equal(dequantize_stored(tensors, prefix)[inv], dequantize(tensors, prefix))


def test_golden_repack_is_byte_identical(golden):
    tensors, hashes = golden
    for prefix in hashes:
        q_weight = tensors[f"{prefix}.q_weight"]
        groups = parse_groups(tensors[f"{prefix}.q_groups"], q_weight.shape[0], prefix)
        packed = pack(unpack_codes(q_weight, groups), [(g.bits, g.rows) for g in groups],
                      unpack_scale_codes(tensors[f"{prefix}.q_scale"], q_weight.shape[1]),
                      tensors[f"{prefix}.q_scale_max"], torch.argsort(tensors[f"{prefix}.q_invperm"].long()))
        on_disk = {k[len(prefix) + 1:] for k in tensors if k.startswith(prefix + ".")}
        assert set(packed) == on_disk
        for key, t in packed.items():
            ref = tensors[f"{prefix}.{key}"]
            assert t.dtype == ref.dtype and t.shape == ref.shape, (prefix, key)
            assert t.numpy().tobytes() == ref.numpy().tobytes(), (prefix, key)


def test_golden_layouts_follow_converter_rule(golden):
    """Every golden layer's groups equal group_layout() of one of the options measured for its projection."""
    tensors, hashes = golden
    measurement = json.loads((GOLDEN / "measurement.json").read_text())["measurement"]
    for prefix in hashes:
        layout = _layout(tensors, prefix)
        if prefix == "lm_head":  # -hb 6: 15 % 8-bit / 85 % 6-bit, group 128
            assert layout == group_layout(256, [8, 6], [0.15, 0.85], {8: 128, 6: 128})
            continue
        block, proj = prefix.rsplit(".", 1)
        candidates = [group_layout(SHAPES[proj][0], o[proj]["bits"], o[proj]["bits_prop"],
                                   {int(b): g for b, g in o[proj]["group_size"].items()})
                      for o in measurement[block]]
        assert layout in candidates, prefix
        assert sum(bit_mix(tensors, prefix).values()) == SHAPES[proj][0]


def test_golden_folders_cover_every_width():
    widths = set()
    for folder in FOLDERS:
        tensors = load_file(GOLDEN / folder / "output.safetensors")
        for key in tensors:
            if key.endswith(".q_groups"):
                widths |= set(tensors[key][0::2].tolist())
    assert widths == {2, 3, 4, 5, 6, 8}


def test_golden_bpw_equals_tensor_bytes(golden):
    tensors, hashes = golden
    for prefix in hashes:
        k, n = hashes[prefix]["shape"]
        nbytes = sum(t.numel() * t.element_size() for key, t in tensors.items() if key.startswith(prefix + ".q_"))
        assert layer_storage_bits(k, n, _layout(tensors, prefix)) == nbytes * 8
        assert layer_bpw(tensors, prefix) == pytest.approx(nbytes * 8 / (k * n), rel=1e-12)


def test_measurement_total_bits_match_storage_formula():
    """measurement.json's total_bits (computed by exllamav2's qparams) = Σ layer_storage_bits over projections."""
    measurement = json.loads((GOLDEN / "measurement.json").read_text())["measurement"]
    count = 0
    for options in measurement.values():
        for option in options or []:
            total = 0
            for proj, qp in option.items():
                if proj in SHAPES:
                    k, n = SHAPES[proj]
                    # group_size keys are strings in the JSON, as group_layout accepts
                    total += layer_storage_bits(k, n, group_layout(k, qp["bits"], qp["bits_prop"], qp["group_size"]))
            assert total == option["total_bits"]
            count += 1
    assert count == 144


# ---------------------------------------------------------------- converter rules (spec §1.10, §2.4, §3.4)

def _counts(layout):
    counts = {}
    for b, _ in layout:
        counts[b] = counts.get(b, 0) + 1
    return list(counts.values())


@pytest.mark.parametrize("k, expected", [(4096, [4, 60]), (11008, [9, 163]), (14336, [12, 212])])
def test_group_layout_3b2b(k, expected):
    layout = group_layout(k, [3, 2], [0.05, 0.95], {3: 64, 2: 64})
    assert _counts(layout) == expected and sum(r for _, r in layout) == k


@pytest.mark.parametrize("k, expected", [(4096, [7, 4, 27]), (11008, [18, 9, 73]), (14336, [23, 12, 95])])
def test_group_layout_three_widths_last_group_truncated(k, expected):
    layout = group_layout(k, [8, 4, 3], [0.05, 0.1, 0.85], [32, 128, 128])
    assert _counts(layout) == expected and sum(r for _, r in layout) == k
    assert all(r == {8: 32, 4: 128, 3: 128}[b] for b, r in layout[:-1])
    assert layout[-1][1] == k - sum(r for _, r in layout[:-1]) <= 128


def test_storage_bits_examples():
    assert layer_storage_bits(4096, 4096, group_layout(4096, [4], [1], {4: 128})) == 67_765_760
    heads = {2: ([4, 2], [0.3, 0.7], 32, 2.735, 2.727), 3: ([4, 3], [0.15, 0.85], 32, 3.282, 3.278),
             4: ([6, 4], [0.15, 0.85], 32, 4.439, 4.430), 5: ([6, 5], [0.15, 0.85], 128, 5.189, 5.188),
             6: ([8, 6], [0.15, 0.85], 128, 6.345, 6.344), 8: ([8], [1.0], 128, 8.032, 8.032)}
    for bits, props, gs, bpw_small, bpw_big in heads.values():
        for (k, n), bpw in (((4096, 32000), bpw_small), ((8192, 128256), bpw_big)):
            total = layer_storage_bits(k, n, group_layout(k, bits, props, {b: gs for b in bits}))
            assert round(total / (k * n), 3) == bpw


# ---------------------------------------------------------------- independent per-element reference

def _ref_decode(packed: dict, n_cols: int):
    """Plain-Python reader written from spec §1.3–§1.6 (unsigned words, per-element loops)."""
    words = packed["q_weight"].numpy().view(np.uint32)
    qg = packed["q_groups"].tolist()
    q_rows = words.shape[0]
    scale_words = packed["q_scale"].numpy().view(np.uint32)
    smax = packed["q_scale_max"].numpy()
    codes, levels, row = [], [], 0
    for g in range(len(qg) // 2):
        bits, base = qg[2 * g], qg[2 * g + 1]
        end = qg[2 * g + 3] if 2 * g + 3 < len(qg) else q_rows
        m = np.float16(np.float32(smax[g]) / np.float32(256))
        for r in range((end - base) * 32 // bits):
            s = r * bits
            crow, lrow = [], []
            for n in range(n_cols):
                word = int(words[base + s // 32, n])
                v = word >> (s % 32)
                if s % 32 + bits > 32:
                    v |= int(words[base + s // 32 + 1, n]) << (32 - s % 32)
                code = v & ((1 << bits) - 1)
                nib = (int(scale_words[g, n // 8]) >> (4 * (n % 8))) & 15
                scale = np.float16(np.float32((nib + 1) ** 2) * np.float32(m))
                crow.append(code)
                lrow.append(np.float16(np.float32(code - (1 << (bits - 1))) * np.float32(scale)))
            codes.append(crow)
            levels.append(lrow)
            row += 1
    return torch.tensor(codes), torch.from_numpy(np.array(levels, dtype=np.float16))


def _random_layer(gen, k, n, layout, with_bias):
    row_bits = torch.repeat_interleave(torch.tensor([b for b, _ in layout]), torch.tensor([r for _, r in layout]))
    codes = torch.randint(0, 1 << 20, (k, n), generator=gen) % (1 << row_bits).unsqueeze(1)
    scale_codes = torch.randint(1, 17, (len(layout), n), generator=gen)
    scale_max = (torch.rand(len(layout), generator=gen) * 0.05 + 1e-3).half()
    perm = torch.randperm(k, generator=gen)
    bias = torch.randn(n, generator=gen).half() if with_bias else None
    return codes, scale_codes, scale_max, perm, bias


CASES = [  # (K, N, widths, proportions, group sizes, bias); proportions None: widths is the explicit layout
    *[(128, 40, [b], [1.0], 32, False) for b in (8, 6, 5, 4, 3, 2)],
    (240, 32, [(8, 32), (6, 32), (6, 32), (5, 32), (4, 32), (3, 32), (2, 32), (2, 16)], None, None, True),
    (320, 24, [6, 5], [0.1, 0.9], 128, True),           # last 5-bit group truncated to 64 rows
    (336, 40, [3, 2], [0.3, 0.7], 64, False),           # last 2-bit group truncated to 16 rows
    (192, 64, [8, 4], [0.05, 0.95], [32, 64], True),
    (256, 48, [5, 4, 3], [0.05, 0.1, 0.85], [32, 128, 128], False),
]


@pytest.mark.parametrize("k, n, bits, props, gs, with_bias", CASES)
def test_round_trip_against_reference(k, n, bits, props, gs, with_bias):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    layout = bits if props is None else group_layout(k, bits, props, gs if isinstance(gs, list) else {b: gs for b in bits})
    codes, scale_codes, scale_max, perm, bias = _random_layer(gen, k, n, layout, with_bias)
    packed = pack(codes, layout, scale_codes, scale_max, perm, bias)
    n_pad = math.ceil(n / 32) * 32
    assert packed["q_weight"].shape == (sum(r * b for b, r in layout) // 32, n_pad)
    assert packed["q_scale"].shape == (len(layout), n_pad // 8)
    assert ("bias" in packed) == with_bias

    # pack -> parse/unpack gives back exactly what went in (padded columns: zero code, scale code 16, bias 0)
    groups = parse_groups(packed["q_groups"], packed["q_weight"].shape[0], "x")
    assert [(g.bits, g.rows) for g in groups] == layout
    got = unpack_codes(packed["q_weight"], groups).long()
    assert torch.equal(got[:, :n], codes)
    zero = torch.repeat_interleave(torch.tensor([1 << (b - 1) for b, _ in layout]), torch.tensor([r for _, r in layout]))
    assert torch.equal(got[:, n:], zero.unsqueeze(1).expand(k, n_pad - n))
    sc = unpack_scale_codes(packed["q_scale"], n_pad).long()
    assert torch.equal(sc[:, :n], scale_codes) and bool((sc[:, n:] == 16).all())
    assert torch.equal(packed["q_scale_max"], scale_max)
    assert torch.equal(packed["q_invperm"].long(), torch.argsort(perm))
    if with_bias:
        assert torch.equal(packed["bias"][:n], bias) and not packed["bias"][n:].any()

    # the independent reader agrees on codes and on every dequantized value, in stored and natural order
    ref_codes, ref_stored = _ref_decode(packed, n_pad)
    assert torch.equal(ref_codes[:, :n], codes)
    tensors = {f"m.l.{key}": t for key, t in packed.items()}
    stored = dequantize_stored(tensors, "m.l")
    assert stored.dtype == torch.float16
    assert stored.view(torch.int16).equal(ref_stored.view(torch.int16))
    natural = dequantize(tensors, "m.l")
    ref_natural = torch.empty_like(ref_stored)
    ref_natural[perm] = ref_stored
    assert natural.view(torch.int16).equal(ref_natural.view(torch.int16))
    assert not natural[:, n:].any()

    assert layer_storage_bits(k, n_pad, layout, n_pad if with_bias else 0) == \
        sum(t.numel() * t.element_size() * 8 for t in packed.values())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_byte_and_word_bit_paths_agree(bits):
    """The little-endian byte path and the portable int32/int64 path encode and decode identically."""
    gen = torch.Generator().manual_seed(bits)
    rows = 64
    codes = torch.randint(0, 1 << bits, (rows, 24), generator=gen).to(torch.uint8)
    words_b = fmt._encode_run(codes, bits, use_bytes=True)
    words_w = fmt._encode_run(codes, bits, use_bytes=False)
    assert torch.equal(words_b, words_w)
    for use_bytes in (True, False):
        for dtype in (torch.uint8, torch.int16):
            out = torch.empty((rows, 24), dtype=dtype)
            fmt._decode_run(words_b, bits, out, use_bytes=use_bytes)
            assert torch.equal(out.long(), codes.long())


def test_scales_follow_spec_roundings():
    # nibble 15 (code 16) gives exactly M; code 1 gives fp16(fp16(M/256)); a subnormal M/256 is rounded once
    q_scale = torch.tensor([[0x0000000F, 0x0]], dtype=torch.int32)  # column 0 -> nibble 15, others nibble 0
    m = torch.tensor([0.0371], dtype=torch.float16)
    s = unpack_scales(q_scale, m, 16)
    assert s[0, 0] == m[0]
    assert s[0, 1] == (m.float() / 256).half()[0]
    tiny = torch.tensor([7.0e-5], dtype=torch.float16)  # M/256 = 4.59 · 2^-24 is subnormal: rounds to 5 · 2^-24
    s = unpack_scales(q_scale, tiny, 16)
    assert s[0, 3].item() == 5 * 2.0 ** -24
    assert s[0, 0].item() == 256 * 5 * 2.0 ** -24 != tiny.item()


def test_bit_mix_and_bpw_of_packed_layer():
    layout = group_layout(256, [6, 4], [0.25, 0.75], {6: 32, 4: 64})
    codes, scale_codes, scale_max, perm, _ = _random_layer(torch.Generator().manual_seed(1), 256, 96, layout, False)
    tensors = {f"p.{k}": v for k, v in pack(codes, layout, scale_codes, scale_max, perm).items()}
    assert bit_mix(tensors, "p") == {6: 64, 4: 192}
    bits = layer_storage_bits(256, 96, layout)
    assert layer_bpw(tensors, "p") == pytest.approx(bits / (256 * 96))
    assert layer_bpw(tensors, "p", out_features=90) == pytest.approx(bits / (256 * 90))


# ---------------------------------------------------------------- malformed data

PREFIX = "model.layers.7.mlp.up_proj"


@pytest.fixture()
def layer():
    layout = [(5, 64), (4, 128), (4, 64)]
    codes, scale_codes, scale_max, perm, _ = _random_layer(torch.Generator().manual_seed(3), 256, 64, layout, False)
    return {f"{PREFIX}.{k}": v for k, v in pack(codes, layout, scale_codes, scale_max, perm).items()}


def _expect_error(tensors, fragment):
    with pytest.raises(FormatError) as err:
        dequantize(tensors, PREFIX)
    assert PREFIX in str(err.value) and fragment in str(err.value)


def test_valid_fixture_layer_loads(layer):
    assert dequantize(layer, PREFIX).shape == (256, 64)


def test_missing_invperm(layer):
    del layer[f"{PREFIX}.q_invperm"]
    _expect_error(layer, "q_invperm")


def test_widths_not_descending(layer):
    q_groups = layer[f"{PREFIX}.q_groups"].clone()
    q_groups[0], q_groups[2] = 4, 5  # 4-bit then 5-bit
    layer[f"{PREFIX}.q_groups"] = q_groups
    _expect_error(layer, "descending")


def test_invalid_width(layer):
    layer[f"{PREFIX}.q_groups"] = layer[f"{PREFIX}.q_groups"].clone().index_fill_(0, torch.tensor([0]), 7)
    _expect_error(layer, "bit width 7")


@pytest.mark.parametrize("index, value", [(3, 500), (5, 10), (1, 3)])
def test_offsets_out_of_range_or_decreasing(layer, index, value):
    layer[f"{PREFIX}.q_groups"] = layer[f"{PREFIX}.q_groups"].clone().index_fill_(0, torch.tensor([index]), value)
    with pytest.raises(FormatError) as err:
        dequantize(layer, PREFIX)
    assert PREFIX in str(err.value)


def test_offset_not_whole_rows(layer):
    layer[f"{PREFIX}.q_groups"] = layer[f"{PREFIX}.q_groups"].clone().index_fill_(0, torch.tensor([3]), 9)
    _expect_error(layer, "whole number")


@pytest.mark.parametrize("key, bad", [("q_scale", lambda t: t[:-1]), ("q_scale_max", lambda t: t[:-1]),
                                      ("q_invperm", lambda t: t[:-1]), ("q_scale", lambda t: t[:, :-1])])
def test_shape_disagreement(layer, key, bad):
    layer[f"{PREFIX}.{key}"] = bad(layer[f"{PREFIX}.{key}"])
    _expect_error(layer, key)


def test_invperm_not_a_permutation(layer):
    inv = layer[f"{PREFIX}.q_invperm"].clone()
    inv[0] = inv[1]
    layer[f"{PREFIX}.q_invperm"] = inv
    _expect_error(layer, "permutation")


def test_odd_q_groups(layer):
    layer[f"{PREFIX}.q_groups"] = layer[f"{PREFIX}.q_groups"][:-1]
    _expect_error(layer, "q_groups")


def test_parse_groups_direct():
    groups = parse_groups(torch.tensor([6, 0, 6, 6, 2, 12], dtype=torch.int16), 14, "x")
    assert groups == [Exl2Group(6, 0, 6, 0, 32), Exl2Group(6, 6, 12, 32, 32), Exl2Group(2, 12, 14, 64, 32)]


@pytest.mark.parametrize("layout, fragment", [([(4, 64), (5, 64)], "descending"), ([(3, 48)], "int32"),
                                              ([(4, 40), (4, 8)], "multiple of 32"), ([(7, 64)], "bit width")])
def test_pack_rejects_bad_layouts(layout, fragment):
    k = sum(r for _, r in layout)
    with pytest.raises(ValueError, match=fragment):
        pack(torch.zeros(k, 32, dtype=torch.long), layout, torch.ones(len(layout), 32, dtype=torch.long),
             torch.ones(len(layout)).half(), torch.arange(k))


def test_pack_rejects_bad_values():
    layout = [(4, 64)]
    good = dict(codes=torch.zeros(64, 32, dtype=torch.long), groups=layout, scale_codes=torch.ones(1, 32),
                scale_max=torch.ones(1).half(), perm=torch.arange(64))
    with pytest.raises(ValueError, match="0..15"):
        pack(**{**good, "codes": torch.full((64, 32), 16)})
    with pytest.raises(ValueError, match="1..16"):
        pack(**{**good, "scale_codes": torch.zeros(1, 32)})
    with pytest.raises(ValueError, match="permutation"):
        pack(**{**good, "perm": torch.zeros(64, dtype=torch.long)})


def test_synthetic_model_bodies_are_valid_exl2():
    """`exl2 bench`'s fabricated layers: pure 4-bit, or 5/4/3-bit groups in every matrix (--mixed), ≈ 4.0 bpw,
    and readable by the format's own reader."""
    from exl2.formats.exl2 import layer_bpw, read_layer
    from exl2.runtime.synthetic import BODY_OPTION, LLAMA3_8B, MIXED_BODY_OPTION, llama_exl2_tensors

    cfg = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16,
               num_key_value_heads=4, vocab_size=300)
    for body, widths in ((BODY_OPTION, {4}), (MIXED_BODY_OPTION, {3, 4, 5})):
        t = llama_exl2_tensors(cfg, body=body)
        for p in ("self_attn.q_proj", "mlp.down_proj"):
            _, groups, _, _ = read_layer(t, f"model.layers.0.{p}")
            assert {g.bits for g in groups} == widths
            assert abs(layer_bpw(t, f"model.layers.0.{p}") - 4.05) < 0.15
