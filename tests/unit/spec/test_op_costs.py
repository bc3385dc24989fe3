"""Op costs in the plan (``Stage.op_costs`` per chunk, ``Pipeline.transfer_costs`` per boundary): parsing,
write-back, validation messages, and the action lists the runtime orders by them (docs/schedules.md,
"Costs in the plan")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_files import load, problems

from runtime.torchfree.pipeline_schedules import ChunkCost, Costs, build_schedule, check_schedule
from runtime.torchfree.schedule_policies import schedule_layout
from runtime.torchfree.spec.handle import StrategyHandle, plan_schedule
from runtime.torchfree.spec.io import dump_yaml
from runtime.torchfree.spec.plan import Pipeline, Stage
from runtime.torchfree.spec.schema import to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = yaml.safe_load((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text())
COSTS = ([[0.012, 0.010, 0.008]], [[0.030, 0.025, 0.020]])   # pipeline 1: its slow second stage


TRANSFER = [0.004]


def costed_plan(transfers: object = TRANSFER, **changes) -> dict:
    """cpu-hetero4-tiny with op costs on pipeline 1's two stages and its one boundary (under ZB-H1, so B
    and W both count)."""
    data = copy.deepcopy(BASE)
    data["training"]["schedule"] = "zb-h1"
    pipe = data["strategies"][0]["pipelines"][1]
    for stage, costs in zip(pipe["stages"], COSTS):
        stage["op_costs"] = copy.deepcopy(costs)
    if transfers is not None:
        pipe["transfer_costs"] = transfers
    for k, v in changes.items():
        pipe["stages"][int(k[-1])]["op_costs"] = v
    return data




def test_op_costs_parse_and_write_back(tmp_path: Path) -> None:
    ctx = load(tmp_path, costed_plan())
    stages = ctx.plan.strategies[0].pipelines[1].stages
    assert stages[0].op_costs == ((0.012, 0.010, 0.008),) and stages[1].op_costs == ((0.030, 0.025, 0.020),)
    assert ctx.plan.strategies[0].pipelines[0].stages[0].op_costs is None
    data = to_data(ctx.plan)
    assert "op_costs" not in data["strategies"][0]["pipelines"][0]["stages"][0]   # None: not written
    assert data["strategies"][0]["pipelines"][1]["stages"][1]["op_costs"] == COSTS[1]
    assert data["strategies"][0]["pipelines"][1]["transfer_costs"] == TRANSFER
    assert "transfer_costs" not in data["strategies"][0]["pipelines"][0]
    assert load(tmp_path, yaml.safe_load(dump_yaml(data))).plan == ctx.plan


S1 = "strategies[0].pipelines[1].stages[1].op_costs"
BAD = {
    "count": ({"s1": [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]},
              f"{S1}: lists 2 cost triple(s) for 1 chunk(s): one [forward, input_grad, weight_grad] per layer range"),
    "zero": ({"s1": [[0.01, 0.0, 0.01]]},
             f"{S1}: chunk 0: op durations must be positive finite seconds, got [0.01, 0.0, 0.01]"),
    "negative": ({"s1": [[-1.0, 1.0, 1.0]]},
                 f"{S1}: chunk 0: op durations must be positive finite seconds, got [-1.0, 1.0, 1.0]"),
    "nan": ({"s1": [[1.0, float("nan"), 1.0]]}, f"{S1}[0][1]: expected a finite number, got nan"),
    "pair": ({"s1": [[1.0, 1.0]]}, f"{S1}[0]: expected a list of 3 items, got 2"),
}


P1 = "strategies[0].pipelines[1].transfer_costs"
BAD_TRANSFERS = {
    "count": ([0.1, 0.1], f"{P1}: lists 2 transfer time(s) for 1 virtual-stage boundaries"),
    "negative": ([-0.1], f"{P1}: transfer times must be finite seconds >= 0, got [-0.1]"),
    "nan": ([float("inf")], f"{P1}[0]: expected a finite number, got inf"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_op_costs_one_line_with_the_path(tmp_path: Path, case: str) -> None:
    changes, want = BAD[case]
    assert problems(tmp_path, costed_plan(**changes)) == [want]


@pytest.mark.parametrize("case", BAD_TRANSFERS, ids=list(BAD_TRANSFERS))
def test_bad_transfer_costs_one_line_with_the_path(tmp_path: Path, case: str) -> None:
    transfers, want = BAD_TRANSFERS[case]
    assert problems(tmp_path, costed_plan(transfers)) == [want]


def test_schedule_for_orders_by_op_costs(tmp_path: Path) -> None:
    """With op costs on every stage: ``build_schedule`` on those costs (B + W the fused backward) and the
    pipeline's transfer times (none given: 0); with them on only some stages: the layer-count order, as
    without any."""
    h = StrategyHandle.of(load(tmp_path, costed_plan()))
    want = build_schedule("zb-h1", 2, 2, 1, Costs(tuple((ChunkCost(*c[0]),) for c in COSTS), tuple(TRANSFER)))
    got = h.pipeline_schedule(1)
    assert got.actions == want.actions and got.timeline == want.timeline and got.costs == want.costs
    assert h.schedule_for(1, 5).actions == build_schedule("zb-h1", 2, 5, 1, want.costs).actions
    free = StrategyHandle.of(load(tmp_path, costed_plan(None))).pipeline_schedule(1)
    assert free.costs == Costs(want.costs.chunks) and free.timeline != want.timeline
    partial = costed_plan(None, s1=None)
    del partial["strategies"][0]["pipelines"][1]["stages"][1]["op_costs"]
    layer_counts = Costs(chunks=((ChunkCost(3, 3, 3),), (ChunkCost(3, 3, 3),)))
    assert StrategyHandle.of(load(tmp_path, partial)).schedule_for(1, 5).actions == \
        build_schedule("zb-h1", 2, 5, 1, layer_counts).actions


def test_uneven_op_costs_change_the_order() -> None:
    """The point of op costs: a slow middle stage reorders ZB-H1's lists (so the integration test's plan,
    tests/integration/engine_plans/zb-h1-costs-hetero4.yaml, runs an order the layer counts would not)."""
    plain = Pipeline(6, (Stage((0, 1), (0, 2)), Stage((2,), (2, 4)), Stage((3,), (4, 6))))
    costed = Pipeline(6, tuple(Stage(s.devices, s.layers, op_costs=(c,)) for s, c in
                               zip(plain.stages, ((1.0, 1.0, 1.0), (3.0, 2.0, 2.5), (0.5, 0.4, 0.3)))))
    a, b = plan_schedule(plain, "zb-h1", 6), plan_schedule(costed, "zb-h1", 6)
    assert a.order(1) != b.order(1)
    assert check_schedule(b.actions, b.layout, 6, split_backward=True).ok


triples = st.tuples(*[st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)] * 3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"]), devices=st.integers(1, 5),
       extra=st.integers(0, 6), data=st.data())
def test_lists_built_from_random_op_costs_are_sound(name: str, devices: int, extra: int, data) -> None:
    """For any positive op costs and transfer times: every transfer matched, no deadlock, each op once in
    dependency order."""
    chunks = {"interleaved": data.draw(st.integers(1, 3)), "zb-v": 2}.get(name, 1)
    m = devices + extra
    layout = schedule_layout(name, devices, chunks)
    stages = []
    for d in range(devices):
        layers = tuple((layout.stage(d, c), layout.stage(d, c) + 1) for c in range(chunks))
        stages.append(Stage((d,), layers, op_costs=tuple(data.draw(triples) for _ in range(chunks))))
    transfers = tuple(data.draw(st.floats(min_value=0.0, max_value=1e3)) for _ in range(devices * chunks - 1))
    sched = plan_schedule(Pipeline(m, tuple(stages), transfer_costs=transfers), name, m)   # type: ignore[arg-type]
    check = check_schedule(sched.actions, sched.layout, m, split_backward=sched.split_backward)
    assert check.ok, check.problems
    assert sched.costs.chunk(0, 0) == ChunkCost(*stages[0].op_costs[0])
