"""The cost model against hand-computed cases: schedule formulas, memory of a known layer, comm."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import (
    GIB,
    CostModel,
    allreduce_seconds,
    model_flops_per_token,
    pipeline_time,
)
from runtime.torchfree.annotations.states import PARTIAL, Annotation, DistributedStates
from runtime.torchfree.comm.gradsync import SyncGroup, plan_sync, sync_groups
from runtime.torchfree.profiling.profile import (
    CommFigures,
    ComponentFit,
    MeasuredModel,
    OptimizerFit,
    ProfileSet,
    ResolvedProfile,
    analytic_components,
    spec_profile,
)
from runtime.torchfree.schedule_policies import live_activation_limit
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

TINY = load_model("llama-tiny")
CPU4 = load_cluster("cpu-hetero4")


def fit(a: float = 0.0, b: float = 0.0, c: float = 0.0) -> tuple[float, float, float]:
    return (a, b, c)


def hand_profile(name: str, *, layer_fwd: float = 1.0, layer_bwd: float = 2.0, extras: bool = False,
                 act_per_token: float = 100.0, latency: float = 0.0, overhead_gib: float = 0.0):
    """A measured profile of llama-tiny whose layer costs are round numbers: attention takes
    ``layer_fwd`` forward and ``layer_bwd`` backward per micro-batch, everything else is free unless
    ``extras``; attention saves ``act_per_token`` bytes per token."""
    zero = ComponentFit(fit(), fit(), fit(), params=0)
    comps = {
        "attention": ComponentFit(fit(c=layer_fwd), fit(c=layer_bwd), fit(b=act_per_token), params=1000),
        "mlp": ComponentFit(fit(), fit(), fit(), params=3000),
        "norm": ComponentFit(fit(), fit(), fit(), params=64),
        "embedding": ComponentFit(fit(c=0.5), fit(c=0.25), fit(), params=500) if extras else zero,
        "head": ComponentFit(fit(c=0.75), fit(c=1.5), fit(), params=700) if extras else zero,
    }
    measured = MeasuredModel(hidden_size=64, ffn_hidden_size=128, num_heads=8, num_kv_heads=4, vocab_size=256,
                             micro_batch=1, seq_lens=(64,),
                             tp={1: comps, 2: {k: dataclasses.replace(v, params=v.params // 2) if k != "norm" else v
                                               for k, v in comps.items()}})
    base = spec_profile(name, peak_tflops=1.0, hbm_bandwidth_gbs=10, memory_gib=2, note="test", emulated=True,
                        framework_overhead_gib=overhead_gib)
    comm = CommFigures(p2p_latency_s=latency, allreduce_latency_s=latency, bandwidth_efficiency=1.0)
    opt = dataclasses.replace(base.optimizer, seconds_per_param=1e-6, fixed_s=0.0)
    return dataclasses.replace(base, provenance="measured", comm=comm, optimizer=opt, models={"tiny": measured})


def hand_set(**kw) -> ProfileSet:
    return ProfileSet({t: ResolvedProfile(hand_profile(t, **kw), None) for t in CPU4.device_types})


def cm_for(profiles, micro_batch: int = 1, seq_len: int = 64, step_allreduce: bool = False) -> CostModel:
    return CostModel(TINY, CPU4, profiles, micro_batch=micro_batch, seq_len=seq_len, step_allreduce=step_allreduce)


# -- closed-form schedule ------------------------------------------------------------------------


def test_1f1b_formula_hand_computed():
    # t = f + b = [3, 6, 3]; (m-1) * max + sum = 3 * 6 + 12 = 30; boundaries add once each.
    assert pipeline_time([1, 2, 1], [2, 4, 2], 4, "1f1b") == 30
    assert pipeline_time([1, 2, 1], [2, 4, 2], 4, "1f1b", [0.5, 0.25]) == 30.75


def test_gpipe_formula_hand_computed():
    # 1F1B: t = [5, 5] -> 2*5 + 10 = 20. GPipe: 2*(max f 3 + max b 4) + sum f 4 + sum b 6 = 24.
    assert pipeline_time([1, 3], [4, 2], 3, "1f1b") == 20
    assert pipeline_time([1, 3], [4, 2], 3, "gpipe") == 24


def test_in_flight_micro_batches():
    # The planner's memory bound of a one-chunk schedule: stage k of S holds min(S-k, m) under 1F1B, m under GPipe.
    assert [live_activation_limit("1f1b", 4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [live_activation_limit("1f1b", 4, k, 2) for k in range(4)] == [2, 2, 2, 1]
    assert [live_activation_limit("gpipe", 4, k, 8) for k in range(4)] == [8, 8, 8, 8]


def test_allreduce_formula():
    assert allreduce_seconds(1e9, 1, 1.0, 1.0) == 0.0
    assert allreduce_seconds(4e9, 4, 0.5, 2.0) == pytest.approx(0.5 + 2 * 3 / 4 * 4 / 2)


def test_model_flops_per_token_llama7b():
    m = load_model("llama-7b")
    n = m.num_layers * m.layer_params() + m.vocab_size * m.hidden_size
    assert model_flops_per_token(m, 2048) == 6 * n + 12 * m.num_layers * m.hidden_size * 2048
    assert 6.5e9 * 6 < model_flops_per_token(m, 2048) < 7.5e9 * 6  # ~6.7B params


# -- stage time and memory of a known layer -------------------------------------------------------


def test_stage_time_uses_measured_fits():
    cm = cm_for(hand_set(extras=True))
    s = cm.stage("cpu-fast", 1, 3, first=True, last=False)
    assert s.forward_s == pytest.approx(3 * 1.0 + 0.5)
    assert s.backward_s == pytest.approx(3 * 2.0 + 0.25)
    s = cm.stage("cpu-fast", 1, 3, first=False, last=True, recompute=True)
    assert s.forward_s == pytest.approx(3 * 1.0 + 0.75)
    assert s.backward_s == pytest.approx(3 * (2.0 + 1.0) + 1.5)  # recompute re-runs each layer's forward
    assert s.params == 3 * (1000 + 3000 + 2 * 64) + 64 + 700   # final norm + head


def test_memory_of_a_known_layer():
    cm = cm_for(hand_set(act_per_token=100.0, overhead_gib=0.25), micro_batch=2, seq_len=64)
    m = cm.stage_memory("cpu-fast", 1, num_layers=2, first=False, last=False, recompute=False, in_flight=3)
    params = 2 * (1000 + 3000 + 2 * 64)
    assert m.params == params * 4 and m.grads == params * 4 and m.optimizer == params * 8
    assert m.activations == 3 * 2 * (100.0 * 2 * 64)           # in-flight x layers x bytes/token x tokens
    assert m.overhead == 0.25 * GIB
    z = cm.stage_memory("cpu-fast", 1, 2, False, False, False, 3, zero_degree=4)
    assert z.optimizer == params * 8 / 4 and z.params == m.params
    # Recompute keeps each layer's input [B, s, h] fp32 per micro-batch, plus one layer's activations.
    r = cm.stage_memory("cpu-fast", 1, 2, False, False, True, 3)
    assert r.activations == 3 * 2 * (2 * 64 * 64 * 4) + 100.0 * 2 * 64


def test_analytic_params_match_parameter_table():
    for tp in (1, 2, 4):
        comps = analytic_components(TINY, spec_profile("x", peak_tflops=1, hbm_bandwidth_gbs=1, memory_gib=1,
                                                       note="").compute, tp)
        layer = comps["attention"].params + comps["mlp"].params + 2 * comps["norm"].params
        h = TINY.hidden_size
        # Sharded q/k/v/o and gate/up/down split by tp, the two norms are duplicated.
        assert layer == (TINY.layer_params() - 2 * h) // tp + 2 * h
        assert comps["head"].params == TINY.vocab_size * h // tp


def test_analytic_costs_scale_with_peak_and_tp():
    m = load_model("llama-7b")
    slow = spec_profile("a", peak_tflops=100, hbm_bandwidth_gbs=2000, memory_gib=80, note="").compute
    fast = dataclasses.replace(slow, peak_tflops=200)
    a, b = analytic_components(m, slow, 1)["mlp"], analytic_components(m, fast, 1)["mlp"]
    # The MLP's per-token term is FLOPs / rate + bytes / bandwidth: doubling the rate halves the first part.
    flops = 6 * m.hidden_size * m.ffn_hidden_size / (100e12 * slow.matmul_efficiency)
    assert a.forward_s[1] - b.forward_s[1] == pytest.approx(flops / 2)
    t2 = analytic_components(m, slow, 2)["mlp"]
    assert t2.forward_s[1] == pytest.approx(a.forward_s[1] / 2)
    att = analytic_components(m, slow, 1)["attention"]
    assert att.forward_s[0] > 0  # attention is quadratic in sequence length


def test_measured_fits_only_for_matching_shape():
    profiles = hand_set()
    assert cm_for(profiles).is_measured("cpu-fast", 1)
    assert not cm_for(profiles).is_measured("cpu-fast", 4)   # TP 4 not measured: analytic
    big = CostModel(load_model("llama-7b"), CPU4, profiles, micro_batch=1, seq_len=64)
    assert not big.is_measured("cpu-fast", 1)


# -- communication ----------------------------------------------------------------------------------


def test_p2p_is_latency_plus_bytes_over_bandwidth():
    cm = cm_for(hand_set(latency=0.001))
    nbytes = 1 * 64 * 64 * 4
    bw = CPU4.bandwidth_gbs(0, 2) * 1.0
    assert cm.p2p_time((0,), (2,)) == pytest.approx(0.001 + nbytes / (bw * 1e9))


def test_tp_collectives_in_stage_time():
    cm = cm_for(hand_set(latency=0.001))
    one, two = cm.stage("cpu-fast", 1, 2, False, False), cm.stage("cpu-fast", 2, 2, False, False)
    assert one.tp_comm_s == 0
    nbytes = 64 * 64 * 4
    ar = 0.001 * 2 + nbytes / (2 * 1e9)     # latency per ring step x 2(n-1), then 2(n-1)/n x bytes / bw
    assert two.tp_comm_s == pytest.approx(2 * 4 * ar)  # 2 layers x (2 forward + 2 backward all-reduces)


def test_grad_sync_two_equal_pipelines():
    cm = cm_for(hand_set(latency=0.0))
    one = Strategy("one", (Pipeline(8, (Stage((0,), (0, 6)),)),))
    assert cm.sync_plan(one) == [] and cm.grad_sync_time(one) == 0
    two = Strategy("two", (Pipeline(4, (Stage((0,), (0, 6)),)), Pipeline(4, (Stage((1,), (0, 6)),))))
    (group,) = cm.sync_plan(two)                     # everything in one fused all-reduce
    assert group.devices == (0, 1) and group.numel == TINY.total_params()
    # Ring of 2: 2(n-1)/n = 1 times the bytes over the link (2 GB/s, efficiency 1), no latency.
    expect = TINY.total_params() * 4 / (CPU4.bandwidth_gbs(0, 1) * 1e9)
    assert cm.grad_sync_times(two) == pytest.approx({0: expect, 1: expect})


def test_split_allreduce_lcm_slices():
    cm = cm_for(hand_set(latency=0.001))
    s = Strategy("mixed", (Pipeline(6, (Stage((0, 1), (0, 6)),)), Pipeline(2, (Stage((2,), (0, 6)),))))
    g02, g12, g012 = cm.sync_plan(s)
    h, v = TINY.hidden_size, TINY.vocab_size
    sharded = 2 * v * h + 6 * (TINY.layer_params() - 2 * h)
    # Each TP-2 device shares its half of the sharded weights with the TP-1 device; the norms, duplicated
    # in the TP-2 group, are all-reduced by all three devices (device 1's replica contributes zeros).
    assert (g02.devices, g12.devices, g012.devices) == ((0, 2), (1, 2), (0, 1, 2))
    assert g02.numel == g12.numel == sharded / 2 and g012.numel == 6 * 2 * h + h
    ring = lambda numel: 0.001 * 2 + numel * 4 / (2 * 1e9)   # noqa: E731 (latency x 2(n-1) + bytes / bw)
    norms = cm.allreduce_time([0, 1, 2], g012.numel * 4)
    times = cm.grad_sync_times(s)
    assert times[0] == pytest.approx(ring(g02.numel) + norms) and times[1] == pytest.approx(ring(g12.numel) + norms)
    assert times[2] == pytest.approx(ring(g02.numel) + ring(g12.numel) + norms)
    # The span, as the runtime runs the groups (one global order, each a rendezvous): device 2's two rings
    # then the norms, here also the busiest device's sum.
    assert cm.grad_sync_time(s) == pytest.approx(times[2])


def test_grad_sync_span_waits_for_peers_held_up_elsewhere():
    """A TP-2 stage against two TP-1 stages: the groups (0,2) (0,3) (1,2) (1,3) then the norms (0,1,2)
    (0,1,3), in the runtime's order. (1,2) waits for device 2's first ring and (1,3) for both, so the norms
    start after three rings, where each device's own groups take two rings and the norms."""
    cm = cm_for(hand_set(latency=0.001))
    s = Strategy("chain", (Pipeline(6, (Stage((0, 1), (0, 6)),)),
                           Pipeline(2, (Stage((2,), (0, 3)), Stage((3,), (3, 6))))))
    plan, secs = cm.sync_plan(s), cm.sync_times(s)
    assert [g.devices for g in plan] == [(0, 2), (0, 3), (1, 2), (1, 3), (0, 1, 2), (0, 1, 3)]
    ring, norms = secs[0], secs[4] + secs[5]
    assert secs[:4] == pytest.approx([ring] * 4)
    assert cm.grad_sync_time(s) == pytest.approx(3 * ring + norms)
    assert max(cm.grad_sync_times(s).values()) == pytest.approx(2 * ring + norms)
    assert cm.estimate(s, global_batch=8).grad_sync_s == pytest.approx(3 * ring + norms)


# -- whole strategy --------------------------------------------------------------------------------


def test_estimate_adds_up_and_flags_oom():
    cm = cm_for(hand_set(extras=True))
    s = Strategy("s", (Pipeline(4, (Stage((0,), (0, 3)), Stage((1,), (3, 6)))),))
    est = cm.estimate(s, global_batch=4)
    p = est.pipelines[0]
    f = [st.forward_s for st in p.stages]
    b = [st.backward_s for st in p.stages]
    assert p.time_s == pytest.approx(3 * max(x + y for x, y in zip(f, b)) + sum(f) + sum(b) + sum(p.boundary_s))
    assert est.step_time_s == pytest.approx(p.time_s + est.grad_sync_s + est.optimizer_s)
    assert est.tokens_per_s == pytest.approx(4 * 64 / est.step_time_s)
    assert est.fits
    # A model far too big for 2 GiB devices.
    big = CostModel(load_model("llama-7b"), CPU4, hand_set(), micro_batch=1, seq_len=64)
    est = big.estimate(Strategy("b", (Pipeline(4, (Stage((0,), (0, 16)), Stage((1,), (16, 32)))),)), 4)
    assert est.oom_devices == (0, 1)
    assert est.memory[0].gib > 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 5), st.floats(0.1, 5)), min_size=1, max_size=5), st.integers(1, 12))
def test_1f1b_never_slower_than_gpipe_formula(stages, m):
    f, b = [x for x, _ in stages], [y for _, y in stages]
    assert pipeline_time(f, b, m, "1f1b") <= pipeline_time(f, b, m, "gpipe") + 1e-9
    assert pipeline_time(f, b, m, "1f1b") >= m * max(x + y for x, y in stages) - 1e-9


def test_cost_calls_are_cached_and_fast():
    cm = CostModel(load_model("llama-32b"), load_cluster("h800-h20-48"),
                   ProfileSet({t: ResolvedProfile(spec_profile(t, peak_tflops=989, hbm_bandwidth_gbs=3350,
                                                               memory_gib=80, note=""), None)
                               for t in ("H800", "H20")}), micro_batch=1, seq_len=4096)
    a = cm.stage("H800", 8, 30, True, False, False)
    assert cm.stage("H800", 8, 30, True, False, False) is a
    assert math.isfinite(a.time_s) and a.time_s > 0


def test_measured_tp_overhead_replaces_counted_collectives():
    ps = hand_set(latency=0.001)
    over = ComponentFit((0.0, 0.0, 0.01), (0.0, 0.0, 0.02), (0.0, 0.0, 0.0), params=0)
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(
        ps[t], models={k: dataclasses.replace(m, tp_overhead={2: over}) for k, m in ps[t].models.items()}), None)
        for t in ps})
    cm = cm_for(ps)
    fast = cm.stage("cpu-fast", 2, 3, False, False)
    assert (fast.tp_forward_s, fast.tp_backward_s) == pytest.approx((3 * 0.01, 3 * 0.02))


def blocks_set(**kw) -> ProfileSet:
    """``hand_set`` plus measured stage blocks (layer 1.5/2.5 s, stage 0.2/0.1, embedding 0.3/0.05, head
    0.4/0.6) and, at TP 2, measured TP blocks (wall: layer 0.1/0.2, stage 0.01/0.02, embedding 0.03/0,
    head 0.04/0.05)."""
    ps = hand_set(**kw)

    def blk(f: float, b: float) -> ComponentFit:
        return ComponentFit(fit(c=f), fit(c=b), fit(), params=0)

    blocks = {"layer": blk(1.5, 2.5), "stage": blk(0.2, 0.1), "embedding": blk(0.3, 0.05), "head": blk(0.4, 0.6)}
    tp = {"layer": blk(0.1, 0.2), "stage": blk(0.01, 0.02), "embedding": blk(0.03, 0.0), "head": blk(0.04, 0.05)}
    return ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], models={k: dataclasses.replace(
        m, blocks={1: blocks, 2: blocks}, tp_overhead={2: tp["layer"]}, tp_blocks={2: tp})
        for k, m in ps[t].models.items()}), None) for t in ps})


def test_measured_stage_blocks_replace_the_component_sum():
    cm = cm_for(blocks_set(extras=True))
    # Timed whole: n layers + the stage's fixed time + what the embedding / head add.
    mid = cm.stage("cpu-fast", 1, 2, False, False)
    assert (mid.forward_s, mid.backward_s) == pytest.approx((2 * 1.5 + 0.2, 2 * 2.5 + 0.1))
    whole = cm.stage("cpu-fast", 1, 3, True, True)
    assert (whole.forward_s, whole.backward_s) == pytest.approx((4.5 + 0.2 + 0.3 + 0.4, 7.5 + 0.1 + 0.05 + 0.6))
    # Parameters and activations still come from the components.
    assert whole.params == 3 * cm.layer("cpu-fast", 1).params + 500 + 64 + 700   # + the final norm
    # TP 2: the measured TP blocks.
    tp = cm.stage("cpu-fast", 2, 2, True, False)
    assert (tp.tp_forward_s, tp.tp_backward_s) == pytest.approx((2 * 0.1 + 0.01 + 0.03, 2 * 0.2 + 0.02))


def test_a_sequence_parallel_plan_is_priced_by_the_tp_blocks_measured_with_it():
    """``tp_blocks_sp`` (measured with sequence parallelism on: wall layer 0.3/0.4, stage 0.05/0.06,
    embedding 0.07/0, head 0.08/0.09) price the TP stages of a sequence-parallel
    plan; a plan without it keeps ``tp_blocks``; a profile without SP figures prices both by ``tp_blocks``."""
    base = blocks_set(extras=True)

    def blk(f: float, b: float) -> ComponentFit:
        return ComponentFit(fit(c=f), fit(c=b), fit(), params=0)

    sp = {"layer": blk(0.3, 0.4), "stage": blk(0.05, 0.06), "embedding": blk(0.07, 0.0), "head": blk(0.08, 0.09)}
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(base[t], models={
        k: dataclasses.replace(m, tp_blocks_sp={2: sp})
        for k, m in base[t].models.items()}), None) for t in base})

    def model(profiles, sequence_parallel: bool) -> CostModel:
        return CostModel(TINY, CPU4, profiles, micro_batch=1, seq_len=64, step_allreduce=False,
                         sequence_parallel=sequence_parallel)

    on = model(ps, True).stage("cpu-fast", 2, 2, True, False)
    assert (on.tp_forward_s, on.tp_backward_s) == pytest.approx((2 * 0.3 + 0.05 + 0.07, 2 * 0.4 + 0.06))
    off = model(ps, False).stage("cpu-fast", 2, 2, True, False)   # blocks_set's tp_blocks
    assert (off.tp_forward_s, off.tp_backward_s) == pytest.approx((2 * 0.1 + 0.01 + 0.03, 2 * 0.2 + 0.02))
    # the stated fallback: no SP figures in the profile, the SP plan priced as without SP
    old = model(base, True).stage("cpu-fast", 2, 2, True, False)
    assert (old.tp_forward_s, old.tp_backward_s) == pytest.approx((off.tp_forward_s, off.tp_backward_s))
    # TP 1 stages have no TP overhead, whatever the plan's switch
    assert model(ps, True).stage("cpu-fast", 1, 2, True, False).tp_forward_s == 0.0


def test_a_measured_split_backward_prices_b_and_w_on_their_own():
    """A profile with ``split_blocks`` (B and W of the layer, the stage's fixed part and the head, as the
    engine runs a split backward): a chunk's B and W are their sums, not shares of the fused backward;
    the first chunk (no input gradient) and a recompute chunk keep their rule."""
    base = blocks_set(extras=True)

    def blk(b: float, w: float) -> ComponentFit:
        return ComponentFit(fit(c=b), fit(c=w), fit(), params=0)

    split = {"layer": blk(2.0, 1.25), "stage": blk(0.3, 0.2), "head": blk(0.5, 0.25)}
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(base[t], models={
        k: dataclasses.replace(m, split_blocks={1: split}) for k, m in base[t].models.items()}), None) for t in base})
    cm, plain = cm_for(ps), cm_for(base)
    mid = cm.chunk_cost("cpu-fast", 1, 2, False, False)
    assert (mid.input_grad, mid.weight_grad) == pytest.approx((2 * 2.0 + 0.3, 2 * 1.25 + 0.2))
    assert mid.full_backward == pytest.approx(2 * 2.5 + 0.1) and mid.forward == pytest.approx(2 * 1.5 + 0.2)
    last = cm.chunk_cost("cpu-fast", 1, 3, False, True)
    assert (last.input_grad, last.weight_grad) == pytest.approx((6.0 + 0.3 + 0.5, 3.75 + 0.2 + 0.25))
    # the emulated 3x type: its profile's fits are as stretched as its blocks (here: the same hand fits)
    assert cm.chunk_cost("cpu-slow", 1, 2, False, False).input_grad == pytest.approx(4.3)
    for args in (("cpu-fast", 1, 2, True, False), ("cpu-fast", 1, 2, False, False, True)):
        assert cm.chunk_cost(*args) == plain.chunk_cost(*args)


def test_step_overhead_and_sync_packing_are_priced():
    ps = hand_set()
    per = OptimizerFit(seconds_per_param=1e-6, seconds_per_tensor=1e-3, fixed_s=0.5)
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], step_overhead=per, sync_pack=per), None)
                     for t in ps})
    cm = cm_for(ps)
    dp = Strategy("dp", (Pipeline(1, (Stage((0,), (0, 6)),)), Pipeline(1, (Stage((1,), (0, 6)),))))
    (group,) = cm.sync_plan(dp)
    assert group.slices == cm.tensors_per_stage(6, True, True)   # every gradient of the model, whole
    plain = cm_for(hand_set())
    assert cm.sync_group_time(group) == pytest.approx(plain.sync_group_time(group) + 1e-6 * group.numel
                                                     + 1e-3 * group.slices + 0.5)
    n, tensors = cm.device_params(dp)[0]
    assert cm.step_overhead_times(dp)[0] == pytest.approx(1e-6 * n + 1e-3 * tensors + 0.5)
    assert cm.estimate(dp, 2).step_time_s == pytest.approx(plain.estimate(dp, 2).step_time_s
                                                          + cm.step_overhead_times(dp)[0]
                                                          + cm.sync_group_time(group) - plain.sync_group_time(group))


def test_zero1_adds_the_parameter_allgather():
    cm = cm_for(hand_set(latency=0.001))
    dp = Strategy("dp", (Pipeline(4, (Stage((0,), (0, 6)),)), Pipeline(4, (Stage((1,), (0, 6)),))))
    (group,) = cm.sync_plan(dp)
    bw = CPU4.bandwidth_gbs(0, 1) * 1e9                  # no measured all-reduce: the link, efficiency 1
    nbytes = TINY.total_params() * 4                     # fp32 parameters, one bucket (< 32 MiB)
    # A ring all-gather of 2: n-1 = 1 step of latency 0.001 (an all-reduce has 2), half the traffic.
    gather = 0.001 + nbytes / (2 * bw)
    assert cm.zero_gather_time(group) == pytest.approx(gather)
    assert cm.zero_gather_times(dp) == pytest.approx({0: gather, 1: gather})
    assert cm.zero_gather_times(dp, zero=False) == {0: 0.0, 1: 0.0}
    n, _ = cm.device_params(dp)[0]
    plain, zero = cm.estimate(dp, 8, zero=False), cm.estimate(dp, 8, zero=True)
    # ZeRO-1 on: the optimizer updates half the parameters (1 us each), then the all-gather runs.
    assert zero.step_time_s == pytest.approx(plain.step_time_s - 1e-6 * n / 2 + gather)
    assert zero.extra["zero_gather_s"] == pytest.approx(gather) and plain.extra["zero_gather_s"] == 0.0
    # One pipeline: no replicas, nothing sharded, nothing gathered.
    one = Strategy("one", (Pipeline(8, (Stage((0,), (0, 6)),)),))
    assert cm.estimate(one, 8, zero=True).step_time_s == cm.estimate(one, 8, zero=False).step_time_s


def sync_group(devices: tuple[int, ...], *sizes: int) -> SyncGroup:
    """The runtime's one sync group of gradients of these sizes, each a summand per device."""
    ann = Annotation.union(PARTIAL, [((d,), DistributedStates.of()) for d in devices])
    (group,) = sync_groups(plan_sync([ann.layout((n,)) for n in sizes]))
    return group


def test_zero1_allgather_per_sync_bucket():
    cm = cm_for(hand_set(latency=0.001))
    group = sync_group((0, 1), *[4_000_000] * 5)        # 80 MB of fp32: 3 buckets of 32 MiB at most
    bw = CPU4.bandwidth_gbs(0, 1) * 1e9
    assert len(group.buckets) == 3
    assert cm.zero_gather_time(group) == pytest.approx(3 * 0.001 + 80e6 / (2 * bw))


def test_zero1_allgather_uses_the_measured_fit():
    from runtime.torchfree.profiling.profile import LinkFit

    ps = hand_set(latency=0.001)
    fits = {2: LinkFit(latency_s=0.002, bandwidth_gbs=0.5), 4: LinkFit(latency_s=0.006, bandwidth_gbs=0.25)}
    ps = ProfileSet({t: ResolvedProfile(dataclasses.replace(ps[t], comm=dataclasses.replace(ps[t].comm,
                                                                                           allgather=fits)), None)
                     for t in ps})
    cm = cm_for(ps)
    # Measured: latency + (n-1)/n x gathered bytes / bandwidth, the group size's own fit; one 4 MB bucket.
    assert cm.allgather_time([0, 1], 4e6) == pytest.approx(0.002 + 0.5 * 4e6 / 0.5e9)
    assert cm.allgather_time([0, 1, 2, 3], 4e6) == pytest.approx(0.006 + 0.75 * 4e6 / 0.25e9)
    assert cm.zero_gather_time(sync_group((0, 1), 1_000_000)) == pytest.approx(0.002 + 0.5 * 4e6 / 0.5e9)
    # A group size not measured: the nearest one's fit (a tie goes to the smaller), its latency scaled by
    # ring steps: 3 devices take 2 steps where 2 take 1.
    assert cm.allgather_time([0, 1, 2], 3e6) == pytest.approx(0.002 * 2 + 2 / 3 * 3e6 / 0.5e9)


# -- partial recompute (Stage.recompute_layers): one rule for time and memory ---------------------------


def test_partial_recompute_time_memory_and_split_backward_hand_computed():
    cm = cm_for(hand_set(act_per_token=100.0, extras=True), micro_batch=2, seq_len=64)
    s = cm.stage("cpu-fast", 1, 3, first=False, last=True, recompute_layers=2)
    assert s.forward_s == pytest.approx(3 * 1.0 + 0.75)
    assert s.backward_s == pytest.approx(3 * 2.0 + 2 * 1.0 + 1.5)   # two of three layers rerun their forward
    assert cm.stage("cpu-fast", 1, 3, False, True, recompute_layers=3) == cm.stage("cpu-fast", 1, 3, False, True, True)
    # Memory: a recomputed layer keeps its input [B, s, h] fp32, the other its 100 B/token; one layer's
    # activations live again while it is recomputed.
    act, ckpt = 100.0 * 2 * 64, 2 * 64 * 64 * 4
    m = cm.stage_memory("cpu-fast", 1, 3, False, False, False, 4, recompute_layers=1)
    assert m.activations == 4 * (2 * act + ckpt) + act
    assert cm.stage_memory("cpu-fast", 1, 3, False, False, False, 4, recompute_layers=0).activations == 4 * 3 * act
    assert cm.chunk_activation_bytes("cpu-fast", 1, 3, False, False, 2) == act + 2 * ckpt
    # Two chunks (ZB-V), the first recomputing both its layers: live chunks at the larger chunk's bytes.
    d = cm.device_memory("cpu-fast", 1, ((2, False, False), (2, False, False)), False, 4, 1, (2, 0))
    assert d.activations == act + 4 * max(2 * ckpt, 2 * act)
    # Split backward: the recomputed layers' weight gradients are B's, so W is the one other layer's share
    # of the backward compute (3 * 2.0 s: the recompute forward is not backward compute) plus the head's.
    p, h, v = TINY.layer_params(), TINY.hidden_size, TINY.vocab_size
    share = (1 * 2 * p + 2 * v * h) / (3 * (4 * p + 8 * h * 64) + 4 * v * h)
    c = cm.chunk_cost("cpu-fast", 1, 3, False, True, recompute_layers=2)
    assert c.weight_grad == pytest.approx(share * (3 * 2.0 + 1.5))
    assert c.input_grad == pytest.approx(s.backward_s - c.weight_grad)
    assert c.full_backward == pytest.approx(s.backward_s)


def test_partial_recompute_in_a_strategy_prices_its_chunks():
    """``Stage.recompute_layers`` reaches the estimate: the stage's lowest layers, chunk by chunk."""
    cm = cm_for(hand_set(act_per_token=100.0))
    plain = Strategy(name="s", pipelines=(Pipeline(micro_batches=4, stages=(
        Stage(devices=(0,), layers=((0, 3),)), Stage(devices=(1,), layers=((3, 6),)))),))
    part = dataclasses.replace(plain, pipelines=(dataclasses.replace(plain.pipelines[0], stages=(
        Stage(devices=(0,), layers=((0, 3),), recompute_layers=2), plain.pipelines[0].stages[1])),))
    a, b = cm.stage_total(plain.pipelines[0].stages[0]), cm.stage_total(part.pipelines[0].stages[0])
    assert b.backward_s - a.backward_s == pytest.approx(2 * 1.0)
    ma, mb = cm.pipeline_memory(plain, 0, "1f1b")[0], cm.pipeline_memory(part, 0, "1f1b")[0]
    # 1F1B stage 0 of 2 holds 2 micro-batches: two layers drop to their input, one layer's bytes return once.
    act, ckpt = 100.0 * 64, 64 * 64 * 4
    assert mb.activations - ma.activations == pytest.approx(2 * 2 * (ckpt - act) + act)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(0, 6), in_flight=st.integers(1, 8), first=st.booleans(), last=st.booleans())
def test_partial_recompute_between_none_and_all(n, k, in_flight, first, last):
    """Every partial recompute lies between none and all: time grows by one forward per recomputed layer,
    memory falls as more recompute (past the first, which brings the one-layer replay), split costs add up."""
    k = min(k, n)
    cm = cm_for(hand_set(act_per_token=5000.0, extras=True))
    t = [cm.stage("cpu-slow", 1, n, first, last, recompute_layers=r).backward_s for r in range(n + 1)]
    assert all(b - a == pytest.approx(1.0) for a, b in zip(t, t[1:]))
    mem = [cm.stage_memory("cpu-slow", 1, n, first, last, False, in_flight, recompute_layers=r).total
           for r in range(n + 1)]
    assert all(b <= a for a, b in zip(mem[1:], mem[2:]))
    assert mem[n] == cm.stage_memory("cpu-slow", 1, n, first, last, True, in_flight).total
    c = cm.chunk_cost("cpu-slow", 1, n, first, last, recompute_layers=k)
    if k < n or first:   # the whole backward split in two (a full-recompute chunk's W reruns the graph)
        assert c.input_grad + c.weight_grad == pytest.approx(t[k])
