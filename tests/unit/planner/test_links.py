"""The network rules of planner/costmodel/network.py, hand-computed, in the closed-form estimate and the simulator
alike: rings sharing a NIC, a TP stage's boundary as the runtime sends it, a cross-node all-reduce from a
measured rate, a tick's send and receive serialised, a fixed per-iteration cost."""

from __future__ import annotations

import dataclasses

import pytest

from planner.cost import CostModel
from planner.costmodel.network import Flow, concurrent_seconds, ring_sharers, tick_seconds
from planner.simulate import simulate
from runtime.torchfree.profiling.profile import (
    COMPONENTS,
    CommFigures,
    ComponentFit,
    MeasuredModel,
    OptimizerFit,
    spec_profile,
)
from runtime.torchfree.profiling.tables import LinkCurve
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.cluster import Cluster, DeviceType, Node
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

TINY = dataclasses.replace(load_model("llama-tiny"), num_layers=2)
INTER, INTRA = 10.0, 100.0          # GB/s
ACT = 1 * 64 * TINY.hidden_size * 4  # one micro-batch's boundary activation, fp32 (B=1, s=64)


def profile(**comm: object):
    """A GPU whose decoder layer takes 1 s forward, 2 s backward (everything else free), links without
    latency at the cluster's bandwidth, a free optimizer; the TP degrees' times include their collectives."""
    zero = (0.0, 0.0, 0.0)
    comps = {c: ComponentFit(zero, zero, zero, params=10) for c in COMPONENTS}
    comps["attention"] = ComponentFit((0.0, 0.0, 1.0), (0.0, 0.0, 2.0), zero, params=10)
    mm = MeasuredModel(TINY.hidden_size, TINY.ffn_hidden_size, TINY.num_heads, TINY.num_kv_heads, TINY.vocab_size,
                       1, (64,), {t: comps for t in (1, 2, 4)}, includes_tp_comm=True)
    base = spec_profile("gpu", peak_tflops=100, hbm_bandwidth_gbs=1000, memory_gib=80, note="test")
    return dataclasses.replace(base, provenance="imported", models={"tiny": mm}, optimizer=OptimizerFit(0.0),
                               comm=CommFigures(0.0, 0.0, 1.0, **comm))  # type: ignore[arg-type]


def model(nodes: int = 2, per_node: int = 4, nics: int = 1, **comm: object) -> CostModel:
    cl = Cluster("c", {"gpu": DeviceType(80, 100, 1000, INTRA)},
                 tuple(Node(f"n{i}", "gpu", per_node) for i in range(nodes)), inter_node_bandwidth_gbs=INTER,
                 nics_per_node=nics)
    return CostModel(TINY, cl, {"gpu": profile(**comm)}, micro_batch=1, seq_len=64, step_allreduce=False)


def pp(*stages: tuple[tuple[int, ...], tuple[int, int]], m: int = 1) -> Pipeline:
    return Pipeline(m, tuple(Stage(d, lay) for d, lay in stages))


def both(cm: CostModel, s: Strategy) -> tuple[float, float]:
    """(closed-form estimate, simulated) step time."""
    return cm.estimate(s, 4).step_time_s, simulate(cm, s, 4).step_time_s


# -- the rules themselves ---------------------------------------------------------------------------


def test_concurrent_flows_share_ports_and_nics():
    node = ["a", "a", "b", "b"]
    secs = lambda a, b, n: n / 1e9   # noqa: E731  (1 GB/s everywhere)
    assert concurrent_seconds([Flow(0, 2, 100.0)], secs, node) == 100 / 1e9
    # Two flows leaving node a: its NIC carries both.
    assert concurrent_seconds([Flow(0, 2, 100.0), Flow(1, 3, 100.0)], secs, node) == 200 / 1e9
    # Within a node each pair has its link; one sender's two messages share its port.
    assert concurrent_seconds([Flow(0, 1, 100.0), Flow(2, 3, 100.0)], secs, node) == 100 / 1e9
    assert concurrent_seconds([Flow(2, 0, 100.0), Flow(2, 1, 50.0)], secs, ["a", "a", "a", "a"]) == 150 / 1e9


def test_ring_sharers_counts_sibling_rings_at_each_nic():
    node = ["a", "a", "b", "b", "c"]
    groups = [((0, 2), "x"), ((1, 3), "x"), ((0, 1, 2, 3), "y"), ((0, 1), "x"), ((3, 4), "x")]
    # (0,2) and (1,3) cross a<->b together; (3,4) is disjoint from (0,2) and touches b: 3 at b for (0,2).
    assert ring_sharers(groups, node) == [3, 2, 1, 1, 2]


def test_tick_seconds():
    assert tick_seconds([1.0, 3.0], serialise=False) == 3.0
    assert tick_seconds([1.0, 3.0], serialise=True) == 4.0
    assert tick_seconds([], serialise=True) == 0.0


# -- the five modelling changes, estimate and simulator ---------------------------------------------


def test_gradient_rings_of_a_tp_stage_share_the_nic():
    cm = model()
    s = Strategy("dp", (pp(((0, 1), (0, 2))), pp(((4, 5), (0, 2)))))
    plan = cm.sync_plan(s)
    times = cm.sync_times(s)
    shards = [i for i, g in enumerate(plan) if len(g.devices) == 2]
    norms = [i for i, g in enumerate(plan) if len(g.devices) == 4]
    assert sorted(plan[i].devices for i in shards) == [(0, 4), (1, 5)] and len(norms) == 1
    for i in shards:   # a ring of 2 sends 2(n-1)/n = 1 x its bytes; two rings on one NIC: half the bandwidth each
        assert times[i] == pytest.approx(sum(n * 4 * 2 / (INTER * 1e9) for n in plan[i].bucket_numel))
    (k,) = norms       # the norms' ring of 4 (its slowest link across nodes) runs alone
    assert times[k] == pytest.approx(sum(2 * 3 / 4 * n * 4 / (INTER * 1e9) for n in plan[k].bucket_numel))
    compute = 2 * (1.0 + 2.0)
    expect = compute + times[shards[0]] + times[k]
    est, sim = both(cm, s)
    assert est == pytest.approx(expect) and sim == pytest.approx(expect)


def test_tp4_boundary_is_every_ranks_copy():
    cm = model()
    s = Strategy("pp", (pp(((0, 1, 2, 3), (0, 1)), ((4, 5, 6, 7), (1, 2))),))
    # Each of the 4 ranks sends its full copy to its counterpart: 4 activations through one NIC.
    p = 4 * ACT / (INTER * 1e9)
    assert cm.p2p_time((0, 1, 2, 3), (4, 5, 6, 7)) == pytest.approx(p)
    assert [(f.src, f.dst, f.nbytes) for f in cm.boundary_flows((0, 1, 2, 3), (4, 5, 6, 7))] == [
        (0, 4, ACT), (1, 5, ACT), (2, 6, ACT), (3, 7, ACT)]
    expect = 1.0 + p + 1.0 + 2.0 + p + 2.0   # F0, activation, F1, B1, its gradient, B0
    est, sim = both(cm, s)
    assert est == pytest.approx(expect) and sim == pytest.approx(expect)
    # Within one node each pair has its own link: one activation's time.
    one = model(nodes=1, per_node=8)
    assert one.p2p_time((0, 1, 2, 3), (4, 5, 6, 7)) == pytest.approx(ACT / (INTRA * 1e9))
    # TP 2 -> TP 4 across nodes: each of the 2 senders sends 2 copies; still 4 through the NIC.
    assert cm.p2p_time((0, 1), (4, 5, 6, 7)) == pytest.approx(4 * ACT / (INTER * 1e9))


def test_cross_node_allreduce_from_a_measured_rate():
    rate = 4.0   # GB/s bus bandwidth, measured at two sizes
    cm = model(allreduce_curves={"inter": {2: LinkCurve((1000, 10**9), (rate, rate))}})
    assert cm.allreduce_time([0, 4], 1e6) == pytest.approx(1e6 / (rate * 1e9))
    assert model().allreduce_time([0, 4], 1e6) == pytest.approx(1e6 / (INTER * 1e9))   # no curve: the link
    s = Strategy("dp", (pp(((0,), (0, 2))), pp(((4,), (0, 2)))))
    (g,) = cm.sync_plan(s)
    sync = sum(n * 4 / (rate * 1e9) for n in g.bucket_numel)
    est, sim = both(cm, s)
    assert est == pytest.approx(6.0 + sync) and sim == pytest.approx(6.0 + sync)


@pytest.mark.parametrize("serialised", [False, True])
def test_send_and_receive_at_one_tick(serialised: bool):
    cm = model(nodes=1, per_node=8, serialised_send_recv=serialised)
    s = Strategy("pp", (pp(((0,), (0, 1)), ((1,), (1, 2)), m=2),))
    p = ACT / (INTRA * 1e9)
    assert tick_seconds((p, p), cm.serialises((0,))) == pytest.approx(2 * p if serialised else p)
    # 1F1B, 2 stages of f = 1, b = 2, m = 2 (hand-played): stage 0's send_forward 1 + recv_backward 0 and
    # stage 1's send_backward 0 + recv_forward 1 are posted together; serialised they take 2p, not p.
    # F0 | p | F1 | tick (waits for stage 1's F0 B0) | B0 | recv_backward 1 (waits for F1 B1) | p | B1.
    expect = 9.0 + (4 * p if serialised else 3 * p)
    est, sim = both(cm, s)
    assert sim == pytest.approx(expect) and est == pytest.approx(expect)


def test_fixed_cost_per_iteration():
    cm = model()
    s = Strategy("one", (pp(((0,), (0, 2))),))
    plain = both(cm, s)
    assert plain == pytest.approx((6.0, 6.0))
    slow = dataclasses.replace(profile(), iteration_s=0.25)
    cm2 = CostModel(TINY, cm.cluster, {"gpu": slow}, micro_batch=1, seq_len=64, step_allreduce=False)
    assert both(cm2, s) == pytest.approx((6.25, 6.25))


@pytest.mark.parametrize("src, dst", [((3, 1), (6, 4)), ((0, 1, 2, 3), (7, 5, 6, 4)), ((2,), (5,)),
                                      ((0, 1), (4, 5, 6, 7)), ((4, 5, 6, 7), (1, 0))])
def test_boundary_flows_are_the_runtimes_messages(src, dst):
    from runtime.torchfree.annotations.from_plan import Boundary
    from runtime.torchfree.annotations.states import Annotation
    from runtime.torchfree.engine.specialize import resolve_boundary

    cm = model()
    op = resolve_boundary(Boundary(0, 0, (1, 64, TINY.hidden_size), Annotation.spmd(src), Annotation.spmd(dst), 0, 1),
                          cm.cluster).forward
    assert sorted(cm.boundary_flows(src, dst), key=lambda f: (f.src, f.dst)) == sorted(
        (Flow(d, m.peer, float(m.nbytes)) for d in src for m in op.sends(d)), key=lambda f: (f.src, f.dst))


def test_rings_of_other_stages_do_not_share():
    """Two pipelines of two TP-1 stages across the nodes: each stage's ring runs when its stages finish
    their backward, not with the other stage's: each has the NIC to itself."""
    cm = model()
    s = Strategy("dp-pp", (pp(((0,), (0, 1)), ((1,), (1, 2))), pp(((4,), (0, 1)), ((5,), (1, 2)))))
    plan = cm.sync_plan(s)
    assert sorted(g.devices for g in plan) == [(0, 4), (1, 5)]
    for g, t in zip(plan, cm.sync_times(s)):
        assert t == pytest.approx(sum(n * 4 / (INTER * 1e9) for n in g.bucket_numel))


def test_a_nic_per_gpu_is_shared_by_nobody():
    """Rail-optimised nodes (one NIC per GPU, ``nics_per_node``): TP ranks' rings and boundary copies each
    leave by their own NIC."""
    cm = model(nics=4)
    s = Strategy("dp", (pp(((0, 1), (0, 2))), pp(((4, 5), (0, 2)))))
    for g, t in zip(cm.sync_plan(s), cm.sync_times(s)):
        if len(g.devices) == 2:
            assert t == pytest.approx(sum(n * 4 / (INTER * 1e9) for n in g.bucket_numel))
    assert cm.p2p_time((0, 1, 2, 3), (4, 5, 6, 7)) == pytest.approx(ACT / (INTER * 1e9))
    # Two NICs for four GPUs: devices 0 and 2 share NIC 0, 1 and 3 NIC 1: two copies through each.
    assert model(nics=2).p2p_time((0, 1, 2, 3), (4, 5, 6, 7)) == pytest.approx(2 * ACT / (INTER * 1e9))
