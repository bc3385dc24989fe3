"""The discrete-event simulator against the closed forms it must reproduce, and its outputs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hetu_cli.main import cli
from planner.cost import CostModel, pipeline_time, planner_handle
from planner.simulate import EventLoop, OpKind, SimOp, chrome_trace, simulate, tp_block_split
from runtime.pipeline_schedules import PostSend
from runtime.profiling.profile import (
    CommFigures,
    ComponentFit,
    CoreHandoff,
    MeasuredModel,
    P2pActions,
    ProfileSet,
    ResolvedProfile,
    ResumePenalty,
    SharingCurve,
    save_profile,
    spec_profile,
)
from runtime.spec import load_cluster, load_model
from runtime.spec.plan import Pipeline, Stage, Strategy
from runtime.spec.schema import MAX_FIGURE

TINY = load_model("llama-tiny")
CPU4 = load_cluster("cpu-hetero4")
# The same devices with the fastest links the spec allows: transfers cost practically only their latency.
FAST_LINKS = dataclasses.replace(CPU4, device_types={
    k: dataclasses.replace(v, intra_node_bandwidth_gbs=MAX_FIGURE) for k, v in CPU4.device_types.items()})
PLANS = Path(__file__).resolve().parents[3] / "configs" / "plans"


def profiles(layer_fwd: float = 1.0, layer_bwd: float = 2.0, latency: float = 0.0, extras: bool = False,
             slow: float = 1.0) -> ProfileSet:
    """llama-tiny with round-number layer costs; free embedding/head unless ``extras``; ``slow``
    stretches the cpu-slow type; optimizer 1 us per parameter."""
    out = {}
    for t in CPU4.device_types:
        k = slow if t == "cpu-slow" else 1.0
        z = ComponentFit((0, 0, 0), (0, 0, 0), (0, 0, 0), params=0)
        comps = {"attention": ComponentFit((0, 0, layer_fwd * k), (0, 0, layer_bwd * k), (0, 100, 0), params=1000),
                 "mlp": z, "norm": z,
                 "embedding": ComponentFit((0, 0, 0.3 * k), (0, 0, 0.1 * k), (0, 0, 0), 10) if extras else z,
                 "head": ComponentFit((0, 0, 0.4 * k), (0, 0, 0.9 * k), (0, 0, 0), 10) if extras else z}
        mm = MeasuredModel(64, 128, 8, 4, 256, 1, (64,), {1: comps, 2: comps})
        base = spec_profile(t, peak_tflops=1, hbm_bandwidth_gbs=10, memory_gib=2, note="t", emulated=True)
        out[t] = ResolvedProfile(dataclasses.replace(
            base, provenance="measured", models={"tiny": mm},
            comm=CommFigures(p2p_latency_s=latency, allreduce_latency_s=latency, bandwidth_efficiency=1.0),
            optimizer=dataclasses.replace(base.optimizer, seconds_per_param=1e-6, fixed_s=0.0)), None)
    return ProfileSet(out)


def cost_model(ps: ProfileSet, step_allreduce: bool = False) -> CostModel:
    return CostModel(TINY, FAST_LINKS, ps, micro_batch=1, seq_len=64, step_allreduce=step_allreduce)


def chain(m: int, layers: list[int], devices: list[int] | None = None) -> Strategy:
    devices = devices or list(range(len(layers)))
    bounds = [sum(layers[:i]) for i in range(len(layers) + 1)]
    stages = tuple(Stage((d,), (bounds[i], bounds[i + 1])) for i, d in enumerate(devices))
    return Strategy("s", (Pipeline(m, stages),))


def played(r, stage: int) -> list[tuple[str, int]]:
    """The (F/B, micro-batch) compute blocks a simulated stage ran, in time order."""
    return [(e.name[0], e.micro_batch) for e in r.events if e.stage == stage and e.category in ("forward", "backward")]


def test_schedule_orders():
    cm = cost_model(profiles())
    one = simulate(cm, chain(3, [3, 3]), 3, "1f1b")
    assert played(one, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert played(one, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert played(simulate(cm, chain(2, [3, 3]), 2, "gpipe"), 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def chunked(m: int, chunk_layers: list[list[tuple[int, int]]], schedule: str) -> Strategy:
    """One pipeline of one-device stages holding the given chunks, under ``schedule``."""
    return Strategy("s", (Pipeline(m, tuple(Stage((d,), tuple(r)) for d, r in enumerate(chunk_layers)), schedule),))


# (schedule, micro-batches, per stage its chunks) on llama-tiny's 6 layers, uneven chunks included.
RUNTIME_CASES = [("1f1b", 3, [[(0, 6)]]), ("1f1b", 2, [[(0, 3)], [(3, 6)]]),
                 ("gpipe", 5, [[(0, 2)], [(2, 4)], [(4, 6)]]),
                 ("1f1b", 4, [[(0, 1)], [(1, 2)], [(2, 4)], [(4, 6)]]), ("zb-h1", 5, [[(0, 2)], [(2, 4)], [(4, 6)]]),
                 ("interleaved", 4, [[(0, 2), (3, 5)], [(2, 3), (5, 6)]]),
                 ("interleaved", 3, [[(0, 1), (3, 4)], [(1, 2), (4, 5)], [(2, 3), (5, 6)]]),
                 ("zb-v", 3, [[(0, 1), (5, 6)], [(1, 3), (3, 5)]]),
                 ("zb-v", 4, [[(0, 1), (5, 6)], [(1, 2), (4, 5)], [(2, 3), (3, 4)]])]


@pytest.mark.parametrize("case", range(len(RUNTIME_CASES)))
def test_actions_are_the_runtime_schedule(case):
    """The simulator plays the runtime's own action lists (StrategyHandle.pipeline_schedule): each stage's
    compute ops in the lists' order, every message one transfer, which ends before the op that reads it
    starts and starts no earlier than the op that produces it ends."""
    schedule, m, chunks = RUNTIME_CASES[case]
    cm = cost_model(profiles(latency=0.001))
    s = chunked(m, chunks, schedule)
    r = simulate(cm, s, m)
    sched = planner_handle(cm, s, m).pipeline_schedule(0)
    assert r.pipeline_schedules == (schedule,)
    v = len(chunks[0])

    def label(op) -> str:
        return f"{op.kind[0]}{op.micro_batch}" + (f"/{op.chunk}" if v > 1 else "")

    for k in range(len(chunks)):
        ran = [e.name for e in r.events if e.stage == k and e.lane == "stage" and e.category in ("forward", "backward")]
        assert ran == [label(op) for op in sched.order(k)]
    at = {(e.stage, e.name): e for e in r.events if e.lane == "stage"}
    messages = [a.message for acts in sched.actions for a in acts if isinstance(a, PostSend)]
    p2p = [e for e in r.events if e.category == "p2p"]
    assert len(p2p) == len(messages) == len(set(messages))
    for msg in messages:
        (e,) = [e for e in p2p if e.name == f"{msg.kind} {msg.micro_batch} (stage {msg.src_stage}->{msg.dst_stage})"]
        read_kind = "F" if msg.kind == "activation" else "B"
        made_kind = "F" if msg.kind == "activation" else "B"
        c_dst, c_src = sched.layout.chunk(msg.dst_stage), sched.layout.chunk(msg.src_stage)
        reader = at[msg.dst, f"{read_kind}{msg.micro_batch}" + (f"/{c_dst}" if v > 1 else "")]
        maker = at[msg.src, f"{made_kind}{msg.micro_batch}" + (f"/{c_src}" if v > 1 else "")]
        assert maker.end_s <= e.start_s + 1e-12 and e.end_s <= reader.start_s + 1e-12
        assert e.end_s - e.start_s == pytest.approx(cm.p2p_time((msg.src,), (msg.dst,)))


def test_one_stage_pipeline_equals_cost_model_sum():
    ps = profiles(extras=True, latency=0.001)
    cm = cost_model(ps, step_allreduce=True)
    s = chain(8, [6])
    r = simulate(cm, s, global_batch=8)
    stage = cm.stage("cpu-fast", 1, 6, True, True)
    opt = cm.optimizer_time("cpu-fast", stage.params)
    assert r.step_time_s == pytest.approx(8 * stage.time_s + opt)
    assert r.step_time_s == pytest.approx(r.formula_step_time_s)
    assert r.stages[0].bubble_s == pytest.approx(0.0, abs=1e-12)


def test_1f1b_equal_stages_match_formula():
    # Four equal stages of 1 layer (fwd 1, bwd 2), 6 micro-batches, no communication cost:
    # (m-1) * max + sum = 5 * 3 + 4 * 3 = 27.
    cm = cost_model(profiles())
    r = simulate(cm, chain(6, [1, 1, 1, 1]), global_batch=6)
    assert r.pipeline_end_s[0] == pytest.approx(27.0)
    assert r.pipeline_end_s[0] == pytest.approx(pipeline_time([1] * 4, [2] * 4, 6))
    # The bubble of every stage is the (S-1) * (f+b) fill and drain: 9 of 27 s (+ optimizer wait).
    assert [round(s.compute_s, 9) for s in r.stages] == [18.0] * 4
    assert [s.peak_in_flight for s in r.stages] == [4, 3, 2, 1]


def test_gpipe_holds_all_micro_batches():
    cm = cost_model(profiles())
    one = simulate(cm, chain(6, [1, 1, 1]), 6, "1f1b")
    gp = simulate(cm, chain(6, [1, 1, 1]), 6, "gpipe")
    assert [s.peak_in_flight for s in gp.stages] == [6, 6, 6]
    assert [s.peak_in_flight for s in one.stages] == [3, 2, 1]
    assert all(g.peak_memory_gib > o.peak_memory_gib for g, o in zip(gp.stages, one.stages))
    # Equal stages: GPipe and 1F1B take the same time ((m-1)(f+b) + S(f+b)) without comm.
    assert gp.pipeline_end_s[0] == pytest.approx(one.pipeline_end_s[0])


def test_comm_latency_delays_the_pipeline():
    base = simulate(cost_model(profiles()), chain(4, [3, 3]), 4).step_time_s
    slow = simulate(cost_model(profiles(latency=0.05)), chain(4, [3, 3]), 4).step_time_s
    assert slow > base + 2 * 0.05  # at least one forward and one backward transfer on the critical path


def test_hetero_pipelines_and_sync_wait_for_slowest():
    cm = cost_model(profiles(slow=3.0, latency=0.001))
    s = Strategy("h", (Pipeline(6, (Stage((0, 1), (0, 6)),)),
                       Pipeline(2, (Stage((2,), (0, 3)), Stage((3,), (3, 6))))))
    r = simulate(cm, s, 8)
    fast_end, slow_end = r.pipeline_end_s
    assert fast_end == pytest.approx(6 * 6 * 3.0 + 6 * cm.stage("cpu-fast", 2, 6, True, True).tp_comm_s)
    assert r.step_time_s > max(fast_end, slow_end)
    # The sync, as the runtime lays it out: the TP-2 slices against each TP-1 stage, then each TP-1 stage's
    # norms with the whole TP-2 group (its duplicated replicas count once), in the runtime's global order.
    plan = cm.sync_plan(s)
    assert [g.devices for g in plan] == [(0, 2), (0, 3), (1, 2), (1, 3), (0, 1, 2), (0, 1, 3)]
    # Every device joins its groups in that order after its stage's last action; a group's all-reduce
    # ends once its last member has joined.
    ready: dict[int, float] = {}
    for e in r.events:
        if e.category in ("forward", "backward", "p2p"):
            for d in s.pipelines[e.pipeline].stages[e.stage].devices:
                ready[d] = max(ready.get(d, 0.0), e.end_s)
    for g in plan:
        end = max(ready[d] for d in g.devices) + cm.sync_group_time(g)
        ready.update(dict.fromkeys(g.devices, end))
    opt = max(cm.optimizer_times(s).values())
    assert r.step_time_s == pytest.approx(max(ready.values()) + opt, rel=1e-4)
    # The closed form prices the same rendezvous chain, every device ready at once: here more than the
    # busiest device's own groups, since (1, 2) waits for 2's first group and (0, 1, 2) for 1's.
    span: dict[int, float] = {}
    for g in plan:
        end = max(span.get(d, 0.0) for d in g.devices) + cm.sync_group_time(g)
        span.update(dict.fromkeys(g.devices, end))
    per_device = {d: sum(cm.sync_group_time(g) for g in plan if d in g.devices) for d in s.devices}
    assert cm.grad_sync_time(s) == pytest.approx(max(span.values()))
    assert cm.grad_sync_time(s) > max(per_device.values()) * 1.1


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(0, 6), st.floats(0.2, 3.0), st.floats(0.2, 3.0))
def test_equal_stages_property(stages, extra_mb, f, b):
    m = stages + extra_mb
    cm = cost_model(profiles(layer_fwd=f, layer_bwd=b))
    r = simulate(cm, chain(m, [1] * stages), m)
    assert r.pipeline_end_s[0] == pytest.approx(pipeline_time([f] * stages, [b] * stages, m))


def test_chrome_trace_is_complete():
    cm = cost_model(profiles(latency=0.001))
    s = chain(3, [3, 3])
    r = simulate(cm, s, 3)
    trace = chrome_trace(r, s)
    json.dumps(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {(e["pid"], e["tid"], e["name"]) for e in xs}
    assert sum(1 for e in xs if e["cat"] == "forward") == 6 and sum(1 for e in xs if e["cat"] == "backward") == 6
    comm = [e["name"] for e in xs if e["cat"] == "p2p"]
    # 3 activations and 3 gradients, each one transfer on the stages' link.
    assert len(comm) == 6 and sum(n.startswith("activation") for n in comm) == 3
    assert sum(n.startswith("gradient") for n in comm) == 3
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in xs) and len(names) == len(xs)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(r.step_time_s * 1e6)


def test_simulate_cli_json_and_trace(tmp_path: Path):
    prof = tmp_path / "prof"
    for name, rp in ((n, profiles().resolved(n)) for n in CPU4.device_types):
        save_profile(rp.profile, prof / f"{name}.yaml")
    trace = tmp_path / "t.json"
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(PLANS / "cpu-hetero4-tiny.yaml"), "--profile",
                                   str(prof), "--trace", str(trace), "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    for key in ("step_time_s", "tokens_per_s", "mfu", "stages", "peak_memory_gib"):
        assert key in data
    assert set(data["peak_memory_gib"]) == {"0", "1", "2", "3"}
    assert data["profiles"]["cpu-fast"]["provenance"] == "measured"
    assert json.loads(trace.read_text())["traceEvents"]
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(PLANS / "cpu-hetero4-tiny.yaml"), "--profile",
                                   str(prof)])
    assert res.exit_code == 0 and "step time" in res.output and "per stage" in res.output


def test_simulate_cli_flags_oom(tmp_path: Path):
    plan = tmp_path / "plan.yaml"
    text = (PLANS / "cpu-hetero4-symmetric.yaml").read_text().replace("model: llama-tiny", "model: llama-7b")
    plan.write_text(text.replace("[0, 6]", "[0, 32]").replace("seq_len: 64", "seq_len: 128"))
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(plan), "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["oom_devices"] == [0, 1, 2, 3] and all(s["oom"] for s in data["stages"])


def with_cores(ps: ProfileSet, cores: int) -> ProfileSet:
    return ProfileSet({t: ResolvedProfile(dataclasses.replace(
        ps[t], compute=dataclasses.replace(ps[t].compute, host_cores=cores)), None) for t in ps})


def test_emulated_devices_share_host_cores():
    dp2 = Strategy("dp", (Pipeline(1, (Stage((0,), (0, 6)),)), Pipeline(1, (Stage((1,), (0, 6)),))))
    # Two fast devices computing at once: on 2 cores (one each, as the launcher pins them) each runs at full
    # speed; on 1 core both are pinned to it and run at half speed.
    two = simulate(cost_model(with_cores(profiles(), 2)), dp2, 2)
    one = simulate(cost_model(with_cores(profiles(), 1)), dp2, 2)
    assert two.pipeline_end_s == pytest.approx((18.0, 18.0)) and two.cpu_hosts == {"core 0": 1.0, "core 1": 1.0}
    assert one.pipeline_end_s == pytest.approx((36.0, 36.0)) and one.cpu_hosts == {"core 0": 1.0}
    # A 3x emulated device does 1/3 of its block on the CPU and then sleeps 2x the CPU time it used (not
    # its wall time), as runtime/trace.py does. On one core: both forwards share it (fast: 6 core-s, slow:
    # 18 / 3 = 6 core-s) and end their CPU work at 12 s; the fast backward then has the core alone
    # (12 -> 24); the slow device sleeps 2 x 6 s (-> 24), then runs its backward alone (12 core-s -> 36)
    # and sleeps 2 x 12 (-> 60).
    mixed = Strategy("m", (Pipeline(1, (Stage((0,), (0, 6)),)), Pipeline(1, (Stage((2,), (0, 6)),))))
    r = simulate(cost_model(with_cores(profiles(slow=3.0), 1)), mixed, 2)
    assert r.pipeline_end_s == pytest.approx((24.0, 60.0))


def with_models(ps: ProfileSet, **fields) -> ProfileSet:
    return ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], models={
        k: dataclasses.replace(m, **fields) for k, m in ps[t].models.items()}), None) for t in ps})


def test_time_sharing_a_core_costs_its_measured_efficiency():
    dp2 = Strategy("dp", (Pipeline(1, (Stage((0,), (0, 6)),)), Pipeline(1, (Stage((1,), (0, 6)),))))
    # Two processes on one core at efficiency 0.8: each progresses at 0.4 of its speed alone.
    ps = with_models(with_cores(profiles(), 1), core_sharing={64: 0.8})
    r = simulate(cost_model(ps), dp2, 2)
    assert r.pipeline_end_s == pytest.approx((36.0 / 0.8, 36.0 / 0.8))
    # Interpolated in log length between measured lengths (clamped outside them).
    cm = CostModel(TINY, FAST_LINKS, with_models(profiles(), core_sharing={32: 0.6, 128: 1.0}), micro_batch=1,
                   seq_len=64, step_allreduce=False)
    assert cm.host.core_sharing("cpu-fast") == pytest.approx(0.8)
    # By the block's size (``SharingCurve``): the whole 6-layer stage's forward + backward is 18 CPU s, between
    # measured blocks of 2 s (0.9) and 162 s (0.5): log-interpolated, 0.9 - 0.4 x ln 9 / ln 81 = 0.7.
    curve = with_models(with_cores(profiles(), 1), core_sharing={64: 0.9},
                        core_sharing_curve={64: SharingCurve((2.0, 162.0), (0.9, 0.5))})
    assert cost_model(curve).host.core_sharing("cpu-fast", 18.0) == pytest.approx(0.7)
    assert cost_model(curve).host.core_sharing("cpu-fast") == pytest.approx(0.9)   # no size: the smallest
    r = simulate(cost_model(curve), dp2, 2)
    assert r.pipeline_end_s == pytest.approx((36.0 / 0.7, 36.0 / 0.7))
    # On their own cores nothing is shared, whatever the efficiency.
    alone = simulate(cost_model(with_models(with_cores(profiles(), 2), core_sharing={64: 0.5})), dp2, 2)
    assert alone.pipeline_end_s == pytest.approx((18.0, 18.0))


def test_resume_and_wake_penalties_follow_idle_time():
    # Stage 1 idles while stage 0 runs its first forward (1 s per layer, 2 layers): its first forward then
    # costs the resume penalty for 2 s of idling; back-to-back blocks cost nothing extra.
    pen = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1.0)
    base = simulate(cost_model(profiles()), chain(1, [2, 2]), 1)
    r = simulate(cost_model(with_models(profiles(), resume=pen)), chain(1, [2, 2]), 1)
    ev = {(e.stage, e.name): e for e in r.events}
    base_ev = {(e.stage, e.name): e for e in base.events}
    f1 = ev[1, "F0"]
    assert f1.end_s - f1.start_s == pytest.approx(2.0 + pen.extra_s(2.0, False))
    b1 = ev[1, "B0"]   # right after its forward: no idling
    assert b1.end_s - b1.start_s == pytest.approx(base_ev[1, "B0"].end_s - base_ev[1, "B0"].start_s)
    assert r.step_time_s > base.step_time_s
    # A penalty that grows with the block: stage 1's first forward (2 s of CPU) pays 25% of it on top.
    grows = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1.0, forward_rate=0.25)
    g = {(e.stage, e.name): e for e in simulate(cost_model(with_models(profiles(), resume=grows)),
                                                 chain(1, [2, 2]), 1).events}
    assert g[1, "F0"].end_s - g[1, "F0"].start_s == pytest.approx(2.0 + (0.5 + 0.25 * 2.0) * (1 - math.exp(-2.0)))
    # A transfer ends later on the side that waited for it, by the wake penalty of its wait: stage 1 waits
    # 2 s for the activation, then stage 0 waits for the gradient from 2 s until stage 1 has resumed and
    # run its forward and backward (2 + 4 s).
    wake = ResumePenalty(forward_s=0.25, backward_s=0.25, tau_s=0.5)
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(
        profiles()[t], comm=dataclasses.replace(profiles()[t].comm, p2p_wake=wake)), None)
        for t in CPU4.device_types})
    w = simulate(cost_model(ps), chain(1, [2, 2]), 1)
    first = wake.extra_s(2.0, False)
    assert w.step_time_s == pytest.approx(base.step_time_s + first + wake.extra_s(6.0 + first, False))


def test_zero1_allgather_follows_the_optimizer():
    cm = cost_model(profiles(latency=0.001))
    dp = Strategy("dp", (Pipeline(2, (Stage((0,), (0, 6)),)), Pipeline(2, (Stage((1,), (0, 6)),))))
    plain, zero = simulate(cm, dp, 4, zero=False), simulate(cm, dp, 4, zero=True)
    (group,) = cm.sync_plan(dp)
    n, _ = cm.device_params(dp)[0]
    gather = cm.zero_gather_time(group)
    assert gather > 0
    # Half the optimizer's per-parameter work (1 us each), then the all-gather, nothing else changes.
    assert zero.step_time_s == pytest.approx(plain.step_time_s - 1e-6 * n / 2 + gather)
    ev = [e for e in zero.events if e.category == "zero_gather"]
    opt_end = max(e.end_s for e in zero.events if e.category == "optimizer")
    assert len(ev) == 2 and all(e.start_s == pytest.approx(opt_end) for e in ev)
    assert not [e for e in plain.events if e.category == "zero_gather"]


HANDOFF = CoreHandoff(handoff_s=0.5, wake_s=0.25, recv_wake_s=0.75)


def test_busy_core_handoff_delays_only_on_a_busy_core():
    """Hand-computed on one core (processor sharing at efficiency 1): A computes 10 CPU-s; B (an emulated 3x
    device: sleeps 2x the CPU time it used) computes 2, then 1 CPU-s."""
    def play(with_a: bool, handoff: CoreHandoff | None) -> dict[str, tuple[float, float]]:
        sim = EventLoop({"c": 1.0})
        if with_a:
            sim.add(SimOp("A", "a", cpu=10.0, hosts=(("c", 1.0),), handoff=handoff))
        sim.add(SimOp("B1", "b", cpu=2.0, stretch=3.0, hosts=(("c", 1.0),), handoff=handoff))
        sim.add(SimOp("B2", "b", cpu=1.0, stretch=3.0, hosts=(("c", 1.0),), handoff=handoff))
        return sim.run()

    # Shared: B1's CPU work ends at 4 (half the core each) with A still computing: + handoff 0.5, then the
    # sleep of 2 x 2 -> 8.5. B2 wakes at 8.5 with A computing: starts 0.25 later (A alone from 4 to 8.75:
    # 2 + 4.75 CPU-s done, 3.25 left), shares the core for 2 s (CPU work ends 10.75, A still busy): + 0.5,
    # sleep 2 x 1 -> 13.25. A: 2.25 CPU-s left at 10.75, alone -> 13.0 (B is asleep then: no hand-off).
    t = play(True, HANDOFF)
    assert t["B1"] == pytest.approx((0.0, 8.5))
    assert t["B2"] == pytest.approx((8.75, 13.25))
    assert t["A"] == pytest.approx((0.0, 13.0))
    # The same without the measured delays: B1 4 -> 8, B2 at 8 (A: 2 + 4 done) shares to 10, sleeps -> 12;
    # A: 4 - 1 = 3 CPU-s left at 10 -> 13.
    t = play(True, None)
    assert t["B1"] == pytest.approx((0.0, 8.0)) and t["B2"] == pytest.approx((8.0, 12.0))
    assert t["A"] == pytest.approx((0.0, 13.0))
    # On an idle core the delays never apply: B1 2 + 4 sleep, B2 6 -> 7 + 2 sleep.
    alone = play(False, HANDOFF)
    assert alone["B1"] == pytest.approx((0.0, 6.0)) and alone["B2"] == pytest.approx((6.0, 9.0))
    assert alone == play(False, None)


def test_blocked_receive_wakes_late_only_on_a_busy_core():
    # The receiver posts at 0 and waits for its peer (another core), which posts at 5; the transfer takes 0.1.
    def play(busy_for: float) -> dict[str, tuple[float, float]]:
        sim = EventLoop({"c": 1.0, "d": 1.0})
        if busy_for:
            sim.add(SimOp("A", "a", cpu=busy_for, hosts=(("c", 1.0),)))
        sim.add(SimOp("before", "p", duration=5.0))
        sim.add(SimOp("send", "p", duration=0.1, waits=(("recv", 0.1),)))
        sim.add(SimOp("recv", "r", duration=0.1, waits=(("send", 0.1),), hosts=(("c", 1.0),), handoff=HANDOFF))
        return sim.run()

    assert play(10.0)["recv"] == pytest.approx((0.0, 5.1 + 0.75))   # A computes at 5: woken 0.75 late
    assert play(0.0)["recv"] == pytest.approx((0.0, 5.1))           # idle core: on time
    assert play(3.0)["recv"] == pytest.approx((0.0, 5.1))           # A done by then: on time
    assert play(10.0)["send"] == pytest.approx((5.0, 5.1))          # the side that did not wait: on time


def test_core_handoff_from_the_profile_reaches_the_simulation():
    # Fast device 0 (2 micro-batches) and a 3x slow device 2 (1), both pinned to the one core; forward 1 s,
    # backward 3 s per layer, 6 layers: CPU work F = 6, B = 18 on either device.
    mixed = Strategy("m", (Pipeline(2, (Stage((0,), (0, 6)),)), Pipeline(1, (Stage((2,), (0, 6)),))))
    ps = with_cores(profiles(layer_bwd=3.0, slow=3.0), 1)
    # Without the delays: both forwards share the core to 12 (ending together: no hand-off either way);
    # the slow device sleeps 2 x 6 -> 24 while fast B0 runs alone (12 of 18 done); they share from 24,
    # fast B0 ends at 36, F1 at 48 (slow: 12 done), then B1 and slow B0 share until the slow one's CPU
    # work ends at 60 (sleep 2 x 18 -> 96) and fast B1 finishes its last 12 alone (-> 72).
    assert simulate(cost_model(ps), mixed, 3).pipeline_end_s == pytest.approx((72.0, 96.0))
    # With them: the slow device wakes at 24 on a busy core and starts at 24.25 (fast B0: 6.25 done); fast
    # B0's CPU work ends at 35.75, + 0.5 hand-off (slow computing) -> 36.25, F1 shares to 48.25, + 0.5; the
    # slow B0 (11.75, then 5.25 left at 48.75) ends its CPU work at 59.25, + 0.5, + 36 -> 95.75; fast B1
    # has 5.25 done at 59.25 and ends alone at 72.0 (the slow one asleep: no hand-off).
    r = simulate(cost_model(with_models(ps, core_handoff={64: HANDOFF})), mixed, 3)
    assert r.pipeline_end_s == pytest.approx((72.0, 95.75))
    # Interpolated in log length between measured lengths, like core_sharing.
    cm = CostModel(TINY, FAST_LINKS, with_models(profiles(), core_handoff={
        32: CoreHandoff(0.001, 0.002, 0.0), 128: CoreHandoff(0.003, 0.0, 0.004)}), micro_batch=1, seq_len=64,
        step_allreduce=False)
    h = cm.host.core_handoff("cpu-fast")
    assert h is not None and (h.handoff_s, h.wake_s, h.recv_wake_s) == pytest.approx((0.002, 0.001, 0.002))
    assert cost_model(profiles()).host.core_handoff("cpu-fast") is None


def test_block_after_the_core_mate_computed_pays_its_cold_caches():
    cold = CoreHandoff(handoff_s=0.0, wake_s=0.0, recv_wake_s=0.0, cold_forward_s=1.0, cold_backward_s=2.0)

    def play(a_cpu: float, stretch: float = 1.0) -> dict[str, tuple[float, float]]:
        sim = EventLoop({"c": 1.0})
        if a_cpu:
            sim.add(SimOp("A", "a", cpu=a_cpu, hosts=(("c", 1.0),)))
        sim.add(SimOp("F", "b", cpu=2.0, stretch=stretch, hosts=(("c", 1.0),), handoff=cold, kind=OpKind.FORWARD))
        sim.add(SimOp("B", "b", cpu=4.0, stretch=stretch, hosts=(("c", 1.0),), handoff=cold, kind=OpKind.BACKWARD))
        return sim.run()

    # A and F start together (nothing ran before F: no extra); F's CPU work ends at 4 at half the core. A
    # ran meanwhile, so B needs 4 + 2 CPU-s at half the core (-> 16); A: 8 done by 16, alone -> 28.
    t = play(20.0)
    assert t["F"] == pytest.approx((0.0, 4.0)) and t["B"] == pytest.approx((4.0, 16.0))
    assert t["A"] == pytest.approx((0.0, 28.0))
    # A 3x device: F sleeps 2 x 2 -> 8; A (3 CPU-s) finishes alone at 5, before B starts at 8 on an idle
    # core: B still pays for A's work meanwhile (4 + 2, alone -> 14, sleep 12 -> 26).
    t = play(3.0, stretch=3.0)
    assert t["F"] == pytest.approx((0.0, 8.0)) and t["B"] == pytest.approx((8.0, 26.0))
    # Alone on the core: no extra.
    t = play(0.0)
    assert t["F"] == pytest.approx((0.0, 2.0)) and t["B"] == pytest.approx((2.0, 6.0))
    # Measured on an 8 CPU-s backward block: B (4 CPU-s) pays half the cold backward penalty (4 + 1 at half
    # the core -> 14); F is as big as its probe block (2 CPU-s): the whole of it.
    cold = dataclasses.replace(cold, block_forward_s=2.0, block_backward_s=8.0)
    t = play(20.0)
    assert t["F"] == pytest.approx((0.0, 4.0)) and t["B"] == pytest.approx((4.0, 14.0))


def test_weight_gradient_after_idling_pays_no_resume_or_cold_penalty():
    """A split backward's W works on what its B just produced (measured: pp4-uneven-zb-h1 on cpu-hetero4,
    traced op by op): hand-computed, a 1 CPU-s op waiting 2 s for a peer then pays (1 - e^-2) of its resume
    penalty as F (0.5 s) or B (1 s), and nothing as a hot W; after the core-mate's work, likewise."""
    pen = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1.0)
    cold = CoreHandoff(handoff_s=0.0, wake_s=0.0, recv_wake_s=0.0, cold_forward_s=1.0, cold_backward_s=2.0)

    def play(kind: OpKind, hot: bool, mate: bool = False) -> tuple[float, float, float]:
        """X's start, end and CPU consumed."""
        sim = EventLoop({"c": 1.0})
        sim.add(SimOp("peer", "p", duration=2.0))
        if mate:
            sim.add(SimOp("A", "a", cpu=1.0, hosts=(("c", 1.0),)))
        sim.add(SimOp("X", "b", kind, cpu=1.0, deps=("peer",), hosts=(("c", 1.0),), resume=pen, hot=hot,
                      handoff=cold))
        t = sim.run()
        return (*t["X"], sim.cpu_s["X"])

    idle = 1.0 - math.exp(-2.0)   # 0.8647
    assert play(OpKind.FORWARD, False) == pytest.approx((2.0, 3.0 + 0.5 * idle, 1.0 + 0.5 * idle))
    assert play(OpKind.BACKWARD, False) == pytest.approx((2.0, 3.0 + 1.0 * idle, 1.0 + 1.0 * idle))
    assert play(OpKind.BACKWARD, True) == pytest.approx((2.0, 3.0, 1.0))
    # A (1 CPU-s) ran on the core before X started at 2: a B pays the cold backward penalty (2 s) on top.
    assert play(OpKind.BACKWARD, False, mate=True) == pytest.approx((2.0, 5.0 + idle, 3.0 + idle))
    assert play(OpKind.BACKWARD, True, mate=True) == pytest.approx((2.0, 3.0, 1.0))
    # In a zero-bubble schedule the simulator marks every W hot: each costs its priced CPU whatever the
    # idling before it, while the stages' F / B ops after idling pay more.
    zb, m = chunked(4, [[(0, 2)], [(2, 4)], [(4, 6)]], "zb-h1"), 4
    base = {(e.stage, e.name): e.cpu_s for e in simulate(cost_model(profiles()), zb, m).events}
    r = {(e.stage, e.name): e.cpu_s for e in simulate(cost_model(with_models(profiles(), resume=pen)), zb, m).events}
    w = [k for k in r if k[1].startswith("W")]
    assert len(w) == 3 * m and all(r[k] == pytest.approx(base[k]) for k in w)
    assert any(r[k] > base[k] + 0.1 for k in r if k[1][0] in "FB")


def test_optimizer_after_idling_pays_the_resume_penalty():
    """The optimizer step finds cold caches after the step's collectives, as a block does after idling:
    hand-computed, two replicas of 6 layers (1 s forward, 2 s backward per layer), 3 micro-batches on
    device 0 and 1 on device 1: device 1 idles 2 x 18 s in the gradient sync (free on these links) while
    device 0 computes, so its optimizer pays the whole forward penalty of ``pen`` on top of its priced
    CPU; device 0's, straight after its own backward, pays nothing. Its idle runs from its stage's last
    block, not from the step's start."""
    pen = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1.0, forward_rate=0.25)
    dp = Strategy("dp", (Pipeline(3, (Stage((0,), (0, 6)),)), Pipeline(1, (Stage((1,), (0, 6)),))))
    base = {e.pipeline: e for e in simulate(cost_model(profiles()), dp, 4).events
            if e.category == "optimizer"}
    r = {e.pipeline: e for e in simulate(cost_model(with_models(profiles(), resume=pen)), dp, 4).events
         if e.category == "optimizer"}
    opt = base[0].cpu_s
    assert opt > 0 and base[1].cpu_s == pytest.approx(opt)
    assert r[0].cpu_s == pytest.approx(opt, abs=1e-6)
    assert r[1].cpu_s == pytest.approx(opt + (0.5 + 0.25 * opt) * (1 - math.exp(-36.0)))


def test_compute_events_carry_the_cpu_they_consumed():
    """The timeline's compute events say how much CPU work they consumed (an emulated device's sleep
    and any wait excluded), so a measured trace can be held against them op by op."""
    pen = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1.0)
    r = simulate(cost_model(with_models(profiles(), resume=pen)), chain(1, [2, 2]), 1)
    ev = {(e.stage, e.name): e for e in r.events}
    assert ev[0, "F0"].cpu_s == pytest.approx(2.0)                          # 1 s per layer, nothing idle before
    assert ev[1, "F0"].cpu_s == pytest.approx(2.0 + pen.extra_s(2.0, False))   # after 2 s idle
    assert all(e.cpu_s > 0 for e in r.events if e.category in ("forward", "backward"))


def test_tp_collectives_cpu_is_core_work():
    """A TP block's collectives: their CPU part (``tp_blocks_cpu``) joins the block's core work, only the
    rest of their wall time is waiting. Hand-computed: 1 s of the block's own CPU, collectives of 0.6 s
    wall of which 0.4 s CPU, on a 3x emulated device (sleeps 2x the CPU): the cost model's total is
    3 x 1 + 0.6 + 2 x 0.4 = 4.4 s, its TP part 1.4 s."""
    assert tp_block_split(1.0, 0.6, 0.4) == pytest.approx((1.4, 0.2, 0.0))
    # More CPU than wall time (several threads at once): the excess is stretched but not a core's work.
    assert tp_block_split(1.0, 0.3, 0.5) == pytest.approx((1.3, 0.0, 0.2))
    assert tp_block_split(1.0, 0.0, 0.0) == (1.0, 0.0, 0.0)

    def play(cpu: float, comm: float, mate: bool) -> tuple[float, float]:
        sim = EventLoop({"c": 1.0})
        if mate:   # another device's block of 2.8 CPU-s on the same core from 0
            sim.add(SimOp("A", "a", cpu=2.8, hosts=(("c", 1.0),)))
        sim.add(SimOp("T", "t", cpu=cpu, comm=comm, stretch=3.0, hosts=(("c", 1.0),)))
        return sim.run()["T"]

    cpu, comm, comm_cpu = tp_block_split(1.0, 0.6, 0.4)
    assert comm_cpu == 0.0
    # Alone: CPU 1.4, waiting 0.2, sleep 2 x 1.4 -> 4.4, the cost model's total.
    assert play(cpu, comm, False) == pytest.approx((0.0, 4.4))
    # Sharing the core at half speed: 1.4 CPU-s end at 2.8, then 0.2 of waiting and the 2.8 s sleep -> 5.8.
    # (With the collectives' CPU as waiting, only 1 CPU-s was shared: 2.0 + 0.6 + 2 x 1.4 = 5.4.)
    assert play(cpu, comm, True) == pytest.approx((0.0, 5.8))


def with_p2p_actions(ps: ProfileSet, actions: P2pActions) -> ProfileSet:
    return ProfileSet({t: ResolvedProfile(dataclasses.replace(
        ps[t], comm=dataclasses.replace(ps[t].comm, p2p_actions=actions)), None) for t in ps})


def test_message_cpu_is_played_on_the_stage_and_priced_by_the_estimate():
    # Two stages of 2 layers (F 2 s, BW 4 s), one micro-batch, transfers free. The runtime's lists: stage 0
    # F0, post send (act), post recv (grad), wait (grad), BW0; stage 1 post recv (act), wait (act), F0, BW0,
    # post send (grad). Simulated, every post and unpack is the stage's own work: the critical path is
    # F0 (0-2), send (2-2.1), stage 1's unpack (2.1-2.12; its recv was posted at 0-0.05), F0 + BW0
    # (2.12-8.12), send (8.12-8.22), stage 0's unpack (8.22-8.24; its recv post 2.1-2.15 is off the path),
    # BW0 (-12.24): 12 + 2 x (0.1 + 0.02).
    acts = P2pActions(post_send_s=0.1, post_recv_s=0.05, wait_recv_s=0.02)
    s = chain(1, [2, 2])
    base = cost_model(profiles())
    cm = cost_model(with_p2p_actions(profiles(), acts))
    assert simulate(base, s, 1).pipeline_end_s[0] == pytest.approx(12.0)
    r = simulate(cm, s, 1)
    assert r.pipeline_end_s[0] == pytest.approx(12.24)
    # The estimate puts each message's CPU into the ops that send or receive it: stage 0's F + 0.1 (send),
    # BW + 0.07 (post recv + unpack); stage 1's F + 0.07, BW + 0.1. One micro-batch is the four ops in turn:
    # 2.1 + 2.07 + 4.1 + 4.07 (the recv posts, off the simulated path, are on this one).
    assert base.pipeline_step_time(s, 0, "1f1b") == pytest.approx(12.0)
    assert cm.pipeline_step_time(s, 0, "1f1b") == pytest.approx(12.34)
    costs = cm.pipeline_costs(s, 0, "1f1b")
    assert costs.chunk(0, 0).forward == pytest.approx(2.1)
    assert costs.chunk(0, 0).of("BW") == pytest.approx(4.07)
    assert costs.chunk(1, 0).forward == pytest.approx(2.07)
    assert costs.chunk(1, 0).of("BW") == pytest.approx(4.1)
    # A one-stage pipeline sends nothing: unchanged.
    one = chain(2, [6])
    assert simulate(cm, one, 2).step_time_s == pytest.approx(simulate(base, one, 2).step_time_s)
    assert cm.pipeline_step_time(one, 0, "1f1b") == pytest.approx(base.pipeline_step_time(one, 0, "1f1b"))


def test_an_action_after_idling_pays_its_cold_cost():
    """The same pipeline with the actions' cold costs measured (saturated at any idle: tau 1 us): a send
    right after its block's CPU and a receive's post right after a send or at the start are hot; each
    unpack follows its stage's wait (stage 1's since its post at 0.05, stage 0's since 2.15), so both
    pay 0.01 more: 12.24 + 2 x 0.01. The estimate charges a cold cost only for the idle a block leaves its
    device, which a device that is neither stretched nor sleeping to targets does not have: unchanged."""
    hot = P2pActions(post_send_s=0.1, post_recv_s=0.05, wait_recv_s=0.02)
    cold = dataclasses.replace(hot, cold_post_send_s=0.5, cold_post_recv_s=0.3, cold_wait_recv_s=0.01,
                               cold_tau_s=1e-6)
    s = chain(1, [2, 2])
    cm = cost_model(with_p2p_actions(profiles(), cold))
    assert simulate(cm, s, 1).pipeline_end_s[0] == pytest.approx(12.26)
    assert cm.pipeline_step_time(s, 0, "1f1b") == pytest.approx(
        cost_model(with_p2p_actions(profiles(), hot)).pipeline_step_time(s, 0, "1f1b"))


def test_message_cpu_scales_with_the_messages_a_schedule_sends():
    # Interleaved on 2 stages, 2 chunks each: 3 virtual-stage boundaries, every one across devices, so per
    # micro-batch each device posts 3 sends and 3 receives (of 2 x 3 messages) where 1F1B's 2 stages post 1
    # and 1. The estimate's costs: device 0 holds virtual stages 0 and 2, device 1 stages 1 and 3.
    acts = P2pActions(post_send_s=0.1, post_recv_s=0.05, wait_recv_s=0.02)
    cm = cost_model(with_p2p_actions(profiles(), acts))
    base = cost_model(profiles())
    s = chunked(4, [[(0, 2), (3, 5)], [(2, 3), (5, 6)]], "interleaved")
    got, bare = cm.pipeline_costs(s, 0, "interleaved"), base.pipeline_costs(s, 0, "interleaved")
    extra = {(d, c): (got.chunk(d, c).forward - bare.chunk(d, c).forward,
                      got.chunk(d, c).input_grad - bare.chunk(d, c).input_grad) for d in (0, 1) for c in (0, 1)}
    assert extra[0, 0] == pytest.approx((0.1, 0.07))     # stage 0: sends its output, receives its gradient
    assert extra[1, 0] == pytest.approx((0.17, 0.17))    # stage 1: receives and sends both ways
    assert extra[0, 1] == pytest.approx((0.17, 0.17))    # stage 2
    assert extra[1, 1] == pytest.approx((0.07, 0.1))     # stage 3 (the head): receives its input, sends back
    # Simulated: each device's host work is its posts and unpacks, all of them played (4 micro-batches).
    r = simulate(cm, s, 4)
    sched = cm.runtime_schedule(s, 0, "interleaved")
    for k in (0, 1):
        n_send = sum(isinstance(a, PostSend) for a in sched.actions[k])
        assert n_send == 4 * 3
    assert r.step_time_s > simulate(base, s, 4).step_time_s + 4 * 3 * 0.1 * 0.5   # some of it on the path


def test_v_bottom_sends_nothing():
    # ZB-V on 2 devices: device 1 holds virtual stages 1 and 2, the bottom of the V, handed over in memory:
    # its chunk 0's F receives (no send), its chunk 1's F sends (no receive); backward the reverse.
    acts = P2pActions(post_send_s=0.1, post_recv_s=0.05, wait_recv_s=0.02)
    cm, base = cost_model(with_p2p_actions(profiles(), acts)), cost_model(profiles())
    s = chunked(3, [[(0, 1), (5, 6)], [(1, 3), (3, 5)]], "zb-v")
    got, bare = cm.pipeline_costs(s, 0, "zb-v"), base.pipeline_costs(s, 0, "zb-v")
    lay = cm.runtime_schedule(s, 0, "zb-v").layout
    assert [(lay.device(j), lay.chunk(j)) for j in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    f = {(d, c): got.chunk(d, c).forward - bare.chunk(d, c).forward for d in (0, 1) for c in (0, 1)}
    b = {(d, c): got.chunk(d, c).input_grad - bare.chunk(d, c).input_grad for d in (0, 1) for c in (0, 1)}
    w = {(d, c): got.chunk(d, c).weight_grad - bare.chunk(d, c).weight_grad for d in (0, 1) for c in (0, 1)}
    assert f == pytest.approx({(0, 0): 0.1, (1, 0): 0.07, (1, 1): 0.1, (0, 1): 0.07})
    assert b == pytest.approx({(0, 0): 0.07, (1, 0): 0.1, (1, 1): 0.07, (0, 1): 0.1})
    assert w == pytest.approx(dict.fromkeys(w, 0.0))


def test_message_cpu_shares_the_core_but_is_no_block():
    # On one core shared by both stages, a post is processor-shared CPU work like a block's; it does not
    # move the resume penalty's idle reference (the previous block's end) and is never stretched.
    acts = P2pActions(post_send_s=0.1, post_recv_s=0.05, wait_recv_s=0.02)
    s = chain(1, [2, 2])
    one_core = cost_model(with_p2p_actions(with_cores(profiles(), 1), acts))
    # Stage 1's recv post (0.05 s of CPU) shares the core with stage 0's F0 from 0: F0 ends at 2.05. Stage 0's
    # send 2.05-2.15; then its recv post (0.05) shares the core with stage 1's unpack (0.02: done at 2.19,
    # the post 0.02 in) and F0 (the post's last 0.03 at half speed: -2.25, F0 0.03 in): F0 ends 2.25 + 1.97
    # = 4.22, BW0 8.22, its send 8.32, stage 0's unpack 8.34, BW0 12.34: the two-core path + 2 x 0.05.
    assert simulate(one_core, s, 1).pipeline_end_s[0] == pytest.approx(12.24 + 2 * 0.05)
    slow = cost_model(with_p2p_actions(profiles(slow=3.0), acts))
    devs = Strategy("s", (Pipeline(1, (Stage((0,), (0, 2)), Stage((2,), (2, 4)))),))
    # Stage 1 on a 3x device: its F0 and BW0 (6 and 12 s) stretched as blocks, its posts and unpacks not.
    assert simulate(slow, devs, 1).pipeline_end_s[0] == pytest.approx(2 + 0.1 + 0.02 + 6 + 12 + 0.1 + 0.02 + 4)
    # The resume penalty's idle time runs from the stage's previous block (none: from 0), not from its unpack:
    # stage 1's F0 starts at 2.12 (as above) after 2.12 s without a block.
    pen = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1.0)
    r = simulate(cost_model(with_models(with_p2p_actions(profiles(), acts), resume=pen)), s, 1)
    f1 = {(e.stage, e.name): e for e in r.events}[1, "F0"]
    assert f1.start_s == pytest.approx(2.12)
    assert f1.end_s - f1.start_s == pytest.approx(2.0 + pen.extra_s(2.12, False))


def test_every_emulated_sleep_ends_late_by_its_measured_slack():
    # Stage 1 on a 3x device (F 6 s, BW 12 s: 2 and 4 s of CPU, each followed by a sleep of twice that); its
    # sleeps end 0.01 s late on an idle core too (no shared cores here). Stage 0 (not stretched) sleeps
    # never. Both of stage 1's blocks are on the path: 2 + 6 + 12 + 4 = 24, + 2 x 0.01.
    late = CoreHandoff(handoff_s=0.0, wake_s=0.0, recv_wake_s=0.0, sleep_late_s=0.01)
    devs = Strategy("s", (Pipeline(1, (Stage((0,), (0, 2)), Stage((2,), (2, 4)))),))
    base = cost_model(profiles(slow=3.0))
    cm = cost_model(with_models(profiles(slow=3.0), core_handoff={64: late}))
    assert simulate(base, devs, 1).pipeline_end_s[0] == pytest.approx(24.0)
    assert simulate(cm, devs, 1).pipeline_end_s[0] == pytest.approx(24.02)
    # The estimate adds it to each of the slow stage's ops (one sleep per block) and to none of the fast's.
    assert base.pipeline_step_time(devs, 0, "1f1b") == pytest.approx(24.0)
    assert cm.pipeline_step_time(devs, 0, "1f1b") == pytest.approx(24.02)
    got, bare = cm.pipeline_costs(devs, 0, "1f1b"), base.pipeline_costs(devs, 0, "1f1b")
    assert got.chunk(0, 0) == bare.chunk(0, 0)
    assert got.chunk(1, 0).forward - bare.chunk(1, 0).forward == pytest.approx(0.01)
    assert got.chunk(1, 0).of("BW") - bare.chunk(1, 0).of("BW") == pytest.approx(0.01)   # one block, one sleep
    # A split backward is two blocks, two sleeps: B and W each.
    assert got.chunk(1, 0).input_grad - bare.chunk(1, 0).input_grad == pytest.approx(0.01)
    assert got.chunk(1, 0).weight_grad - bare.chunk(1, 0).weight_grad == pytest.approx(0.01)


def test_first_block_follows_the_previous_steps_optimizer_sleep():
    """Steps follow one another: an emulated slower device's first block of a step comes after its previous
    optimizer step's sleep, and pays the resume penalty for that idle time. Hand-computed: one stage of 6
    layers (1 s forward per layer) on the 3x device; its optimizer block of c CPU seconds (2 ms) sleeps 2c,
    so its first forward costs 6 + 0.5 (1 - e^(-2c / tau)) CPU seconds (tau 1 ms: 0.49 s). A device that is
    not stretched idles nothing before its first block."""
    pen = ResumePenalty(forward_s=0.5, backward_s=1.0, tau_s=1e-3)
    cm = cost_model(with_models(profiles(slow=3.0), resume=pen))
    for device, stretch in ((2, 3.0), (0, 1.0)):
        s = Strategy("s", (Pipeline(1, (Stage((device,), (0, 6)),)),))
        cpu = cm.optimizer_times(s)[device] / stretch
        assert cpu == pytest.approx(0.006 / stretch)   # 6000 parameters at 1 us, a 3x device sleeping 2/3 of it
        f0 = {(e.stage, e.name): e for e in simulate(cm, s, 1).events}[0, "F0"]
        idle = (stretch - 1.0) * cpu
        assert f0.cpu_s == pytest.approx(6.0 + pen.extra_s(idle, False, 6.0))
        assert f0.cpu_s == pytest.approx(6.0 + 0.5 * (1 - math.exp(-4.0)) if stretch > 1.0 else 6.0)
