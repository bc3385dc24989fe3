"""Sleep mode's block pricing (runtime/profiling/profile.py ``block_seconds``): hand-computed values, and
the planner / simulator pricing a sleep-mode device by the same function, outside the host model."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import CostModel
from planner.simulate import simulate
from runtime.profiling.profile import (
    ComponentFit,
    ComputeBlock,
    CoreHandoff,
    MeasuredModel,
    P2pActions,
    ProfileSet,
    ResolvedProfile,
    ResumePenalty,
    SleepTarget,
    block_seconds,
    component_fits,
    eval_fit,
    sleep_target,
    spec_profile,
)
from runtime.spec import load_cluster, load_model
from runtime.spec.cluster import Emulation, EmulationTarget
from runtime.spec.plan import Pipeline, Stage, Strategy

TINY = load_model("llama-tiny")
SLEEP4 = load_cluster("cpu-hetero4-sleep")
STRETCH4 = load_cluster("cpu-hetero4")


def fit(f: float, b: float) -> ComponentFit:
    return ComponentFit((0.0, 0.0, f), (0.0, 0.0, b), (0.0, 0.0, 0.0), params=0)


def measured(name: str = "x", attention_fwd=(0.0, 0.0, 1.0)):
    """A profile with round-number fits for llama-tiny's shape at TP 1 (seconds per call)."""
    comps = {"attention": ComponentFit(attention_fwd, (0.0, 0.0, 2.0), (0.0, 0.0, 0.0), params=0),
             "mlp": fit(3.0, 5.0), "norm": fit(0.25, 0.5), "embedding": fit(7.0, 11.0), "head": fit(13.0, 17.0)}
    base = spec_profile(name, peak_tflops=1, hbm_bandwidth_gbs=10, memory_gib=2, note="t", emulated=True)
    return dataclasses.replace(base, provenance="measured",
                               models={"tiny": MeasuredModel(64, 128, 8, 4, 256, 1, (64,), {1: comps})})


def test_block_seconds_hand_computed():
    p = measured()
    # One layer: attention + MLP + 2 norms = 1 + 3 + 0.5 forward, 2 + 5 + 1 backward.
    block = ComputeBlock(layers=2, micro_batch=1, seq_len=64, backward=False)
    assert block_seconds(p, TINY, block) == pytest.approx(9.0)
    assert block_seconds(p, TINY, dataclasses.replace(block, backward=True)) == pytest.approx(16.0)
    # First stage: + embedding; last: + final norm + head.
    assert block_seconds(p, TINY, dataclasses.replace(block, first=True)) == pytest.approx(16.0)
    assert block_seconds(p, TINY, dataclasses.replace(block, first=True, backward=True)) == pytest.approx(27.0)
    assert block_seconds(p, TINY, dataclasses.replace(block, last=True)) == pytest.approx(9.0 + 0.25 + 13.0)
    assert block_seconds(p, TINY, dataclasses.replace(block, last=True, backward=True)) == pytest.approx(33.5)
    # Recompute: the backward re-runs the layers' forward first (the extras are not checkpointed).
    rc = dataclasses.replace(block, backward=True, recompute=True, first=True)
    assert block_seconds(p, TINY, rc) == pytest.approx(16.0 + 9.0 + 11.0)
    assert block_seconds(p, TINY, dataclasses.replace(rc, backward=False)) == pytest.approx(16.0)
    # Fits in B and s: attention forward 0.5 * B * s^2 + 1 at B = 2, s = 3 -> 10 per layer.
    q = measured(attention_fwd=(0.5, 0.0, 1.0))
    one = ComputeBlock(layers=1, micro_batch=2, seq_len=3, backward=False)
    assert block_seconds(q, TINY, one) == pytest.approx(10.0 + 3.0 + 0.5)


def test_unmeasured_shapes_are_priced_from_the_profile_figures():
    # TP 2 is not measured in this profile: the analytic components of its figures (as the cost model uses).
    p = measured()
    comps = component_fits(p, TINY, 2)
    layer = [comps[k] for k in ("attention", "mlp", "norm", "norm")]
    expect = 3 * sum(eval_fit(c.forward_s, 1, 64) for c in layer)
    assert block_seconds(p, TINY, ComputeBlock(layers=3, micro_batch=1, seq_len=64, backward=False, tp=2)) == (
        pytest.approx(expect))
    assert comps != component_fits(p, TINY, 1)


def test_block_validation():
    with pytest.raises(ValueError, match="empty stage"):
        ComputeBlock(layers=0, micro_batch=1, seq_len=8, backward=False)
    with pytest.raises(ValueError, match="seq_len"):
        ComputeBlock(layers=1, micro_batch=1, seq_len=0, backward=False)


def test_sleep_target_scales_the_target_price():
    target = SleepTarget(measured(), TINY, time_scale=10.0)
    assert target.block_s(ComputeBlock(layers=2, micro_batch=1, seq_len=64, backward=True)) == pytest.approx(160.0)
    # Resolved from the cluster file: a shipped profile and a catalog model.
    em = SLEEP4.device_types["emu-h20"].emulate
    resolved = sleep_target(em)
    assert resolved.profile.device_type == "H20" and resolved.model.name == "llama-32b"
    assert resolved.time_scale == em.time_scale
    with pytest.raises(ValueError, match="not a sleep-mode"):
        sleep_target(Emulation(slowdown=3.0))
    assert Emulation(target=EmulationTarget("H20", "llama-32b"), time_scale=2.0).sleeps


def sleep_profiles(cores: int = 1) -> ProfileSet:
    """Measured-looking profiles for the sleep cluster's types, with every host effect switched on (one
    shared core, a resume penalty): a sleep-mode device must not feel any of them."""
    out = {}
    for t in SLEEP4.device_types:
        p = measured(t)
        mm = dataclasses.replace(p.models["tiny"], resume=ResumePenalty(0.5, 1.0, 1.0), core_sharing={64: 0.5})
        out[t] = ResolvedProfile(dataclasses.replace(
            p, models={"tiny": mm}, compute=dataclasses.replace(p.compute, host_cores=cores)), None)
    return ProfileSet(out)


def test_planner_prices_a_sleep_mode_stage_by_its_target():
    cm = CostModel(TINY, SLEEP4, sleep_profiles(), micro_batch=1, seq_len=64, step_allreduce=False)
    for t in ("emu-a800", "emu-h20"):
        target = sleep_target(SLEEP4.device_types[t].emulate)
        assert cm.sleep_target(t) == target and not cm.host.contended(t)
        st = cm.stage(t, 1, 3, True, False)
        block = ComputeBlock(layers=3, micro_batch=1, seq_len=64, backward=False, first=True)
        assert st.forward_s == pytest.approx(target.block_s(block))
        assert st.backward_s == pytest.approx(target.block_s(dataclasses.replace(block, backward=True)))
        assert st.tp_comm_s == 0.0
    stretch = CostModel(TINY, STRETCH4, ProfileSet({t: ResolvedProfile(measured(t), None)
                                                    for t in STRETCH4.device_types}), micro_batch=1, seq_len=64)
    assert stretch.sleep_target("cpu-slow") is None and stretch.host.contended("cpu-slow")


def test_simulator_keeps_sleep_mode_devices_out_of_the_host_model():
    cm = CostModel(TINY, SLEEP4, sleep_profiles(cores=1), micro_batch=1, seq_len=64, step_allreduce=False)
    # Devices 0 (emu-a800) and 2 (emu-h20) each train the whole model on 2 micro-batches at once. Pinned to
    # one shared core in stretch mode they would share it; in sleep mode each block lasts its target, so
    # each pipeline takes exactly its blocks' targets, then the optimizer.
    dp = Strategy("dp", (Pipeline(2, (Stage((0,), (0, 6)),)), Pipeline(2, (Stage((2,), (0, 6)),))))
    r = simulate(cm, dp, 4)
    assert r.cpu_hosts == {}
    for pi, t in enumerate(("emu-a800", "emu-h20")):
        st = cm.stage(t, 1, 6, True, True)
        assert r.pipeline_end_s[pi] == pytest.approx(2 * (st.forward_s + st.backward_s))


def test_a_sleep_mode_devices_optimizer_pays_for_the_sleep_before_it():
    """A sleep-mode device's blocks last their targets, but its optimizer step runs as it is, after the
    device slept through its last block: it pays the resume penalty (the forward's figures: 0.5 s, tau
    1 s) for the idle since that block's start. Hand-computed on the dp strategy: each optimizer takes its
    price plus 0.5 (1 - e^(-idle)), idle from its pipeline's last backward's start to the optimizer's start;
    the blocks cost their targets exactly."""
    cm = CostModel(TINY, SLEEP4, sleep_profiles(cores=1), micro_batch=1, seq_len=64, step_allreduce=False)
    dp = Strategy("dp", (Pipeline(2, (Stage((0,), (0, 6)),)), Pipeline(2, (Stage((2,), (0, 6)),))))
    r = simulate(cm, dp, 4)
    price = cm.optimizer_times(dp)
    for pi, (d, t) in enumerate(((0, "emu-a800"), (2, "emu-h20"))):
        events = [e for e in r.events if e.pipeline == pi]
        st = cm.stage(t, 1, 6, True, True)
        for e in events:
            if e.category in ("forward", "backward"):
                assert e.cpu_s == pytest.approx(st.forward_s if e.category == "forward" else st.backward_s)
        last = max((e for e in events if e.category == "backward"), key=lambda e: e.start_s)
        (opt,) = (e for e in events if e.category == "optimizer")
        idle = opt.start_s - last.start_s
        assert idle > 0.1
        assert opt.cpu_s == pytest.approx(price[d] + 0.5 * (1 - math.exp(-idle)))
        assert opt.end_s - opt.start_s == pytest.approx(opt.cpu_s)


@given(layers=st.integers(1, 12), mb=st.integers(1, 8), seq=st.sampled_from([16, 64, 256, 1024]),
       tp=st.sampled_from([1, 2, 4, 8]), first=st.booleans(), last=st.booleans(), recompute=st.booleans(),
       backward=st.booleans())
@settings(max_examples=100, deadline=None)
def test_a_block_is_linear_in_its_layers(layers, mb, seq, tp, first, last, recompute, backward):
    # The planner's layer-split ILP takes a stage's cost as (per-layer coefficient) x layers + fixed part,
    # from the stage of 1 and 2 layers: the target price must be exactly that shape.
    target = sleep_target(SLEEP4.device_types["emu-h20"].emulate)

    def price(n: int) -> float:
        return target.block_s(ComputeBlock(layers=n, micro_batch=mb, seq_len=seq, backward=backward, tp=tp,
                                           recompute=recompute, first=first, last=last))

    one, two = price(1), price(2)
    assert price(layers) == pytest.approx(one + (layers - 1) * (two - one), rel=1e-9)
    assert two > one > 0


def test_packed_documents_pay_attention_per_document_and_the_fixed_cost_once():
    # attention a*s^2 + c (a = 1e-4, c = 1); MLP and norms constant per call: a packed row of documents of
    # 10 and 30 tokens costs attention 1e-4 * (100 + 900) + 1 once, not 1e-4 * 40^2 + 1 nor 2 x the fixed 1.
    p = measured(attention_fwd=(1e-4, 0.0, 1.0))
    packed = ComputeBlock(layers=1, micro_batch=1, seq_len=40, backward=False, documents=(10, 30))
    layer_rest = 3.0 + 0.5  # MLP + 2 norms, constants
    assert block_seconds(p, TINY, packed) == pytest.approx(1e-4 * (100 + 900) + 1.0 + layer_rest)
    whole = dataclasses.replace(packed, documents=())
    assert block_seconds(p, TINY, whole) == pytest.approx(1e-4 * 1600 + 1.0 + layer_rest)
    alone = dataclasses.replace(packed, documents=(40,))
    assert block_seconds(p, TINY, alone) == pytest.approx(block_seconds(p, TINY, whole))


def test_a_sleep_mode_block_lasts_its_target_whatever_the_host_measured():
    """A sleep-mode block ends at its target (runtime/trace.py ``EmulatedTarget`` spins out the end of its
    wait), so a profile's measured sleep slack and hand-off delays, which a stretched block's plain sleep
    pays, change nothing: the simulator and the estimate give the same step as without them."""
    late = CoreHandoff(handoff_s=0.5, wake_s=0.5, recv_wake_s=0.5, cold_forward_s=1.0, sleep_late_s=0.01)
    ps = sleep_profiles(cores=1)
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], models={"tiny": dataclasses.replace(
        ps[t].models["tiny"], core_handoff={64: late})}), None) for t in SLEEP4.device_types})
    base = CostModel(TINY, SLEEP4, sleep_profiles(cores=1), micro_batch=1, seq_len=64, step_allreduce=False)
    cm = CostModel(TINY, SLEEP4, ps, micro_batch=1, seq_len=64, step_allreduce=False)
    dp = Strategy("dp", (Pipeline(2, (Stage((0,), (0, 6)),)), Pipeline(2, (Stage((2,), (0, 6)),))))
    plain, slack = simulate(base, dp, 4), simulate(cm, dp, 4)
    for pi in (0, 1):
        assert slack.pipeline_end_s[pi] == pytest.approx(plain.pipeline_end_s[pi])
        assert cm.pipeline_step_time(dp, pi, "1f1b") == pytest.approx(base.pipeline_step_time(dp, pi, "1f1b"))


def with_shared_core_delay(ps: ProfileSet, delay: float) -> ProfileSet:
    return ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], comm=dataclasses.replace(
        ps[t].comm, shared_core_p2p_s=delay)), None) for t in ps})


@pytest.mark.parametrize("pipes, shared", [(((0, 2), (1, 3)), True), (((0, 1), (2, 3)), False)])
def test_a_boundary_between_workers_pinned_to_one_core_arrives_later(pipes, shared):
    """Two cores, four sleep-mode devices: the launcher pins the plan's devices to cores 0, 1, 0, 1 in id
    order, so stage boundaries 0 -> 2 and 1 -> 3 join workers sharing a core, 0 -> 1 and 2 -> 3 do not. With
    the measured 10 ms (``shared_core_p2p_s``) and one micro-batch per pipeline, each pipeline's step
    crosses its boundary twice (F, then B): 20 ms later where shared (hand-computed), the same where not,
    in the simulator and in the estimate alike."""
    ps = sleep_profiles(cores=2)
    base = CostModel(TINY, SLEEP4, ps, micro_batch=1, seq_len=64, step_allreduce=False)
    cm = CostModel(TINY, SLEEP4, with_shared_core_delay(ps, 0.01), micro_batch=1, seq_len=64, step_allreduce=False)
    strat = Strategy("pp", tuple(Pipeline(1, (Stage((a,), (0, 3)), Stage((b,), (3, 6)))) for a, b in pipes))
    extra = 0.01 if shared else 0.0
    for a, b in pipes:
        assert cm.hop_time(strat, (a,), (b,)) == pytest.approx(base.p2p_time((a,), (b,)) + extra)
        assert cm.hop_time(strat, (b,), (a,)) == pytest.approx(base.p2p_time((b,), (a,)) + extra)
    plain, late = simulate(base, strat, 2), simulate(cm, strat, 2)
    for pi in (0, 1):
        assert late.pipeline_end_s[pi] == pytest.approx(plain.pipeline_end_s[pi] + 2 * extra)
        assert cm.pipeline_step_time(strat, pi, "1f1b") == pytest.approx(
            base.pipeline_step_time(strat, pi, "1f1b") + 2 * extra)


def test_a_stretched_device_plays_the_shared_core_per_op_instead():
    """Where compute contends for the cores (stretch mode) the simulator plays the busy core's delays op by
    op (``CoreHandoff.recv_wake_s``): the measured shared-core delay is not added to its transfers."""
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(measured(t), compute=dataclasses.replace(
        measured(t).compute, host_cores=2)), None) for t in STRETCH4.device_types})
    cm = CostModel(TINY, STRETCH4, with_shared_core_delay(ps, 0.01), micro_batch=1, seq_len=64)
    strat = Strategy("pp", (Pipeline(1, (Stage((0,), (0, 3)), Stage((2,), (3, 6)))),
                            Pipeline(1, (Stage((1,), (0, 6)),)), Pipeline(1, (Stage((3,), (0, 6)),))))
    assert cm.hop_time(strat, (0,), (2,)) == pytest.approx(cm.p2p_time((0,), (2,)))


def test_a_sleep_mode_device_posts_its_messages_after_idling_through_its_block():
    """A sleep-mode block is a sleep to its target after a little real work: the action after it pays its
    cold cost (saturated here: tau 1 us). One micro-batch through two stages on devices 0 -> 1 (other
    cores): stage 0's send after F, stage 1's unpack of it, stage 1's send after B and stage 0's unpack of
    that lie on the path, 2 x (0.01 + 0.003) later (hand-computed; the receives' posts, at the start and
    right after a send, stay hot), in the simulator and in the estimate alike."""
    hot = P2pActions(post_send_s=0.001, post_recv_s=0.0005, wait_recv_s=0.0002)
    cold = dataclasses.replace(hot, cold_post_send_s=0.01, cold_post_recv_s=0.5, cold_wait_recv_s=0.003,
                               cold_tau_s=1e-6)

    def model(acts: P2pActions) -> CostModel:
        ps = sleep_profiles(cores=2)
        ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], comm=dataclasses.replace(
            ps[t].comm, p2p_actions=acts)), None) for t in ps})
        return CostModel(TINY, SLEEP4, ps, micro_batch=1, seq_len=64, step_allreduce=False)

    base, cm = model(hot), model(cold)
    pp = Strategy("pp", (Pipeline(1, (Stage((0,), (0, 3)), Stage((1,), (3, 6)))),))
    assert simulate(cm, pp, 1).pipeline_end_s[0] == pytest.approx(simulate(base, pp, 1).pipeline_end_s[0] + 0.026)
    assert cm.pipeline_step_time(pp, 0, "1f1b") == pytest.approx(base.pipeline_step_time(pp, 0, "1f1b") + 0.026)
