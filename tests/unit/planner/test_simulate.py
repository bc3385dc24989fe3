"""The discrete-event simulator against the closed forms it must reproduce, and its outputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hetu_cli.main import cli
from planner.cost import CostModel, pipeline_time, planner_handle
from planner.simulate import chrome_trace, simulate
from runtime.torchfree.pipeline_schedules import PostSend
from runtime.torchfree.profiling.profile import (
    CommFigures,
    ComponentFit,
    MeasuredModel,
    ProfileSet,
    ResolvedProfile,
    save_profile,
    spec_profile,
)
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy
from runtime.torchfree.spec.schema import MAX_FIGURE

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
