"""A failure and its recovery as the coordinator records and reports them.

``Incident`` is one failure (possibly of several devices) with its timeline, from the failure to the
first step done after it; ``failure_event`` turns it into the ``failure`` event (what each part of the
recovery cost). ``UnrecoverableFailure`` stops a run whose state did not survive (``lost_lines`` says
what is lost and what to do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.elastic.protocol import Switched, Transition
from runtime.launch.options import TrainOptions
from runtime.torchfree.elastic.state import LostState
from runtime.torchfree.errors import HspmdError


class UnrecoverableFailure(HspmdError):
    """Devices failed and the run cannot continue in memory (a parameter lost every replica, or no
    plan fits the survivors)."""

    exit_code = 1

    def __init__(self, lines: list[str]) -> None:
        self._lines = lines
        super().__init__("; ".join(lines))

    def lines(self) -> list[str]:
        return list(self._lines)


@dataclass
class Incident:
    """One failure (possibly of several devices) and its recovery, with its timeline."""

    step: int  # the step abandoned and redone
    failed: dict[int, str]  # device -> what happened
    t_fail_wall: float  # when it failed (injected fault's own clock, else the last sign of life)
    t_detect: float  # monotonic
    t_detect_wall: float
    t_left: float | None = None
    replan_s: float = 0.0
    plan_s: float = 0.0
    replanned: bool = False
    t_sent: float | None = None
    t_resumed: float | None = None
    transition: Transition | None = None
    times: dict[int, Switched] = field(default_factory=dict)
    attempts: int = 0
    moment_bytes: int = 0  # ZeRO-1 with copies: the first round, rebuilding moments from the copies
    ungathered: bool = False  # it struck inside a committed step's parameter all-gather (ZeRO-1)
    preplanned: bool = False  # its plan was made ahead, in the background


def device_list(devices: Any) -> str:
    return ", ".join(str(d) for d in sorted(devices))


def lost_lines(lost: LostState, step: int, options: TrainOptions) -> list[str]:
    lines = [f"device(s) {device_list(lost.failed)} failed during step {step} and {lost.what()}, so the run "
             "cannot continue in memory:"]
    return lines + lost.details() + _checkpoint_lines(options)


def _checkpoint_lines(options: TrainOptions) -> list[str]:
    lines = []
    if options.save_dir is not None:
        lines.append(f"--save {options.save_dir}: left as it was (checkpoints are written only at the end of a run)")
    lines.append("restart from the last checkpoint with --load, on a plan for the remaining devices")
    return lines


def slowest(times: dict[int, Switched]) -> dict[str, float]:
    """Each part of a transition as its slowest device took it."""
    return {k: max((getattr(t, k) for t in times.values()), default=0.0)
            for k in ("regroup_s", "specialize_s", "transfer_s")}


def failure_event(inc: Incident, now: float, survivors: list[int]) -> dict[str, Any]:
    t = inc.transition
    assert t is not None and inc.t_left is not None and inc.t_resumed is not None and inc.t_sent is not None
    detect = max(0.0, inc.t_detect_wall - inc.t_fail_wall)
    return {
        "event": "failure", "step": inc.step, "failed": sorted(inc.failed),
        "cause": {str(d): how for d, how in sorted(inc.failed.items())}, "survivors": survivors,
        "replanned": inc.replanned, "strategy": t.target.name, "plan": t.target.describe(),
        "devices": sorted(t.target.devices), "micro_batch": t.target.ctx.plan.training.micro_batch,
        "detect_s": detect, "abandon_s": inc.t_left - inc.t_detect, "replan_s": inc.replan_s + inc.plan_s,
        **slowest(inc.times), "switch_s": inc.t_resumed - inc.t_sent,
        "switch_bytes": t.bsr.total_bytes + inc.moment_bytes, "moment_rebuild_bytes": inc.moment_bytes,
        "in_param_gather": inc.ungathered, "preplanned": inc.preplanned,
        "modelled_transfer_s": t.bsr.modelled_time(t.target.ctx.cluster),
        "total_s": detect + (inc.t_resumed - inc.t_detect), "first_step_s": now - inc.t_resumed,
        "recovery_s": now - inc.t_detect, "attempts": inc.attempts,
    }


def recovered_line(inc: Incident, e: dict[str, Any]) -> str:
    """The log line of a recovery's ``failure`` event ``e``."""
    return (f"recovered from the failure of device(s) {device_list(inc.failed)}: step {inc.step} done "
            f"{e['recovery_s']:.3f} s after detection (detect {e['detect_s']:.3f} s, abandon "
            f"{e['abandon_s']:.3f} s, replan {e['replan_s']:.3f} s, regroup {e['regroup_s']:.3f} s, "
            f"transfer {e['transfer_s']:.3f} s, total to resume {e['total_s']:.3f} s)")
