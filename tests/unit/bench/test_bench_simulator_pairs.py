"""scripts/bench_simulator.py's ranking criterion: only pairs of plans measured further apart than the target
must be ranked right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_simulator_under_test", REPO / "scripts" / "bench_simulator.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_only_separated_pairs_count():
    bench = load_bench()
    measured = {"a": 1.00, "b": 1.03, "c": 1.20}
    # a-b lie 3% apart (either order is fine); a-c and b-c more than 5%.
    assert bench.separated_pairs({"a": 1.04, "b": 1.01, "c": 1.25}, measured) == (2, 2)
    assert bench.separated_pairs({"a": 1.00, "b": 1.30, "c": 1.25}, measured) == (1, 2)
    assert bench.separated_pairs({"a": 1.0}, {"a": 1.0}) == (0, 0)
