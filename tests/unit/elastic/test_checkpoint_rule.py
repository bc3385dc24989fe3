"""The checkpoint-interval rule of the trace model (planner/trace_model.py): Young's interval for a rate, the
trace's failure rates, and the rate of losses in-memory recovery cannot survive, hand-computed on tiny
layouts (two nodes a: devices 0-1, b: devices 2-3)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from planner.trace_model import FailureRates, unrecoverable_rate, young_interval_steps
from runtime.elastic.events import parse_trace
from runtime.torchfree.elastic.state import holder_sets
from runtime.torchfree.spec import load_cluster, load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]
NODE_OF = {0: "a", 1: "a", 2: "b", 3: "b"}
RATES = FailureRates(device_per_s=1e-3, node_per_s=1e-4)
W = 10.0


def p(rate_s: float) -> float:
    """P(at least one failure within W) for failures at ``rate_s`` per second."""
    return 1 - math.exp(-W * rate_s)


def test_young_interval_for_a_rate():
    # sqrt(2 x 32 s x 10000 s) = 800 s = 200 steps of 4 s
    assert young_interval_steps(32.0, 4.0, 10_000.0, 1.0) == 200
    # an expected quarter failure over the run: MTBF 40000 s, sqrt(2 x 32 x 40000) = 1600 s = 400 steps
    assert young_interval_steps(32.0, 4.0, 10_000.0, 0.25) == 400
    assert young_interval_steps(32.0, 4.0, 10_000.0, 0.0) is None
    # never below one step
    assert young_interval_steps(0.001, 100.0, 1.0, 1000.0) == 1


def test_the_trace_rates():
    cluster = load_cluster("cpu-hetero4")  # one node of 4 devices
    trace = parse_trace({"events": [{"step": 5, "action": "kill", "devices": [1]},
                                    {"step": 6, "action": "hang", "devices": [2]},
                                    {"step": 9, "action": "rejoin", "devices": [1]}]},
                        cluster, range(4), "t.yaml")
    r = FailureRates.of_trace(trace.events, cluster, 1000.0)
    assert r == FailureRates(2 / (4 * 1000.0), 0.0)  # the return is no failure
    with pytest.raises(ValueError):
        FailureRates(-1.0, 0.0)


def test_replicas_on_two_nodes_need_two_failures_within_a_window():
    sets = [{0, 2}, {1, 3}]
    # a device, then its partner or the partner's node; a node, then either partner or the other node
    want = 4 * 1e-3 * p(1e-3 + 1e-4) + 2 * 1e-4 * p(2 * 1e-3 + 1e-4)
    assert unrecoverable_rate(sets, NODE_OF, RATES, W) == pytest.approx(want)
    # the coordinator on node a: its loss ends the job alone (and is no second failure after another)
    want = 1e-4 + 2 * 1e-3 * p(1e-3 + 1e-4) + 2 * 1e-3 * p(1e-3) + 1e-4 * p(2 * 1e-3)
    assert unrecoverable_rate(sets, NODE_OF, RATES, W, "a") == pytest.approx(want)
    # no window: only the coordinator's node
    assert unrecoverable_rate(sets, NODE_OF, RATES, 0.0, "a") == pytest.approx(1e-4)


def test_replicas_on_one_node_die_with_it():
    sets = [{0, 1}]
    # node a alone; device 0 then device 1 or node a, and the other way round
    want = 1e-4 + 2 * 1e-3 * p(1e-3 + 1e-4)
    assert unrecoverable_rate(sets, NODE_OF, RATES, W) == pytest.approx(want)
    # one replica: its device or its node, each alone
    assert unrecoverable_rate([{2}], NODE_OF, RATES, W) == pytest.approx(1e-3 + 1e-4)


def test_the_dp_pp_layout_three_replicas():
    ctx = load_plan_context(REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml")  # 0 | 1 | 2 -> 3
    sets = holder_sets(StrategyHandle.of(ctx, "dp-pp"))
    assert sets == {frozenset({0, 1, 2}), frozenset({0, 1, 3})}
    # coordinator on a: nothing but its node (a device of a leaves {1, 2}: two nodes, two failures more;
    # device 2 leaves {0, 1}: node a, the coordinator's, counted on its own)
    assert unrecoverable_rate(sets, NODE_OF, RATES, W, "a") == pytest.approx(1e-4)
    # coordinator on b: node a leaves {2} and {3} (either device); device 2 or 3 leaves {0, 1} (node a)
    want = 1e-4 + 1e-4 * p(2 * 1e-3) + 2 * 1e-3 * p(1e-4)
    assert unrecoverable_rate(sets, NODE_OF, RATES, W, "b") == pytest.approx(want)
    with pytest.raises(ValueError):
        unrecoverable_rate(sets, NODE_OF, RATES, -1.0)


def test_elastic_zero_moment_chunks_are_pieces_of_state(tmp_path):
    """Under ZeRO-1 with 2 copies a moment chunk has 2 holders, fewer than its parameter's replicas."""
    plan0 = load_plan(REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml")
    whole = plan0.strategies[0].pipelines[0]  # one device, every layer
    four = replace(plan0.strategies[0], name="dp4", pipelines=tuple(
        replace(whole, micro_batches=2, stages=(replace(whole.stages[0], devices=(d,)),)) for d in range(4)))
    path = tmp_path / "zero.yaml"
    save_plan(replace(plan0, training=replace(plan0.training, zero=True, zero_redundancy=2), strategies=(four,)),
              path)
    sets = holder_sets(StrategyHandle.of(load_plan_context(path)))
    assert sets == {frozenset({0, 1, 2, 3}), frozenset({0, 2}), frozenset({1, 3})}
    # the chunks' pairs span the two nodes: as test_replicas_on_two_nodes... (the whole-parameter set adds nothing)
    want = 4 * 1e-3 * p(1e-3 + 1e-4) + 2 * 1e-4 * p(2 * 1e-3 + 1e-4)
    assert unrecoverable_rate(sets, NODE_OF, RATES, W) == pytest.approx(want)
