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

from runtime.errors import Problem, SpecError
from runtime.spec.catalog import PlanContext
from runtime.spec.cluster import Cluster
from runtime.spec.model import ModelSpec
from runtime.spec.plan import Strategy, TrainingSettings

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class StrategyHandle:
    """A strategy of a validated plan, with the plan's model, cluster and training settings."""

    ctx: PlanContext
    strategy: Strategy
    _memo: dict[Callable[..., Any], Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not any(s is self.strategy or s == self.strategy for s in self.ctx.plan.strategies):
            raise SpecError([Problem(str(self.ctx.path), "strategies",
                                     f"strategy {self.strategy.name!r} is not one of this plan's")])

    @classmethod
    def of(cls, ctx: PlanContext, name: str | None = None) -> StrategyHandle:
        """The named strategy of ``ctx`` (the first when ``name`` is None)."""
        return cls(ctx, ctx.plan.strategy(name))

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

    def describe(self) -> str:
        """'[0,1]:0-4 > [2]:4-8 x6 | ...': each pipeline's stages (devices: layers) and micro-batches."""
        pipes = []
        for p in self.strategy.pipelines:
            stages = " > ".join("[" + ",".join(map(str, s.devices)) + f"]:{s.layers[0]}-{s.layers[1]}"
                                for s in p.stages)
            pipes.append(f"{stages} x{p.micro_batches}")
        return " | ".join(pipes)

    def cached(self, derive: Callable[[StrategyHandle], T]) -> T:
        """``derive(self)``, computed once per handle."""
        if derive not in self._memo:
            self._memo[derive] = derive(self)
        return self._memo[derive]
