"""The staged switch of a documents run (runtime/torchfree/elastic/staging.py): units, their order, the peak bytes."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.torchfree.elastic.staging import (
    SWITCH_STAGES,
    UnitBytes,
    end_bytes,
    plan_staged_switch,
    stage_bytes,
    stage_order,
    start_bytes,
    switch_peak,
    switch_units,
)
from runtime.torchfree.elastic.state import plan_switch
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

PLAN = Path(__file__).resolve().parents[2] / "integration" / "engine_plans" / "lengths-two.yaml"


def test_units_cover_every_layer_once_in_at_most_switch_stages_groups():
    for n in (1, 6, 8, 9, 64, 80):
        units = switch_units(n)
        layers = [u for u in units if u.kind == "layers"]
        assert units[0].kind == "embedding" and units[-1].kind == "head"
        assert len(layers) <= SWITCH_STAGES
        assert [i for u in layers for i in range(u.first, u.stop)] == list(range(n))


unit_bytes = st.builds(UnitBytes, st.integers(0, 100).map(float), st.integers(0, 100).map(float),
                       st.integers(0, 50).map(float))
tables = st.lists(st.dictionaries(st.integers(0, 3), unit_bytes, min_size=1), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(tables)
def test_the_order_is_a_deterministic_permutation_and_the_peak_covers_both_ends(table):
    order = stage_order(table)
    assert sorted(order) == list(range(len(table)))
    assert stage_order(table) == order
    peak = switch_peak(table, order)
    a, b = start_bytes(table), end_bytes(table)
    assert all(peak[d] >= max(a[d], b[d]) for d in peak)


@settings(max_examples=200, deadline=None)
@given(tables, st.booleans())
def test_where_every_unit_shrinks_or_every_unit_grows_a_device_stays_within_one_stage(table, grow):
    # make each device monotone: its units all grow (dst >= src) or all shrink
    mono = [{d: UnitBytes(min(b.src, b.dst), max(b.src, b.dst), b.buffers) if grow ^ (d % 2 == 0)
             else UnitBytes(max(b.src, b.dst), min(b.src, b.dst), b.buffers) for d, b in row.items()}
            for row in table]
    peak = switch_peak(mono, stage_order(mono))
    a, b = start_bytes(mono), end_bytes(mono)
    for d in peak:
        one = max(stage_bytes(row[d]) for row in mono if d in row)
        assert peak[d] <= max(a[d], b[d]) + one


def test_two_stages_swapping_layers_are_interleaved_not_stacked():
    # device 0 holds units 0-3 in A and 4-7 in B; device 1 the opposite: layer order would stack 4 units
    table = [{0: UnitBytes(10.0, 0.0), 1: UnitBytes(0.0, 10.0)} for _ in range(4)] + \
            [{0: UnitBytes(0.0, 10.0), 1: UnitBytes(10.0, 0.0)} for _ in range(4)]
    in_layer_order = switch_peak(table, range(8))
    greedy = switch_peak(table, stage_order(table))
    assert max(in_layer_order.values()) == 80.0
    assert max(greedy.values()) <= 50.0   # max(A, B) = 40, plus one unit


def test_a_staged_switch_moves_what_the_fused_switch_moves():
    ctx = load_plan_context(PLAN)
    a, b = StrategyHandle.of(ctx, "short"), StrategyHandle.of(ctx, "long")
    staged, fused = plan_staged_switch(a, b), plan_switch(a, b)
    assert sorted(t.name for s in staged.stages for t in s.bsr.tensors) == sorted(t.name for t in fused.tensors)
    assert sum(s.bsr.total_bytes for s in staged.stages) == fused.total_bytes
    # each device's start and end are its whole state in each strategy; the peak is below holding both
    for d in range(4):
        start, end, peak = start_bytes(staged.table)[d], end_bytes(staged.table)[d], staged.peak()[d]
        assert start > end > 0 and max(start, end) <= peak < start + end
