"""The worker: one process per device, running that device's specialized program step by step.

``train_worker`` is the same under both launchers; only where the store comes from and where reports go
differ. Under ``hspmd train`` (runtime.launch.launcher) reports, heartbeats and errors travel over a pipe
to the launcher, and a control pipe lets the launcher start and stop the worker; under torchrun
(runtime.launch.torchrun) rank 0 reports to its own console.

Imports of torch and the engine happen inside functions: the launcher imports this module to name the
process entry point and must not pay for torch before its workers are started.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from runtime.errors import HspmdError
from runtime.launch.options import Fault, StepReport, WorkerSpec

TRACE_MERGED = "trace.json"


def trace_file(trace_dir: Path, device: int) -> Path:
    return trace_dir / f"device{device}.json"


class Reporter(Protocol):
    def up(self) -> None:
        """Start-up is over (the process group exists): from now on the worker is expected to be lively."""
        ...

    def step(self, report: StepReport) -> None: ...

    def log(self, message: str) -> None: ...


class NullReporter:
    def up(self) -> None:
        pass

    def step(self, report: StepReport) -> None:
        pass

    def log(self, message: str) -> None:
        pass


# ----------------------------------------------------------------------------------------------------
# The training loop (both launchers)


def train_worker(spec: WorkerSpec, store: Any, reporter: Reporter) -> None:
    """Join the world through ``store``, build this device's program, run the steps, save, trace."""
    import torch
    import torch.distributed as dist

    from runtime.comm.groups import ProcessGroups
    from runtime.data import token_source
    from runtime.spec import load_plan_context

    options = spec.options
    plan_ctx = load_plan_context(options.plan)
    training = plan_ctx.plan.training
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.torch_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = token_source(vocab_size=plan_ctx.model.vocab_size, global_batch=training.global_batch,
                          seq_len=training.seq_len, seed=training.seed, data_file=options.data_file)
    timeout = timedelta(seconds=options.timeout_s)
    dist.init_process_group(spec.backend, store=dist.PrefixStore(spec.store_prefix, store), rank=spec.rank,
                            world_size=spec.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    reporter.up()
    try:
        from runtime.engine import DeviceProgram, WorkerContext

        groups = ProcessGroups(DeviceProgram.required_groups(plan_ctx, spec.strategy), spec.ranks, timeout=timeout)
        hooks, recorder, emulator = _hooks(spec, plan_ctx, device)
        if emulator is not None:
            reporter.log(f"device {spec.device_id}: emulating a {emulator.slowdown:g}x slower device "
                         f"(sleeps {emulator.slowdown - 1:g}x each measured compute block)")
        ctx = WorkerContext(plan=plan_ctx, strategy=spec.strategy, device_id=spec.device_id,
                            ranks=dict(spec.ranks), torch_device=device, timeout=timeout,
                            precision=options.precision)
        program = DeviceProgram(ctx, groups, hooks)
        done = 0
        if options.load_dir is not None:
            from runtime.checkpoint import load_checkpoint

            done = load_checkpoint(program, options.load_dir, plan_ctx)
            if spec.is_reporter:
                reporter.log(f"loaded {options.load_dir} (step {done})")
        faults = {f.step: f for f in options.faults if f.device == spec.device_id}
        for step in range(done + 1, done + options.steps + 1):
            if step in faults:
                _inject(faults[step])
            batch = source.batch(step)
            with recorder.span("step", f"step {step}") if recorder is not None else nullcontext():
                t0 = time.perf_counter()
                stats = program.train_step(batch)
                wall = time.perf_counter() - t0
            reporter.step(StepReport(
                step=step, rank=spec.rank, device=spec.device_id, loss=float(stats.loss),
                grad_norm=float(stats.grad_norm), tokens=int(stats.tokens), wall_s=wall,
                compute_s=float(stats.compute_s), comm_s=float(stats.comm_s),
                emulation_s=emulator.take_emulated_s() if emulator is not None else 0.0))
        if options.save_dir is not None:
            from runtime.checkpoint import save_checkpoint

            save_checkpoint(program, groups, options.save_dir, plan=plan_ctx, strategy=spec.strategy,
                            step=done + options.steps)
            if spec.is_reporter:
                reporter.log(f"saved {options.save_dir} (step {done + options.steps})")
        if recorder is not None:
            assert options.trace_dir is not None
            recorder.write(trace_file(options.trace_dir, spec.device_id))
        dist.barrier()
        if recorder is not None and spec.is_reporter:
            _merge_traces(options.trace_dir, sorted(spec.ranks))
        groups.destroy()
    finally:
        dist.destroy_process_group()


def _hooks(spec: WorkerSpec, plan_ctx: Any, device: Any) -> tuple[Any, Any, Any]:
    from runtime.engine import NULL_HOOKS
    from runtime.trace import EmulatedSlowdown, TraceRecorder

    options = spec.options
    dev_type = plan_ctx.cluster.type_of(spec.device_id)
    emulate = dev_type.emulate is not None and dev_type.emulate.slowdown > 1.0 and device.type == "cpu"
    recorder = None
    if options.trace_dir is not None:
        import torch

        label = f"device {spec.device_id} ({plan_ctx.cluster.device(spec.device_id).type}"
        label += f", emulated {dev_type.emulate.slowdown:g}x slower)" if emulate else ")"
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        recorder = TraceRecorder(spec.device_id, label, sync=sync)
    emulator = EmulatedSlowdown(dev_type.emulate.slowdown, inner=recorder) if emulate else None
    return emulator or recorder or NULL_HOOKS, recorder, emulator


def _merge_traces(trace_dir: Path | None, devices: list[int]) -> None:
    from runtime.trace import merge_chrome_traces

    assert trace_dir is not None
    # Under a multi-node torchrun the directory may not be shared: merge what this node can see.
    paths = [trace_file(trace_dir, d) for d in devices if trace_file(trace_dir, d).is_file()]
    merge_chrome_traces(paths, trace_dir / TRACE_MERGED)


def _inject(fault: Fault) -> None:
    if fault.kind == "error":
        raise RuntimeError(f"injected fault on device {fault.device} at step {fault.step}")
    if fault.kind == "user-error":
        raise HspmdError(f"injected user error on device {fault.device} at step {fault.step}")
    if fault.kind == "exit":
        os._exit(3)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)


# ----------------------------------------------------------------------------------------------------
# Under the hspmd launcher: pipes to the launcher


@dataclass(frozen=True)
class ErrorInfo:
    """How a worker failed: ``kind`` is "user" (HspmdError), "comm" (a collective or the store failed,
    usually because a peer died first) or "error" (anything else: a bug)."""

    kind: str
    lines: tuple[str, ...]
    traceback: str


def classify(exc: BaseException) -> ErrorInfo:
    tb = "".join(traceback.format_exception(exc))
    if isinstance(exc, HspmdError):
        return ErrorInfo("user", tuple(exc.lines()), tb)
    kind = "error"
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            kind = "comm"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return ErrorInfo(kind, (f"{type(exc).__name__}: {first}" if first else type(exc).__name__,), tb)


class PipeReporter:
    """Sends reports, logs, heartbeats and the final word to the launcher (thread-safe)."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self._lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        with self._lock:
            self.conn.send((msg[0], self.rank, *msg[1:]))

    def up(self) -> None:
        self.send("up")

    def step(self, report: StepReport) -> None:
        self.send("step", report)

    def log(self, message: str) -> None:
        self.send("log", message)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _watch_launcher(control: Connection, inbox: Any = None) -> None:
    """Exit at once when the launcher says stop or goes away: a worker blocked in a collective whose
    peer died must not outlive the run (the blocking C++ call releases the GIL, so this thread runs).
    Any other word (elastic and switching runs) goes to ``inbox`` for the training loop."""
    try:
        while True:
            msg = control.recv()
            if msg[0] == "stop":
                _exit_now(1)
            if inbox is not None:
                inbox.put(msg)
    except (EOFError, OSError):
        _exit_now(1)


def _heartbeat(reporter: PipeReporter, every_s: float) -> None:
    while True:
        time.sleep(every_s)
        try:
            reporter.send("hb")
        except (OSError, ValueError):
            _exit_now(1)


def process_main(spec: WorkerSpec, report_conn: Connection, control_conn: Connection) -> None:
    """Entry point of a worker process started by the launcher (multiprocessing 'spawn')."""
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpus)  # first: threads started from now on inherit it
    reporter = PipeReporter(report_conn, spec.rank)
    threading.Thread(target=_heartbeat, args=(reporter, spec.options.heartbeat_s), daemon=True).start()
    try:
        import torch.distributed as dist  # the slow import, overlapping the launcher's store start-up

        msg = control_conn.recv()
        if msg[0] != "start":
            _exit_now(1)
        _, host, port = msg
        inbox = None
        if spec.options.coordinated:
            from runtime.elastic.worker import Inbox

            inbox = Inbox()
        threading.Thread(target=_watch_launcher, args=(control_conn, inbox), daemon=True).start()
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=spec.options.timeout_s))
        if inbox is not None:
            from runtime.elastic.worker import elastic_worker

            elastic_worker(spec, store, reporter, inbox)
        else:
            train_worker(spec, store, reporter)
        reporter.send("done")
    except (EOFError, KeyboardInterrupt):
        _exit_now(1)
    except BaseException as exc:  # noqa: BLE001 - everything a worker raises goes to the launcher
        info = classify(exc)
        try:
            reporter.send("error", info)
        finally:
            _exit_now(2 if info.kind == "user" else 1)
    # Everything is written and the process group is gone; skip interpreter teardown (seconds of torch
    # finalisation under load) so that the launcher returns as soon as the work is done.
    _exit_now(0)
