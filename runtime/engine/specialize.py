"""Graph specialization as a pure function: strategy + device -> what that device holds and does.

Nothing here touches torch, so ``hspmd show --device N`` and the unit tests can ask what a device's
program is without starting a world. ``specialize`` derives it once, as a ``DevicePlan``; the executor
(program.py) builds from that record and ``describe_program`` (describe.py) prints it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from runtime.annotations.from_plan import Boundary, StrategyAnnotations, strategy_annotations
from runtime.annotations.states import Annotation
from runtime.comm.bsr import FLOAT32
from runtime.comm.gradsync import SyncBucket, plan_sync
from runtime.comm.resolve import CommOp, resolve
from runtime.engine.schedules import Action, build_schedule
from runtime.engine.zero import MomentPiece, ZeroBucket, ZeroSlice, moment_pieces, zero_buckets, zero_slices
from runtime.models.params import ParamInfo, llama_parameters
from runtime.spec.cluster import Cluster
from runtime.spec.handle import StrategyHandle
from runtime.spec.model import ModelSpec

BOUNDARY_DTYPE = FLOAT32  # the residual stream stays fp32 under autocast; sent as such


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
    layers: tuple[int, int]  # decoder layers [start, end)
    embed: bool
    head: bool  # final norm, head and loss
    recompute: bool
    micro_batches: int
    micro_batch: int  # samples per micro-batch
    first_sample: int  # the pipeline's share of the global batch starts at this sample

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def samples(self) -> int:
        return self.micro_batches * self.micro_batch

    def micro_batch_rows(self, mb: int) -> slice:
        """Rows of the global batch that micro-batch ``mb`` of this pipeline takes."""
        start = self.first_sample + mb * self.micro_batch
        return slice(start, start + self.micro_batch)


@dataclass(frozen=True)
class ParamShard:
    """One parameter as this device holds it (its AdamW states share the layout)."""

    info: ParamInfo
    tp_size: int
    tp_rank: int
    region: tuple[slice, ...]  # the part of the full tensor held here
    primary: bool  # the copy counted once: pipeline 0, and TP rank 0 for parameters duplicated in TP
    annotation: Annotation  # the parameter's HSPMD annotation over the whole strategy

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region)


@dataclass(frozen=True)
class BoundaryOps:
    """Both directions of one stage boundary, resolved once per program."""

    boundary: Boundary
    forward: CommOp  # activation: earlier stage -> later stage
    backward: CommOp  # its gradient: later stage -> earlier stage (the forward op's adjoint)

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
    actions: tuple[Action, ...]
    prev: BoundaryOps | None  # the boundary before this stage (None on first stages)
    next: BoundaryOps | None  # the one after it (None on last stages)
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
    slices = zero_slices(ann) if zero else {}
    layouts = [p.grad.layout(p.shape) for p in ann.params]
    prev, nxt = stage_boundaries(ann, role, handle.cluster)
    return DevicePlan(
        handle=handle, role=role, annotations=ann, shards=tuple(parameter_shards(handle.model, role, ann)),
        actions=tuple(build_schedule(handle.schedule_name(role.pipeline), role.num_stages, role.stage,
                                     role.micro_batches)),
        prev=prev, next=nxt, grad_sync=tuple(b for b in plan_sync(layouts) if device in b.devices),
        zero_slices=slices, zero_buckets=tuple(zero_buckets(ann, slices)) if zero else (),
        moment_pieces=moment_pieces(slices, device))


def stage_role(handle: StrategyHandle, device: int) -> StageRole | None:
    """The role of ``device`` in the strategy, or None when the strategy leaves it idle."""
    where = handle.strategy.locate(device)
    if where is None:
        return None
    pi, si, tp_rank = where
    strat = handle.strategy
    pipe = strat.pipelines[pi]
    stage = pipe.stages[si]
    if stage.chunks != 1:  # the chunk-aware executor is the next step of issue 12
        raise ValueError(f"pipelines[{pi}].stages[{si}].layers: the engine runs one layer range per stage, "
                         f"got {stage.chunks}")
    mb = handle.training.micro_batch
    first = sum(p.micro_batches for p in strat.pipelines[:pi]) * mb
    return StageRole(
        strategy=strat.name, device=device, pipeline=pi, stage=si, num_stages=len(pipe.stages),
        tp_rank=tp_rank, devices=stage.devices, layers=stage.layers[0], embed=si == 0,
        head=si == len(pipe.stages) - 1, recompute=stage.recompute, micro_batches=pipe.micro_batches,
        micro_batch=mb, first_sample=first)


def stage_parameters(model: ModelSpec, role: StageRole) -> list[ParamInfo]:
    """The parameters a stage holds, in module order."""
    lo, hi = role.layers
    out = []
    for info in llama_parameters(model):
        if info.owner == "embedding" and (role.embed or info.tied and role.head) or info.owner == "head" and role.head:
            out.append(info)
        elif info.owner == "layer" and info.layer is not None and lo <= info.layer < hi:
            out.append(info)
    return out


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
        out.append(ParamShard(info, role.tp, role.tp_rank, region, held.member == 0 and held.replica == 0, ann))
    return out


def resolve_boundary(boundary: Boundary, cluster: Cluster) -> BoundaryOps:
    fwd = resolve(boundary.src, boundary.dst, boundary.shape, dtype=BOUNDARY_DTYPE, bandwidth=cluster)
    bwd = fwd.adjoint
    for op in (fwd, bwd):
        if not op.p2p_only:
            raise NotImplementedError(f"stage boundary {boundary.src} -> {boundary.dst} resolved to {op.kind}, "
                                      "which needs collectives; a schedule tick can only fuse P2P messages")
    return BoundaryOps(boundary, fwd, bwd)


def stage_boundaries(annotations: StrategyAnnotations, role: StageRole,
                     cluster: Cluster) -> tuple[BoundaryOps | None, BoundaryOps | None]:
    """The boundary before this device's stage and the one after it (None at the pipeline's ends)."""
    prev = nxt = None
    for b in annotations.boundaries:
        if b.pipeline != role.pipeline:
            continue
        if b.stage == role.stage - 1:
            prev = resolve_boundary(b, cluster)
        elif b.stage == role.stage:
            nxt = resolve_boundary(b, cluster)
    return prev, nxt


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
