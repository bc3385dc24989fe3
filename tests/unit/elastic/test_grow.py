"""planner/replan.py ``grow``: a returning device is adopted only when the step time it saves over the
steps left beats the modelled switch cost."""

from __future__ import annotations

from pathlib import Path

from planner.replan import SwitchModel, grow, replan
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]


def _after_failure():
    ctx = load_plan_context(REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml")
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    handle = StrategyHandle.of(ctx, "dp-pp")
    survivors = replan(handle, {1}, profiles, time_limit_s=10)
    return StrategyHandle.of(survivors.context), profiles


def test_a_return_is_adopted_only_when_the_gain_beats_the_switch():
    current, profiles = _after_failure()
    many = grow(current, {1}, profiles, steps_left=1_000_000, time_limit_s=10)
    assert many.step_time_s < many.current_step_time_s  # one more fast device helps
    assert many.adopt and many.context is not None and 1 in StrategyHandle.of(many.context).devices
    assert many.gain_s == (many.current_step_time_s - many.step_time_s) * 1_000_000
    assert many.switch_s > SwitchModel().regroup_s  # the state has to move too
    # Too few steps left to pay for the switch: stay (and say why).
    few = grow(current, {1}, profiles, steps_left=1, time_limit_s=10)
    assert not few.adopt and few.context is None and few.gain_s < few.switch_s
    assert few.reason.startswith("stay: with device(s) 1:")
