"""A recovery's decisions: which worker errors are failures, the plan for the survivors, the transition.

* ``sort_errors``: a worker's error near a device failure (or while the survivors leave a failed step) is
  that failure's consequence; one with no failure within the grace window is a genuine error.
* ``replan_for_survivors``: the plan for the survivors is looked up among those made ahead
  (runtime/torchfree/elastic/preplan.py) or asked of the ``replan`` callback now; either way it must use only live
  devices and keep the model and the training settings (``check_compatible``). A failure no plan fits stops
  the run (``UnrecoverableFailure``).
* ``plan_recovery``: the transition to that plan in a new world, its fused BSR planned once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from runtime.elastic.incident import Incident, UnrecoverableFailure, device_list
from runtime.elastic.protocol import Transition, World
from runtime.launch.messages import WorkerError
from runtime.launch.supervise import WorkerHandle
from runtime.torchfree.elastic.preplan import Preplanner, Replanner
from runtime.torchfree.elastic.state import check_compatible, plan_moment_gather, plan_switch
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.handle import StrategyHandle

TimedError = tuple[float, WorkerHandle, WorkerError]  # when it arrived (monotonic), from whom, what


def sort_errors(errors: Iterable[TimedError], failure_times: list[float], grace_s: float, *,
                leaving: bool) -> tuple[list[tuple[WorkerHandle, WorkerError]], list[TimedError]]:
    """The genuine errors among ``errors``, and those still within ``grace_s`` (kept to be sorted later)."""
    now = time.monotonic()
    genuine, keep = [], []
    for t, w, info in errors:
        # While survivors abandon a step their collectives fail (peers vanish or leave): consequences.
        # Otherwise an error is one only if a device failed about when it happened.
        if leaving or any(abs(t - f) <= grace_s for f in failure_times):
            continue
        if now - t < grace_s:
            keep.append((t, w, info))
            continue
        genuine.append((w, info))
    return genuine, keep


def replan_for_survivors(inc: Incident, source: StrategyHandle, failed: frozenset[int], alive: set[int], *,
                         replan: Replanner | None, preplanner: Preplanner | None, steps_left: int,
                         log: Callable[[str], None]) -> StrategyHandle:
    """The plan on ``alive`` after ``failed`` left ``source``; records the time it took in ``inc``."""
    if replan is None:
        raise UnrecoverableFailure([f"device(s) {device_list(failed)} failed and no replanner was given "
                                    "(hspmd train --elastic supplies the planner)"])
    t0 = time.perf_counter()
    ahead = preplanner.lookup(source, failed) if preplanner is not None else None
    if ahead is not None and ahead.context is not None:
        new_ctx = ahead.context
        inc.preplanned = True
        log(f"the plan for survivors {device_list(alive)} was made ahead (in {ahead.plan_s:.3f} s, "
            "in the background): switching without planning")
    else:
        try:
            new_ctx = replan(failed, source.ctx, source.name, steps_left)
        except HspmdError as err:
            raise UnrecoverableFailure([f"no plan for the survivors {device_list(alive)}: {line}"
                                        for line in err.lines()]) from None
    inc.replan_s += time.perf_counter() - t0
    inc.replanned = True
    target = StrategyHandle.of(new_ctx)
    bad = sorted(set(target.devices) - alive)
    if bad:
        raise RuntimeError(f"the replanner's plan uses devices {bad} that are not alive")
    check_compatible(source.ctx, target.ctx)
    log(f"replanned for survivors {device_list(alive)} in {time.perf_counter() - t0:.3f} s: {target.describe()}")
    return target


def plan_recovery(inc: Incident, source: StrategyHandle, target: StrategyHandle, failed: frozenset[int], *,
                  epoch: int, committed: int, world: World, ungathered: bool) -> Transition:
    """The transition of the survivors from ``source`` to ``target`` in ``world``, recorded in ``inc``.

    ``ungathered``: the failure struck inside the committed step's parameter all-gather. Only ZeRO-1's
    parameter all-gather communicates after a commit. A failure inside it leaves the committed step
    half-gathered, and what is consistent then is: on every survivor the step count, the unsharded parameters
    and moments, and the moments of its own chunks are the committed step's (the update ran everywhere before
    the all-gather); so are the parameters of its own chunks (kept by the optimizer until the all-gather ends,
    runtime/engine/optim.py); every other element of a sharded slice is of either step, depending on which
    buckets arrived. Every chunk has a surviving holder (r copies, ``lost_state``), so the first round of the
    switch rebuilds each slice's parameters from its chunks' holders as it rebuilds the moments: the
    all-gather redone among the survivors, then the usual fused BSR to the new layout. A survivor that
    finished the all-gather holds the same values."""
    t0 = time.perf_counter()
    bsr = plan_switch(source, target, failed)
    # the workers plan the same themselves (runtime/elastic/move.py)
    gather = plan_moment_gather(source, failed, ungathered=ungathered)
    inc.moment_bytes = gather.total_bytes if gather is not None else 0
    inc.ungathered = ungathered
    inc.plan_s += time.perf_counter() - t0
    t = Transition(epoch, source, target, committed, bsr, world, ungathered)
    inc.transition = t
    inc.attempts += 1
    return t
