"""The launcher's side of an elastic or switching run: commit agreement, failures, transitions.

The coordinator watches every worker as the plain launcher does (report pipes, process sentinels,
heartbeats) and drives the protocol of runtime/elastic/protocol.py:

* **Steps.** A step is committed when every device of the plan says ``ready`` (its gradients are
  synced, nothing is updated yet); only then does any device update. A failure before that point
  means no survivor has touched its state for the step, and the step is redone on the new plan.
* **Failures** (elastic runs): a death is seen at once (the process sentinel), a hang when the
  heartbeat stops (the hung process is then SIGKILLed, which also closes its sockets so that peers
  blocked on it fail at once). The coordinator aborts the generation and waits for every survivor to
  leave it; more devices that fail meanwhile join the same incident. Then it checks that every
  parameter still has a surviving replica (if not: which, and the run stops, exit code 1; a checkpoint
  directory given with ``--save`` is left as it was, since it is only ever written at the end),
  asks the ``replan`` callback for a plan on the survivors, plans the fused BSR once and sends every
  survivor a transition to a new world (a fresh store prefix, new ranks).
* **Planned switches**: a transition in the same world before the scheduled step.

Every incident and switch is logged with what it cost and reported through ``on_event``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from runtime.elastic.protocol import SwitchTimes, Transition, World
from runtime.elastic.state import check_compatible, describe_lost, lost_tensors, plan_switch
from runtime.errors import HspmdError
from runtime.launch.launcher import _PRIORITY, RunSummary, WorkerFailure, _death, _Worker
from runtime.launch.options import PlannedSwitch, StepRecord, StepReport, TrainOptions
from runtime.spec import PlanContext, load_plan_context
from runtime.spec.handle import StrategyHandle as PlanRef

Replanner = Callable[[frozenset[int], PlanContext, str], PlanContext]
"""``replan(failed devices, current plan, current strategy) -> plan for the survivors`` (its first
strategy is used). Supplied by the CLI (which calls the planner); the runtime never imports it."""

ERROR_GRACE_S = 1.0  # a worker's error with no device failure within this window is a genuine error
LEAVE_MARGIN_S = 5.0  # beyond the op timeout, how long a survivor may take to leave a failed step


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
class _Incident:
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
    times: dict[int, SwitchTimes] = field(default_factory=dict)
    attempts: int = 0


@dataclass
class _Switch:
    """A planned switch in progress."""

    step: int
    t_start: float
    plan_s: float
    transition: Transition
    t_resumed: float | None = None


def prepare(options: TrainOptions, ctx: PlanContext, strategy: str, first_step: int) -> tuple[dict[int, PlanRef],
                                                                                              list[int]]:
    """User errors of a coordinated run, before any process starts: the planned switches by step and the
    devices the world needs (the union of every plan's devices)."""
    ref = PlanRef.of(ctx, strategy)
    devices = set(ref.devices)
    last = first_step - 1 + options.steps
    if ctx.plan.training.zero:
        raise HspmdError(f"{ctx.path}: training.zero: {'--elastic' if options.elastic else '--switch'} moves AdamW "
                         "moments from full replicas, and ZeRO-1 keeps one copy of each: use a plan with zero: false "
                         "(hspmd plan --elastic or --no-zero)")
    if options.elastic and options.switches:
        raise HspmdError("--switch and --elastic cannot be combined (planned switches name devices that a "
                         "failure may have taken)")
    if options.elastic and options.heartbeat_timeout_s >= options.timeout_s:
        raise HspmdError(f"--elastic: the heartbeat timeout ({options.heartbeat_timeout_s:g} s) must be shorter "
                         f"than the op timeout (--timeout {options.timeout_s:g} s), so that a hang is found before "
                         "the survivors' collectives time out")
    switches: dict[int, PlanRef] = {}
    for sw in options.switches:
        switches[sw.step] = _switch_target(sw, ctx, first_step, last)
        devices |= set(switches[sw.step].devices)
    return switches, sorted(devices)


def _switch_target(sw: PlannedSwitch, ctx: PlanContext, first: int, last: int) -> PlanRef:
    where = f"--switch {sw.step}:{sw.plan}"
    if not first < sw.step <= last:
        raise HspmdError(f"{where}: the step must come after the first step of the run ({first}) and at most at "
                         f"its last ({last})")
    target = load_plan_context(sw.plan)
    if target.cluster != ctx.cluster:
        raise HspmdError(f"{where}: plan is for cluster {target.cluster.name!r}, the run is on {ctx.cluster.name!r}")
    check_compatible(ctx, target)
    return PlanRef.of(target, sw.strategy)


class Coordinator:
    def __init__(self, workers: list[_Worker], options: TrainOptions, ref: PlanRef, first_step: int,
                 switches: dict[int, PlanRef], replan: Replanner | None, summary: RunSummary,
                 on_step: Callable[[StepRecord], None] | None, on_event: Callable[[dict[str, Any]], None] | None,
                 log: Callable[[str], None], t_start: float) -> None:
        self.workers = {w.spec.device_id: w for w in workers}
        self.options = options
        self.ref = ref
        self.switches = dict(switches)
        self.replan = replan
        self.summary = summary
        self.on_step = on_step
        self.on_event = on_event
        self.log = log
        self.t_start = t_start
        self.alive: set[int] = set(self.workers)
        self.failed: dict[int, str] = {}
        self.gen = 0
        self.epoch = 0
        self.committed = first_step - 1
        self.recorded = first_step - 1
        self.last = first_step - 1 + options.steps
        self.phase = "train"
        self.ready: dict[tuple[int, int], set[int]] = {}
        self.reports: dict[int, list[StepReport]] = {}
        self.left: dict[int, set[int]] = {}
        self.switched: dict[int, dict[int, SwitchTimes]] = {}
        self.fault_wall: dict[int, float] = {}
        self.last_seen_wall: dict[int, float] = {d: time.time() for d in self.workers}
        self.errors: list[tuple[float, _Worker, Any]] = []
        self.fatal: list[tuple[int, float, WorkerFailure]] = []
        self.fatal_deadline: float | None = None
        self.incident: _Incident | None = None
        self.reported_incident: _Incident | None = None
        self.switch: _Switch | None = None
        self.t_abort = 0.0
        self.t_transition = 0.0
        self.failure_times: list[float] = []
        self.committers: dict[int, set[int]] = {}  # step -> the devices told to commit it

    @property
    def active(self) -> tuple[int, ...]:
        return self.ref.devices

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        self._note_single_copies()
        by_conn = {w.report: w for w in self.workers.values()}
        by_sentinel = {w.process.sentinel: w for w in self.workers.values()}
        while True:
            timeout = self.options.heartbeat_s
            if self.fatal_deadline is not None:
                timeout = max(0.0, min(timeout, self.fatal_deadline - time.monotonic()))
            for obj in wait(list(by_conn) + list(by_sentinel), timeout=timeout):
                if obj in by_conn:
                    w = by_conn[obj]
                    try:
                        self._handle(w, obj.recv())
                    except (EOFError, OSError):
                        by_conn.pop(obj, None)
                else:
                    w = by_sentinel.pop(obj)
                    w.process.join(1.0)
                    try:
                        while w.report.poll():
                            self._handle(w, w.report.recv())
                    except (EOFError, OSError):
                        pass
                    by_conn.pop(w.report, None)
                    if not w.finished and not w.failed:
                        self._device_failed(w, _death(w.process.exitcode), "died")
            self._check_heartbeats()
            self._check_errors()
            if self.fatal_deadline is not None and time.monotonic() >= self.fatal_deadline:
                self.fatal.sort(key=lambda f: (f[0], f[1]))
                raise self.fatal[0][2]
            if self._advance():
                return

    def _handle(self, w: _Worker, msg: tuple) -> None:
        d = w.spec.device_id
        w.last_seen = time.monotonic()
        self.last_seen_wall[d] = time.time()
        what = msg[0]
        if what == "step":
            report: StepReport = msg[2]
            self.reports.setdefault(report.step, []).append(report)
        elif what == "ready":
            self.ready.setdefault((msg[2], msg[3]), set()).add(d)  # (generation, step)
        elif what == "left":
            self.left.setdefault(msg[2], set()).add(d)
        elif what == "switched":
            self.switched.setdefault(msg[2], {})[d] = msg[3]
        elif what == "fault":
            self.fault_wall[d] = msg[3]
        elif what == "up":
            w.up = True
        elif what == "log":
            self.log(msg[2])
        elif what == "error":
            info = msg[2]
            if not self.options.elastic or info.kind == "user":
                self._fatal(w, info.kind, info.lines, info.traceback)
            else:
                self.errors.append((time.monotonic(), w, info))
        elif what == "done":
            w.finished = True

    # -- failures ---------------------------------------------------------------------------------------

    def _fatal(self, w: _Worker, kind: str, lines: tuple[str, ...], tb: str = "") -> None:
        if w.failed:
            return
        w.failed = True
        self.fatal.append((_PRIORITY[kind], time.monotonic(), WorkerFailure(w.spec.device_id, w.spec.rank, kind,
                                                                            tuple(lines), tb)))
        if self.fatal_deadline is None:
            self.fatal_deadline = time.monotonic() + ERROR_GRACE_S

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for d in sorted(self.alive):
            w = self.workers[d]
            limit = self.options.heartbeat_timeout_s if w.up else self.options.timeout_s
            if not w.finished and not w.failed and now - w.last_seen > limit:
                what = "no heartbeat" if w.up else "no sign of start-up"
                w.hung = True
                self._device_failed(w, f"{what} for {now - w.last_seen:.1f} s (process stopped or wedged)", "hung")

    def _check_errors(self) -> None:
        now = time.monotonic()
        keep = []
        for t, w, info in self.errors:
            # While survivors abandon a step their collectives fail (peers vanish or leave): consequences.
            # Otherwise an error is one only if a device failed about when it happened.
            if self.phase == "leave" or any(abs(t - f) <= ERROR_GRACE_S for f in self.failure_times):
                continue
            if now - t < ERROR_GRACE_S:
                keep.append((t, w, info))
                continue
            self._fatal(w, info.kind, info.lines, info.traceback)
        self.errors = keep

    def _device_failed(self, w: _Worker, how: str, kind: str) -> None:
        d = w.spec.device_id
        starting = not all(self.workers[x].up for x in self.alive)
        if not self.options.elastic or self.phase == "finish" or starting:
            # Recovery starts once every program is built (the state exists); before that, or while
            # saving at the end, a failure stops the run as without --elastic.
            self._fatal(w, kind, (how,))
            return
        if d in self.failed:
            return
        w.failed = True
        self.failed[d] = how
        self.alive.discard(d)
        self.failure_times.append(time.monotonic())
        if w.process.is_alive():
            w.process.kill()  # a hung process: killing it closes its sockets, so its peers fail fast
        inc = self.incident
        if inc is None:
            step = self.committed + 1
            t_fail = self.fault_wall.get(d, self.last_seen_wall[d])
            self.incident = inc = _Incident(step, {}, t_fail, time.monotonic(), time.time())
            self.log(f"device {d} failed during step {step}: {how}")
        else:
            self.log(f"device {d} failed too: {how}")
        inc.failed[d] = how
        if self.phase in ("train", "switch"):
            self._abort()

    def _abort(self) -> None:
        """Abort the current generation; every survivor leaves it (phase "leave")."""
        self.phase = "leave"
        self.t_abort = time.monotonic()
        self.ready.clear()
        self.reports = {k: v for k, v in self.reports.items() if k <= self.committed}
        self._send(self.alive, ("abort", self.gen))

    def _note_single_copies(self) -> None:
        if not self.options.elastic:
            return
        singles = []
        for d in self.active:
            lost = lost_tensors(self.ref, [d])
            if lost:
                singles.append((d, len(lost)))
        if singles:
            where = ", ".join(f"device {d} ({n} tensors)" for d, n in singles)
            self.log(f"note: some parameters have a single copy, on {where}: if such a device fails the run "
                     "cannot continue in memory (plan with `hspmd plan --elastic` to keep >= 2 pipelines)")

    # -- the state machine ------------------------------------------------------------------------------

    def _advance(self) -> bool:
        if self.fatal:
            return False
        self._collect_records()
        if self.phase == "train":
            self._advance_train()
        elif self.phase == "leave":
            self._advance_leave()
        elif self.phase == "switch":
            self._advance_switch()
        elif self.phase == "finish":
            return all(self.workers[d].finished for d in self.alive)
        return False

    def _advance_train(self) -> None:
        step = self.committed + 1
        if step <= self.last and set(self.active) <= self.ready.get((self.gen, step), set()):
            then = "hold" if step == self.last or step + 1 in self.switches else "next"
            self.ready.pop((self.gen, step), None)
            self._send(self.active, ("commit", self.gen, step, then))
            self.committed = step
            self.committers[step] = set(self.active)
            self._collect_records()
        if self.recorded == self.last:
            self.phase = "finish"
            self._send(self.alive, ("finish",))
        elif self.recorded == self.committed and self.committed + 1 in self.switches:
            self._start_switch(self.committed + 1)

    def _collect_records(self) -> None:
        while self.recorded < self.committed:
            done = self.recorded + 1
            got = self.reports.get(done, [])
            # A device that died after the commit never reports; every survivor does before anything else.
            if not got or not {r.device for r in got} >= self.committers[done] & self.alive:
                return
            self.committers.pop(done)
            record = StepRecord.combine(self.reports.pop(done), self.ref.name)
            self.recorded = done
            if not self.summary.records:
                self.summary.startup_s = time.perf_counter() - self.t_start
            self.summary.records.append(record)
            if self.on_step is not None:
                self.on_step(record)
            self._after_first_step(done)

    def _still_waiting(self, waiting: set[int], since: float, what: str) -> bool:
        """Whether some devices have yet to report a phase's end; those still silent an op timeout (plus
        margin) after ``since`` are failed as hung."""
        if not waiting:
            return False
        limit = self.options.timeout_s + LEAVE_MARGIN_S
        if time.monotonic() - since > limit:
            for d in sorted(waiting):
                self._device_failed(self.workers[d], f"did not {what} within {limit:g} s", "hung")
        return True

    def _advance_leave(self) -> None:
        if self._still_waiting(self.alive - self.left.get(self.gen, set()), self.t_abort, "leave the failed step"):
            return
        inc = self.incident
        assert inc is not None
        if inc.t_left is None:
            inc.t_left = time.monotonic()
            self.log(f"survivors {_devs(self.alive)} abandoned step {inc.step} "
                     f"{inc.t_left - inc.t_detect:.3f} s after the failure was detected")
        self._start_recovery(inc)

    def _start_recovery(self, inc: _Incident) -> None:
        failed = frozenset(self.failed)
        source = self.ref
        lost = lost_tensors(source, failed)
        if lost:
            raise UnrecoverableFailure(_lost_lines(failed, inc.step, lost, self.options))
        target = source
        if failed & set(source.devices):
            if self.replan is None:
                raise UnrecoverableFailure([f"device(s) {_devs(failed)} failed and no replanner was given "
                                            "(hspmd train --elastic supplies the planner)"])
            t0 = time.perf_counter()
            try:
                new_ctx = self.replan(failed, source.ctx, source.name)
            except HspmdError as err:
                raise UnrecoverableFailure([f"no plan for the survivors {_devs(self.alive)}: {line}"
                                            for line in err.lines()]) from None
            inc.replan_s += time.perf_counter() - t0
            inc.replanned = True
            target = PlanRef.of(new_ctx)
            bad = sorted(set(target.devices) - self.alive)
            if bad:
                raise RuntimeError(f"the replanner's plan uses devices {bad} that are not alive")
            check_compatible(source.ctx, target.ctx)
            self.log(f"replanned for survivors {_devs(self.alive)} in {time.perf_counter() - t0:.3f} s: "
                     f"{target.describe()}")
        t0 = time.perf_counter()
        bsr = plan_switch(source, target, failed)
        inc.plan_s += time.perf_counter() - t0
        self.gen += 1
        self.epoch += 1
        t = Transition(self.epoch, "failure", source, target, tuple(sorted(failed)), self.committed, bsr,
                       World.of(self.gen, sorted(self.alive)))
        inc.transition = t
        inc.attempts += 1
        inc.t_sent = self.t_transition = time.monotonic()
        self.phase = "switch"
        self._send(self.alive, ("transition", t))

    def _start_switch(self, step: int) -> None:
        target = self.switches.pop(step)
        t0 = time.perf_counter()
        bsr = plan_switch(self.ref, target, ())
        plan_s = time.perf_counter() - t0
        self.epoch += 1
        t = Transition(self.epoch, "switch", self.ref, target, (), self.committed, bsr, None)
        self.switch = _Switch(step, time.monotonic(), plan_s, t)
        self.t_transition = time.monotonic()
        self.phase = "switch"
        self._send(self.alive, ("transition", t))

    def _advance_switch(self) -> None:
        got = self.switched.get(self.epoch, {})
        if self._still_waiting(self.alive - set(got), self.t_transition, "finish the switch"):
            return
        t = self.incident.transition if self.incident is not None else self.switch.transition  # type: ignore[union-attr]
        assert t is not None and t.epoch == self.epoch
        self._send(self.alive, ("resume", self.epoch))
        self.ref = t.target
        self.phase = "train"
        now = time.monotonic()
        if self.incident is not None:
            inc = self.incident
            inc.t_resumed = now
            inc.times = dict(got)
            self.reported_incident, self.incident = inc, None
            self.log(f"switched to {t.target.describe()} in {now - (inc.t_sent or now):.3f} s "
                     f"({_bytes(t.bsr.total_bytes)} moved); redoing step {inc.step}")
        else:
            sw = self.switch
            assert sw is not None
            sw.t_resumed = now
            event = _switch_event(sw, got, self.ref)
            self.summary.events.append(event)
            self.log(f"switched at step {sw.step} to {t.target.describe()} in {event['total_s']:.3f} s "
                     f"(specialize {event['specialize_s']:.3f} s, transfer {event['transfer_s']:.3f} s, "
                     f"{_bytes(event['switch_bytes'])})")
            if self.on_event is not None:
                self.on_event(event)
            self.switch = None

    def _after_first_step(self, step: int) -> None:
        inc = self.reported_incident
        if inc is None or step < inc.step:
            return
        self.reported_incident = None
        event = _failure_event(inc, time.monotonic(), time.time(), sorted(self.alive))
        self.summary.events.append(event)
        self.log(f"recovered from the failure of device(s) {_devs(inc.failed)}: step {inc.step} done "
                 f"{event['recovery_s']:.3f} s after detection (detect {event['detect_s']:.3f} s, abandon "
                 f"{event['abandon_s']:.3f} s, replan {event['replan_s']:.3f} s, regroup {event['regroup_s']:.3f} s, "
                 f"transfer {event['transfer_s']:.3f} s, total to resume {event['total_s']:.3f} s)")
        if self.on_event is not None:
            self.on_event(event)

    def _send(self, devices: Any, msg: tuple) -> None:
        for d in sorted(devices):
            try:
                self.workers[d].control.send(msg)
            except (OSError, ValueError):
                pass  # it died: its sentinel says so


def _devs(devices: Any) -> str:
    return ", ".join(str(d) for d in sorted(devices))


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _lost_lines(failed: frozenset[int], step: int, lost: list[Any], options: TrainOptions) -> list[str]:
    lines = [f"device(s) {_devs(failed)} failed during step {step} and {len(lost)} parameter(s) have no surviving "
             f"replica, so the run cannot continue in memory:"]
    lines += [f"  {line}" for line in describe_lost(lost)]
    if options.save_dir is not None:
        lines.append(f"--save {options.save_dir}: left as it was (checkpoints are written only at the end of a run)")
    lines.append("restart from the last checkpoint with --load, on a plan for the remaining devices")
    return lines


def _max(times: dict[int, SwitchTimes], name: str) -> float:
    return max((getattr(t, name) for t in times.values()), default=0.0)


def _failure_event(inc: _Incident, now: float, now_wall: float, survivors: list[int]) -> dict[str, Any]:
    t = inc.transition
    assert t is not None and inc.t_left is not None and inc.t_resumed is not None and inc.t_sent is not None
    strat = t.target.strategy
    return {
        "event": "failure", "step": inc.step, "failed": sorted(inc.failed),
        "cause": {str(d): how for d, how in sorted(inc.failed.items())}, "survivors": survivors,
        "replanned": inc.replanned, "strategy": t.target.name, "plan": t.target.describe(),
        "devices": sorted(strat.devices), "micro_batch": t.target.ctx.plan.training.micro_batch,
        "detect_s": max(0.0, inc.t_detect_wall - inc.t_fail_wall),
        "abandon_s": inc.t_left - inc.t_detect,
        "replan_s": inc.replan_s + inc.plan_s,
        "regroup_s": _max(inc.times, "regroup_s"),
        "specialize_s": _max(inc.times, "specialize_s"),
        "transfer_s": _max(inc.times, "transfer_s"),
        "switch_s": inc.t_resumed - inc.t_sent,
        "switch_bytes": t.bsr.total_bytes,
        "modelled_transfer_s": t.bsr.modelled_time(t.target.ctx.cluster),
        "total_s": max(0.0, inc.t_detect_wall - inc.t_fail_wall) + (inc.t_resumed - inc.t_detect),
        "first_step_s": now - inc.t_resumed,
        "recovery_s": now - inc.t_detect,
        "attempts": inc.attempts,
    }


def _switch_event(sw: _Switch, times: dict[int, SwitchTimes], ref: PlanRef) -> dict[str, Any]:
    t = sw.transition
    assert sw.t_resumed is not None
    return {
        "event": "switch", "step": sw.step, "from": t.source.describe(), "to": t.target.describe(),
        "strategy": t.target.name, "plan_file": str(t.target.ctx.path),
        "plan_s": sw.plan_s, "regroup_s": _max(times, "regroup_s"), "specialize_s": _max(times, "specialize_s"),
        "transfer_s": _max(times, "transfer_s"), "switch_bytes": t.bsr.total_bytes,
        "modelled_transfer_s": t.bsr.modelled_time(ref.ctx.cluster),
        "total_s": sw.t_resumed - sw.t_start,
    }


__all__ = ["Coordinator", "Replanner", "UnrecoverableFailure", "prepare"]
