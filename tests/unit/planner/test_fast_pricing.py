"""The planner's fast paths to the exact pipeline price. ``step_time_bound``: the search skips exact
pricing where this bound says a plan cannot win, which is only sound if it never exceeds the exact time
(the list scheduler's, and the runtime's lists played on other costs than they were ordered by, as the
cost model prices them). ``play_timeline``: the price without deriving the action lists, which must be
exactly ``play_actions``' number; ``play_order`` the same from the op order alone (``schedule_order``), as
``CostModel.pipeline_step_time`` prices it."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from played_lists import play_actions, play_timeline

from planner.baselines import EXACTLY_PRICED, best_symmetric, symmetric_strategies
from planner.cost import CostModel, play_order, timeline_order
from planner.search import BOUND_ROUNDING, lazily_sorted
from runtime.torchfree.pipeline_schedules import (
    ChunkCost,
    Costs,
    build_schedule,
    op_kinds,
    schedule_order,
    schedule_timeline,
    step_time,
    step_time_bound,
)
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, device_limits, schedule_layout, schedule_problems
from runtime.torchfree.spec import load_cluster, load_model

positive = st.floats(min_value=1e-3, max_value=5.0, allow_nan=False, allow_infinity=False)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[str, int, int, int, Costs, Costs]:
    """A valid (schedule, S, m, v) with two random cost sets (one to order the lists by, one to play)."""
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    s = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3)) if name == "interleaved" else schedule_layout(name, 1).chunks
    m = draw(st.integers(1, 12))
    if schedule_problems(name, s, m, v):
        m = max(m, s)   # interleaved needs m >= S
    layout = schedule_layout(name, s, v)

    def costs(full: bool) -> Costs:
        chunks = tuple(tuple(ChunkCost(draw(positive), draw(positive), draw(positive),
                                       draw(positive) if full and draw(st.booleans()) else None)
                             for _ in range(layout.chunks)) for _ in range(s))
        boundary = tuple(draw(st.sampled_from([0.0, 0.01, 0.3, 1.0])) for _ in range(layout.num_stages - 1))
        return Costs(chunks, boundary if draw(st.booleans()) else ())

    return name, s, m, v, costs(False), costs(True)


@settings(max_examples=150, deadline=None)
@given(shapes())
def test_bound_never_exceeds_the_list_schedulers_time(shape: tuple[str, int, int, int, Costs, Costs]) -> None:
    name, s, m, v, order, _ = shape
    assert step_time_bound(name, s, m, v, order) <= step_time(name, s, m, v, order) * (1 + 1e-9) + 1e-12


@settings(max_examples=150, deadline=None)
@given(shapes())
def test_bound_never_exceeds_the_played_lists(shape: tuple[str, int, int, int, Costs, Costs]) -> None:
    """Lists ordered by one set of costs, played with another (fused backwards, transfers): the cost model's
    exact price (``CostModel.pipeline_step_time``)."""
    name, s, m, v, order, played = shape
    sched = build_schedule(name, s, m, v, order)
    assert step_time_bound(name, s, m, v, played) <= play_actions(sched, played) * (1 + 1e-9) + 1e-12


@settings(max_examples=150, deadline=None)
@given(shapes(), st.lists(st.integers(0, 30), min_size=6, max_size=6))
def test_bound_never_exceeds_the_played_lists_with_raised_limits(shape: tuple[str, int, int, int, Costs, Costs],
                                                                 extra: list[int]) -> None:
    """With activation limits raised above the schedule's own (``Pipeline.activation_limits``): the bound holds
    for any op order, so ``ExactPricer.spare_gain`` plays no lists where it is above the ranking price."""
    name, s, m, v, order, played = shape
    own = device_limits(name, s, m, v)
    limits = tuple(lim + x for lim, x in zip(own, extra))
    sched = build_schedule(name, s, m, v, order, limits)
    bound = step_time_bound(name, s, m, v, played)
    assert bound * (1 - BOUND_ROUNDING) - 1e-12 <= play_actions(sched, played)
    assert bound * (1 - BOUND_ROUNDING) - 1e-12 <= step_time(name, s, m, v, played, limits)


@pytest.mark.parametrize("s, m", [(1, 1), (2, 5), (4, 4), (6, 13)])
def test_bound_is_exact_for_1f1b_on_equal_stages(s: int, m: int) -> None:
    costs = Costs(tuple((ChunkCost(1.0, 0.5, 1.5),) for _ in range(s)))
    assert step_time_bound("1f1b", s, m, 1, costs) == pytest.approx(step_time("1f1b", s, m, 1, costs))
    assert step_time_bound("1f1b", s, m, 1, costs) == pytest.approx((m + s - 1) * 3.0)


def test_bound_sees_the_slowest_stage_and_the_transfers() -> None:
    """A slow stage sets the bound at m times its time; a transfer adds to the fill."""
    slow = Costs(((ChunkCost(1.0, 1.0, 1.0),), (ChunkCost(3.0, 3.0, 3.0),), (ChunkCost(1.0, 1.0, 1.0),)))
    assert step_time_bound("zb-h1", 3, 8, 1, slow) >= 8 * 9.0
    plain = Costs(((ChunkCost(1.0, 1.0, 1.0),),) * 3)
    sent = Costs(plain.chunks, (0.5, 0.5))
    assert step_time_bound("1f1b", 3, 4, 1, sent) == pytest.approx(step_time_bound("1f1b", 3, 4, 1, plain) + 2.0)


@settings(max_examples=150, deadline=None)
@given(shapes())
def test_playing_the_timeline_is_playing_the_action_lists(shape: tuple[str, int, int, int, Costs, Costs]) -> None:
    name, s, m, v, order, played = shape
    sched = build_schedule(name, s, m, v, order)
    assert schedule_timeline(name, s, m, v, order) == sched.timeline
    assert play_timeline(sched.layout, sched.timeline, played) == play_actions(sched, played)   # exactly


@settings(max_examples=200, deadline=None)
@given(shapes(), st.lists(st.integers(0, 30), min_size=6, max_size=6), st.booleans())
def test_playing_the_order_is_playing_the_timeline(shape: tuple[str, int, int, int, Costs, Costs], extra: list[int],
                                                   raised: bool) -> None:
    """``schedule_order`` is the timeline's order op for op, and ``play_order`` on it gives ``play_timeline``'s
    float to the bit (and so the played lists'), at the schedule's own limits and raised ones."""
    name, s, m, v, order, played = shape
    limits = tuple(lim + x for lim, x in zip(device_limits(name, s, m, v), extra)) if raised else None
    sched = build_schedule(name, s, m, v, order, limits)
    kinds = op_kinds(name)
    ops = schedule_order(name, s, m, v, order, limits)
    assert ops == timeline_order(sched.layout, kinds, sched.timeline)
    assert [[(k // len(kinds)) % sched.layout.num_stages for k in d] for d in ops] == \
        [[t.op.stage for t in d] for d in sched.timeline]
    want = play_timeline(sched.layout, sched.timeline, played)
    assert play_order(sched.layout, kinds, ops, played) == want
    assert want == play_actions(sched, played)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.0, 2.5, 7.0, math.inf]), st.sampled_from([0.0, 0.5, 1.0])),
                max_size=25), st.data())
def test_lazily_sorted_is_sorted_and_prices_only_what_comes_up(items: list[tuple[float, float]],
                                                               data: st.DataObject) -> None:
    """Exact values with lower bounds below them (ties included) come out as ``sorted`` orders them; a
    consumer that stops after ``k`` never had an item priced whose bound lay above the ``k``-th value."""
    exact = [lo + gap for lo, gap in items]
    lower = [lo for lo, _ in items]
    priced: list[int] = []

    def price(i: int) -> float:
        priced.append(i)
        return exact[i]

    want = sorted((v, i) for i, v in enumerate(exact) if math.isfinite(v))
    assert list(lazily_sorted(lower, price, range(len(items)))) == want
    k = data.draw(st.integers(1, max(1, len(want))))
    priced.clear()
    got = list(itertools.islice(lazily_sorted(lower, price, range(len(items))), k))
    assert got == want[:k]
    if got:
        assert all(lower[i] <= got[-1][0] for i in priced)


@pytest.mark.parametrize("cluster_name, model_name", [("hexiscale-mixed", "llama-7b"), ("h2-example", "llama-13b")])
def test_symmetric_baseline_matches_the_exhaustive_ranking(cluster_name: str, model_name: str) -> None:
    """The lazily ranked symmetric baseline is the one ranking every candidate by its proxy estimate and
    pricing the best ``EXACTLY_PRICED`` exactly would find."""
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    cms = {b: CostModel(model, cluster, resolve_profiles(cluster.device_types), micro_batch=b, seq_len=2048)
           for b in (1, 2)}
    devices = tuple(range(cluster.num_devices))
    got = best_symmetric(cms, devices, 64, True)
    ranked = []
    for b, cm in sorted(cms.items()):
        for _, strategy in symmetric_strategies(cm, devices, 64, "symmetric"):
            proxy = [cm.pipeline_proxy_time(strategy, 0)] * len(strategy.pipelines)
            est = cm.estimate(strategy, 64, "1f1b", True, pipeline_s=proxy)
            if est.fits:
                ranked.append((est.step_time_s, b, strategy))
    ranked.sort(key=lambda x: x[0])
    exact = [(cms[b].estimate(cms[b].with_op_costs(s, "1f1b"), 64, "1f1b", True).step_time_s, b)
             for _, b, s in ranked[:EXACTLY_PRICED]]
    assert ranked and got.estimate is not None
    assert got.estimate.step_time_s == min(t for t, _ in exact)
