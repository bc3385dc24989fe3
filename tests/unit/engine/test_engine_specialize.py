"""Specialization, for every plan: devices' roles, batch shares, shards and the program description."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetu_cli.main import cli
from runtime.torchfree.annotations.from_plan import strategy_annotations
from runtime.torchfree.engine.describe import describe_program
from runtime.torchfree.engine.specialize import parameter_shards, stage_role
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, schedule_layout
from runtime.torchfree.spec import (
    OptimizerSettings,
    Pipeline,
    Plan,
    PlanContext,
    Stage,
    Strategy,
    TrainingSettings,
    load_cluster,
    load_model,
    load_plan_context,
    validate_plan,
)
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]
ENGINE_PLANS = REPO / "tests" / "integration" / "engine_plans"
MODEL = load_model("llama-tiny")
CLUSTER = load_cluster(str(ENGINE_PLANS / "cpu-emu8.yaml"))


@st.composite
def plans(draw) -> PlanContext:
    """Random valid strategies of llama-tiny on 8 devices: 1-3 pipelines of 1-3 stages, TP 1/2/4, each
    pipeline with its own schedule (and so 1-3 chunks per stage, placed as the schedule places them)."""
    micro_batch = draw(st.integers(1, 2))
    pipes, next_dev = [], 0
    for _ in range(draw(st.integers(1, 3))):
        n_stages = draw(st.integers(1, 3))
        name = draw(st.sampled_from(SCHEDULE_NAMES))
        chunks = {"interleaved": draw(st.integers(1, 3)), "zb-v": 2}.get(name, 1)
        assume(n_stages * chunks <= MODEL.num_layers)
        layout = schedule_layout(name, n_stages, chunks)
        n = layout.num_stages
        cuts = sorted(draw(st.sets(st.integers(1, MODEL.num_layers - 1), min_size=n - 1, max_size=n - 1)))
        bounds = [0, *cuts, MODEL.num_layers]
        stages = []
        for i in range(n_stages):
            tp = draw(st.sampled_from([1, 2, 4]))
            devices = tuple(range(next_dev, next_dev + tp))
            next_dev += tp
            ranges = tuple((bounds[j], bounds[j + 1]) for j in (layout.stage(i, c) for c in range(chunks)))
            stages.append(Stage(devices, ranges, recompute=draw(st.booleans())))
        pipes.append(Pipeline(draw(st.integers(n_stages, n_stages + 3)), tuple(stages), schedule=name))
    assume(next_dev <= CLUSTER.num_devices)
    training = TrainingSettings(global_batch=sum(p.micro_batches for p in pipes) * micro_batch,
                                micro_batch=micro_batch, seq_len=16, optimizer=OptimizerSettings())
    plan = Plan(1, "llama-tiny", "cpu-emu8", training, (Strategy("s", tuple(pipes)),))
    assert validate_plan(plan, MODEL, CLUSTER) == [], validate_plan(plan, MODEL, CLUSTER)
    return PlanContext(plan, MODEL, CLUSTER, ENGINE_PLANS / "random.yaml")


@settings(max_examples=40, deadline=None)
@given(plans())
def test_every_element_has_one_primary_copy_and_the_batch_is_partitioned(ctx: PlanContext) -> None:
    handle = StrategyHandle.of(ctx)
    strategy = handle.strategy
    ann = strategy_annotations(handle)
    counts = {p.name: torch.zeros(p.shape, dtype=torch.int32) for p in llama_parameters(MODEL)}
    per_pipeline = {(pi, p.name): torch.zeros(p.shape, dtype=torch.int32)
                    for pi in range(len(strategy.pipelines)) for p in llama_parameters(MODEL)}
    rows = torch.zeros(ctx.plan.training.global_batch, dtype=torch.int32)
    for d in strategy.devices:
        role = stage_role(handle, d)
        assert role is not None and role.device == d
        if role.tp_rank == 0 and role.embed:
            for mb in range(role.micro_batches):
                start = role.first_sample + mb * role.micro_batch   # the rows micro-batch mb takes
                rows[start:start + role.micro_batch] += 1
        # parameter_shards checks each region against DTensor's Shard slice of this TP rank.
        for s in parameter_shards(MODEL, role, ann):
            assert s.local_shape == tuple(torch.empty(s.info.shape)[s.region].shape)
            if s.primary:
                counts[s.name][s.region] += 1
            if role.tp_rank == 0 or s.info.tp_dim is not None:
                per_pipeline[(role.pipeline, s.name)][s.region] += 1
    assert bool((rows == 1).all()), "pipelines' shares must partition the global batch"
    for name, c in counts.items():
        assert bool((c == 1).all()), f"{name}: primary copies must tile the tensor exactly once"
    for key, c in per_pipeline.items():
        assert bool((c == 1).all()), f"pipeline {key[0]} must hold all of {key[1]} exactly once"


@settings(max_examples=15, deadline=None)
@given(plans())
def test_every_device_program_can_be_described(ctx: PlanContext) -> None:
    strategy = ctx.plan.strategies[0]
    for d in range(CLUSTER.num_devices):
        desc = describe_program(StrategyHandle(ctx, strategy), d)
        if d not in strategy.devices:
            assert desc.role is None and not desc.ops
            continue
        pi = desc.role.pipeline
        sched = StrategyHandle(ctx, strategy).pipeline_schedule(pi)
        ops = ("forward", "input_grad", "weight_grad") if sched.split_backward else ("forward", "backward")
        computes = [o for o in desc.ops if o.kind == "compute" and o.name.startswith(ops)]
        assert len(computes) == len(ops) * desc.role.micro_batches * len(desc.role.chunks)
        assert [c.layers for c in desc.role.chunks] == list(strategy.pipelines[pi].stages[desc.role.stage].layers)
        # Exactly the chunks holding the first and the last layer embed and hold the head.
        assert [c.embed for c in desc.role.chunks] == [c.layers[0] == 0 for c in desc.role.chunks]
        assert [c.head for c in desc.role.chunks] == [c.layers[1] == MODEL.num_layers for c in desc.role.chunks]
        assert desc.ops[-1].name == "optimizer"


def test_tp2_to_tp1_boundary_is_described_with_its_messages() -> None:
    ctx = load_plan_context(ENGINE_PLANS / "tp2-tp1.yaml")
    d2 = describe_program(StrategyHandle.of(ctx, "tp2-tp1"), 2)
    assert d2.holds == "layers 4-5, final norm + head + loss"
    comm = [o for o in d2.ops if o.kind == "comm" and "recv_forward" in o.name]
    assert comm and all("recv" in o.detail and "from 0" in o.detail for o in comm)
    back = [o for o in d2.ops if o.kind == "comm" and "send_backward" in o.name]
    # The gradient goes back to both TP ranks of the earlier stage.
    assert back and all("to 0" in o.detail and "to 1" in o.detail for o in back)
    d1 = describe_program(StrategyHandle.of(ctx, "tp2-tp1"), 1)
    assert [p.local_shape for p in d1.params if p.name == "model.embed_tokens.weight"] == [(128, 64)]
    assert any("nothing for this device" in o.detail for o in d1.ops if "send_forward" in o.name)


def test_show_device_cli() -> None:
    plan = str(ENGINE_PLANS / "two-pipelines.yaml")
    res = CliRunner().invoke(cli, ["show", "--device", "4", plan])
    assert res.exit_code == 0, res.output
    assert "pipeline 1 stage 0" in res.output and "send_forward mb0" in res.output
    res = CliRunner().invoke(cli, ["show", "--device", "0", "--format", "json", plan])
    assert res.exit_code == 0, res.output
    import json

    data = json.loads(res.output)
    prog = data["programs"][0]
    assert prog["role"]["tp_group"] == [0, 1, 2, 3]
    assert any(o["name"].startswith("grad all-reduce") for o in prog["ops"])
    res = CliRunner().invoke(cli, ["show", "--device", "8", plan])
    assert res.exit_code == 2 and "unknown device id 8" in res.output


def test_show_device_says_which_order_the_schedule_runs() -> None:
    """The published order where it is faster on the plan's op costs, else the list scheduler's (layer counts
    stand in for op costs the plan does not give)."""
    repo = Path(__file__).resolve().parents[3]
    textbook = repo / "tests" / "integration" / "engine_plans" / "1f1b-textbook-hetero4.yaml"
    res = CliRunner().invoke(cli, ["show", str(textbook), "--device", "1", "--format", "json"])
    assert res.exit_code == 0, res.output
    (prog,) = json.loads(res.output)["programs"]
    assert (prog["order"], prog["order_by"]) == ("Megatron's 1F1B order", "the plan's op costs")
    res = CliRunner().invoke(cli, ["show", str(repo / "configs" / "plans" / "cpu-hetero4-tiny.yaml"), "--device", "2",
                                   "--format", "json"])
    assert res.exit_code == 0, res.output
    (prog,) = json.loads(res.output)["programs"]
    assert prog["order"] == "the list scheduler's order"
    assert prog["order_by"] == "layer counts: the plan gives no op costs"
    res = CliRunner().invoke(cli, ["show", str(textbook), "--device", "1"])
    assert res.exit_code == 0 and "Megatron's 1F1B order" in res.output, res.output
