"""The test oracle for the planner's pricing of a pipeline: the runtime's action lists played op by op, the
way every device runs them (``CostModel.pipeline_step_time`` prices the same order from its timeline,
``play_timeline``, without deriving the lists; the tests check the two agree exactly)."""

from __future__ import annotations

from runtime.pipeline_schedules import Compute, Costs, Message, PostSend, WaitRecv
from runtime.pipeline_schedules import Schedule as PipelineSchedule


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
