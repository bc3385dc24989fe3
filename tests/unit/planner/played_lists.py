"""The test oracles for the planner's pricing of a pipeline: the runtime's action lists played op by op, the
way every device runs them (``play_actions``), and the same order played from its timeline without deriving
the lists (``play_timeline``). ``CostModel.pipeline_step_time`` prices the op order alone
(``planner.cost.play_order``); the tests check the three agree exactly."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.torchfree.pipeline_schedules import Compute, Costs, Message, PostSend, TimedOp, WaitRecv
from runtime.torchfree.pipeline_schedules import Schedule as PipelineSchedule
from runtime.torchfree.schedule_policies import Layout


def play_actions(schedule: PipelineSchedule, costs: Costs) -> float:
    """The pipeline part of a step when each device runs ``schedule``'s action lists in order with the op
    durations and message times of ``costs``: a compute op starts when its device is free, a ``WaitRecv``
    waits for its message, which arrives its boundary's transfer time after the ``PostSend`` that follows
    its producer (no link contention: the simulator plays that). Ends at the last op's end, as
    ``step_time`` does for the order the list scheduler builds on ``costs``."""
    layout = schedule.layout
    arrival: dict[Message, float] = {}
    clock = [0.0] * layout.num_devices
    pos = [0] * layout.num_devices
    last = 0.0
    moved = True
    while moved:
        moved = False
        for d, acts in enumerate(schedule.actions):
            t = clock[d]
            while pos[d] < len(acts):
                a = acts[pos[d]]
                if isinstance(a, WaitRecv):
                    if a.message not in arrival:
                        break   # its sender has not got there yet
                    t = max(t, arrival[a.message])
                elif isinstance(a, Compute):
                    t += costs.chunk(d, a.chunk).of(a.kind)
                    last = max(last, t)
                elif isinstance(a, PostSend):
                    m = a.message
                    arrival[m] = t + costs.transfer(min(m.src_stage, m.dst_stage))
                pos[d] += 1
                moved = True
            clock[d] = t
    if any(p < len(acts) for p, acts in zip(pos, schedule.actions)):
        raise RuntimeError("the action lists deadlock (a runtime schedule bug, not a user error)")
    return last


def play_timeline(layout: Layout, timeline: Sequence[Sequence[TimedOp]], costs: Costs) -> float:
    """What the action lists ``derive_actions`` makes of ``timeline`` take when played, without making them:
    those lists put each ``WaitRecv`` right before the op that reads its message and each ``PostSend``
    right after the producer, so playing them is each device running its ops in timeline order, an op
    on another device's output starting no earlier than the producer's end plus the boundary's transfer
    time."""
    n = layout.num_stages
    dev = [layout.device(j) for j in range(n)]
    arrival: dict[tuple[bool, int, int], float] = {}   # (gradient?, micro-batch, sending virtual stage)
    clock = [0.0] * layout.num_devices
    pos = [0] * layout.num_devices
    last = 0.0
    moved = True
    while moved:
        moved = False
        for d, ops in enumerate(timeline):
            t = clock[d]
            while pos[d] < len(ops):
                op = ops[pos[d]].op
                kind, mb, j = op.kind, op.micro_batch, op.stage
                back = kind in ("B", "BW")
                if kind == "F" and j > 0 and dev[j - 1] != dev[j]:
                    if (False, mb, j - 1) not in arrival:
                        break   # its sender has not got there yet
                    t = max(t, arrival[False, mb, j - 1])
                elif back and j < n - 1 and dev[j + 1] != dev[j]:
                    if (True, mb, j + 1) not in arrival:
                        break
                    t = max(t, arrival[True, mb, j + 1])
                t += costs.chunk(d, op.chunk).of(kind)
                last = max(last, t)
                if kind == "F" and j < n - 1 and dev[j + 1] != dev[j]:
                    arrival[False, mb, j] = t + costs.transfer(j)
                elif back and j > 0 and dev[j - 1] != dev[j]:
                    arrival[True, mb, j] = t + costs.transfer(j - 1)
                pos[d] += 1
                moved = True
            clock[d] = t
    if any(p < len(ops) for p, ops in zip(pos, timeline)):
        raise RuntimeError("the action lists deadlock (a runtime schedule bug, not a user error)")
    return last
