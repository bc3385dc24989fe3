"""Per-step strategy choice with hysteresis, and the plan-derived cost model the runtime dispatches with."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.torchfree.dispatch import (
    CostModel,
    PipelineCost,
    StageCost,
    StrategyCost,
    choose,
    dispatch,
    plan_strategy_cost,
)
from runtime.torchfree.spec import load_plan_context

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def const(cost: float):
    return lambda _a, _b: cost


def test_choose_keeps_current_unless_the_gain_pays_for_the_switch():
    assert choose([3.0, 1.0], None, const(10.0)) == 1          # first step: the cheapest
    assert choose([3.0, 1.0], 0, const(10.0)) == 0             # gain 2 < cost 10: stay
    assert choose([3.0, 1.0], 0, const(1.5)) == 1              # gain 2 > cost 1.5: switch
    assert choose([3.0, 1.0], 0, const(2.0)) == 0              # equal: not taken
    assert choose([None, 5.0], 0, const(100.0)) == 1           # current cannot serve: forced
    assert choose([3.0, 1.0], 0, None) == 1                    # no cost model: the cheapest
    assert choose([1.0, 1.0], 1, const(0.0)) == 1              # ties keep the current one


@given(st.lists(st.one_of(st.none(), st.floats(0, 10)), min_size=1, max_size=5).filter(
    lambda p: any(x is not None for x in p)), st.integers(0, 4), st.floats(0, 5))
def test_choose_never_picks_a_strategy_that_cannot_serve(predicted, current, cost):
    current = current if current < len(predicted) else None
    i = choose(predicted, current, const(cost))
    assert predicted[i] is not None
    if current is not None and predicted[current] is not None and i != current:
        assert predicted[current] - predicted[i] > cost


def strategy(name: str, max_len: int, speed: float) -> StrategyCost:
    return StrategyCost(name, max_len, (PipelineCost((StageCost(CostModel(0.0, 1.0 / speed, 0.0), 10**6),)),))


def test_dispatch_reports_hysteresis():
    short, long = strategy("short", 10, 2.0), strategy("long", 100, 1.0)
    d = dispatch([5, 5], [short, long], current=1, switch_cost=const(100.0))
    # Stayed: the cheapest strategy was another one, but its gain did not pay for the switch.
    assert d.strategy_name == "long" and d.cheapest == 0 != d.strategy and d.switch_cost == 0.0
    d = dispatch([5, 5], [short, long], current=1, switch_cost=const(0.5))
    assert d.strategy_name == "short" and d.cheapest is None and d.switch_cost == 0.5
    d = dispatch([50], [short, long], current=0, switch_cost=const(100.0))
    assert d.strategy_name == "long" and d.predicted[0] is None and d.switch_cost == 100.0


def test_plan_cost_model():
    ctx = load_plan_context(CONFIGS / "plans" / "cpu-hetero4-tiny.yaml")
    t = ctx.plan.training
    c = plan_strategy_cost(ctx.plan.strategies[0], ctx.model, ctx.cluster, t)
    assert c.max_seq_len == t.seq_len
    assert all(p.capacity == t.micro_batch * t.seq_len for p in c.pipelines)
    fast, slow = c.pipelines[0].stages[0], c.pipelines[1].stages[0]
    # the TP-2 fast stage runs all 6 layers, each slow stage 3 layers at a third of the rate, without TP
    assert fast.cost.b < slow.cost.b * 2
    assert c.pipelines[1].stages[1].cost.b > slow.cost.b      # the last stage also runs the head
    assert all(s.cost.a > 0 for p in c.pipelines for s in p.stages)   # attention is quadratic
    with pytest.raises(ValueError):
        CostModel(-1.0)
