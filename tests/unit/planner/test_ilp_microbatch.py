"""Micro-batch allocation ILP (and the greedy used in the search) against brute-force enumeration."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.microbatch import PipelineClass, TimeOption, allocate_greedy, allocate_ilp, min_total


def brute_force(classes, total: int) -> float:
    """Every per-pipeline micro-batch count (each pipeline on its own, each picking its best option)."""
    pipes = [c for c in classes for _ in range(c.count)]
    best = math.inf

    def rec(i: int, left: int, worst: float) -> None:
        nonlocal best
        if worst >= best:
            return
        if i == len(pipes):
            if left == 0:
                best = worst
            return
        c = pipes[i]
        rest_min = sum(p.min_micro_batches for p in pipes[i + 1:])
        for m in range(c.min_micro_batches, left - rest_min + 1):
            t = min(o.time(m) for o in c.options)
            rec(i + 1, left - m, max(worst, t))

    rec(0, total, 0.0)
    return best


option_st = st.builds(TimeOption, st.floats(0.1, 4.0), st.floats(0.0, 6.0))
class_st = st.builds(PipelineClass, st.lists(option_st, min_size=1, max_size=2).map(tuple), st.integers(1, 3),
                     st.integers(1, 2))


def _check(classes, total, alloc):
    assert sum(sum(p) for p in alloc.per_class) == total
    for c, counts in zip(classes, alloc.per_class):
        assert len(counts) == c.count
        assert min(counts) >= c.min_micro_batches
        assert max(counts) - min(counts) <= 1


@settings(max_examples=40, deadline=None)
@given(classes=st.lists(class_st, min_size=1, max_size=3), total=st.integers(1, 12))
def test_ilp_finds_the_brute_force_optimum(classes, total):
    want = brute_force(classes, total)
    got = allocate_ilp(classes, total)
    if math.isinf(want):
        assert got is None and total < min_total(classes)
        return
    assert got is not None
    _check(classes, total, got)
    assert got.makespan_s == pytest.approx(want, rel=1e-7, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(classes=st.lists(class_st.map(lambda c: PipelineClass(c.options[:1], c.min_micro_batches, c.count)),
                        min_size=1, max_size=3), total=st.integers(1, 14))
def test_greedy_matches_brute_force_with_one_option(classes, total):
    want = brute_force(classes, total)
    got = allocate_greedy(classes, total)
    if math.isinf(want):
        assert got is None
        return
    assert got is not None
    assert sum(sum(p) for p in got.per_class) == total
    assert all(min(p) >= c.min_micro_batches for p, c in zip(got.per_class, classes))
    assert got.makespan_s == pytest.approx(want, rel=1e-7, abs=1e-9)


def test_faster_pipeline_gets_more_micro_batches():
    fast = PipelineClass((TimeOption(1.0, 2.0),), 2)
    slow = PipelineClass((TimeOption(3.0, 2.0),), 2)
    got = allocate_ilp([fast, slow], 16)
    assert got is not None
    assert got.per_class == ((12,), (4,))
    assert got.makespan_s == 14.0


def test_option_choice_follows_the_count():
    # Option 0 is better for few micro-batches, option 1 for many: the ILP picks per class.
    both = (TimeOption(2.0, 0.0), TimeOption(1.0, 10.0))
    for total, option in ((4, 0), (40, 1)):
        got = allocate_ilp([PipelineClass(both, 1)], total)
        assert got is not None and got.option == (option,)
        assert got.makespan_s == min(o.time(total) for o in both)


def test_too_few_micro_batches_is_none():
    classes = [PipelineClass((TimeOption(1.0, 0.0),), 3, 2)]
    assert allocate_ilp(classes, 5) is None
    assert allocate_greedy(classes, 5) is None
    assert allocate_ilp(classes, 6) is not None


def test_many_identical_pipelines_stay_balanced():
    got = allocate_ilp([PipelineClass((TimeOption(1.0, 1.0),), 2, 7)], 30)
    assert got is not None
    assert sorted(got.per_class[0]) == [4, 4, 4, 4, 4, 5, 5]
    greedy = allocate_greedy([PipelineClass((TimeOption(1.0, 1.0),), 2, 7)], 30)
    assert greedy is not None and greedy.makespan_s == got.makespan_s


def test_brute_force_helper_sanity():
    # Two pipelines, 3 micro-batches: (2, 1) or (1, 2) -> max(2, 1) with equal costs.
    c = PipelineClass((TimeOption(1.0, 0.0),), 1, 2)
    assert brute_force([c], 3) == 2.0
    # Options are per pipeline: with 4 micro-batches on one pipeline the cheaper option at m=4 wins.
    two = PipelineClass((TimeOption(1.0, 5.0), TimeOption(2.0, 0.0)), 1)
    assert brute_force([two], 4) == 8.0


def test_greedy_ends_where_fixed_times_dwarf_a_micro_batch():
    """A 1e-20 GB/s link (before the cluster spec refused it) made fixed_s ~1e15 s beside per_mb_s 0.01 s: the
    fluid bound's rounding slack (1e-9 of it) was 1e8 micro-batches below the optimum, which the search for an
    upper end walked one micro-batch at a time (hspmd plan spun for hours). Now it ends, and still right."""
    import time

    classes = [PipelineClass((TimeOption(0.00992284224, 1092266666666666.5),), 2, 1)]
    t0 = time.process_time()
    alloc = allocate_greedy(classes, 6)
    assert time.process_time() - t0 < 1.0
    assert alloc is not None and alloc.per_class == ((6,),)
    two = [PipelineClass((TimeOption(0.01, 1e15),), 1, 1), PipelineClass((TimeOption(0.02, 1e15),), 1, 1)]
    alloc = allocate_greedy(two, 9)
    assert alloc is not None and sum(sum(ms) for ms in alloc.per_class) == 9
    assert alloc.makespan_s == pytest.approx(brute_force(two, 9), rel=1e-12)
