"""The emulated CPU cluster's test harness, in one module: what an emulated cluster needs that a GPU cluster
does not. The runtime and the planner never import it (tests/unit/test_layering.py); the CLI hands its
results to them through their generic hooks:

* ``SleepBlockTargets``: a sleep-mode device's compute blocks last what its target prices them at (the
  runtime's ``BlockTargets`` protocol, runtime/launch/options.py; the worker's ``EmulatedTarget`` hook,
  runtime/trace.py, sleeps each block out to it). One object for a run, pickled to the workers; it prices
  any strategy, so the strategies an elastic run replans to are priced as they are built.
* ``cpu_shares`` / ``worker_cpus``: the cores each emulated worker is pinned to and its intra-op threads
  (the launcher's and the profiler's generic affinity options).
* ``emulated``: a run's ``TrainOptions`` with both filled in where its cluster is emulated.

Importing this loads no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from planner.costmodel.targets import (
    SPLIT_BACKWARD_SHARE,
    ExpertShare,
    SleepTarget,
    moe_block_s,
    sleep_target,
    slowest_target,
)
from runtime.launch.options import TrainOptions
from runtime.profiling.host import WorkerCpus, host_cpus
from runtime.torchfree.profiling.profile import ComputeBlock
from runtime.torchfree.spec import Cluster, PlanContext

BlockTarget = Callable[[str, Mapping[str, Any]], float | None]


def cpu_shares(devices: Sequence[int], cluster_devices: int, cpus: Sequence[int]) -> WorkerCpus:
    """The CPU share of each worker of an emulated cluster on this host: intra-op threads, and per device
    the cores to pin it to.

    Every worker gets the same thread count, ``max(1, cores // cluster devices)``, whichever devices the
    plan uses: an emulated device's speed must not depend on the plan (and one profile, measured at that
    count, fits every plan). The i-th device of ``devices`` (in id order) is pinned to cores ``i*t ..
    i*t+t-1`` (mod the core count): left alone, the scheduler at times puts two communicating workers on
    one core while another core idles (wake-affine placement), and the same plan's step time varied by
    +-20% from run to run.
    """
    cores = list(cpus) or [0]
    t = max(1, len(cores) // max(1, cluster_devices))
    return WorkerCpus(t, {d: tuple(sorted({cores[(i * t + j) % len(cores)] for j in range(t)}))
                          for i, d in enumerate(sorted(devices))})


def profiler_cpus(cluster: Cluster) -> WorkerCpus | None:
    """The share ``hspmd profile`` measures an emulated cluster under: the one its workers run with."""
    if not cluster.emulated:
        return None
    n = cluster.num_devices
    return cpu_shares(range(n), n, host_cpus())


def worker_cpus(ctx: PlanContext, options: TrainOptions) -> WorkerCpus | None:
    """The CPU share of a run's workers (None: not an emulated cluster): the devices its strategies use, or
    every device of the cluster for a coordinated run (elastic or switching: devices may rejoin it, a switch
    may bring in others)."""
    if not ctx.cluster.emulated:
        return None
    from runtime.launch.session import run_devices

    devices = range(ctx.cluster.num_devices) if options.coordinated else run_devices(ctx, options)
    return cpu_shares(list(devices), ctx.cluster.num_devices, host_cpus())


@dataclasses.dataclass(frozen=True)
class SleepBlockTargets:
    """``BlockTargets`` of a cluster's sleep-mode devices: each forward / backward block of a device's
    stage lasts what its type's target (``SleepTarget.block_s``) prices it at, the same function the cost
    model prices these types by, so the plan and the run agree. Targets resolve lazily, per strategy a worker
    builds."""

    def for_device(self, ctx: PlanContext, strategy: str, device: int) -> BlockTarget | None:
        return stage_block_targets(ctx, strategy, device)


def device_target(ctx: PlanContext, dev_type: str) -> SleepTarget | None:
    """A device type's sleep-mode target for a run of the plan's model (None: the type does not sleep)."""
    em = ctx.cluster.device_types[dev_type].emulate
    if em is None or not em.sleeps:
        return None
    return sleep_target(em, trained=ctx.model, file=f"cluster {ctx.cluster.name}",
                        field=f"device_types.{dev_type}.emulate")


def sleeps(cluster: Cluster) -> bool:
    return any(dt.emulate is not None and dt.emulate.sleeps for dt in cluster.device_types.values())


def emulated(options: TrainOptions, ctx: PlanContext | None = None) -> TrainOptions:
    """``options`` with what its emulated cluster needs (block targets, worker cores); unchanged on GPUs."""
    if ctx is None:
        from runtime.torchfree.spec import load_plan_context

        ctx = load_plan_context(options.plan, options.cluster, options.model)
    if not ctx.cluster.emulated:
        return options
    return dataclasses.replace(options, block_targets=SleepBlockTargets() if sleeps(ctx.cluster) else None,
                               worker_cpus=worker_cpus(ctx, options))


def stage_block_targets(ctx: PlanContext, strategy: str, device: int) -> BlockTarget | None:
    """The targets of ``device``'s blocks in ``strategy``: its stage's forward and backward blocks as its type's
    target prices them, at the plan's micro-batch size and sequence length (or the span's own ``seq_len``,
    where the engine names one), with its MoE layers' difference (``moe_block_s``: on an expert-parallel
    stage its own experts' rows, the TP parts at the pace of the stage's slowest target). Other compute
    blocks (the optimizer step) have no target, and so has every block of a device the strategy leaves idle.
    None where the device's type does not sleep."""
    own = device_target(ctx, ctx.cluster.device(device).type)
    if own is None:
        return None
    strat = ctx.strategy(strategy)
    where = strat.locate(device)
    if where is None:   # idle in this strategy (an elastic run's standby device): no blocks to price
        return lambda name, args: None
    pi, si, _ = where
    stages = strat.pipelines[pi].stages
    st = stages[si]
    t = ctx.plan.training
    model = ctx.model
    # the sleep-mode types of the stage (an expert-parallel stage may mix them)
    targets = {ty: tg for ty in {ctx.cluster.device(d).type for d in st.devices}
               if (tg := device_target(ctx, ty)) is not None}
    share = None if not st.expert_parallel else ExpertShare(tuple(st.devices), dict(st.experts or ()), device)
    cache: dict[tuple[bool, int, int, bool, bool, int], float] = {}

    def stage_target(seq_len: int) -> SleepTarget:
        """The target the stage's TP parts run at: its one type's, or a mixed stage's slowest."""
        return own if len(targets) == 1 else targets[slowest_target(targets, st.tp, t.micro_batch, seq_len)]

    def moe_s(backward: bool, seq_len: int, chunk: int | None) -> float:
        if model.moe is None:
            return 0.0
        # the chunk's layers (a span naming none: every chunk's), and the lowest of each chunk's that recompute
        chunks = range(len(st.layers)) if chunk is None else (chunk,)
        ids = [i for c in chunks for i in range(*st.layers[c])]
        rerun = [i for c in chunks for i in range(*st.layers[c])[:st.chunk_recompute(c)]]
        return moe_block_s(stage_target(seq_len), own, model.moe, st.tp, t.micro_batch, seq_len,
                           backward=backward, moe_layers=sum(1 for i in ids if model.is_moe_layer(i)),
                           rerun_layers=sum(1 for i in rerun if model.is_moe_layer(i)), share=share)

    def target_s(name: str, args: Mapping[str, Any]) -> float | None:
        # A split backward's two halves (zero-bubble schedules: input gradient, then weight gradient) are
        # priced at their share of the backward block each (the cost model's chunk_cost splits it so too).
        share_of = {"forward": 1.0, "backward": 1.0, "input_grad": SPLIT_BACKWARD_SHARE,
                    "weight_grad": SPLIT_BACKWARD_SHARE}.get(name)
        if share_of is None:
            return None
        backward = name != "forward"
        seq_len = int(args.get("seq_len", t.seq_len))
        # The engine names the chunk it runs (its layers, whether it embeds / holds the head); a span
        # without them is the whole stage.
        chunk = args.get("chunk")
        chunk = None if chunk is None else int(chunk)
        layers = int(args.get("layers", st.num_layers))
        first = bool(args.get("first", si == 0))
        last = bool(args.get("last", si == len(stages) - 1))
        docs = tuple(int(n) for n in args.get("documents", ()))
        # packed documents (one row of several documents): priced by their lengths, uncached (they vary)
        key = (backward, seq_len, layers, first, last, -1 if chunk is None else chunk)
        if docs or key not in cache:
            price = stage_target(seq_len).block_s(ComputeBlock(
                layers=layers, micro_batch=1 if docs else t.micro_batch, seq_len=sum(docs) or seq_len,
                backward=backward, tp=st.tp, recompute=st.recompute, first=first, last=last, documents=docs))
            price += moe_s(backward, seq_len, chunk)
            if docs:
                return share_of * price
            cache[key] = price
        return share_of * cache[key]

    return target_s
