"""Mixed lengths at paper scale on a CPU: sleep mode's ``seq_scale`` (blocks priced at the target's lengths) and
``memory: target`` (plans checked against the target's memory), the planner pricing a documents run's
strategies each alone and their staged switches against memory (``planner.lengths.shared``), and ``hspmd train
--dispatch-costs profiles`` handing the planner's dispatch costs to the run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetu_cli.commands.lengths_report import planner_dispatch_costs, strategies_of
from planner.cost import GIB, CostModel
from planner.costmodel.targets import sleep_target
from planner.lengths import (
    LengthSettings,
    LengthStrategy,
    StageRoom,
    build_plan,
    plan_lengths,
    shared,
    stage_rooms,
    strategy_cost,
    with_budgets,
)
from runtime.documents import length_distribution
from runtime.launch.options import TrainOptions
from runtime.torchfree.dispatch import CostModel as TokenCost
from runtime.torchfree.dispatch import PipelineCost, StageCost, StrategyCost
from runtime.torchfree.errors import InfeasibleError, SpecError
from runtime.torchfree.profiling.profile import ComputeBlock, block_seconds, resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

LONG = load_cluster("cpu-hetero4-long")
TINY = load_model("llama-tiny")


def test_seq_scale_prices_blocks_and_documents_at_the_target_lengths():
    for t in LONG.device_types:
        target = sleep_target(LONG.device_types[t].emulate)
        k = target.seq_scale
        assert k == 128 and target.memory and target.model.name == "llama-70b"
        block = ComputeBlock(layers=3, micro_batch=1, seq_len=20, backward=True, tp=2, first=True)
        at_target = dataclasses.replace(block, seq_len=20 * k)
        assert target.block_s(block) == pytest.approx(target.time_scale
                                                      * block_seconds(target.profile, target.model, at_target))
        packed = dataclasses.replace(block, documents=(5, 15))
        assert target.block_s(packed) == pytest.approx(target.time_scale * block_seconds(
            target.profile, target.model, dataclasses.replace(at_target, documents=(5 * k, 15 * k))))
        # a long document's attention is visible at the scaled lengths: two halves cost less than the whole
        whole = target.block_s(dataclasses.replace(block, documents=(200,)))
        halves = target.block_s(dataclasses.replace(block, documents=(100, 100)))
        assert halves < 0.9 * whole


def test_memory_target_prices_the_target_shapes_at_the_scaled_length():
    cm = CostModel(TINY, LONG, resolve_profiles(LONG.device_types), micro_batch=1, seq_len=256)
    target = sleep_target(LONG.device_types["emu-a800"].emulate)
    direct = CostModel(target.model, dataclasses.replace(LONG, device_types={
        t: dataclasses.replace(d, emulate=None) for t, d in LONG.device_types.items()}),
        {t: target.profile for t in LONG.device_types}, micro_batch=1, seq_len=256 * 128)
    for args in ((1, 6, True, True, False, 1), (2, 3, True, False, True, 2), (2, 3, False, True, False, 1)):
        assert cm.stage_memory("emu-a800", *args) == direct.stage_memory("emu-a800", *args)
    assert cm.chunk_activation_bytes("emu-a800", 2, 3, True, False) == \
        direct.chunk_activation_bytes("emu-a800", 2, 3, True, False)
    # The target's memory binds as on the real devices: the emulated model's state alone exceeds one A800, and
    # a 32K document on two A800s needs recompute.
    assert cm.stage_memory("emu-a800", 1, 6, True, True, False, 0).total > 80 * GIB
    assert cm.stage_memory("emu-a800", 2, 6, True, True, False, 1).total > 80 * GIB
    assert cm.stage_memory("emu-a800", 2, 6, True, True, True, 1).total < 80 * GIB
    # the real-memory sleep cluster is priced by its own (tiny) model as before
    sleep = load_cluster("cpu-hetero4-sleep")
    plain = CostModel(TINY, sleep, resolve_profiles(sleep.device_types), micro_batch=1, seq_len=256)
    assert plain.target_memory_model("emu-a800") is None
    assert plain.stage_memory("emu-a800", 1, 6, True, True, False, 1).total < 2 * GIB


def room(devices, free, token, state, in_flight=1):
    return StageRoom(tuple(devices), in_flight, float(free), float(token), float(state))


def member(name, top, rooms) -> LengthStrategy:
    pipes = tuple(PipelineCost(tuple(StageCost(TokenCost(0.0, 1e-3, 0.0), max(r.in_flight, r.budget()), 0.0)
                                     for r in pr)) for pr in rooms)
    stages = tuple(Pipeline(1, tuple(Stage(r.devices, ((0, 6),)) for r in pr)) for pr in rooms)
    return LengthStrategy(Strategy(name, stages, max_seq_len=top), StrategyCost(name, top, pipes), 0.0, name,
                          rooms=tuple(tuple(pr) for pr in rooms))


@settings(max_examples=60, deadline=None)
@given(st.floats(0, 4e3), st.floats(1.0, 8.0), st.integers(1, 3))
def test_with_budgets_are_the_rooms_own(free, token, in_flight):
    """A documents run holds only the running strategy's state: each stage's budget is its own room's free bytes
    over its bytes per token, and a stage without room for its in-flight micro-batches is refused."""
    a = member("a", 64, [[room((0,), free, token, 10.0, in_flight)]])
    if a.rooms[0][0].budget() < in_flight:
        with pytest.raises(InfeasibleError, match="no memory left for activations"):
            with_budgets(a.cost, a.rooms)
        return
    got = with_budgets(a.cost, a.rooms)
    assert got.pipelines[0].stages[0].activation_budget_tokens == math.floor(free / token)


@pytest.fixture(scope="module")
def long_plan():
    profiles = resolve_profiles(LONG.device_types)
    s = LengthSettings(tokens_per_step=2048, max_len=256, sample_steps=6)
    return profiles, s, plan_lengths(TINY, LONG, profiles, length_distribution("longtail", 256), s)


def test_the_plan_on_the_long_cluster_fits_its_switches_and_beats_the_single_plan(long_plan):
    profiles, s, result = long_plan
    assert shared(list(result.strategies), TINY, LONG, s) == list(result.strategies)
    assert result.expected_step_s <= result.single_expected_s
    # memory binds: no pipeline of the single whole-cluster plan for 32K documents is a lone device
    assert all(len(p.devices) >= 2 for p in result.single_best.strategy.pipelines)
    for ls in result.strategies:
        assert ls.cost.holds(ls.max_seq_len)


def test_dispatch_costs_profiles_are_the_planners(long_plan, tmp_path: Path):
    profiles, s, result = long_plan
    path = tmp_path / "p.yaml"
    save_plan(result.to_plan("llama-tiny", "cpu-hetero4-long"), path)
    opts = planner_dispatch_costs(TrainOptions(plan=path, lengths="longtail"), [])
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(path)
    assert opts.dispatch_costs == tuple(m.cost for m in strategies_of(ctx, profiles))
    assert [c.name for c in opts.dispatch_costs] == [x.name for x in ctx.plan.strategies]
    # --strategy: that strategy's costs alone (nothing else is allocated beside it)
    one = ctx.plan.strategies[-1].name
    solo = planner_dispatch_costs(TrainOptions(plan=path, lengths="longtail", strategy=one), [])
    assert [c.name for c in solo.dispatch_costs] == [one]
    # a fixed-window run does not dispatch
    fixed = tmp_path / "f.yaml"
    p = build_plan([result.single_best], s, "llama-tiny", "cpu-hetero4-long")
    save_plan(dataclasses.replace(p, training=dataclasses.replace(p.training, tokens_per_step=None)), fixed)
    with pytest.raises(SpecError, match="--dispatch-costs"):
        planner_dispatch_costs(TrainOptions(plan=fixed), [])


def test_plan_lengths_fixed_out_writes_the_single_plan(tmp_path: Path):
    import json

    from click.testing import CliRunner

    from hetu_cli.main import cli
    from runtime.torchfree.spec import load_plan

    out, fixed = tmp_path / "p.yaml", tmp_path / "fixed.yaml"
    r = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4-long", "--lengths",
                                 "longtail", "--tokens-per-step", "2048", "-o", str(out), "--fixed-out", str(fixed),
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    single = load_plan(fixed)
    assert report["fixed_output"] == str(fixed) and len(single.strategies) == 1
    assert single.training.tokens_per_step == 2048 and single.strategies[0].max_seq_len == 256
    assert report["speedup_over_single"] >= 1.0
    r = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4-long", "--global-batch",
                                 "8", "--seq-len", "256", "--fixed-out", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2 and "--fixed-out: only with --lengths" in r.output


def test_a_switch_that_does_not_fit_a_device_is_refused(long_plan):
    """``shared`` keeps each strategy's own budgets and refuses a set exactly by the staged switch's peak:
    with each device's room for state below its larger strategy's state (a switch's peak is at least that),
    the two-strategy set is refused; with room to spare it is accepted."""
    profiles, s, result = long_plan
    members = list(LONG_PAIR(profiles, s))
    assert shared(members, TINY, LONG, s) == members

    def squeezed(ls, factor):
        # Each device's most state bytes (parameters, AdamW moments) between steps, over the members.
        most = {d: max(sum(r.state_bytes for pipe in m.rooms for r in pipe if d in r.devices) for m in members)
                for d in range(LONG.num_devices)}
        rooms = tuple(tuple(dataclasses.replace(r, state_room=factor * max(most[d] for d in r.devices)) for r in pr)
                      for pr in ls.rooms)
        return dataclasses.replace(ls, rooms=rooms)

    assert shared([squeezed(m, 0.9) for m in members], TINY, LONG, s) is None
    assert shared([squeezed(m, 3.0) for m in members], TINY, LONG, s) is not None


def LONG_PAIR(profiles, s):
    """Two strategies of different layouts on cpu-hetero4-long: two TP-2 pipelines, and one 4-device pipeline."""
    cm = CostModel(TINY, LONG, profiles, micro_batch=1, seq_len=256)
    two = Strategy("two", (Pipeline(4, (Stage((0, 1), ((0, 6),)),)), Pipeline(4, (Stage((2, 3), ((0, 6),)),))),
                   max_seq_len=128)
    one = Strategy("one", (Pipeline(8, (Stage((0, 1), ((0, 3),)), Stage((2, 3), ((3, 6),)))),), max_seq_len=256)
    for strat in (two, one):
        yield LengthStrategy(strat, strategy_cost(cm, strat, strat.max_seq_len), 0.0, strat.name,
                             rooms=stage_rooms(cm, strat))
