"""Replans planned ahead: between failures the coordinator plans, in the background, what it would switch to
after the loss of each single device and each whole node of the running layout, so that such a failure
switches without planning (the foreground replan is most of an in-memory recovery's time at paper scale).

* **Bounded**: one replan per candidate (the layout's devices, then its nodes; then the returns below), each
  bounded by the planner's own time limit; nothing else is planned until the layout changes.
* **Cancellable**: a stop flag checked between candidates; a replan in flight when it is set finishes (it
  cannot be interrupted) but its result is dropped. The coordinator stops the work when a failure strikes
  (the recovery must not share the CPU with it) and when the run finishes.
* **Never delaying a step boundary**: the work runs on a daemon thread; the supervisor loop only starts it,
  looks plans up and stops it. The planner is Python and HiGHS, so it shares the interpreter lock with the
  loop, which gets it back within the interpreter's switch interval (milliseconds: nothing against a step).
  On an emulated cluster it also shares the host's cores with the workers.
* **Keyed by the survivor set** of the running layout (its devices less the failed ones: what the planner
  plans on); the cache belongs to one layout (one ``StrategyHandle``) and is replaced when the layout changes.
  The plans are made with the steps left when planned: a replan weighs a switch against the steps left, so a
  pre-planned choice may differ from a fresh one made later (the same candidates, a slightly older horizon).
* **Returns too**: after the losses, the grow decision (``Grower``: a plan with the returning devices and the
  gain-vs-switch-cost rule, adopt or stay) for each device out of the layout (failed earlier, or in the cluster
  file but idle), then each node's such devices together; keyed by the resulting device set, so that a device
  that announces itself joins (or stays spare) without planning in the foreground.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext
from runtime.torchfree.spec.handle import StrategyHandle

Replanner = Callable[[frozenset[int], PlanContext, str, int], PlanContext]
"""``replan(failed devices, current plan, current strategy, steps left) -> plan for the survivors`` (its
first strategy is used; the steps left, the failed one included, weigh a candidate's switch against its
step time). Supplied by the CLI (which calls the planner); the runtime never imports it."""

Grower = Callable[[frozenset[int], PlanContext, str, int], PlanContext | None]
"""``grow(joining devices, current plan, current strategy, steps left) -> a plan using them, or None``
when the predicted gain over the steps left does not beat the modelled switch cost (the CLI's calls
planner/replan.py ``grow``)."""


@dataclass(frozen=True)
class Preplanned:
    """The plan for one resulting device set (None: a grow decision to stay), and the planner's wall time."""

    context: PlanContext | None
    plan_s: float


def survivors(ref: StrategyHandle, failed: Collection[int]) -> tuple[int, ...]:
    """The cache key of a loss: the layout's devices that are not in ``failed``."""
    return tuple(d for d in ref.devices if d not in failed)


def grown(ref: StrategyHandle, joining: Collection[int]) -> tuple[int, ...]:
    """The cache key of a return: the layout's devices with ``joining``."""
    return tuple(sorted(set(ref.devices) | set(joining)))


def returns(ref: StrategyHandle, out: Collection[int]) -> list[frozenset[int]]:
    """The returns planned ahead, in order: each device of ``out`` (the cluster's devices in no world now)
    that the layout does not use, then each node's such devices together where there are several (a node
    coming back returns all of them)."""
    away = sorted(set(out) - set(ref.devices))
    nodes: dict[str, set[int]] = {}
    for d in ref.cluster.devices:
        if d.id in away:
            nodes.setdefault(d.node, set()).add(d.id)
    return [frozenset({d}) for d in away] + [frozenset(devs) for _, devs in sorted(nodes.items()) if len(devs) > 1]


def candidates(ref: StrategyHandle, alive: Collection[int]) -> list[frozenset[int]]:
    """The losses planned ahead, in order: each device of the layout, then each node's devices that are up
    (a node's loss fails all of them) where the node holds more than one of the layout's devices."""
    out = [frozenset({d}) for d in ref.devices]
    nodes: dict[str, set[int]] = {}
    for d in ref.cluster.devices:
        if d.id in alive:
            nodes.setdefault(d.node, set()).add(d.id)
    for _, devs in sorted(nodes.items()):
        if len(devs & set(ref.devices)) > 1:
            out.append(frozenset(devs))
    return out


def plan_layout(p: Preplanner, ref: StrategyHandle, alive: Collection[int], failed: frozenset[int],
                steps_left: int, *, begin: bool, log: Callable[[str], None]) -> None:
    """Between failures: on a layout not planned ahead yet (``begin``: the run is training, with steps to go),
    plan its single-device and node losses, then decide the returns of the cluster's devices in no world now
    (failed earlier, or never started); log what the work has found so far."""
    if begin and p.ref is not ref:
        out = {d.id for d in ref.cluster.devices} - set(alive)
        p.begin(ref, candidates(ref, alive), failed, steps_left, returns(ref, out))
    for line in p.notes():
        log(line)


class Preplanner:
    """The background planning of one layout at a time (see the module docstring)."""

    def __init__(self, replan: Replanner, grow: Grower | None = None) -> None:
        self.replan = replan
        self.grow = grow  # None: returns are decided when they come
        self.ref: StrategyHandle | None = None  # the layout the cache is for
        self._plans: dict[tuple[int, ...], Preplanned] = {}
        self._grows: dict[tuple[int, ...], Preplanned] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._notes: list[str] = []

    def begin(self, ref: StrategyHandle, losses: Iterable[frozenset[int]], failed_before: frozenset[int],
              steps_left: int, back: Iterable[frozenset[int]] = ()) -> None:
        """Stop the work in progress; plan ahead for ``losses`` of ``ref`` (``failed_before``: devices already
        lost, passed on to the replanner as a failure would), then decide ahead the returns ``back``."""
        self.stop()
        stop = threading.Event()
        with self._lock:
            self.ref, self._plans, self._grows, self._stop = ref, {}, {}, stop
        work = [("loss", set_) for set_ in losses if set_ & set(ref.devices)]
        if self.grow is not None:
            work += [("return", set_) for set_ in back if set_ - set(ref.devices)]
        self._thread = threading.Thread(target=self._work, args=(ref, work, failed_before, steps_left, stop),
                                        name="hspmd-preplan", daemon=True)
        self._thread.start()

    def _work(self, ref: StrategyHandle, work: list[tuple[str, frozenset[int]]], failed_before: frozenset[int],
              steps_left: int, stop: threading.Event) -> None:
        done = 0
        t_all = time.perf_counter()
        for kind, devs in work:
            if stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                if kind == "loss":
                    ctx = self.replan(failed_before | devs, ref.ctx, ref.name, steps_left)
                else:  # a return joins after the next step at the earliest: one step fewer to gain on
                    assert self.grow is not None
                    ctx = self.grow(devs, ref.ctx, ref.name, steps_left - 1)
            except HspmdError:
                continue  # no plan for it: that event plans in the foreground (and says why)
            except Exception as err:  # noqa: BLE001 - a planner bug must not end the run from this thread
                self._note(f"pre-planning the {kind} of device(s) {sorted(devs)} failed: {err!r}")
                continue
            with self._lock:
                if stop.is_set() or self.ref is not ref:
                    return
                if kind == "loss":
                    self._plans[survivors(ref, devs)] = Preplanned(ctx, time.perf_counter() - t0)
                else:
                    self._grows[grown(ref, devs)] = Preplanned(ctx, time.perf_counter() - t0)
            done += 1
        self._note(f"pre-planned {done} of {len(work)} single-device and node losses and returns of "
                   f"{ref.describe()} in {time.perf_counter() - t_all:.3f} s (background)")

    def _note(self, line: str) -> None:
        with self._lock:
            self._notes.append(line)

    def notes(self) -> list[str]:
        """Log lines of the background work since the last call (the supervisor loop logs them)."""
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def lookup(self, ref: StrategyHandle, failed: Collection[int]) -> Preplanned | None:
        """The plan made ahead for the survivors of ``failed`` in layout ``ref`` (None: not planned)."""
        with self._lock:
            if self.ref is not ref:
                return None
            return self._plans.get(survivors(ref, failed))

    def lookup_return(self, ref: StrategyHandle, joining: Collection[int]) -> Preplanned | None:
        """The grow decision made ahead for ``joining`` returning to layout ``ref`` (its context None: stay;
        None: not decided ahead)."""
        with self._lock:
            if self.ref is not ref:
                return None
            return self._grows.get(grown(ref, joining))

    def stop(self) -> None:
        """No new replan starts; the one in flight is dropped when done. The plans made so far stay."""
        if self._stop is not None:
            self._stop.set()

    def close(self) -> None:
        """``stop``, and wait for the replan in flight (one planner call, bounded by its time limit): a
        daemon thread still inside the solver when the process exits aborts it (SIGABRT, "terminate called
        without an active exception": the solver's C++ threads torn down under it, as after a run stops on an
        unrecoverable failure)."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


__all__ = ["Grower", "Preplanned", "Preplanner", "Replanner", "candidates", "grown", "plan_layout", "returns",
           "survivors"]
