"""planner/trace_model.py ``model_trace``: each line's time is the sum of its parts, the restart baseline drops
whole nodes and pays what torchrun + Megatron pay (NCCL timeout for a lost node, half a checkpoint interval
redone), checkpoints follow Young's rule for the failures each line must checkpoint against (restart: every
failure; hspmd and Oobleck-like: the losses memory cannot survive, whose expected cost they are charged), and a
replan weighs switch against step time over the steps left."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner import trace_model
from planner.baselines import best_symmetric, best_symmetric_subset
from planner.cost import CostModel
from planner.replan import choose, pays, restart_cost
from planner.trace_model import MEGATRON_NCCL_TIMEOUT_S, TraceModel, model_trace, young_interval_steps
from runtime.elastic.events import parse_trace
from runtime.launch.options import ELASTIC_HEARTBEAT_TIMEOUT_S, node_loss_detect_s
from runtime.torchfree.elastic.preplan import candidates
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "configs" / "clusters" / "cpu-hetero4.yaml"
DP_PP = REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"  # 0 | 1 | 2 -> 3


def opt(step: float, nbytes: int, switch_s: float, origin: str = "planner", rank: int = 0):
    return SimpleNamespace(step_time_s=step, switch_bytes=nbytes, modelled_switch_s=switch_s, origin=origin,
                           rank=rank)


def test_with_steps_left_the_choice_minimizes_switch_plus_steps_within_the_tolerance():
    fast, near_cheap, slow_free = opt(1.00, 900, 3.0), opt(1.04, 100, 1.0, rank=1), opt(1.5, 0, 0.0, "repair")
    options = [fast, near_cheap, slow_free]
    assert choose(options, 0.05) is near_cheap  # no horizon: the fewest bytes within the tolerance
    assert choose(options, 0.05, steps_left=10) is near_cheap  # 11.4 < 13
    assert choose(options, 0.05, steps_left=100) is fast  # 103 < 105
    assert choose(options, 0.05, steps_left=0) is near_cheap  # nothing left: the cheaper switch
    assert choose(options, 1.0, steps_left=0) is slow_free  # the tolerance bounds what may be chosen
    assert choose(options, 1.0, steps_left=100) is fast


def test_pays_and_young():
    assert pays(2.0, 1.0, 10, 9.9) and not pays(2.0, 1.0, 10, 10.0) and not pays(1.0, 2.0, 100, 0.0)
    assert young_interval_steps(50.0, 5.0, 10_000.0, 0) is None
    # sqrt(2 x 50 x 10000 / 4) = 500 s = 100 steps of 5 s
    assert young_interval_steps(50.0, 5.0, 10_000.0, 4) == 100


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """cpu-hetero4 as two nodes (a: devices 0-1, b: 2-3) and the dp-pp plan on it."""
    d = tmp_path_factory.mktemp("trace-model")
    text = CLUSTER.read_text()
    head = text[:text.index("\nnodes:")].replace("name: cpu-hetero4", "name: cpu-hetero4-2node")
    cluster = d / "two-nodes.yaml"
    cluster.write_text(head + "\nnodes:\n  - {name: a, device_type: cpu-fast, count: 2}\n"
                              "  - {name: b, device_type: cpu-slow, count: 2}\n")
    p = load_plan(DP_PP)
    path = d / "plan.yaml"
    save_plan(replace(p, cluster=str(cluster), strategies=(p.strategy("dp-pp"),)), path)
    ctx = load_plan_context(path)
    return StrategyHandle.of(ctx), resolve_profiles(ctx.cluster.device_types, [])


def test_every_line_is_the_sum_of_its_parts(two_nodes):
    handle, profiles = two_nodes
    steps = 400
    trace = parse_trace({"events": [{"step": 50, "action": "kill", "node": "b"},
                                    {"step": 150, "action": "kill", "devices": [1]},
                                    {"step": 250, "action": "rejoin", "node": "b"}]},
                        handle.ctx.cluster, handle.devices, "t.yaml")
    model = TraceModel(time_limit_s=5.0)
    out = model_trace(handle, trace.events, steps, profiles, model)
    ck = restart_cost(handle.ctx.model, out["initial_step_time_s"], model.restart)
    r0 = out["restart"]["initial_step_time_s"]
    restart_interval = young_interval_steps(ck.write_s, r0, steps * r0, 2)
    assert out["restart"]["checkpoint"]["interval_steps"] == restart_interval
    assert out["restart"]["breakdown_s"]["unrecoverable_losses_expected"] == 0.0
    rates = out["checkpoint"]["failure_rates"]
    t = steps * out["initial_step_time_s"]
    assert rates == {"device_per_s": pytest.approx(1 / (4 * t)), "node_per_s": pytest.approx(1 / (2 * t))}
    for name in ("hspmd", "restart", "oobleck_like"):
        line = out[name]
        b = line["breakdown_s"]
        assert line["total_s"] == pytest.approx(sum(b.values()))
        interval = line["checkpoint"]["interval_steps"]
        assert b["checkpoint_writes"] == pytest.approx((steps // interval if interval else 0) * ck.write_s)
        assert b["unrecoverable_losses_expected"] == line["checkpoint"]["unrecoverable_losses_expected_s"]
        assert b["recoveries_and_switches"] == pytest.approx(sum(e["cost_s"] for e in line["events"]))
        for e in line["events"]:
            assert e["cost_s"] == pytest.approx(sum(e["parts_s"].values()))
    assert out["modelled_goodput_over_restart"] == pytest.approx(out["restart"]["total_s"] / out["hspmd"]["total_s"])
    # hspmd checkpoints against its expected unrecoverable losses: the layouts it ran, each at its rate (at least
    # the coordinator's node's), and is charged their expected cost.
    h = out["hspmd"]
    hc = h["checkpoint"]
    steps_s = h["breakdown_s"]["failure_free_steps"] + h["breakdown_s"]["slower_steps"]
    assert sum(x["seconds"] for x in hc["layouts"]) == pytest.approx(steps_s)
    assert all(x["losses_per_s"] >= rates["node_per_s"] for x in hc["layouts"])
    assert hc["expected_losses"] == pytest.approx(sum(x["seconds"] * x["losses_per_s"] for x in hc["layouts"]))
    assert hc["interval_steps"] == min(steps, young_interval_steps(ck.write_s, h["initial_step_time_s"], steps_s,
                                                                   hc["expected_losses"]))
    assert hc["interval_steps"] >= restart_interval  # fewer losses to checkpoint against (here both are tiny)
    per_loss = node_loss_detect_s() + ck.read_s + model.restart.restart_s
    assert h["breakdown_s"]["unrecoverable_losses_expected"] == pytest.approx(sum(
        x["seconds"] * x["losses_per_s"] * (per_loss + hc["interval_steps"] / 2 * x["step_time_s"])
        for x in hc["layouts"]))
    assert hc["recovery_window_s"] == max(e["cost_s"] for e in h["events"] if e["event"] != "rejoin")
    # the earlier accounting: every line charged restart's writes, no expected loss
    same = out["same_checkpoints"]
    assert same["interval_steps"] == restart_interval
    assert same["hspmd_total_s"] == pytest.approx(h["total_s"] - h["breakdown_s"]["checkpoint_writes"]
                                                  - h["breakdown_s"]["unrecoverable_losses_expected"]
                                                  + steps // restart_interval * ck.write_s)
    assert same["restart_total_s"] == pytest.approx(out["restart"]["total_s"])
    assert out["modelled_goodput_over_restart_same_checkpoints"] == pytest.approx(
        same["restart_total_s"] / same["hspmd_total_s"])
    # hspmd: a death seen at once, a node's loss after the agent timeout; the step in flight redone.
    node, kill, back = out["hspmd"]["events"]
    assert kill["parts_s"]["detect"] == model.detect_s
    assert node["parts_s"]["detect"] == node_loss_detect_s() == ELASTIC_HEARTBEAT_TIMEOUT_S / 2 + 0.5
    assert kill["parts_s"]["step_redone"] == pytest.approx(kill["step_time_before_s"] / 2)
    assert back["event"] == "rejoin" and (back["adopted"] == ("switch" in back["parts_s"]))
    assert not math.isnan(out["modelled_goodput_over_oobleck_like"])


def test_restart_drops_the_node_and_waits_for_the_nccl_timeout(two_nodes):
    handle, profiles = two_nodes
    trace = parse_trace({"events": [{"step": 50, "action": "kill", "node": "a"},
                                    {"step": 200, "action": "rejoin", "node": "a"}]},
                        handle.ctx.cluster, handle.devices, "t.yaml")
    # hspmd's coordinator on node b (on a, losing a would end the job: test_losing_the_coordinators_node...)
    out = model_trace(handle, trace.events, 400, profiles, TraceModel(time_limit_s=5.0, coordinator_node="b"))
    interval = out["restart"]["checkpoint"]["interval_steps"]
    lost, back = out["restart"]["events"]
    assert lost["parts_s"]["detect"] == MEGATRON_NCCL_TIMEOUT_S and lost["nodes_dropped"] == ["a"]
    assert lost["devices_after"] == 2  # node b's
    assert set(lost["parts_s"]) == {"detect", "read", "restart", "lost_work"}
    assert lost["parts_s"]["lost_work"] == pytest.approx(interval / 2 * lost["step_time_after_s"])
    assert back["adopted"] == ("write" in back["parts_s"])
    # hspmd recovers in memory (node b holds every parameter), seen after the agent timeout.
    (h_lost, _) = out["hspmd"]["events"]
    assert h_lost["parts_s"]["detect"] == node_loss_detect_s() and "restart" not in h_lost["parts_s"]
    # Oobleck-like: node a's pipelines ([0], [1]) go, [2 -> 3] takes every micro-batch; the node's return
    # re-instantiates the original plan, the returning pipelines' state broadcast over one link.
    o_lost, o_back = out["oobleck_like"]["events"]
    assert o_lost["devices_after"] == 2 and set(o_lost["parts_s"]) == {"detect", "regroup", "broadcast", "step_redone"}
    assert o_back["devices_after"] == 4 and o_back["step_time_after_s"] == out["initial_step_time_s"]
    assert o_back["parts_s"]["broadcast"] > 0


def test_a_given_checkpoint_interval_is_used(two_nodes):
    handle, profiles = two_nodes
    trace = parse_trace({"events": [{"step": 30, "action": "kill", "devices": [3]}]}, handle.ctx.cluster,
                        handle.devices, "t.yaml")
    out = model_trace(handle, trace.events, 100, profiles, TraceModel(checkpoint_interval_steps=25, time_limit_s=5.0))
    assert out["checkpoint"]["interval_rule"] == "given"
    for name in ("hspmd", "restart", "oobleck_like"):
        c = out[name]["checkpoint"]
        assert c == {**c, "interval_steps": 25, "writes": 4, "unrecoverable_losses_expected_s": 0.0}
    assert out["modelled_goodput_over_restart"] == pytest.approx(out["modelled_goodput_over_restart_same_checkpoints"])
    with pytest.raises(ValueError):
        TraceModel(checkpoint_interval_steps=0)
    with pytest.raises(ValueError):
        TraceModel(recovery_window_s=-1.0)


def test_losing_the_coordinators_node_restarts_hspmd_from_its_checkpoint(two_nodes):
    handle, profiles = two_nodes
    trace = parse_trace({"events": [{"step": 50, "action": "kill", "node": "a"}]}, handle.ctx.cluster,
                        handle.devices, "t.yaml")
    model = TraceModel(time_limit_s=5.0, recovery_window_s=4.0)  # the coordinator: node a, the first
    out = model_trace(handle, trace.events, 400, profiles, model)
    (lost,) = out["hspmd"]["events"]
    assert lost["restarted"] == "the coordinator's node lost"
    assert set(lost["parts_s"]) == {"detect", "read", "restart", "lost_work"}
    hc = out["hspmd"]["checkpoint"]
    assert hc["recovery_window_s"] == 4.0 and out["checkpoint"]["coordinator_node"] == "a"
    assert lost["parts_s"]["lost_work"] == pytest.approx(hc["interval_steps"] / 2 * lost["step_time_after_s"])
    with pytest.raises(HspmdError, match="coordinator_node: 'c' is not a node"):
        model_trace(handle, trace.events, 400, profiles, TraceModel(coordinator_node="c"))


def test_megatron_restart_runs_the_best_symmetric_plan_on_the_whole_nodes_left(two_nodes):
    handle, profiles = two_nodes
    steps = 400
    trace = parse_trace({"events": [{"step": 50, "action": "kill", "node": "a"}]}, handle.ctx.cluster,
                        handle.devices, "t.yaml")
    model = TraceModel(time_limit_s=5.0, coordinator_node="b")
    out = model_trace(handle, trace.events, steps, profiles, model)
    t = handle.ctx.plan.training

    def symmetric_s(devices):  # Megatron's layout: the best symmetric plan, over all of them or one type's
        cms = {b: CostModel(handle.ctx.model, handle.ctx.cluster, profiles, micro_batch=b, seq_len=t.seq_len)
               for b in (1, 2, 4, 8) if t.global_batch % b == 0}
        found = [f(cms, devices, t.global_batch, 1) for f in (best_symmetric, best_symmetric_subset)]
        return min(b.estimate.step_time_s for b in found if b.estimate is not None)

    s0, s1 = symmetric_s([0, 1, 2, 3]), symmetric_s([2, 3])  # node a (0, 1) lost at step 50
    ck = restart_cost(handle.ctx.model, out["initial_step_time_s"], model.restart)
    interval = min(young_interval_steps(ck.write_s, s0, steps * s0, 1) or steps, steps)
    lost = MEGATRON_NCCL_TIMEOUT_S + ck.read_s + model.restart.restart_s + interval / 2 * s1
    total = 49 * s0 + (steps - 49) * s1 + lost + steps // interval * ck.write_s
    m = out["megatron_restart"]
    assert m["initial_step_time_s"] == pytest.approx(s0)
    (e,) = m["events"]
    assert e["step_time_after_s"] == pytest.approx(s1) and e["devices_after"] <= 2 and e["nodes_dropped"] == ["a"]
    assert e["cost_s"] == pytest.approx(lost)
    assert m["checkpoint"]["interval_steps"] == interval
    assert m["total_s"] == pytest.approx(total)
    assert out["modelled_goodput_over_megatron_restart"] == pytest.approx(total / out["hspmd"]["total_s"])
    # the planned restart line is unchanged by it, and can be left out
    alone = model_trace(handle, trace.events, steps, profiles, replace(model, megatron_restart=False))
    assert "megatron_restart" not in alone and "modelled_goodput_over_megatron_restart" not in alone
    assert alone["restart"]["total_s"] == pytest.approx(out["restart"]["total_s"])


def test_a_loss_planned_ahead_costs_a_lookup_when_the_layout_ran_long_enough_to_plan_it(two_nodes, monkeypatch):
    handle, profiles = two_nodes
    switches = []  # the devices lost of every fused BSR planned (the Oobleck-like line plans one per event too)
    real_plan_switch = trace_model.plan_switch

    def plan_switch(source, target, failed):
        switches.append(set(failed))
        return real_plan_switch(source, target, failed)

    monkeypatch.setattr(trace_model, "plan_switch", plan_switch)
    trace = parse_trace({"events": [{"step": 150, "action": "kill", "devices": [1]},
                                    {"step": 300, "action": "kill", "devices": [0, 2]}]},
                        handle.ctx.cluster, handle.devices, "t.yaml")
    on = model_trace(handle, trace.events, 400, profiles, TraceModel(time_limit_s=5.0, coordinator_node="b"))
    first, second = on["hspmd"]["events"]
    # device 1 alone is a candidate of the layout; it is planned ahead when 149 steps at the layout's step time
    # cover one replan per candidate (each device, and each node with two of the layout's devices) at this
    # event's planner wall time
    n = len(candidates(handle, set(range(4))))
    ran = 149 * first["step_time_before_s"]
    assert first["preplanned"] == (ran >= n * first["planner_wall_s"])
    # planned ahead, the loss is charged the lookup's own time, not the planner's (both are wall times: no order
    # between them is asserted); devices 0 and 2 together are neither one device nor one node: planned at the failure
    assert (first["parts_s"]["replan"] == first["planner_wall_s"]) != first["preplanned"]
    assert first["cost_s"] == pytest.approx(sum(first["parts_s"].values()))
    assert not second["preplanned"] and second["parts_s"]["replan"] == second["planner_wall_s"]
    # without it every replan is charged the planner's wall time, and nothing is looked up: the one fused BSR
    # fewer is the lookup's
    with_lookup = list(switches)
    switches.clear()
    off = model_trace(handle, trace.events, 400, profiles,
                      TraceModel(time_limit_s=5.0, coordinator_node="b", preplan=False))
    assert sorted(map(sorted, with_lookup)) == sorted(map(sorted, switches + ([{1}] if first["preplanned"] else [])))
    assert all(e["parts_s"]["replan"] == e["planner_wall_s"] and not e["preplanned"]
               for e in off["hspmd"]["events"] if "planner_wall_s" in e)


def test_a_return_decided_ahead_costs_a_lookup_and_the_modelled_switch(two_nodes):
    """A plan on devices 0 | 2 -> 3 (device 1, node a, out of the world) and device 1 returning late in a long
    run: the coordinator plans the layout's 4 losses (0, 2, 3, node b's {2, 3}) then its 1 return ({1}) ahead,
    5 plans, far less than the 9999 steps it ran."""
    handle, profiles = two_nodes
    p = handle.ctx.plan
    pipes = p.strategies[0].pipelines
    three = replace(p.strategies[0], name="no1", pipelines=(replace(pipes[0], micro_batches=5), pipes[2]))
    ctx = replace(handle.ctx, plan=replace(p, strategies=(three,)))
    h = StrategyHandle.of(ctx)
    assert h.devices == (0, 2, 3)
    assert len(candidates(h, {0, 1, 2, 3})) == 4
    trace = parse_trace({"events": [{"step": 10_000, "action": "rejoin", "devices": [1]}]}, ctx.cluster,
                        h.devices, "t.yaml")
    on = model_trace(h, trace.events, 12_000, profiles, TraceModel(time_limit_s=5.0, coordinator_node="b"))
    off = model_trace(h, trace.events, 12_000, profiles,
                      TraceModel(time_limit_s=5.0, coordinator_node="b", preplan=False))
    (back,) = on["hspmd"]["events"]
    ran = 9_999 * back["step_time_before_s"]
    assert ran >= 5 * back["planner_wall_s"]  # the premise: the layout ran long enough to plan all 5
    assert back["preplanned"] is True
    if back["adopted"]:  # the lookup plus the planning of its fused BSR, then the modelled switch
        assert set(back["parts_s"]) == {"decide", "switch"}
        assert back["parts_s"]["decide"] != back["planner_wall_s"]  # its own wall time, not the planner's
    else:  # a lookup: the decision to stay was made ahead
        assert back["parts_s"] == {"decide": 0.0}
    assert back["cost_s"] == pytest.approx(sum(back["parts_s"].values()))
    (fresh,) = off["hspmd"]["events"]
    assert fresh["preplanned"] is False and fresh["parts_s"]["decide"] == fresh["planner_wall_s"]
    assert fresh["adopted"] == back["adopted"]
    if back["adopted"]:  # the same modelled switch either way
        assert fresh["parts_s"]["switch"] == pytest.approx(back["parts_s"]["switch"])
    # a return at step 2: one step of the layout cannot have covered 5 plans at the planner's wall time
    early = parse_trace({"events": [{"step": 2, "action": "rejoin", "devices": [1]}]}, ctx.cluster, h.devices,
                        "t.yaml")
    (first,) = model_trace(h, early.events, 100, profiles,
                           TraceModel(time_limit_s=5.0, coordinator_node="b"))["hspmd"]["events"]
    assert first["preplanned"] == (first["step_time_before_s"] >= 5 * first["planner_wall_s"])
