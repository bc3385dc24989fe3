"""The outer search: which TP degree per device type, which kinds share pipelines, how many pipelines.

Decomposition (each level solved once per distinct sub-problem, then reused):

1. **Type choices**: per device type a TP degree (power of two, same node, dividing heads / kv heads /
   MLP) and whether a node's left-over devices form smaller groups (``tp_groups``).
2. **Blocks**: a set of device types whose groups are shared out over ``P`` pipelines
   (``pipelines.build_pipelines``): as evenly as possible, or for a small block over 2-3 pipelines in
   every uneven way (``pipelines.distributions``); in one of three stage orders (most memory first,
   fastest first, fastest last); placed ``contiguous`` (a pipeline's stages share nodes) or
   ``interleaved`` (the gradient-sync peers, one per pipeline, share nodes). A block of one type may
   also use only ``P x S`` of its groups (``P`` pipelines of ``S`` stages, the rest idle) when the batch
   is too small for more. Identical pipelines form a class; each class is split once by
   ``layer_split.split_fast`` (exact min-max), and blocks whose pipelines cannot hold the model are
   dropped before any group is dealt. A block's own gradient sync is priced as ``CostModel.sync_plan``
   lays it out (layer segments, their holders, fused per stage) on the fast splits. A class whose stages
   have memory for more activations than its schedule's bound is ranked by the lesser of its proxy and
   its exact time with the bounds raised (``Searcher.spare_gain``: every returned plan gets them raised,
   so the ranking must know it), priced only for the drafts the keep below looks at. Per block, only the
   candidates on the front of (throughput up, fill-and-drain down) are kept, and the best of identical
   pipelines in each placement. Mixed blocks try every TP
   degree of each type when they hold two types, the two best per type otherwise.
3. **Combination**: the types in use are partitioned into blocks (every set partition of every
   subset of types: some types may stay idle), one candidate per block; ranked by a fast score: the
   greedy micro-batch allocation (exact for the fast splits) plus the gradient all-reduce (a single
   block's own sync; across blocks, each block's costliest stage rings joined by one device of every
   other pipeline), optimizer and clip priced by the cost model's own ``allreduce_time`` /
   ``optimizer_time`` / ``clip_time``.
4. **Realized**: the best combinations (and the best one using each device type) become strategies
   (fast splits, greedy micro-batches) scored by ``CostModel.estimate`` with their pipelines' proxy
   times; the best ``EXACT_REALIZED`` are priced exactly (the runtime's action lists played on the op
   costs), under ``schedule="auto"`` each also with every pipeline class on the schedule that runs it
   fastest by that exact price (``best_schedules``; planner/schedule_choice.py).
5. **Finalists** (the best exactly priced, plus the best one using each type, so that idle devices can
   be explained with real numbers): each class re-split by the layer-split ILP for the micro-batch
   counts it may get (under its schedule's memory and fill factor), counts and splits chosen together
   by the allocation ILP, re-split for the final count, the split refined by the exact price
   (``layer_split.refine_split``), and scored by ``CostModel.estimate``. Every exactly priced strategy is
   a candidate; the best one per structure (devices per stage, schedule, micro-batches) is kept.

Schedules: with a fixed ``PlanSettings.schedule`` every phase uses it (its memory bound and placement in
the slots, its fill factor in the ranking); with "auto" phases 1-3 rank as ZB-H1 runs (1F1B's memory,
never slower than 1F1B by the proxy) and phase 4 picks the schedule per pipeline class by its exact price
(docs/design.md §10), and the whole search runs again as if ZB-V were fixed (``auto_families``), all
candidates ranked together. Every exactly priced plan
finally has its pipelines' activation bounds raised to what their memory holds where that is faster
(``Searcher.with_spare_limits``, ``PlanSettings.spare_activations``).

The search is deterministic: every enumeration runs in a fixed order and ties break on that order.
A time limit stops the enumeration early (the result says so) and caps each ILP.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from planner.cost import CostModel, StrategyEstimate, memo, zero_degree
from planner.layer_split import LayerSplit, SlotCost, refine_split, slot_costs, split_fast, split_ilp
from planner.microbatch import Allocation, PipelineClass, TimeOption, allocate_greedy, allocate_ilp
from planner.parallel import Tasks, worker_count
from planner.pipelines import (
    ORDERS,
    PLACEMENTS,
    PipelineLayout,
    Template,
    build_pipelines,
    deal,
    distributions,
    kind_order,
    share_out,
)
from planner.schedule_choice import (
    AUTO,
    ScheduleChoice,
    fill_factor,
    refine_limits,
    rounded_shares,
    schedule_choices,
    spare_activation_limits,
    stage_layer_ranges,
)
from planner.tp_groups import GroupKind, TPGroup, form_groups, groups_by_kind, tp_choices
from runtime.pipeline_schedules import Costs, step_time_bound
from runtime.schedule_policies import device_limits
from runtime.spec.cluster import Cluster
from runtime.spec.model import ModelSpec
from runtime.spec.plan import OptimizerSettings, Pipeline, Schedule, Stage, Strategy

Progress = Callable[[str, int, int], None]
Shares = Sequence[Mapping[GroupKind, int]]   # groups of each kind per pipeline
_T = TypeVar("_T")


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


MICRO_BATCHES = (1, 2, 4)
BLOCK_KEEP = 8          # block candidates kept per block (after the Pareto filter)
COMBOS_REALIZED = 40    # best combinations (by the fast score) realized and scored by the cost model
COMBOS_FINAL = 6        # best realized plans solved exactly (ILPs)
EXACT_REALIZED = 8      # best realized plans (by their proxy) priced exactly as they are
ALIGNED_REALIZED = 3    # best one-block plans of identical pipelines realized as well
TYPE_CHOICES_MULTI = (4, 2, 2)  # TP choices per type tried inside mixed blocks of 2, 3, 4+ types
COMBO_BUDGET = 400      # combinations scored per set partition of the types
SMALL_BLOCK_GROUPS = 12  # blocks of at most this many TP groups also try uneven shares (every distribution)
DISTRIBUTIONS_LIMIT = 150  # ... unless there are more ways than this (then: even shares only)
UNEVEN_PIPELINES = 3       # ... over at most this many pipelines
UNEVEN_CHOICES = 2         # ... and in mixed blocks with each type's first two TP choices only
# Exact pipeline-time prices per class and finalist when moving layers (refine_split): as many as fit in
# this many scheduled ops (stages x chunks x micro-batches x op kinds), between 3 and 24.
REFINE_OPS = 4_000
# How far ``step_time_bound`` may exceed the time it bounds by rounding alone (tests/unit/planner/test_fast_pricing.py
# checks it within this): a bound is trusted to rule a price out only past it.
BOUND_ROUNDING = 1e-9
SYNC_RINGS = 2          # costliest stage positions per block kept to price cross-block gradient sync


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
    # pipeline's time with the bounds raised (``Searcher.spare_room``; None: no room), and what raising saves
    # on the ranking price (``Searcher.spare_gain``; None: not priced yet, ``Searcher.complete`` prices it).
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
    ``Searcher.complete`` only to the drafts ``Searcher._keep`` ranks high enough to look at."""

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
        """``overhead`` or less, before ``Searcher.complete`` prices the spare limits (``floor_option``)."""
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
    """A block to build (``Searcher.block_job``): its pipelines' templates known, its groups not dealt yet."""

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
    proxy: bool = False                # the estimate's pipeline times are the search's proxy (Searcher.exact)

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


def lazily_sorted(lower: Sequence[float], exact: Callable[[int], float], indices: Iterable[int],
                  skip: Callable[[int], bool] | None = None, middle: Callable[[int], float] | None = None,
                  first: Callable[[int], float] | None = None, refine: Callable[[int], float | None] | None = None
                  ) -> Iterator[tuple[float, int]]:
    """``(exact(i), i)`` for the ``indices`` with a finite exact value, in the order ``sorted`` gives
    (value, then index), computing ``exact(i)`` only when its lower bound ``lower[i]`` comes up: a
    consumer that stops early never pays for the rest. ``skip(i)``, asked then, drops ``i`` unpriced.
    ``middle(i)``: a tighter lower bound of ``exact(i)``, dearer than ``lower`` and cheaper than ``exact``,
    computed when ``lower[i]`` comes up; ``exact(i)`` then waits for it to come up in turn. ``first(i)``:
    with it, ``lower[i]`` bounds ``first(i)``, the bound the others refine, computed when ``lower[i]``
    comes up; ``skip`` is asked from ``first``'s value on (what it reads may exist only from then). (Any
    value not above the exact one keeps the order: an entry is yielded only once every bound below it
    has been replaced by its exact value. With ``first`` the entries from its value on come up in the
    order they would without it, so ``skip``, ``middle`` and ``exact`` are asked the same things at the
    same points.) ``refine(i)``: asked each time ``i`` comes up past ``middle`` (``skip`` first, as there):
    a still tighter lower bound of ``exact(i)`` (a step of its work), or None when there is none left to
    give, and then ``exact(i)`` follows. A ``skip`` that only ever drops more as the search goes on (one
    that would drop ``i`` now would drop it later too) drops what it would have dropped without it."""
    start = 0 if first is None else -1
    heap = [(lower[i], i, start) for i in indices if math.isfinite(lower[i])]
    heapq.heapify(heap)
    while heap:
        value, i, level = heapq.heappop(heap)
        if level == 2:
            yield value, i
            continue
        if level == -1 and first is not None:
            value, level = first(i), 0
        elif skip is not None and skip(i):
            continue
        elif level == 0 and middle is not None:
            value, level = middle(i), 1
        else:
            tighter = refine(i) if refine is not None else None
            value, level = (exact(i), 2) if tighter is None else (tighter, 1)
        if math.isfinite(value):
            heapq.heappush(heap, (value, i, level))


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every partition of ``items`` into non-empty blocks, in a fixed order."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [(first,)] + part
        for i in range(len(part)):
            yield part[:i] + [(first,) + part[i]] + part[i + 1:]


def _pareto(view: Callable[[int], BlockCandidate], n: int, lower: Sequence[float], score: Callable[[int], float],
            keep: int, middle: Callable[[int], float] | None = None, first: Callable[[int], float] | None = None,
            refine: Callable[[int], float | None] | None = None) -> list[int]:
    """By score (``score(i)``, best first), the first ``keep`` of ``n`` drafts that no earlier one beats on
    rate, fill-and-drain and score alike. In that order every earlier score is at most a later one's, so
    only rate and fill-and-drain decide, and a draft they rule out when its lower bound ``lower[i]`` comes
    up is dropped without being scored. ``view(i)``: the draft as known so far (completed once scored); an
    unscored one is compared by the least fill-and-drain it may have (``floor_overhead``)."""
    out: list[int] = []

    def beaten(i: int) -> bool:
        c = view(i)
        return any(view(j).rate >= c.rate and view(j).overhead <= c.floor_overhead for j in out)

    # ``beaten`` only drops more as ``out`` grows and as a draft's floor rises towards its completed value.
    for _, i in lazily_sorted(lower, score, range(n), beaten, middle, first, refine):
        if beaten(i):
            continue
        out.append(i)
        if len(out) >= keep:
            break
    return out


@dataclass(frozen=True)
class MixedInputs:
    """What the mixed blocks need of the single-type phase (``Searcher.start``): small, so that a worker
    process gets it with each subset of types (``search``'s parallel path)."""

    top_choice: Mapping[str, tuple[TypeChoice, ...]]   # per type, its TP choices best first (``_top_choices``)
    alone: frozenset[str]   # the types with a kept single-type block
    best_rate: Mapping[str, float]   # per type, its best single-type block's throughput
    total_rate: float


@dataclass(frozen=True)
class SearchStart:
    """``Searcher.start``'s result: the types searched, their kept single-type blocks, the mixed blocks' inputs."""

    types: tuple[str, ...]
    singles: Mapping[frozenset[str], list[BlockCandidate]]
    mixed: MixedInputs


def mixed_chunks(types: Sequence[str]) -> list[tuple[tuple[str, ...], ...]]:
    """``mixed_subsets`` cut into the tasks of ``search``'s parallel path: every pair together, each larger
    subset alone."""
    subsets = mixed_subsets(types)
    pairs = tuple(s for s in subsets if len(s) == 2)
    return ([pairs] if pairs else []) + [(s,) for s in subsets if len(s) > 2]


def mixed_subsets(types: Sequence[str]) -> list[tuple[str, ...]]:
    """The subsets of >= 2 types that form mixed blocks, in the search's order."""
    return [s for r in range(2, len(types) + 1) for s in itertools.combinations(types, r)]


# The ``Searcher`` caches whose values depend only on the cost model, the settings and the devices (not on
# the schedules searched): the searches ``search`` runs per micro-batch size share them. (``memo`` keeps a
# method's cache under ``_memo_<name>``.)
SHARED_CACHES = ("_memo_layer_s", "_memo_groups", "_memo_fast_split", "_memo__split_of", "_memo_fill",
                 "_memo__segment_grad_bytes", "_sync_cache", "_p2p", "_spare", "_room", "_open",
                 "_bare", "_ranges", "_stages")


class Searcher:
    """One search at one micro-batch size (one cost model)."""

    def __init__(self, cm: CostModel, settings: PlanSettings, devices: Sequence[int], deadline: float,
                 progress: Progress | None = None, choices: tuple[ScheduleChoice, ...] | None = None,
                 shared: dict[str, dict] | None = None) -> None:
        """``choices``: under "auto", search as if these schedules were fixed (``auto_families``), every
        pipeline naming its own. ``shared``: the caches of another search on the same cost model, settings
        and devices (``SHARED_CACHES``: what they hold depends on nothing else), used and filled."""
        self.cm = cm
        self.model: ModelSpec = cm.model
        self.cluster: Cluster = cm.cluster
        self.settings = settings
        self.devices = tuple(sorted(devices))
        self.deadline = deadline
        self.progress = progress
        self.micro_batches = settings.global_batch // cm.micro_batch
        # Under "auto" the search ranks pipelines as ZB-H1 runs them (1F1B's memory bound and splits, its
        # fill), and the best plans try every schedule per pipeline class by its exact price
        # (``best_schedules``); a fixed schedule is searched as such.
        auto = settings.schedule == AUTO
        self.choices = (ScheduleChoice("zb-h1"),) if auto else schedule_choices(settings.schedule)
        self.variant_choices = schedule_choices(AUTO) if auto else ()
        if auto and choices is not None:
            self.choices = choices
        self.stats = SearchStats()
        self._sync_cache: dict[tuple, float] = {}
        self._p2p: dict[tuple[int, int], tuple[float, float]] = {}
        self._spare: dict[tuple, float] = {}
        self._room: dict[tuple, float | None] = {}
        self._open: dict[tuple, float] = {}
        self._bare: dict[tuple, Pipeline] = {}
        self._ranges: dict[tuple, list[tuple[tuple[int, int], ...]]] = {}
        self._stages: dict[tuple, Stage] = {}
        self._seen_blocks: set[tuple] = set()
        names = {n.name: i for i, n in enumerate(self.cluster.nodes)}
        self._node_idx = [names[d.node] for d in self.cluster.devices]
        self._device_links = any(o.devices is not None for o in self.cluster.bandwidth_overrides)
        self.clip_s = cm.clip_time(self.devices)
        if shared is not None:
            for name in SHARED_CACHES:
                self.__dict__[name] = shared.setdefault(name, {})

    # -- small helpers -------------------------------------------------------------------------------

    def out_of_time(self, phase: str) -> bool:
        """Whether the time limit has passed; if so ``phase`` is recorded as cut short (``SearchStats.cut``)."""
        if time.perf_counter() > self.deadline:
            self.stats.cut(phase)
            return True
        return False

    @memo
    def layer_s(self, kind: GroupKind) -> float:
        return self.cm.stage(kind.device_type, kind.tp, 1, False, False).time_s

    def memory_gib(self, kind: GroupKind) -> float:
        return self.cluster.device_types[kind.device_type].memory_gib

    @memo
    def groups(self, choice: tuple[TypeChoice, ...]) -> dict[GroupKind, list[TPGroup]]:
        out: dict[GroupKind, list[TPGroup]] = {}
        for c in choice:
            gs = form_groups(self.cluster, self.model, {c.device_type: c.tp}, self.devices, c.remainder)
            for k, v in groups_by_kind(gs).items():
                out.setdefault(k, []).extend(v)
        return out

    def zero_degree(self, pipelines: int) -> int:
        return zero_degree(pipelines, self.settings.zero)

    def _slots(self, template: Template, zero_degree: int, choice: ScheduleChoice, partial: bool = True
               ) -> tuple[SlotCost, ...]:
        """``partial=False``: without partial recompute (whole-stage recompute only)."""
        slots = slot_costs(self.cm, template, zero_degree=zero_degree, recompute=self.settings.allow_recompute,
                           memory_margin=self.settings.memory_margin, schedule=choice)
        if partial and self.settings.partial_recompute:
            return slots
        return tuple(dataclasses.replace(s, partial=()) for s in slots)

    @memo
    def fast_split(self, template: Template, zero_degree: int, choice: ScheduleChoice, partial: bool = True
                   ) -> LayerSplit | None:
        """The min-max split under ``choice``'s memory (None if none fits, or a stage gets fewer layers
        than chunks)."""
        sp = self._split_of(self._slots(template, zero_degree, choice, partial))
        return None if sp is None or min(sp.layers) < choice.chunks else sp

    @memo
    def _split_of(self, slots: tuple[SlotCost, ...]) -> LayerSplit | None:
        """``split_fast`` per distinct slots: schedules of one memory bound and placement (1F1B and ZB-H1)
        share their splits."""
        return split_fast(slots, self.model.num_layers)

    @memo
    def fill(self, template: Template, choice: ScheduleChoice) -> tuple[float, float]:
        """``fill_factor`` of ``choice`` on this template (its first kind's op shares)."""
        kind = template[0]
        shares = rounded_shares(self.cm.chunk_cost(kind.device_type, kind.tp, 1, False, False))
        return fill_factor(choice, len(template), shares)

    def class_schedule(self, template: Template, boundary: float, zero_degree: int, micro_batches: int,
                       choices: Sequence[ScheduleChoice] | None = None
                       ) -> tuple[ScheduleChoice, LayerSplit, float, float] | None:
        """The schedule (of ``choices``, default those the settings allow) whose fast split runs
        ``micro_batches`` fastest by ``LayerSplit.pipeline_s`` with its fill factor; None if none fits."""
        best = None
        for choice in self.choices if choices is None else choices:
            sp = self.fast_split(template, zero_degree, choice)
            if sp is None:
                continue
            fill, hops = self.fill(template, choice)
            t = sp.pipeline_s(micro_batches, hops * boundary, fill)
            if best is None or t < best[0] - 1e-12:
                best = (t, choice, sp, fill, hops)
        return None if best is None else best[1:]

    def _hop_s(self, a: int, b: int) -> tuple[float, float]:
        """One boundary each way between stages led by devices ``a`` and ``b`` (``p2p_time`` prices a
        transfer by the link between the stages' first devices), cached by their nodes (or devices, where
        the cluster overrides single devices' links)."""
        key = (a, b) if self._device_links else (self._node_idx[a], self._node_idx[b])
        hit = self._p2p.get(key)
        if hit is None:
            hit = self._p2p[key] = (self.cm.p2p_time((a,), (b,)), self.cm.p2p_time((b,), (a,)))
        return hit

    def _pair_s(self, a: int, b: int) -> float:
        """One boundary both ways (``_hop_s``' sum)."""
        there, back = self._hop_s(a, b)
        return there + back

    def boundary_s(self, layout: PipelineLayout) -> float:
        gs = layout.groups
        return sum(self._pair_s(a.devices[0], b.devices[0]) for a, b in zip(gs, gs[1:]))

    def hops(self, layout: PipelineLayout) -> tuple[tuple[float, float], ...]:
        """Per stage boundary of ``layout`` its transfer time each way: what its exact time and bounds read
        of its devices besides their types (``CostModel.pipeline_costs``), so the key under which pipelines
        on other devices of alike nodes share those prices. (Not the boundaries' sum: two layouts whose
        hops differ but sum alike run differently.)"""
        gs = layout.groups
        return tuple(self._hop_s(a.devices[0], b.devices[0]) for a, b in zip(gs, gs[1:]))

    # -- blocks --------------------------------------------------------------------------------------

    def evaluate_block(self, choice: tuple[TypeChoice, ...], pipelines: int, order: str,
                       stages: int | None = None, placement: str = "contiguous",
                       shares: Sequence[Mapping[GroupKind, int]] | None = None) -> BlockCandidate | None:
        """``stages``: use only ``pipelines x stages`` groups (one kind), the rest idle. ``shares``: groups
        of each kind per pipeline (default: as even as possible)."""
        job = self.block_job(choice, pipelines, order, stages, placement, shares)
        return None if job is None else self.build_block(job)

    def block_job(self, choice: tuple[TypeChoice, ...], pipelines: int, order: str,
                  stages: int | None = None, placement: str = "contiguous",
                  shares: Sequence[Mapping[GroupKind, int]] | None = None) -> BlockJob | None:
        """``evaluate_block`` up to dealing the groups: all that decides whether the block exists (its
        pipelines' templates, their fast splits, not evaluated already in another order), without its
        layouts and classes (``build_block``); ``job_bound`` bounds what ``_keep`` ranks it by."""
        self.stats.block_evaluations += 1
        groups = self.groups(choice)
        if stages is not None:
            (kind, gs), = groups.items()
            if pipelines * stages > len(gs):
                return None
            groups = {kind: gs[:pipelines * stages]}
        ranked = kind_order(list(groups), self.memory_gib, self.layer_s, order)
        zd = self.zero_degree(pipelines)
        # Templates first: a block whose pipelines cannot hold the model is dropped before dealing groups.
        if shares is None:
            shares = share_out({k: len(v) for k, v in groups.items() if v}, pipelines)
        if shares is None:
            return None
        templates = tuple(sorted(tuple(k for k in ranked for _ in range(sh.get(k, 0))) for sh in shares))
        # Another stage order or share-out that gives the same pipelines was evaluated already.
        seen_key = (choice, stages, placement, templates)
        if seen_key in self._seen_blocks:
            return None
        self._seen_blocks.add(seen_key)
        for template in set(templates):
            if len(template) > self.model.num_layers or all(self.fast_split(template, zd, c) is None
                                                            for c in self.choices):
                return None
        if placement != "contiguous" and all(
                deal(len(gs), [sh.get(k, 0) for sh in shares], placement)
                == deal(len(gs), [sh.get(k, 0) for sh in shares], "contiguous") for k, gs in groups.items()):
            return None   # the same pipelines as the contiguous placement
        return BlockJob(choice, pipelines, order, placement, groups, tuple(ranked), tuple(shares), templates)

    def build_block(self, job: BlockJob) -> BlockCandidate | None:
        """The rest of ``evaluate_block``: the groups dealt, the pipelines' classes (schedule, split, room
        for raised activation bounds)."""
        layouts = build_pipelines(job.groups, job.pipelines, job.ranked, job.placement, job.shares)
        if layouts is None:
            return None
        zd = self.zero_degree(job.pipelines)
        by_class: dict[tuple[Template, float], list[int]] = {}
        for i, lay in enumerate(layouts):
            by_class.setdefault((lay.template, round(self.boundary_s(lay), 12)), []).append(i)
        classes = []
        m_each = max(1, self.micro_batches // job.pipelines)
        for (template, bnd), members in by_class.items():
            picked = self.class_schedule(template, bnd, zd, max(len(template), m_each))
            if picked is None:
                return None
            sched, split, fill, hops = picked
            m = max(len(template), m_each)
            room = self.spare_room(layouts[members[0]], zd, split, sched, m)
            classes.append(ClassInfo(template, bnd, tuple(members), split, sched, fill, hops, room, spare_count=m))
        return BlockCandidate(job.choice, job.pipelines, job.order, job.placement, tuple(layouts), tuple(classes))

    def job_bound(self, job: BlockJob, share: float) -> float:
        """A lower bound of ``_keep``'s cheap bound of the block ``job`` builds (``_span_alone`` on each
        class's ``floor_option``, plus the clip), from its templates alone: per template the least slowest
        stage over the schedules searched and a fixed time without the boundary transfers (``option`` adds
        ``hops * boundary >= 0``; ``pipeline_step_bound`` only grows with each transfer time, so
        ``open_bound``, the same bound with none, is at most ``spare_bound_s``). The greedy allocation's
        makespan only falls with per-micro-batch and fixed times, and pipelines alike in both count as one
        class; a margin against rounding (``BOUND_ROUNDING``)."""
        zd = self.zero_degree(job.pipelines)
        m_each = max(1, self.micro_batches // job.pipelines)
        counts = Counter(job.templates)
        classes = []
        for template, n in counts.items():
            m = max(len(template), m_each)
            per = fixed = math.inf
            for choice in self.choices:
                sp = self.fast_split(template, zd, choice)
                if sp is None:
                    continue
                fill_s = self.fill(template, choice)[0] * (sp.sum_s - sp.max_s)
                room_s = self.open_bound(template, job.groups, sp, choice, m) - m * sp.max_s
                per, fixed = min(per, sp.max_s), min(fixed, max(0.0, min(fill_s, room_s)))
            if not math.isfinite(per):
                return math.inf
            classes.append(PipelineClass((TimeOption(per, fixed),), len(template), n))
        m_total = max(sum(len(t) for t in job.templates), round(self.micro_batches * share))
        alloc = allocate_greedy(classes, m_total)
        if alloc is None:
            return math.inf
        return (alloc.makespan_s + self.clip_s) * (1 - BOUND_ROUNDING) - 1e-12

    def open_bound(self, template: Template, groups: Mapping[GroupKind, Sequence[TPGroup]], split: LayerSplit,
                   choice: ScheduleChoice, micro_batches: int) -> float:
        """``pipeline_step_bound`` of a pipeline of ``template`` with ``split`` under ``choice`` and every
        transfer time 0: a bound of it on any devices of those kinds (the bound grows with each transfer,
        and the chunk costs read the devices' types only); cached per (template, split, schedule, count)."""
        key = (template, split, choice, micro_batches)
        hit = self._open.get(key)
        if hit is None:
            taken: dict[GroupKind, int] = {}
            chain = []
            for kind in template:
                chain.append(groups[kind][taken.get(kind, 0)])
                taken[kind] = taken.get(kind, 0) + 1
            lay = PipelineLayout(tuple(chain))
            one = Strategy(name="class", pipelines=(self._bare_pipeline(lay, split, micro_batches, choice),))
            costs = self.cm.pipeline_costs(one, 0, choice.name)
            hit = self._open[key] = step_time_bound(choice.name, len(template), micro_batches, choice.chunks,
                                                    Costs(costs.chunks))
        return hit

    def spare_room(self, lay: PipelineLayout, zero_degree: int, split: LayerSplit, choice: ScheduleChoice,
                   micro_batches: int) -> float | None:
        """Where a stage of the class's pipeline can hold more activations than its schedule's bound (by
        memory), a lower bound of its time with the bounds raised (``CostModel.pipeline_step_bound``: any
        op order; no lists built); None where none can."""
        if not self.settings.spare_activations:
            return None
        key = (lay.template, self.hops(lay), zero_degree, split, choice, micro_batches)
        if key not in self._room:
            one = Strategy(name="class", pipelines=(self._bare_pipeline(lay, split, micro_batches, choice),))
            room = spare_activation_limits(self.cm, one, 0, choice.name, zero_degree,
                                           self.settings.memory_margin) is not None
            self._room[key] = self._class_bound(lay, split, micro_batches, choice) if room else None
        return self._room[key]

    def spare_gain(self, lay: PipelineLayout, zero_degree: int, split: LayerSplit, choice: ScheduleChoice,
                   micro_batches: int, proxy_s: float) -> float:
        """Seconds by which the exact time of the class's pipeline (``lay`` with ``split`` under ``choice``,
        ``micro_batches``) with its activation bounds raised to what its stages' free memory holds
        (``spare_activation_limits``, as ``with_spare_limits`` raises them for the plans the search returns)
        falls below ``proxy_s``, its ranking price at that count; 0 where no stage has room or it does not.
        Without it the ranking prices every pipeline at its schedule's own bounds and drops plans that raising
        makes the fastest (h2-example: ``2 x [chip-a/tp2 x4 > chip-b/tp2]``, 11.92 s at the bounds, 11.28 s
        raised). Against the proxy, not the exact time at the own bounds: what raising recovers there is
        often a steady-state stall the proxy never charged. Cached per (template, ``hops``, split, schedule,
        count, proxy): blocks share their classes, and pipelines on alike nodes their prices."""
        if not self.settings.spare_activations:
            return 0.0
        key = (lay.template, self.hops(lay), zero_degree, split, choice, micro_batches, proxy_s)
        hit = self._spare.get(key)
        if hit is None:
            # Memory and the bound from the bare pipeline (neither reads the op costs); the costed one only to play.
            one = Strategy(name="class", pipelines=(self._bare_pipeline(lay, split, micro_batches, choice),))
            limits = spare_activation_limits(self.cm, one, 0, choice.name, zero_degree, self.settings.memory_margin)
            hit = 0.0
            # The lists are played only where the time can fall below the proxy: ``pipeline_step_bound`` holds
            # for any op order, so for any activation limits (the same costs), up to rounding (the margin), and
            # above the proxy it leaves no gain (exact: the same 0 the played time would give).
            if limits is not None and \
                    self.cm.pipeline_step_bound(one, 0, choice.name) * (1 - BOUND_ROUNDING) - 1e-12 < proxy_s:
                pipe = self._pipeline(lay, split, micro_batches, choice)
                raised = Strategy(name="class", pipelines=(dataclasses.replace(pipe, activation_limits=limits),))
                hit = max(0.0, proxy_s - self.cm.pipeline_step_time(raised, 0, choice.name))
            self._spare[key] = hit
        return hit

    def complete(self, draft: BlockCandidate) -> BlockCandidate:
        """``draft`` with its gradient sync and optimizer terms (what ``overheads`` prices) and each class's
        ``spare_gain`` (priced here, not for every draft: it plays the schedule)."""
        return self.with_spare_gains(self.with_sync(draft))

    def with_sync(self, draft: BlockCandidate) -> BlockCandidate:
        """``draft`` with its gradient sync and optimizer terms: what ``overheads`` prices (from the splits,
        layouts and schedules alone: the spare gains change none of them)."""
        grad_bytes, opt_terms = self._terms(draft.classes)
        rings = self._sync_rings(draft.layouts, draft.classes) if draft.pipelines > 1 else ()
        return dataclasses.replace(draft, grad_bytes=grad_bytes, opt_terms=opt_terms, sync_rings=rings[:SYNC_RINGS],
                                   sync_self_s=rings[0][2] if rings else 0.0)

    def with_spare_gains(self, draft: BlockCandidate, only: int | None = None) -> BlockCandidate:
        """``draft`` with each class's ``spare_gain`` where it has room and none is priced yet (``only``: that
        class alone; a class's gain reads nothing of the others')."""
        zd = self.zero_degree(draft.pipelines)
        classes = []
        late = any(c.spare_s is None and c.spare_room for c in draft.classes) and \
            self.out_of_time("raised activation limits")   # past the limit: ranked without them
        for j, c in enumerate(draft.classes):
            if c.spare_s is None and c.spare_room and not late and only in (None, j):
                m = c.spare_count
                c = dataclasses.replace(c, spare_s=self.spare_gain(draft.layouts[c.members[0]], zd, c.split,
                                                                   c.schedule, m, c.option().time(m)))
            classes.append(c)
        return dataclasses.replace(draft, classes=tuple(classes))

    def _sync_rings(self, layouts: Sequence[PipelineLayout], classes: Sequence[ClassInfo]
                    ) -> list[tuple[tuple[int, ...], float, float]]:
        """The block's own gradient sync as ``CostModel.sync_plan`` lays it out, from the fast splits: the
        layers cut where any class changes stage, each segment all-reduced among its holders (one device
        per pipeline; TP slices priced as one ring through the groups' first devices), a stage's segments
        with the same holders fused. Returns (ring, bytes, seconds) per stage of each class, costliest
        first."""
        n_layers = self.model.num_layers
        ranges = [[(lo, hi, k) for k, chunks in enumerate(stage_layer_ranges(c.split.layers, c.schedule))
                   for lo, hi in chunks] for c in classes]
        cuts = sorted({0, n_layers} | {b for rs in ranges for r in rs for b in r[:2]})
        fused: dict[tuple[int, int], dict[tuple[int, ...], float]] = {}
        ring_keys: dict[tuple[int, ...], tuple[int, ...]] = {}
        for a, b in zip(cuts, cuts[1:]):
            holders = []
            devs: list[int] = []
            for ci, (c, rs) in enumerate(zip(classes, ranges)):
                k = next(i for lo, hi, i in rs if lo <= a < hi)
                holders.append((ci, k))
                devs.extend(layouts[i].groups[k].devices[0] for i in c.members)
            if len(devs) < 2:
                continue
            ring = tuple(sorted(devs))
            if ring not in ring_keys:
                ring_keys[ring] = self._ring_key(ring)
            for ci, k in holders:
                nbytes = self._segment_grad_bytes(classes[ci].template[k], b - a, a == 0, b == n_layers)
                per = fused.setdefault((ci, k), {})
                per[ring] = per.get(ring, 0.0) + nbytes
        out = []
        for per in fused.values():
            secs = sum(self._keyed_ring_time(ring_keys[ring], ring, nbytes) for ring, nbytes in per.items())
            biggest = max(per, key=lambda r: (per[r], r))
            out.append((biggest, sum(per.values()), secs))
        out.sort(key=lambda r: (-r[2], r[0]))
        return out

    @memo
    def _segment_grad_bytes(self, kind: GroupKind, layers: int, first: bool, last: bool) -> float:
        """Gradient bytes of ``layers`` decoder layers on ``kind`` (with the embedding where the segment
        starts at layer 0, the head where it ends at the last layer: the stage holding them holds those)."""
        params = layers * self.cm.layer(kind.device_type, kind.tp).params
        if first:
            params += self.cm.extras(kind.device_type, kind.tp, True, False).params
        if last:
            params += self.cm.extras(kind.device_type, kind.tp, False, True).params
        return params * self.cm.profiles[kind.device_type].memory.grad_bytes

    def _ring_key(self, ring: tuple[int, ...]) -> tuple[int, ...]:
        return ring if self._device_links else tuple(self._node_idx[d] for d in ring)

    def ring_time(self, ring: tuple[int, ...], nbytes: float) -> float:
        """``allreduce_time`` of a ring, cached by the ring's nodes (a node holds one device type, and
        links depend on nodes only, unless the cluster overrides single devices' bandwidth)."""
        return self._keyed_ring_time(self._ring_key(ring), ring, nbytes)

    def _keyed_ring_time(self, key: tuple[int, ...], ring: tuple[int, ...], nbytes: float) -> float:
        hit = self._sync_cache.get((key, nbytes))
        if hit is None:
            hit = self._sync_cache[(key, nbytes)] = self.cm.allreduce_time(list(ring), nbytes)
        return hit

    def _terms(self, classes: Sequence[ClassInfo]) -> tuple[float, tuple[tuple[str, int, int], ...]]:
        """The largest per-device gradient and, per device type, the stages with the most parameters and
        the most tensors (what the optimizer step's time grows with)."""
        grad = 0.0
        opt: dict[tuple[str, int], tuple[int, int]] = {}
        for c in classes:
            n_st = len(c.template)
            for k, (kind, n) in enumerate(zip(c.template, c.split.layers)):
                first, last = c.schedule.ends(k, n_st)
                params = self.cm.stage(kind.device_type, kind.tp, n, first, last).params
                tensors = self.cm.tensors_per_stage(n, first, last)
                grad = max(grad, params * self.cm.profiles[kind.device_type].memory.grad_bytes)
                t = kind.device_type
                for key, val in (((t, 0), params), ((t, 1), tensors)):
                    if key not in opt or val > (opt[key][0] if key[1] == 0 else opt[key][1]):
                        opt[key] = (params, tensors)
        return grad, tuple(sorted({(t, p, n) for (t, _), (p, n) in opt.items()}))

    @staticmethod
    def share_options(groups: Mapping[GroupKind, Sequence[TPGroup]], pipelines: int) -> list[Shares | None]:
        """How a block's groups may be shared out to its pipelines: as evenly as possible (None), and for a
        small block of several kinds over 2-3 pipelines every other way (``distributions``), so that
        pipelines may differ as much as the devices do."""
        counts = {k: len(v) for k, v in groups.items() if v}
        out: list[Shares | None] = [None]
        if len(counts) < 2 or sum(counts.values()) > SMALL_BLOCK_GROUPS or not 2 <= pipelines <= UNEVEN_PIPELINES:
            return out
        even = share_out(counts, pipelines)
        canon = None if even is None else sorted(tuple(sorted(sh.items())) for sh in even)
        for way in distributions(counts, pipelines, DISTRIBUTIONS_LIMIT) or []:
            if sorted(tuple(sorted(sh.items())) for sh in way) != canon:
                out.append(tuple(way))
        return out

    @staticmethod
    def placements(pipelines: int) -> tuple[str, ...]:
        """One pipeline has no gradient-sync peers to place next to each other."""
        return PLACEMENTS if pipelines > 1 else PLACEMENTS[:1]

    def pipeline_counts(self, groups: int) -> list[int]:
        """Pipeline counts worth trying for a block of ``groups`` TP groups: every stage count's nearest
        pipeline counts, and the divisors of ``groups`` (even pipelines)."""
        n_layers = self.model.num_layers
        top = min(groups, self.micro_batches)
        out = set()
        for s in range(1, n_layers + 1):
            for p in (groups // s, -(-groups // s)):
                if 1 <= p <= top:
                    out.add(p)
        out.update(p for p in range(1, top + 1) if groups % p == 0)
        return sorted(out)

    # -- combination ---------------------------------------------------------------------------------

    def overheads(self, blocks: Sequence[BlockCandidate]) -> float:
        """Gradient sync + optimizer + clip of a combination, from the cost model's own pricing: the
        largest per-device gradient all-reduced over one device of every pipeline, the heaviest
        optimizer step, the clip all-reduce. A ranking proxy only: realized plans get ``estimate``."""
        p = sum(b.pipelines for b in blocks)
        sync = 0.0
        if len(blocks) == 1:
            sync = blocks[0].sync_self_s
        elif p > 1:
            # Each block's costliest positions, joined by one device of every other pipeline.
            for i, b in enumerate(blocks):
                others = tuple(d for j, o in enumerate(blocks) if j != i for d in o.rep_devices)
                rings = b.sync_rings or ((b.rep_devices, b.grad_bytes),)
                for ring, nbytes, *_ in rings:
                    sync = max(sync, self.ring_time(tuple(sorted(ring + others)), nbytes))
        zd = self.zero_degree(p)
        opt = max(self.cm.optimizer_time(t, n, zd, k) for b in blocks for t, n, k in b.opt_terms)
        return sync + opt + self.clip_s

    def score(self, blocks: Sequence[BlockCandidate]) -> tuple[float, Allocation] | None:
        """Fast step-time estimate of a combination (greedy allocation over the fast splits)."""
        p = sum(b.pipelines for b in blocks)
        if p < self.settings.min_pipelines:
            return None
        if sum(b.min_micro_batches for b in blocks) > self.micro_batches:
            return None
        classes = [PipelineClass((c.option(),), len(c.template), len(c.members)) for b in blocks for c in b.classes]
        alloc = allocate_greedy(classes, self.micro_batches)
        if alloc is None:
            return None
        return alloc.makespan_s + self.overheads(blocks), alloc

    # -- the whole search ----------------------------------------------------------------------------

    def run(self) -> list[Candidate]:
        """The phases of the module docstring, each on what the one before kept (``search``'s parallel path
        runs the same three parts, ``start``, ``mixed_blocks`` per chunk of subsets of types and ``finish``, as
        tasks)."""
        start = self.start()
        subsets = mixed_subsets(start.types)
        return self.finish(start, dict(zip(map(frozenset, subsets), self.mixed_blocks(start.mixed, subsets))))

    def start(self) -> SearchStart:
        """Phase 1 and phase 2's single-type blocks: what the mixed blocks and ``finish`` build on."""
        choices = tp_choices(self.cluster, self.model, self.devices)
        types = tuple(t for t, tps in choices.items() if tps)
        single = self._single_type_blocks(choices, types)
        # Share of the batch a block of these types would get, from the single-type throughputs.
        best_rate = {t: max((c.rate for c in single[t]), default=0.0) for t in types}
        total_rate = sum(best_rate.values()) or 1.0
        blocks = {frozenset([t]): self._keep(single[t], best_rate[t] / total_rate) for t in types}
        mixed = MixedInputs(self._top_choices(choices, types, blocks),
                            frozenset(t for t in types if blocks[frozenset([t])]), best_rate, total_rate)
        return SearchStart(types, blocks, mixed)

    def finish(self, start: SearchStart, mixed: Mapping[frozenset[str], list[BlockCandidate]]) -> list[Candidate]:
        """Phases 3-5 on the kept blocks, single-type and mixed."""
        types = start.types
        blocks = {**start.singles, **mixed}
        realized = self._realize_best(types, self.combine(types, blocks))
        exact = self._price_best(realized)
        if not exact and realized:
            # Past the time limit before any exact price (the runtime's lists of a large batch take long to
            # play): the best plan by its proxy, marked as such (``Candidate.proxy``).
            return [realized[0][0]]
        final = self._finalize_best(types, exact + [r for r in realized if all(r[1] is not e[1] for e in exact)])
        # Only exactly priced plans are returned, so that every candidate is compared on the same estimate
        # (``exact`` has its raised limits already).
        return [c for c, _, _ in exact] + [self.with_spare_limits(c) for c in final]

    def with_spare_limits(self, cand: Candidate) -> Candidate:
        """``cand`` with each pipeline's activation bound raised to what its stages' free memory holds
        (``spare_activation_limits``), where the exact estimate says that is faster; else ``cand``."""
        if not self.settings.spare_activations or self.out_of_time("raised activation limits"):
            return cand
        zd = self.zero_degree(len(cand.strategy.pipelines))
        pipes = []
        for pi, pipe in enumerate(cand.strategy.pipelines):
            name = pipe.schedule if pipe.schedule is not None else self.settings.default_schedule
            limits = spare_activation_limits(self.cm, cand.strategy, pi, name, zd, self.settings.memory_margin)
            pipes.append(pipe if limits is None else dataclasses.replace(pipe, activation_limits=limits))
        if all(a is b for a, b in zip(pipes, cand.strategy.pipelines)):
            return cand
        # The estimate's sum but for the slowest pipeline is the same with any limits (memory aside, and a
        # plan that is not faster is not taken): with a slowest pipeline unchanged it cannot get faster.
        times = [p.time_s for p in cand.estimate.pipelines]
        slowest = max(times)
        if any(a is b for a, b, t in zip(pipes, cand.strategy.pipelines, times) if t == slowest):
            return cand
        strategy = dataclasses.replace(cand.strategy, pipelines=tuple(pipes))
        est = self.cm.estimate(strategy, self.settings.global_batch, self.settings.default_schedule,
                               self.settings.zero)
        if not est.fits or est.step_time_s >= cand.step_time_s - 1e-12:
            return cand
        return dataclasses.replace(cand, strategy=strategy, estimate=est)

    def _price_best(self, realized: Sequence[tuple[Candidate, Combo, Allocation]]
                    ) -> list[tuple[Candidate, Combo, Allocation]]:
        """Phase 4b: the best ``EXACT_REALIZED`` realized plans (by the proxy) priced exactly, and with
        ``schedule="auto"`` each also with every pipeline class on the schedule that runs it fastest
        (``best_schedules``). Best first, each with its raised activation limits (``with_spare_limits``) as
        it will be returned: the finalists are the best of these, and a plan the raised limits make fast
        ranks low at the schedules' own bounds."""
        out = []
        for cand, combo, alloc in realized[:EXACT_REALIZED]:
            if self.out_of_time("exact pricing"):
                break   # past the limit (``run`` falls back on the best proxy-priced plan if none is priced)
            out.append((self.with_spare_limits(self.exact(cand)), combo, alloc))
            if self.out_of_time("schedule per pipeline class"):
                continue
            variant = self.best_schedules(combo, alloc)
            if variant is not None:
                alt = self.realize(variant, alloc)
                if alt is not None:
                    out.append((self.with_spare_limits(self.exact(alt)), variant, alloc))
        out.sort(key=lambda x: x[0].step_time_s)
        return out

    def best_schedules(self, combo: Combo, alloc: Allocation) -> Combo | None:
        """``combo`` with each pipeline class on the schedule of ``variant_choices`` (its own fast split
        under that schedule's memory) whose exact pipeline time (``CostModel.pipeline_step_time``: the
        runtime's lists played on the op costs) at the class's micro-batch count is least; None when no
        class changes. The search itself ranks pipelines by ZB-H1's proxy under "auto", where the
        proxies of the other schedules mislead (per-chunk fixed costs, v times the messages)."""
        if not self.variant_choices:
            return None
        zd = self.zero_degree(sum(b.pipelines for b in combo))
        blocks, changed, hj = [], False, 0
        for b in combo:
            classes = []
            for c in b.classes:
                mb = max(alloc.per_class[hj])
                hj += 1
                lay = b.layouts[c.members[0]]
                best = (self._class_time(lay, c.split, mb, c.schedule), c)
                for choice in self.variant_choices:
                    sp = self.fast_split(c.template, zd, choice)
                    if choice == c.schedule or sp is None or (choice.name == "interleaved" and mb < len(c.template)):
                        continue
                    if self._class_bound(lay, sp, mb, choice) >= best[0] - 1e-12:
                        continue   # cannot beat the best so far: not worth its action lists
                    t = self._class_time(lay, sp, mb, choice)
                    if t < best[0] - 1e-12:
                        fill, hops = self.fill(c.template, choice)
                        proxy = time_option(sp, c.boundary_s, fill, hops).time(mb)
                        best = (t, dataclasses.replace(
                            c, split=sp, schedule=choice, fill=fill, hops=hops,
                            spare_bound_s=self.spare_room(lay, zd, sp, choice, mb), spare_count=mb,
                            spare_s=self.spare_gain(lay, zd, sp, choice, mb, proxy)))
                changed |= best[1] is not c
                classes.append(best[1])
            blocks.append(dataclasses.replace(b, classes=tuple(classes)))
        return tuple(blocks) if changed else None

    def _class_time(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                    ) -> float:
        """The exact pipeline time of one pipeline of a class (the runtime's lists played on its op costs)."""
        one = Strategy(name="class", pipelines=(self._pipeline(lay, split, micro_batches, choice),))
        return self.cm.pipeline_step_time(one, 0, choice.name)

    def _class_bound(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                     ) -> float:
        """A lower bound of ``_class_time`` that builds no lists (``CostModel.pipeline_step_bound``). On the bare
        pipeline: the bound reads the cost model's chunk and transfer costs, not the op costs a plan carries
        (``costed_pipeline``), so it is the same number without building them."""
        one = Strategy(name="class", pipelines=(self._bare_pipeline(lay, split, micro_batches, choice),))
        return self.cm.pipeline_step_bound(one, 0, choice.name)

    def _single_type_jobs(self, choices: Mapping[str, Sequence[int]], types: Sequence[str]) -> Iterator[Job]:
        """Single-type blocks to evaluate: all of a type's groups, or P x S of them, at every TP degree."""
        for t in types:
            for c in [TypeChoice(t, tp, rem) for tp in choices[t] for rem in (True, False)]:
                choice = (c,)
                gs = self.groups(choice)
                total = sum(len(v) for v in gs.values())
                if total == 0 or (not c.remainder and len(self.groups((TypeChoice(t, c.tp),))) == len(gs)):
                    continue   # rem=False only differs where a node has left-over devices
                for p in self.pipeline_counts(total):
                    for sh in self.share_options(gs, p):
                        for place in self.placements(p):
                            yield choice, p, "memory", None, place, sh
                if len(gs) == 1:
                    for s in range(1, self.model.num_layers + 1):
                        p = min(total // s, self.micro_batches // s)
                        if p >= 1 and p * s < total:
                            for place in self.placements(p):
                                yield choice, p, "memory", s, place, None

    def _single_type_blocks(self, choices: Mapping[str, Sequence[int]], types: Sequence[str]
                            ) -> dict[str, list[BlockCandidate]]:
        """Phase 2 for one type at a time: every feasible block of ``_single_type_jobs``, by type."""
        single: dict[str, list[BlockCandidate]] = {t: [] for t in types}
        jobs = list(self._single_type_jobs(choices, types))
        self._report("pipelines (single type)", 0, len(jobs))
        found = False
        for i, (choice, p, order, s, place, sh) in enumerate(jobs):
            if i % 64 == 0:
                self._report("pipelines (single type)", i, len(jobs))
            # Past the time limit the search goes on only until it has a block (a plan to return).
            if found and self.out_of_time("single-type pipelines"):
                break
            cand = self.evaluate_block(choice, p, order, s, place, sh)
            if cand is not None:
                single[choice[0].device_type].append(cand)
                found = True
        self._report("pipelines (single type)", len(jobs), len(jobs))
        return single

    def _top_choices(self, choices: Mapping[str, Sequence[int]], types: Sequence[str],
                     blocks: Mapping[frozenset[str], list[BlockCandidate]]) -> dict[str, tuple[TypeChoice, ...]]:
        """Per type, the TP choices of its best own pipelines, then every degree by time per layer (a type
        that cannot hold the model alone, small memory, tries them all)."""
        top: dict[str, tuple[TypeChoice, ...]] = {}
        for t in types:
            seen: list[TypeChoice] = []
            for c in blocks[frozenset([t])]:
                if c.choice[0] not in seen:
                    seen.append(c.choice[0])
            by_eff = sorted(choices[t], key=lambda tp: (tp * self.layer_s(GroupKind(t, tp)), tp))
            for tp in by_eff:
                if TypeChoice(t, tp) not in seen:
                    seen.append(TypeChoice(t, tp))
            top[t] = tuple(seen)
        return top

    def mixed_blocks(self, inputs: MixedInputs, subsets: Sequence[tuple[str, ...]]) -> list[list[BlockCandidate]]:
        """``mixed_block`` of each subset in turn (all of them in ``run``, a chunk in a worker's task); past the
        time limit the rest are skipped once some block is kept."""
        out: list[list[BlockCandidate]] = []
        for done, subset in enumerate(subsets):
            self._report("pipelines (mixed types)", done, len(subsets))
            out.append(self.mixed_block(inputs, subset, bool(inputs.alone) or any(out)))
        self._report("pipelines (mixed types)", len(subsets), len(subsets))
        return out

    def mixed_block(self, inputs: MixedInputs, subset: Sequence[str], have_blocks: bool) -> list[BlockCandidate]:
        """Phase 2 for one subset of >= 2 types: the best TP choices per type, every stage order; the kept
        candidates (for the subset's expected share of the batch). ``have_blocks``: some block is kept
        already, so past the time limit this subset is skipped (``[]``)."""
        if have_blocks and self.out_of_time("mixed-type pipelines"):
            return []
        found: list[BlockJob] = []   # built only where ``_keep`` looks at them
        share = sum(inputs.best_rate[t] for t in subset) / inputs.total_rate
        width = TYPE_CHOICES_MULTI[min(len(subset), 4) - 2]
        lists = [inputs.top_choice[t][:width] if t in inputs.alone else inputs.top_choice[t] for t in subset]
        for combo in itertools.product(*lists):
            if found and self.out_of_time("mixed-type pipelines"):
                break   # the subset's blocks so far are kept
            gs = self.groups(tuple(combo))
            total = sum(len(v) for v in gs.values())
            # Uneven shares only with each type's leading TP choices (they multiply the work).
            uneven = all(c in inputs.top_choice[t][:UNEVEN_CHOICES] for t, c in zip(subset, combo))
            for p in self.pipeline_counts(total):
                for sh in (self.share_options(gs, p) if uneven else [None]):
                    for order in ORDERS:
                        for place in self.placements(p):
                            job = self.block_job(tuple(combo), p, order, None, place, sh)
                            if job is not None:
                                found.append(job)
        return self._keep(found, share)

    @staticmethod
    def _with_each_type(kept: list[_T], ranked: Sequence[_T], types: Sequence[str],
                        combo: Callable[[_T], Sequence[BlockCandidate]]) -> list[_T]:
        """``kept`` and, for each type, the best of ``ranked`` whose combination uses it (if not kept yet):
        so that idle devices can be explained with real numbers."""
        out = list(kept)
        for t in types:
            best = next((x for x in ranked if any(t in b.types for b in combo(x))), None)
            if best is not None and all(combo(best) is not combo(k) for k in out):
                out.append(best)
        return out

    def _realize_best(self, types: Sequence[str], scored: Sequence[tuple[float, Combo, Allocation]]
                      ) -> list[tuple[Candidate, Combo, Allocation]]:
        """Phase 4: the best combinations by the fast score, the best using each type and the best aligned
        ones, realized (fast splits, greedy micro-batches) and scored by the cost model; best first."""
        ranked = [(c, a) for _, c, a in scored]
        picked = self._with_each_type(ranked[:COMBOS_REALIZED], ranked, types, lambda x: x[0])
        aligned = [(c, a) for c, a in ranked if len(c) == 1 and c[0].aligned][:ALIGNED_REALIZED]
        picked += [(c, a) for c, a in aligned if all(c is not p for p, _ in picked)]
        realized: list[tuple[Candidate, Combo, Allocation]] = []
        for i, (combo, alloc) in enumerate(picked):
            self._report("scoring plans with the cost model", i, len(picked))
            if realized and self.out_of_time("scoring plans"):
                break   # past the limit: no more once one plan is scored
            cand = self.realize(combo, alloc)
            if cand is not None:
                realized.append((cand, combo, alloc))
        self._report("scoring plans with the cost model", len(picked), len(picked))
        realized.sort(key=lambda x: x[0].step_time_s)
        return realized

    def _finalize_best(self, types: Sequence[str], realized: Sequence[tuple[Candidate, Combo, Allocation]]
                       ) -> list[Candidate]:
        """Phase 5: exact layer splits and micro-batches (ILPs) for the best realized plans and the best
        one using each type."""
        finalists = self._with_each_type(list(realized[:COMBOS_FINAL]), realized, types, lambda x: x[1])
        out: list[Candidate] = []
        for i, (_, combo, alloc) in enumerate(finalists):
            self._report("exact layer split + micro-batches (ILP)", i, len(finalists))
            if self.out_of_time("exact layer splits and micro-batches"):
                break   # the exactly priced plans stand (``_price_best`` prices at least one)
            out.extend(self.finalize(combo, alloc))
        self._report("exact layer split + micro-batches (ILP)", len(finalists), len(finalists))
        self.stats.finalists += len(finalists)
        return out

    def _span_alone(self, cand: BlockCandidate, share: float = 1.0, floor: bool = False) -> float:
        """The greedy allocation's makespan of a block as if it took ``share`` of the batch alone (``floor``:
        with each class's ``floor_option``, a lower bound before ``complete``)."""
        m = max(cand.min_micro_batches, round(self.micro_batches * share))
        classes = [PipelineClass((c.floor_option() if floor else c.option(),), len(c.template), len(c.members))
                   for c in cand.classes]
        alloc = allocate_greedy(classes, m)
        return math.inf if alloc is None else alloc.makespan_s

    def _keep(self, found: Sequence[BlockCandidate | BlockJob], share: float) -> list[BlockCandidate]:
        """The block candidates worth combining, completed (``complete``): the best when the block gets
        ``share`` of the batch (its expected share next to the other types), and the best when it gets all
        of it; each scored as if it ran alone (makespan plus its ``overheads``). Drafts are completed in
        order of a lower bound of that score (makespan plus clip), so only those that may be kept are; and
        before the spare gains, which play the schedule, each gets a tighter bound (the floor makespan plus
        its own sync and optimizer terms, ``with_sync``), so that only those that still may be kept play it.
        Blocks not built yet (``BlockJob``, the mixed blocks) are built when a bound of that bound from their
        templates (``job_bound``) comes up: those that cannot be kept never deal their groups."""
        built: dict[int, BlockCandidate | None] = {}
        done: dict[int, BlockCandidate] = {}
        synced: dict[int, BlockCandidate] = {}
        partial: dict[int, BlockCandidate] = {}   # drafts with some classes' spare gains priced (``step``)
        lazy = any(isinstance(x, BlockJob) for x in found)
        any_built = [False]

        def draft(i: int) -> BlockCandidate | None:
            x = found[i]
            if isinstance(x, BlockCandidate):
                return x
            if i not in built:
                # Past the time limit no more blocks are built once one is (the ones so far are kept).
                late = any_built[0] and self.out_of_time("mixed-type pipelines")
                built[i] = None if late else self.build_block(x)
                any_built[0] |= built[i] is not None
            return built[i]

        def built_draft(i: int) -> BlockCandidate:   # asked only of drafts whose bound came up: built, not None
            d = draft(i)
            assert d is not None
            return d

        def sync_view(i: int) -> BlockCandidate:
            if i not in synced:
                synced[i] = self.with_sync(built_draft(i))
            return synced[i]

        def full(i: int) -> BlockCandidate:
            if i not in done:
                done[i] = self.with_spare_gains(partial.pop(i, None) or sync_view(i))
            return done[i]

        def view(i: int) -> BlockCandidate:
            return done.get(i) or partial.get(i) or built_draft(i)

        def step(i: int) -> BlockCandidate | None:
            """The draft with one more class's spare gain priced (None when at most one is left: the score's
            own work), so that a draft whose classes are priced one at a time can fall out of the ranking
            before it plays them all. Which class first: the one whose floor is furthest below its option
            at the draft's rate (``floor_overhead``'s term), the likeliest to lift the bound."""
            if i in done:
                return None
            d = partial.get(i) or sync_view(i)
            todo = [j for j, c in enumerate(d.classes) if c.spare_s is None and c.spare_room]
            if len(todo) < 2 or time.perf_counter() > self.deadline:
                return None   # (past the limit ``full`` decides, and records the cut, as before)
            j = max(todo, key=lambda j: (len(d.classes[j].members) * (d.classes[j].option().fixed_s
                                          - d.classes[j].floor_option().fixed_s) / d.classes[j].split.max_s, -j))
            partial[i] = self.with_spare_gains(d, only=j)
            return partial[i]

        out: list[BlockCandidate] = []
        shares = (share, 1.0) if share < 0.999 else (1.0,)
        for k, sh in enumerate(shares):
            # overheads() adds sync + optimizer >= 0 to the clip; the floor span, what the spare limits may save
            # (below it, for blocks not built yet, their templates' bound).
            lower = [self.job_bound(x, sh) if isinstance(x, BlockJob) else
                     self._span_alone(x, sh, floor=True) + self.clip_s for x in found]

            def cheap(i: int, sh: float = sh) -> float:   # ``lower``'s bound once the block is built
                d = draft(i)
                return math.inf if d is None else self._span_alone(d, sh, floor=True) + self.clip_s

            first = cheap if lazy else None

            def score(i: int, sh: float = sh) -> float:
                return self._span_alone(full(i), sh) + self.overheads([full(i)])

            def middle(i: int, sh: float = sh) -> float:   # the overheads are the score's; the floor span below its
                d = partial.get(i) or sync_view(i)
                return self._span_alone(d, sh, floor=True) + self.overheads([d])

            def refine(i: int, sh: float = sh) -> float | None:
                # ``middle`` with one more class priced: a priced class's floor is its option, at or above its
                # floor before, and the greedy makespan only grows with a class's fixed time; the overheads
                # are the score's (the spare gains change none of their terms). The margin: an unpriced
                # class's floor (from the bound) and its option (from the played time) are rounded apart, and
                # a bound an ulp above the score could reorder ties. (``middle`` reads the draft ``step`` priced.)
                return None if step(i) is None else middle(i, sh) * (1 - BOUND_ROUNDING) - 1e-12

            kept = [full(i) for i in _pareto(view, len(found), lower, score, BLOCK_KEEP if k == 0 else BLOCK_KEEP // 2,
                                             middle, first, refine)]
            # ... and the best with identical pipelines (their gradient sync has no chains of waits, which
            # the closed form does not price: see api.simulator_check), in each placement: where the
            # pipelines' stages sit decides between boundary and sync costs, which the ranking prices apart.
            for place in PLACEMENTS:
                aligned = [i for i, c in enumerate(found) if c.aligned and c.placement == place]
                kept += [full(i) for _, i in itertools.islice(lazily_sorted(lower, score, aligned, middle=middle,
                                                                            first=first, refine=refine), 1)]
            for c in kept:
                if all(c is not o for o in out):
                    out.append(c)
        return out

    def combine(self, types: Sequence[str], blocks: Mapping[frozenset[str], list[BlockCandidate]]
                ) -> list[tuple[float, Combo, Allocation]]:
        """Phase 3: every set partition of every subset of the types into blocks, a candidate per block;
        ranked by the fast score."""
        scored: list[tuple[float, Combo, Allocation]] = []
        subsets = [s for r in range(1, len(types) + 1) for s in itertools.combinations(types, r)]
        for si, subset in enumerate(subsets):
            self._report("combining pipelines", si, len(subsets))
            for part in set_partitions(list(subset)):
                lists = [blocks.get(frozenset(b), []) for b in part]
                if any(not x for x in lists):
                    continue
                width = max(2, int(COMBO_BUDGET ** (1.0 / len(lists))))
                lists = [x[:width] for x in lists]
                for combo in itertools.product(*lists):
                    self.stats.combinations += 1
                    res = self.score(combo)
                    if res is not None:
                        scored.append((res[0], tuple(combo), res[1]))
        self._report("combining pipelines", len(subsets), len(subsets))
        scored.sort(key=lambda x: x[0])   # stable: ties keep the order found
        return scored

    # -- realized plans ------------------------------------------------------------------------------

    def _classes(self, combo: Sequence[BlockCandidate], alloc: Allocation
                 ) -> tuple[list[PipelineLayout], list[ClassKey], dict, dict, dict]:
        """Classes over the whole combination (identical template, boundary cost and schedule), their
        members (indices into the layouts), the largest micro-batch count the allocation gave each and
        their schedule's (fill, hops)."""
        layouts = [lay for b in combo for lay in b.layouts]
        keys: list[ClassKey] = []
        members: dict[ClassKey, list[int]] = {}
        most: dict[ClassKey, int] = {}
        fills: dict[ClassKey, tuple[float, float]] = {}
        gi = hj = 0
        for b in combo:
            for c in b.classes:
                key = (c.template, c.boundary_s, c.schedule)
                if key not in members:
                    keys.append(key)
                    members[key] = []
                    fills[key] = (c.fill, c.hops)
                members[key].extend(gi + i for i in c.members)
                most[key] = max(most.get(key, 0), max(alloc.per_class[hj]))
                hj += 1
            gi += len(b.layouts)
        return layouts, keys, members, most, fills

    def _candidate(self, layouts: Sequence[PipelineLayout], split_of: Mapping[int, LayerSplit],
                   mb_of: Mapping[int, int], choice_of: Mapping[int, ScheduleChoice],
                   proxy_s: Sequence[float] | None = None) -> Candidate | None:
        """The plan, estimated (``proxy_s``: with these pipeline times instead of the list scheduler's)."""
        pipes = tuple(self._pipeline(lay, split_of[idx], mb_of[idx], choice_of[idx]) for idx, lay in enumerate(layouts))
        strategy = Strategy(name="planned", pipelines=pipes)
        est = self.cm.estimate(strategy, self.settings.global_batch, self.settings.default_schedule,
                               self.settings.zero, pipeline_s=proxy_s)
        if not est.fits:
            self.stats.notes.append(f"dropped a plan: the cost model reports OOM on devices {est.oom_devices}")
            return None
        used = set(strategy.devices)
        idle = tuple(d for d in self.devices if d not in used)
        return Candidate(strategy, est, self.cm.micro_batch, idle,
                         describe(strategy, self.cluster, self.settings.default_schedule), proxy=proxy_s is not None)

    def exact(self, cand: Candidate) -> Candidate:
        """A proxy-priced candidate with the exact estimate (the list scheduler's pipeline times)."""
        est = self.cm.estimate(cand.strategy, self.settings.global_batch, self.settings.default_schedule,
                               self.settings.zero)
        return dataclasses.replace(cand, estimate=est, proxy=False)

    def _pipeline(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                  ) -> Pipeline:
        """A pipeline of ``lay``'s groups with ``split``'s layers cut into ``choice``'s chunks (its schedule
        named unless it is the plan's default)."""
        # With its costs, as the plan will carry them: the runtime orders its lists by them (and so the price).
        return self.cm.costed_pipeline(self._bare_pipeline(lay, split, micro_batches, choice), choice.name)

    def _bare_pipeline(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                       ) -> Pipeline:
        """``_pipeline`` without its op and transfer costs; cached (a pure function of its arguments: the
        bounds, the memory check and the play of one class each built it, validating every stage anew)."""
        key = (lay, split, micro_batches, choice)
        hit = self._bare.get(key)
        if hit is None:
            partial = split.recompute_layers or (0,) * len(split.layers)
            # Stages and layer ranges shared between the pipelines that have them (each a pure function of
            # its arguments; a ``Stage`` is immutable): many layouts put one group on one layer range, and
            # each ``Stage`` validates itself when built.
            ranges = self._ranges.get((split.layers, choice))
            if ranges is None:
                ranges = self._ranges[split.layers, choice] = stage_layer_ranges(split.layers, choice)
            stages = []
            for g, r, rc, k in zip(lay.groups, ranges, split.recompute, partial):
                st = self._stages.get((g.devices, r, rc, k))
                if st is None:
                    st = self._stages[g.devices, r, rc, k] = Stage(devices=g.devices, layers=r, recompute=rc,
                                                                   recompute_layers=k or None)
                stages.append(st)
            stages = tuple(stages)
            own = None if choice.name == self.settings.default_schedule else choice.name
            hit = self._bare[key] = Pipeline(micro_batches=micro_batches, stages=stages, schedule=own)
        return hit

    def realize(self, combo: Sequence[BlockCandidate], alloc: Allocation) -> Candidate | None:
        """The combination as it was scored: fast splits, greedy micro-batch counts, each class's schedule;
        scored by the cost model (its estimate, not the fast score), each pipeline's time by its class's
        ``time_option`` (a proxy: ``Searcher.exact`` prices the best ones by the list scheduler)."""
        split_of: dict[int, LayerSplit] = {}
        mb_of: dict[int, int] = {}
        choice_of: dict[int, ScheduleChoice] = {}
        proxy: dict[int, float] = {}
        gi = hj = 0
        for b in combo:
            for c in b.classes:
                for i, mb in zip(c.members, alloc.per_class[hj]):
                    split_of[gi + i] = c.split
                    mb_of[gi + i] = mb
                    choice_of[gi + i] = c.schedule
                    proxy[gi + i] = c.option().time(mb)
                hj += 1
            gi += len(b.layouts)
        layouts = [lay for b in combo for lay in b.layouts]
        return self._candidate(layouts, split_of, mb_of, choice_of, [proxy[i] for i in range(len(layouts))])

    def finalize(self, combo: Sequence[BlockCandidate], hint: Allocation) -> list[Candidate]:
        """Exact layer splits and micro-batches for a combination, scored by ``CostModel.estimate``: each
        class offers its fast split and the ILP splits for the micro-batch counts it may get (under its
        schedule's memory and fill), the allocation ILP picks counts and splits together, then each class
        is re-split for its count. Where a class's split recomputes part of a stage, the plan is also
        returned with that class split without partial recompute (``plain``): the closed form the splits
        are chosen by prices partial recompute's extra forwards, but not the activation limits a plain
        split's free memory buys later (``with_spare_limits``), which can make it the faster."""
        layouts, keys, members, hint_m, fills = self._classes(combo, hint)
        zd = self.zero_degree(len(layouts))
        m_total = self.micro_batches
        n_layers = self.model.num_layers
        limit = max(1.0, min(10.0, self.deadline - time.perf_counter()))
        options: list[list[LayerSplit]] = []
        for key in keys:
            template, _, choice = key
            fill = fills[key][0]
            slots = self._slots(template, zd, choice)
            fast = self.fast_split(template, zd, choice)
            if fast is None:
                return []
            found = [fast]
            for mb in sorted({len(template), hint_m[key]}):
                self.stats.ilps += 1
                sp = split_ilp(slots, n_layers, mb, limit, incumbent=fast, fill=fill)
                if sp is not None and sp not in found and min(sp.layers) >= choice.chunks:
                    found.append(sp)
            options.append(found)

        def option(key: ClassKey, sp: LayerSplit) -> TimeOption:
            return time_option(sp, key[1], *fills[key])

        classes = [PipelineClass(tuple(option(key, s) for s in opts), len(key[0]), len(members[key]))
                   for key, opts in zip(keys, options)]
        self.stats.ilps += 1
        alloc = allocate_ilp(classes, m_total, limit)
        if alloc is None:
            return []
        chosen = [opts[o] for opts, o in zip(options, alloc.option)]
        changed = False
        for j, key in enumerate(keys):
            mb = max(alloc.per_class[j])
            if mb in (hint_m[key], len(key[0])):
                continue   # already solved for this count
            self.stats.ilps += 1
            fill = fills[key][0]
            sp = split_ilp(self._slots(key[0], zd, key[2]), n_layers, mb, limit, incumbent=chosen[j], fill=fill)
            if sp is not None and min(sp.layers) >= key[2].chunks and \
                    sp.pipeline_s(mb, fill=fill) < chosen[j].pipeline_s(mb, fill=fill) - 1e-12:
                chosen[j] = sp
                changed = True
        if changed:
            classes = [PipelineClass((option(key, s),), len(key[0]), len(members[key])) for key, s in zip(keys, chosen)]
            self.stats.ilps += 1
            again = allocate_ilp(classes, m_total, limit)
            if again is not None and again.makespan_s <= alloc.makespan_s + 1e-12:
                alloc = again
        plain: list[LayerSplit | None] = list(chosen)
        for j, key in enumerate(keys):   # the exact pipeline time has the last word on each split
            lay, mb, choice = layouts[members[key][0]], max(alloc.per_class[j]), key[2]

            def price(sp: LayerSplit, lay: PipelineLayout = lay, mb: int = mb, choice: ScheduleChoice = choice
                      ) -> float:
                return self._class_time(lay, sp, mb, choice)

            def bound(sp: LayerSplit, lay: PipelineLayout = lay, mb: int = mb, choice: ScheduleChoice = choice
                      ) -> float:
                return self._class_bound(lay, sp, mb, choice)

            budget = max(3, min(24, REFINE_OPS // (3 * len(key[0]) * choice.chunks * mb)))
            chosen[j] = refine_split(self._slots(key[0], zd, choice), chosen[j], price, choice.chunks, budget, bound)
            if any(chosen[j].recompute_layers):
                sp = self.fast_split(key[0], zd, choice, False)
                plain[j] = None if sp is None else \
                    refine_split(self._slots(key[0], zd, choice, False), sp, price, choice.chunks, budget, bound)
        out = []
        for splits in (chosen, plain) if any(p is not c for p, c in zip(plain, chosen)) else (chosen,):
            if any(sp is None for sp in splits):
                continue
            split_of: dict[int, LayerSplit] = {}
            mb_of: dict[int, int] = {}
            choice_of: dict[int, ScheduleChoice] = {}
            for j, key in enumerate(keys):
                for idx, mb in zip(members[key], alloc.per_class[j]):
                    mb_of[idx] = mb
                    split_of[idx] = splits[j]
                    choice_of[idx] = key[2]
            cand = self._candidate(layouts, split_of, mb_of, choice_of)
            if cand is not None:
                out.append(cand)
        return out

    def _report(self, phase: str, done: int, total: int) -> None:
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


def search(cms: Mapping[int, CostModel], settings: PlanSettings, devices: Iterable[int],
           progress: Progress | None = None, workers: int | None = 1) -> tuple[list[Candidate], SearchStats]:
    """Run the search at every micro-batch size in ``cms``; candidates ranked best first, distinct.

    ``workers`` > 1 (None: every core) runs the searches (one per micro-batch size and ``auto_families``
    entry) in worker processes (planner/parallel.py), each cut into tasks (``_parallel_runs``): the same
    candidates, in the same order, but the tasks do not share caches and ``progress`` hears only the
    phases after them."""
    start = time.perf_counter()
    deadline = start + settings.time_limit_s
    devices = tuple(sorted(devices))
    stats = SearchStats()
    found: list[Candidate] = []
    runs = [(b, family) for b in sorted(cms) for family in auto_families(settings)]
    if worker_count(workers, len(runs)) > 1:
        outcomes = _parallel_runs([(cms[b], family) for b, family in runs], settings, devices, deadline, workers)
    else:
        outcomes, shared_by = [], {}
        for b, family in runs:
            if time.perf_counter() > deadline and any(cands for cands, _ in outcomes):
                stats.cut(f"search at micro-batch {b}" + ("" if family is None else f" ({family[0].name} family)"))
                continue   # past the limit with plans in hand: the other searches are skipped
            def report(phase: str, done: int, total: int, b: int = b) -> None:
                if progress is not None:
                    progress(f"micro-batch {b}: {phase}", done, total)

            s = Searcher(cms[b], settings, devices, deadline, report, family, shared_by.setdefault(b, {}))
            outcomes.append((s.run(), s.stats))
    for cands, st in outcomes:
        found.extend(cands)
        stats.add(st)
    ranked = rank(found)
    # The best few: their raised activation limits lowered per stage where that is faster (the search's
    # candidates get them raised all the way: pricing lower ones for all would double its time).
    top = []
    for c in ranked[:LIMITS_REFINED]:
        if time.perf_counter() > deadline:
            stats.cut("refined activation limits")
            top.append(c)
        else:
            top.append(refined_limits(cms[c.micro_batch], settings, c))
    return rank(top + ranked[LIMITS_REFINED:]), stats


def _parallel_runs(runs: Sequence[tuple[CostModel, tuple[ScheduleChoice, ...] | None]], settings: PlanSettings,
                   devices: tuple[int, ...], deadline: float, workers: int | None
                   ) -> list[tuple[list[Candidate], SearchStats]]:
    """``Searcher.run`` of each run, cut into tasks over ``workers`` processes: every run's ``start``, then its
    ``mixed_chunks`` (``mixed_block`` of each subset of types in the chunk), the chunks of most types first,
    then each run's ``finish``. Why: with a task per run, the ZB-H1 search alone (73% of the work at 1024
    GPUs) was the wall time. The same candidates as the serial runs: each part is a function of its
    arguments, and the caches it fills (per process now) are exact. Past the time limit a task skips its
    subsets as the serial loop does, but knows only of the blocks its own chunk kept."""
    # perf_counter is per process: tasks get the limit as an absolute wall-clock time, read when they start.
    wall_deadline = time.time() + (deadline - time.perf_counter())
    with Tasks(workers, 1 << 30) as tasks:   # (as many workers as asked: the chunks are many)
        pending = [tasks.submit(_start_task, cm, settings, devices, wall_deadline, family) for cm, family in runs]
        starts = [collect() for collect in pending]
        # A task per subset of three or more types; a run's pairs together, one task each run: they share
        # their kinds, so the cost model's caches that one pair fills (stage memory, slots) serve the next.
        jobs = sorted(((ri, chunk) for ri, (start, _) in enumerate(starts) for chunk in mixed_chunks(start.types)),
                      key=lambda job: -sum(len(s) for s in job[1]))   # stable: ties keep the runs' order
        mixed = {job: tasks.submit(_mixed_task, runs[job[0]][0], settings, devices, wall_deadline, runs[job[0]][1],
                                   starts[job[0]][0].mixed, job[1]) for job in jobs}
        finishing = []
        for ri, ((cm, family), (start, stats)) in enumerate(zip(runs, starts)):
            done = {}
            for chunk in mixed_chunks(start.types):
                found, st = mixed[ri, chunk]()
                done.update(zip(chunk, found))
                stats.add(st)
            kept = {frozenset(subset): done[subset] for subset in mixed_subsets(start.types)}
            finishing.append((stats, tasks.submit(_finish_task, cm, settings, devices, wall_deadline, family,
                                                  start, kept)))
        out = []
        for stats, collect in finishing:
            cands, st = collect()
            stats.add(st)
            out.append((cands, stats))
        return out


def _searcher(cm: CostModel, settings: PlanSettings, devices: tuple[int, ...], wall_deadline: float,
              family: tuple[ScheduleChoice, ...] | None) -> Searcher:
    return Searcher(cm, settings, devices, time.perf_counter() + (wall_deadline - time.time()), None, family)


def _start_task(cm: CostModel, settings: PlanSettings, devices: tuple[int, ...], wall_deadline: float,
                family: tuple[ScheduleChoice, ...] | None) -> tuple[SearchStart, SearchStats]:
    s = _searcher(cm, settings, devices, wall_deadline, family)
    return s.start(), s.stats


def _mixed_task(cm: CostModel, settings: PlanSettings, devices: tuple[int, ...], wall_deadline: float,
                family: tuple[ScheduleChoice, ...] | None, inputs: MixedInputs, subsets: tuple[tuple[str, ...], ...]
                ) -> tuple[list[list[BlockCandidate]], SearchStats]:
    s = _searcher(cm, settings, devices, wall_deadline, family)
    return s.mixed_blocks(inputs, subsets), s.stats


def _finish_task(cm: CostModel, settings: PlanSettings, devices: tuple[int, ...], wall_deadline: float,
                 family: tuple[ScheduleChoice, ...] | None, start: SearchStart,
                 mixed: Mapping[frozenset[str], list[BlockCandidate]]) -> tuple[list[Candidate], SearchStats]:
    s = _searcher(cm, settings, devices, wall_deadline, family)
    return s.finish(start, mixed), s.stats


LIMITS_REFINED = 3   # best candidates whose activation limits ``refined_limits`` refines


def refined_limits(cm: CostModel, settings: PlanSettings, cand: Candidate) -> Candidate:
    """``cand`` with each pipeline's raised ``activation_limits`` lowered per stage while its exact time drops
    (``refine_limits``), re-estimated; ``cand`` itself when nothing changes."""
    pipes, changed = [], False
    for pipe in cand.strategy.pipelines:
        if pipe.activation_limits is None:
            pipes.append(pipe)
            continue
        name = pipe.schedule if pipe.schedule is not None else settings.default_schedule

        def price(lim: tuple[int, ...], pipe: Pipeline = pipe, name: str = name) -> float:
            one = Strategy(name="limits", pipelines=(dataclasses.replace(pipe, activation_limits=lim),))
            return cm.pipeline_step_time(one, 0, name)

        own = device_limits(name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks)
        lim = refine_limits(price, own, pipe.activation_limits)[0]
        changed |= lim != pipe.activation_limits
        pipes.append(dataclasses.replace(pipe, activation_limits=lim))
    if not changed:
        return cand
    strategy = dataclasses.replace(cand.strategy, pipelines=tuple(pipes))
    est = cm.estimate(strategy, settings.global_batch, settings.default_schedule, settings.zero)
    if not est.fits or est.step_time_s >= cand.step_time_s - 1e-12:
        return cand
    return dataclasses.replace(cand, strategy=strategy, estimate=est)


# Under "auto", the schedules also searched as if fixed: their memory bound and placement from the first
# phase on (ranked as ZB-H1, the search drops the pipelines only ZB-V's memory-balanced V makes good:
# h800-h20-48). Choosing per class by the proxies instead misleads (h2-example: 12.54 s against 11.43 s).
# Interleaved is left out: it never won a case (its group order stalls on uneven stages).
AUTO_FAMILIES: tuple[str, ...] = ("zb-v",)


def auto_families(settings: PlanSettings) -> list[tuple[ScheduleChoice, ...] | None]:
    """The searches ``search`` runs per micro-batch size: the settings' own (None), and under "auto" one
    per schedule of ``AUTO_FAMILIES`` as if fixed (every pipeline naming its schedule)."""
    if settings.schedule != AUTO:
        return [None]
    return [None] + [schedule_choices(name) for name in AUTO_FAMILIES]


def rank(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Best first (ties: smaller micro-batch, fewer pipelines, then the order found); one per structure."""
    ordered = sorted(candidates, key=lambda c: (c.step_time_s, c.micro_batch, len(c.strategy.pipelines)))
    out, seen = [], set()
    for c in ordered:
        k = (c.micro_batch, structure_key(c.strategy))
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out
