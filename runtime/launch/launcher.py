"""``hspmd train``'s launcher: hosts the TCPStore, starts one worker per device, supervises them.

The launcher owns the store (workers are clients under a per-generation PrefixStore), so a failure
recovery can start a new generation of process groups without the store dying with a worker. Its
policy (runtime/launch/supervise.py) decides which devices get a worker, what each runs and what a
failure means.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.launch.messages import Start
from runtime.launch.options import StepRecord, TrainOptions, WorkerSpec, rank_map
from runtime.launch.placement import CudaGpus, GpuProbe, pin_gpu_order
from runtime.launch.session import (
    document_source_of,
    documents_line,
    documents_mode,
    documents_problems,
    read_dispatch_state,
    run_strategies,
    sleep_mode_problem,
)
from runtime.launch.supervise import LocalWorkers, PlainPolicy, Policy, Run, RunSummary, supervise
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext, load_plan_context
from runtime.torchfree.spec.catalog import check_trainable

STORE_HOST = "127.0.0.1"


def placement(ctx: PlanContext, devices: list[int], *, one_host: bool = True,
              gpus: GpuProbe = CudaGpus()) -> tuple[str, dict[int, str]]:
    """Backend and torch device of every worker: gloo on CPU for emulated clusters, else NCCL with
    device d on cuda:<its index on its node> (checked here only when this host runs them all)."""
    if ctx.cluster.emulated:
        return "gloo", dict.fromkeys(devices, "cpu")
    if not one_host:
        return "nccl", {d: f"cuda:{ctx.cluster.device(d).local_index}" for d in devices}
    nodes = sorted({ctx.cluster.device(d).node for d in devices})
    if len(nodes) > 1:
        raise HspmdError(f"{ctx.path}: the strategy spans nodes {', '.join(nodes)}: `hspmd train` starts "
                         "workers on this machine only; run `torchrun ... -m hetu_cli train --plan PLAN` on "
                         "every node (docs/training.md, 'Multi-node')")
    pin_gpu_order()  # the workers inherit it: GPU indices in PCI order, as the cluster file counts them
    need = max(ctx.cluster.device(d).local_index for d in devices) + 1
    have = gpus.count()
    if have < need:
        raise HspmdError(f"{ctx.path}: cluster {ctx.cluster.name!r} has real GPUs and the strategy needs "
                         f"{need} on this node, but {have} CUDA device(s) are visible (emulated clusters such "
                         "as cpu-hetero4 run on CPU)")
    return "nccl", {d: f"cuda:{ctx.cluster.device(d).local_index}" for d in devices}


def _preflight(options: TrainOptions, ctx: PlanContext) -> str | None:
    """User errors that would otherwise surface in every worker at once (cheap: no torch import); for a
    documents run the line that says what its data is."""
    from runtime.data import token_source

    t = ctx.plan.training
    check_trainable(ctx)
    line = None
    if documents_mode(options, t):
        problems = documents_problems(ctx, options)
        if problems:
            raise HspmdError(problems[0])
        line = documents_line(document_source_of(ctx, options))  # bad input refused before any worker starts
        if options.load_dir is not None:
            read_dispatch_state(options.load_dir)
    else:
        source = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len,
                              seed=t.seed, data_file=options.data_file)
        from runtime.epochs import ShardWindows

        if isinstance(source, ShardWindows):   # windows of a prepared directory: say what they are
            line = source.describe()
    # Both checked in documents runs too, which skipped them: a bad --load or --save surfaced in the workers.
    from runtime.checkpoint import check_load_and_save

    check_load_and_save(ctx, options.load_dir, options.save_dir)
    return line


@dataclass(frozen=True)
class Prepared:
    """A run checked and placed, before any process starts: what every launcher (this one, the node
    agents' coordinator) needs to start its workers."""

    ctx: PlanContext
    strategy: str
    devices: tuple[int, ...]
    backend: str
    torch_devices: dict[int, str]  # every cluster device the run may use (a device joining later too)
    threads: int | None
    cpus: dict[int, tuple[int, ...]]
    data_line: str | None = None  # a documents run: what its data is (logged at the start)

    def spec(self, options: TrainOptions, device: int, *, joining: bool = False) -> WorkerSpec:
        """Device ``device``'s worker; ``joining``: it joins a running job (its world comes later)."""
        ranks = rank_map(self.devices)
        return WorkerSpec(options=options, strategy=self.strategy, device_id=device,
                          rank=ranks.get(device, -1), ranks=ranks, backend=self.backend,
                          torch_device=self.torch_devices[device], num_threads=self.threads,
                          cpus=self.cpus.get(device), joining=joining)


def prepare(options: TrainOptions, policy: Policy, *, one_host: bool = True) -> Prepared:
    """Load the plan, ask the policy which devices run, refuse bad requests (no process started yet).
    ``one_host``: this launcher starts every worker (a strategy spanning nodes is refused)."""
    ctx = load_plan_context(options.plan, options.cluster, options.model)
    strategy = ctx.strategy(options.strategy)
    devices = policy.prepare(options, ctx, strategy.name)
    n = ctx.cluster.num_devices
    outside = sorted({r.device for r in options.rejoins if not 0 <= r.device < n})
    if outside:
        raise HspmdError(f"--rejoin-device: device(s) {outside} are not in cluster {ctx.cluster.name!r} "
                         f"(devices 0-{n - 1})")
    stray = sorted({f.device for f in options.faults} - set(devices) - {r.device for r in options.rejoins})
    if stray:
        raise HspmdError(f"fault injection: device(s) {stray} run no worker in this run (devices "
                         f"{', '.join(map(str, devices))})")
    missing = sleep_mode_problem(ctx, options)
    if missing is not None:
        raise HspmdError(missing)
    everyone = list(range(ctx.cluster.num_devices))
    backend, _ = placement(ctx, devices, one_host=one_host, gpus=options.gpus)  # refuses what this host cannot run
    _, torch_devices = placement(ctx, everyone, one_host=False)  # a device joining later included
    share = options.worker_cpus
    if backend == "gloo" and share is not None:   # cores chosen by the caller (the emulated cluster's harness)
        threads, cpus = share.threads, dict(share.cpus)
    else:  # the workers on one machine share its cores, rather than each taking all of them
        local = len(devices) if one_host else max(Counter(ctx.cluster.device(d).node for d in devices).values(),
                                                   default=1)
        threads, cpus = max(1, (os.cpu_count() or 1) // local), {}
    data_line = _preflight(options, ctx)
    return Prepared(ctx, strategy.name, tuple(devices), backend, torch_devices, threads, cpus, data_line)


def launch(options: TrainOptions, policy: Policy | None = None, *,
           on_step: Callable[[StepRecord], None] | None = None,
           on_log: Callable[[str], None] | None = None) -> RunSummary:
    """Run ``options`` on this machine under ``policy`` (default ``PlainPolicy``); return the per-step
    records or raise WorkerFailure (an elastic run may also raise runtime.elastic.UnrecoverableFailure)."""
    t_start = time.perf_counter()
    log = on_log or (lambda _msg: None)
    policy = policy or PlainPolicy()
    prep = prepare(options, policy)
    if prep.data_line is not None:
        log(prep.data_line)
    local = LocalWorkers()
    store = None
    try:
        for d in prep.devices:
            local.start(prep.spec(options, d), policy.worker_loop)
        # Workers are importing torch now; the launcher's own import overlaps with theirs.
        store = host_store(STORE_HOST, 0, options.timeout_s)
        local.start_store = Start(STORE_HOST, store.port)
        for w in local.workers:
            w.send(local.start_store)
            w.started = True
        t = prep.ctx.plan.training
        names = run_strategies(prep.ctx, options) if documents_mode(options, t) else (prep.strategy,)
        which = f"strategy {names[0]!r}" if len(names) == 1 else f"strategies {', '.join(map(repr, names))}"
        log(f"started {len(prep.devices)} workers ({prep.backend}, {which}, devices "
            f"{', '.join(map(str, prep.devices))})")
        run = Run(options, prep.ctx, prep.strategy, {w.device: w for w in local.workers},
                  RunSummary(prep.strategy, prep.devices, prep.backend), on_step, log, t_start,
                  source=local, make_spec=lambda d: prep.spec(options, d, joining=True))
        policy.begin(run)
        supervise(run, local, policy)
        local.join(options.timeout_s)
        run.summary.wall_s = time.perf_counter() - t_start
        return run.summary
    finally:
        local.stop()
        del store


def host_store(host: str, port: int, timeout_s: float) -> Any:
    """The run's TCPStore, hosted by this process (port 0: any free port)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
