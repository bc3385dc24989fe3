"""Sleep mode with a mixture-of-experts model (configs/clusters/cpu-hetero4-sleep-moe.yaml): each device's block
targets (hetu_cli/emulation.py) carry its MoE layers priced on its target, an expert-parallel device by its own
experts' rows, and the cost model prices each chunk at its slowest device's targets, so a plan and its emulated
run agree; a dense target for a MoE model is refused."""

from __future__ import annotations

import dataclasses

import pytest

from hetu_cli.emulation import SleepBlockTargets
from planner.cost import CostModel
from planner.moe_placement import even_placement
from runtime.torchfree.errors import SpecError
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model, load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

CLUSTER = load_cluster("cpu-hetero4-sleep-moe")
MOE = load_model("moe-tiny")   # 4 experts, top-2, a shared expert, layer 0 dense
FAST, SLOW = (0, 1), (2, 3)    # emulated A800s, H20s


def plan_file(tmp_path, strategy: Strategy, cluster: str = "cpu-hetero4-sleep-moe"):
    base = load_plan("configs/plans/cpu-hetero4-moe-ep.yaml")
    plan = dataclasses.replace(base, cluster=cluster, strategies=(strategy,),
                               training=dataclasses.replace(base.training, global_batch=4, micro_batch=1))
    path = tmp_path / f"{strategy.name}.yaml"
    save_plan(plan, path)
    return path


STRATEGIES = {
    # one expert-parallel stage over both types: the fast devices hold more, expert 3 on two devices
    "mixed": Strategy("mixed", (Pipeline(4, (Stage((0, 1, 2, 3), (0, 6), experts={0: [0, 1], 1: [2, 3], 2: [3],
                                                                                     3: [1]}),)),)),
    # a type's own expert-parallel stage beside a TP-split one, recomputing
    "by_type": Strategy("by_type", (Pipeline(2, (Stage(FAST, (0, 6), experts={0: [0, 1, 2], 1: [3]}),)),
                                    Pipeline(2, (Stage(SLOW, (0, 6), recompute=True),)))),
    # two mixed stages, the first recomputing its two lowest layers (layer 0 dense, layer 1 MoE)
    "pipeline": Strategy("pipeline", (Pipeline(4, (
        Stage((0, 2), (0, 3), experts={0: [0, 1, 2], 2: [3]}, recompute_layers=2),
        Stage((1, 3), (3, 6), experts={1: [0, 1], 3: [2, 3]}))),)),
}


def chunk_args(strategy: Strategy, pi: int, si: int) -> dict:
    st = strategy.pipelines[pi].stages[si]
    a, b = st.layers[0]
    return {"chunk": 0, "layers": b - a, "first": a == 0, "last": b == MOE.num_layers}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_chunk_is_priced_at_its_slowest_devices_targets(tmp_path, name):
    strategy = STRATEGIES[name]
    ctx = load_plan_context(plan_file(tmp_path, strategy))
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, resolve_profiles(ctx.cluster.device_types))
    for pi, pipe in enumerate(strategy.pipelines):
        for si, st in enumerate(pipe.stages):
            sc, cc = cm.stage_chunk(st, 0)
            args = chunk_args(strategy, pi, si)
            per_device = {d: SleepBlockTargets().for_device(ctx, name, d) for d in st.devices}
            fwd = {d: price("forward", args) for d, price in per_device.items()}
            bwd = {d: price("backward", args) for d, price in per_device.items()}
            assert sc.forward_s == pytest.approx(max(fwd.values()), rel=1e-9)
            assert sc.backward_s == pytest.approx(max(bwd.values()), rel=1e-9)
            assert cc.full_backward == pytest.approx(sc.backward_s, rel=1e-9)
            # a split backward's halves: half the block each, on both sides
            for d, price in per_device.items():
                assert price("input_grad", args) == pytest.approx(bwd[d] / 2)
            if st.expert_parallel:   # each device lasts its own experts' rows: they differ
                assert len({round(v, 12) for v in fwd.values()}) > 1


def test_the_fast_devices_holding_more_experts_shorten_the_slowest_block(tmp_path):
    devices = (0, 1, 2, 3)
    placed = Strategy("placed", (Pipeline(4, (Stage(devices, (0, 6), experts={0: [0, 1], 1: [2, 3], 2: [3],
                                                                                3: [1]}),)),))
    even = Strategy("even", (Pipeline(4, (Stage(devices, (0, 6), experts=even_placement(devices, 4)),)),))
    slowest = {}
    for s in (placed, even):
        ctx = load_plan_context(plan_file(tmp_path, s))
        args = chunk_args(s, 0, 0)
        slowest[s.name] = max(SleepBlockTargets().for_device(ctx, s.name, d)("forward", args) for d in devices)
    assert slowest["placed"] < slowest["even"]


def test_a_dense_target_for_a_moe_model_is_refused(tmp_path):
    strategy = Strategy("ep", (Pipeline(4, (Stage(FAST, (0, 6), experts={0: [0, 1], 1: [2, 3]}),)),))
    ctx = load_plan_context(plan_file(tmp_path, strategy, cluster="cpu-hetero4-sleep"))
    with pytest.raises(SpecError, match=r"device_types\.emu-a800\.emulate\.target\.model: 'llama-32b' is a dense "
                                        r"model; moe-tiny is a mixture of experts"):
        SleepBlockTargets().for_device(ctx, "ep", 0)("forward", {})
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, resolve_profiles(ctx.cluster.device_types))
    with pytest.raises(SpecError, match="is a dense model"):
        cm.stage_chunk(strategy.pipelines[0].stages[0], 0)
