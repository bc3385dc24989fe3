"""Devices joining a running job: whether the devices that are up and waiting are worth a switch.

A returning device starts a worker that joins no world; once it is up the coordinator asks the grower (or
looks up the decision made ahead, runtime/elastic/preplan.py) for a plan with it. ``decide_growth`` gives the
``Growth`` to adopt at the next step boundary, or None when the devices stay spare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from runtime.elastic.incident import device_list
from runtime.elastic.preplan import Grower, Preplanner
from runtime.elastic.state import check_compatible
from runtime.errors import HspmdError
from runtime.spec.handle import StrategyHandle

T = TypeVar("T")


@dataclass(frozen=True)
class Growth:
    """Devices to adopt at the next step boundary, and the plan that uses them (decided in ``decide_s``)."""

    joining: tuple[int, ...]
    target: StrategyHandle
    decide_s: float
    preplanned: bool = False  # decided ahead, in the background (runtime/elastic/preplan.py)


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
