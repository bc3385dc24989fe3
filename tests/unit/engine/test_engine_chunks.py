"""Specialization with several chunks per stage: virtual stages, embedding / head placement, routes per
virtual-stage boundary and parameter ownership (torch-free: the engine's plan, not its run)."""

from __future__ import annotations

from pathlib import Path

from runtime.torchfree.annotations.from_plan import strategy_annotations
from runtime.torchfree.engine.describe import describe_program
from runtime.torchfree.engine.specialize import specialize
from runtime.torchfree.pipeline_schedules import Compute, PostSend, WaitSends
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

PLANS = Path(__file__).resolve().parents[3] / "tests" / "integration" / "engine_plans"


def handle(name: str) -> StrategyHandle:
    return StrategyHandle.of(load_plan_context(PLANS / name))


def test_zb_v_puts_embedding_and_head_on_the_first_device() -> None:
    h = handle("zb-v-hetero4.yaml")
    plan = specialize(h, 0)
    assert plan is not None
    role = plan.role
    assert [(c.stage, c.layers, c.embed, c.head) for c in role.chunks] == [(0, (0, 1), True, False),
                                                                          (5, (5, 6), False, True)]
    assert role.embed and role.head
    # Device 0 talks across boundaries 0 (to device 1) and 4 (from device 1); device 2's two chunks are
    # virtual stages 2 and 3: the boundary between them is handed over in memory, no route.
    assert sorted(plan.routes) == [0, 4]
    p2 = specialize(h, 2)
    assert p2 is not None and sorted(p2.routes) == [1, 3]
    assert not any(isinstance(a, PostSend) and {a.message.src_stage, a.message.dst_stage} == {2, 3}
                   for a in p2.actions)
    # The tied embedding is one parameter on device 0 (the lookup in chunk 0, the head in chunk 1).
    names = [s.name for s in plan.shards]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    ann = strategy_annotations(h)
    assert [(b.stage, b.src_stage, b.dst_stage) for b in ann.boundaries if b.pipeline == 0] == [
        (0, 0, 1), (1, 1, 2), (3, 2, 1), (4, 1, 0)]
    # Labels live where the loss is computed: pipeline 0's first stage, pipeline 1's only one.
    assert sorted(ann.labels.devices) == [0, 3] and sorted(ann.tokens.devices) == [0, 3]


def test_interleaved_routes_include_the_wrap_around() -> None:
    h = handle("interleaved-hetero4.yaml")
    plan = specialize(h, 2)  # stage 1: virtual stages 1 and 3
    assert plan is not None
    assert [c.stage for c in plan.role.chunks] == [1, 3] and plan.role.head and not plan.role.embed
    assert sorted(plan.routes) == [0, 1, 2]  # 0->1 in, 1->2 out to stage 0 (the wrap), 2->3 in
    assert plan.routes[1].boundary.src_stage == 1 and plan.routes[1].boundary.dst_stage == 0
    # Its list is the schedule's, for its stage: F, BW of each (micro-batch, chunk) once, WaitSends last.
    computes = [a for a in plan.actions if isinstance(a, Compute)]
    assert sorted((a.kind, a.micro_batch, a.chunk) for a in computes) == sorted(
        (k, mb, c) for k in ("F", "BW") for mb in range(4) for c in range(2))
    assert isinstance(plan.actions[-1], WaitSends)
    # The one-stage pipeline has nothing to send: no WaitSends.
    p3 = specialize(h, 3)
    assert p3 is not None and p3.routes == {} and all(isinstance(a, Compute) for a in p3.actions)
    assert p3.role.chunks[0].embed and p3.role.chunks[1].head


def test_device_description_lists_the_new_actions() -> None:
    d = describe_program(handle("zb-h1-hetero4.yaml"), 2)
    names = [o.name for o in d.ops]
    assert "post recv_forward mb0 stage 0->1" in names and "wait recv_forward mb0 stage 0->1" in names
    assert "input_grad mb0" in names and "weight_grad mb0" in names
    assert names.index("input_grad mb0") < names.index("post send_backward mb0 stage 1->0") < \
        names.index("weight_grad mb0")
    assert d.schedule == "zb-h1" and describe_program(handle("zb-h1-hetero4.yaml"), 3).schedule == "1f1b"


def test_show_device_prints_the_action_list() -> None:
    from click.testing import CliRunner

    from hetu_cli.main import cli

    res = CliRunner().invoke(cli, ["show", "--device", "2", str(PLANS / "interleaved-hetero4.yaml")])
    assert res.exit_code == 0, res.output
    assert "schedule interleaved" in res.output
    assert "forward mb0 chunk 1" in res.output and "post send_forward mb0 stage 1->2" in res.output
    assert "wait sends" in res.output
