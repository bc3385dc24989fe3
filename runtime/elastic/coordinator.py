"""The launcher's side of an elastic or switching run: commit agreement, failures, transitions.

``ElasticPolicy`` has no loop of its own: the supervisor's (runtime/launch/supervise.py) hands it every
worker's messages, deaths and silences, and it drives the protocol of runtime/elastic/protocol.py, one
phase object at a time (``Training``, ``Leaving``, ``Switching``, ``Finishing``):

* **Steps** are all-or-nothing: committed only when every device of the plan is ``Ready`` (why:
  runtime/elastic/worker.py), so a step a failure interrupts is redone on the new plan.
* **Failures** (elastic runs): a death is seen at once (the process sentinel), a hang when the
  heartbeat stops or says the device's GPU has finished no work for the heartbeat timeout (the hung
  process is then SIGKILLed). The coordinator aborts the generation (every survivor aborts that world's
  process groups as the word arrives, which releases whatever it is blocked in: runtime/comm/abort.py)
  and waits for every survivor to leave it; more devices that fail meanwhile join the same incident.
  Then it checks that every parameter still has a surviving replica (if not: which, and the run stops,
  exit code 1; a checkpoint directory given with ``--save`` is left as it was, since it is only ever
  written at the end),
  asks the ``replan`` callback for a plan on the survivors, plans the fused BSR once and sends every
  survivor a transition to a new world (a fresh store prefix, new ranks).
* **Planned switches**: a transition in the same world before the scheduled step. In an elastic run a
  failure may void one (in flight, or due at the step being redone) or take devices a later one names:
  the recovery goes straight to a due switch's plan, and a switch whose plan lost devices is re-planned
  for its survivors; one that cannot be is dropped, logged and reported (``switch_dropped``), never
  silently.

Every incident and switch is logged with what it cost and reported through ``on_event``.

The decisions live beside it: preflight.py (user errors before the run), recovery.py (errors sorted, the
plan for the survivors, the recovery's transition), switches.py (planned switches after a failure, their
events), joining.py (returning devices: when awaited, whether adopted), incident.py (a failure's record and
event).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich import filesize

from runtime.elastic.incident import (
    Incident,
    UnrecoverableFailure,
    device_list,
    failure_event,
    lost_lines,
    recovered_line,
)
from runtime.elastic.joining import Growth, Returns, by_step, decide_growth
from runtime.elastic.preflight import check_run, first_step, single_copy_note
from runtime.elastic.protocol import (
    Abort,
    Commit,
    Finish,
    Interrupted,
    Left,
    Ready,
    Resume,
    Switched,
    Transition,
    World,
)
from runtime.elastic.recovery import plan_recovery, replan_for_survivors, sort_errors
from runtime.elastic.switches import after_failure, switch_event
from runtime.elastic.worker import elastic_worker
from runtime.launch.messages import FaultFiring, StepDone, WorkerError
from runtime.launch.options import StepRecord, StepReport, TrainOptions
from runtime.launch.supervise import FailureLog, Run, WorkerHandle
from runtime.torchfree.elastic.preplan import Grower, Preplanner, Replanner, plan_layout
from runtime.torchfree.elastic.state import lost_state, plan_switch
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext
from runtime.torchfree.spec.handle import StrategyHandle

ERROR_GRACE_S = 1.0  # a worker's error with no device failure within this window is a genuine error
LEAVE_MARGIN_S = 5.0  # beyond the op timeout, how long a survivor may take to leave a failed step


# -- the phases: what the coordinator waits for now, and what comes next ---------------------------------


class Training:
    """Steps run; a step is committed when every device of the plan is ready for it. A failure aborts."""

    def advance(self, c: ElasticPolicy) -> None:
        step = c.committed + 1
        if step <= c.last and set(c.active) <= c.ready.get((c.gen, step), set()) and c.admitted(step):
            hold = step == c.last or step + 1 in c.switches or c.growth is not None
            c.ready.pop((c.gen, step), None)
            c.send(c.active, Commit(c.gen, step, "hold" if hold else "next"))
            c.holding = hold and step < c.last
            c.committed = step
            c.committers[step] = set(c.active)
            c.inject(step + 1)
            c.collect_records()
        if c.recorded == c.last:
            c.phase = Finishing()
            if c.preplanner is not None:
                c.preplanner.stop()
            c.send(c.alive | set(c.waiting), Finish())
        elif c.recorded == c.committed and c.holding:
            # Only devices that hold (the last commit said so) read a transition: right after a recovery
            # they train the redone step, and a growth decided meanwhile waits for that step's "hold".
            if c.committed + 1 in c.switches:
                c.start_switch(c.committed + 1)
            elif c.growth is not None:
                c.start_growth()
            else:
                c.release()


@dataclass
class Leaving:
    """The generation was aborted at ``since``: every survivor leaves it. While they do, their collectives
    fail (peers vanish or leave): those errors are consequences, and more failures join the incident."""

    since: float

    def advance(self, c: ElasticPolicy) -> None:
        if c.still_waiting(c.alive - c.left.get(c.gen, set()), self.since, "leave the failed step"):
            return
        inc = c.incident
        assert inc is not None
        if inc.t_left is None:
            inc.t_left = time.monotonic()
            c.log(f"survivors {device_list(c.alive)} abandoned step {inc.step} "
                  f"{inc.t_left - inc.t_detect:.3f} s after the failure was detected")
        c.start_recovery(inc)


@dataclass
class Switching:
    """``transition`` was sent at ``since``: every device switches, then resumes (a recovery, or the
    planned switch before ``step``, planned in ``plan_s``). A failure aborts the generation."""

    transition: Transition
    since: float
    step: int = 0
    plan_s: float = 0.0
    growth: Growth | None = None  # devices joining the job (a new world with them in it)

    def advance(self, c: ElasticPolicy) -> None:
        got = c.switched.get(c.epoch, {})
        if c.still_waiting(c.alive - set(got), self.since, "finish the switch"):
            return
        t = self.transition
        assert t.epoch == c.epoch
        c.send(c.alive, Resume(c.epoch))
        c.ref = t.target
        c.phase = Training()
        now = time.monotonic()
        if c.incident is not None:
            inc = c.incident
            inc.t_resumed = now
            inc.times = dict(got)
            c.reported_incident, c.incident = inc, None
            c.log(f"switched to {t.target.describe()} in {now - (inc.t_sent or now):.3f} s "
                  f"({filesize.decimal(t.bsr.total_bytes + inc.moment_bytes)} moved); redoing step {inc.step}")
        elif self.growth is not None:
            g = self.growth
            c.report(switch_event(t, self.step, self.growth, self.plan_s, self.since, now, got),
                     lambda e: f"device(s) {device_list(g.joining)} joined after step {self.step}: now "
                               f"{t.target.describe()}; "
                               f"switch {e['total_s']:.3f} s (regroup {e['regroup_s']:.3f} s, transfer "
                               f"{e['transfer_s']:.3f} s, {filesize.decimal(e['switch_bytes'])})")
        else:
            c.report(switch_event(t, self.step, self.growth, self.plan_s, self.since, now, got),
                     lambda e: f"switch at step {self.step} to {t.target.describe()} in {e['total_s']:.3f} s "
                               f"(specialize {e['specialize_s']:.3f} s, transfer {e['transfer_s']:.3f} s, "
                               f"{filesize.decimal(e['switch_bytes'])})")


class Finishing:
    """The last step is recorded: every device saves, writes its trace and exits. A failure is fatal."""


Phase = Training | Leaving | Switching | Finishing


class ElasticPolicy:
    """The supervisor's policy for elastic and switching runs (``TrainOptions.elastic`` / ``switches``):
    ``replan`` gives the plan for the survivors of a failure (``preplan``: the same, planned ahead for every
    single device and node loss of the running layout), ``grow`` the decision on returning devices
    (``preplan_grow``: the same, decided ahead for each device and node out of the layout), ``on_event`` gets
    one dict per failure or switch.
    Without ``options.elastic`` a failure stops the run as under ``PlainPolicy``."""

    worker_loop = staticmethod(elastic_worker)

    def __init__(self, replan: Replanner | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None, grow: Grower | None = None,
                 preplan: Replanner | None = None, preplan_grow: Grower | None = None) -> None:
        self.replan = replan
        self.grow = grow
        self.on_event = on_event
        self.failures = FailureLog(ERROR_GRACE_S)
        # ``preplan`` / ``preplan_grow``: the replanner and grower for planning ahead, in the background
        # (runtime/torchfree/elastic/preplan.py; the CLI's are ``replan`` and ``grow`` without their log lines); None
        # plans only when a failure strikes (a return: when it comes).
        self.preplanner = Preplanner(preplan, preplan_grow) if preplan is not None else None

    def prepare(self, options: TrainOptions, ctx: PlanContext, strategy: str) -> list[int]:
        """User errors of a coordinated run, before any process starts; the devices the world needs (the
        union of every plan's devices)."""
        self.first_step = first_step(options, ctx)
        self.switches = check_run(options, ctx, self.first_step)
        return sorted(set(StrategyHandle.of(ctx, strategy).devices).union(*(t.devices for t in self.switches.values())))

    def begin(self, run: Run) -> None:
        self.run = run
        self.workers = run.workers
        self.options = run.options
        self.log = run.log
        self.ref = StrategyHandle.of(run.ctx, run.strategy)
        self.alive: set[int] = set(self.workers)
        self.failed: dict[int, str] = {}
        self.gen = self.epoch = 0
        self.committed = self.recorded = self.first_step - 1
        self.last = self.first_step - 1 + run.options.steps
        self.phase: Phase = Training()
        self.ready: dict[tuple[int, int], set[int]] = {}  # (generation, step) -> the devices ready
        self.reports: dict[int, list[StepReport]] = {}
        self.left: dict[int, set[int]] = {}
        self.switched: dict[int, dict[int, Switched]] = {}
        self.fault_wall: dict[int, float] = {}
        self.errors: list[tuple[float, WorkerHandle, WorkerError]] = []
        self.incident: Incident | None = None
        self.reported_incident: Incident | None = None
        self.failure_times: list[float] = []
        self.committers: dict[int, set[int]] = {}  # step -> the devices told to commit it
        self.error_grace_s = ERROR_GRACE_S + run.loss_detect_s
        self.waiting: dict[int, WorkerHandle] = {}  # joining devices: started, in no world yet
        self.declined: set[int] = set()  # joining devices the grower turned down (asked again with others)
        self.growth: Growth | None = None
        # Joining devices whose adopting transition a failure voided -> its generation: until they have left
        # it, their errors are its consequences and they are not asked for again.
        self.voided: dict[int, int] = {}
        self.returns = Returns(by_step((r.step, r.device) for r in run.options.rejoins))
        self.node_kills = by_step((k.step, k.node) for k in run.options.node_kills)
        self.holding = False  # the last commit said "hold" before the run's last step
        self.ungathered: set[int] = set()  # committed steps whose ZeRO-1 parameter all-gather some survivor left
        if self.options.elastic and (note := single_copy_note(self.ref)) is not None:
            self.log(note)
        self.inject(self.first_step)

    @property
    def active(self) -> tuple[int, ...]:
        return self.ref.devices

    # -- events -----------------------------------------------------------------------------------------

    def on_message(self, w: WorkerHandle, msg: object) -> None:
        d = w.device
        if self.workers.get(d) is not w:
            return  # the late word of a device's earlier worker (it has rejoined since)
        if isinstance(msg, StepDone):
            self.reports.setdefault(msg.report.step, []).append(msg.report)
        elif isinstance(msg, Interrupted):
            self.reports.setdefault(msg.report.step, []).append(msg.report)
            self.ungathered.add(msg.report.step)
        elif isinstance(msg, Ready):
            self.ready.setdefault((msg.generation, msg.step), set()).add(d)
        elif isinstance(msg, Left):
            self.left.setdefault(msg.generation, set()).add(d)
            if d in self.voided and msg.generation >= self.voided[d]:
                del self.voided[d]
                self.log(f"device {d} left the void growth's world: it may be adopted again")
        elif isinstance(msg, Switched):
            self.switched.setdefault(msg.epoch, {})[d] = msg
        elif isinstance(msg, FaultFiring):
            self.fault_wall[d] = msg.wall_time
        elif isinstance(msg, WorkerError):
            if d in self.voided:
                return  # its transition failed with the growth a failure voided
            if not self.options.elastic or msg.kind == "user":
                self.failures.add(w, msg.kind, msg.lines, msg.traceback)
            else:
                self.errors.append((time.monotonic(), w, msg))

    def on_failure(self, w: WorkerHandle, kind: str, how: str) -> None:
        d = w.device
        if self.workers.get(d) is not w:
            return  # a device's earlier worker (it has rejoined since)
        if d in self.waiting:
            w.failed = True
            w.kill()
            del self.waiting[d]
            self.voided.pop(d, None)
            self.log(f"device {d} failed before it joined the job: {how}")
            if self.growth is not None and d in self.growth.joining:
                self.growth = None
            return
        if isinstance(self.phase, Finishing) and self.options.elastic and d not in self.active:
            w.failed = True  # idle in the plan: it has nothing to save, and the others do not wait for it
            self.alive.discard(d)
            self.log(f"device {d} (idle in the plan) failed while the run finished: {how}")
            return
        starting = not all(self.workers[x].up for x in self.alive)
        if not self.options.elastic or isinstance(self.phase, Finishing) or starting:
            # Recovery starts once every program is built (the state exists); before that, or while
            # saving at the end, a failure stops the run as without --elastic.
            self.failures.add(w, kind, (how,))
            return
        if d in self.failed:
            return
        w.failed = True
        self.failed[d] = how
        self.alive.discard(d)
        self.failure_times.append(time.monotonic())
        if self.preplanner is not None:
            self.preplanner.stop()  # the recovery has the CPU; the plans made so far stay for it
        # A growth decided on the plan before this failure is void; the spares are reconsidered after it.
        self.growth = None
        self.declined.clear()
        voided = self._void_growth_in_flight()
        self._requeue_switch_in_flight()
        w.kill()  # a hung process: killing it closes its sockets, so its peers fail fast
        inc = self.incident
        if inc is None:
            step = self.committed + 1
            t_fail = self.fault_wall.get(d, w.last_seen_wall)
            self.incident = inc = Incident(step, {}, t_fail, time.monotonic(), time.time())
            self.log(f"device {d} failed during step {step}: {how}")
        else:
            self.log(f"device {d} failed too: {how}")
        inc.failed[d] = how
        if isinstance(self.phase, (Training, Switching)):
            self._abort()
        self.send(voided, Abort(self.gen))  # they leave the world of the void growth, and wait again

    def _requeue_switch_in_flight(self) -> None:
        """A failure during a planned switch voids it: it is due again at the step redone (``after_failure``)."""
        phase = self.phase
        if (isinstance(phase, Switching) and phase.growth is None and self.incident is None
                and phase.transition.target is not self.ref):  # not a release (a switch to the running plan)
            self.switches[phase.step] = phase.transition.target

    def _void_growth_in_flight(self) -> set[int]:
        """A failure during the transition that adopts returning devices voids it: the recovery starts from
        the plan that ran, which they are not in (their state had not all arrived), so they go back to
        waiting, still up, and are asked for again on the plan after the recovery."""
        phase = self.phase
        if not isinstance(phase, Switching) or phase.growth is None:
            return set()
        back = {d for d in phase.growth.joining if d in self.alive}
        for d in sorted(back):
            self.alive.discard(d)
            self.waiting[d], self.voided[d] = self.workers[d], self.gen
        if back:
            self.log(f"the growth with device(s) {device_list(back)} is void: they wait for the recovery")
        return back

    def end(self) -> None:
        if self.preplanner is not None:
            self.preplanner.close()

    def tick(self) -> bool:
        self._check_errors()
        if self.failures:
            return False
        self.collect_records()
        if isinstance(self.phase, Finishing):
            return all(self.workers[d].finished for d in self.alive | set(self.waiting))
        self._returned()
        self._plan_ahead()
        if isinstance(self.phase, Training) and self.growth is None and not self.returns.awaited() & set(self.waiting):
            self._consider_growth()  # a device returning unannounced (a scheduled one: when its step comes)
        self.phase.advance(self)
        return False

    def _plan_ahead(self) -> None:
        """Between failures, plan ahead the running layout's losses and the returns (``plan_layout``)."""
        if self.preplanner is not None and self.options.elastic and self.replan is not None:
            new = isinstance(self.phase, Training) and self.incident is None and self.committed + 1 < self.last
            plan_layout(self.preplanner, self.ref, self.alive, frozenset(self.failed), self.last - self.committed,
                        begin=new, log=self.log)

    # -- devices joining a running job ----------------------------------------------------------------------

    def inject(self, step: int) -> None:
        """The injected events due at the start of ``step`` (tests, demos, --events traces): nodes lost at
        ``step``; devices returning at ``step + 1`` start now, so that they are up when ``step`` ends and
        train from ``step + 1`` on (``admitted``: the commit of ``step`` waits for their start-up)."""
        for node in self.node_kills.pop(step, []):
            if self.run.source is None:
                raise HspmdError(f"node kill at step {step}: this launcher has no nodes to lose")
            self.log(f"fault injection: killing the agent of node {node!r} at the start of step {step}")
            self.run.source.kill_node(node)
        for d in self.returns.starting(step):
            self.log(f"device {d} returns: its worker starts now, to train from step {step + 1}")
            try:
                self.start_joiner(d)
            except HspmdError as err:
                # Its node's agent is not back yet: the commit of ``step`` waits for it (up to an op timeout).
                self.returns.unplaced[d] = time.monotonic() + self.options.timeout_s
                self.log(f"device {d} waits for its node: {'; '.join(err.lines())}")

    def admitted(self, step: int) -> bool:
        """Whether ``step`` may be committed: the devices due to return after it are up (or failed, or
        their node did not come back within an op timeout)."""
        if step not in self.returns.admit:
            return True
        if not self.returns.arrived(step, self.waiting, self.log):
            return False
        self._consider_growth()
        return True

    def _returned(self) -> None:
        source = self.run.source
        back = source.returned_devices() if source is not None else []
        scheduled = self.returns.scheduled()
        for d in back:
            if d in scheduled:
                continue  # a trace says when it returns: its worker starts then
            self.returns.unplaced.pop(d, None)
            try:
                self.start_joiner(d)
            except HspmdError as err:
                self.log(f"device {d} cannot join: {'; '.join(err.lines())}")

    def start_joiner(self, d: int) -> None:
        """Start a worker for device ``d``, to join the job once it is up (if the grower wants it)."""
        if d in self.alive or d in self.waiting:
            self.log(f"device {d} is already in the job: nothing to rejoin")
            return
        if self.run.source is None or self.run.make_spec is None:
            raise HspmdError(f"device {d} cannot rejoin: this launcher starts no workers during a run")
        w = self.run.source.start(self.run.make_spec(d), self.worker_loop)
        self.workers[d] = w
        self.waiting[d] = w
        self.failed.pop(d, None)
        self.declined.discard(d)

    def _consider_growth(self) -> None:
        up = frozenset(d for d, w in self.waiting.items() if w.up and d not in self.voided)
        if self.growth is not None or not up or up <= self.declined or self.committed + 2 > self.last:
            return
        if self.grow is None:
            self.declined |= up
            self.log(f"device(s) {device_list(up)} are up but no grower was given: they stay spare")
            return
        self.growth = decide_growth(up, self.ref, self.alive, grow=self.grow, preplanner=self.preplanner,
                                    steps_left=self.last - self.committed - 1, after_step=self.committed + 1,
                                    log=self.log)
        if self.growth is None:
            self.declined |= up

    def release(self) -> None:
        """The devices hold for a growth its joiner's failure voided: a switch to the plan they run frees them."""
        self.log(f"the devices held after step {self.committed} go on with {self.ref.describe()}")
        self.start_transition(self.ref, None, self.committed + 1, 0.0, None)

    def start_growth(self) -> None:
        """A new world with the joining devices in it; every state tensor moves by one fused BSR."""
        g = self.growth
        assert g is not None
        self.growth = None
        self.gen += 1
        for d in g.joining:
            del self.waiting[d]
        self.alive |= set(g.joining)
        self.start_transition(g.target, World.of(self.gen, sorted(self.alive)), self.committed + 1, g.decide_s, g)

    def _check_errors(self) -> None:
        genuine, self.errors = sort_errors(self.errors, self.failure_times, self.error_grace_s,
                                           leaving=isinstance(self.phase, Leaving))
        for w, info in genuine:
            self.failures.add(w, info.kind, info.lines, info.traceback)

    def _abort(self) -> None:
        """Abort the current generation; every survivor leaves it."""
        self.phase = Leaving(time.monotonic())
        self.ready.clear()
        self.reports = {k: v for k, v in self.reports.items() if k <= self.committed}
        self.send(self.alive, Abort(self.gen))

    # -- what the phases share --------------------------------------------------------------------------

    def collect_records(self) -> None:
        while self.recorded < self.committed:
            done = self.recorded + 1
            got = self.reports.get(done, [])
            # A device that died after the commit never reports; every survivor does before anything else.
            if not got or not {r.device for r in got} >= self.committers[done] & self.alive:
                return
            self.committers.pop(done)
            self.recorded = done
            self.run.record(StepRecord.combine(self.reports.pop(done), self.ref.name))
            self._after_first_step(done)

    def still_waiting(self, waiting: set[int], since: float, what: str) -> bool:
        """Whether some devices have yet to report a phase's end; those still silent an op timeout (plus
        margin) after ``since`` are failed as hung."""
        if not waiting:
            return False
        limit = self.options.timeout_s + LEAVE_MARGIN_S
        if time.monotonic() - since > limit:
            for d in sorted(waiting):
                self.on_failure(self.workers[d], "hung", f"did not {what} within {limit:g} s")
        return True

    def start_recovery(self, inc: Incident) -> None:
        failed = frozenset(self.failed)
        source = self.ref
        lost = lost_state(source, failed)
        if lost:
            raise UnrecoverableFailure(lost_lines(lost, inc.step, self.options))
        self.collect_records()
        if self.recorded < self.committed:  # every survivor reports a committed step, gathered or not
            raise RuntimeError(f"survivors {device_list(self.alive)} left step {self.committed} after its commit "
                               "without reporting it")
        # a failure inside a committed step's ZeRO-1 parameter all-gather: ``plan_recovery`` says what then
        ungathered = self.committed in self.ungathered
        if ungathered:
            self.log(f"step {self.committed} was committed but its parameter all-gather did not finish: the "
                     "switch rebuilds the parameters from the surviving copies of their chunks")
        target = source
        due = after_failure(self.switches, inc.step, failed, ref=self.ref, alive=self.alive, last=self.last,
                            replan=self.replan, log=self.log, report=self.report)
        if due is not None:
            target = due
        elif failed & set(source.devices):
            target = replan_for_survivors(inc, source, failed, self.alive, replan=self.replan,
                                          preplanner=self.preplanner, steps_left=self.last - inc.step + 1,
                                          log=self.log)
        self.gen += 1
        self.epoch += 1
        t = plan_recovery(inc, source, target, failed, epoch=self.epoch, committed=self.committed,
                          world=World.of(self.gen, sorted(self.alive)), ungathered=ungathered)
        self.holding = False  # whatever the last commit said, the survivors go on after this transition
        inc.t_sent = time.monotonic()
        self.phase = Switching(t, inc.t_sent)
        self.send(self.alive, t)

    def start_switch(self, step: int) -> None:
        self.start_transition(self.switches.pop(step), None, step, 0.0, None)

    def start_transition(self, target: StrategyHandle, world: World | None, step: int, decide_s: float,
                         growth: Growth | None) -> None:
        """Send every member the transition to ``target`` (in ``world``, or the current one) before ``step``."""
        t0 = time.perf_counter()
        bsr = plan_switch(self.ref, target, ())
        plan_s = time.perf_counter() - t0 + decide_s
        self.epoch += 1
        self.holding = False
        t = Transition(self.epoch, self.ref, target, self.committed, bsr, world)
        self.phase = Switching(t, time.monotonic(), step if growth is None else step - 1, plan_s, growth)
        self.send(self.alive, t)

    def _after_first_step(self, step: int) -> None:
        inc = self.reported_incident
        if inc is None or step < inc.step:
            return
        self.reported_incident = None
        self.report(failure_event(inc, time.monotonic(), sorted(self.alive)), lambda e: recovered_line(inc, e))

    def report(self, event: dict[str, Any], line: Callable[[dict[str, Any]], str]) -> None:
        """An incident's or switch's event: into the summary, the log (``line(event)``) and ``on_event``."""
        self.run.summary.events.append(event)
        self.log(line(event))
        if self.on_event is not None:
            self.on_event(event)

    def send(self, devices: Any, msg: object) -> None:
        for d in sorted(devices):
            self.workers[d].send(msg)


__all__ = ["ElasticPolicy", "Grower", "Replanner", "UnrecoverableFailure"]  # the callbacks: preplan.py
