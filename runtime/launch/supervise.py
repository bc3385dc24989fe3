"""Watching a run's workers: one event loop, and a policy that decides what each event means.

The loop (``supervise``) takes events from a source (``LocalWorkers``: this host's report pipes and
process sentinels, waited on at once, so a death is seen the moment it happens) and hands each worker's
message, death and silence (no heartbeat within the limit: a SIGSTOPped or wedged process) to a
``Policy``. ``PlainPolicy`` is ``hspmd train``'s: the first failure stops the run, and after a short
grace for the root cause to report, the failure that explains it best is raised as ``WorkerFailure``.
The elastic coordinator (runtime/elastic/coordinator.py ``ElasticPolicy``) recovers instead. The node
agents' relay (runtime/elastic/agents.py ``AgentWorkers``) is the other source: it yields the same pairs
for workers on other nodes, and a ``Lost`` for each worker of a node whose agent went silent.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from runtime.launch.messages import Exited, Heartbeat, Log, Lost, Start, StepDone, Up, WorkerError
from runtime.launch.options import StepRecord, StepReport, TrainOptions, WorkerSpec
from runtime.launch.session import run_devices
from runtime.launch.worker import WorkerLoop, process_main, train_worker
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext

FAILURE_GRACE_S = 0.5  # after the first failure, how long to wait for its root cause to report
STOP_GRACE_S = 2.0  # how long a stopped worker gets to exit before SIGKILL

# Which report explains a failure best. A worker that raises reports before it exits, so among errors
# the earliest is the cause; a worker that dies or hangs says nothing, and its peers' collectives then
# fail with errors of their own (gloo raises plain RuntimeErrors for a vanished peer), so a silent death
# or hang outranks any error that is not a user error.
PRIORITY = {"user": 0, "died": 1, "hung": 1, "error": 2, "comm": 3}


class WorkerFailure(HspmdError):
    """A worker failed; the run was stopped. ``kind``: user, error, comm, died or hung."""

    def __init__(self, device: int, rank: int, kind: str, lines: tuple[str, ...], traceback: str = "") -> None:
        self.device, self.rank, self.kind = device, rank, kind
        self.messages = lines
        self.traceback = traceback
        super().__init__("; ".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"device {self.device} (rank {self.rank}): {line}" for line in self.messages]

    @property
    def exit_code(self) -> int:
        """2 for a user error (like every other user error of the CLI), 1 for a crash."""
        return 2 if self.kind == "user" else 1


@dataclass
class RunSummary:
    strategy: str
    devices: tuple[int, ...]
    backend: str
    records: list[StepRecord] = field(default_factory=list)
    startup_s: float = 0.0  # launch to the first completed step (process start, imports, groups, step 1)
    wall_s: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)  # failures and switches (runtime/elastic/)


class WorkerLink(Protocol):
    """How the supervisor reaches one worker: its control pipe on this host, or its node's agent."""

    def send(self, msg: object) -> None:
        """Deliver ``msg`` (silently dropped when the worker is gone: its death is reported anyway)."""

    def kill(self) -> None:
        """SIGKILL the worker if it still runs (a hung one: killing it closes its sockets)."""


@dataclass(eq=False)
class WorkerHandle:
    """One worker as the supervisor sees it: how to reach it, and what it has shown of itself."""

    spec: WorkerSpec
    link: WorkerLink
    last_seen: float = field(default_factory=time.monotonic)
    last_seen_wall: float = field(default_factory=time.time)  # for a failure's timeline
    started: bool = False  # told where the store is (before that it holds nothing and may just be killed)
    up: bool = False  # past start-up (imports, store, process group): heartbeats are due from now on
    finished: bool = False
    failed: bool = False
    hung: bool = False

    @property
    def device(self) -> int:
        return self.spec.device_id

    def send(self, msg: object) -> None:
        self.link.send(msg)

    def kill(self) -> None:
        self.link.kill()


@dataclass(eq=False)
class LocalLink:
    """A worker process of this host: its pipes and its process."""

    process: BaseProcess
    report: Connection
    control: Connection

    def send(self, msg: object) -> None:
        with contextlib.suppress(OSError, ValueError):  # it died: its sentinel says so
            self.control.send(msg)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()


class EventSource(Protocol):
    def poll(self, timeout_s: float) -> Iterator[tuple[WorkerHandle, object]]:
        """Each worker's messages that arrive within ``timeout_s`` (fewer seconds once any has), and an
        ``Exited`` (or ``Lost``) in its name once its process has ended (or can no longer be seen)."""

    def start(self, spec: WorkerSpec, loop: WorkerLoop) -> WorkerHandle:
        """A new worker (at start-up, or a device joining a running job); told where the store is."""

    def returned_devices(self) -> list[int]:
        """Devices that became available since the last call (a node's agent said hello again)."""

    def kill_node(self, node: str) -> None:
        """Fault injection: lose node ``node`` whole (raises HspmdError where there are no nodes to lose)."""


class LocalWorkers:
    """This host's worker processes (multiprocessing 'spawn'): the events of their pipes and sentinels.
    ``start_store``: where a worker started later than the others is told the store is (None: the caller
    sends ``Start`` itself, once the store is up)."""

    def __init__(self) -> None:
        self.workers: list[WorkerHandle] = []
        self._by_conn: dict[Any, WorkerHandle] = {}
        self._by_sentinel: dict[Any, WorkerHandle] = {}
        self._links: dict[int, LocalLink] = {}  # id(handle) -> its link
        self.start_store: Start | None = None

    def start(self, spec: WorkerSpec, loop: WorkerLoop) -> WorkerHandle:
        mp = multiprocessing.get_context("spawn")
        report_r, report_w = mp.Pipe(duplex=False)
        control_r, control_w = mp.Pipe(duplex=False)
        proc = mp.Process(target=process_main, args=(spec, loop, report_w, control_r), daemon=True,
                          name=f"hspmd-device{spec.device_id}")
        proc.start()
        report_w.close()
        control_r.close()
        link = LocalLink(proc, report_r, control_w)
        w = WorkerHandle(spec, link)
        self.workers.append(w)
        self._links[id(w)] = link
        self._by_conn[report_r] = w
        self._by_sentinel[proc.sentinel] = w
        if self.start_store is not None:
            w.send(self.start_store)
            w.started = True
        return w

    def link(self, w: WorkerHandle) -> LocalLink:
        return self._links[id(w)]

    def returned_devices(self) -> list[int]:
        return []  # every device of this host is started by the run itself

    def kill_node(self, node: str) -> None:
        raise HspmdError(f"node {node!r} has no agent to kill (node kills need hspmd train --agents N)")

    def poll(self, timeout_s: float) -> Iterator[tuple[WorkerHandle, object]]:
        for obj in wait(list(self._by_conn) + list(self._by_sentinel), timeout=timeout_s):
            if obj in self._by_conn:
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    self._by_conn.pop(obj, None)
                    continue
                yield self._by_conn[obj], msg
            elif obj in self._by_sentinel:
                w = self._by_sentinel.pop(obj)
                link = self.link(w)
                link.process.join(1.0)  # the sentinel fires as the process exits; reaping it may lag
                with contextlib.suppress(EOFError, OSError):
                    while link.report.poll():  # what it said before it ended comes first
                        yield w, link.report.recv()
                self._by_conn.pop(link.report, None)
                yield w, Exited(link.process.exitcode)

    def join(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for w in self.workers:
            self.link(w).process.join(max(0.0, end - time.monotonic()))

    def stop(self) -> None:
        """Stop every worker still running: close its control pipe (it exits at once), then SIGKILL (a
        SIGSTOPped or not yet started one at once)."""
        alive = [w for w in self.workers if self.link(w).process.is_alive()]
        for w in alive:
            if w.hung or not w.started:
                self.link(w).process.kill()
            else:
                self.link(w).control.close()
        end = time.monotonic() + STOP_GRACE_S
        for w in alive:
            self.link(w).process.join(max(0.0, end - time.monotonic()))
        for w in alive:
            proc = self.link(w).process
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for w in self.workers:
            link = self.link(w)
            for conn in (link.report, link.control):
                with contextlib.suppress(OSError):
                    conn.close()


def death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"worker process was killed by {name}"
    return f"worker process exited with status {code} without reporting an error"


class FailureLog:
    """The failures that stop a run, and which of them explains it best (``PRIORITY``, then the earliest),
    raised once ``grace_s`` after the first has passed (its root cause reports within it)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._failures: list[tuple[int, float, WorkerFailure]] = []
        self.deadline: float | None = None

    def __bool__(self) -> bool:
        return bool(self._failures)

    def add(self, w: WorkerHandle, kind: str, lines: tuple[str, ...], tb: str = "") -> None:
        if w.failed:
            return
        w.failed = True
        self._failures.append((PRIORITY[kind], time.monotonic(),
                               WorkerFailure(w.device, w.spec.rank, kind, tuple(lines), tb)))
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s

    def wait_s(self, longest: float) -> float:
        return longest if self.deadline is None else max(0.0, min(longest, self.deadline - time.monotonic()))

    def raise_when_due(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self._failures.sort(key=lambda f: (f[0], f[1]))
            raise self._failures[0][2]


@dataclass
class Run:
    """What a policy is given: the run, its workers by device, and where its results go."""

    options: TrainOptions
    ctx: PlanContext  # the plan the run starts with
    strategy: str
    workers: dict[int, WorkerHandle]
    summary: RunSummary
    on_step: Callable[[StepRecord], None] | None
    log: Callable[[str], None]
    t_start: float
    source: EventSource | None = None  # where a worker joining later is started
    make_spec: Callable[[int], WorkerSpec] | None = None  # a joining device's spec (its world comes later)
    # How long the loss of a worker can take to be seen besides heartbeats (a node agent's silence): errors
    # its peers raise within that window are consequences, not causes.
    loss_detect_s: float = 0.0

    def record(self, record: StepRecord) -> None:
        if not self.summary.records:
            self.summary.startup_s = time.perf_counter() - self.t_start
        self.summary.records.append(record)
        if self.on_step is not None:
            self.on_step(record)


class Policy(Protocol):
    """What a run (one per policy object) makes of its workers' events. The loop itself notes every sign
    of life, ``Up``, ``Log`` and a clean exit, and raises the failure that explains the run best once
    ``failures`` says it is due."""

    worker_loop: WorkerLoop  # what each worker process runs
    failures: FailureLog

    def prepare(self, options: TrainOptions, ctx: PlanContext, strategy: str) -> list[int]:
        """User errors found before any process starts; the devices to start workers on."""

    def begin(self, run: Run) -> None: ...

    def on_message(self, w: WorkerHandle, msg: object) -> None: ...

    def on_failure(self, w: WorkerHandle, kind: str, how: str) -> None:
        """``w`` died (kind "died") or went silent ("hung")."""

    def tick(self) -> bool:
        """After each round of events: whether the run is over."""

    def end(self) -> None:
        """The run is over, finished or failing: what the policy runs in the background has stopped when
        this returns (the process may exit next)."""


def supervise(run: Run, source: EventSource, policy: Policy) -> None:
    """The one event loop of a run: until ``policy.tick()`` says it is over, or a failure stops it."""
    try:
        _loop(run, source, policy)
    finally:
        policy.end()


def _loop(run: Run, source: EventSource, policy: Policy) -> None:
    options = run.options
    while True:
        for w, msg in source.poll(policy.failures.wait_s(options.heartbeat_s)):
            if isinstance(msg, (Exited, Lost)):
                if isinstance(msg, Exited) and msg.code == 0:
                    w.finished = True
                elif not w.finished and not w.failed:
                    policy.on_failure(w, "died", death(msg.code) if isinstance(msg, Exited) else msg.how)
                continue
            w.last_seen, w.last_seen_wall = time.monotonic(), time.time()
            if isinstance(msg, Up):
                w.up = True
            elif isinstance(msg, Log):
                run.log(msg.text)
            elif isinstance(msg, Heartbeat):
                # The process lives, but its GPU may not: stuck in its own work (a wedged GPU, a hung
                # kernel) for as long as a silent process would be, it is hung. A device stalled behind a
                # communication waits for a peer: that peer's failure is the one to find.
                if msg.stalled_at == "compute" and msg.stalled_s > options.heartbeat_timeout_s and w.up \
                        and not w.finished and not w.failed:
                    w.hung = True
                    policy.on_failure(w, "hung", f"its GPU finished no work for {msg.stalled_s:.1f} s "
                                                 "(stuck in a compute block: wedged)")
            else:
                policy.on_message(w, msg)
        now = time.monotonic()
        for d in sorted(run.workers):
            w = run.workers[d]
            # Start-up (a cold torch import on a loaded machine holds the GIL for seconds) gets the
            # generous operation timeout; after it, a silent worker is hung within heartbeat_timeout_s.
            limit = options.heartbeat_timeout_s if w.up else options.timeout_s
            if not w.finished and not w.failed and now - w.last_seen > limit:
                what = "no heartbeat" if w.up else "no sign of start-up"
                w.hung = True
                policy.on_failure(w, "hung", f"{what} for {now - w.last_seen:.1f} s (process stopped or wedged)")
        over = policy.tick()
        policy.failures.raise_when_due()
        if over:
            return


class PlainPolicy:
    """``hspmd train`` without --elastic or --switch: aggregate the steps; the first failure stops the run."""

    worker_loop = staticmethod(train_worker)

    def __init__(self) -> None:
        self.failures = FailureLog(FAILURE_GRACE_S)
        self.pending: dict[int, list[StepReport]] = {}

    def prepare(self, options: TrainOptions, ctx: PlanContext, strategy: str) -> list[int]:
        if options.coordinated:
            raise ValueError("elastic and switching runs are supervised by runtime.elastic.ElasticPolicy")
        return run_devices(ctx, options)  # a documents run's every strategy (runtime/launch/session.py)

    def begin(self, run: Run) -> None:
        self.run = run

    def on_message(self, w: WorkerHandle, msg: object) -> None:
        if isinstance(msg, StepDone):
            got = self.pending.setdefault(msg.report.step, [])
            got.append(msg.report)
            if len(got) == len(self.run.workers):
                self.run.record(StepRecord.combine(self.pending.pop(msg.report.step), self.run.strategy))
        elif isinstance(msg, WorkerError):
            self.failures.add(w, msg.kind, msg.lines, msg.traceback)

    def on_failure(self, w: WorkerHandle, kind: str, how: str) -> None:
        self.failures.add(w, kind, (how,))

    def tick(self) -> bool:
        return all(w.finished for w in self.run.workers.values())

    def end(self) -> None:
        pass   # nothing runs in the background
