"""Running as one of torchrun's workers (``torchrun ... -m hetu_cli train --plan PLAN``), for multi-node.

torchrun's agent hosts the store and watches the processes (it stops the others when one fails); each
worker here finds its device: on an emulated cluster the rank-th device of the run; on GPUs the
local-rank-th of the run's devices on this machine's node (``--node NAME``, else the host name), on the GPU
the cluster file gives it (runtime/launch/placement.py), so nodes may run different numbers of devices and
torchrun's node order does not matter. Ranks follow device ids, as under the hspmd launcher; the worker
runs the same ``train_worker``. Rank 0 reports steps to its console; the others are quiet.
The torchrun protocol is its environment variables; they are read in one place (``TorchrunEnv``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.launch.messages import Log, StepDone
from runtime.launch.options import StepRecord, TrainOptions, WorkerSpec, rank_map
from runtime.launch.placement import pin_gpu_order, this_node, torchrun_device
from runtime.launch.session import Reporter, run_devices
from runtime.launch.worker import train_worker
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.catalog import check_trainable


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
    if ctx.cluster.emulated:
        device = devices[env.rank]  # emulated devices have no GPU: rank r runs the r-th device
        backend, torch_device = "gloo", "cpu"
        threads: int | None = max(1, (os.cpu_count() or 1) // env.local_world_size)
    else:
        # This machine's node, then its local rank among the node's devices of the run: the device and its
        # GPU follow from the cluster file, whatever torchrun's node order (runtime/launch/placement.py).
        pin_gpu_order()
        node = this_node(ctx.cluster, options.node, options.gpus.host())
        if node is None:
            named = f"--node {options.node!r}" if options.node is not None else f"host {options.gpus.host()!r}"
            raise HspmdError(f"{options.plan}: rank {env.rank}: {named} is not a node of cluster "
                             f"{ctx.cluster.name!r} (nodes: {', '.join(sorted({n.name for n in ctx.cluster.nodes}))}; "
                             "give this machine's node name with --node NAME)")
        device = torchrun_device(ctx.cluster, devices, node, env.local_rank, env.local_world_size)
        backend = "nccl"
        threads = max(1, (os.cpu_count() or 1) // env.local_world_size)  # the node's cores shared, not each all
        torch_device = f"cuda:{ctx.cluster.device(device).local_index}"
    spec = WorkerSpec(options=options, strategy=strategy.name, device_id=device, rank=ranks[device], ranks=ranks,
                      backend=backend, torch_device=torch_device, num_threads=threads)
    # torchrun's "env://" rendezvous: MASTER_ADDR/PORT, and the agent's own store where it hosts one.
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size,
                                       timeout=timedelta(seconds=options.timeout_s)))
    quiet = ranks[device] != 0
    train_worker(spec, store, _console(strategy.name, None if quiet else on_step, None if quiet else on_log))
