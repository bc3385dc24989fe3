"""The outer search against exhaustive enumeration of every strategy on tiny clusters, and its building
blocks (set partitions, dealing groups out to pipelines, TP groups) against their rules."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.api import PlanSettings, plan
from planner.cost import CostModel
from planner.pipelines import deal, distributions, share_out
from planner.search import set_partitions
from planner.tp_groups import GroupKind, available, form_groups, tp_choices
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.cluster import Cluster, DeviceType, Emulation, Node
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

TINY = load_model("llama-tiny")


def tiny_cluster(fast: int, slow: int, slow_node: str = "cpu0") -> Cluster:
    types = {"cpu-fast": DeviceType(2, 0.2, 10, 2, Emulation(1.0)),
             "cpu-slow": DeviceType(2, 0.0667, 10, 2, Emulation(3.0))}
    nodes = tuple(n for n in (Node("cpu0", "cpu-fast", fast) if fast else None,
                              Node(slow_node, "cpu-slow", slow) if slow else None) if n is not None)
    return Cluster("tiny", types, nodes, 1.0)


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def groupings(ids: list[int], model) -> list[list[tuple[int, ...]]]:
    """Every way to cut one node's devices of one type into TP groups of valid power-of-two sizes, devices
    taken in id order (leftovers idle are covered by not using a group)."""
    if not ids:
        return [[]]
    out = []
    for t in (1, 2, 4, 8):
        if t <= len(ids) and model.tp_problem(t) is None:
            for rest in groupings(ids[t:], model):
                out.append([tuple(ids[:t])] + rest)
    return out


def chain_sets(groups: list):
    """Every set of ordered chains (pipelines) over every subset of the groups."""
    n = len(groups)
    for r in range(1, n + 1):
        for subset in itertools.combinations(groups, r):
            for part in set_partitions(list(range(r))):
                for orders in itertools.product(*(itertools.permutations(block) for block in part)):
                    yield [[subset[i] for i in order] for order in orders]


def exhaustive_best(cm: CostModel, global_batch: int, zero: bool) -> float:
    """Every strategy: TP groups, pipelines, stage orders, layer splits, micro-batch counts (no recompute:
    memory never binds here, which the test checks)."""
    m_total = global_batch // cm.micro_batch
    per_node = list(available(cm.cluster).values())
    best = math.inf
    for grouping in itertools.product(*(groupings(ids, cm.model) for ids in per_node)):
        groups = [g for part in grouping for g in part]
        for chains in chain_sets(groups):
            if sum(len(c) for c in chains) > m_total:
                continue
            splits = [list(compositions(cm.model.num_layers, len(c))) for c in chains]
            for split in itertools.product(*splits):
                for counts in compositions(m_total, len(chains)):
                    if any(m < len(c) for m, c in zip(counts, chains)):
                        continue
                    pipes = []
                    for c, layers, m in zip(chains, split, counts):
                        start, stages = 0, []
                        for g, n in zip(c, layers):
                            stages.append(Stage(g, (start, start + n)))
                            start += n
                        pipes.append(Pipeline(m, tuple(stages)))
                    est = cm.estimate(Strategy("x", tuple(pipes)), global_batch, "1f1b", zero)
                    assert est.fits
                    best = min(best, est.step_time_s)
    return best


def nodes_cluster(*nodes: tuple[str, str, int], inter_gbs: float = 1.0) -> Cluster:
    """A tiny cluster of the given (node, type, count): three CPU kinds, 1 / 2 / 3x slow."""
    types = {"cpu-fast": DeviceType(2, 0.2, 10, 2, Emulation(1.0)),
             "cpu-mid": DeviceType(2, 0.1, 10, 2, Emulation(2.0)),
             "cpu-slow": DeviceType(2, 0.0667, 10, 2, Emulation(3.0))}
    used = {t for _, t, _ in nodes}
    return Cluster("tiny-nodes", {k: v for k, v in types.items() if k in used},
                   tuple(Node(n, t, c) for n, t, c in nodes), inter_gbs)


CASES = [(tiny_cluster(2, 1, "cpu0"), 4), (tiny_cluster(1, 2, "cpu0"), 4), (tiny_cluster(2, 2, "cpu0"), 4),
         (tiny_cluster(2, 2, "cpu1"), 6), (tiny_cluster(3, 1, "cpu1"), 5),
         # Two nodes of one type behind a slow link: which devices pair up as gradient-sync peers matters
         # (interleaved vs contiguous placement).
         (nodes_cluster(("n0", "cpu-fast", 2), ("n1", "cpu-fast", 2), inter_gbs=0.05), 4),
         # Three kinds on three nodes: the best pipelines may differ (uneven shares, stage orders).
         (nodes_cluster(("n0", "cpu-fast", 1), ("n1", "cpu-mid", 2), ("n2", "cpu-slow", 1)), 6)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_search_matches_exhaustive_enumeration(case):
    cluster, batch = CASES[case]
    profiles = resolve_profiles(cluster.device_types, include_shipped=False)
    cm = CostModel(TINY, cluster, profiles, micro_batch=1, seq_len=64)
    want = exhaustive_best(cm, batch, zero=True)
    # baselines=False: the search alone must find it (a symmetric baseline would otherwise join the ranking).
    # The enumeration covers plans under each schedule's own activation bound (spare_activations=False).
    result = plan(TINY, cluster, profiles, PlanSettings(global_batch=batch, seq_len=64, micro_batch=1,
                                                        spare_activations=False), baselines=False)
    assert result.best.step_time_s == pytest.approx(want, rel=1e-9)
    assert result.lower_bound.step_time_s <= want
    # Raising the bounds where memory allows (the default) only adds plans: never worse than that optimum.
    raised = plan(TINY, cluster, profiles, PlanSettings(global_batch=batch, seq_len=64, micro_batch=1),
                  baselines=False)
    assert raised.best.step_time_s <= want * (1 + 1e-9)
    assert raised.lower_bound.step_time_s <= raised.best.step_time_s


# -- building blocks ---------------------------------------------------------------------------------


BELL = [1, 1, 2, 5, 15, 52]


@pytest.mark.parametrize("n", range(6))
def test_set_partitions_are_all_distinct_partitions(n):
    items = [str(i) for i in range(n)]
    parts = list(set_partitions(items))
    assert len(parts) == BELL[n]
    canon = {tuple(sorted(tuple(sorted(b)) for b in p)) for p in parts}
    assert len(canon) == len(parts)
    for p in parts:
        assert sorted(x for b in p for x in b) == items


@settings(max_examples=60, deadline=None)
@given(counts=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 20), min_size=1),
       pipelines=st.integers(1, 25))
def test_share_out_deals_every_group_evenly(counts, pipelines):
    kinds = {GroupKind(k, 1): v for k, v in counts.items()}
    shares = share_out(kinds, pipelines)
    if pipelines > sum(kinds.values()):
        assert shares is None
        return
    if shares is None:   # only when some pipeline would get nothing
        return
    assert len(shares) == pipelines
    for k, v in kinds.items():
        got = [s.get(k, 0) for s in shares]
        assert sum(got) == v
        assert max(got) - min(got) <= 1
    assert all(sum(s.values()) >= 1 for s in shares)


def test_share_out_never_starves_a_pipeline_when_groups_suffice():
    # 5 groups of one kind over 5 pipelines, and two kinds with 3 + 2 groups over 5 pipelines.
    assert share_out({GroupKind("a", 1): 5}, 5) is not None
    shares = share_out({GroupKind("a", 1): 3, GroupKind("b", 1): 2}, 5)
    assert shares is not None and all(sum(s.values()) == 1 for s in shares)


@pytest.mark.parametrize("cluster_name,model_name", [("h800-h20-48", "llama-32b"), ("hexiscale-mixed", "llama-7b"),
                                                     ("cpu-hetero4", "llama-tiny")])
def test_tp_groups_follow_the_rules(cluster_name, model_name):
    cluster, model = load_cluster(cluster_name), load_model(model_name)
    choices = tp_choices(cluster, model)
    for combo in itertools.product(*choices.values()):
        tp = dict(zip(choices, combo))
        for rem in (True, False):
            groups = form_groups(cluster, model, tp, remainder=rem)
            seen = [d for g in groups for d in g.devices]
            assert len(seen) == len(set(seen))
            for g in groups:
                assert {cluster.device(d).type for d in g.devices} == {g.kind.device_type}
                assert {cluster.device(d).node for d in g.devices} == {g.node}
                assert g.kind.tp == len(g.devices) and g.kind.tp & (g.kind.tp - 1) == 0
                assert model.tp_problem(g.kind.tp) is None
                assert g.kind.tp <= tp[g.kind.device_type]


@settings(max_examples=60, deadline=None)
@given(counts=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 3), min_size=1),
       pipelines=st.integers(1, 3))
def test_distributions_are_every_uneven_share_out_once(counts, pipelines):
    kinds = {GroupKind(k, 1): v for k, v in counts.items()}
    ways = distributions(kinds, pipelines, limit=10_000)
    assert ways is not None
    # Brute force: every assignment of labelled groups to labelled pipelines, up to relabelling.
    items = [k for k, v in sorted(kinds.items()) for _ in range(v)]
    want = set()
    for owner in itertools.product(range(pipelines), repeat=len(items)):
        bins = [tuple(sorted(k for k, o in zip(items, owner) if o == p)) for p in range(pipelines)]
        if all(bins):
            want.add(tuple(sorted(bins)))
    got = [tuple(sorted(tuple(sorted(k for k, n in sh.items() for _ in range(n))) for sh in way)) for way in ways]
    assert len(got) == len(set(got))
    assert set(got) == want
    assert distributions(kinds, pipelines, limit=len(want) - 1) is None or not want


@settings(max_examples=60, deadline=None)
@given(shares=st.lists(st.integers(0, 5), min_size=1, max_size=6), spare=st.integers(0, 3))
def test_deal_gives_each_pipeline_its_share_of_distinct_groups(shares, spare):
    n = sum(shares) + spare
    for placement in ("contiguous", "interleaved"):
        dealt = deal(n, shares, placement)
        assert [len(d) for d in dealt] == shares
        flat = [i for d in dealt for i in d]
        assert len(flat) == len(set(flat)) and all(0 <= i < n for i in flat)
    # Interleaved: the r-th groups of the pipelines that have one are dealt side by side.
    dealt = deal(n, shares, "interleaved")
    for r in range(max(shares)):
        row = sorted(d[r] for d in dealt if len(d) > r)
        assert row == list(range(row[0], row[0] + len(row)))
