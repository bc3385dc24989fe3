"""The cost model: time and memory of a strategy on a cluster, from device profiles.

Everything the planner, the simulator and the reports know about speed and memory comes from here.

Quick start::

    from planner.cost import CostModel
    from runtime.profiling.profile import resolve_profiles

    profiles = resolve_profiles(cluster.device_types, [profile_dir])   # measured > spec > datasheet
    cm = CostModel(model, cluster, profiles, micro_batch=1, seq_len=4096)   # or CostModel.for_plan(...)
    est = cm.estimate(strategy, global_batch=64, schedule="1f1b", zero=False)
    est.step_time_s, est.tokens_per_s, est.mfu, est.oom_devices

Units: seconds, bytes (``MemoryBreakdown.gib`` for GiB), one micro-batch of ``micro_batch`` sequences of
``seq_len`` tokens unless a method says otherwise. Nothing here mutates its inputs.

Building blocks, all cached per instance (keys are small: device type name, TP degree, flags), so the
planner can call them millions of times:

* ``layer(device_type, tp, recompute=False) -> LayerCost``: one decoder layer on one device of a TP
  group: forward/backward compute, TP collectives, saved activations, local parameters. Stage costs are
  linear in the layer count, so ``LayerCost`` fields are the per-layer coefficients an ILP wants.
* ``extras(device_type, tp, first, last) -> LayerCost``: what the first stage (embedding) and the last
  (final norm, head, loss) add on top of their layers.
* ``stage(device_type, tp, num_layers, first, last, recompute) -> StageCost``: one micro-batch through
  one stage. ``forward_s``/``backward_s`` include the TP collectives; ``backward_s`` includes the
  recompute forward when ``recompute``.
* ``stage_memory(device_type, tp, num_layers, first, last, recompute, in_flight, zero_degree=1)
  -> MemoryBreakdown``: parameters, gradients, optimizer states / ``zero_degree``, activations x
  ``in_flight`` micro-batches (``live_activation_limit``), framework overhead.
* ``p2p_time(src_devices, dst_devices)``: one activation (or its gradient, fp32) across a stage
  boundary, priced as what the runtime sends (``boundary_flows``: every TP rank's copy, or the BSR's
  pieces), its messages sharing ports and NICs (planner/links.py); ``transfer_time(a, b, nbytes)`` one
  message (measured link curves, else ``link(a, b)``'s latency and bandwidth); ``serialises(devices)``
  whether a tick's sends and receives serialise, as the profile says (``tick_seconds``, planner/links.py).
  ``hop_time(strategy, src, dst)``: the same as a run of ``strategy`` carries it, with the emulated host's
  delay where its launcher pins a sender and its receiver to one core (``HostModel.shared_core_delay``);
  the estimate and the simulator price boundaries with it.
* ``allreduce_time(devices, nbytes)``: one ring all-reduce (measured curves by size for its link class,
  across nodes too, when the profiles have them).
* ``sync_plan(strategy) -> [SyncGroup]``: the cross-pipeline gradient sync exactly as the runtime lays it
  out (runtime/comm/gradsync.py: its device groups in its order, each with its buckets; SplitAllReduce LCM
  slices when TP degrees differ, norms duplicated in a TP group synced by the whole group); ``sync_group_time``
  prices one group; ``sync_times(strategy)`` prices them all, the rings that cross one NIC at once
  (the TP ranks' of a stage) sharing it; ``grad_sync_times(strategy) -> {device: seconds}`` sums a device's groups;
  ``grad_sync_time`` is the span of the groups in their global order, each a rendezvous of its members (as the
  runtime runs them and the simulator plays them: waits for peers included).
* ``zero_gather_time(group)``: ZeRO-1's all-gather of a sync group's updated parameters after the
  optimizer step (one per gradient-sync bucket: ``allgather_time``, measured or half an all-reduce);
  ``zero_gather_times(strategy, zero)`` sums a device's groups.
* ``optimizer_time(device_type, params, zero_degree=1, tensors=0)``: one AdamW step;
  ``tensors_per_stage`` gives the tensor count. ``clip_time(devices)``: the per-step all-reduce of
  loss and gradient norm.
* ``zero`` everywhere is a copy count: 0 (or False) off, 1 (or True) ZeRO-1, r >= 2 ZeRO-1 with r copies of
  every moment chunk (``training.zero_redundancy``, elastic plans): ``zero_degree`` divides a device's
  optimizer state and AdamW step by ``pipelines // r``; the all-gather sends each element once whatever r.
* ``estimate(strategy, global_batch, schedule, zero) -> StrategyEstimate``: the whole step, each pipeline
  by ``pipeline_step_time`` (the runtime's action lists played with ``chunk_cost``s: ``play_order``)
  under its own schedule, plus memory per device (the schedule's ``live_activation_limit``:
  ``pipeline_memory``) with OOM flags. docs/design.md §10.
* ``chunk_cost``: a chunk's F, B and W (the backward split by ``weight_grad_fraction``); ``with_op_costs``:
  a strategy with every stage's ``op_costs`` (its chunks' ``chunk_cost``s) and every pipeline's
  ``transfer_costs`` (``pipeline_costs``' boundaries: ``costed_pipeline``), as the planner writes plans, so
  that the runtime orders its lists by them (``runtime_schedule``: ``plan_schedule``, the handle's own
  function); ``pipeline_costs``: the priced ``Costs`` of a pipeline (transfers included);
  ``ideal_step_time``: the list scheduler on them (``step_time``).
* ``iteration_time``: the measured fixed cost per iteration, added once to the step (estimate and simulator).
* ``placed_stage(device_type, tp, layers, first, last, recompute)``: ``stage`` for layer ranges, with the
  profile's per-layer-index overrides (estimate and simulator; the planner's ILP prices layers alike).

Fidelity notes: compute comes from a measured profile's stage blocks when it has them (one decoder
layer, a stage's fixed time per micro-batch, what the embedding and head add, timed through the
runtime's stage module as the engine runs a micro-batch: ``MeasuredModel.blocks``), else from the sum of
the components. TP collectives are priced from the measured TP overhead per block (DTensor dispatch and
collectives: ``tp_blocks``, ``tp_blocks_sp`` for a sequence-parallel plan where the profile has them, or
per layer ``tp_overhead`` in older profiles) when there is one, else
counted (2 all-reduces forward, 2 backward per layer, as the runtime lays Megatron TP out). On a
CPU-emulated device type only the CPU-time part of the TP overhead (``tp_blocks_cpu``) is stretched by its
slowdown: the runtime sleeps a multiple of each compute block's CPU time. ``step_overhead_time`` (the
step's code outside its spans) and the gradient sync's packing (``sync_group_time``) come from measured
profiles too. ``host`` (planner/host.py) holds the emulated host's effects: the slowdown ``stage`` stretches
by, the measured costs of sharing the CPU that only the simulator plays out (planner/simulate.py), and
two the estimate charges as well (``pipeline_costs``): the executor's CPU per boundary message
(``p2p_actions``) and the lateness of every emulated sleep (``sleep_late_s``).

Pure formulas (module level): ``pipeline_time`` (1F1B's closed form ``(m-1)*max(t) + sum(t) +
sum(boundary comm)``, GPipe's on forward and backward separately: ranking proxies, e.g.
``pipeline_proxy_time``), ``play_order``, ``weight_grad_fraction``, ``allreduce_seconds``,
``model_flops_per_token`` (for MFU).

Where a profile has measured fits for this model's shape and TP degree, they are used as measured;
otherwise the component costs are derived from the profile's throughput figures and the model's
FLOPs and bytes (``analytic_components``, runtime/profiling/profile.py ``component_fits``). Both paths
yield the same ``ComponentFit`` records. A sleep-mode emulated type (runtime/spec/cluster.py ``Emulation``)
is priced by its target instead: ``stage`` gives what ``sleep_target`` prices each forward / backward
block at (runtime/profiling/profile.py ``block_seconds``, the function the runtime sleeps by), and
``HostModel.contended`` tells the simulator's host model to leave it out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.host import HostModel
from planner.links import Flow, concurrent_seconds, curve_seconds, ring_sharers
from runtime.annotations.from_plan import Boundary, held_by, placements
from runtime.annotations.states import Annotation
from runtime.comm.gradsync import SliceGroups, SyncGroup, cut_buckets, reduce_slices, sync_groups
from runtime.engine.specialize import BOUNDARY_DTYPE, resolve_boundary
from runtime.errors import HspmdError
from runtime.models.decoders import model_parameters
from runtime.models.params import ParamInfo
from runtime.pipeline_schedules import ChunkCost, Costs, TimedOp, op_kinds, step_time, step_time_bound
from runtime.pipeline_schedules import Schedule as PipelineSchedule
from runtime.profiling.profile import (
    BLOCKS,
    SPLIT_BACKWARD_SHARE,
    ComponentFit,
    ComputeBlock,
    DeviceProfile,
    LinkCurve,
    LinkFit,
    MeasuredModel,
    P2pAction,
    P2pActions,
    ProfileSet,
    SleepTarget,
    analytic_components,  # noqa: F401 (re-exported: it lived here before the runtime's block pricing)
    component_fits,
    eval_fit,
    extra_components,
    layer_components,
    layer_override_fits,
    measured_tp_comm,
    sleep_target,
    table_optimizer_s,
)
from runtime.schedule_policies import Layout, device_limits, schedule_layout
from runtime.spec.catalog import PlanContext
from runtime.spec.cluster import Cluster
from runtime.spec.handle import StrategyHandle, plan_order, plan_schedule
from runtime.spec.model import ModelSpec
from runtime.spec.plan import PLAN_VERSION, OpCosts, Pipeline, Plan, Schedule, Stage, Strategy, TrainingSettings

GIB = float(2**30)

# Collectives a TP group issues per micro-batch, as the runtime lays TP out with DTensor
# (runtime/engine/tensor_parallel.py; Megatron layout): in forward, the two
# row-parallel projections (o_proj, down_proj) all-reduce their outputs; in backward, each block's
# column-parallel projections (q/k/v, gate/up) read one shared replicated input, so their partial input
# gradients add up locally and one all-reduce per block remains (counted with DTensor's CommDebugMode:
# 2 forward + 2 backward per layer). The vocab-parallel
# embedding all-reduces its output; the column-parallel head all-gathers the logits (forward) and
# all-reduces its input gradient (backward). Under sequence parallelism (``training.sequence_parallel``)
# each layer's all-reduces are a reduce-scatter plus an all-gather of the same bytes, and a stage adds
# one all-gather each way where its sharded residual stream meets its replicated ends (``extras``).
TP_ALLREDUCES_PER_LAYER = (2, 2)
# What crosses a stage boundary: the runtime's residual stream, in its dtype.
BOUNDARY_BYTES = BOUNDARY_DTYPE.itemsize
# What a TP degree adds where the measured times already include its collectives (``includes_tp_comm``).
ZERO_FIT = ComponentFit((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), params=0)


# ---------------------------------------------------------------------------------------------------
# Pure formulas


def pipeline_time(forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int,
                  schedule: Schedule = "1f1b", boundary_s: Sequence[float] = ()) -> float:
    """Time of one pipeline for one step, closed form (docs/design.md §5).

    1F1B: ``(m-1) * max_s(f_s + b_s) + sum_s(f_s + b_s) + sum(boundary)``; GPipe runs all forwards, then
    all backwards: ``(m-1)*max(f) + sum(f) + (m-1)*max(b) + sum(b) + sum(boundary)``. ``boundary_s``
    is the fill-and-drain cost of each stage boundary (forward activation plus backward gradient).
    Exact for equal stages without communication; an estimate otherwise (the simulator is exact).
    """
    m = micro_batches
    if schedule == "1f1b":
        t = [f + b for f, b in zip(forward_s, backward_s)]
        return (m - 1) * max(t) + sum(t) + sum(boundary_s)
    return (m - 1) * (max(forward_s) + max(backward_s)) + sum(forward_s) + sum(backward_s) + sum(boundary_s)


def timeline_order(layout: Layout, kinds: Sequence[str], timeline: Sequence[Sequence[TimedOp]]
                   ) -> tuple[tuple[int, ...], ...]:
    """A timeline's op order as op numbers (``runtime.pipeline_schedules.schedule_order``)."""
    n, index = layout.num_stages, {k: i for i, k in enumerate(kinds)}
    return tuple(tuple((t.op.micro_batch * n + t.op.stage) * len(kinds) + index[t.op.kind] for t in ops)
                 for ops in timeline)


def play_order(layout: Layout, kinds: Sequence[str], order: Sequence[Sequence[int]], costs: Costs) -> float:
    """What the timeline whose op order is ``order`` takes when played (op numbers over ``kinds``,
    ``schedule_order``): the same arithmetic in the same order per op, so the same float to the bit
    (tests/unit/planner/test_fast_pricing.py), with each op's duration, the message it waits for and the
    transfer its output takes looked up by number instead of read from a ``TimedOp``."""
    n, nk = layout.num_stages, len(kinds)
    per_mb = n * nk
    dev = [layout.device(j) for j in range(n)]
    dur: list[float] = []
    src: list[int] = []               # per op of one micro-batch: the op (offset) whose message it waits for, 0: none
    out: list[float | None] = []      # the transfer time its output takes to another device, None: none
    for j in range(n):
        cc = costs.chunk(dev[j], layout.chunk(j))
        for kind in kinds:
            dur.append(cc.of(kind))  # type: ignore[arg-type]
            back = kind in ("B", "BW")
            if kind == "F" and j > 0 and dev[j - 1] != dev[j]:
                src.append(-nk)       # the previous stage's F of this micro-batch
            elif back and j < n - 1 and dev[j + 1] != dev[j]:
                src.append(nk)        # the next stage's backward
            else:
                src.append(0)
            if kind == "F" and j < n - 1 and dev[j + 1] != dev[j]:
                out.append(costs.transfer(j))
            elif back and j > 0 and dev[j - 1] != dev[j]:
                out.append(costs.transfer(j - 1))
            else:
                out.append(None)
    arrival: list[float | None] = [None] * sum(len(ops) for ops in order)
    clock = [0.0] * layout.num_devices
    pos = [0] * layout.num_devices
    last = 0.0
    moved = True
    while moved:
        moved = False
        for d, ops in enumerate(order):
            t, p, size = clock[d], pos[d], len(ops)
            while p < size:
                o = ops[p]
                r = o % per_mb
                if src[r]:
                    a = arrival[o + src[r]]
                    if a is None:
                        break   # its sender has not got there yet
                    if a > t:   # (``max(t, a)``)
                        t = a
                t += dur[r]
                if t > last:
                    last = t
                x = out[r]
                if x is not None:
                    arrival[o] = t + x
                p += 1
                moved = True
            clock[d], pos[d] = t, p
    if any(p < len(ops) for p, ops in zip(pos, order)):
        raise RuntimeError("the action lists deadlock (a runtime schedule bug, not a user error)")
    return last


def recomputed(num_layers: int, recompute: bool, recompute_layers: int) -> int:
    """How many of ``num_layers`` layers recompute: all with ``recompute``, else ``recompute_layers``
    (partial recompute, ``Stage.recompute_layers``), at most all."""
    return num_layers if recompute else min(num_layers, max(0, recompute_layers))


def stage_recompute(st: Stage) -> tuple[int, ...]:
    """Per chunk of ``st``, how many of its layers recompute (``Stage.chunk_recompute``)."""
    return tuple(st.chunk_recompute(c) for c in range(st.chunks))


def weight_grad_fraction(model: ModelSpec, seq_len: int, num_layers: int, head: bool,
                         in_input_grad: int = 0) -> float:
    """The weight-gradient (W) share of a chunk's backward compute, by FLOPs (docs/design.md §10).

    Per token, a decoder layer's forward runs ``2P`` matmul FLOPs (P its parameters) and ``4hs``
    attention FLOPs (PaLM's count, as ``model_flops_per_token``). Its backward computes the input
    gradients, ``2P + 8hs`` (the attention's backward is all input gradient: it has no weights), and the
    weight gradients, ``2P``. The head adds ``2Vh`` to each half; the embedding's backward is a
    scatter-add (no FLOPs). The profiles time the backward as one block, so W is this share of it and B
    the rest; recompute and TP collectives stay with B (the recompute forward runs before the input
    gradients; the row-parallel input-gradient all-reduce is B's). ``in_input_grad``: layers whose weight
    gradients B computes itself (partial recompute's recomputed layers: the engine does not defer them, as
    deferring would rerun their forward once more), so they are not W's."""
    p, h = model.layer_params(), model.hidden_size
    head_flops = 2.0 * model.vocab_size * h if head else 0.0
    w = (num_layers - in_input_grad) * 2.0 * p + head_flops
    total = num_layers * (4.0 * p + 8.0 * h * seq_len) + 2.0 * head_flops
    return w / total if total > 0 else 0.0


def allreduce_seconds(nbytes: float, n: int, latency_s: float, bandwidth_gbs: float) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` devices: ``latency + 2(n-1)/n * bytes / bandwidth``."""
    if n <= 1:
        return 0.0
    return latency_s + 2.0 * (n - 1) / n * nbytes / (bandwidth_gbs * 1e9)


def _collective_time(lines: Sequence[tuple[float, float]], sizes: Sequence[float]) -> float:
    """Seconds of one collective call per entry of ``sizes`` (bytes): each call takes the slowest of the
    (seconds, seconds per byte) ``lines`` (one per device type's fit)."""
    if len(lines) == 1:
        fixed, per_byte = lines[0]
        return fixed * len(sizes) + per_byte * sum(sizes)
    return sum(max(fixed + per_byte * x for fixed, per_byte in lines) for x in sizes)


def nearest_fit(fits: Mapping[int, LinkFit], n: int) -> tuple[float, float]:
    """(latency s, bandwidth GB/s) for a ring of ``n`` from the fit of the nearest measured group size
    (the smaller on a tie), its latency scaled by ring steps."""
    size = min(fits, key=lambda k: (abs(k - n), k))
    fit = fits[size]
    return fit.latency_s * (n - 1) / (size - 1), fit.bandwidth_gbs


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recompute): ``6N + 12*L*h*s`` (PaLM, App. B),
    with N the layer and head parameters (the embedding lookup is not a matmul)."""
    n = model.num_layers * model.layer_params() + model.vocab_size * model.hidden_size
    return 6.0 * n + 12.0 * model.num_layers * model.hidden_size * seq_len


def has_tp_stage(strategy: Strategy) -> bool:
    """Whether some stage is a TP group: what ``training.sequence_parallel`` acts on (a plan without one
    must not set it, runtime/spec/validate.py)."""
    return any(st.tp > 1 for p in strategy.pipelines for st in p.stages)


def zero_degree(pipelines: int, zero: int) -> int:
    """How many ways ZeRO-1 divides a device's optimizer state and AdamW step (``zero``: the copy count,
    0 off): ``pipelines // r`` chunks per slice (runtime/engine/zero.py ``place``; a slice has at least
    one replica per pipeline, so this errs on the side of memory)."""
    return max(1, pipelines // int(zero)) if zero else 1


def zero_copies(training: TrainingSettings) -> int:
    """A plan's ZeRO-1 setting as the copy count the cost model takes (0: off)."""
    return training.zero_redundancy if training.zero else 0


def zero_fields(copies: int) -> dict[str, Any]:
    """The inverse of ``zero_copies``: ``TrainingSettings``' ZeRO-1 fields for a copy count."""
    return {"zero": bool(copies), "zero_redundancy": max(1, int(copies))}


def planner_handle(cm: CostModel, strategy: Strategy, global_batch: int, schedule: Schedule = "1f1b",
                   zero: int = 0) -> StrategyHandle:
    """``strategy`` as a plan's strategy handle, so that the cost model and the simulator play the very
    action lists the runtime would execute (``StrategyHandle.pipeline_schedule``): a planned strategy has
    no plan file yet."""
    training = TrainingSettings(global_batch=global_batch, micro_batch=cm.micro_batch, seq_len=cm.seq_len,
                                schedule=schedule, sequence_parallel=cm.sequence_parallel, **zero_fields(zero))
    plan = Plan(version=PLAN_VERSION, model=cm.model.name, cluster=cm.cluster.name, training=training,
                strategies=(strategy,))
    return StrategyHandle(PlanContext(plan, cm.model, cm.cluster, Path("<planner>")), strategy)


# ---------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class LayerCost:
    """One micro-batch through one decoder layer (or the first/last stage's extras), one device.

    ``forward_s``/``backward_s``: compute only. ``recompute_s``: the forward re-run in backward when
    the stage recomputes. ``tp_forward_s``/``tp_backward_s``: the TP collectives. ``activation_bytes``:
    saved for backward; ``checkpoint_bytes``: what recompute keeps instead (the layer input).
    ``params``: local (per shard) parameter count.
    """

    forward_s: float
    backward_s: float
    recompute_s: float
    tp_forward_s: float
    tp_backward_s: float
    activation_bytes: float
    checkpoint_bytes: float
    params: int


@dataclass(frozen=True)
class StageCost:
    """One micro-batch through one stage. Times include the TP collectives (listed separately too)."""

    forward_s: float
    backward_s: float
    compute_s: float        # forward + backward (+ recompute) compute, no communication
    tp_forward_s: float     # TP collectives inside forward_s
    tp_backward_s: float    # TP collectives inside backward_s (recompute included)
    params: int             # local parameters on each device of the stage
    # CPU seconds inside the TP collectives (DTensor dispatch): on an emulated device they are stretched
    # with the compute (included in tp_forward_s / tp_backward_s as (slowdown - 1) x these).
    tp_cpu_forward_s: float = 0.0
    tp_cpu_backward_s: float = 0.0

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def tp_comm_s(self) -> float:
        return self.tp_forward_s + self.tp_backward_s


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at its peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    overhead: float
    casts: float = 0.0   # bf16 weight copies for one step's compute (freed after it, like the gradients)

    @property
    def total(self) -> float:
        return self.total_with(self.activations)

    def total_with(self, activations: float) -> float:
        """``total`` had the activations been ``activations`` (the same sum, in the same order)."""
        return self.params + self.grads + self.optimizer + activations + self.overhead + self.casts

    @property
    def gib(self) -> float:
        return self.total / GIB


@dataclass(frozen=True)
class PipelineEstimate:
    micro_batches: int
    stages: tuple[StageCost, ...]
    boundary_s: tuple[float, ...]   # per boundary: forward activation + backward gradient, one micro-batch
    time_s: float
    schedule: Schedule = "1f1b"     # the schedule it is priced (and runs) with
    chunks: int = 1                 # model chunks per stage (v)


@dataclass(frozen=True)
class StrategyEstimate:
    step_time_s: float
    pipelines: tuple[PipelineEstimate, ...]
    grad_sync_s: float
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    memory: Mapping[int, MemoryBreakdown]   # by device id
    capacity_gib: Mapping[int, float]
    oom_devices: tuple[int, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.oom_devices


# ---------------------------------------------------------------------------------------------------


def _stage_blocks(blocks: Mapping[str, ComponentFit], first: bool, last: bool) -> list[ComponentFit]:
    """The measured blocks a stage adds beyond its layers: its fixed part, the embedding's, the head's."""
    return [blocks["stage"]] + ([blocks["embedding"]] if first else []) + ([blocks["head"]] if last else [])


_KEYWORDS = object()   # marks a ``memo`` key with keyword arguments: no positional tuple can hold it


def memo(fn: Callable) -> Callable:
    """Per-instance cache for methods with hashable arguments (CostModel holds unhashable specs)."""
    name = f"_memo_{fn.__name__}"

    def wrapper(self, *args, **kwargs):
        # The search calls these millions of times (3.0 M calls at 64 GPUs, most hits): a positional call is
        # keyed by its argument tuple itself (no key tuple built and hashed around it), and the cache found
        # by one dict lookup once it exists.
        key = (args, _KEYWORDS, tuple(sorted(kwargs.items()))) if kwargs else args
        try:
            cache = self.__dict__[name]
        except KeyError:
            cache = self.__dict__[name] = {}
        try:
            return cache[key]
        except KeyError:
            value = cache[key] = fn(self, *args, **kwargs)
            return value

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


class CostModel:
    """Costs of one model on one cluster at one micro-batch shape. Cheap to build; caches as it goes."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                 *, micro_batch: int, seq_len: int, step_allreduce: bool = True,
                 sequence_parallel: bool = False) -> None:
        refused = model.pricing_problem()
        if refused is not None:  # a MoE model priced as if dense would be a wrong plan, not an approximate one
            raise HspmdError(refused)
        missing = [t for t in cluster.device_types if t not in profiles]
        if missing:
            raise ValueError(f"no profile for device type(s) {missing}")
        self.model = model
        self.cluster = cluster
        self.profiles = profiles
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.step_allreduce = step_allreduce
        # Whether TP stages run Megatron sequence parallelism (``training.sequence_parallel``): a plan-wide
        # switch, so every price of a (device type, TP degree) is the one its plan runs.
        self.sequence_parallel = sequence_parallel
        self.host = HostModel(model, cluster, profiles, seq_len)   # emulated hosts: planner/host.py
        self._type_of = [d.type for d in cluster.devices]
        self._node_of = [d.node for d in cluster.devices]
        self._nic_of = [cluster.nic_of(d.id) for d in cluster.devices]
        params = model_parameters(dataclasses.replace(model, num_layers=1))
        self._layer_tensors = [p for p in params if p.owner == "layer"]
        self._embed_tensors = [p for p in params if p.owner == "embedding"]
        self._head_tensors = [p for p in params if p.owner == "head"]

    def __reduce__(self) -> tuple:
        """Pickled as its inputs, without its caches (rebuilt on demand: every cached value is a function of
        the inputs): the planner's worker processes (planner/parallel.py) get a small cost model."""
        return (functools.partial(CostModel, micro_batch=self.micro_batch, seq_len=self.seq_len,
                                  step_allreduce=self.step_allreduce, sequence_parallel=self.sequence_parallel),
                (self.model, self.cluster, self.profiles))

    @classmethod
    def for_plan(cls, plan: Plan, model: ModelSpec, cluster: Cluster,
                 profiles: Mapping[str, DeviceProfile] | ProfileSet) -> CostModel:
        t = plan.training
        return cls(model, cluster, profiles, micro_batch=t.micro_batch, seq_len=t.seq_len,
                   sequence_parallel=t.sequence_parallel)

    # -- components ----------------------------------------------------------------------------------

    @memo
    def blocks(self, device_type: str, tp: int) -> dict[str, ComponentFit] | None:
        """Measured stage blocks (one decoder layer, a stage's fixed time, embedding, head) at this TP
        degree, timed through the runtime's stage module; None when the profile has none."""
        measured = self._measured(device_type)
        if measured is not None and tp in measured.blocks and tp not in measured.tables:
            return dict(measured.blocks[tp])
        return None

    @memo
    def components(self, device_type: str, tp: int, micro_batch: int | None = None,
                   seq_len: int | None = None) -> dict[str, ComponentFit]:
        """Per-component fits on this device type at this TP degree: measured if the profile has this
        model shape and TP degree, else derived from the profile's throughput figures; tables (measured
        elsewhere) resolved at this micro-batch shape (runtime/profiling/profile.py ``component_fits``)."""
        b, s = self._shape(micro_batch, seq_len)
        return component_fits(self.profiles[device_type], self.model, tp, b, s)

    def _measured(self, device_type: str) -> MeasuredModel | None:
        return self.profiles[device_type].measured_model(self.model)

    def _tp_overhead(self, device_type: str, tp: int) -> ComponentFit | None:
        """The measured per-layer TP overhead (DTensor + collectives), if the profile has it: the layer
        block of ``_tp_blocks``, else (profiles without TP blocks) ``tp_overhead``."""
        blocks = self._tp_blocks(device_type, tp)
        if blocks is not None:
            return blocks["layer"]
        m = self._measured(device_type) if tp > 1 else None
        return None if m is None else m.tp_overhead.get(tp)

    def is_measured(self, device_type: str, tp: int) -> bool:
        m = self._measured(device_type)
        return m is not None and tp in m.tp

    def sequence_sharded(self, tp: int) -> bool:
        """Whether a stage of this TP degree runs sequence parallel: the norms, their saved inputs and the
        residual stream sharded 1/tp along the sequence (runtime/engine/tensor_parallel.py)."""
        return self.sequence_parallel and tp > 1

    def _act_element_bytes(self, device_type: str) -> int:
        return self.profiles[device_type].compute.activation_bytes

    def _shape(self, micro_batch: int | None, seq_len: int | None) -> tuple[int, int]:
        """(micro-batch, sequence length): the given ones, else this model's."""
        return (self.micro_batch if micro_batch is None else micro_batch,
                self.seq_len if seq_len is None else seq_len)

    def activation_tensor_bytes(self, device_type: str, micro_batch: int | None = None,
                                seq_len: int | None = None) -> float:
        """Bytes of one hidden-state tensor [B, s, h]: what crosses a stage boundary or a TP all-reduce."""
        b, s = self._shape(micro_batch, seq_len)
        return float(b * s * self.model.hidden_size * self._act_element_bytes(device_type))

    # -- per layer and per stage ---------------------------------------------------------------------

    @memo
    def layer(self, device_type: str, tp: int, recompute: bool = False, micro_batch: int | None = None,
              seq_len: int | None = None) -> LayerCost:
        """One decoder layer: attention, MLP and two RMSNorms, plus its TP all-reduces."""
        b, s = self._shape(micro_batch, seq_len)
        comp = self.components(device_type, tp, b, s)
        parts = layer_components(comp)
        blocks = self.blocks(device_type, tp)
        timed = [blocks["layer"]] if blocks is not None else parts
        # Sequence parallel: each norm runs on (and saves) 1/tp of the tokens. The blocks' inputs are
        # gathered whole before the column-parallel projections, which save them whole, as without it.
        # (A measured layer block was timed without sequence parallelism and is kept as measured.)
        share = [1.0 / tp if self.sequence_sharded(tp) and p is comp["norm"] else 1.0 for p in parts]
        shares = share if blocks is None else [1.0]
        fwd = sum(k * eval_fit(p.forward_s, b, s) for k, p in zip(shares, timed))
        bwd = sum(k * eval_fit(p.backward_s, b, s) for k, p in zip(shares, timed))
        act = sum(k * eval_fit(p.activation_bytes, b, s) for k, p in zip(share, parts))
        overhead = self._tp_overhead(device_type, tp)
        if overhead is not None:
            tp_f, tp_b = eval_fit(overhead.forward_s, b, s), eval_fit(overhead.backward_s, b, s)
        else:
            # Sequence parallel: each all-reduce becomes an all-gather (before the block) plus a
            # reduce-scatter (after it), the same bytes: priced as the all-reduce.
            ar = self._tp_allreduce(device_type, tp, self.activation_tensor_bytes(device_type, b, s))
            tp_f, tp_b = TP_ALLREDUCES_PER_LAYER[0] * ar, TP_ALLREDUCES_PER_LAYER[1] * ar
        # A recomputed layer keeps its input: the residual stream, 1/tp of it under sequence parallelism.
        kept = float(b * s * self.model.hidden_size * BOUNDARY_BYTES) / (tp if self.sequence_sharded(tp) else 1)
        return LayerCost(forward_s=fwd, backward_s=bwd, recompute_s=fwd + tp_f if recompute else 0.0,
                         tp_forward_s=tp_f, tp_backward_s=tp_b, activation_bytes=act,
                         checkpoint_bytes=kept,
                         params=sum(p.params for p in parts))

    @memo
    def extras(self, device_type: str, tp: int, first: bool, last: bool, micro_batch: int | None = None,
               seq_len: int | None = None) -> LayerCost:
        """What a stage adds to its layers: the first stage's embedding, the last one's final norm, head
        and loss, and (measured stage blocks only) every stage's fixed time per micro-batch."""
        b, s = self._shape(micro_batch, seq_len)
        comp = self.components(device_type, tp, b, s)
        parts = extra_components(comp, first, last)
        blocks = self.blocks(device_type, tp)
        # Measured blocks: a stage's fixed time per micro-batch (every stage pays it) plus what the
        # embedding and the head add; else the components' sum. (The embedding, the final norm and the
        # head run as without sequence parallelism: it shards only between the first and the last layer.)
        timed = parts if blocks is None else _stage_blocks(blocks, first, last)
        tp_blocks = self._tp_blocks(device_type, tp)
        if tp_blocks is not None:   # measured: DTensor dispatch and collectives of the TP stage module
            tp_f, tp_b = self._tp_extras(tp_blocks, first, last, b, s)
        else:   # counted: the embedding's all-reduce, the head's all-gather and input-gradient all-reduce
            act = self.activation_tensor_bytes(device_type, b, s)
            ar_act = self._tp_allreduce(device_type, tp, act)
            logits = float(b * s * self.model.vocab_size * self._act_element_bytes(device_type))
            tp_f = (ar_act if first else 0.0) + (self._tp_allgather(device_type, tp, logits) if last else 0.0)
            tp_b = ar_act if last else 0.0
            if self.sequence_sharded(tp):
                # The last layer's output gathered whole (forward); the first layer's input scattered, so
                # its gradient gathered whole (backward): runtime/engine/tensor_parallel.py.
                ag = self._tp_allgather(device_type, tp, act)
                tp_f, tp_b = tp_f + ag, tp_b + ag
        return LayerCost(
            forward_s=sum(eval_fit(p.forward_s, b, s) for p in timed),
            backward_s=sum(eval_fit(p.backward_s, b, s) for p in timed),
            recompute_s=0.0, tp_forward_s=tp_f, tp_backward_s=tp_b,
            activation_bytes=sum(eval_fit(p.activation_bytes, b, s) for p in parts),
            checkpoint_bytes=0.0, params=sum(p.params for p in parts))

    @memo
    def stage(self, device_type: str, tp: int, num_layers: int, first: bool, last: bool,
              recompute: bool = False, micro_batch: int | None = None, seq_len: int | None = None,
              recompute_layers: int = 0) -> StageCost:
        """One micro-batch through a stage of ``num_layers`` layers, ``recomputed(...)`` of them with
        whole-layer checkpoints (their forward re-run in the backward)."""
        r = recomputed(num_layers, recompute, recompute_layers)
        lay = self.layer(device_type, tp, r > 0, micro_batch, seq_len)
        ext = self.extras(device_type, tp, first, last, micro_batch, seq_len)
        n = num_layers
        b, s = self._shape(micro_batch, seq_len)
        target = self.sleep_target(device_type)
        if target is not None:   # sleep mode: each block lasts its target (TP collectives run inside it)
            block = ComputeBlock(layers=n, micro_batch=b, seq_len=s, backward=False, tp=tp, recompute=r == n > 0,
                                 first=first, last=last)
            fwd = target.block_s(block)
            bwd = target.block_s(dataclasses.replace(block, backward=True))
            return StageCost(forward_s=fwd, backward_s=bwd, compute_s=fwd + bwd, tp_forward_s=0.0,
                             tp_backward_s=0.0, params=n * lay.params + ext.params)
        fwd_c = n * lay.forward_s + ext.forward_s
        bwd_c = n * lay.backward_s + r * lay.recompute_s + ext.backward_s
        # An emulated device sleeps (slowdown - 1) x the CPU time of each compute block (runtime/trace.py
        # EmulatedSlowdown): the waits inside its TP collectives are not stretched, their CPU time is.
        stretch = self.host.emulated_slowdown(device_type)
        cpu_blocks = self._tp_blocks(device_type, tp, cpu=True)
        tp_cpu_f = tp_cpu_b = 0.0
        if cpu_blocks is not None:
            cpu_f = eval_fit(cpu_blocks["layer"].forward_s, b, s)
            ext_f, ext_b = self._tp_extras(cpu_blocks, first, last, b, s)
            tp_cpu_f = n * cpu_f + ext_f
            tp_cpu_b = n * eval_fit(cpu_blocks["layer"].backward_s, b, s) + r * cpu_f + ext_b
        tp_f = n * lay.tp_forward_s + ext.tp_forward_s + (stretch - 1.0) * tp_cpu_f
        tp_b = n * lay.tp_backward_s + ext.tp_backward_s + (stretch - 1.0) * tp_cpu_b
        return StageCost(forward_s=fwd_c + tp_f, backward_s=bwd_c + tp_b, compute_s=fwd_c + bwd_c,
                         tp_forward_s=tp_f, tp_backward_s=tp_b, params=n * lay.params + ext.params,
                         tp_cpu_forward_s=tp_cpu_f, tp_cpu_backward_s=tp_cpu_b)

    @memo
    def placed_stage(self, device_type: str, tp: int, layers: tuple[tuple[int, int], ...], first: bool, last: bool,
                     recompute: bool = False, recompute_layers: int = 0) -> StageCost:
        """``stage`` for the decoder layer ranges ``layers`` ((start, stop) per chunk): where the profile
        overrides some of them by index (``MeasuredModel.layers``), their own components' times replace the
        shared layer's. The recomputed layers are the lowest ``recomputed(...)`` indices."""
        n_layers = sum(b - a for a, b in layers)
        sc = self.stage(device_type, tp, n_layers, first, last, recompute, recompute_layers=recompute_layers)
        rc_ids = set(sorted(i for a, b in layers for i in range(a, b))[:recomputed(n_layers, recompute,
                                                                                   recompute_layers)])
        prof, (b, s) = self.profiles[device_type], self._shape(None, None)
        measured = self._measured(device_type)
        if measured is None or not measured.layers or self.sleep_target(device_type) is not None:
            return sc
        base = layer_components(self.components(device_type, tp))
        d_f = d_b = 0.0
        for i in (i for a, b in layers for i in range(a, b)):
            own = layer_override_fits(prof, self.model, tp, i, b, s)
            if own is None:
                continue
            f = sum(eval_fit(p.forward_s, b, s) for p in layer_components(own)) - sum(
                eval_fit(p.forward_s, b, s) for p in base)
            d_f += f
            d_b += f * (i in rc_ids) + sum(eval_fit(p.backward_s, b, s) for p in layer_components(own)) - sum(
                eval_fit(p.backward_s, b, s) for p in base)
        return dataclasses.replace(sc, forward_s=sc.forward_s + d_f, backward_s=sc.backward_s + d_b,
                                   compute_s=sc.compute_s + d_f + d_b)

    def _tp_blocks(self, device_type: str, tp: int, cpu: bool = False) -> Mapping[str, ComponentFit] | None:
        """Measured TP overhead per stage block (wall time, or its CPU part), if the profile has it: for a
        sequence-parallel plan the figures measured with it on (``tp_blocks_sp``), where the profile has
        them at this degree, else (older profiles) those measured without it, whose collectives move the
        same bytes (each all-reduce a reduce-scatter plus an all-gather)."""
        m = self._measured(device_type) if tp > 1 else None
        if m is not None and measured_tp_comm(self.profiles[device_type], self.model, tp):
            return dict.fromkeys(BLOCKS, ZERO_FIT)   # the measured times include the collectives
        if m is not None and self.sequence_sharded(tp) and tp in m.tp_blocks_sp:
            return (m.tp_blocks_sp_cpu if cpu else m.tp_blocks_sp).get(tp)
        return None if m is None else (m.tp_blocks_cpu if cpu else m.tp_blocks).get(tp)

    @staticmethod
    def _tp_extras(blocks: Mapping[str, ComponentFit], first: bool, last: bool, b: int, s: int) -> tuple[float, float]:
        """(forward, backward) TP overhead a stage adds beyond its layers: its fixed part, the embedding's
        and the head's."""
        parts = _stage_blocks(blocks, first, last)
        return (sum(eval_fit(p.forward_s, b, s) for p in parts), sum(eval_fit(p.backward_s, b, s) for p in parts))

    @memo
    def sleep_target(self, device_type: str) -> SleepTarget | None:
        """A sleep-mode emulated type's target (runtime/spec/cluster.py ``Emulation``): its forward and
        backward blocks last what the target prices them at (``stage``), the same function the runtime's
        emulation sleeps by. None for every other type."""
        em = self.cluster.device_types[device_type].emulate
        if em is None or not em.sleeps:
            return None
        return sleep_target(em, file=f"cluster {self.cluster.name}", field=f"device_types.{device_type}.emulate")

    # -- memory --------------------------------------------------------------------------------------

    @memo
    def stage_memory(self, device_type: str, tp: int, num_layers: int, first: bool, last: bool,
                     recompute: bool, in_flight: int, zero_degree: int = 1,
                     recompute_layers: int = 0) -> MemoryBreakdown:
        """Peak bytes on one device of a stage holding ``in_flight`` micro-batches of activations.

        A layer without recompute keeps its saved tensors per in-flight micro-batch; a recomputed one
        (``recomputed(...)`` of them) only its input, and while one is recomputed its full activations
        live once more.
        The head's logits live only between the last stage's forward and backward of one micro-batch.
        A sleep-mode type that emulates its target's memory is priced by ``target_memory_model``.
        """
        target = self.target_memory_model(device_type)
        if target is not None:
            return target.stage_memory(device_type, tp, num_layers, first, last, recompute, in_flight, zero_degree,
                                       recompute_layers)
        prof = self.profiles[device_type]
        mem = prof.memory
        r = recomputed(num_layers, recompute, recompute_layers)
        lay = self.layer(device_type, tp, r > 0)
        ext = self.extras(device_type, tp, first, last)
        params = num_layers * lay.params + ext.params
        act = in_flight * ((num_layers - r) * lay.activation_bytes + r * lay.checkpoint_bytes)
        if r:
            act += lay.activation_bytes
        comp = self.components(device_type, tp)
        if first:
            act += in_flight * eval_fit(comp["embedding"].activation_bytes, self.micro_batch, self.seq_len)
        if last:
            act += sum(eval_fit(comp[k].activation_bytes, self.micro_batch, self.seq_len) for k in ("norm", "head"))
        # Autocast's bf16 copies of the matrices a step multiplies with (the layers' and the head's; the
        # embedding is a lookup, the norms stay fp32), made once per step and shared by its micro-batches.
        cast = (num_layers * lay.params + (comp["head"].params if last else 0.0)) * mem.cast_bytes
        return MemoryBreakdown(params=params * mem.param_bytes, grads=params * mem.grad_bytes,
                               optimizer=params * mem.optimizer_bytes / max(1, zero_degree),
                               activations=act, overhead=mem.framework_overhead_gib * GIB, casts=cast)

    @memo
    def target_memory_model(self, device_type: str) -> CostModel | None:
        """For a sleep-mode type with ``memory: target`` (runtime/spec/cluster.py ``Emulation``): a cost model
        of the target's model on its profile at ``seq_scale`` times this one's lengths, with the type's
        emulation removed, whose memory is this type's; None for every other type."""
        target = self.sleep_target(device_type)
        if target is None or not target.memory:
            return None
        dt = self.cluster.device_types[device_type]
        types = {**self.cluster.device_types, device_type: dataclasses.replace(dt, emulate=None)}
        profiles = {t: target.profile if t == device_type else self.profiles[t] for t in types}
        return CostModel(target.model, dataclasses.replace(self.cluster, device_types=types), profiles,
                         micro_batch=self.micro_batch, seq_len=self.seq_len * target.seq_scale,
                         step_allreduce=self.step_allreduce, sequence_parallel=self.sequence_parallel)

    def capacity_bytes(self, device: int) -> float:
        return self.cluster.type_of(device).memory_gib * GIB

    # -- communication -------------------------------------------------------------------------------

    @memo
    def link(self, a: int, b: int) -> LinkFit:
        """Latency and bandwidth between two devices: measured if both types measured this host's
        links, else the cluster's link bandwidth times the profiles' efficiency."""
        pa, pb = self.profiles[self._type_of[a]], self.profiles[self._type_of[b]]
        if self._node_of[a] == self._node_of[b] and pa.comm.p2p is not None and pb.comm.p2p is not None:
            return LinkFit(max(pa.comm.p2p.latency_s, pb.comm.p2p.latency_s),
                           min(pa.comm.p2p.bandwidth_gbs, pb.comm.p2p.bandwidth_gbs))
        eff = min(pa.comm.bandwidth_efficiency, pb.comm.bandwidth_efficiency)
        return LinkFit(max(pa.comm.p2p_latency_s, pb.comm.p2p_latency_s), self.cluster.bandwidth_gbs(a, b) * eff)

    def boundary_bytes(self) -> float:
        """Bytes of one micro-batch's hidden states [B, s, h] at a stage boundary (fp32)."""
        return float(self.micro_batch * self.seq_len * self.model.hidden_size * BOUNDARY_BYTES)

    @memo
    def transfer_time(self, a: int, b: int, nbytes: float) -> float:
        """One message of ``nbytes`` from device ``a`` to ``b`` on a link of its own: the profiles' measured
        curves by size and direction where they have them (planner/links.py), else ``link``'s latency +
        bytes / bandwidth."""
        cls = "intra" if self._node_of[a] == self._node_of[b] else "inter"
        curves = curve_seconds(self.profiles[self._type_of[a]].comm.links.get(cls),
                               self.profiles[self._type_of[b]].comm.links.get(cls), nbytes)
        if curves is not None:
            return curves
        lk = self.link(a, b)
        return lk.latency_s + nbytes / (lk.bandwidth_gbs * 1e9)

    @memo
    def boundary_flows(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[Flow, ...]:
        """What the runtime sends from stage ``src`` to stage ``dst`` for one micro-batch: the messages of
        the stage boundary's reshard as runtime/engine/specialize.py ``resolve_boundary`` lays it out
        (equal TP degrees: every rank's full copy to its counterpart; otherwise the BSR's pieces)."""
        if len(src) == len(dst):
            # Equal TP degrees: the layout does not depend on the devices or links (rank i to rank i), so
            # it is resolved once per degree on stand-in devices and mapped back (the planner prices many).
            ids = (*src, *dst)
            return tuple(Flow(ids[f.src], ids[f.dst], f.nbytes) for f in self._boundary_pattern(len(src)))
        return self._resolved_flows(src, dst, self.cluster)

    @memo
    def _boundary_pattern(self, tp: int) -> tuple[Flow, ...]:
        return self._resolved_flows(tuple(range(tp)), tuple(range(tp, 2 * tp)), None)

    def _resolved_flows(self, src: tuple[int, ...], dst: tuple[int, ...], cluster: Cluster | None) -> tuple[Flow, ...]:
        shape = (self.micro_batch, self.seq_len, self.model.hidden_size)
        op = resolve_boundary(Boundary(0, 0, shape, Annotation.spmd(src), Annotation.spmd(dst), 0, 1),
                              cluster).forward  # type: ignore[arg-type]  # None: no links steer the layout
        return tuple(Flow(d, m.peer, float(m.nbytes)) for d in src for m in op.sends(d))

    def p2p_time(self, src: Sequence[int], dst: Sequence[int]) -> float:
        """One activation ([B, s, h] fp32) from stage ``src`` to ``dst``, one direction: the boundary's
        messages posted together, sharing their devices' ports and nodes' NICs (planner/links.py)."""
        return self._p2p_time(tuple(src), tuple(dst))

    @memo
    def _p2p_time(self, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        return concurrent_seconds(self.boundary_flows(src, dst), self.transfer_time, self._node_of, self._nic_of)

    def hop_time(self, strategy: Strategy, src: Sequence[int], dst: Sequence[int]) -> float:
        """One boundary message of ``strategy`` as its run carries it: ``p2p_time``, and on an emulated host
        the delay when the launcher pins its sender and receiver to one core (``HostModel.shared_core_delay``)."""
        return self.p2p_time(src, dst) + self._shared_core_delay(tuple(strategy.devices), tuple(src), tuple(dst))

    @memo
    def _shared_core_delay(self, devices: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        return self.host.shared_core_delay(devices, src, dst)

    def serialises(self, devices: Sequence[int]) -> bool:
        """Whether a transfer's send and receive directions share the link one after the other (the
        profile's ``comm.serialised_send_recv`` of any of ``devices``), else full duplex."""
        return any(self.profiles[self._type_of[d]].comm.serialised_send_recv for d in devices)

    def iteration_time(self, strategy: Strategy) -> float:
        """The measured fixed cost per iteration (launches, synchronisation, logging) of the step: the
        largest among the device types it uses (they wait for each other at the step's end)."""
        return max((self.profiles[self._type_of[d]].iteration_s for d in strategy.devices), default=0.0)

    def allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """One ring all-reduce among ``devices``: measured curves by size where the profiles have them for
        the group's link class (one node, or across nodes), else the measured fit for a same-type group on
        one node for this group size (or the nearest measured size), else per-step latency and the
        slowest link of the ring."""
        return self.allreduce_calls(tuple(devices), (nbytes,))

    def allreduce_calls(self, devices: tuple[int, ...], sizes: Sequence[float], sharers: int = 1) -> float:
        """One all-reduce per entry of ``sizes`` (bytes) among ``devices``, ``sharers`` rings crossing the
        busiest NIC at once (planner/links.py ``ring_sharers``: each carries its bytes over it)."""
        curves = self._allreduce_curves(devices)
        if curves is None:
            return _collective_time(self._allreduce_lines(devices, sharers), sizes)
        n = len(devices)
        return sum(max(2.0 * (n - 1) / n * c.seconds(x * sharers) for c in curves) for x in sizes)

    @memo
    def _allreduce_curves(self, devices: tuple[int, ...]) -> tuple[LinkCurve, ...] | None:
        """The measured all-reduce curve of every type of the group for its link class (nearest measured
        group size); None unless every type has one."""
        if len(devices) <= 1:
            return None
        cls = "intra" if len({self._node_of[d] for d in devices}) == 1 else "inter"
        out = []
        for t in sorted({self._type_of[d] for d in devices}):
            by_size = self.profiles[t].comm.allreduce_curves.get(cls)
            if not by_size:
                return None
            out.append(by_size[min(by_size, key=lambda k: (abs(k - len(devices)), k))])
        return tuple(out)

    @memo
    def _allreduce_lines(self, devices: tuple[int, ...], sharers: int = 1) -> tuple[tuple[float, float], ...]:
        """``allreduce_time`` as lines (seconds, seconds per byte), the time being the slowest of them; a
        ring across nodes shares the NIC with ``sharers - 1`` others."""
        n = len(devices)
        if n <= 1:
            return ((0.0, 0.0),)
        measured = self._measured_fits(devices, lambda prof: prof.comm.allreduce)
        if measured is None:
            types = {self._type_of[d] for d in devices}
            bw = min(self.link(devices[i], devices[(i + 1) % n]).bandwidth_gbs for i in range(n))
            bw /= sharers if len({self._node_of[d] for d in devices}) > 1 else 1
            measured = [(max(self.profiles[t].comm.allreduce_latency_s for t in types) * 2 * (n - 1), bw)]
        return tuple((lat, 2.0 * (n - 1) / n / (bw * 1e9)) for lat, bw in measured)

    @memo
    def _tp_allreduce(self, device_type: str, tp: int, nbytes: float) -> float:
        """An all-reduce inside a TP group of one type on one node (same-node intra bandwidth)."""
        if tp <= 1:
            return 0.0
        prof = self.profiles[device_type]
        curves = prof.comm.allreduce_curves.get("intra")
        if curves:
            curve = curves[min(curves, key=lambda k: (abs(k - tp), k))]
            return 2.0 * (tp - 1) / tp * curve.seconds(nbytes)
        measured = prof.comm.allreduce
        if measured:
            return allreduce_seconds(nbytes, tp, *nearest_fit(measured, tp))
        dt = self.cluster.device_types[device_type]
        bw = dt.intra_node_bandwidth_gbs * prof.comm.bandwidth_efficiency
        return allreduce_seconds(nbytes, tp, prof.comm.allreduce_latency_s * 2 * (tp - 1), bw)

    @memo
    def _tp_allgather(self, device_type: str, tp: int, nbytes: float) -> float:
        """An all-gather of ``nbytes`` (the gathered size) inside a TP group: half an all-reduce's
        traffic, same per-step latency."""
        if tp <= 1:
            return 0.0
        full = self._tp_allreduce(device_type, tp, nbytes)
        base = self._tp_allreduce(device_type, tp, 0.0)
        return base / 2 + (full - base) / 2

    def tensors_per_stage(self, num_layers: int, first: bool, last: bool) -> int:
        """Parameter tensors a stage holds (one gradient all-reduce call each, per LCM slice)."""
        return (num_layers * len(self._layer_tensors) + (len(self._embed_tensors) if first else 0)
                + (len(self._head_tensors) if last else 0))

    def sync_plan(self, strategy: Strategy) -> list[SyncGroup]:
        """The cross-pipeline gradient sync exactly as the runtime lays it out (runtime/comm/gradsync.py
        ``sync_groups``): its device groups in the order it issues them, each with its buckets.

        Every pipeline holds every layer (and the embedding and head), each at its own TP degree; where
        the degrees differ, the SplitAllReduce cuts each gradient into the LCM grid of their shards and
        every slice is all-reduced by the devices that hold it (one per pipeline), norms duplicated inside
        a TP group by the whole group (each replica counted once).
        """
        ids, groups = self._sync_shape(strategy)

        def back(devices: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(ids[i] for i in devices)

        return [SyncGroup(back(g.devices), tuple(dataclasses.replace(b, devices=back(b.devices)) for b in g.buckets))
                for g in groups]

    def _sync_shape(self, strategy: Strategy) -> tuple[tuple[int, ...], tuple[SyncGroup, ...]]:
        """``sync_plan`` before its devices are mapped back: the strategy's device ids in id order and the
        layout of the renumbered plan (devices 0, 1, ...).

        The layout only compares and sorts device ids, so plans of one shape on other devices share it:
        computed once per pattern and mapped back. The search prices many placements of few shapes, and
        pricing needs only each group's devices mapped back (``_group_times``), not every bucket's."""
        ids = tuple(sorted(strategy.devices))
        if len(strategy.pipelines) <= 1:
            return ids, ()  # nothing to sync
        number = {d: i for i, d in enumerate(ids)}
        pattern = tuple(tuple((tuple(number[d] for d in st.devices), st.layers) for st in p.stages)
                        for p in strategy.pipelines)
        cache = self.__dict__.setdefault("_sync_plans", {})
        if pattern not in cache:
            renumbered = dataclasses.replace(strategy, pipelines=tuple(
                dataclasses.replace(p, stages=tuple(dataclasses.replace(st, devices=devices)
                                                    for st, (devices, _) in zip(p.stages, shape)))
                for p, shape in zip(strategy.pipelines, pattern)))
            cache[pattern] = tuple(sync_groups(cut_buckets([self._grad_slices(info, stages)
                                                            for info, stages in placements(renumbered, self.model)])))
        return ids, cache[pattern]

    def _grad_slices(self, info: ParamInfo, stages: tuple[Stage, ...]) -> SliceGroups:
        """One gradient's all-reduce slices where ``stages`` hold it: the same for every tensor of its shape
        and split placed on the same devices, in any plan (so computed once per cost model).

        The runtime's layout only compares and sorts device ids, so it is computed once per pattern (the
        devices renumbered 0, 1, ... in their order) and mapped back: plans that place a tensor on other
        devices the same way share it."""
        memo = self.__dict__.setdefault("_slices", {})
        key = (info.shape, info.tp_dim, tuple(s.devices for s in stages))
        if key not in memo:
            ids = sorted({d for s in stages for d in s.devices})
            number = {d: i for i, d in enumerate(ids)}
            placed = tuple(tuple(number[d] for d in s.devices) for s in stages)
            by_pattern = self.__dict__.setdefault("_slice_patterns", {})
            if (info.shape, info.tp_dim, placed) not in by_pattern:
                renumbered = [Stage(devices, s.layers) for devices, s in zip(placed, stages)]
                by_pattern[info.shape, info.tp_dim, placed] = reduce_slices(
                    held_by(renumbered, info).grad.layout(info.shape))
            memo[key] = tuple(((tuple(ids[i] for i in group), cls), regions)
                              for (group, cls), regions in by_pattern[info.shape, info.tp_dim, placed])
        return memo[key]

    def sync_group_time(self, group: SyncGroup, sharers: int = 1) -> float:
        """One fused all-reduce of a sync group (a call per bucket, as the runtime cuts them), plus packing
        its gradient slices into the buckets and back (measured profiles; the slowest device's);
        ``sharers`` rings crossing its busiest NIC at once (``sync_times``)."""
        return self._sync_seconds(group.devices, group, sharers)

    def _sync_seconds(self, devices: tuple[int, ...], group: SyncGroup, sharers: int = 1) -> float:
        """``sync_group_time`` of ``group``'s buckets all-reduced among ``devices`` (the bucket sizes do not
        depend on which devices hold them: ``_group_times`` prices a renumbered layout so)."""
        grad_bytes = max(self.profiles[self._type_of[d]].memory.grad_bytes for d in devices)
        calls = self.allreduce_calls(devices, [n * grad_bytes for n in group.bucket_numel], sharers)
        pack = 0.0
        for d in devices:
            fit = self.profiles[self._type_of[d]].sync_pack
            pack = max(pack, fit.seconds_per_param * group.numel + fit.seconds_per_tensor * group.slices
                       + fit.fixed_s * len(group.buckets))
        return calls + pack

    def sync_times(self, strategy: Strategy) -> list[float]:
        """Each group of ``sync_plan``'s time, the rings that cross one NIC at the same time sharing it
        (planner/links.py ``ring_sharers``: the TP ranks' rings of a stage)."""
        return self._priced_groups(strategy, self.sync_plan(strategy))

    def _priced_groups(self, strategy: Strategy, plan: Sequence[SyncGroup]) -> list[float]:
        return [self.sync_group_time(g, k)
                for g, k in zip(plan, self._ring_sharers(strategy, [g.devices for g in plan], plan))]

    def _ring_sharers(self, strategy: Strategy, devices: Sequence[tuple[int, ...]],
                      plan: Sequence[SyncGroup]) -> list[int]:
        """Rings run at once where they are the TP ranks' of the same stages (their stages finish their
        backward together) with the same buckets: the signature ``ring_sharers`` compares."""
        stage_of = {d: (pi, k) for pi, p in enumerate(strategy.pipelines) for k, st in enumerate(p.stages)
                    for d in st.devices}
        return ring_sharers([(devs, (tuple(g.bucket_numel), tuple(sorted({stage_of[d] for d in devs}))))
                             for devs, g in zip(devices, plan)], self._node_of, self._nic_of)

    def grad_sync_times(self, strategy: Strategy) -> dict[int, float]:
        """Seconds each device spends in the cross-pipeline gradient sync (its groups one after the
        other, ignoring waits for slower peers; the simulator plays those out)."""
        return self._group_times(strategy, self._sync_seconds)

    def grad_sync_time(self, strategy: Strategy) -> float:
        """The gradient sync's span as the runtime runs it: its groups in one global order, each device joining
        them one after the other and a group's all-reduce starting once its last member has joined (a
        rendezvous, as the simulator plays it), every device ready at once (the estimate adds the span after
        the slowest pipeline). Where the pipelines split the layers alike this is the busiest device's sum
        (``grad_sync_times``); where they do not, a group waits on peers held up by groups of their own, and
        the span can be several times that sum (a 1024-GPU mix of four layouts: 4.3 s against 0.45 s)."""
        return self._group_span(strategy, self._sync_seconds)

    def allgather_time(self, devices: Sequence[int], nbytes: float) -> float:
        """One all-gather of ``nbytes`` (the gathered size) among ``devices``: the measured fit for a
        same-type group on one node when the profiles have one (nearest measured group size, latency scaled
        by ring steps; on gloo an all-gather costs about as much as an all-reduce of the same bytes, not
        half), else a ring's ``n-1`` steps where an all-reduce takes ``2(n-1)``: half its latency and
        traffic."""
        return _collective_time(self._allgather_lines(tuple(devices)), (nbytes,))

    @memo
    def _allgather_lines(self, devices: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        n = len(devices)
        if n <= 1:
            return ((0.0, 0.0),)
        measured = self._measured_fits(devices, lambda prof: prof.comm.allgather)
        if measured is None:
            return tuple((fixed / 2.0, per_byte / 2.0) for fixed, per_byte in self._allreduce_lines(devices))
        return tuple((lat, (n - 1) / n / (bw * 1e9)) for lat, bw in measured)

    def _measured_fits(self, devices: Sequence[int],
                       fits_of: Callable[[DeviceProfile], Mapping[int, LinkFit] | None]
                       ) -> list[tuple[float, float]] | None:
        """(latency s, bandwidth GB/s) of a collective among ``devices`` from measured fits (measured among
        one node's processes): for each type involved the nearest measured group size (``nearest_fit``);
        None when the group spans nodes or some type has no fits."""
        if len({self._node_of[d] for d in devices}) != 1:
            return None
        measured = [fits_of(self.profiles[t]) for t in sorted({self._type_of[d] for d in devices})]
        if not all(measured):
            return None
        return [nearest_fit(fits, len(devices)) for fits in measured]  # type: ignore[arg-type]

    def zero_gather_time(self, group: SyncGroup) -> float:
        """ZeRO-1's parameter all-gather of one sync group after the optimizer step (runtime/engine/zero.py):
        each device sends its updated chunk of every slice the group holds, one all-gather per gradient-sync
        bucket (the parameters, ``param_bytes`` each)."""
        return self._gather_seconds(group.devices, group)

    def _gather_seconds(self, devices: tuple[int, ...], group: SyncGroup, sharers: int = 1) -> float:
        """``zero_gather_time`` of ``group``'s buckets among ``devices`` (as ``_sync_seconds``; NIC sharing is
        not priced for the gathers: ``sharers`` is ignored)."""
        if len(devices) <= 1:
            return 0.0
        param_bytes = max(self.profiles[self._type_of[d]].memory.param_bytes for d in devices)
        return _collective_time(self._allgather_lines(devices), [n * param_bytes for n in group.bucket_numel])

    def zero_gather_times(self, strategy: Strategy, zero: bool = True) -> dict[int, float]:
        """Seconds each device spends in ZeRO-1's all-gathers (its groups one after the other); all zero
        without ZeRO or with one pipeline (nothing is sharded then)."""
        if not zero:
            return {d: 0.0 for d in strategy.devices}
        return self._group_times(strategy, self._gather_seconds)

    def _group_times(self, strategy: Strategy, price: Callable[[tuple[int, ...], SyncGroup, int], float]
                     ) -> dict[int, float]:
        """Each device's sum of ``price(devices, group, sharers)`` over the sync groups it is in (every device of the
        strategy), priced on the renumbered layout with only the groups' devices mapped back. Cached per
        strategy (the estimate asks for the sync and the ZeRO-1 gathers of one plan)."""
        cache = self.__dict__.setdefault("_group_time_cache", {})
        key = (strategy.pipelines, price.__name__)
        hit = cache.get(key)
        if hit is not None:
            return dict(hit)
        ids, groups = self._sync_shape(strategy)
        mapped = [tuple(ids[i] for i in g.devices) for g in groups]
        out = {d: 0.0 for d in strategy.devices}
        for devices, g, k in zip(mapped, groups, self._ring_sharers(strategy, mapped, groups)):
            t = price(devices, g, k)
            for d in devices:
                out[d] += t
        if len(cache) > 4096:   # bounded: the search prices many plans once each
            cache.clear()
        cache[key] = dict(out)
        return out

    def _group_span(self, strategy: Strategy, price: Callable[[tuple[int, ...], SyncGroup, int], float]) -> float:
        """The makespan of the sync groups in their global order under ``price``, each a rendezvous of its
        members (``grad_sync_time``); cached per strategy as ``_group_times``."""
        cache = self.__dict__.setdefault("_group_span_cache", {})
        key = (strategy.pipelines, price.__name__)
        hit = cache.get(key)
        if hit is not None:
            return hit
        ids, groups = self._sync_shape(strategy)
        mapped = [tuple(ids[i] for i in g.devices) for g in groups]
        ready: dict[int, float] = {}
        for devices, g, k in zip(mapped, groups, self._ring_sharers(strategy, mapped, groups)):
            end = max(ready.get(d, 0.0) for d in devices) + price(devices, g, k)
            ready.update(dict.fromkeys(devices, end))
        if len(cache) > 4096:   # bounded: the search prices many plans once each
            cache.clear()
        span = cache[key] = max(ready.values(), default=0.0)
        return span

    # -- optimizer -----------------------------------------------------------------------------------

    def optimizer_time(self, device_type: str, params: float, zero_degree: int = 1, tensors: int = 0) -> float:
        """One AdamW step over ``params`` local parameters in ``tensors`` tensors (``params / zero_degree``
        with ZeRO-1)."""
        opt = self.profiles[device_type].optimizer
        return opt.seconds_per_param * params / max(1, zero_degree) + opt.seconds_per_tensor * tensors + opt.fixed_s

    def step_overhead_time(self, device_type: str, params: float, tensors: int = 0) -> float:
        """A step's own code outside its compute and comm spans on one device (gradients collected and
        reset, the global norm summed tensor by tensor): measured profiles only, never stretched."""
        fit = self.profiles[device_type].step_overhead
        return fit.seconds_per_param * params + fit.seconds_per_tensor * tensors + fit.fixed_s

    def step_overhead_times(self, strategy: Strategy) -> dict[int, float]:
        return {d: self.step_overhead_time(self._type_of[d], n, tensors)
                for d, (n, tensors) in self.device_params(strategy).items()}

    def clip_time(self, devices: Sequence[int]) -> float:
        """The per-step all-reduce of loss and gradient norm (for clipping) over every device."""
        if not self.step_allreduce or len(devices) <= 1:
            return 0.0
        return self.allreduce_time(list(devices), 8.0)

    # -- pipeline schedules (runtime/pipeline_schedules.py) ---------------------------------------------

    @memo
    def chunk_cost(self, device_type: str, tp: int, num_layers: int, first: bool, last: bool,
                   recompute: bool = False, recompute_layers: int = 0) -> ChunkCost:
        """One micro-batch through one model chunk as the list scheduler times it: F, and the backward
        split into B (input gradients, what the previous chunk waits for) and W (weight gradients) by
        ``weight_grad_fraction`` of its backward compute; the fused backward is ``stage``'s. As the engine
        runs them (docs/schedules.md, the executor): the chunk holding layer 0 has no input gradient, its W
        is its whole backward; a chunk recomputing all its layers runs W as a second backward through the
        graph B kept; one recomputing some (partial recompute) computes their weight gradients in B."""
        r = recomputed(num_layers, recompute, recompute_layers)
        sc = self.stage(device_type, tp, num_layers, first, last, recompute_layers=r)
        tiny = 1e-6 * sc.backward_s   # ChunkCost wants both halves positive
        if self.sleep_target(device_type) is not None:
            # Sleep emulation prices each half at its share of the backward block (runtime/trace.py
            # stage_block_targets): what the emulated device then takes.
            half = SPLIT_BACKWARD_SHARE * sc.backward_s
            return ChunkCost(forward=sc.forward_s, input_grad=half, weight_grad=half, full_backward=sc.backward_s)
        if first:   # the engine runs the first chunk's W as its whole backward: it has no input gradient
            return ChunkCost(forward=sc.forward_s, input_grad=tiny, weight_grad=sc.backward_s - tiny,
                             full_backward=sc.backward_s)
        split = None if r else self._split_backward(device_type, tp, num_layers, last)
        if split is not None:   # measured: the two autograd passes cost more than the fused backward
            return ChunkCost(forward=sc.forward_s, input_grad=max(tiny, split[0]) + sc.tp_backward_s,
                             weight_grad=max(tiny, split[1]), full_backward=sc.backward_s)
        rerun = r * self.layer(device_type, tp, True).recompute_s
        backward_compute = sc.compute_s - (sc.forward_s - sc.tp_forward_s) - rerun
        partial = r if r < num_layers else 0
        w = weight_grad_fraction(self.model, self.seq_len, num_layers, last, partial) * max(0.0, backward_compute)
        w = min(max(w, tiny), sc.backward_s - tiny)
        b = sc.backward_s - w
        if r == num_layers:   # ... and a recompute chunk's W as one more backward through the kept graph
            w = max(tiny, backward_compute)
        return ChunkCost(forward=sc.forward_s, input_grad=b, weight_grad=w, full_backward=sc.backward_s)

    def _split_backward(self, device_type: str, tp: int, num_layers: int, last: bool) -> tuple[float, float] | None:
        """(B, W) compute seconds of a chunk without the embedding as the profile measured a split backward
        (``MeasuredModel.split_blocks``), or None where it did not."""
        m = self._measured(device_type)
        split = None if m is None else m.split_blocks.get(tp)
        if split is None:
            return None
        b, s = self._shape(None, None)
        parts = [split["stage"]] + ([split["head"]] if last else [])
        return tuple(num_layers * eval_fit(getattr(split["layer"], f), b, s)  # type: ignore[return-value]
                     + sum(eval_fit(getattr(p, f), b, s) for p in parts) for f in ("forward_s", "backward_s"))

    @memo
    def placed_chunk_cost(self, device_type: str, tp: int, start: int, stop: int,
                          recompute_layers: int = 0) -> ChunkCost:
        """``chunk_cost`` of the chunk holding decoder layers [start, stop), with the profile's per-layer
        overrides (``placed_stage``): F moves by their forward difference, B and W share the backward's in
        their own proportion."""
        n, first, last = stop - start, start == 0, stop == self.model.num_layers
        cc = self.chunk_cost(device_type, tp, n, first, last, recompute_layers=recompute_layers)
        placed = self.placed_stage(device_type, tp, ((start, stop),), first, last, recompute_layers=recompute_layers)
        plain = self.stage(device_type, tp, n, first, last, recompute_layers=recompute_layers)
        d_f, d_b = placed.forward_s - plain.forward_s, placed.backward_s - plain.backward_s
        if not (d_f or d_b):
            return cc
        grow = 1.0 + d_b / (cc.input_grad + cc.weight_grad)
        return ChunkCost(forward=cc.forward + d_f, input_grad=cc.input_grad * grow, weight_grad=cc.weight_grad * grow,
                         full_backward=None if cc.full_backward is None else cc.full_backward + d_b)

    def pipeline_costs(self, strategy: Strategy, pi: int, schedule: Schedule) -> Costs:
        """The list scheduler's costs of pipeline ``pi``: per stage and chunk its ``chunk_cost`` (the chunk
        holding layer 0 carries the embedding, the one holding the last layer the head), per virtual-stage
        boundary one activation's transfer (the slower direction; 0 where both sit on one stage)."""
        pipe = strategy.pipelines[pi]
        chunks = []
        for st in pipe.stages:
            dtype = self._type_of[st.devices[0]]
            chunks.append(tuple(self.placed_chunk_cost(dtype, st.tp, a, b, recompute_layers=st.chunk_recompute(c))
                                for c, (a, b) in enumerate(st.layers)))
        layout = schedule_layout(schedule, len(pipe.stages), pipe.stages[0].chunks)
        chunks = self._with_executor_costs(pipe, layout, chunks)
        boundary = []
        for j in range(layout.num_stages - 1):
            a, b = pipe.stages[layout.device(j)], pipe.stages[layout.device(j + 1)]
            boundary.append(0.0 if a is b else max(self.hop_time(strategy, a.devices, b.devices),
                                                   self.hop_time(strategy, b.devices, a.devices)))
        return Costs(tuple(chunks), tuple(boundary))

    @memo
    def _executor_figures(self, device_type: str) -> tuple[P2pActions | None, float]:
        """(CPU per boundary message, lateness of an emulated sleep after a block: 0 unless stretched; a
        sleep-mode block ends at its target, runtime/trace.py ``EmulatedTarget``)."""
        h = self.host.core_handoff(device_type) if self.host.emulated_slowdown(device_type) > 1.0 else None
        return self.host.p2p_actions(device_type), 0.0 if h is None else h.sleep_late_s

    def _with_executor_costs(self, pipe: Pipeline, layout: Layout, chunks: list[tuple[ChunkCost, ...]]
                             ) -> list[tuple[ChunkCost, ...]]:
        """``chunks`` with what the executor adds to the ops, as the simulator plays it on the stage's own
        timeline (measured; nothing without the figures): the CPU per boundary message
        (``HostModel.p2p_actions``) in the ops that send or receive it (a virtual stage's F receives its
        input, post and wait, from the previous one and sends its output to the next, its B or fused BW the
        reverse; W sends nothing; a neighbour on the same device, the bottom of a V, is handed over in
        memory), and on an emulated slower device the lateness of the sleep after each block
        (``CoreHandoff.sleep_late_s``: every F, B, W and BW is one block)."""
        figures = [self._executor_figures(self._type_of[st.devices[0]]) for st in pipe.stages]
        per_stage, late = [f[0] for f in figures], [f[1] for f in figures]
        if all(a is None for a in per_stage) and not any(late):   # (spec and GPU profiles: the search's case)
            return chunks
        out = [list(row) for row in chunks]
        last = layout.num_stages - 1
        for j in range(layout.num_stages):
            d, c = layout.device(j), layout.chunk(j)
            acts = per_stage[d]
            f = b = late[d]
            cc = out[d][c]
            if acts is not None:
                before = j > 0 and layout.device(j - 1) != d     # F receives, B sends
                after = j < last and layout.device(j + 1) != d   # F sends, B receives
                dtype = self._type_of[pipe.stages[d].devices[0]]
                f += self._actions_s(acts, dtype, cc.forward, before, after)
                b += self._actions_s(acts, dtype, cc.input_grad, after, before)
            if f or b:
                # A fused BW is one block (one sleep), a split backward two (B and W).
                out[d][c] = dataclasses.replace(cc, forward=cc.forward + f, input_grad=cc.input_grad + b,
                                                weight_grad=cc.weight_grad + late[d],
                                                full_backward=cc.input_grad + cc.weight_grad + b
                                                if cc.full_backward is None else cc.full_backward + b)
        return [tuple(row) for row in out]

    def _actions_s(self, acts: P2pActions, device_type: str, block_s: float, receives: bool, sends: bool) -> float:
        """The executor's CPU around one block of ``block_s`` that receives and / or sends a boundary
        message: its send and its receive's unpacking each after the device idled as long as such a block
        leaves it idle (a sleep-mode block all of it, a stretched one its sleep), the receive's post hot (a
        stage posts it with the tick's other messages, right after a send or at the step's start). The
        simulator plays the real idle before each action."""
        k = self.host.emulated_slowdown(device_type)
        idle = block_s if self.host.sleeps_to_target(device_type) else (k - 1.0) / k * block_s
        cold: list[P2pAction] = (["wait_recv"] if receives else []) + (["post_send"] if sends else [])
        return sum(acts.after_idle(a, idle) for a in cold) + (acts.hot("post_recv") if receives else 0.0)

    def pipeline_step_time(self, strategy: Strategy, pi: int, schedule: Schedule) -> float:
        """Pipeline ``pi``'s part of the step under its schedule (``schedule`` unless it names its own): the
        action lists the runtime executes (``runtime_schedule``) played with the real op costs
        (played from their op order, ``play_order``, which gives the number the lists give
        without deriving the lists or building the timeline), cached."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        costs = self.pipeline_costs(strategy, pi, name)
        key = self._schedule_key(pipe, name)
        layout = schedule_layout(name, len(pipe.stages), pipe.stages[0].chunks)
        kinds = op_kinds(name)
        full = self.__dict__.get("_runtime_schedules", {}).get(key)
        orders = self.__dict__.setdefault("_runtime_orders", {})
        if key not in orders:
            orders[key] = timeline_order(layout, kinds, full.timeline) if full is not None else \
                plan_order(pipe, name, pipe.micro_batches)
        order = orders[key]
        cache = self.__dict__.setdefault("_step_times", {})
        played = (id(order), costs)
        if played not in cache:
            cache[played] = play_order(layout, kinds, order, costs)
        return cache[played]

    def pipeline_step_bound(self, strategy: Strategy, pi: int, schedule: Schedule) -> float:
        """A lower bound of ``pipeline_step_time`` that builds no lists (``step_time_bound``): a search that
        compares exact prices skips the plans this shows cannot win."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        return step_time_bound(name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks,
                               self.pipeline_costs(strategy, pi, name))

    def ideal_step_time(self, strategy: Strategy, pi: int, schedule: Schedule) -> float:
        """The list scheduler run on the priced costs, transfers included (``step_time``): what
        ``pipeline_step_time`` would be if the runtime's lists were ordered knowing the transfer times and
        the fused backward. The runtime orders by the plan's op costs without those (else by layer counts:
        docs/schedules.md, "Costs in the plan"), so the two can differ."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        costs = self.pipeline_costs(strategy, pi, name)
        key = (name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks, costs, pipe.activation_limits)
        cache = self.__dict__.setdefault("_ideal_times", {})
        if key not in cache:
            cache[key] = step_time(name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks, costs,
                                   pipe.activation_limits)
        return cache[key]

    def runtime_schedule(self, strategy: Strategy, pi: int, schedule: Schedule) -> PipelineSchedule:
        """The ``Schedule`` the runtime executes for pipeline ``pi`` (``schedule`` the default unless it names
        its own): ``plan_schedule``, the function ``StrategyHandle.pipeline_schedule`` builds it by, from the
        pipeline's layers and ``op_costs`` (planned strategies carry them: ``with_op_costs``), cached."""
        pipe = strategy.pipelines[pi]
        if pipe.schedule is not None:
            schedule = pipe.schedule
        key = self._schedule_key(pipe, schedule)
        cache = self.__dict__.setdefault("_runtime_schedules", {})
        if key not in cache:
            cache[key] = plan_schedule(pipe, schedule, pipe.micro_batches)
        return cache[key]

    @staticmethod
    def _schedule_key(pipe: Pipeline, schedule: Schedule) -> tuple:
        """What ``plan_schedule`` builds a pipeline's lists from. With every stage's op costs the lists
        depend on them, not on which layers the chunks hold."""
        costed = all(st.op_costs is not None for st in pipe.stages)
        return (schedule, pipe.micro_batches, pipe.transfer_costs, pipe.activation_limits,
                tuple(st.op_costs if costed else (st.layers, st.op_costs) for st in pipe.stages))

    def stage_op_costs(self, st: Stage) -> tuple[OpCosts, ...]:
        """A stage's ``op_costs`` for the plan: each chunk's ``chunk_cost`` (F, B, W), the numbers the
        estimate prices, so that the runtime orders its lists by them."""
        dtype = self._type_of[st.devices[0]]
        out = []
        for k, (a, b) in enumerate(st.layers):
            c = self.placed_chunk_cost(dtype, st.tp, a, b, recompute_layers=st.chunk_recompute(k))
            out.append((c.forward, c.input_grad, c.weight_grad))
        return tuple(out)

    def costed_pipeline(self, pipe: Pipeline, schedule: Schedule) -> Pipeline:
        """``pipe`` with the costs the planner writes into a plan, so that the runtime orders its lists by
        them: each stage's ``op_costs`` (``stage_op_costs``) and the pipeline's ``transfer_costs``
        (``pipeline_costs``' boundaries), under its own schedule, else ``schedule``."""
        name = pipe.schedule if pipe.schedule is not None else schedule
        stages = tuple(dataclasses.replace(st, op_costs=self.stage_op_costs(st)) for st in pipe.stages)
        bare = dataclasses.replace(pipe, stages=stages, transfer_costs=None)
        boundary = self.pipeline_costs(Strategy(name="pipeline", pipelines=(bare,)), 0, name).boundary
        return dataclasses.replace(bare, transfer_costs=boundary)

    def with_op_costs(self, strategy: Strategy, schedule: Schedule) -> Strategy:
        """``strategy`` with every pipeline's costs (``costed_pipeline``): what the planner writes, and so
        what it prices (docs/design.md §10)."""
        return dataclasses.replace(strategy, pipelines=tuple(self.costed_pipeline(p, schedule)
                                                             for p in strategy.pipelines))

    def pipeline_proxy_time(self, strategy: Strategy, pi: int) -> float:
        """1F1B's closed form (``pipeline_time``) on pipeline ``pi``'s whole stages: a cheap ranking proxy
        for the list scheduler's time (``pipeline_step_time``), which the best plans then get."""
        pipe = strategy.pipelines[pi]
        stages = [self.stage_total(s) for s in pipe.stages]
        boundary = [self.hop_time(strategy, a.devices, b.devices) + self.hop_time(strategy, b.devices, a.devices)
                    for a, b in zip(pipe.stages, pipe.stages[1:])]
        return pipeline_time([s.forward_s for s in stages], [s.backward_s for s in stages], pipe.micro_batches,
                             "1f1b", boundary)

    @memo
    def chunk_activation_bytes(self, device_type: str, tp: int, num_layers: int, first: bool,
                               recompute: bool, recompute_layers: int = 0) -> float:
        """Bytes one micro-batch's activation of a chunk keeps until its backward (W under a split
        backward): each layer's saved tensors (only its input where it recomputes), and the embedding's."""
        target = self.target_memory_model(device_type)
        if target is not None:
            return target.chunk_activation_bytes(device_type, tp, num_layers, first, recompute, recompute_layers)
        r = recomputed(num_layers, recompute, recompute_layers)
        lay = self.layer(device_type, tp, r > 0)
        act = (num_layers - r) * lay.activation_bytes + r * lay.checkpoint_bytes
        if first:
            act += eval_fit(self.components(device_type, tp)["embedding"].activation_bytes, self.micro_batch,
                            self.seq_len)
        return act

    @memo
    def device_memory(self, device_type: str, tp: int, chunks: tuple[tuple[int, bool, bool], ...],
                      recompute: bool, live_chunks: int, zero_degree: int = 1,
                      recompute_layers: tuple[int, ...] | None = None) -> MemoryBreakdown:
        """Peak bytes on one device of a stage holding ``chunks`` ((layers, first, last) each) with at most
        ``live_chunks`` chunk activations alive (``live_activation_limit``): each counted at the largest
        chunk's size, so it bounds any order the scheduler picks. One chunk is ``stage_memory``.
        ``recompute_layers``: per chunk, how many of its layers recompute (``Stage.chunk_recompute``)."""
        base, per = self._memory_parts(device_type, tp, chunks, recompute, zero_degree, recompute_layers)
        return dataclasses.replace(base, activations=base.activations + live_chunks * per)

    def device_memory_total(self, device_type: str, tp: int, chunks: tuple[tuple[int, bool, bool], ...],
                            recompute: bool, live_chunks: int, zero_degree: int = 1,
                            recompute_layers: tuple[int, ...] | None = None) -> float:
        """``device_memory(...).total``, the same float, without building the breakdown: the layer split's
        memory tables (planner/layer_split.py) ask it for every layer count at every activation bound."""
        base, per = self._memory_parts(device_type, tp, chunks, recompute, zero_degree, recompute_layers)
        return base.total_with(base.activations + live_chunks * per)

    @memo
    def _memory_parts(self, device_type: str, tp: int, chunks: tuple[tuple[int, bool, bool], ...],
                      recompute: bool, zero_degree: int, recompute_layers: tuple[int, ...] | None
                      ) -> tuple[MemoryBreakdown, float]:
        """``device_memory`` without its live activations, and the bytes of one (the largest chunk's): the
        part shared by every activation bound."""
        # Written out (no generator per sum, any and max: the layer split's tables call this 140 000 times at
        # 64 GPUs); the same sums, truth values and first largest value.
        n, first, last = 0, False, False
        for k, f, la in chunks:
            n += k
            if f:
                first = True
            if la:
                last = True
        rc = recompute_layers if recompute_layers is not None else (0,) * len(chunks)
        base = self.stage_memory(device_type, tp, n, first, last, recompute, 0, zero_degree, sum(rc))
        per = None
        for (k, f, _), r in zip(chunks, rc):
            b = self.chunk_activation_bytes(device_type, tp, k, f, recompute, r)
            if per is None or b > per:
                per = b
        if per is None:
            raise ValueError("max() arg is an empty sequence")   # (as max raised: no chunks)
        return base, per

    def pipeline_memory(self, strategy: Strategy, pi: int, schedule: Schedule, zero_degree: int = 1
                        ) -> list[MemoryBreakdown]:
        """``device_memory`` of each stage of pipeline ``pi`` under ``schedule``: its documented bound, or the
        pipeline's raised ``activation_limits`` (``device_limits``: the bound its lists are built under)."""
        pipe = strategy.pipelines[pi]
        n_layers, n = self.model.num_layers, len(pipe.stages)
        limits = device_limits(schedule, n, pipe.micro_batches, pipe.stages[0].chunks, pipe.activation_limits)
        out = []
        for k, st in enumerate(pipe.stages):
            live = limits[k]
            chunks = tuple((b - a, a == 0, b == n_layers) for a, b in st.layers)
            out.append(self.device_memory(self._type_of[st.devices[0]], st.tp, chunks, st.recompute, live,
                                          zero_degree, stage_recompute(st)))
        return out

    # -- whole strategy ------------------------------------------------------------------------------

    def holds_ends(self, st: Stage) -> tuple[bool, bool]:
        """Whether a stage holds the embedding (a chunk starts at layer 0) and the head (one ends at the
        last layer): under ZB-V both sit on the first stage."""
        return any(a == 0 for a, _ in st.layers), any(b == self.model.num_layers for _, b in st.layers)

    def stage_total(self, st: Stage) -> StageCost:
        """One micro-batch through every chunk of a stage (``stage`` per chunk, summed)."""
        dtype, n_layers = self._type_of[st.devices[0]], self.model.num_layers
        parts = [self.placed_stage(dtype, st.tp, ((a, b),), a == 0, b == n_layers,
                                   recompute_layers=st.chunk_recompute(c)) for c, (a, b) in enumerate(st.layers)]
        if len(parts) == 1:
            return parts[0]
        return StageCost(*(sum(getattr(c, f.name) for c in parts) for f in dataclasses.fields(StageCost)))

    def pipeline_estimate(self, strategy: Strategy, pi: int, schedule: Schedule = "1f1b",
                          time_s: float | None = None) -> PipelineEstimate:
        """Pipeline ``pi`` under its own schedule (``Pipeline.schedule``), else ``schedule``; ``time_s``
        given: its time, instead of ``pipeline_step_time``."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        stages = tuple(self.stage_total(s) for s in pipe.stages)
        boundary = tuple(self.hop_time(strategy, a.devices, b.devices) + self.hop_time(strategy, b.devices, a.devices)
                         for a, b in zip(pipe.stages, pipe.stages[1:]))
        t = self.pipeline_step_time(strategy, pi, name) if time_s is None else time_s
        return PipelineEstimate(pipe.micro_batches, stages, boundary, t, name, pipe.stages[0].chunks)

    def strategy_memory(self, strategy: Strategy, schedule: Schedule = "1f1b",
                        zero: int = 0) -> dict[int, MemoryBreakdown]:
        """Peak memory of every device the strategy uses (ZeRO-1 shards over the pipelines), each pipeline
        under its own schedule's activation bound (``pipeline_memory``)."""
        zd = zero_degree(len(strategy.pipelines), zero)
        out = {}
        for pi, pipe in enumerate(strategy.pipelines):
            name = pipe.schedule if pipe.schedule is not None else schedule
            for s, mem in zip(pipe.stages, self.pipeline_memory(strategy, pi, name, zd)):
                for d in s.devices:
                    out[d] = mem
        return out

    def device_params(self, strategy: Strategy) -> dict[int, tuple[int, int]]:
        """(local parameters, parameter tensors) of every device the strategy uses."""
        out = {}
        for pipe in strategy.pipelines:
            for s in pipe.stages:
                first, last = self.holds_ends(s)
                params = self.stage(self._type_of[s.devices[0]], s.tp, s.num_layers, first, last).params
                tensors = self.tensors_per_stage(s.num_layers, first, last)
                for d in s.devices:
                    out[d] = (params, tensors)
        return out

    def optimizer_times(self, strategy: Strategy, zero: int = 0) -> dict[int, float]:
        """One AdamW step per device: measured per-component optimizer seconds (profile tables) where the
        profile has them for its stage, else the per-parameter fit."""
        zd = zero_degree(len(strategy.pipelines), zero)
        out = {d: self.optimizer_time(self._type_of[d], n, zd, tensors)
               for d, (n, tensors) in self.device_params(strategy).items()}
        for pipe in strategy.pipelines:
            for k, st in enumerate(pipe.stages):
                t = table_optimizer_s(self.profiles[self._type_of[st.devices[0]]], self.model, st.tp, st.num_layers,
                                      k == 0, k == len(pipe.stages) - 1)
                if t is not None:
                    out.update(dict.fromkeys(st.devices, t / zd))
        return out

    def mfu(self, step_time_s: float, global_batch: int, devices: Iterable[int]) -> float:
        """Model FLOPs per second over the datasheet peak of the devices used."""
        peak = sum(self.cluster.type_of(d).peak_bf16_tflops for d in devices) * 1e12
        flops = model_flops_per_token(self.model, self.seq_len) * global_batch * self.seq_len
        return flops / step_time_s / peak if step_time_s > 0 and peak > 0 else 0.0

    def estimate(self, strategy: Strategy, global_batch: int, schedule: Schedule = "1f1b",
                 zero: int = 0, *, pipeline_s: Sequence[float] | None = None) -> StrategyEstimate:
        """Step time and memory of a strategy: ``max over pipelines (pipeline_step_time: the list scheduler on
        the real op costs) + gradient sync + clip + max over devices (step overhead + optimizer + ZeRO-1
        parameter all-gathers) + the fixed cost per iteration``; each pipeline under its own schedule, else
        ``schedule``.

        ``pipeline_s``: the pipelines' times from the caller instead of the list scheduler (a search ranking
        many plans prices them by a proxy, ``pipeline_proxy_time``, and only the best ones exactly)."""
        pipes = tuple(self.pipeline_estimate(strategy, i, schedule, None if pipeline_s is None else pipeline_s[i])
                      for i in range(len(strategy.pipelines)))
        sync = self.grad_sync_time(strategy)
        over = self.step_overhead_times(strategy)
        gather = self.zero_gather_times(strategy, zero)
        opt = max(t + over[d] + gather[d] for d, t in self.optimizer_times(strategy, zero).items())
        clip = self.clip_time(strategy.devices)
        step = max(p.time_s for p in pipes) + sync + clip + opt + self.iteration_time(strategy)
        memory = self.strategy_memory(strategy, schedule, zero)
        cap = {d: self.cluster.type_of(d).memory_gib for d in memory}
        oom = tuple(sorted(d for d, m in memory.items() if m.total > cap[d] * GIB))
        return StrategyEstimate(
            step_time_s=step, pipelines=pipes, grad_sync_s=sync, optimizer_s=opt + clip,
            tokens_per_s=global_batch * self.seq_len / step, mfu=self.mfu(step, global_batch, strategy.devices),
            memory=memory, capacity_gib=cap, oom_devices=oom,
            extra={"zero_gather_s": max(gather.values(), default=0.0)})
