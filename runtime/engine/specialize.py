"""Graph specialization as a pure function: plan + device -> what that device holds and does.

Nothing here touches torch.distributed, so ``hspmd show --device N`` and the unit tests can ask what a
device's program is without starting a world. The executor (program.py) builds from the same records.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.annotations.from_plan import StrategyAnnotations, annotate_strategy
from runtime.annotations.states import Annotation
from runtime.engine.schedules import Action, build_schedule
from runtime.engine.tensor_parallel import shard_slices
from runtime.models.params import ParamInfo, llama_parameters
from runtime.spec import ModelSpec, PlanContext, Strategy


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
    prev_devices: tuple[int, ...] | None  # the previous stage's group (None on first stages)
    next_devices: tuple[int, ...] | None  # the next stage's group (None on last stages)
    layers: tuple[int, int]  # decoder layers [start, end)
    embed: bool
    head: bool  # final norm, head and loss
    recompute: bool
    micro_batches: int
    micro_batch: int  # samples per micro-batch
    first_sample: int  # the pipeline's share of the global batch starts at this sample
    num_pipelines: int

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


def stage_role(ctx: PlanContext, strategy: str | Strategy, device: int) -> StageRole | None:
    """The role of ``device`` in the strategy, or None when the strategy leaves it idle."""
    strat = ctx.plan.strategy(strategy) if isinstance(strategy, str) else strategy
    where = strat.locate(device)
    if where is None:
        return None
    pi, si, tp_rank = where
    pipe = strat.pipelines[pi]
    stage = pipe.stages[si]
    mb = ctx.plan.training.micro_batch
    first = sum(p.micro_batches for p in strat.pipelines[:pi]) * mb
    return StageRole(
        strategy=strat.name, device=device, pipeline=pi, stage=si, num_stages=len(pipe.stages),
        tp_rank=tp_rank, devices=stage.devices,
        prev_devices=pipe.stages[si - 1].devices if si > 0 else None,
        next_devices=pipe.stages[si + 1].devices if si + 1 < len(pipe.stages) else None,
        layers=stage.layers, embed=si == 0, head=si == len(pipe.stages) - 1, recompute=stage.recompute,
        micro_batches=pipe.micro_batches, micro_batch=mb, first_sample=first,
        num_pipelines=len(strat.pipelines))


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


def strategy_annotations(ctx: PlanContext, strategy: str | Strategy) -> StrategyAnnotations:
    strat = ctx.plan.strategy(strategy) if isinstance(strategy, str) else strategy
    return annotate_strategy(strat, ctx.model, ctx.plan.training)


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


def stage_schedule(ctx: PlanContext, role: StageRole, schedule: str | None = None) -> list[Action]:
    """The stage's action list under the plan's schedule (or ``schedule``)."""
    return build_schedule(schedule or ctx.plan.training.schedule, role.num_stages, role.stage, role.micro_batches)


def global_tokens(ctx: PlanContext) -> int:
    t = ctx.plan.training
    return t.global_batch * t.seq_len
