"""The state of a run as data: what survives a failure, and the fused BSR of a switch."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.torchfree.annotations.states import intersect, volume
from runtime.torchfree.elastic.state import (
    STATE_SUFFIXES,
    check_compatible,
    describe_lost,
    lost_tensors,
    plan_switch,
    state_moves,
)
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import Pipeline, PlanContext, Stage, Strategy, load_plan_context, validate_plan
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"  # TP-2 on 0,1 | 2 -> 3
EMU8 = REPO / "tests" / "integration" / "engine_plans" / "three-pipelines.yaml"  # 8 devices of one kind


def with_strategy(ctx: PlanContext, pipelines: list[tuple[int, list[tuple[tuple[int, ...], tuple[int, int]]]]],
                  name: str = "s", micro_batch: int = 1) -> StrategyHandle:
    strat = Strategy(name, tuple(Pipeline(m, tuple(Stage(d, lay) for d, lay in stages)) for m, stages in pipelines))
    gb = sum(m for m, _ in pipelines) * micro_batch
    plan = replace(ctx.plan, training=replace(ctx.plan.training, global_batch=gb, micro_batch=micro_batch),
                   strategies=(strat,))
    problems = validate_plan(plan, ctx.model, ctx.cluster, "test")
    assert not problems, problems
    return StrategyHandle.of(PlanContext(plan, ctx.model, ctx.cluster, ctx.path), name)


def test_a_tp_shard_survives_through_the_other_pipeline():
    ref = StrategyHandle.of(load_plan_context(TINY), "hetero")
    assert lost_tensors(ref, [1]) == []
    assert lost_tensors(ref, [0, 1]) == []  # pipeline 2 -> 3 still holds everything
    lost = lost_tensors(ref, [1, 3])  # layers 3-5: TP half on 1 and the only other copy on 3
    names = {t.name for t in lost}
    assert "lm_head.weight" in names and "model.layers.3.mlp.up_proj.weight" in names
    assert not any(n.startswith(("model.layers.0.", "model.layers.2.")) for n in names)
    # A TP-duplicated norm in layers 3-5 survives on device 0 (it holds the whole of it).
    assert "model.layers.4.input_layernorm.weight" not in names
    assert describe_lost(lost)[0].startswith("decoder layers 3-5 (")


def test_describe_lost_groups_layer_runs_and_names_the_rest():
    ctx = load_plan_context(TINY)
    ref = with_strategy(ctx, [(2, [((0,), (0, 2)), ((1,), (2, 6))])])
    lines = describe_lost(lost_tensors(ref, [0]))
    assert lines == ["model.embed_tokens.weight: held only by failed device(s) 0",
                     "decoder layers 0-1 (18 tensors): held only by failed device(s) 0"]


def test_switch_moves_exactly_the_missing_tp_halves():
    ctx = load_plan_context(TINY)
    src = StrategyHandle.of(ctx, "hetero")
    dst = with_strategy(ctx, [(6, [((0,), (0, 6))]), (2, [((2,), (0, 3)), ((3,), (3, 6))])])
    plan = plan_switch(src, dst, excluded=[1])
    # Device 0 had TP rank 0's half of every split tensor; the other half (and nothing else) comes in,
    # for the parameter and both moments, fp32.
    halves = sum(math.prod(p.shape) // 2 for p in llama_parameters(ctx.model) if p.tp_dim is not None)
    assert plan.total_bytes == halves * 4 * len(STATE_SUFFIXES)
    assert {t.dst for t in plan.transfers} == {0}
    assert {t.src for t in plan.transfers} <= {2, 3}
    assert len(state_moves(src, dst)) == 3 * len(llama_parameters(ctx.model))


def test_the_same_plan_moves_nothing():
    ref = StrategyHandle.of(load_plan_context(TINY), "hetero")
    plan = plan_switch(ref, ref)
    assert plan.total_bytes == 0 and plan.transfers == ()


def test_incompatible_plans_are_refused():
    ctx = load_plan_context(TINY)
    other = replace(ctx.plan, training=replace(ctx.plan.training, seq_len=32))
    with pytest.raises(HspmdError, match="training.seq_len 64 vs 32"):
        check_compatible(ctx, PlanContext(other, ctx.model, ctx.cluster, ctx.path))
    # micro-batch size and schedule may differ
    ok = replace(ctx.plan, training=replace(ctx.plan.training, micro_batch=2, schedule="gpipe"))
    check_compatible(ctx, PlanContext(ok, ctx.model, ctx.cluster, ctx.path))


@st.composite
def strategies_and_failures(draw):
    """A random valid strategy on 8 alike devices (1-3 pipelines, 1-2 stages, TP 1 or 2), a random set of
    failed devices among the ones it uses, and a random target plan on some survivors."""
    devices = iter(range(8))
    pipelines = []
    for _ in range(draw(st.integers(1, 3))):
        n_stages = draw(st.integers(1, 2))
        cut = draw(st.integers(1, 5))
        bounds = [(0, 6)] if n_stages == 1 else [(0, cut), (cut, 6)]
        stages = []
        for lay in bounds:
            tp = draw(st.sampled_from([1, 2]))
            devs = tuple(next(devices, None) for _ in range(tp))
            if None in devs:
                return None
            stages.append((devs, lay))
        pipelines.append((n_stages, stages))
    used = sorted(d for _, stages in pipelines for devs, _ in stages for d in devs)
    failed = draw(st.sets(st.sampled_from(used), min_size=1, max_size=min(3, len(used))))
    survivors = [d for d in used if d not in failed]
    target_tp = draw(st.sampled_from([1, 2])) if len(survivors) >= 2 else 1
    return pipelines, sorted(failed), survivors[:target_tp]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(strategies_and_failures())
def test_a_switch_plan_exists_exactly_when_nothing_is_lost_and_rebuilds_every_slice(case):
    if case is None or not case[2]:
        return
    pipelines, failed, target_devs = case
    ctx = load_plan_context(EMU8)
    src = with_strategy(ctx, pipelines)
    dst = with_strategy(ctx, [(sum(m for m, _ in pipelines), [(tuple(target_devs), (0, 6))])], name="t")
    lost = lost_tensors(src, failed)
    if lost:
        with pytest.raises(HspmdError, match="no surviving owner"):
            plan_switch(src, dst, failed)
        return
    plan = plan_switch(src, dst, failed)
    assert not {t.src for t in plan.transfers} & set(failed)
    for i, tensor in enumerate(plan.tensors):
        for dev, held in tensor.dst.holdings:
            parts = [c.region for c in plan.local_copies(dev) if c.tensor == i]
            parts += [t.region for t in plan.transfers if t.dst == dev and t.tensor == i]
            # the pieces tile the destination region: they lie inside it, do not overlap, and add up
            assert all(intersect(p, held.region) == p for p in parts)
            assert sum(volume(p) for p in parts) == volume(held.region)
            assert all(intersect(a, b) is None for k, a in enumerate(parts) for b in parts[k + 1:])
        for t in (t for t in plan.transfers if t.tensor == i):
            assert intersect(t.region, tensor.src.by_device[t.src].region) == t.region  # senders own it
