"""Graph specialization as a pure function: strategy + device -> what that device holds and does.

Nothing here touches torch, so ``hspmd show --device N`` and the unit tests can ask what a device's
program is without starting a world. ``specialize`` derives it once, as a ``DevicePlan``; the executor
(program.py) builds from that record and ``describe_program`` (describe.py) prints it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.torchfree.annotations.from_plan import Boundary, StrategyAnnotations, strategy_annotations
from runtime.torchfree.comm.bsr import FLOAT32
from runtime.torchfree.comm.gradsync import SyncBucket, plan_sync
from runtime.torchfree.comm.resolve import CommOp, resolve
from runtime.torchfree.engine.zero import (
    MomentPiece,
    ZeroBucket,
    ZeroSlice,
    moment_pieces,
    strategy_zero_slices,
    zero_buckets,
)
from runtime.torchfree.models.decoders import model_parameters
from runtime.torchfree.models.params import ParamInfo
from runtime.torchfree.pipeline_schedules import Action, Compute
from runtime.torchfree.schedule_policies import Layout
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Pipeline

BOUNDARY_DTYPE = FLOAT32  # the residual stream stays fp32 under autocast; sent as such


@dataclass(frozen=True)
class ChunkRole:
    """One model chunk of a stage: a virtual stage of the pipeline, built as a module of its own."""

    chunk: int  # local index on the device (the schedule's ``Compute.chunk``)
    stage: int  # virtual stage j (the schedule's ``Compute.stage``)
    layers: tuple[int, int]  # decoder layers [start, end)
    embed: bool  # holds layer 0: looks up the tokens
    head: bool  # holds the last layer: final norm, head and loss
    # The decoder layers it checkpoints (recompute: all; partial recompute: the stage's lowest ones here).
    recomputed: tuple[int, ...] = ()

    @property
    def recomputes_all(self) -> bool:
        return len(self.recomputed) == self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class StageRole:
    """Where one device sits in a strategy and what its stage computes."""

    strategy: str
    device: int
    pipeline: int
    stage: int
    num_stages: int
    tp_rank: int
    devices: tuple[int, ...]  # this stage's TP group, in TP-rank order
    chunks: tuple[ChunkRole, ...]  # one per layer range the stage holds, in local chunk order
    recompute: bool
    micro_batches: int
    micro_batch: int  # samples per micro-batch
    first_sample: int  # the pipeline's share of the global batch starts at this sample
    # An expert-parallel stage (``Stage.experts``): the routed experts this device holds whole; None: the
    # stage splits every expert over its TP group.
    experts: tuple[int, ...] | None = None
    # ... and every device's, in TP-rank order (the token exchange's routing table).
    expert_placement: tuple[tuple[int, ...], ...] | None = None

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def layers(self) -> tuple[tuple[int, int], ...]:
        """Decoder layers [start, end) of each chunk."""
        return tuple(c.layers for c in self.chunks)

    @property
    def embed(self) -> bool:
        """Some chunk of this stage holds the embedding."""
        return any(c.embed for c in self.chunks)

    @property
    def head(self) -> bool:
        """Some chunk of this stage holds the final norm, head and loss."""
        return any(c.head for c in self.chunks)

    @property
    def samples(self) -> int:
        return self.micro_batches * self.micro_batch


@dataclass(frozen=True)
class ParamShard:
    """One parameter as this device holds it (its AdamW states share the layout)."""

    info: ParamInfo
    tp_size: int
    tp_rank: int
    region: tuple[slice, ...]  # the part of the full tensor held here
    primary: bool  # the copy counted once: pipeline 0, and TP rank 0 for parameters duplicated in TP

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region)


@dataclass(frozen=True)
class BoundaryOps:
    """Both directions of one virtual-stage boundary, resolved once per program."""

    boundary: Boundary
    forward: CommOp  # activation: virtual stage j -> j + 1
    backward: CommOp  # its gradient: j + 1 -> j (the forward op's adjoint)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.boundary.shape


@dataclass(frozen=True)
class DevicePlan:
    """Everything one device holds and does in a strategy: its stage, its shards, its schedule and every
    communication it takes part in, derived once from the plan."""

    handle: StrategyHandle
    role: StageRole
    annotations: StrategyAnnotations
    shards: tuple[ParamShard, ...]
    layout: Layout  # the pipeline's virtual stages: which stage and chunk each one is
    actions: tuple[Action, ...]  # this stage's list of the pipeline's schedule (handle.pipeline_schedule)
    routes: Mapping[int, BoundaryOps]  # virtual boundary j (between j and j + 1) -> its ops, where this
    # device sends or receives; boundaries between two chunks of this stage have none (handed in memory)
    grad_sync: tuple[SyncBucket, ...]  # this device's gradient all-reduces, in the global order
    zero_slices: Mapping[str, tuple[ZeroSlice, ...]]  # ZeRO-1 only (else empty): every sharded parameter's
    zero_buckets: tuple[ZeroBucket, ...]  # ZeRO-1 only: every all-gather of the strategy, in order
    moment_pieces: Mapping[str, tuple[MomentPiece, ...]]  # ZeRO-1 only: the moments this device keeps

    @property
    def device(self) -> int:
        return self.role.device

    @property
    def schedule(self) -> str:
        return self.handle.schedule_name(self.role.pipeline)


def specialize(handle: StrategyHandle, device: int) -> DevicePlan | None:
    """The plan of ``device`` in the strategy, or None when the strategy leaves it idle."""
    role = stage_role(handle, device)
    if role is None:
        return None
    ann = strategy_annotations(handle)
    zero = handle.training.zero
    slices = strategy_zero_slices(ann, handle.training, handle.cluster)
    layouts = [p.grad.layout(p.shape) for p in ann.params]
    sched = handle.pipeline_schedule(role.pipeline)
    routes = stage_routes(ann, role, handle.cluster)
    actions = _own_actions(sched.actions[role.stage], routes)
    return DevicePlan(
        handle=handle, role=role, annotations=ann, shards=tuple(parameter_shards(handle.model, role, ann)),
        layout=sched.layout, actions=actions, routes=routes,
        grad_sync=tuple(b for b in plan_sync(layouts) if device in b.devices),
        zero_slices=slices, zero_buckets=tuple(zero_buckets(ann, slices)) if zero else (),
        moment_pieces=moment_pieces(slices, device))


def stage_actions(plan: DevicePlan, micro_batches: int) -> tuple[Action, ...]:
    """The stage's action list for a step of ``micro_batches`` (packed documents vary the count per step;
    none: the pipeline got no document), from the same rule as ``plan.actions``."""
    if micro_batches == plan.role.micro_batches:
        return plan.actions
    if micro_batches == 0:
        return ()
    sched = plan.handle.schedule_for(plan.role.pipeline, micro_batches)
    return _own_actions(sched.actions[plan.role.stage], plan.routes)


def _own_actions(actions: tuple[Action, ...], routes: Mapping[int, BoundaryOps]) -> tuple[Action, ...]:
    # A stage without boundaries (a one-stage pipeline) has nothing to send: its list's WaitSends is dropped.
    return actions if routes else tuple(a for a in actions if isinstance(a, Compute))


def stage_role(handle: StrategyHandle, device: int) -> StageRole | None:
    """The role of ``device`` in the strategy, or None when the strategy leaves it idle."""
    where = handle.strategy.locate(device)
    if where is None:
        return None
    pi, si, tp_rank = where
    strat = handle.strategy
    pipe = strat.pipelines[pi]
    stage = pipe.stages[si]
    mb = handle.training.micro_batch
    first = sum(p.micro_batches for p in strat.pipelines[:pi]) * mb
    return StageRole(
        strategy=strat.name, device=device, pipeline=pi, stage=si, num_stages=len(pipe.stages),
        tp_rank=tp_rank, devices=stage.devices, chunks=chunk_roles(pipe, si, handle.pipeline_schedule(pi).layout),
        recompute=stage.recompute, micro_batches=pipe.micro_batches, micro_batch=mb, first_sample=first,
        experts=stage.experts_of(device) if stage.expert_parallel else None,
        expert_placement=tuple(stage.experts_of(d) for d in stage.devices) if stage.expert_parallel else None)


def chunk_roles(pipe: Pipeline, stage: int, layout: Layout) -> tuple[ChunkRole, ...]:
    """The chunks of ``stage``: the virtual stage each one is under the schedule's layout, which must be
    the layer order (plan validation checks it; a plan built in code without validation is caught here)."""
    order = pipe.chunk_order()
    out = []
    st = pipe.stages[stage]
    rc = set(st.layer_ids[:st.recomputed_layers])
    for c, layers in enumerate(st.layers):
        j = layout.stage(stage, c)
        if order[j] != (stage, c):
            raise ValueError(f"stages[{stage}].layers[{c}]: {list(layers)} is virtual stage {j} of the "
                             f"{layout.placement} placement, but not the {j}-th range in layer order")
        out.append(ChunkRole(c, j, layers, embed=j == 0, head=j == layout.num_stages - 1,
                             recomputed=tuple(i for i in range(*layers) if i in rc)))
    return tuple(out)


def weight_grad_from_outputs(plan: DevicePlan, chunk: ChunkRole) -> bool:
    """Whether W of ``chunk`` multiplies the gradients B left at its parameter-owning modules' outputs
    into its weights (program.py ``OutputRecord``), rather than running one backward through the kept
    graph: only under a split backward, not on the first chunk (it has no input gradient, so its B is
    empty and W is the whole backward), and not where every layer of the chunk recomputes (each small
    backward would recompute its layer). Under partial recompute the recomputed layers' weight gradients
    come out of B itself (``recomputed_params``), the other layers' from their outputs."""
    return plan.handle.pipeline_schedule(plan.role.pipeline).split_backward and not chunk.embed \
        and not chunk.recomputes_all


def chunk_parameters(model: ModelSpec, chunk: ChunkRole, experts: tuple[int, ...] | None = None) -> list[ParamInfo]:
    """The parameters one chunk's module holds, in module order (a tied head holds the embedding); on an
    expert-parallel stage only ``experts`` of the routed experts, whole (``expert_placed``)."""
    lo, hi = chunk.layers
    return expert_placed([info for info in model_parameters(model)
                          if info.owner == "embedding" and (chunk.embed or info.tied and chunk.head)
                          or info.owner == "head" and chunk.head
                          or info.owner == "layer" and info.layer is not None and lo <= info.layer < hi], experts)


def expert_placed(params: list[ParamInfo], experts: tuple[int, ...] | None) -> list[ParamInfo]:
    """``params`` as a device of an expert-parallel stage holding ``experts`` keeps them: no other routed
    expert, and its own unsplit (TP dim None); unchanged when ``experts`` is None (a TP stage)."""
    if experts is None:
        return params
    return [dataclasses.replace(p, tp_dim=None) if p.expert is not None else p
            for p in params if p.expert is None or p.expert in experts]


def stage_parameters(model: ModelSpec, role: StageRole) -> list[ParamInfo]:
    """The parameters a stage holds over all its chunks, each once, in module order."""
    held = {info.name: info for c in role.chunks for info in chunk_parameters(model, c, role.experts)}
    return [held[info.name] for info in model_parameters(model) if info.name in held]


def parameter_shards(model: ModelSpec, role: StageRole, annotations: StrategyAnnotations) -> list[ParamShard]:
    """This device's shard of each parameter of its stage, from the strategy's annotations.

    The region is the annotation's (the comm layer reduces and moves exactly these slices) and must be
    the slice DTensor's Shard keeps on this TP rank; the primary copy is member 0 (pipeline 0), first
    replica.
    """
    out = []
    for info in stage_parameters(model, role):
        ann = annotations.param(info.name).param
        held = ann.layout(info.shape).by_device[role.device]
        region = tuple(slice(a, b) for a, b in held.region)
        tp_dim = info.tp_dim if role.tp > 1 else None
        if region != shard_slices(info.shape, tp_dim, role.tp, role.tp_rank):
            raise AssertionError(f"{info.name}: annotation region {held.region} is not TP rank {role.tp_rank}'s "
                                 f"shard of a {info.shape} tensor split on dim {tp_dim} x {role.tp}")
        out.append(ParamShard(info, role.tp, role.tp_rank, region, held.member == 0 and held.replica == 0))
    return out


def resolve_boundary(boundary: Boundary, cluster: Cluster) -> BoundaryOps:
    fwd = resolve(boundary.src, boundary.dst, boundary.shape, dtype=BOUNDARY_DTYPE, bandwidth=cluster)
    bwd = fwd.adjoint
    for op in (fwd, bwd):
        if not op.p2p_only:
            raise NotImplementedError(f"stage boundary {boundary.src} -> {boundary.dst} resolved to {op.kind}, "
                                      "which needs collectives; the schedule posts boundary messages as "
                                      "point-to-point sends")
    return BoundaryOps(boundary, fwd, bwd)


def stage_routes(annotations: StrategyAnnotations, role: StageRole, cluster: Cluster) -> dict[int, BoundaryOps]:
    """The virtual-stage boundaries this device's stage sends or receives across, by virtual stage j
    (the boundary between j and j + 1); each resolved once."""
    out = {}
    for b in annotations.boundaries:
        if b.pipeline == role.pipeline and role.stage in (b.src_stage, b.dst_stage):
            out[b.stage] = resolve_boundary(b, cluster)
    return out


def shard_slices(shape: tuple[int, ...], tp_dim: int | None, tp_size: int, tp_rank: int) -> tuple[slice, ...]:
    """Which part of the full tensor TP rank ``tp_rank`` holds (torch.chunk semantics, as DTensor's
    Shard)."""
    out = [slice(0, s) for s in shape]
    if tp_dim is not None and tp_size > 1:
        n = shape[tp_dim]
        step = -(-n // tp_size)  # ceil: torch.chunk's chunk size
        lo = min(tp_rank * step, n)
        out[tp_dim] = slice(lo, min(lo + step, n))
    return tuple(out)
