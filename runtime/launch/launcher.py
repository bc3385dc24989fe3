"""``hspmd train``'s launcher: hosts the TCPStore, starts one worker per device, watches them all.

The launcher owns the store (workers are clients under a per-generation PrefixStore), so a later
failure-recovery step can start a new generation of process groups without the store dying with a
worker. It waits on every worker's report pipe and process sentinel at once: a death is seen the
moment it happens, a hang (SIGSTOP, a wedged process) when its heartbeat stops. On the first failure
it stops every worker (a peer blocked in a collective is told to exit through its control pipe, and
killed if it has not) and raises ``WorkerFailure`` naming the device and its error.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from runtime.errors import HspmdError, SpecError
from runtime.launch.options import StepRecord, StepReport, TrainOptions, WorkerSpec, rank_map
from runtime.launch.worker import ErrorInfo, process_main
from runtime.profiling.host import emulated_cpu_shares, host_cpus
from runtime.spec import PlanContext, Strategy, load_plan_context
from runtime.spec.catalog import train_problems

STORE_HOST = "127.0.0.1"
FAILURE_GRACE_S = 0.5  # after the first failure, how long to wait for its root cause to report
STOP_GRACE_S = 2.0  # how long a stopped worker gets to exit before SIGKILL


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


# Which report explains a failure best. A worker that raises reports before it exits, so among errors
# the earliest is the cause; a worker that dies or hangs says nothing, and its peers' collectives then
# fail with errors of their own (gloo raises plain RuntimeErrors for a vanished peer), so a silent death
# or hang outranks any error that is not a user error.
_PRIORITY = {"user": 0, "died": 1, "hung": 1, "error": 2, "comm": 3}


@dataclass
class RunSummary:
    strategy: str
    devices: tuple[int, ...]
    backend: str
    records: list[StepRecord] = field(default_factory=list)
    startup_s: float = 0.0  # launch to the first completed step (process start, imports, groups, step 1)
    wall_s: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)  # failures and switches (runtime/elastic/)


@dataclass
class _Worker:
    spec: WorkerSpec
    process: BaseProcess
    report: Connection
    control: Connection
    last_seen: float
    started: bool = False  # told where the store is (before that it holds nothing and may just be killed)
    up: bool = False  # past start-up (imports, store, process group): heartbeats are due from now on
    finished: bool = False
    failed: bool = False
    hung: bool = False


def select_strategy(ctx: PlanContext, name: str | None) -> Strategy:
    """The named strategy (or the plan's first); an unknown name is a user error naming the plan file."""
    if name is None:
        return ctx.plan.strategies[0]
    for s in ctx.plan.strategies:
        if s.name == name:
            return s
    raise HspmdError(f"{ctx.path}: --strategy: no strategy named {name!r} "
                     f"(the plan has: {', '.join(s.name for s in ctx.plan.strategies)})")


def placement(ctx: PlanContext, devices: list[int]) -> tuple[str, dict[int, str]]:
    """Backend and torch device of every worker: gloo on CPU for emulated clusters, else NCCL with
    device d on cuda:<its index on its node>."""
    if ctx.cluster.emulated:
        return "gloo", {d: "cpu" for d in devices}
    nodes = sorted({ctx.cluster.device(d).node for d in devices})
    if len(nodes) > 1:
        raise HspmdError(f"{ctx.path}: the strategy spans nodes {', '.join(nodes)}: `hspmd train` starts "
                         "workers on this machine only; run `torchrun ... -m hetu_cli train --plan PLAN` on "
                         "every node (README, 'Training')")
    import torch

    need = max(ctx.cluster.device(d).local_index for d in devices) + 1
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        raise HspmdError(f"{ctx.path}: cluster {ctx.cluster.name!r} has real GPUs and the strategy needs "
                         f"{need} on this node, but {have} CUDA device(s) are visible (emulated clusters such "
                         "as cpu-hetero4 run on CPU)")
    return "nccl", {d: f"cuda:{ctx.cluster.device(d).local_index}" for d in devices}


def _preflight(options: TrainOptions, ctx: PlanContext) -> None:
    """User errors that would otherwise surface in every worker at once (cheap: no torch import)."""
    from runtime.data import token_source

    t = ctx.plan.training
    refused = train_problems(ctx)
    if refused:
        raise SpecError(refused)
    token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len, seed=t.seed,
                 data_file=options.data_file)
    if options.load_dir is not None:
        from runtime.checkpoint import read_checkpoint_info

        read_checkpoint_info(options.load_dir, ctx)
    if options.save_dir is not None and options.save_dir.exists() and not options.save_dir.is_dir():
        raise HspmdError(f"{options.save_dir}: --save: exists and is not a directory")


def launch(options: TrainOptions, *, on_step: Callable[[StepRecord], None] | None = None,
           on_log: Callable[[str], None] | None = None, on_event: Callable[[dict[str, Any]], None] | None = None,
           replan: Callable[..., Any] | None = None) -> RunSummary:
    """Run ``options`` on this machine; return the per-step records or raise WorkerFailure.

    Elastic and switching runs (``options.elastic``, ``options.switches``) are coordinated by
    runtime/elastic/: ``on_event`` gets one dict per failure or switch, ``replan(failed, plan context,
    strategy) -> plan context`` gives the plan for the survivors of a failure (runtime.elastic.Replanner);
    such a run may also raise runtime.elastic.UnrecoverableFailure.
    """
    t_start = time.perf_counter()
    log = on_log or (lambda _msg: None)
    ctx = load_plan_context(options.plan)
    strategy = select_strategy(ctx, options.strategy)
    devices = sorted(strategy.devices)
    switches: dict[int, Any] = {}
    first_step = 1
    if options.coordinated:
        from runtime.elastic.coordinator import prepare

        if options.load_dir is not None:
            from runtime.checkpoint import read_checkpoint_info

            first_step = read_checkpoint_info(options.load_dir, ctx).step + 1
        switches, devices = prepare(options, ctx, strategy.name, first_step)
    stray = sorted({f.device for f in options.faults} - set(devices))
    if stray:
        raise HspmdError(f"fault injection: device(s) {stray} run no worker in this run (devices "
                         f"{', '.join(map(str, devices))})")
    ranks = rank_map(devices)
    backend, torch_devices = placement(ctx, devices)
    threads, cpus = (emulated_cpu_shares(devices, ctx.cluster.num_devices, host_cpus()) if backend == "gloo"
                     else (None, {}))
    _preflight(options, ctx)
    mp = multiprocessing.get_context("spawn")
    workers: list[_Worker] = []
    store = None
    try:
        for d in devices:
            spec = WorkerSpec(options=options, strategy=strategy.name, device_id=d, rank=ranks[d], ranks=ranks,
                              backend=backend, torch_device=torch_devices[d], num_threads=threads,
                              cpus=cpus.get(d))
            report_r, report_w = mp.Pipe(duplex=False)
            control_r, control_w = mp.Pipe(duplex=False)
            proc = mp.Process(target=process_main, args=(spec, report_w, control_r), daemon=True,
                              name=f"hspmd-device{d}")
            proc.start()
            report_w.close()
            control_r.close()
            workers.append(_Worker(spec, proc, report_r, control_w, time.monotonic()))
        # Workers are importing torch now; the launcher's own import overlaps with theirs.
        store = _host_store(options.timeout_s)
        for w in workers:
            w.control.send(("start", STORE_HOST, store.port))
            w.started = True
        log(f"started {len(workers)} workers ({backend}, strategy {strategy.name!r}, devices "
            f"{', '.join(map(str, devices))})")
        summary = RunSummary(strategy.name, tuple(devices), backend)
        if options.coordinated:
            from runtime.elastic.coordinator import Coordinator
            from runtime.spec.handle import StrategyHandle

            Coordinator(workers, options, StrategyHandle(ctx, strategy), first_step, switches, replan, summary,
                        on_step, on_event, log, t_start).run()
        else:
            _monitor(workers, options, strategy.name, summary, on_step, log, t_start)
        for w in workers:
            w.process.join(options.timeout_s)
        summary.wall_s = time.perf_counter() - t_start
        return summary
    finally:
        _stop(workers)
        del store


def _host_store(timeout_s: float) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(STORE_HOST, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _monitor(workers: list[_Worker], options: TrainOptions, strategy: str, summary: RunSummary,
             on_step: Callable[[StepRecord], None] | None, log: Callable[[str], None], t_start: float) -> None:
    by_conn = {w.report: w for w in workers}
    by_sentinel = {w.process.sentinel: w for w in workers}
    pending: dict[int, list[StepReport]] = {}
    failures: list[tuple[int, float, WorkerFailure]] = []
    deadline: float | None = None

    def fail(w: _Worker, kind: str, lines: tuple[str, ...], tb: str = "") -> None:
        nonlocal deadline
        if w.failed:
            return
        w.failed = True
        failures.append((_PRIORITY[kind], time.monotonic(),
                         WorkerFailure(w.spec.device_id, w.spec.rank, kind, lines, tb)))
        if deadline is None:
            deadline = time.monotonic() + FAILURE_GRACE_S

    def handle(w: _Worker, msg: tuple) -> None:
        w.last_seen = time.monotonic()
        what = msg[0]
        if what == "step":
            report: StepReport = msg[2]
            got = pending.setdefault(report.step, [])
            got.append(report)
            if len(got) == len(workers):
                record = StepRecord.combine(pending.pop(report.step), strategy)
                if not summary.records:
                    summary.startup_s = time.perf_counter() - t_start
                summary.records.append(record)
                if on_step is not None:
                    on_step(record)
        elif what == "up":
            w.up = True
        elif what == "log":
            log(msg[2])
        elif what == "error":
            info: ErrorInfo = msg[2]
            fail(w, info.kind, info.lines, info.traceback)
        elif what == "done":
            w.finished = True

    def drain(w: _Worker) -> None:
        try:
            while w.report.poll():
                handle(w, w.report.recv())
        except (EOFError, OSError):
            pass
        by_conn.pop(w.report, None)

    while not all(w.finished for w in workers):
        now = time.monotonic()
        wait_s = options.heartbeat_s if deadline is None else max(0.0, deadline - now)
        for obj in wait(list(by_conn) + list(by_sentinel), timeout=wait_s):
            if obj in by_conn:
                w = by_conn[obj]
                try:
                    handle(w, obj.recv())
                except (EOFError, OSError):
                    by_conn.pop(obj, None)
            else:
                w = by_sentinel.pop(obj)
                w.process.join(1.0)  # the sentinel fires as the process exits; reaping it may lag
                drain(w)
                if not w.finished and not w.failed:
                    fail(w, "died", (_death(w.process.exitcode),))
        now = time.monotonic()
        for w in workers:
            # Start-up (a cold torch import on a loaded machine holds the GIL for seconds) gets the
            # generous operation timeout; after it, a silent worker is hung within heartbeat_timeout_s.
            limit = options.heartbeat_timeout_s if w.up else options.timeout_s
            if not w.finished and not w.failed and now - w.last_seen > limit:
                what = "no heartbeat" if w.up else "no sign of start-up"
                w.hung = True
                fail(w, "hung", (f"{what} for {now - w.last_seen:.1f} s (process stopped or wedged)",))
        if deadline is not None and time.monotonic() >= deadline:
            failures.sort(key=lambda f: (f[0], f[1]))
            raise failures[0][2]


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"worker process was killed by {name}"
    return f"worker process exited with status {code} without reporting an error"


def _stop(workers: list[_Worker]) -> None:
    """Stop every worker still running: ask through the control pipe, then SIGKILL (a SIGSTOPped or
    not yet started one at once)."""
    alive = [w for w in workers if w.process.is_alive()]
    for w in alive:
        if w.hung or not w.started:
            w.process.kill()
            continue
        try:
            w.control.send(("stop",))
        except (OSError, ValueError):
            pass
    end = time.monotonic() + STOP_GRACE_S
    for w in alive:
        w.process.join(max(0.0, end - time.monotonic()))
    for w in alive:
        if w.process.is_alive():
            w.process.kill()
            w.process.join(5.0)
    for w in workers:
        for conn in (w.report, w.control):
            try:
                conn.close()
            except OSError:
                pass
