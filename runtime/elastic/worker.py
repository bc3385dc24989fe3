"""The worker of an elastic or switching run: the plain worker loop plus generations and transitions.

What differs from runtime/launch/worker.py's ``train_worker``:

* **All-or-nothing steps.** ``train_step`` calls back before the optimizer update (``before_update``):
  the worker says ``Ready`` and waits for the launcher's ``Commit``. The launcher commits a step only
  when every device of the plan is ready, so either every survivor applies it or none does, and a
  step interrupted by a failure is redone on the new plan from exactly the committed state. (The
  alternative, keeping a copy of the state to undo an update, costs a second copy of every parameter
  and moment; the agreement costs one pipe round trip per step.) Under ZeRO-1 the parameter all-gather
  follows the update: a failure inside it leaves the committed step half-gathered; the worker then says
  ``Interrupted`` (with the step's statistics) and keeps its updated chunks, from which the recovery
  rebuilds the parameters (runtime/elastic/move.py).
* **Leaving a generation.** When the launcher aborts a generation, the thread that receives its word
  aborts every process group of that world at once (``Session.abort``), whatever the training thread is
  blocked in: on NCCL a survivor's training thread waits in a host sync behind a kernel that waits for
  the dead peer, and only an abort of the communicators from another thread ends it
  (runtime/comm/abort.py). The training thread then fails its next operation, keeps its state as plain
  tensors, drops its program and leaves. A worker whose step fails before the launcher's word leaves the
  same way, aborting its groups first; on gloo it also shuts its connections down, so that a peer blocked
  on it errors at once (``gloo_shut_on_leave``).
* **Transitions.** On the launcher's word the worker joins a new world (a fresh store prefix), creates
  the target plan's process groups, builds the target program, runs the fused BSR that the launcher
  planned, and loads the result; the old state is dropped only when every device has switched.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from runtime.device_clock import Progress
from runtime.elastic.move import carry_router_biases, move_state
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
from runtime.launch.messages import Log, StepDone, Up
from runtime.launch.options import WorkerSpec
from runtime.launch.session import Reporter, Session
from runtime.launch.worker import Inbox, classify
from runtime.torchfree.spec.handle import StrategyHandle


class Aborted(Exception):
    """The launcher abandoned the step in progress (some device failed)."""


class ElasticWorker(Session):
    """One device's side of an elastic or switching run: a session that moves between worlds and plans."""

    def __init__(self, spec: WorkerSpec, store: Any, report: Reporter, inbox: Inbox,
                 progress: Progress | None = None) -> None:
        super().__init__(spec, store, report, progress)
        self.inbox = inbox
        inbox.first(self._on_word)
        self.ref = StrategyHandle.of(self.ctx, spec.strategy)
        self.world: World | None = None
        self.program: Any = None
        self.held: dict[str, Any] | None = None  # the state as plain tensors while no program holds it
        self.held_biases: dict[str, Any] = {}  # its routers' biases (aux-loss-free balancing), likewise
        self.left_gen = -1

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        if not self.spec.joining:
            self._enter(World(0, self.spec.store_prefix, dict(self.spec.ranks)))
        # Leaving a generation needs a full gc pass (the groups sit in reference cycles); the objects of
        # the imports (torch's are many) need never be scanned: ~0.5 s -> ~0.05 s per pass.
        gc.freeze()
        if self.me in self.ref.devices and not self.spec.joining:
            self.program = self.build(self.ref)
        # A device joining a running job holds nothing: its state arrives with the transition that adopts it.
        done = self.load(self.program)
        self.report(Up())  # the state exists from here on: failures are recoverable
        step = done + 1
        last = done + self.options.steps
        training = self.program is not None and step <= last
        pending: tuple[Transition, Any] | None = None
        while True:
            if training:
                self.fire_fault(step)
                outcome = self._train_step(step)
                if outcome != "left":
                    step += 1
                training = outcome == "next"
                continue
            msg = self.inbox.next(self.options.timeout_s + 3600.0)  # the launcher watches everything
            if isinstance(msg, Abort):
                pending = None  # a half-done transition's program holds groups of the aborted world
                self._abandon(msg.generation)
            elif isinstance(msg, Transition):
                pending = self._transition(msg)
            elif isinstance(msg, Resume):
                if pending is None or pending[0].epoch != msg.epoch:
                    raise RuntimeError(f"resume of transition {msg.epoch} without that transition")
                t, program = pending
                pending = None
                self.program, self.held, self.held_biases, self.ref = program, None, {}, t.target
                step = t.steps_done + 1
                training = program is not None and step <= last
                gc.collect()
            elif isinstance(msg, Finish):
                if self.world is not None:  # a device that never joined has nothing to save or leave
                    self.finish(self.program, self.ref, step - 1, sync=False)
                return
            # a late Commit of an aborted generation needs nothing

    def _train_step(self, step: int) -> str:
        """Run one step; "next"/"hold" after a committed step, "left" after an abandoned one."""
        gen = self.world.generation if self.world is not None else -1
        then: list[str] = []
        seen: list[Any] = []  # the step's statistics, final before the commit
        t0 = time.perf_counter()

        def before_update(stats: Any) -> None:
            self.report(Ready(gen, step))
            while True:
                msg = self.inbox.next(self.options.timeout_s + 3600.0)
                if isinstance(msg, Commit) and msg.generation == gen and msg.step == step:
                    then.append(msg.then)
                    self.fire_fault(step, "after-commit")
                    seen.append(stats)
                    return
                if isinstance(msg, Abort) and msg.generation == gen:
                    raise Aborted()
                if isinstance(msg, Abort):
                    continue  # of an older generation
                raise RuntimeError(f"unexpected {type(msg).__name__} from the launcher during step {step}")

        failed = False
        try:
            report = self.step(self.program, step, before_update)
        except Aborted:
            failed = True
        except Exception as exc:  # noqa: BLE001 - a peer vanished mid-step (or a bug: the launcher decides)
            if seen:  # committed: the update ran, the parameter all-gather (ZeRO-1) did not finish
                self.report(Interrupted(gen, self.step_report(step, seen[0], time.perf_counter() - t0)))
            self.report(classify(exc))
            failed = True
            del exc  # its traceback holds the program's frames: they must go for the sockets to close
        if failed:
            self._abandon(gen)
            return "left"
        self.report(StepDone(report))
        return then[0]

    def _on_word(self, msg: object) -> None:
        """On the control-pipe thread, as a word arrives: the launcher's abort of a generation aborts its
        world here and now, before the training thread (maybe blocked in it) reads the word."""
        if isinstance(msg, Abort):
            try:
                if self.abort(msg.generation):
                    self.report(Log(f"device {self.me}: aborted the process groups of generation {msg.generation}"))
            except Exception as exc:  # noqa: BLE001 - the training thread still reads the abort and leaves
                self.report(Log(f"device {self.me}: aborting generation {msg.generation} failed: {exc}"))

    # -- worlds and programs ----------------------------------------------------------------------------

    def _enter(self, world: World) -> None:
        import torch.distributed as dist

        gen = world.generation
        self.join(world.prefix, world.ranks,
                  abandoned=lambda: self.inbox.holds(lambda m: isinstance(m, Abort) and m.generation == gen),
                  tag=gen)
        self.world = world
        if world.generation > 0:
            dist.barrier()  # everyone is in; NCCL also wants a world collective before the first P2P

    def _abandon(self, gen: int) -> None:
        """Keep the state as plain tensors, drop the program and every process group of generation
        ``gen``; say so."""
        if self.left_gen < gen:
            self._leave_world(abandon=True)
            self.left_gen = gen
        self.report(Left(gen))

    def _leave_world(self, *, abandon: bool = False) -> None:
        """Keep the state as plain tensors, drop the program, leave the world (``Session.leave``)."""
        if self.program is not None:
            self.held = {k: v.detach() for k, v in self.program.local_state().items()}
            self.held_biases = {k: v.detach().clone() for k, v in self.program.router_biases().items()}
            self.program = None
        self.world = None
        self.leave(abandon=abandon)

    def _transition(self, t: Transition) -> tuple[Transition, Any] | None:
        """Everything up to ``Switched``; on a failure say why, leave, and wait for the launcher."""
        gen = t.world.generation if t.world is not None else self.world.generation if self.world else -1
        program = None
        try:
            t0 = time.perf_counter()
            if t.world is not None:
                if self.world is not None:  # devices join: this world's groups do not include them
                    self._leave_world()
                self._enter(t.world)
            else:
                self.ensure_groups(t.target)
            t1 = time.perf_counter()
            program = self.build(t.target) if self.me in t.target.devices else None
            t2 = time.perf_counter()
            # A planned switch reads the running program's state; after a failure it was kept as tensors.
            source = self.program.local_state() if self.program is not None else (self.held or {})
            move_state(t.bsr, source, self.groups, program, t.steps_done, self.device, t.source,
                       ungathered=t.ungathered)
            del source
            carry_router_biases(self.program.router_biases() if self.program is not None else self.held_biases,
                                program, t.target, self.device)
            t3 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a peer vanished mid-switch (or a bug: the launcher decides)
            self.report(classify(exc))
            del exc
            program = None
            self._abandon(gen)
            return None
        self.report(Switched(t.epoch, t1 - t0, t2 - t1, t3 - t2))
        return t, program


def elastic_worker(spec: WorkerSpec, store: Any, report: Reporter, inbox: Inbox,
                   progress: Progress | None = None) -> None:
    """The worker loop of an elastic or switching run (``runtime.launch.worker.process_main`` runs it)."""
    ElasticWorker(spec, store, report, inbox, progress).run()
