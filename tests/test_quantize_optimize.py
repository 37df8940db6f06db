"""The option optimizer: exact on brute-forceable instances, hits the budget on real-sized ones."""
import itertools
import json
import random
from pathlib import Path

import pytest

from exl2.errors import ConfigError
from exl2.quantize.optimize import choose_strategy, solve
from exl2.quantize.qparams import QPARAMS_ATTN, QPARAMS_MLP

GOLDEN = Path(__file__).parent / "fixtures" / "golden"


def brute_force(costs, errors, budget):
    best, best_err = None, float("inf")
    for combo in itertools.product(*[range(len(c)) for c in costs]):
        if sum(costs[s][o] for s, o in enumerate(combo)) <= budget:
            e = sum(errors[s][o] for s, o in enumerate(combo))
            if e < best_err:
                best, best_err = list(combo), e
    return best, best_err


def test_solver_is_optimal_on_small_instances():
    rng = random.Random(0)
    for _ in range(300):
        slots, options = rng.randint(1, 5), rng.randint(1, 6)
        costs = [[rng.randint(1, 10 ** 6) for _ in range(options)] for _ in range(slots)]
        errors = [[rng.random() for _ in range(options)] for _ in range(slots)]
        budget = rng.randint(0, 4 * 10 ** 6)
        best, best_err = brute_force(costs, errors, budget)
        if best is None:
            with pytest.raises(ConfigError):
                solve(costs, errors, budget)
            continue
        picks = solve(costs, errors, budget)
        assert sum(costs[s][o] for s, o in enumerate(picks)) <= budget
        assert sum(errors[s][o] for s, o in enumerate(picks)) == pytest.approx(best_err, rel=0, abs=1e-12)


def synthetic_measurement(layers=32, seed=1):
    """Llama-3-8B-shaped costs from the real option tables, errors falling with bits (with per-layer spread)."""
    rng = random.Random(seed)
    shapes_a = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096)]
    shapes_m = [(4096, 14336), (4096, 14336), (14336, 4096)]
    m, keys, numel = {}, [], 0
    for i in range(layers):
        for kind, rows, shapes in (("self_attn", QPARAMS_ATTN, shapes_a), ("mlp", QPARAMS_MLP, shapes_m)):
            key = f"model.layers.{i}.{kind}"
            scale = rng.uniform(0.5, 2.0)
            opts = []
            for row in rows:
                bits = sum(q.total_bits(k, n) for q, (k, n) in zip(row, shapes))
                bpw = bits / sum(k * n for k, n in shapes)
                opts.append({"accuracy": 1 - scale * 2 ** -bpw * rng.uniform(0.9, 1.1), "total_bits": bits,
                             "kl": scale * 4 ** -bpw})
            m[key] = opts
            keys.append(key)
            numel += sum(k * n for k, n in shapes) + 4096
    return m, keys, numel


@pytest.mark.parametrize("bits", [2.5, 4.125, 6.0])
def test_budget_is_met_closely(bits):
    m, keys, numel = synthetic_measurement(layers=16)
    for mode in ("kl", "rfn2"):
        strategy, info = choose_strategy(m, keys, numel, bits, mode)
        used = sum(strategy[k]["total_bits"] for k in keys)
        assert used <= int(numel * bits) and used == info["used_bits"]
        assert bits - 0.05 <= used / numel <= bits


def test_golden_measurement_budget():
    """exllamav2's own measurement of the golden model (no KL data: squared relative errors are used)."""
    m = json.loads((GOLDEN / "measurement.json").read_text())["measurement"]
    keys = [k for k, v in m.items() if v]
    numel = 4 * (2 * 256 * 256 + 2 * 256 * 128 + 256 + 3 * 256 * 768 + 256)
    for bits in (3.0, 4.0, 6.0):
        strategy, info = choose_strategy(m, keys, numel, bits)
        assert info["objective"] == "rfn2"
        assert bits - 0.05 <= info["bpw"] <= bits
    with pytest.raises(ConfigError):
        choose_strategy(m, keys, numel, 1.5)
