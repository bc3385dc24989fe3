"""What the search works on and hands back: the user's settings (``PlanSettings``), the pieces it builds
(``TypeChoice``, ``ClassInfo``, ``BlockJob``, ``BlockCandidate``), the plans it returns (``Candidate``), its
counts and time limit (``SearchStats``, ``SearchBudget``), and the short text that describes a plan.
planner/search.py describes the phases these pass through."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from planner.cost import StrategyEstimate
from planner.layer_split import LayerSplit
from planner.microbatch import TimeOption
from planner.pipelines import (
    PipelineLayout,
    Template,
)
from planner.schedule_choice import (
    AUTO,
    ScheduleChoice,
)
from planner.tp_groups import GroupKind, TPGroup
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.plan import OptimizerSettings, Pipeline, Schedule, Strategy

Progress = Callable[[str, int, int], None]

Shares = Sequence[Mapping[GroupKind, int]]   # groups of each kind per pipeline



@dataclass(frozen=True)
class PlanSettings:
    """What the user asks for. ``micro_batch=None`` lets the planner choose among ``MICRO_BATCHES``."""

    global_batch: int
    seq_len: int
    micro_batch: int | None = None
    elastic: bool = False          # every parameter on >= 2 pipelines (failure recovery)
    # ZeRO-1 over the pipelines; None: on, except under elastic, where planner/api.py ``plan`` tries both
    # (ZeRO-1 with 2 copies of every moment chunk, and off) and keeps the faster.
    use_zero: bool | None = None
    time_limit_s: float = 120.0
    top_k: int = 5
    allow_recompute: bool = True
    # Recompute only the layers of a stage its memory lacks room for (``Stage.recompute_layers``), searched
    # only where memory binds; off: whole-stage recompute or none.
    partial_recompute: bool = True
    # Raise a pipeline's activation bound to what its stages' free memory holds (``Pipeline.activation_limits``)
    # where that makes the plan faster: more forwards ahead, more W deferred into the fill and drain.
    spare_activations: bool = True
    memory_margin: float = 0.0     # fraction of each device's memory kept free
    # TP stages run Megatron sequence parallelism (``training.sequence_parallel``; planner/cost.py prices it).
    sequence_parallel: bool = True
    # The pipeline schedule every plan runs (and is priced with), or "auto": the search picks a schedule and
    # its chunk count per pipeline class (planner/schedule_choice.py).
    schedule: Schedule | Literal["auto"] = "1f1b"
    seed: int = 0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    # Re-check the best ``simulate_top`` candidates (and the best one whose pipelines are all alike) with
    # the discrete-event simulator and rank those by the worse of the two predictions (0: off).
    simulate_top: int = 0

    @property
    def zero(self) -> int:
        """ZeRO-1 as the cost model's copy count (planner/cost.py ``zero_degree``): 0 off, 1 plain ZeRO-1, 2
        under elastic (``training.zero_redundancy: 2``: any single failure leaves a copy of every chunk)."""
        on = (not self.elastic) if self.use_zero is None else self.use_zero
        return (2 if self.elastic else 1) if on else 0

    @property
    def min_pipelines(self) -> int:
        return 2 if self.elastic else 1

    @property
    def default_schedule(self) -> Schedule:
        """What a pipeline without a schedule of its own runs (the baselines too, and the plan's
        ``training.schedule``): the fixed schedule if it runs one-chunk stages, else 1F1B (under "auto",
        interleaved and ZB-V every planned pipeline names its schedule)."""
        if self.schedule in (AUTO, "interleaved", "zb-v"):
            return "1f1b"
        return self.schedule



# How far ``step_time_bound`` may exceed the time it bounds by rounding alone (tests/unit/planner/test_fast_pricing.py
# checks it within this): a bound is trusted to rule a price out only past it.
BOUND_ROUNDING = 1e-9



@dataclass(frozen=True)
class TypeChoice:
    device_type: str
    tp: int
    remainder: bool = True



@dataclass(frozen=True)
class ClassInfo:
    """Identical pipelines of a block: same stage kinds, same boundary cost."""

    template: Template
    boundary_s: float
    members: tuple[int, ...]   # indices into the block's layouts
    split: LayerSplit
    schedule: ScheduleChoice = ScheduleChoice("1f1b")
    fill: float = 1.0          # the schedule's fill_factor: (fill, hops)
    hops: float = 1.0
    # Where some stage's free memory holds more activations than the schedule's bound: a lower bound of the
    # pipeline's time with the bounds raised (``ExactPricer.spare_room``; None: no room), and what raising saves
    # on the ranking price (``ExactPricer.spare_gain``; None: not priced yet, ``BlockBuilder.complete`` prices it).
    # The plans get those limits in the end (``with_spare_limits``), so the ranking must know what they buy.
    spare_bound_s: float | None = None
    spare_s: float | None = None
    spare_count: int = 1   # the micro-batch count both are priced at

    def option(self) -> TimeOption:
        opt = time_option(self.split, self.boundary_s, self.fill, self.hops)
        return TimeOption(opt.per_mb_s, max(0.0, opt.fixed_s - (self.spare_s or 0.0)))

    @property
    def spare_room(self) -> bool:
        return self.spare_bound_s is not None

    def floor_option(self) -> TimeOption:
        """``option`` or less, known before the spare limits are priced: the raised time is at least
        ``spare_bound_s`` (at the count it is priced at, ``spare_count``)."""
        opt = self.option()
        if self.spare_bound_s is None or self.spare_s is not None:
            return opt
        m = self.spare_count
        return TimeOption(opt.per_mb_s, max(0.0, min(opt.fixed_s, self.spare_bound_s - m * opt.per_mb_s)))



def time_option(split: LayerSplit, boundary_s: float, fill: float, hops: float) -> TimeOption:
    """A pipeline's time per micro-batch and fixed time for the allocation: ``LayerSplit.pipeline_s``."""
    return TimeOption(split.max_s, fill * (split.sum_s - split.max_s) + hops * boundary_s)



@dataclass(frozen=True, eq=False)
class BlockCandidate:
    """Compared by identity: candidates are built once and shared by the combinations. ``evaluate_block``
    builds a draft (its pipelines and classes); the sync and optimizer terms are added by
    ``BlockBuilder.complete`` only to the drafts ``block_ranking.keep_blocks`` ranks high enough to look at."""

    choice: tuple[TypeChoice, ...]
    pipelines: int
    order: str
    placement: str
    layouts: tuple[PipelineLayout, ...]
    classes: tuple[ClassInfo, ...]
    grad_bytes: float = 0.0                              # largest gradient of one device (its stage's share)
    opt_terms: tuple[tuple[str, int, int], ...] = ()     # (device type, params, tensors): the heaviest stages
    # Gradient sync of the block's own pipelines: per stage position, the devices at that position (one per
    # pipeline: the ones that all-reduce together) and the largest gradient among them, costliest first.
    sync_rings: tuple[tuple[tuple[int, ...], float], ...] = ()
    sync_self_s: float = 0.0

    @property
    def types(self) -> frozenset[str]:
        return frozenset(c.device_type for c in self.choice)

    @property
    def aligned(self) -> bool:
        """All pipelines alike (one template, hence one layer split)."""
        return len({c.template for c in self.classes}) == 1

    @property
    def rate(self) -> float:
        """Micro-batches per second at steady state."""
        return sum(len(c.members) / c.split.max_s for c in self.classes)

    @property
    def overhead(self) -> float:
        return sum(len(c.members) * c.option().fixed_s / c.split.max_s for c in self.classes)

    @property
    def floor_overhead(self) -> float:
        """``overhead`` or less, before ``BlockBuilder.complete`` prices the spare limits (``floor_option``)."""
        return sum(len(c.members) * c.floor_option().fixed_s / c.split.max_s for c in self.classes)

    @property
    def min_micro_batches(self) -> int:
        return sum(len(c.members) * len(c.template) for c in self.classes)

    @property
    def rep_devices(self) -> tuple[int, ...]:
        """One device per pipeline, to price the cross-pipeline gradient all-reduce: those of the costliest
        stage position (the first devices when the block has one pipeline)."""
        if self.sync_rings and len(self.sync_rings[0][0]) == len(self.layouts):
            return self.sync_rings[0][0]
        return tuple(lay.groups[0].devices[0] for lay in self.layouts)



@dataclass(frozen=True, eq=False)
class BlockJob:
    """A block to build (``BlockBuilder.block_job``): its pipelines' templates known, its groups not dealt yet."""

    choice: tuple[TypeChoice, ...]
    pipelines: int
    order: str
    placement: str
    groups: Mapping[GroupKind, Sequence[TPGroup]]
    ranked: tuple[GroupKind, ...]
    shares: tuple[Mapping[GroupKind, int], ...]
    templates: tuple[Template, ...]

    @property
    def aligned(self) -> bool:
        """``BlockCandidate.aligned`` of the block it builds (its layouts' templates are these)."""
        return len(set(self.templates)) == 1



@dataclass(frozen=True)
class Candidate:
    """One complete strategy with its cost-model estimate."""

    strategy: Strategy
    estimate: StrategyEstimate
    micro_batch: int
    idle_devices: tuple[int, ...]
    summary: str
    simulated_s: float | None = None   # the simulator's step time, where the candidate was re-checked
    proxy: bool = False                # the estimate's pipeline times are the search's proxy (ExactPricer.exact)

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def checked_s(self) -> float:
        """The worse of the closed-form estimate and the simulation (the estimate if not simulated)."""
        return self.step_time_s if self.simulated_s is None else max(self.step_time_s, self.simulated_s)



Combo = tuple[BlockCandidate, ...]   # one block candidate per block of a combination

ClassKey = tuple[Template, float, ScheduleChoice]   # pipelines alike: template, boundary cost, schedule

# A block to evaluate: (type choices, pipelines, stage order, stages or None, placement, shares or None).
Job = tuple[tuple[TypeChoice, ...], int, str, int | None, str, Shares | None]



@dataclass
class SearchStats:
    block_evaluations: int = 0
    combinations: int = 0
    finalists: int = 0
    ilps: int = 0
    truncated: bool = False
    notes: list[str] = field(default_factory=list)
    # The phases the time limit cut short or skipped, in the order it happened (``truncated`` says whether any).
    cut_short: list[str] = field(default_factory=list)

    def cut(self, phase: str) -> None:
        """Record that the time limit cut ``phase`` short (once per phase)."""
        self.truncated = True
        if phase not in self.cut_short:
            self.cut_short.append(phase)

    def add(self, other: SearchStats) -> None:
        """Count ``other``'s work in (another search, or a part of one run in a worker process)."""
        self.block_evaluations += other.block_evaluations
        self.combinations += other.combinations
        self.finalists += other.finalists
        self.ilps += other.ilps
        self.truncated |= other.truncated
        self.notes.extend(other.notes)
        self.cut_short.extend(p for p in other.cut_short if p not in self.cut_short)



class SearchBudget:
    """One search's time limit, its counts and its progress reports, shared by its phases."""

    def __init__(self, deadline: float, progress: Progress | None = None) -> None:
        self.deadline = deadline   # (``time.perf_counter``)
        self.progress = progress
        self.stats = SearchStats()

    def out_of_time(self, phase: str) -> bool:
        """Whether the time limit has passed; if so ``phase`` is recorded as cut short (``SearchStats.cut``)."""
        if time.perf_counter() > self.deadline:
            self.stats.cut(phase)
            return True
        return False

    def report(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)


def schedule_label(pipe: Pipeline, default: Schedule = "1f1b") -> str:
    """'1f1b', 'zb-h1', 'interleaved v=2', ...: a pipeline's schedule and, for interleaved, its chunks."""
    name = pipe.schedule if pipe.schedule is not None else default
    return name if name != "interleaved" else f"interleaved v={pipe.stages[0].chunks}"



def describe(strategy: Strategy, cluster: Cluster, default: Schedule = "1f1b") -> str:
    """Short text: identical pipelines grouped, e.g. ``2 x [H800/tp1 x4] m=8 zb-h1 + ...`` (the schedule
    where it is not 1F1B)."""
    parts: dict[tuple[str, int, str], int] = {}
    for p in strategy.pipelines:
        stages = []
        for s in p.stages:
            label = f"{cluster.device(s.devices[0]).type}/tp{s.tp}"
            if stages and stages[-1][0] == label:
                stages[-1][1] += 1
            else:
                stages.append([label, 1])
        text = "[" + " > ".join(f"{lab} x{n}" if n > 1 else lab for lab, n in stages) + "]"
        label = schedule_label(p, default)
        key = (text, p.micro_batches, "" if label == "1f1b" else f" {label}")
        parts[key] = parts.get(key, 0) + 1
    return " + ".join(f"{n} x {t} m={mb}{sched}" for (t, mb, sched), n in parts.items())



def structure_key(s: Strategy) -> tuple:
    """Which devices form which stages of which pipeline, and the micro-batch counts; layer splits aside
    (two splits of one structure are the same plan, one a little worse)."""
    return tuple((p.micro_batches, p.schedule, tuple(st.devices for st in p.stages)) for p in s.pipelines)
