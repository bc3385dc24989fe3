"""Sleep mode's block pricing (runtime/torchfree/profiling/profile.py ``block_seconds``): hand-computed values, and
the planner / simulator pricing a sleep-mode device by the same function."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import CostModel
from planner.costmodel.targets import SleepTarget, sleep_target
from planner.simulate import simulate
from runtime.torchfree.profiling.profile import (
    ComponentFit,
    ComputeBlock,
    MeasuredModel,
    ProfileSet,
    ResolvedProfile,
    block_seconds,
    component_fits,
    eval_fit,
    spec_profile,
)
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.cluster import Emulation, EmulationTarget
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

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


def sleep_profiles() -> ProfileSet:
    """Measured-looking profiles for the sleep cluster's types."""
    return ProfileSet({t: ResolvedProfile(measured(t), None) for t in SLEEP4.device_types})


def test_planner_prices_a_sleep_mode_stage_by_its_target():
    cm = CostModel(TINY, SLEEP4, sleep_profiles(), micro_batch=1, seq_len=64, step_allreduce=False)
    for t in ("emu-a800", "emu-h20"):
        target = sleep_target(SLEEP4.device_types[t].emulate)
        assert cm.sleep_target(t) == target
        st = cm.stage(t, 1, 3, True, False)
        block = ComputeBlock(layers=3, micro_batch=1, seq_len=64, backward=False, first=True)
        assert st.forward_s == pytest.approx(target.block_s(block))
        assert st.backward_s == pytest.approx(target.block_s(dataclasses.replace(block, backward=True)))
        assert st.tp_comm_s == 0.0
    stretch = CostModel(TINY, STRETCH4, ProfileSet({t: ResolvedProfile(measured(t), None)
                                                    for t in STRETCH4.device_types}), micro_batch=1, seq_len=64)
    assert stretch.sleep_target("cpu-slow") is None


def test_simulator_plays_a_sleep_mode_device_by_its_targets():
    cm = CostModel(TINY, SLEEP4, sleep_profiles(), micro_batch=1, seq_len=64, step_allreduce=False)
    # Devices 0 (emu-a800) and 2 (emu-h20) each train the whole model on 2 micro-batches at once: each
    # pipeline takes exactly its blocks' targets, then the optimizer.
    dp = Strategy("dp", (Pipeline(2, (Stage((0,), (0, 6)),)), Pipeline(2, (Stage((2,), (0, 6)),))))
    r = simulate(cm, dp, 4)
    for pi, t in enumerate(("emu-a800", "emu-h20")):
        st = cm.stage(t, 1, 6, True, True)
        assert r.pipeline_end_s[pi] == pytest.approx(2 * (st.forward_s + st.backward_s))


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
