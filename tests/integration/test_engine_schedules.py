"""Interleaved 1F1B, ZB-H1 and ZB-V plans train exactly like the single-process reference, and a
checkpoint saved under one schedule continues under another.

One 4-process gloo world (cpu-hetero4's devices) serves the module; the reference is computed here from
the same initial weights and batches, at the engine tests' tolerances (test_engine_correctness.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_world import EngineWorld
from test_engine_correctness import PLANS, check_against_reference, check_saved, make_batches

from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.pipeline_schedules import check_schedule, schedule_timeline
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle, plan_costs, plan_schedule


@pytest.fixture(scope="module")
def world():
    w = EngineWorld(4)
    yield w
    w.close()


CASES = ["interleaved-hetero4.yaml", "zb-h1-hetero4.yaml", "zb-h1-tp-hetero4.yaml", "zb-v-hetero4.yaml",
         "zb-h1-costs-hetero4.yaml", "zb-h1-limits-hetero4.yaml", "zb-h1-partial-hetero4.yaml",
         "1f1b-textbook-hetero4.yaml", "interleaved-textbook-hetero4.yaml", "1f1b-few-hetero4.yaml"]


@pytest.mark.parametrize("plan", CASES, ids=[p.removesuffix("-hetero4.yaml") for p in CASES])
def test_schedule_matches_single_device_reference(world: EngineWorld, plan: str) -> None:
    path = PLANS / plan
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches)
    check_against_reference(path, results, batches)
    # The plans really run what they name: chunks per device and split backwards where expected.
    handle = StrategyHandle.of(ctx)
    for r in results.values():
        role = r.description["role"]
        sched = handle.pipeline_schedule(role["pipeline"])
        assert r.description["schedule"] == sched.name
        assert len(role["chunks"]) == sched.layout.chunks
        assert ("input_grad" in [n for _, n in r.spans]) == sched.split_backward
    if plan == "zb-h1-costs-hetero4.yaml":   # its op costs order the lists (not the layer counts)
        uncosted = dataclasses.replace(ctx.plan.strategies[0].pipelines[0], stages=tuple(
            dataclasses.replace(st, op_costs=None) for st in ctx.plan.strategies[0].pipelines[0].stages))
        assert plan_schedule(uncosted, "zb-h1", 6).actions != handle.pipeline_schedule(0).actions
    if plan.endswith("-textbook-hetero4.yaml"):   # the published order is faster there, and is what ran
        pipe = ctx.plan.strategies[0].pipelines[0]
        sched = handle.pipeline_schedule(0)
        args = (sched.name, len(pipe.stages), pipe.micro_batches, sched.layout.chunks, plan_costs(pipe))
        assert sched.timeline == schedule_timeline(*args, source="textbook") != schedule_timeline(*args, source="list")
    if plan == "zb-h1-partial-hetero4.yaml":   # partial recompute: the stage's lowest layers checkpointed
        recomputed = {r.description["role"]["stage"]: r.description["role"]["chunks"][0]["recomputed"]
                      for r in results.values()}
        assert recomputed == {0: [], 1: [1, 2], 2: [4]}
    if plan == "zb-h1-limits-hetero4.yaml":   # its raised limits change the lists, and are used
        pipe = ctx.plan.strategies[0].pipelines[0]
        own = plan_schedule(dataclasses.replace(pipe, activation_limits=None), "zb-h1", 6)
        raised = handle.pipeline_schedule(0)
        assert own.actions != raised.actions
        peak = check_schedule(raised.actions, raised.layout, 6, split_backward=True).peak_live
        assert any(p > b for p, b in zip(peak, own.activation_limits()))
        assert all(p <= b for p, b in zip(peak, raised.activation_limits()))


@pytest.mark.parametrize("then", ["interleaved-hetero4.yaml", "zb-h1-hetero4.yaml"])
def test_checkpoint_continues_across_schedules(world: EngineWorld, tmp_path: Path, then: str) -> None:
    """Saved after two 1F1B steps (the interleaved plan's devices, one chunk per stage), continued for one
    step under ``then``: equal to the reference run uninterrupted, checkpoint included."""
    first, second = PLANS / "1f1b-hetero4.yaml", PLANS / then
    ctx1, ctx2 = load_plan_context(first), load_plan_context(second)
    assert ctx1.plan.training.optimizer == ctx2.plan.training.optimizer  # one reference serves both
    assert StrategyHandle.of(ctx1).schedule_name(0) == "1f1b"
    ref = ReferenceTrainer(ctx1.model, ctx1.plan.training)
    saved, again = tmp_path / "1f1b", tmp_path / "next"
    batches = make_batches(ctx1, 2)
    check_against_reference(first, world.train(str(first), batches, save_dir=str(saved)), batches, ref=ref,
                            steps=2)
    check_saved(saved, ref, 2)
    batches = make_batches(ctx2, 1)
    results = world.train(str(second), batches, load_dir=str(saved), save_dir=str(again), first_step=3)
    check_against_reference(second, results, batches, ref=ref, steps=3)
    check_saved(again, ref, 3)


def test_bf16_weight_copies_are_made_once_per_step_not_per_micro_batch(world: EngineWorld) -> None:
    """Under bf16 autocast each weight's bf16 copy is shared by every micro-batch in flight (one per
    micro-batch would be 2 bytes per parameter per in-flight micro-batch, which the cost model does not
    count), and sharing it changes no number."""
    from engine_world import bf16_weight_copies_job

    path = PLANS / "zb-h1-tp-hetero4.yaml"
    ctx = load_plan_context(path)
    batches = [b.numpy() for b in make_batches(ctx, 2)]
    run = world.world.run
    shared = {r[0]: r for r in run(bf16_weight_copies_job, str(path), batches, True, timeout_s=180) if r}
    per_mb = {r[0]: r for r in run(bf16_weight_copies_job, str(path), batches, False, timeout_s=180) if r}
    for dev, (_, losses, copies, weights) in sorted(shared.items(), reverse=True):
        assert copies <= weights, (dev, copies, weights)
        assert losses == per_mb[dev][1]          # the same casts: bitwise the same training
    first = 3                                     # stage 0 (no recompute) keeps 3 micro-batches in flight
    assert per_mb[first][2] > 2 * shared[first][2], (per_mb[first], shared[first])
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, precision="bf16")
    want = [ref.train_step(torch.from_numpy(b)).loss for b in batches]
    for _, losses, _, _ in shared.values():
        assert losses == pytest.approx(want, rel=1e-2)
