"""Replanning after a failure: switch-cost-aware choice, the repair candidate, the restart model, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from planner.replan import LostStateError, RestartModel, choose, repair, replan, restart_cost
from runtime.torchfree.elastic.state import lost_state, moment_slices
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan, validate_plan
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"  # TP-2 on 0,1 | 2 -> 3
DP_PP = REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"  # 0 | 1 | 2 -> 3
SINGLE = REPO / "tests" / "integration" / "engine_plans" / "pp-uneven.yaml"  # one pipeline 0 -> 1 -> 2


def opt(step: float, nbytes: int, origin: str = "planner", rank: int = 0):
    return SimpleNamespace(step_time_s=step, switch_bytes=nbytes, origin=origin, rank=rank)


def test_choice_prefers_the_least_state_moved_among_the_near_best():
    fast, near_cheap, slow_free = opt(1.00, 900), opt(1.04, 100, rank=1), opt(1.30, 0, "repair")
    assert choose([fast, near_cheap, slow_free], 0.05) is near_cheap
    assert choose([fast, near_cheap, slow_free], 0.0) is fast
    assert choose([fast, near_cheap, slow_free], 0.5) is slow_free
    tie = opt(1.02, 900, rank=1)
    assert choose([tie, fast], 0.05) is fast  # same bytes: the faster


def test_restart_model_states_its_arithmetic():
    ctx = load_plan_context(TINY)
    m = RestartModel(storage_gbs=2.0, restart_s=30.0, checkpoint_interval_steps=10)
    rc = restart_cost(ctx.model, 0.5, m)
    nbytes = ctx.model.total_params() * 12
    assert rc.checkpoint_bytes == nbytes
    assert rc.write_s == rc.read_s == pytest.approx(nbytes / 2e9)
    assert rc.lost_work_s == pytest.approx(5 * 0.5)
    assert rc.total_s == pytest.approx(2 * nbytes / 2e9 + 30.0 + 2.5)
    assert any("30 s" in a for a in rc.assumptions()) and any("every 10 steps" in a for a in rc.assumptions())


def test_repair_keeps_intact_pipelines_and_spreads_the_micro_batches():
    ctx = load_plan_context(DP_PP)
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    plan, step_time = repair(StrategyHandle.of(ctx, "dp-pp"), [3], profiles)
    (strategy,) = plan.strategies
    assert [p.devices for p in strategy.pipelines] == [(0,), (1,)]
    assert sum(p.micro_batches for p in strategy.pipelines) == 8 and step_time > 0
    assert repair(StrategyHandle.of(ctx, "dp-pp"), [0, 1, 2], profiles) is None  # nothing intact
    assert repair(StrategyHandle.of(ctx, "dp-pp"), [5], profiles) is None  # nothing broken


def test_a_repair_without_a_tp_stage_turns_sequence_parallelism_off():
    """Found in the demo: pre-planning the loss of a rank of the TP stage a failure had switched to failed,
    because the repair kept `training.sequence_parallel` on a plan left with no TP stage (invalid)."""
    ctx = load_plan_context(TINY)
    sp = dataclasses.replace(ctx, plan=dataclasses.replace(
        ctx.plan, training=dataclasses.replace(ctx.plan.training, sequence_parallel=True)))
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    for failed, tp_left in (([0], False), ([3], True)):
        plan, _ = repair(StrategyHandle.of(sp, "hetero"), failed, profiles)
        assert plan.training.sequence_parallel is tp_left, failed
        assert validate_plan(plan, ctx.model, ctx.cluster) == [], failed
    assert replan(StrategyHandle.of(sp, "hetero"), [0], profiles).chosen is not None  # raised before


def test_replan_picks_a_near_best_plan_that_moves_the_least():
    ctx = load_plan_context(TINY)
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    r = replan(StrategyHandle.of(ctx, "hetero"), [1], profiles, tolerance=0.05)
    assert r.survivors == (0, 2, 3) and r.failed == (1,)
    fastest = min(o.step_time_s for o in r.options)
    near = [o for o in r.options if o.step_time_s <= fastest * 1.05]
    assert r.chosen in near and r.chosen.switch_bytes == min(o.switch_bytes for o in near)
    assert 1 not in r.chosen.strategy.devices
    assert any(o.origin == "repair" and o.switch_bytes == 0 for o in r.options)
    assert r.restart.total_s > r.chosen.modelled_switch_s
    # An unbounded tolerance takes the repair: nothing moves at all.
    assert replan(StrategyHandle.of(ctx, "hetero"), [1], profiles, tolerance=100.0).chosen.origin == "repair"


def test_replan_refuses_when_a_parameter_lost_every_replica():
    ctx = load_plan_context(SINGLE)
    with pytest.raises(LostStateError) as err:
        replan(StrategyHandle.of(ctx, "pp"), [1], resolve_profiles(ctx.cluster.device_types, []))
    assert err.value.lines()[1:] == ["  decoder layers 1-4 (36 tensors): held only by failed device(s) 1"]


def test_cli_json_and_plan_file(tmp_path):
    out = tmp_path / "new.yaml"
    res = CliRunner().invoke(cli, ["replan", "--plan", str(TINY), "--failed", "1", "-o", str(out), "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    for key in ("plan", "step_time_s", "switch_bytes", "switch_time_s", "restart_time_s"):
        assert key in data
    assert data["switch_time_s"] < data["restart_time_s"]
    assert sum(link["bytes"] for link in data["link_bytes"]) == data["switch_bytes"]
    written = load_plan(out)
    assert 1 not in written.strategies[0].devices
    assert written.strategies[0].name == data["plan"]["strategies"][0]["name"]
    load_plan_context(out)  # valid against its model and cluster


def test_cli_text_report_and_errors(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["replan", "--plan", str(TINY), "--failed", "1"])
    assert res.exit_code == 0, res.output
    assert "checkpoint-restart (modelled)" in res.output and "assumes:" in res.output
    res = runner.invoke(cli, ["replan", "--plan", str(SINGLE), "--failed", "0,1"])
    assert res.exit_code == 2
    assert "parameter(s) have no surviving replica" in res.output
    assert "held only by failed device(s) 0, 1" in res.output
    res = runner.invoke(cli, ["replan", "--plan", str(TINY), "--failed", "one"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == ["error: --failed: expected comma-separated device ids or ranges such "
                                               "as 5,6 or 16-23, got 'one'"]
    res = runner.invoke(cli, ["replan", "--plan", str(TINY), "--failed", "9"])
    assert res.exit_code == 2 and "not in cluster" in res.output


@pytest.fixture
def zero_dp4(tmp_path) -> Path:
    """Four whole-model replicas with ZeRO-1, two copies of every moment chunk (holders 0+2 and 1+3)."""
    plan = load_plan(DP_PP)
    whole = plan.strategies[0].pipelines[0]  # one device, every layer
    four = dataclasses.replace(plan.strategies[0], name="dp4", pipelines=tuple(
        dataclasses.replace(whole, micro_batches=2, stages=(dataclasses.replace(whole.stages[0], devices=(d,)),))
        for d in range(4)))
    path = tmp_path / "zero-dp4.yaml"
    save_plan(dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero=True, zero_redundancy=2),
                                  strategies=(four,)), path)
    ref = StrategyHandle.of(load_plan_context(path))
    assert {h for sl in moment_slices(ref).values() for s in sl for h in s.holders} == {(0, 2), (1, 3)}
    return path


def test_cli_replans_an_elastic_zero_plan_after_one_holder_of_each_chunk_fails(zero_dp4, tmp_path):
    out = tmp_path / "new.yaml"
    res = CliRunner().invoke(cli, ["replan", "--plan", str(zero_dp4), "--failed", "2", "-o", str(out),
                                   "--format", "json", "--time-limit", "10"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["failed"] == [2] and data["survivors"] == [0, 1, 3]
    assert 2 not in load_plan(out).strategies[0].devices
    load_plan_context(out)


def test_cli_refuses_when_both_holders_of_a_moment_chunk_fail(zero_dp4, tmp_path):
    out = tmp_path / "new.yaml"
    res = CliRunner().invoke(cli, ["replan", "--plan", str(zero_dp4), "--failed", "0,2", "-o", str(out)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    # every parameter is still on devices 1 and 3, but chunk 0 of every slice's moments was on 0 and 2 only
    assert lines[0].startswith("error: device(s) 0, 2: the ZeRO-1 AdamW moments of ")
    assert "lost every copy of a chunk" in lines[0] and "no surviving replica" not in lines[0]
    assert "the last checkpoint is what is left" in lines[0]
    assert any(line.startswith("error:   AdamW moments of decoder layers 0-") and
               line.endswith("chunk 0 of 2 held only by failed device(s) 0, 2") for line in lines), lines
    assert "Traceback" not in res.output and not out.exists()
    # the same verdict as the coordinator's, from the same function
    failed = lost_state(StrategyHandle.of(load_plan_context(zero_dp4)), [0, 2])
    assert not failed.tensors and failed.moments and [f"error: {line}" for line in failed.details()] == lines[1:-1]
    assert lines[-1].endswith("--restart writes a plan for the surviving devices to restart from that checkpoint")
    # one holder of each chunk is no loss; a parameter's last replica still is, as before
    assert not lost_state(StrategyHandle.of(load_plan_context(zero_dp4)), [0, 1])
    res = CliRunner().invoke(cli, ["replan", "--plan", str(zero_dp4), "--failed", "0,1,2,3"])
    assert res.exit_code == 2 and "parameter(s) have no surviving replica" in res.output


def test_replan_of_an_interleaved_plan_keeps_a_micro_batch_per_stage():
    """Found with large global batches: the repair priced an interleaved pipeline of two stages on one
    micro-batch, which interleaved refuses (a traceback from replan); it starts from one per stage."""
    ctx = load_plan_context(TINY)
    inter = dataclasses.replace(ctx, plan=dataclasses.replace(
        ctx.plan, training=dataclasses.replace(ctx.plan.training, schedule="interleaved")))
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    plan, step_time = repair(StrategyHandle.of(inter, "hetero"), [1], profiles)
    (strategy,) = plan.strategies
    assert [p.devices for p in strategy.pipelines] == [(2, 3)] and strategy.pipelines[0].micro_batches == 8
    assert validate_plan(plan, ctx.model, ctx.cluster) == [] and step_time > 0
    assert replan(StrategyHandle.of(inter, "hetero"), [1], profiles, time_limit_s=5).chosen is not None
