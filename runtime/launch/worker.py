"""The worker process: one per device; its plain training loop, and its pipes to the launcher.

``train_worker`` runs under both launchers: under ``hspmd train`` its words travel over a pipe to the
launcher, which starts and stops it through a control pipe; under torchrun rank 0 reports to its own
console. ``process_main`` runs the loop the launcher's policy names (this one, or the elastic loop of
runtime/elastic/worker.py), so this module never needs to know the elastic one. Torch is imported inside
functions: the launcher imports this module before its workers start and must not pay for torch.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from runtime.device_clock import Progress, device_clock
from runtime.launch.messages import Heartbeat, Log, Start, StepDone, Up, WorkerError
from runtime.launch.options import WorkerSpec
from runtime.launch.session import Reporter, Session, document_steps, documents_step
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.handle import StrategyHandle


def train_worker(spec: WorkerSpec, store: Any, report: Reporter, inbox: Inbox | None = None,
                 progress: Progress | None = None) -> None:
    """Join the world through ``store``, build this device's program, run the steps, save, trace.
    (``inbox``: the launcher's other words, a plain run has none; ``progress``: where the program marks
    the device's progress for the heartbeat.)"""
    session = Session(spec, store, report, progress)
    session.join(spec.store_prefix, spec.ranks)
    report(Up())
    try:
        if session.documents:
            steps = document_steps(session)
            done = 0
            if spec.options.load_dir is not None:
                done = steps.load(spec.options.load_dir)
                if session.rank == 0:
                    report(Log(f"loaded {spec.options.load_dir} (step {done})"))
                    if steps.note is not None:
                        report(Log(steps.note))
            last = done + spec.options.steps
            for step in range(done + 1, last + 1):
                session.fire_fault(step)
                report(StepDone(documents_step(session, steps, step)))
                if session.periodic_save_due(step, last):
                    session.save_documents(steps, step, background=spec.options.save_in_background)
            session.finish(None, steps.current_handle, last,
                           save=lambda n: session.save_documents(steps, n, background=False))
            return
        handle = StrategyHandle.of(session.ctx, spec.strategy)
        program = session.build(handle)
        done = session.load(program)
        last = done + spec.options.steps
        for step in range(done + 1, last + 1):
            session.fire_fault(step)
            report(StepDone(session.step(program, step)))
            if session.periodic_save_due(step, last):
                session.save(program, handle, step, background=spec.options.save_in_background)
        session.finish(program, handle, last)
    finally:
        session.leave()


# What a worker runs once it has the store: (spec, store, report, inbox, progress).
WorkerLoop = Callable[[WorkerSpec, Any, Reporter, "Inbox", Progress], None]


# ----------------------------------------------------------------------------------------------------
# Under the hspmd launcher: pipes to the launcher


def classify(exc: BaseException) -> WorkerError:
    tb = "".join(traceback.format_exception(exc))
    if isinstance(exc, HspmdError):
        return WorkerError("user", tuple(exc.lines()), tb)
    kind = "error"
    with contextlib.suppress(ImportError):  # torch failed to import: what the worker raised says why
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            kind = "comm"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return WorkerError(kind, (f"{type(exc).__name__}: {first}" if first else type(exc).__name__,), tb)


def _pipe(conn: Connection) -> Reporter:
    """Words to the launcher, from the training loop and the heartbeat thread alike (hence the lock)."""
    lock = threading.Lock()

    def send(msg: object) -> None:
        with lock:
            conn.send(msg)

    return send


class Inbox(queue.Queue):
    """The launcher's words, in order (filled by the control-pipe thread).

    ``first``: a word's handler run on the control-pipe thread as the word arrives, before the training
    loop can read it: the one thread free to act while the loop is blocked (an elastic worker aborts its
    world there when the launcher says the world is over)."""

    def __init__(self) -> None:
        super().__init__()
        self._first: Callable[[object], None] | None = None

    def first(self, handler: Callable[[object], None] | None) -> None:
        self._first = handler

    def deliver(self, msg: object) -> None:
        if self._first is not None:
            self._first(msg)
        self.put(msg)

    def next(self, timeout_s: float) -> object:
        try:
            return self.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no word from the launcher for {timeout_s:g} s") from None

    def holds(self, wanted: Callable[[object], bool]) -> bool:
        """Whether a word not yet read is ``wanted`` (it stays for ``next``): a worker blocked outside its
        loop (forming a world) looks for an abort without taking the words in between."""
        with self.mutex:
            return any(wanted(m) for m in self.queue)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _watch_launcher(control: Connection, inbox: Inbox) -> None:
    """Exit at once when the launcher closes the control pipe or goes away: a worker blocked in a collective
    whose peer died must not outlive the run (the blocking C++ call releases the GIL, so this thread runs).
    Every word (elastic and switching runs) goes to ``inbox`` for the training loop."""
    try:
        while True:
            inbox.deliver(control.recv())
    except (EOFError, OSError):
        _exit_now(1)


def _heartbeat(report: Reporter, every_s: float, progress: Progress) -> None:
    while True:
        time.sleep(every_s)
        try:
            report(Heartbeat(*progress.stall()))
        except (OSError, ValueError):
            _exit_now(1)


def process_main(spec: WorkerSpec, loop: WorkerLoop, report_conn: Connection, control_conn: Connection) -> None:
    """Entry point of a worker process started by the launcher (multiprocessing 'spawn')."""
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpus)  # first: threads started from now on inherit it
    report = _pipe(report_conn)
    progress = Progress(device_clock(spec.torch_device))  # the device's, from the heartbeat thread's view
    threading.Thread(target=_heartbeat, args=(report, spec.options.heartbeat_s, progress), daemon=True).start()
    try:
        import torch.distributed as dist  # the slow import, overlapping the launcher's store start-up

        msg = control_conn.recv()
        if not isinstance(msg, Start):
            _exit_now(1)
        inbox = Inbox()
        threading.Thread(target=_watch_launcher, args=(control_conn, inbox), daemon=True).start()
        store = dist.TCPStore(msg.host, msg.port, is_master=False,
                              timeout=timedelta(seconds=spec.options.timeout_s))
        loop(spec, store, report, inbox, progress)
    except (EOFError, KeyboardInterrupt):
        _exit_now(1)
    except BaseException as exc:  # noqa: BLE001 - everything a worker raises goes to the launcher
        info = classify(exc)
        try:
            report(info)
        finally:
            _exit_now(2 if info.kind == "user" else 1)
    # Everything is written and the process group is gone: status 0 tells the launcher so. Interpreter
    # teardown is skipped (seconds of torch finalisation under load): the launcher returns at once.
    _exit_now(0)
