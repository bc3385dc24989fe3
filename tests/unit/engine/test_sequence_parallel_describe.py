"""`hspmd show --device` lists the TP collectives of the layout the plan runs (sequence parallel or not)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runtime.torchfree.engine.describe import describe_program
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

PLAN = Path(__file__).resolve().parents[2] / "integration" / "engine_plans" / "tp2-sp.yaml"


def tp_details(ctx, device: int) -> list[str]:
    return [o.detail for o in describe_program(StrategyHandle.of(ctx), device).ops if "TP group" in o.detail]


def test_sequence_parallel_collectives_are_listed() -> None:
    ctx = load_plan_context(PLAN)
    assert ctx.plan.training.sequence_parallel
    on = tp_details(ctx, 3)   # the TP-2 stage with the head
    assert on and all("reduce-scatter" in d for d in on)
    assert any("output all-gather" in d and "logits all-gather" in d for d in on)
    off_plan = dataclasses.replace(ctx.plan, training=dataclasses.replace(ctx.plan.training, sequence_parallel=False))
    off = tp_details(dataclasses.replace(ctx, plan=off_plan), 3)
    assert off and not any("reduce-scatter" in d for d in off)
    assert tp_details(ctx, 2) == []   # the TP-1 stage has none
