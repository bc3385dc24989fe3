"""The cost model prices exactly the gradient sync the runtime runs: the same device groups, in the same
order, with the same buckets and bytes, for every plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.cost import CostModel
from runtime.torchfree.annotations.from_plan import strategy_annotations, strategy_groups
from runtime.torchfree.comm.gradsync import GRAD_ITEMSIZE, plan_sync
from runtime.torchfree.engine.specialize import specialize
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import (
    Pipeline,
    Plan,
    PlanContext,
    Stage,
    Strategy,
    TrainingSettings,
    load_cluster,
    load_model,
)
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]
CLUSTER = load_cluster(str(REPO / "tests" / "integration" / "engine_plans" / "cpu-emu8.yaml"))
MODEL = load_model("llama-tiny")
PROFILES = resolve_profiles(CLUSTER.device_types, [])


@st.composite
def handles(draw) -> StrategyHandle:
    """Random valid strategies on 8 devices: 1-3 pipelines of 1-3 stages, mixed TP 1/2/4."""
    pipes, next_dev = [], 0
    for _ in range(draw(st.integers(1, 3))):
        n_stages = draw(st.integers(1, 3))
        cuts = sorted(draw(st.sets(st.integers(1, MODEL.num_layers - 1), min_size=n_stages - 1,
                                   max_size=n_stages - 1)))
        bounds = [0, *cuts, MODEL.num_layers]
        stages = []
        for i in range(n_stages):
            tp = draw(st.sampled_from([1, 2, 4]))
            stages.append(Stage(tuple(range(next_dev, next_dev + tp)), (bounds[i], bounds[i + 1])))
            next_dev += tp
        pipes.append(Pipeline(n_stages, tuple(stages)))
    assume(next_dev <= CLUSTER.num_devices)
    training = TrainingSettings(global_batch=sum(p.micro_batches for p in pipes), micro_batch=1, seq_len=16)
    plan = Plan(1, MODEL.name, CLUSTER.name, training, (Strategy("s", tuple(pipes)),))
    return StrategyHandle.of(PlanContext(plan, MODEL, CLUSTER, REPO / "random.yaml"))


@settings(max_examples=40, deadline=None)
@given(handles())
def test_cost_model_prices_the_runtime_sync_groups(handle: StrategyHandle) -> None:
    ann = strategy_annotations(handle)
    issued = plan_sync([p.grad.layout(p.shape) for p in ann.params])  # every device filters this list
    for d in handle.devices:
        plan = specialize(handle, d)
        assert plan is not None and list(plan.grad_sync) == [b for b in issued if d in b.devices]
    runtime: list[tuple[tuple[int, ...], list[int]]] = []
    for b in issued:  # consecutive buckets of one device group: that group's buckets
        if runtime and runtime[-1][0] == b.devices:
            runtime[-1][1].append(b.numel)
        else:
            runtime.append((b.devices, [b.numel]))

    cm = CostModel.for_plan(handle.ctx.plan, MODEL, CLUSTER, PROFILES)
    priced = cm.sync_plan(handle.strategy)
    assert [(g.devices, [b.numel for b in g.buckets]) for g in priced] == runtime
    assert len({g.devices for g in priced}) == len(priced)  # one entry per group: each group priced once
    created = set(strategy_groups(handle.strategy, MODEL, handle.training))
    for g in priced:
        assert g.devices in created  # a process group the runtime creates
        # Bytes: each bucket is one all-reduce of its fp32 gradient slices (no packing cost in these profiles).
        assert all(PROFILES[t].sync_pack.seconds_per_param == 0 for t in CLUSTER.device_types)
        expect = sum(cm.allreduce_time(list(g.devices), n * GRAD_ITEMSIZE) for n in [b.numel for b in g.buckets])
        assert cm.sync_group_time(g) == pytest.approx(expect)
    if len(handle.strategy.pipelines) == 1:
        assert priced == []
