"""Published schedule orders (runtime/torchfree/canonical_schedules.py) and the promise built on them: the order every
consumer runs is never slower than its schedule's textbook order under the same op and transfer times, on
random uneven pipelines, within the same activation bound, its transfers matched and free of deadlock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.torchfree.canonical_schedules import canonical_orders
from runtime.torchfree.pipeline_schedules import (
    ChunkCost,
    Costs,
    build_schedule,
    check_schedule,
    derive_actions,
    schedule_timeline,
    step_time,
)
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, Layout, device_limits, schedule_layout

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def makespan(timeline) -> float:
    return max((ops[-1].end for ops in timeline if ops), default=0.0)


def crossings(layout: Layout) -> int:
    return sum(layout.device(j) != layout.device(j + 1) for j in range(layout.num_stages - 1))


@st.composite
def uneven(draw, names=SCHEDULE_NAMES):
    """A random uneven pipeline: S in 2..8, m in 1..32 (interleaved: at least S), per device and chunk F, B
    and W drawn over a 10x range each, a transfer time per boundary from none to about an op."""
    name = draw(st.sampled_from(names))
    s = draw(st.integers(2, 8))
    m = draw(st.integers(s if name == "interleaved" else 1, 32))
    v = draw(st.integers(2, 3)) if name == "interleaved" else None
    layout = schedule_layout(name, s, v)
    t = st.floats(0.1, 1.0, allow_nan=False)
    costs = Costs(tuple(tuple(ChunkCost(draw(t), draw(t), draw(t)) for _ in range(layout.chunks)) for _ in range(s)),
                  tuple(draw(st.floats(0.0, 0.5)) for _ in range(layout.num_stages - 1)))
    return name, s, m, v, layout, costs


@SETTINGS
@given(uneven())
def test_never_slower_than_the_textbook_and_sound(case) -> None:
    name, s, m, v, layout, costs = case
    textbook = schedule_timeline(name, s, m, v, costs, source="textbook")
    sched = build_schedule(name, s, m, v, costs)
    assert sched.makespan <= makespan(textbook) * (1 + 1e-12)
    assert sched.makespan == step_time(name, s, m, v, costs)
    bound = device_limits(name, s, m, v)
    for tl in (sched.timeline, textbook):
        acts = sched.actions if tl is sched.timeline else derive_actions(tl, layout)
        got = check_schedule(acts, layout, m, split_backward=sched.split_backward)
        assert got.ok, got.problems
        assert not got.deadlock
        assert got.transfers == 2 * m * crossings(layout)
        assert all(p <= b for p, b in zip(got.peak_live, bound)), (got.peak_live, bound)


@SETTINGS
@given(uneven(names=("1f1b",)))
def test_1f1b_with_gpipe_memory_is_never_slower_than_gpipe(case) -> None:
    _, s, m, _, layout, costs = case
    one = build_schedule("1f1b", s, m, None, costs, limits=[m] * s)
    assert one.makespan <= step_time("gpipe", s, m, None, costs) * (1 + 1e-12)
    got = check_schedule(one.actions, layout, m, split_backward=False)
    assert got.ok and max(got.peak_live) <= m


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("s", range(1, 9))
def test_published_orders_run_every_op_once_within_the_bound(name: str, s: int) -> None:
    """Every shape, not a sample: the orders are data, and a missing or doubled op is a wrong order."""
    for m in range(s if name == "interleaved" else 1, 13):
        layout = schedule_layout(name, s)
        nk = 3 if name.startswith("zb") else 2
        for order in canonical_orders(name, layout, m):
            assert sorted(o for ops in order for o in ops) == list(range(m * layout.num_stages * nk))
        tl = schedule_timeline(name, s, m, source="textbook")
        got = check_schedule(derive_actions(tl, layout), layout, m, split_backward=nk == 3)
        assert got.ok, got.problems
        assert all(p <= b for p, b in zip(got.peak_live, device_limits(name, s, m)))


def test_1f1b_textbook_order_is_megatrons() -> None:
    """Device 2 of 8, 16 micro-batches: five warm-up forwards, then F5 B0 F6 B1 ..., then B11 .. B15."""
    tl = schedule_timeline("1f1b", 8, 16, source="textbook")
    got = [f"{t.op.kind}{t.op.micro_batch}" for t in tl[2]]
    want = [f"F{i}" for i in range(5)] + [x for i in range(11) for x in (f"F{i + 5}", f"BW{i}")] + \
        [f"BW{i}" for i in range(11, 16)]
    assert got == want


def test_v100_stages_feeding_t4_stages() -> None:
    """Six V100 stages feeding two T4 stages (GPT-2 medium's 24 layers split 2/4/4/4/4/4/1/1, a T4 layer 2.6x
    a V100 one, 1.5 ms per boundary, 16 micro-batches): the list scheduler alone leaves the textbook order
    and loses to it and to GPipe; the order the runtime runs does neither."""
    f, bw, t4 = 0.0062, 0.0124, 2.6
    split = (2, 4, 4, 4, 4, 4, 1, 1)
    costs = Costs(tuple((ChunkCost(f * n * (t4 if d >= 6 else 1), bw / 2 * n * (t4 if d >= 6 else 1),
                                   bw / 2 * n * (t4 if d >= 6 else 1)),) for d, n in enumerate(split)), (0.0015,) * 7)
    alone = makespan(schedule_timeline("1f1b", 8, 16, costs=costs, source="list"))
    textbook = makespan(schedule_timeline("1f1b", 8, 16, costs=costs, source="textbook"))
    gpipe = step_time("gpipe", 8, 16, costs=costs)
    runs = step_time("1f1b", 8, 16, costs=costs)
    assert alone > 1.1 * textbook          # what the list scheduler alone did (1.827 s against 1.627 s)
    assert runs <= textbook * (1 + 1e-12) and runs <= gpipe
    assert runs == pytest.approx(1.62684, abs=1e-5)


def test_fewer_micro_batches_than_stages_run_as_the_warm_up_allows() -> None:
    """1F1B with m < S: every device's warm-up is cut at m forwards; the step is GPipe's."""
    costs = Costs.uniform(schedule_layout("1f1b", 8))
    sched = build_schedule("1f1b", 8, 3, None, costs)
    assert check_schedule(sched.actions, sched.layout, 3, split_backward=False).ok
    assert sched.makespan == step_time("gpipe", 8, 3, None, costs) == (3 + 8 - 1) * 3
