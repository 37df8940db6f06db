"""Option tables and storage cost against the figures of spec EXL2.md §3.4 / §2.4 and exllamav2's measurement.json."""
import json
from pathlib import Path

import pytest

from exl2.quantize.qparams import QPARAMS_ATTN, QPARAMS_HEAD, QPARAMS_MLP, QParams

GOLDEN = Path(__file__).parent / "fixtures" / "golden"

# Combined block bpw per table row for Llama-2-7B and Llama-3-8B shapes, copied from the spec (computed there with
# exllamav2's qparams.py).
ATTN_BPW = [(2.133, 2.138), (2.215, 2.199), (2.426, 2.283), (2.672, 2.677), (3.164, 3.169), (3.168, 3.170),
            (4.039, 4.044), (4.047, 4.047), (4.086, 4.082), (4.133, 4.138), (4.168, 4.170), (4.194, 4.190),
            (4.403, 4.274), (4.459, 4.329), (5.383, 5.256), (5.459, 5.329), (6.039, 6.044), (6.633, 6.338),
            (8.039, 8.044)]
MLP_BPW = [(2.248, 2.245), (2.326, 2.323), (2.597, 2.596), (2.913, 2.912), (3.285, 3.283), (3.368, 3.366),
           (3.620, 3.619), (4.139, 4.137), (4.200, 4.198), (4.267, 4.266), (4.351, 4.348), (5.250, 5.249),
           (5.333, 5.331), (6.072, 6.071), (6.303, 6.303), (6.869, 6.869), (8.036, 8.035)]
HEAD_BPW = {2: (2.735, 2.727), 3: (3.282, 3.278), 4: (4.439, 4.430), 5: (5.189, 5.188), 6: (6.345, 6.344),
            8: (8.032, 8.032)}

ATTN_L2 = [(4096, 4096)] * 4
ATTN_L3 = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096)]
MLP_L2 = [(4096, 11008), (4096, 11008), (11008, 4096)]
MLP_L3 = [(4096, 14336), (4096, 14336), (14336, 4096)]


def block_bpw(row, shapes):
    return sum(q.total_bits(k, n) for q, (k, n) in zip(row, shapes)) / sum(k * n for k, n in shapes)


@pytest.mark.parametrize("i", range(len(QPARAMS_ATTN)))
def test_attention_rows_match_spec_bpw(i):
    assert len(QPARAMS_ATTN) == 19
    assert round(block_bpw(QPARAMS_ATTN[i], ATTN_L2), 3) == ATTN_BPW[i][0]
    assert round(block_bpw(QPARAMS_ATTN[i], ATTN_L3), 3) == ATTN_BPW[i][1]


@pytest.mark.parametrize("i", range(len(QPARAMS_MLP)))
def test_mlp_rows_match_spec_bpw(i):
    assert len(QPARAMS_MLP) == 17
    assert round(block_bpw(QPARAMS_MLP[i], MLP_L2), 3) == MLP_BPW[i][0]
    assert round(block_bpw(QPARAMS_MLP[i], MLP_L3), 3) == MLP_BPW[i][1]


def test_head_options_and_single_matrix_example():
    for hb, (a, b) in HEAD_BPW.items():
        assert round(QPARAMS_HEAD[hb].bpw(4096, 32000), 3) == a
        assert round(QPARAMS_HEAD[hb].bpw(8192, 128256), 3) == b
    q = QPARAMS_ATTN[6][0]
    assert q.total_bits(4096, 4096) == 67_765_760      # §3.4 worked example
    assert q.desc == "1:4b_128g s4"


def test_distinct_options_and_group_counts():
    attn = [len({row[j].desc for row in QPARAMS_ATTN}) for j in range(4)]
    mlp = [len({row[j].desc for row in QPARAMS_MLP}) for j in range(3)]
    assert attn == [14, 14, 15, 14] and mlp == [13, 13, 14]
    q = QPARAMS_ATTN[0][0]
    assert q.desc == "0.05:3b_64g/0.95:2b_64g s4"
    counts = lambda qp, k: [sum(1 for b, _ in qp.layout(k) if b == w) for w in qp.bits]
    assert [counts(q, k) for k in (4096, 11008, 14336)] == [[4, 60], [9, 163], [12, 212]]
    d = QPARAMS_MLP[4][2]
    assert [counts(d, k) for k in (4096, 11008, 14336)] == [[7, 4, 27], [18, 9, 73], [23, 12, 95]]


def test_golden_measurement_total_bits_and_dicts():
    """Every option of exllamav2's own measurement.json: same projection dicts as our table rows, same total_bits."""
    m = json.loads((GOLDEN / "measurement.json").read_text())["measurement"]
    shapes = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
              "gate_proj": (256, 768), "up_proj": (256, 768), "down_proj": (768, 256)}
    checked = 0
    for key, options in m.items():
        if options is None:
            continue
        rows = QPARAMS_ATTN if key.endswith("self_attn") else QPARAMS_MLP
        names = ("q_proj", "k_proj", "v_proj", "o_proj") if key.endswith("self_attn") else \
            ("gate_proj", "up_proj", "down_proj")
        assert len(options) == len(rows)
        for opt, row in zip(options, rows):
            assert [QParams.from_dict(opt[n]) for n in names] == list(row)
            assert opt[names[0]] == json.loads(json.dumps(row[0].to_dict()))
            assert sum(QParams.from_dict(opt[n]).total_bits(*shapes[n]) for n in names) == opt["total_bits"]
            checked += 1
    assert checked == 4 * (19 + 17)
