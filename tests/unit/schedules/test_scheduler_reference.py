"""The list scheduler (its indexed ready queues and skips) makes exactly the choices of the rules read
literally (reference_scheduler.py): the same op order and the same start and end times on every device,
for every schedule, random shapes, uneven costs (ties included: costs drawn from a few values), transfer
times and raised activation limits."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_scheduler import reference_timeline

from runtime.torchfree.pipeline_schedules import ChunkCost, Costs, build_schedule, schedule_timeline
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, Layout, device_limits, schedule_layout

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    s = draw(st.integers(1, 6))
    m = draw(st.integers(s if name == "interleaved" else 1, 40))
    v = draw(st.integers(1, 4)) if name == "interleaved" else None
    layout = schedule_layout(name, s, v)
    # A few values make ties between ready ops and between events common; any float tests the rest.
    cost = draw(st.sampled_from([st.sampled_from([0.5, 1.0, 2.0]), st.floats(0.1, 4.0, allow_nan=False)]))
    costs = Costs(tuple(tuple(ChunkCost(draw(cost), draw(cost), draw(cost)) for _ in range(layout.chunks))
                        for _ in range(s)),
                  tuple(draw(st.sampled_from([0.0, 0.25, 1.0])) for _ in range(layout.num_stages - 1)))
    limits = None
    if draw(st.booleans()):
        limits = [x + draw(st.integers(0, 2 * s)) for x in device_limits(name, s, m, v)]
    return name, s, m, v, layout, costs, limits


def same_as_reference(name: str, s: int, m: int, v: int | None, layout: Layout, costs: Costs,
                      limits: list[int] | None) -> None:
    bounds = device_limits(name, s, m, layout.chunks, limits)
    want = reference_timeline(name, layout, m, costs, bounds)
    got = schedule_timeline(name, s, m, v, costs, limits, source="list")
    assert [list(t) for t in got] == want


@SETTINGS
@given(cases())
def test_the_scheduler_makes_the_reference_choices(case) -> None:
    same_as_reference(*case)


def test_long_runs_match_the_reference() -> None:
    """Many micro-batches per pipeline (the steady state repeated, the queues long): the same timelines."""
    for name, s, v in (("1f1b", 4, None), ("gpipe", 3, None), ("interleaved", 3, 2), ("zb-h1", 4, None),
                       ("zb-v", 3, None)):
        layout = schedule_layout(name, s, v)
        costs = Costs(tuple(tuple(ChunkCost(1.0 + 0.3 * d, 1.5 + 0.1 * c, 0.7) for c in range(layout.chunks))
                            for d in range(s)), (0.2,) * (layout.num_stages - 1))
        same_as_reference(name, s, 120, v, layout, costs, None)


def test_build_schedule_uses_the_same_timeline() -> None:
    costs = Costs.uniform(schedule_layout("zb-v", 3), ChunkCost(1.0, 2.0, 1.0), 0.5)
    sched = build_schedule("zb-v", 3, 9, None, costs)
    assert sched.timeline == schedule_timeline("zb-v", 3, 9, None, costs)


@st.composite
def instant_cases(draw):
    """Ops and transfers shorter than the scheduler's tolerance (1e-9 of the longest op): an op's end then
    readies its dependents within the event that started it, so a device later in device order must be
    looked at in that same event (``greedy_run`` in runtime/torchfree/list_scheduler.py looks only at the devices an
    event names, ``_woke``)."""
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    s = draw(st.integers(2, 5))
    m = draw(st.integers(s if name == "interleaved" else 1, 16))
    v = draw(st.integers(1, 3)) if name == "interleaved" else None
    layout = schedule_layout(name, s, v)
    cost = st.sampled_from([1e-12, 1e-12, 0.5, 1.0])
    costs = Costs(tuple(tuple(ChunkCost(draw(cost), draw(cost), draw(cost)) for _ in range(layout.chunks))
                        for _ in range(s)),
                  tuple(draw(st.sampled_from([0.0, 1e-12, 0.25])) for _ in range(layout.num_stages - 1)))
    limits = None
    if draw(st.booleans()):
        limits = [x + draw(st.integers(0, s)) for x in device_limits(name, s, m, v)]
    return name, s, m, v, layout, costs, limits


@SETTINGS
@given(instant_cases())
def test_instant_ops_make_the_reference_choices(case) -> None:
    same_as_reference(*case)
