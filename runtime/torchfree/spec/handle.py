"""One strategy within its plan context, resolved once and handed down.

A strategy is chosen once (by the CLI, the launcher, a replan); everything below works on this handle
instead of looking the strategy up by name again. What the layers above spec derive from it (its
annotations, each device's program plan) is computed once per handle through ``cached``, so spec
imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.pipeline_schedules import (
    ChunkCost,
    Costs,
    Schedule,
    TimedOp,
    build_schedule,
    schedule_order,
    schedule_timeline,
)
from runtime.torchfree.schedule_policies import ScheduleName, schedule_layout
from runtime.torchfree.spec.catalog import PlanContext
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Pipeline, Strategy, TrainingSettings

T = TypeVar("T")


def plan_costs(pipe: Pipeline) -> Costs:
    """The durations a pipeline's action lists are ordered by: its stages' ``op_costs`` when every stage has
    them (``full_backward`` is B + W: the plan gives no fused time) with the pipeline's ``transfer_costs``
    (none: 0), else each chunk's F, B and W cost its layer count, transfers free (docs/schedules.md, "Costs
    in the plan")."""
    if all(st.op_costs is not None for st in pipe.stages):
        return Costs(chunks=tuple(tuple(ChunkCost(f, b, w) for f, b, w in st.op_costs)  # type: ignore[union-attr]
                                  for st in pipe.stages), boundary=pipe.transfer_costs or ())
    return Costs(chunks=tuple(tuple(ChunkCost(b - a, b - a, b - a) for a, b in st.layers) for st in pipe.stages))


def plan_schedule(pipe: Pipeline, name: ScheduleName, micro_batches: int) -> Schedule:
    """Pipeline ``pipe``'s action lists under schedule ``name`` for ``micro_batches``: a pure function of
    the plan (its op costs and activation limits), the one definition the engine, the cost model and the
    simulator build them by."""
    layout = schedule_layout(name, len(pipe.stages), pipe.stages[0].chunks)
    return build_schedule(name, len(pipe.stages), micro_batches, layout.chunks, plan_costs(pipe),
                          pipe.activation_limits)


def plan_timeline(pipe: Pipeline, name: ScheduleName, micro_batches: int) -> tuple[tuple[TimedOp, ...], ...]:
    """``plan_schedule(...).timeline`` without the action lists (``schedule_timeline``)."""
    layout = schedule_layout(name, len(pipe.stages), pipe.stages[0].chunks)
    return schedule_timeline(name, len(pipe.stages), micro_batches, layout.chunks, plan_costs(pipe),
                             pipe.activation_limits)


def plan_order(pipe: Pipeline, name: ScheduleName, micro_batches: int) -> tuple[tuple[int, ...], ...]:
    """``plan_timeline``'s op order alone, as op numbers (``schedule_order``)."""
    layout = schedule_layout(name, len(pipe.stages), pipe.stages[0].chunks)
    return schedule_order(name, len(pipe.stages), micro_batches, layout.chunks, plan_costs(pipe),
                          pipe.activation_limits)


@dataclass(frozen=True, eq=False)
class StrategyHandle:
    """A strategy of a validated plan, with the plan's model, cluster and training settings."""

    ctx: PlanContext
    strategy: Strategy
    _memo: dict[Callable[..., Any], Any] = field(default_factory=dict, init=False, repr=False)
    _schedules: dict[tuple[int, int], Schedule] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not any(s is self.strategy or s == self.strategy for s in self.ctx.plan.strategies):
            raise SpecError([Problem(str(self.ctx.path), "strategies",
                                     f"strategy {self.strategy.name!r} is not one of this plan's")])

    @classmethod
    def of(cls, ctx: PlanContext, name: str | None = None) -> StrategyHandle:
        """The named strategy of ``ctx`` (the first when ``name`` is None)."""
        return cls(ctx, ctx.strategy(name))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.ctx, self.strategy))  # the derived values are rebuilt where needed

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def model(self) -> ModelSpec:
        return self.ctx.model

    @property
    def cluster(self) -> Cluster:
        return self.ctx.cluster

    @property
    def training(self) -> TrainingSettings:
        return self.ctx.plan.training

    @cached_property
    def devices(self) -> tuple[int, ...]:
        """Every device the strategy uses, sorted (``strategy.devices`` has them pipeline by pipeline)."""
        return tuple(sorted(self.strategy.devices))

    def schedule_name(self, pipeline: int) -> ScheduleName:
        """The schedule pipeline ``pipeline`` runs (its own, else ``training.schedule``)."""
        return self.strategy.schedule_of(pipeline, self.training)

    def pipeline_schedule(self, pipeline: int) -> Schedule:
        """Pipeline ``pipeline``'s action lists: what the engine executes and the simulator plays."""
        return self.schedule_for(pipeline, self.strategy.pipelines[pipeline].micro_batches)

    def schedule_for(self, pipeline: int, micro_batches: int) -> Schedule:
        """The pipeline's schedule for ``micro_batches`` (the plan's count, or a step's under packed documents).

        Built from the plan alone (``plan_schedule``), so every rank builds the same lists."""
        key = (pipeline, micro_batches)
        if key not in self._schedules:
            self._schedules[key] = plan_schedule(self.strategy.pipelines[pipeline], self.schedule_name(pipeline),
                                                 micro_batches)
        return self._schedules[key]

    def describe(self) -> str:
        """'[0,1]:0-4 > [2]:4-8 x6 | [3]:0-2+6-8 > [4]:2-6 x2 interleaved': each pipeline's stages (devices:
        layer ranges), micro-batches and, where it is not 1F1B, its schedule."""
        pipes = []
        for pi, p in enumerate(self.strategy.pipelines):
            stages = " > ".join("[" + ",".join(map(str, s.devices)) + "]:" + "+".join(f"{a}-{b}" for a, b in s.layers)
                                for s in p.stages)
            name = self.schedule_name(pi)
            pipes.append(f"{stages} x{p.micro_batches}" + ("" if name == "1f1b" else f" {name}"))
        return " | ".join(pipes)

    def cached(self, derive: Callable[[StrategyHandle], T]) -> T:
        """``derive(self)``, computed once per handle."""
        if derive not in self._memo:
            self._memo[derive] = derive(self)
        return self._memo[derive]
