"""ZeRO-1 with r copies of every moment chunk (runtime/torchfree/engine/zero.py ``place``): the placement rule for
every group of replicas and every node structure, the layout it gives every plan, and the plan field."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_specialize import MODEL, plans

from runtime.torchfree.annotations.from_plan import strategy_annotations
from runtime.torchfree.annotations.states import region_index
from runtime.torchfree.engine.zero import ZeroSlice, moment_pieces, place, zero_slices
from runtime.torchfree.errors import SpecError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import PlanContext, load_plan
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.validate import validate_plan

REPO = Path(__file__).resolve().parents[3]


@st.composite
def groups(draw) -> tuple[list[int], dict[int, int], int]:
    """Replicas of one slice (distinct ids), the node of each, and a redundancy 1..k."""
    devices = sorted(draw(st.sets(st.integers(0, 63), min_size=1, max_size=16)))
    nodes = {d: draw(st.integers(0, 5)) for d in devices}
    return devices, nodes, draw(st.integers(1, len(devices)))


def spreadable(nodes: dict[int, int], r: int) -> bool:
    """Whether some choice of the k - r*m leftover devices leaves no node with more than m = k // r:
    exactly when r distinct nodes per chunk is possible (independent of ``place``'s own rule)."""
    k = len(nodes)
    m = k // r
    return sum(max(0, c - m) for c in Counter(nodes.values()).values()) <= k - r * m


@settings(max_examples=300, deadline=None)
@given(groups())
def test_every_chunk_has_r_distinct_holders_in_distinct_nodes_when_possible(g) -> None:
    devices, nodes, r = g
    holders = place(devices, r, nodes)
    k = len(devices)
    assert len(holders) == k // r and all(len(h) == r for h in holders)
    flat = [d for h in holders for d in h]
    assert len(set(flat)) == len(flat) and set(flat) <= set(devices)
    if spreadable(nodes, r):
        assert all(len({nodes[d] for d in h}) == r for h in holders), holders
    if r == 1:
        assert holders == tuple((d,) for d in devices)  # plain ZeRO-1's layout, unchanged


@settings(max_examples=300, deadline=None)
@given(groups(), st.integers(1, 200))
def test_chunks_and_parts_cover_every_element(g, numel: int) -> None:
    devices, nodes, r = g
    s = ZeroSlice("w", ((0, numel),), tuple(devices), place(devices, r, nodes))
    kept = Counter()
    for d in devices:
        a, b = s.chunk(d)
        kept.update(range(a, b))
        x, y = s.part(d)
        assert a <= x <= y <= b  # a device sends only what it updated
    assert kept == Counter({i: r for i in range(numel)})  # every element kept exactly r times
    sent = [i for _, (a, b) in s.senders() for i in range(a, b)]
    assert sent == list(range(numel))  # and sent once, in element order
    lost = s.lost_chunks(frozenset(s.holders[0]))
    assert (numel < len(s.holders)) or lost == [(s.chunk_bounds(0), s.holders[0])]
    assert s.lost_chunks(frozenset(s.holders[0][1:])) == []  # r - 1 holders of a chunk may fail


def with_redundancy(ctx: PlanContext, r: int) -> PlanContext:
    training = dataclasses.replace(ctx.plan.training, zero=True, zero_redundancy=r)
    return dataclasses.replace(ctx, plan=dataclasses.replace(ctx.plan, training=training))


@settings(max_examples=25, deadline=None)
@given(plans(), st.integers(2, 3))
def test_every_moment_element_is_kept_r_times_by_devices_that_hold_it(ctx: PlanContext, r: int) -> None:
    strategy = ctx.plan.strategies[0]
    if len(strategy.pipelines) < r:
        return
    ann = strategy_annotations(StrategyHandle(ctx, strategy))
    nodes = {d.id: d.node for d in ctx.cluster.devices}
    slices = zero_slices(ann, r, nodes)
    assert set(slices) == {p.name for p in llama_parameters(MODEL)}
    counts = {p.name: torch.zeros(p.numel, dtype=torch.int32) for p in llama_parameters(MODEL)}
    index = {p.name: torch.arange(p.numel).reshape(p.shape) for p in llama_parameters(MODEL)}
    for d in strategy.devices:
        for name, pieces in moment_pieces(slices, d).items():
            held = ann.param(name).param.layout(ann.param(name).shape).region(d)
            for p in pieces:
                assert all(a <= x and y <= b for (a, b), (x, y) in zip(held, p.region))
                counts[name][index[name][region_index(p.region)].reshape(-1)[p.start:p.stop]] += 1
    for name, c in counts.items():
        assert bool((c == r).all()), f"{name}: moments must be kept exactly {r} times"


@pytest.mark.parametrize("zero, r, message", [
    ("true", 0, "must be at least 1, got 0"),
    ("false", 2, "2 copies of ZeRO-1's moment chunks need zero: true"),
])
def test_the_plan_field_is_validated_with_one_line_naming_it(tmp_path, zero: str, r: int, message: str) -> None:
    text = (REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml").read_text()
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("  zero: false\n", f"  zero: {zero}\n  zero_redundancy: {r}\n"))
    with pytest.raises(SpecError) as err:
        load_plan(path)
    assert [str(p) for p in err.value.problems] == [f"{path}: training.zero_redundancy: {message}"]


@settings(max_examples=10, deadline=None)
@given(plans())
def test_more_copies_than_pipelines_is_refused(ctx: PlanContext) -> None:
    p = len(ctx.plan.strategies[0].pipelines)
    bad = with_redundancy(ctx, p + 1).plan
    (problem,) = validate_plan(bad, MODEL, ctx.cluster, "plan.yaml")
    assert problem.field == "training.zero_redundancy" and f"has {p} pipeline(s)" in problem.message
    assert validate_plan(with_redundancy(ctx, p).plan, MODEL, ctx.cluster, "plan.yaml") == []
