"""The NCCL rule "an action's host sync waits for every earlier action of its device"
(runtime/torchfree/schedule_sync.py), played by ``check_schedule``: every schedule family passes it with tracing on;
a host sync after every action (a device-wide synchronize per span) deadlocks interleaved 1F1B with 3+
stages; one host sync after a receive hoisted ahead of what it waits for fails it."""

from __future__ import annotations

import pytest

from runtime.torchfree.pipeline_schedules import (
    Compute,
    Message,
    PostRecv,
    PostSend,
    WaitRecv,
    WaitSends,
    build_schedule,
    check_schedule,
    derive_actions,
    schedule_timeline,
)
from runtime.torchfree.schedule_policies import POLICIES, SCHEDULE_NAMES, schedule_layout
from runtime.torchfree.schedule_sync import engine_host_syncs, with_host_syncs
from runtime.trace import TraceRecorder


def shapes():
    for name in SCHEDULE_NAMES:
        for s in (2, 3, 4, 6):
            for m in (s, 2 * s, 2 * s + 1):
                yield from ((name, s, m, v) for v in ((2, 3) if name == "interleaved" else (None,)))


@pytest.mark.parametrize(("name", "s", "m", "v"), list(shapes()))
def test_every_schedule_obeys_the_nccl_host_sync_rule_with_tracing_on(name, s, m, v):
    # Both orders a schedule may run: the list scheduler's and the published one.
    layout = schedule_layout(name, s, v)
    split = POLICIES[name].split_backward
    for source in ("list", "textbook"):
        actions = derive_actions(schedule_timeline(name, s, m, v, source=source), layout)
        syncs = engine_host_syncs(actions, syncs_in_spans=TraceRecorder.SYNCS_IN_SPANS)
        report = check_schedule(actions, layout, m, split_backward=split, host_syncs=syncs)
        assert report.problems == (), source


@pytest.mark.parametrize("s", [3, 4])
def test_a_host_sync_in_every_span_deadlocks_interleaved_1f1b_from_three_stages(s):
    sched = build_schedule("interleaved", s, 2 * s, 2)
    every = engine_host_syncs(sched.actions, syncs_in_spans=True)
    report = check_schedule(sched.actions, sched.layout, 2 * s, split_backward=False, host_syncs=every)
    assert report.deadlock and any(p.startswith("deadlock") for p in report.problems)
    # The same lists without those syncs complete.
    assert check_schedule(sched.actions, sched.layout, 2 * s, split_backward=False).problems == ()


def test_one_host_sync_after_a_receive_hoisted_ahead_of_what_it_waits_for_breaks_the_rule():
    # Interleaved device 0 posts the receive of stage 2's activation (from device 2) before it computes and
    # sends stage 0's: harmless for a post, a deadlock for a host sync right after it.
    sched = build_schedule("interleaved", 3, 3, 2)
    first = sched.actions[0]
    i = next(k for k, a in enumerate(first) if isinstance(a, PostRecv))
    assert i < next(k for k, a in enumerate(first) if isinstance(a, PostSend)) and first[i].message.src == 2
    assert check_schedule(sched.actions, sched.layout, 3, split_backward=False).problems == ()
    bad = check_schedule(sched.actions, sched.layout, 3, split_backward=False, host_syncs=[{i}, set(), set()])
    assert bad.deadlock and "device 0" in bad.problems[0]


def test_a_host_sync_waits_for_the_receives_posted_and_the_sends():
    act = Message("activation", 0, 0, 1, 0, 1)
    acts = [[PostRecv(act), Compute("F", 0, 1, 0), WaitRecv(act), WaitSends()]]
    (seq,) = with_host_syncs(acts, [{1}])
    assert seq == (PostRecv(act), Compute("F", 0, 1, 0), WaitRecv(act), WaitSends(), WaitRecv(act), WaitSends())
    assert engine_host_syncs(acts) == (frozenset({3}),)
