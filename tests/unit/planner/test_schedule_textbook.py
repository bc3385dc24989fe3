"""The order the runtime runs, priced by the cost model, is never slower than the schedule's textbook order
played with the same op and transfer times: llama-7b on an 8-stage pipeline across H800 and H20 stages,
where the list scheduler alone lost 1.4% to Megatron's 1F1B order (and to GPipe)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from planner.cost import CostModel, play_order, timeline_order
from runtime.torchfree.canonical_schedules import canonical_orders
from runtime.torchfree.pipeline_schedules import op_kinds, schedule_timeline
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.schedule_policies import schedule_layout
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import plan_costs

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def eight_stage_plan(tmp_path: Path) -> Path:
    """Layers 4/6/4/4/4/4/4/2 on devices 0, 8, 16, 24, 32, 40, 1, 9 of h800-h20-48, 16 micro-batches of
    1 x 4096."""
    cuts = [0, 4, 10, 14, 18, 22, 26, 30, 32]
    devices = [0, 8, 16, 24, 32, 40, 1, 9]
    plan = {"version": 1, "model": "llama-7b", "cluster": "h800-h20-48",
            "training": {"global_batch": 16, "micro_batch": 1, "seq_len": 4096, "zero": False, "schedule": "1f1b",
                         "seed": 0},
            "strategies": [{"name": "pp8", "pipelines": [{"micro_batches": 16, "stages": [
                {"devices": [d], "layers": [a, b], "recompute": False}
                for d, a, b in zip(devices, cuts, cuts[1:])]}]}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_llama_7b_eight_uneven_stages(tmp_path: Path) -> None:
    ctx = load_plan_context(eight_stage_plan(tmp_path))
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, resolve_profiles(ctx.cluster.device_types, []))
    strat = cm.with_op_costs(ctx.plan.strategies[0], "1f1b")   # the op costs the planner writes into a plan
    layout = schedule_layout("1f1b", 8)
    kinds = op_kinds("1f1b")
    costs = cm.pipeline_costs(strat, 0, "1f1b")
    textbook = play_order(layout, kinds, canonical_orders("1f1b", layout, 16)[0], costs)
    alone = play_order(layout, kinds, timeline_order(layout, kinds, schedule_timeline(
        "1f1b", 8, 16, costs=plan_costs(strat.pipelines[0]), source="list")), costs)
    runs = cm.pipeline_step_time(strat, 0, "1f1b")
    gpipe = cm.pipeline_step_time(strat, 0, "gpipe")
    assert alone > textbook * 1.01            # the list scheduler alone: 4.655 s against 4.592 s
    assert runs <= textbook * (1 + 1e-12)     # what engine, simulator and cost model get
    assert runs == pytest.approx(4.5917, abs=1e-3) and runs < gpipe
