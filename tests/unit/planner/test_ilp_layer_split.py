"""Layer-split ILP and the fast min-max split against brute-force enumeration of every split."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import GIB, CostModel, pipeline_time
from planner.layer_split import SlotCost, feasible, recompute_choice, slot_costs, split_fast, split_ilp, stage_time
from planner.tp_groups import GroupKind
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model

KIND = GroupKind("x", 1)


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute_force(slots, num_layers: int, m: int) -> float:
    """The optimum of (m-1)*max + sum over every split and every recompute choice that fits."""
    best = math.inf
    for layers in compositions(num_layers, len(slots)):
        times = []
        for s, n in zip(slots, layers):
            opts = [stage_time(s, n, rc) for rc in (False, True) if n <= s.max_layers[rc]]
            if not opts:
                break
            times.append(opts)
        else:
            for choice in itertools.product(*times):
                best = min(best, (m - 1) * max(choice) + sum(choice))
    return best


def brute_minmax(slots, num_layers: int) -> float:
    best = math.inf
    for layers in compositions(num_layers, len(slots)):
        worst = 0.0
        for s, n in zip(slots, layers):
            opts = [stage_time(s, n, rc) for rc in (False, True) if n <= s.max_layers[rc]]
            if not opts:
                worst = math.inf
                break
            worst = max(worst, min(opts))
        best = min(best, worst)
    return best


slot_st = st.builds(
    lambda a0, extra, c, n0, n1: SlotCost(KIND, False, False, 1, (a0, a0 + extra), c, (n0, max(n0, n1))),
    st.floats(0.1, 5.0), st.floats(0.05, 3.0), st.floats(0.0, 4.0), st.integers(-1, 7), st.integers(-1, 9))


@settings(max_examples=40, deadline=None)
@given(slots=st.lists(slot_st, min_size=1, max_size=4), num_layers=st.integers(1, 9), m=st.integers(1, 12))
def test_ilp_finds_the_brute_force_optimum(slots, num_layers, m):
    want = brute_force(slots, num_layers, m)
    got = split_ilp(slots, num_layers, m)
    if math.isinf(want):
        assert got is None
        assert not feasible(slots, num_layers)
        return
    assert got is not None
    assert sum(got.layers) == num_layers and min(got.layers) >= 1
    for s, n, rc in zip(slots, got.layers, got.recompute):
        assert n <= s.max_layers[rc]           # fits memory with the recompute choice it made
    assert got.pipeline_s(m) == pytest.approx(want, rel=1e-7, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(slots=st.lists(slot_st, min_size=1, max_size=4), num_layers=st.integers(1, 9))
def test_fast_split_is_the_exact_min_max(slots, num_layers):
    want = brute_minmax(slots, num_layers)
    got = split_fast(slots, num_layers)
    if math.isinf(want):
        assert got is None
        return
    assert got is not None
    assert sum(got.layers) == num_layers
    for s, n, rc in zip(slots, got.layers, got.recompute):
        assert n <= s.max_layers[rc]
    assert got.max_s == pytest.approx(want, rel=1e-7, abs=1e-9)


def test_memory_forces_recompute_only_where_needed():
    # Stage 0 holds at most 2 layers without recompute, 6 with; stage 1 is slow. 8 layers: stage 0 must
    # take more than 2 to balance, so it recomputes; stage 1 never does.
    slots = (SlotCost(KIND, True, False, 2, (1.0, 1.3), 0.0, (2, 6)),
             SlotCost(KIND, False, True, 1, (2.0, 2.6), 0.0, (8, 8)))
    got = split_ilp(slots, 8, 10)
    assert got is not None
    assert got.recompute == (True, False)
    assert got.pipeline_s(10) == pytest.approx(brute_force(slots, 8, 10))


def test_real_cost_model_split_matches_brute_force_and_estimate():
    model = load_model("llama-tiny")
    cluster = load_cluster("cpu-hetero4")
    cm = CostModel(model, cluster, resolve_profiles(cluster.device_types, include_shipped=False),
                   micro_batch=1, seq_len=64)
    kinds = (GroupKind("cpu-fast", 1), GroupKind("cpu-slow", 2), GroupKind("cpu-fast", 1))
    slots = slot_costs(cm, kinds)
    for m in (3, 8):
        got = split_ilp(slots, model.num_layers, m)
        assert got is not None
        assert got.pipeline_s(m) == pytest.approx(brute_force(slots, model.num_layers, m), rel=1e-9)
        # The split's stage times are exactly the cost model's.
        stages = [cm.stage(k.device_type, k.tp, n, i == 0, i == 2, rc)
                  for i, (k, n, rc) in enumerate(zip(kinds, got.layers, got.recompute))]
        assert [s.time_s for s in stages] == pytest.approx(list(got.stage_s), rel=1e-9)
        assert pipeline_time([s.forward_s for s in stages], [s.backward_s for s in stages], m) == \
            pytest.approx(got.pipeline_s(m), rel=1e-9)


def test_slot_memory_limit_is_the_cost_models():
    model = load_model("llama-32b")
    cluster = load_cluster("h800-h20-48")
    cm = CostModel(model, cluster, resolve_profiles(cluster.device_types), micro_batch=1, seq_len=4096)
    kinds = (GroupKind("H20", 4), GroupKind("H800", 1))
    for slot, k in zip(slot_costs(cm, kinds, zero_degree=2), range(2)):
        for rc in (False, True):
            n = slot.max_layers[rc]
            cap = cluster.device_types[slot.kind.device_type].memory_gib * 2**30
            fits = cm.stage_memory(slot.kind.device_type, slot.kind.tp, n, k == 0, k == 1, rc, 2 - k, 2).total
            assert fits <= cap
            if n < model.num_layers:
                over = cm.stage_memory(slot.kind.device_type, slot.kind.tp, n + 1, k == 0, k == 1, rc, 2 - k, 2)
                assert over.total > cap


def test_partial_recompute_where_memory_binds():
    """Stage 0 holds 2 layers without recompute, 6 with; n layers need ``partial[n]`` of them recomputed
    (each +0.5 s). 8 layers: by hand, (5, 3) with 3 recomputed gives stages 5 + 1.5 = 6.5 and 6: the
    least bottleneck ((4, 4): 8; (6, 2): all six recomputed, 9; whole-stage recompute at best 7.5)."""
    slot0 = SlotCost(KIND, True, False, 2, (1.0, 1.5), 0.0, (2, 6), partial=(0, 0, 0, 1, 2, 3, 6))
    slots = (slot0, SlotCost(KIND, False, True, 1, (2.0, 3.0), 0.0, (8, 8)))
    got = split_fast(slots, 8)
    assert got is not None
    assert got.layers == (5, 3) and got.recompute_layers == (3, 0) and got.recompute == (False, False)
    assert got.stage_s == pytest.approx((6.5, 6.0))
    # Six layers need every one recomputed: that is whole-stage recompute, not partial.
    assert stage_time(slot0, 6, True) == pytest.approx(9.0)
    assert recompute_choice(slot0, 6) == (True, 0) and recompute_choice(slot0, 4) == (False, 2)
    assert recompute_choice(slot0, 2) == (False, 0)
    # The ILP knows whole-stage recompute only; with the fast split as incumbent it never does worse.
    ilp = split_ilp(slots, 8, 10, incumbent=got)
    assert ilp is not None and ilp.pipeline_s(10) <= got.pipeline_s(10) + 1e-9
    # Without the partial table the best is whole-stage recompute: slower.
    plain = split_fast((dataclasses.replace(slot0, partial=()), slots[1]), 8)
    assert plain is not None and plain.max_s > got.max_s


def test_slot_partial_table_from_the_cost_model():
    """``slot_costs``' partial table is the least recompute count with which ``device_memory`` fits."""
    model, cluster = load_model("llama-7b"), load_cluster("hexiscale-mixed")
    cm = CostModel(model, cluster, resolve_profiles(cluster.device_types), micro_batch=1, seq_len=4096)
    kind = GroupKind("RTX4090", 1)
    slot = slot_costs(cm, (kind, kind, kind))[0]   # the first of three stages: the embedding, 3 in flight
    cap = cluster.device_types["RTX4090"].memory_gib * GIB
    assert slot.partial and slot.max_layers[0] < len(slot.partial) - 1
    for n in range(slot.max_layers[0] + 1, len(slot.partial)):
        k = slot.partial[n]
        def mem(r: int, n: int = n) -> float:
            return cm.device_memory("RTX4090", 1, ((n, True, False),), False, slot.in_flight, 1, (r,)).total

        assert 1 <= k <= n and mem(k) <= cap and mem(k - 1) > cap
