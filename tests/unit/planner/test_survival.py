"""The failure story of every plan: which single-device and whole-node losses it survives in memory, and a
plan to restart from the checkpoint when memory alone cannot continue."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from planner.survival import plan_survival, span
from runtime.torchfree.spec import load_plan_context

TWO_NODES = """name: two-nodes
device_types:
  H100: {memory_gib: 80, peak_bf16_tflops: 989, hbm_bandwidth_gbs: 3350, intra_node_bandwidth_gbs: 450}
nodes:
  - {name: n0, device_type: H100, count: 4}
  - {name: n1, device_type: H100, count: 4}
inter_node_bandwidth_gbs: 50
"""
PLAN = ["--model", "llama-7b", "--global-batch", "32", "--seq-len", "2048", "--time-limit", "3", "--check-top", "1",
        "--top-k", "3"]


def invoke(args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surv")
    (tmp / "c.yaml").write_text(TWO_NODES)
    out = {}
    for name, extra in (("default", []), ("elastic", ["--elastic"])):
        res = invoke(["plan", *PLAN, *extra, "--cluster", tmp / "c.yaml", "-o", tmp / f"{name}.yaml",
                      "--format", "json"])
        assert res.exit_code == 0, res.output
        out[name] = json.loads(res.output)
    return tmp, out


def test_the_default_plan_says_it_survives_no_single_device_loss(plans):
    tmp, out = plans
    failures = out["default"]["failures"]
    assert failures["single_device"]["survives"] == [] and failures["single_device"]["restart"]
    res = invoke(["plan", *PLAN, "--cluster", tmp / "c.yaml"])
    assert "failures: survives no single device's loss in memory" in res.output
    assert "hspmd plan --elastic keeps copies" in res.output


def test_an_elastic_plan_survives_every_single_device_loss(plans):
    tmp, out = plans
    failures = out["elastic"]["failures"]
    ctx = load_plan_context(tmp / "elastic.yaml")
    assert failures["single_device"]["survives"] == sorted(ctx.plan.strategies[0].devices)
    assert failures["single_device"]["restart"] == []
    # The report is the coordinator's own check, asked ahead: it matches plan_survival on the written plan.
    s = plan_survival(ctx.plan, ctx.model, ctx.cluster)
    assert list(s.nodes_ok) == failures["whole_node"]["survives"]


def test_replan_refuses_a_lost_state_but_says_how_to_restart(plans):
    tmp, _ = plans
    res = invoke(["replan", tmp / "default.yaml", "--failed", "1"])
    assert res.exit_code == 2, res.output
    assert "so no plan can continue from memory" in res.output and "--restart writes a plan" in res.output


def test_replan_restart_writes_a_plan_for_the_survivors(plans):
    tmp, _ = plans
    out = tmp / "restart.yaml"
    res = invoke(["replan", tmp / "default.yaml", "--failed", "1", "--restart", "-o", out, "--time-limit", "3",
                  "--format", "json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert body["restart"] is True and "memory alone cannot continue" in body["reason"]
    ctx = load_plan_context(out)
    assert 1 not in ctx.plan.strategies[0].devices and body["survivors"] == [0, 2, 3, 4, 5, 6, 7]
    text = invoke(["replan", tmp / "default.yaml", "--failed", "1", "--restart", "--time-limit", "3"])
    assert text.exit_code == 0 and "continue" in text.output and "restart plan:" in text.output


def test_span_reads_as_ranges():
    assert span([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert span([]) == ""


def test_elastic_prefers_a_layout_that_survives_a_whole_node_where_the_tolerance_allows(plans):
    tmp, out = plans
    assert out["elastic"]["failures"]["whole_node"]["survives"] == []   # the fastest keeps replicas on one node
    assert "--node-loss-tolerance" in out["elastic"]["node_choice"]       # ... and says what would survive one
    res = invoke(["plan", *PLAN, "--elastic", "--node-loss-tolerance", "0.5", "--cluster", tmp / "c.yaml", "-o",
                  tmp / "spread.yaml", "--format", "json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert body["failures"]["whole_node"]["survives"] == ["n0", "n1"]
    assert "survives the loss of 2 whole node(s)" in body["node_choice"]
    lost_node = [d for d in range(4, 8)]
    res = invoke(["replan", tmp / "spread.yaml", "--failed", ",".join(map(str, lost_node)), "--time-limit", "3"])
    assert res.exit_code == 0, res.output   # the node's loss is survived in memory


def test_spreading_puts_each_stage_positions_replicas_on_different_nodes(plans):
    from planner.survival import spread_over_nodes

    tmp, _ = plans
    ctx = load_plan_context(tmp / "elastic.yaml")
    spread = spread_over_nodes(ctx.plan.strategies[0], ctx.cluster)
    for j in range(len(spread.pipelines[0].stages)):
        nodes = {ctx.cluster.device(p.stages[j].devices[0]).node for p in spread.pipelines}
        assert len(nodes) == min(2, len(spread.pipelines))
    assert sorted(spread.devices) == sorted(ctx.plan.strategies[0].devices)


def test_node_loss_tolerance_is_only_for_elastic():
    res = invoke(["plan", *PLAN, "--cluster", "cpu-hetero4", "--node-loss-tolerance", "0.2"])
    assert res.exit_code == 2 and "--node-loss-tolerance: only with --elastic" in res.output, res.output


def test_a_node_loss_of_an_elastic_plan_does_not_advise_elastic(plans):
    tmp, out = plans
    assert "n0" in out["elastic"]["failures"]["whole_node"]["restart"]
    res = invoke(["replan", tmp / "elastic.yaml", "--failed", "0-3"])
    assert res.exit_code == 2, res.output
    assert "every replica of these sat on the failed devices" in res.output
    assert "plan with --elastic to keep" not in res.output and "--restart writes a plan" in res.output
