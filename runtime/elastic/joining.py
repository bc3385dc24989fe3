"""Devices joining a running job: when they are awaited, and whether they are worth a switch.

A returning device starts a worker that joins no world. ``Returns`` schedules the returns a trace names
(``--events``): such a device starts a step early and that step's commit waits for it to be up.
Once it is up the coordinator asks the grower (or looks up the decision made ahead,
runtime/torchfree/elastic/preplan.py) for a plan with it: ``decide_growth`` gives the ``Growth`` to adopt at the next
step boundary, or None when the devices stay spare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from runtime.elastic.incident import device_list
from runtime.launch.supervise import WorkerHandle
from runtime.torchfree.elastic.preplan import Grower, Preplanner
from runtime.torchfree.elastic.state import check_compatible
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.handle import StrategyHandle

T = TypeVar("T")


@dataclass(frozen=True)
class Growth:
    """Devices to adopt at the next step boundary, and the plan that uses them (decided in ``decide_s``)."""

    joining: tuple[int, ...]
    target: StrategyHandle
    decide_s: float
    preplanned: bool = False  # decided ahead, in the background (runtime/torchfree/elastic/preplan.py)


@dataclass
class Returns:
    """The returns a trace schedules, and the commits that wait for them: a device that trains from step
    ``K`` starts at the start of ``K - 1``, whose commit waits until it is up, has failed, or its node's agent
    has not come back within the wait it was given (``unplaced``)."""

    by_step: dict[int, list[int]]  # the step they train from -> the devices
    admit: dict[int, set[int]] = field(default_factory=dict)  # step -> returning devices its commit waits for
    unplaced: dict[int, float] = field(default_factory=dict)  # returning device -> until when to wait for its node

    def starting(self, step: int) -> list[int]:
        """The devices to start at the start of ``step`` (they train from ``step + 1``): its commit waits."""
        devices = self.by_step.pop(step + 1, [])
        if devices:
            self.admit.setdefault(step, set()).update(devices)
        return devices

    def scheduled(self) -> set[int]:
        """The devices whose return is still to come (they start when their step does)."""
        return {d for ds in self.by_step.values() for d in ds}

    def awaited(self) -> set[int]:
        """The devices some commit waits for."""
        return {d for due in self.admit.values() for d in due}

    def arrived(self, step: int, waiting: Mapping[int, WorkerHandle], log: Callable[[str], None]) -> bool:
        """Whether the devices the commit of ``step`` waits for are up (or failed: no longer ``waiting``, or
        their node did not come back in time); then the commit waits for nothing more."""
        due = self.admit.get(step)
        if not due:
            return True
        for d in sorted(due):
            if d in self.unplaced:
                if time.monotonic() < self.unplaced[d]:
                    return False
                del self.unplaced[d]
                due.discard(d)
                log(f"device {d} did not return: its node has no agent")
            elif d in waiting and not waiting[d].up:
                return False
        del self.admit[step]
        return True


def decide_growth(up: frozenset[int], ref: StrategyHandle, alive: set[int], *, grow: Grower,
                  preplanner: Preplanner | None, steps_left: int, after_step: int,
                  log: Callable[[str], None]) -> Growth | None:
    """The growth with the devices ``up`` (waiting to join ``ref``'s job), decided ahead or now; None when
    they stay spare. ``after_step``: the step after which they would join, for the log."""
    t0 = time.perf_counter()
    ahead = preplanner.lookup_return(ref, up) if preplanner is not None else None
    if ahead is not None:
        new_ctx = ahead.context
        log(f"device(s) {device_list(up)}: the grow decision was planned ahead (in {ahead.plan_s:.3f} s, in the "
            f"background): {'adopt' if new_ctx is not None else 'stay'}, without planning now")
    else:
        try:
            new_ctx = grow(up, ref.ctx, ref.name, steps_left)
        except HspmdError as err:
            new_ctx = None
            log(f"no plan with device(s) {device_list(up)}: {'; '.join(err.lines())}")
    decide_s = time.perf_counter() - t0
    if new_ctx is None:
        log(f"device(s) {device_list(up)} stay spare (not worth a switch now)")
        return None
    target = StrategyHandle.of(new_ctx)
    bad = sorted(set(target.devices) - alive - up)
    if bad:
        raise RuntimeError(f"the grower's plan uses devices {bad} that are not in the job")
    check_compatible(ref.ctx, target.ctx)
    joining = tuple(sorted(set(target.devices) & up))
    log(f"device(s) {device_list(joining)} will join after step {after_step}: {target.describe()} "
        f"(decided in {decide_s:.3f} s)")
    return Growth(joining, target, decide_s, ahead is not None)


def by_step(events: Iterable[tuple[int, T]]) -> dict[int, list[T]]:
    """Scheduled returns (or node kills) grouped by their step, in the order given."""
    out: dict[int, list[T]] = {}
    for step, what in events:
        out.setdefault(step, []).append(what)
    return out
