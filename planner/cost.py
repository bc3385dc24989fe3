"""The cost model: time and memory of a strategy on a cluster, from device profiles.

Everything the planner, the simulator and the reports know about speed and memory comes from here.

Quick start::

    from planner.cost import CostModel
    from runtime.torchfree.profiling.profile import resolve_profiles

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
  pieces), its messages sharing ports and NICs (planner/costmodel/network.py); ``transfer_time(a, b, nbytes)`` one
  message (measured link curves, else ``link(a, b)``'s latency and bandwidth); ``serialises(devices)``
  whether a tick's sends and receives serialise, as the profile says (``tick_seconds``, planner/costmodel/network.py).
* ``allreduce_time(devices, nbytes)``: one ring all-reduce (measured curves by size for its link class,
  across nodes too, when the profiles have them).
* ``sync_plan(strategy) -> [SyncGroup]``: the cross-pipeline gradient sync exactly as the runtime lays it
  out (runtime/torchfree/comm/gradsync.py: its device groups in its order, each with its buckets; SplitAllReduce LCM
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
* ``stage_chunk(stage, chunk) -> (StageCost, ChunkCost)``: one chunk of a plan's stage as the estimate, the
  plan's op costs, the list scheduler and the simulator price it: ``placed_stage``, with a mixture-of-experts
  model's MoE layers as the stage runs them (planner/costmodel/moe.py: TP-split experts, or expert parallelism
  by the stage's ``experts``, its devices' speeds, the router's skew and the all-to-alls over their links).

Fidelity notes: compute comes from a measured profile's stage blocks when it has them (one decoder
layer, a stage's fixed time per micro-batch, what the embedding and head add, timed through the
runtime's stage module as the engine runs a micro-batch: ``MeasuredModel.blocks``), else from the sum of
the components. TP collectives are priced from the measured TP overhead per block (DTensor dispatch and
collectives: ``tp_blocks``, ``tp_blocks_sp`` for a sequence-parallel plan where the profile has them, or
per layer ``tp_overhead`` in older profiles) when there is one, else
counted (2 all-reduces forward, 2 backward per layer, as the runtime lays Megatron TP out).
``step_overhead_time`` (the step's code outside its spans) and the gradient sync's packing
(``sync_group_time``) come from measured profiles too.

Pure formulas (module level): ``pipeline_time`` (1F1B's closed form ``(m-1)*max(t) + sum(t) +
sum(boundary comm)``, GPipe's on forward and backward separately: ranking proxies, e.g.
``pipeline_proxy_time``), ``play_order``, ``weight_grad_fraction``, ``allreduce_seconds``,
``model_flops_per_token`` (for MFU).

Where a profile has measured fits for this model's shape and TP degree, they are used as measured;
otherwise the component costs are derived from the profile's throughput figures and the model's
FLOPs and bytes (``analytic_components``, runtime/torchfree/profiling/profile.py ``component_fits``). Both paths
yield the same ``ComponentFit`` records. A sleep-mode emulated type (runtime/torchfree/spec/cluster.py ``Emulation``)
is priced by its target instead: ``stage`` gives what its ``SleepTarget`` (planner/costmodel/targets.py)
prices each forward / backward block at, the prices the CLI's harness (hetu_cli/emulation.py) hands the
runtime as the blocks' targets.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from planner.costmodel.base import (
    GIB,
    LayerCost,
    MemoryBreakdown,
    PipelineEstimate,
    StageCost,
    StrategyEstimate,
    has_tp_stage,
    memo,
    model_flops_per_token,
    model_flops_utilization,
    recomputed,
    stage_recompute,
    zero_copies,
    zero_degree,
    zero_fields,
)
from planner.costmodel.compute import ComputeCosts
from planner.costmodel.memory import MemoryCosts
from planner.costmodel.moe import MoeCosts
from planner.costmodel.network import NetworkCosts, allreduce_seconds
from planner.costmodel.schedule import ScheduleCosts, pipeline_time, play_order, timeline_order, weight_grad_fraction
from runtime.torchfree.models.decoders import model_parameters
from runtime.torchfree.profiling.profile import (
    DeviceProfile,
    ProfileSet,
    table_optimizer_s,
)
from runtime.torchfree.spec.catalog import PlanContext
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import PLAN_VERSION, Plan, Schedule, Stage, Strategy, TrainingSettings

# What callers import from here: the facade, its records and the formulas they share with it.
__all__ = ["CostModel", "GIB", "LayerCost", "MemoryBreakdown", "PipelineEstimate", "StageCost", "StrategyEstimate",
           "allreduce_seconds", "has_tp_stage", "memo", "model_flops_per_token", "model_flops_utilization",
           "pipeline_time", "planner_handle", "play_order", "recomputed", "stage_recompute", "timeline_order",
           "weight_grad_fraction", "zero_copies", "zero_degree", "zero_fields"]


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


class CostModel(ComputeCosts, MemoryCosts, NetworkCosts, ScheduleCosts, MoeCosts):
    """Costs of one model on one cluster at one micro-batch shape. Cheap to build; caches as it goes."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                 *, micro_batch: int, seq_len: int, step_allreduce: bool = True,
                 sequence_parallel: bool = False) -> None:
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
        self._type_of = [d.type for d in cluster.devices]
        self._node_of = [d.node for d in cluster.devices]
        self._nic_of = [cluster.nic_of(d.id) for d in cluster.devices]
        # One decoder layer's tensors (a MoE model's: a MoE layer's, router and experts included).
        moe = None if model.moe is None else dataclasses.replace(model.moe, dense_layers=(), sparse_step=1)
        params = model_parameters(dataclasses.replace(model, num_layers=1, moe=moe))
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

    # -- whole strategy ------------------------------------------------------------------------------

    def holds_ends(self, st: Stage) -> tuple[bool, bool]:
        """Whether a stage holds the embedding (a chunk starts at layer 0) and the head (one ends at the
        last layer): under ZB-V both sit on the first stage."""
        return any(a == 0 for a, _ in st.layers), any(b == self.model.num_layers for _, b in st.layers)

    def stage_total(self, st: Stage) -> StageCost:
        """One micro-batch through every chunk of a stage (``stage`` per chunk, summed)."""
        parts = [self.stage_chunk(st, c)[0] for c in range(st.chunks)]
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
        boundary = tuple(self.p2p_time(a.devices, b.devices) + self.p2p_time(b.devices, a.devices)
                         for a, b in zip(pipe.stages, pipe.stages[1:]))
        t = self.pipeline_step_time(strategy, pi, name) if time_s is None else time_s
        return PipelineEstimate(pipe.micro_batches, stages, boundary, t, name, pipe.stages[0].chunks)

    def device_params(self, strategy: Strategy) -> dict[int, tuple[int, int]]:
        """(local parameters, parameter tensors) of every device the strategy uses."""
        out = {}
        for pipe in strategy.pipelines:
            for s in pipe.stages:
                first, last = self.holds_ends(s)
                params = self.stage(self.stage_type(s), s.tp, s.num_layers, first, last).params
                tensors = self.tensors_per_stage(s.num_layers, first, last)
                for d in s.devices:
                    out[d] = (round(params + self.ep_params(s, d)), tensors)
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
        return model_flops_utilization(self.model, self.cluster, devices, self.seq_len, global_batch * self.seq_len,
                                       step_time_s)

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
        sync = self.grad_sync_time(strategy) + self.load_sync_time(strategy)
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
