"""Load progress (exllamav2's `callback(idx, total)`): `load_model(progress=...)` hears of every decoder layer and
then the head, in order, whichever builder runs (one device, a split over several); `Engine(config, progress)`
tags them with the model they belong to. No callback: nothing is called and the load is unchanged."""
from pathlib import Path

from exl2.config import EngineConfig
from exl2.engine import Engine
from exl2.runtime.load_progress import report, reporting
from exl2.runtime.loader import load_model
from test_placement import split_on_cpu

MODEL = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"


def test_load_model_reports_each_layer_then_the_head():
    calls = []
    model = load_model(MODEL, "cpu", progress=lambda done, total: calls.append((done, total)))
    n = model.spec.num_layers
    assert calls == [(i, n + 1) for i in range(1, n + 2)]


def test_a_split_model_reports_the_same_way():
    calls = []
    with reporting(lambda done, total: calls.append((done, total))):
        model, _ = split_on_cpu((1, 1, 2))
    n = model.spec.num_layers
    assert n == 4 and calls == [(i, n + 1) for i in range(1, n + 2)]


def test_reporting_nests_and_none_keeps_the_outer_callback():
    outer, inner = [], []
    with reporting(lambda d, t: outer.append(d)):
        report(1, 3)
        with reporting(None):
            report(2, 3)
        with reporting(lambda d, t: inner.append(d)):
            report(3, 3)
        report(4, 4)
    report(5, 5)  # no callback: nothing happens
    assert outer == [1, 2, 4] and inner == [3]


def test_engine_tags_the_model_and_its_draft():
    calls = []
    engine = Engine(EngineConfig(model_dir=MODEL, draft_model_dir=MODEL, max_seq_len=512, device="cpu"),
                    progress=lambda kind, done, total: calls.append((kind, done, total)))
    try:
        n = engine.model.spec.num_layers
        expected = [("model", i, n + 1) for i in range(1, n + 2)] + [("draft", i, n + 1) for i in range(1, n + 2)]
        assert calls == expected
    finally:
        engine.close()


def test_the_cli_shows_a_bar_only_on_a_terminal(monkeypatch):
    import sys

    from exl2.cli.common import load_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with load_bar() as progress:
        assert progress is None          # a pipe or a log file gets no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with load_bar() as progress:
        for done in range(1, 4):
            progress("model", done, 3)
        progress("draft", 1, 2)
