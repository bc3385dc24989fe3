"""The worker of an elastic or switching run: the plain worker loop plus generations and transitions.

What differs from runtime/launch/worker.py's ``train_worker``:

* **All-or-nothing steps.** ``train_step`` calls back before the optimizer update (``before_update``):
  the worker says ``ready`` and waits for the launcher's ``commit``. The launcher commits a step only
  when every device of the plan is ready, so either every survivor applies it or none does, and a
  step interrupted by a failure is redone on the new plan from exactly the committed state. (The
  alternative, keeping a copy of the state to undo an update, costs a second copy of every parameter
  and moment; the agreement costs one pipe round trip per step.)
* **Leaving a generation.** When a step fails (a peer vanished) or the launcher aborts it, the worker
  keeps its state as plain tensors and drops every reference to its program and process groups and
  destroys them. Dropping them closes the gloo sockets, so a peer blocked on this worker errors at
  once instead of waiting for its op timeout: the abort cascades through the survivors in
  milliseconds. (Gloo has no abort for an op in flight; the op timeout only bounds the worst case.)
* **Transitions.** On the launcher's word the worker joins a new world (a fresh store prefix), creates
  the target plan's process groups, builds the target program, runs the fused BSR that the launcher
  planned, and loads the result; the old state is dropped only when every device has switched.
"""

from __future__ import annotations

import gc
import queue
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

from runtime.elastic.protocol import SwitchTimes, Transition, World
from runtime.elastic.state import PlanRef
from runtime.launch.options import StepReport, WorkerSpec


class Aborted(Exception):
    """The launcher abandoned the step in progress (some device failed)."""


class Inbox:
    """The launcher's words other than "stop", in order (filled by the control-pipe thread)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple] = queue.Queue()

    def put(self, msg: tuple) -> None:
        self._queue.put(msg)

    def next(self, timeout_s: float) -> tuple:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no word from the launcher for {timeout_s:g} s") from None


class ElasticWorker:
    """One device's side of an elastic or switching run."""

    def __init__(self, spec: WorkerSpec, store: Any, reporter: Any, inbox: Inbox) -> None:
        import torch

        from runtime.data import token_source
        from runtime.launch.worker import _hooks
        from runtime.spec import load_plan_context

        self.spec, self.store, self.reporter, self.inbox = spec, store, reporter, inbox
        self.options = spec.options
        self.me = spec.device_id
        ctx = load_plan_context(self.options.plan)
        self.ref = PlanRef(ctx, spec.strategy)
        t = ctx.plan.training
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.device = torch.device(spec.torch_device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.timeout = timedelta(seconds=self.options.timeout_s)
        self.source = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch,
                                   seq_len=t.seq_len, seed=t.seed, data_file=self.options.data_file)
        self.hooks, self.recorder, self.emulator = _hooks(spec, ctx, self.device)
        self.world: World | None = None
        self.groups: Any = None
        self.program: Any = None
        self.held: dict[str, Any] | None = None  # the state as plain tensors while no program holds it
        self.left_gen = -1
        self.all_devices = sorted(spec.ranks)

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        self._join(World(0, self.spec.store_prefix, dict(self.spec.ranks)))
        # Leaving a generation needs a full gc pass (the groups sit in reference cycles); the objects of
        # the imports (torch's are many) need never be scanned: ~0.5 s -> ~0.05 s per pass.
        gc.freeze()
        if self.emulator is not None:
            self.reporter.log(f"device {self.me}: emulating a {self.emulator.slowdown:g}x slower device "
                              f"(sleeps {self.emulator.slowdown - 1:g}x each measured compute block)")
        if self.me in self.ref.devices:
            self.program = self._build(self.ref)
        done = self._load()
        self.reporter.up()  # the state exists from here on: failures are recoverable
        faults = {f.step: f for f in self.options.faults if f.device == self.me}
        step = done + 1
        last = done + self.options.steps
        training = self.program is not None and step <= last
        pending: tuple[Transition, Any] | None = None
        while True:
            if training:
                if step in faults:
                    self._inject(faults.pop(step))
                outcome = self._step(step)
                if outcome == "left":
                    training = False
                    continue
                step += 1
                training = outcome == "next"
                continue
            msg = self.inbox.next(self.options.timeout_s + 3600.0)  # the launcher watches everything
            what = msg[0]
            if what == "abort":
                pending = None  # a half-done transition's program holds groups of the aborted world
                self._leave(msg[1])
            elif what == "transition":
                pending = self._transition(msg[1])
            elif what == "resume":
                if pending is None or pending[0].epoch != msg[1]:
                    raise RuntimeError(f"resume of transition {msg[1]} without that transition")
                t, program = pending
                pending = None
                self.program, self.held, self.ref = program, None, t.target
                step = t.steps_done + 1
                training = program is not None and step <= last
                gc.collect()
            elif what == "finish":
                self._finish(step - 1)
                return
            # a late "commit" of an aborted generation needs nothing

    def _step(self, step: int) -> str:
        """Run one step; "next"/"hold" after a committed step, "left" after an abandoned one."""
        from runtime.launch.worker import classify

        gen = self.world.generation if self.world is not None else -1
        then: list[str] = []

        def before_update() -> None:
            self.reporter.send("ready", gen, step)
            while True:
                msg = self.inbox.next(self.options.timeout_s + 3600.0)
                if msg[0] == "commit" and msg[1] == gen and msg[2] == step:
                    then.append(msg[3])
                    return
                if msg[0] == "abort" and msg[1] == gen:
                    raise Aborted()
                if msg[0] == "abort":
                    continue  # of an older generation
                raise RuntimeError(f"unexpected {msg[0]!r} from the launcher during step {step}")

        batch = self.source.batch(step)
        failed = False
        try:
            with self.recorder.span("step", f"step {step}") if self.recorder is not None else nullcontext():
                t0 = time.perf_counter()
                stats = self.program.train_step(batch, before_update=before_update)
                wall = time.perf_counter() - t0
        except Aborted:
            failed = True
        except Exception as exc:  # noqa: BLE001 - a peer vanished mid-step (or a bug: the launcher decides)
            self.reporter.send("error", classify(exc))
            failed = True
            del exc  # its traceback holds the program's frames: they must go for the sockets to close
        if failed:
            self._leave(gen)
            return "left"
        self.reporter.step(StepReport(
            step=step, rank=self.world.ranks[self.me] if self.world else 0, device=self.me, loss=float(stats.loss),
            grad_norm=float(stats.grad_norm), tokens=int(stats.tokens), wall_s=wall,
            compute_s=float(stats.compute_s), comm_s=float(stats.comm_s),
            emulation_s=self.emulator.take_emulated_s() if self.emulator is not None else 0.0))
        return then[0]

    # -- worlds and programs ----------------------------------------------------------------------------

    def _join(self, world: World) -> None:
        import torch.distributed as dist

        from runtime.comm.groups import ProcessGroups

        dist.init_process_group(self.spec.backend, store=dist.PrefixStore(world.prefix, self.store),
                                rank=world.ranks[self.me], world_size=len(world.ranks), timeout=self.timeout,
                                device_id=self.device if self.device.type == "cuda" else None)
        self.world = world
        self.reporter.rank = world.ranks[self.me]
        self.groups = ProcessGroups([], world.ranks, timeout=self.timeout, device=self.device)
        if world.generation > 0:
            dist.barrier()  # everyone is in; NCCL also wants a world collective before the first P2P

    def _leave(self, gen: int) -> None:
        """Keep the state, drop the program and every process group of generation ``gen``; say so."""
        if self.left_gen < gen:
            import torch.distributed as dist

            if self.program is not None:
                self.held = {k: v.detach() for k, v in self.program.local_state().items()}
                self.program = None
            groups, self.groups, self.world = self.groups, None, None
            if self.spec.backend == "gloo":
                sever_tcp_connections(keep_port=self.store.port)
            if groups is not None:
                for key in groups.keys:
                    if self.me in key:
                        _abort(groups.get(key))
                groups.destroy()
                del groups
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()  # the last references to the groups go now: their sockets close
            self.left_gen = gen
        self.reporter.send("left", gen)

    def _build(self, ref: PlanRef) -> Any:
        from runtime.engine import DeviceProgram, WorkerContext

        self.groups.ensure(DeviceProgram.required_groups(ref.ctx, ref.strategy))
        ctx = WorkerContext(plan=ref.ctx, strategy=ref.strategy, device_id=self.me, ranks=dict(self.world.ranks),
                            torch_device=self.device, timeout=self.timeout, precision=self.options.precision)
        return DeviceProgram(ctx, self.groups, self.hooks)

    def _load(self) -> int:
        if self.options.load_dir is None:
            return 0
        from runtime.checkpoint import load_checkpoint, read_checkpoint_info

        if self.program is None:
            return read_checkpoint_info(self.options.load_dir, self.ref.ctx).step
        done = load_checkpoint(self.program, self.options.load_dir, self.ref.ctx)
        if self.spec.is_reporter:
            self.reporter.log(f"loaded {self.options.load_dir} (step {done})")
        return done

    def _transition(self, t: Transition) -> tuple[Transition, Any] | None:
        """Everything up to ``switched``; on a failure say why, leave, and wait for the launcher."""
        from runtime.engine import DeviceProgram
        from runtime.launch.worker import classify

        gen = t.world.generation if t.world is not None else self.world.generation if self.world else -1
        program = None
        try:
            t0 = time.perf_counter()
            if t.world is not None:
                self._join(t.world)
            else:
                self.groups.ensure(DeviceProgram.required_groups(t.target.ctx, t.target.strategy))
            t1 = time.perf_counter()
            program = self._build(t.target) if self.me in t.target.devices else None
            t2 = time.perf_counter()
            # A planned switch reads the running program's state; after a failure it was kept as tensors.
            source = self.program.local_state() if self.program is not None else (self.held or {})
            move_state(t.bsr, source, self.groups, program, t.steps_done, self.device)
            del source
            t3 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a peer vanished mid-switch (or a bug: the launcher decides)
            self.reporter.send("error", classify(exc))
            del exc
            program = None
            self._leave(gen)
            return None
        sent = sum(m.nbytes for m in t.bsr.sends(self.me))
        self.reporter.send("switched", t.epoch, SwitchTimes(t1 - t0, t2 - t1, t3 - t2, sent))
        return t, program

    def _finish(self, last_step: int) -> None:
        import torch.distributed as dist

        from runtime.launch.worker import _merge_traces, trace_file

        if self.program is not None and self.options.save_dir is not None:
            from runtime.checkpoint import save_checkpoint

            save_checkpoint(self.program, self.groups, self.options.save_dir, plan=self.ref.ctx,
                            strategy=self.ref.strategy, step=last_step)
            if self.me == min(self.ref.devices):
                self.reporter.log(f"saved {self.options.save_dir} (step {last_step})")
        if self.recorder is not None:
            assert self.options.trace_dir is not None
            self.recorder.write(trace_file(self.options.trace_dir, self.me))
        dist.barrier()
        if self.recorder is not None and self.world is not None and self.world.ranks[self.me] == 0:
            _merge_traces(self.options.trace_dir, self.all_devices)
        self.program = None
        self.groups.destroy()
        dist.destroy_process_group()

    def _inject(self, fault: Any) -> None:
        from runtime.launch.worker import _inject

        self.reporter.send("fault", fault.kind, time.time())
        _inject(fault)


def move_state(bsr: Any, source: dict[str, Any], groups: Any, program: Any, steps_done: int, device: Any) -> None:
    """This device's part of a switch: run the fused BSR ``bsr`` (collective over ``bsr.devices``) from
    its ``source`` state (``local_state()`` layout of the old plan; empty if it held none) and load the
    result into ``program`` (None when the new plan leaves this device idle)."""
    import torch

    from runtime.comm.execute import run_bsr

    me = groups.my_device
    out = run_bsr(bsr, source, groups, device=device) if me in bsr.devices else {}
    if program is not None:
        out["step"] = torch.tensor(float(steps_done))
        program.load_local_state(out)


def sever_tcp_connections(keep_port: int) -> int:
    """shutdown(2) every connected TCP socket of this process except those to ``keep_port`` (the store).

    Gloo cannot abort an op in flight, and after a peer's death it keeps the generation's other
    connections open even when its process groups are destroyed (the failed op pins the context), so
    peers blocked on this worker would wait for their op timeout. Shutting the sockets down is what a
    process exit would do: every pending op here and on the peers fails at once. The file descriptors
    stay gloo's (it closes them when it lets go). Returns how many were shut down.
    """
    import os
    import socket

    count = 0
    if not os.path.isdir("/proc/self/fd"):
        return 0  # not Linux: peers blocked on this worker wait for their op timeout instead
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                try:
                    peer = sock.getpeername()
                except OSError:
                    continue  # listening or not connected
                if peer[1] != keep_port:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def _abort(pg: Any) -> None:
    """Abort a group's communicators where the backend can (NCCL); gloo has nothing to abort."""
    try:
        pg.abort()
    except (AttributeError, RuntimeError, NotImplementedError):
        pass


def elastic_worker(spec: WorkerSpec, store: Any, reporter: Any, inbox: Inbox) -> None:
    ElasticWorker(spec, store, reporter, inbox).run()
