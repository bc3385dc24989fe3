"""Running as one of torchrun's workers (``torchrun ... -m hetu_cli train --plan PLAN``), for multi-node.

torchrun's agent hosts the store and watches the processes (it stops the others when one fails); each
worker here maps its rank to a device of the strategy (ranks follow device ids, as under the hspmd
launcher) and runs the same ``train_worker``. Rank 0 reports steps to its console; the others are quiet.
The torchrun protocol is its environment variables; they are read in one place (``TorchrunEnv``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.errors import HspmdError
from runtime.launch.messages import Log, StepDone
from runtime.launch.options import StepRecord, TrainOptions, WorkerSpec, rank_map
from runtime.launch.session import Reporter, run_devices
from runtime.launch.worker import train_worker
from runtime.spec import load_plan_context
from runtime.spec.catalog import check_trainable


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def detect(environ: Mapping[str, str]) -> TorchrunEnv | None:
        """The worker's place when started by torchrun (its agent sets TORCHELASTIC_RUN_ID), else None."""
        if "TORCHELASTIC_RUN_ID" not in environ:
            return None
        return TorchrunEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]),
                           int(environ["LOCAL_WORLD_SIZE"]))


def _console(strategy: str, on_step: Callable[[StepRecord], None] | None,
             on_log: Callable[[str], None] | None) -> Reporter:
    """A worker's steps and logs to this process's callbacks (rank 0's console; None: nowhere)."""

    def send(msg: object) -> None:
        if isinstance(msg, StepDone) and on_step is not None:
            on_step(StepRecord.combine([msg.report], strategy))
        elif isinstance(msg, Log) and on_log is not None:
            on_log(msg.text)

    return send


def run_torchrun(options: TrainOptions, env: TorchrunEnv, *, on_step: Callable[[StepRecord], None] | None = None,
                 on_log: Callable[[str], None] | None = None) -> None:
    """This process's share of a torchrun launch; ``on_step``/``on_log`` are used on rank 0 only."""
    from datetime import timedelta

    import torch.distributed as dist

    from runtime.checkpoint import check_load_and_save

    ctx = load_plan_context(options.plan, options.cluster, options.model)
    check_trainable(ctx)
    check_load_and_save(ctx, options.load_dir, options.save_dir)
    strategy = ctx.strategy(options.strategy)
    devices = run_devices(ctx, options)  # a documents run: every strategy's devices (runtime/launch/session.py)
    if env.world_size != len(devices):
        raise HspmdError(f"{options.plan}: strategy {strategy.name!r} uses {len(devices)} devices, but torchrun "
                         f"started {env.world_size} processes (--nnodes x --nproc-per-node must equal "
                         f"{len(devices)})")
    ranks = rank_map(devices)
    device = devices[env.rank]  # rank r runs the r-th device of the strategy; its local rank picks the GPU
    if ctx.cluster.emulated:
        backend, torch_device = "gloo", "cpu"
        threads: int | None = max(1, (os.cpu_count() or 1) // env.local_world_size)
    else:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() <= env.local_rank:
            raise HspmdError(f"{options.plan}: cluster {ctx.cluster.name!r} has real GPUs, but local rank "
                             f"{env.local_rank} has no CUDA device (emulated clusters such as cpu-hetero4 run "
                             "on CPU)")
        backend, torch_device, threads = "nccl", f"cuda:{env.local_rank}", None
    spec = WorkerSpec(options=options, strategy=strategy.name, device_id=device, rank=env.rank, ranks=ranks,
                      backend=backend, torch_device=torch_device, num_threads=threads)
    # torchrun's "env://" rendezvous: MASTER_ADDR/PORT, and the agent's own store where it hosts one.
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size,
                                       timeout=timedelta(seconds=options.timeout_s)))
    quiet = env.rank != 0
    train_worker(spec, store, _console(strategy.name, None if quiet else on_step, None if quiet else on_log))
