"""Activation limits in the plan (``Pipeline.activation_limits``): parsing, write-back, validation messages,
and the action lists the runtime builds under them (docs/schedules.md, "Activation limits")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from plan_files import load, problems

from runtime.torchfree.pipeline_schedules import build_schedule, check_schedule
from runtime.torchfree.spec.handle import StrategyHandle, plan_costs
from runtime.torchfree.spec.io import dump_yaml
from runtime.torchfree.spec.schema import to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = yaml.safe_load((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text())
P1 = "strategies[0].pipelines[1].activation_limits"


def limited(limits: object, schedule: str = "zb-h1") -> dict:
    """cpu-hetero4-tiny under ``schedule`` with ``limits`` on pipeline 1 (two stages)."""
    data = copy.deepcopy(BASE)
    data["training"]["schedule"] = schedule
    data["strategies"][0]["pipelines"][1]["activation_limits"] = limits
    return data




def test_limits_parse_write_back_and_build_the_lists(tmp_path: Path) -> None:
    ctx = load(tmp_path, limited([4, 2]))
    pipe = ctx.plan.strategies[0].pipelines[1]
    assert pipe.activation_limits == (4, 2)
    data = to_data(ctx.plan)
    assert data["strategies"][0]["pipelines"][1]["activation_limits"] == [4, 2]
    assert "activation_limits" not in data["strategies"][0]["pipelines"][0]   # None: not written
    assert load(tmp_path, yaml.safe_load(dump_yaml(data))).plan == ctx.plan
    h = StrategyHandle.of(ctx)
    got = h.pipeline_schedule(1)
    want = build_schedule("zb-h1", 2, pipe.micro_batches, 1, plan_costs(pipe), (4, 2))
    assert got.actions == want.actions and got.activation_limits() == (min(4, pipe.micro_batches), 2)
    assert check_schedule(got.actions, got.layout, pipe.micro_batches, split_backward=True).ok
    # A step with fewer micro-batches (packed documents) builds its lists under the same limits.
    assert h.schedule_for(1, 1).activation_limits() == (1, 1)


BAD = {
    "count": ([4], [f"{P1}: lists 1 limit(s) for 2 stage(s)"]),
    "zero": ([0, 1], [f"{P1}: limits must be integers >= 1, got [0]"]),
    "below": ([1, 1], [f"{P1}[0]: 1 is below zb-h1's own bound of 2 activations for this stage"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_limits_one_line_with_the_path(tmp_path: Path, case: str) -> None:
    limits, want = BAD[case]
    assert problems(tmp_path, limited(limits)) == want
