"""Plan spec (plan.yaml): training settings plus one or more named heterogeneous strategies.

A strategy is a list of pipelines; each pipeline has its own micro-batch count and a chain of
stages; each stage is a TP group (its devices) holding a contiguous range of decoder layers.
The first stage of every pipeline also holds the embedding, the last the final norm and head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from runtime.errors import Checker, Problem, SpecError

PLAN_VERSION = 1

Schedule = Literal["1f1b", "gpipe"]


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        c = Checker()
        c.check(self.lr > 0, "lr", "must be positive")
        c.check(self.weight_decay >= 0, "weight_decay", "must not be negative")
        c.check(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)")
        c.check(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)")
        c.check(self.eps > 0, "eps", "must be positive")
        c.check(self.grad_clip >= 0, "grad_clip", "must not be negative (0 disables clipping)")
        c.raise_if_any()


@dataclass(frozen=True)
class TrainingSettings:
    global_batch: int
    micro_batch: int
    seq_len: int
    zero: bool = False
    schedule: Schedule = "1f1b"
    seed: int = 0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    # Documents mode (docs/lengths.md): a step is whole documents filling this many tokens, seq_len the longest
    # document. None: the fixed global_batch x seq_len windows.
    tokens_per_step: int | None = None

    def __post_init__(self) -> None:
        c = Checker()
        c.check(self.global_batch >= 1, "global_batch", f"must be at least 1, got {self.global_batch}")
        c.check(self.micro_batch >= 1, "micro_batch", f"must be at least 1, got {self.micro_batch}")
        c.check(self.seq_len >= 1, "seq_len", f"must be at least 1, got {self.seq_len}")
        c.check(self.tokens_per_step is None or self.tokens_per_step >= 1, "tokens_per_step",
                f"must be at least 1, got {self.tokens_per_step}")
        c.raise_if_any()


@dataclass(frozen=True)
class Stage:
    devices: tuple[int, ...]
    layers: tuple[int, int]
    recompute: bool = False

    def __post_init__(self) -> None:
        c = Checker()
        c.check(len(self.devices) >= 1, "devices", "must list at least one device")
        dup = sorted({d for d in self.devices if self.devices.count(d) > 1})
        c.check(not dup, "devices", f"lists device(s) {dup} more than once")
        c.check(all(d >= 0 for d in self.devices), "devices", "device ids must not be negative")
        start, end = self.layers
        c.check(0 <= start < end, "layers",
                f"must be a non-empty range [start, end) with 0 <= start < end, got [{start}, {end}]")
        c.raise_if_any()

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class Pipeline:
    micro_batches: int
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        c = Checker()
        c.check(self.micro_batches >= 1, "micro_batches", f"must be at least 1, got {self.micro_batches}")
        c.check(len(self.stages) >= 1, "stages", "must list at least one stage")
        c.raise_if_any()

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)


@dataclass(frozen=True)
class Strategy:
    name: str
    pipelines: tuple[Pipeline, ...]
    estimates: Mapping[str, float] | None = None
    # The longest document this strategy serves: its length range is (the previous strategy's max_seq_len,
    # max_seq_len]. None: training.seq_len (``max_len_of``).
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        c = Checker()
        c.check(bool(self.name), "name", "must not be empty")
        c.check(len(self.pipelines) >= 1, "pipelines", "must list at least one pipeline")
        c.check(self.max_seq_len is None or self.max_seq_len >= 1, "max_seq_len",
                f"must be at least 1, got {self.max_seq_len}")
        c.raise_if_any()

    def max_len_of(self, training: TrainingSettings) -> int:
        """The longest document this strategy serves (``max_seq_len``, else ``training.seq_len``)."""
        return training.seq_len if self.max_seq_len is None else self.max_seq_len

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the strategy uses, pipeline by pipeline, stage by stage."""
        return tuple(d for p in self.pipelines for d in p.devices)

    def locate(self, device: int) -> tuple[int, int, int] | None:
        """(pipeline index, stage index, TP rank) of a device, or None if it is idle."""
        for pi, p in enumerate(self.pipelines):
            for si, s in enumerate(p.stages):
                if device in s.devices:
                    return pi, si, s.devices.index(device)
        return None


@dataclass(frozen=True)
class Plan:
    version: int
    model: str
    cluster: str
    training: TrainingSettings
    strategies: tuple[Strategy, ...]

    def __post_init__(self) -> None:
        c = Checker()
        c.check(self.version == PLAN_VERSION, "version",
                f"unsupported plan version {self.version} (this hspmd reads version {PLAN_VERSION})")
        c.check(len(self.strategies) >= 1, "strategies", "must list at least one strategy")
        names = [s.name for s in self.strategies]
        for i, name in enumerate(names):
            if names.index(name) != i:
                c.add(f"strategies[{i}].name", f"duplicate strategy name {name!r}")
        c.raise_if_any()

    def strategy(self, name: str | None = None) -> Strategy:
        """The named strategy, or the first one."""
        if name is None:
            return self.strategies[0]
        for s in self.strategies:
            if s.name == name:
                return s
        raise SpecError([Problem("", "strategies", f"no strategy named {name!r} "
                                 f"(have: {', '.join(s.name for s in self.strategies)})")])
