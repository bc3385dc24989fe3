"""Plans for documents of mixed length: several strategies, each serving a length range, chosen together.

``plan_lengths(model, cluster, profiles, distribution, settings)``:

1. **Candidates.** For each length bucket L (default: 1/8, 1/4, 1/2 and all of the maximum length) the
   existing planner (``planner.api.plan``) searches the whole cluster at ``seq_len = L`` (micro-batch 1, a
   step of ``tokens_per_step / L`` sequences, ZeRO off: an in-memory switch needs full replicas). And, so
   that one strategy can serve long and short documents side by side (long ones on pipelines with more TP
   or stages, short ones on more pipelines), *composites*: the cluster's nodes split in two, the planner run
   on one part at a long bucket and on the other at a shorter one, the two results' pipelines one strategy.
   No second search: every pipeline comes from ``planner.api.plan``.
2. **Pricing.** Each candidate becomes dispatch's view of it (``strategy_cost``): per stage a document of s
   tokens costs ``a*s^2 + b*s`` (forward + backward through the stage, TP collectives and the send to the
   next stage included; fitted through the cost model's own stage time at three lengths, exact where the
   profile's fits are quadratic), the rest of a micro-batch's stage time is its overhead, and the memory
   left after the stage's weights, gradients and optimizer states is its activation budget in tokens (at
   the cost model's activation bytes per token at L). The step's fixed part (gradient sync, clip,
   optimizer) comes from ``CostModel.estimate``. Time of a step: ``runtime.torchfree.dispatch`` (the runtime's pure
   dispatch; its ``pipeline_time`` is the one time model).
3. **Choice.** Steps of the distribution are drawn with a seed of their own (``PLANNING_SEED_OFFSET``), each
   candidate's step time computed where it holds the step's longest document, and the set of at most
   ``max_strategies`` candidates (distinct ``max_seq_len``, the longest holding the maximum length) with
   the smallest expected step time when every step runs on the set's cheapest eligible strategy is kept;
   the best few sets whose switches fit memory (``shared``: a documents run holds only the running strategy's
   parameters and moments, and a switch moves them in stages, runtime/torchfree/elastic/staging.py, whose peak is
   checked against each device's memory) are re-scored with the switching rule and its modelled costs
   (``play``), the best wins.

``play`` runs a trace of steps on a set of strategies as the runtime's dispatcher chooses
(``runtime.torchfree.dispatch.choose``: the cheapest strategy that holds the step's longest document, with hysteresis
against switching: a switch is taken only when this step's modelled gain exceeds the fused BSR's modelled
cost, or when the current strategy cannot serve the step).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from planner.api import PlanSettings, plan, strategy_estimates
from planner.baselines import best_symmetric
from planner.cost import GIB, CostModel
from planner.search import describe
from runtime.documents import LengthDistribution, SyntheticDocuments, pack_rows
from runtime.torchfree.dispatch import (
    Assignment,
    PipelineCost,
    StageCost,
    StrategyCost,
    assign,
    check_lengths,
    choose,
    finish,
    lower_bound,
)
from runtime.torchfree.dispatch import CostModel as TokenCost
from runtime.torchfree.elastic.staging import UnitBytes, plan_staged_switch, switch_peak, switch_units, unit_of
from runtime.torchfree.elastic.state import STATE_DTYPE, STATE_SUFFIXES
from runtime.torchfree.errors import InfeasibleError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.profiling.profile import DeviceProfile, ProfileSet
from runtime.torchfree.spec.catalog import PlanContext
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import PLAN_VERSION, Pipeline, Plan, Schedule, Strategy, TrainingSettings

DEFAULT_BUCKETS = (1 / 8, 1 / 4, 1 / 2, 1.0)   # fractions of the maximum length
# Planning draws its sample steps from seed + this, so that the plan is not fitted to the very steps a run
# (seed, steps 1, 2, ...) will train.
PLANNING_SEED_OFFSET = 7919
# How many of each part's best results composites combine. The planner ranks a bucket's results for
# sequences of exactly its length, so under a distribution a runner-up might serve better; at paper scale
# (bench_lengths) combining the best two gained under 0.1% for four times the candidates, so: the best.
COMPOSITE_TOP = 1
SETS_REPLAYED = 4         # best sets by the switch-free score, re-scored with switching
FIT_POINTS = (0.25, 0.5, 1.0)   # fractions of L the stage time is fitted through


@dataclass(frozen=True)
class LengthSettings:
    """What ``hspmd plan --lengths`` asks for."""

    tokens_per_step: int
    max_len: int
    buckets: tuple[int, ...] = ()        # candidate max_seq_len values; () = DEFAULT_BUCKETS of max_len
    max_strategies: int = 3
    sample_steps: int = 12
    seed: int = 0
    time_limit_s: float = 30.0           # per planner search
    top_k: int = 2                       # whole-cluster candidates kept per bucket
    composites: bool = True
    schedule: Schedule = "1f1b"
    memory_margin: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1 or self.max_len < 1 or self.max_strategies < 1 or self.sample_steps < 1:
            raise ValueError("tokens_per_step, max_len, max_strategies and sample_steps must be >= 1")
        if any(not 1 <= b <= self.max_len for b in self.buckets):
            raise ValueError(f"buckets must lie in [1, {self.max_len}], got {list(self.buckets)}")

    @property
    def lengths(self) -> tuple[int, ...]:
        """The buckets' maximum lengths, ascending, always ending at ``max_len``."""
        got = self.buckets or tuple(max(1, int(f * self.max_len)) for f in DEFAULT_BUCKETS)
        return tuple(sorted(set(got) | {self.max_len}))


@dataclass(frozen=True)
class StageRoom:
    """A stage's memory as dispatch's budgets come from it: what is left on each device of the stage after its
    own weights, gradients, optimizer states and framework overhead, the activation bytes per in-flight token,
    and what the stage keeps between steps (parameters and AdamW moments; gradients are freed after each
    update). A documents run keeps only the running strategy's state (runtime/launch/session.py
    ``DocumentSteps``), so a strategy's budgets are its own; what a switch needs between two steps is priced
    apart (``switch_fits``) from ``state_room`` (the device's memory less the framework's overhead: all a
    switch may use, activations being freed by then) and ``unit_scales`` (per switch unit, the cost model's
    state bytes over the real model's: 1 but where a sleep-mode device emulates its target's memory)."""

    devices: tuple[int, ...]
    in_flight: int
    free_bytes: float
    token_bytes: float
    state_bytes: float
    state_room: float = math.inf
    unit_scales: tuple[float, ...] = ()
    base_bytes: float = 0.0   # everything on a device of the stage but activations (its peak less them)

    def budget(self) -> int:
        """Activation tokens this stage may hold."""
        return max(0, math.floor(self.free_bytes / self.token_bytes))


@dataclass(frozen=True)
class LengthStrategy:
    """A candidate strategy with what dispatch and the step model need to price it."""

    strategy: Strategy        # max_seq_len set
    cost: StrategyCost        # dispatch's view
    fixed_s: float            # per step outside the pipelines: gradient sync, clip, optimizer
    summary: str
    origin: str = "planned"   # planned (the whole cluster at one bucket) | composite | symmetric
    estimates: Mapping[str, float] = field(default_factory=dict)
    rooms: tuple[tuple[StageRoom, ...], ...] = ()   # per pipeline and stage (``stage_rooms``); () = not priced

    @property
    def max_seq_len(self) -> int:
        return self.cost.max_seq_len

    @property
    def name(self) -> str:
        return self.strategy.name


# ---------------------------------------------------------------------------------------------------------
# Pricing a strategy for dispatch


def quadratic_through(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, c) of the parabola through three points (Lagrange)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    a = y0 / d0 + y1 / d1 + y2 / d2
    b = -(y0 * (x1 + x2) / d0 + y1 * (x0 + x2) / d1 + y2 * (x0 + x1) / d2)
    c = y0 * x1 * x2 / d0 + y1 * x0 * x2 / d1 + y2 * x0 * x1 / d2
    return a, b, c


def stage_rooms(cm: CostModel, strategy: Strategy, memory_margin: float = 0.0) -> tuple[tuple[StageRoom, ...], ...]:
    """Per pipeline and stage its ``StageRoom``, by the cost model at ``cm.seq_len`` (its activation bytes per
    token: conservative for shorter documents where attention's saved tensors grow faster than linearly).
    Stage k of S holds S - k micro-batches under 1F1B."""
    zero_degree = 1   # multi-strategy plans switch in memory: no ZeRO (runtime/torchfree/elastic/state.py)
    out = []
    for pipe in strategy.pipelines:
        n = len(pipe.stages)
        rooms = []
        for k, st in enumerate(pipe.stages):
            dtype = cm.cluster.device(st.devices[0]).type
            in_flight = n - k
            base = cm.stage_memory(dtype, st.tp, st.num_layers, k == 0, k == n - 1, st.recompute, 0, zero_degree,
                                   st.recomputed_layers)
            full = cm.stage_memory(dtype, st.tp, st.num_layers, k == 0, k == n - 1, st.recompute, in_flight,
                                   zero_degree, st.recomputed_layers)
            cap = cm.cluster.device_types[dtype].memory_gib * GIB * (1.0 - memory_margin)
            rooms.append(StageRoom(tuple(st.devices), in_flight, cap - base.total,
                                   max(full.total - base.total, 1.0) / (in_flight * cm.seq_len),
                                   base.params + base.optimizer, cap - base.overhead, unit_scales(cm, dtype),
                                   base.total))
        out.append(tuple(rooms))
    return tuple(out)


def documents_peak_bytes(cost: StrategyCost, rooms: tuple[tuple[StageRoom, ...], ...], tokens_per_step: int) -> float:
    """The most bytes any device holds in a documents step: its stage's base plus the activations of every
    in-flight micro-batch at its pipeline's capacity (dispatch never packs a micro-batch past it, nor a step
    past ``tokens_per_step``). ``cm.estimate`` would price every pipeline at the strategy's longest length,
    which pipelines given only short documents never hold."""
    return max(room.base_bytes + min(room.in_flight * pipe.capacity, tokens_per_step) * room.token_bytes
               for pipe, pipe_rooms in zip(cost.pipelines, rooms) for room in pipe_rooms)


def unit_scales(cm: CostModel, device_type: str) -> tuple[float, ...]:
    """Per unit of a switch (runtime/torchfree/elastic/staging.py ``switch_units``) the state bytes (parameters and
    AdamW moments, tensor-parallel degree 1) the cost model prices it at on ``device_type``, over the real model's
    fp32 bytes of it: what scales a staged switch's bytes, computed from the real tensors, to the memory the
    planner checks (a sleep-mode type with ``memory: target`` prices its target's shapes)."""
    units = switch_units(cm.model.num_layers)
    real = [0.0] * len(units)
    for info in llama_parameters(cm.model):
        real[unit_of(units, info.owner, info.layer)] += info.numel * STATE_DTYPE.itemsize * len(STATE_SUFFIXES)
    out = []
    for u, r in zip(units, real):
        if u.kind == "layers":
            m = cm.stage_memory(device_type, 1, u.stop - u.first, False, False, False, 0)
        else:
            m = cm.stage_memory(device_type, 1, 0, u.kind == "embedding", u.kind == "head", False, 0)
        out.append((m.params + m.optimizer) / r if r else 1.0)
    return tuple(out)


def strategy_cost(cm: CostModel, strategy: Strategy, max_seq_len: int, memory_margin: float = 0.0,
                  name: str | None = None) -> StrategyCost:
    """Dispatch's cost and memory model of ``strategy``; ``cm`` at micro-batch 1 and ``seq_len = max_seq_len``.

    Time: each stage's forward + backward (TP collectives included) plus its send to the next stage, as the
    cost model prices a micro-batch of s tokens, fitted as ``a*s^2 + b*s + c`` through three lengths; a
    document pays ``a*s^2 + b*s`` and the micro-batch ``c`` (launches and latencies, once however many
    documents share it). Negative fitted coefficients (the model is not quite quadratic) are clamped to 0.
    Memory: each stage's ``StageRoom`` budget.
    """
    if cm.micro_batch != 1:
        raise ValueError("strategy_cost needs a cost model at micro-batch 1 (documents are packed in one row)")
    rooms = stage_rooms(cm, strategy, memory_margin)
    xs = [max(1, round(f * max_seq_len)) for f in FIT_POINTS]
    if len(set(xs)) < 3:
        xs = [1, 2, 3]
    pipes = []
    for pipe, pipe_rooms in zip(strategy.pipelines, rooms):
        stages = []
        for k, room in enumerate(pipe_rooms):
            a, b, c = quadratic_through(xs, [stage_seconds(cm, pipe, k, x) for x in xs])
            # the budget is set by with_budgets (from the room); a placeholder that passes validation here
            stages.append(StageCost(TokenCost(max(a, 0.0), max(b, 0.0), 0.0), room.in_flight, max(c, 0.0)))
        pipes.append(PipelineCost(tuple(stages)))
    return with_budgets(StrategyCost(name or strategy.name, max_seq_len, tuple(pipes)), rooms, strategy.name)


def with_budgets(cost: StrategyCost, rooms: tuple[tuple[StageRoom, ...], ...],
                 label: str | None = None) -> StrategyCost:
    """``cost`` with each stage's activation budget its room's; InfeasibleError where a stage is left without
    room for one token per in-flight micro-batch."""
    pipes = []
    for pipe, pipe_rooms in zip(cost.pipelines, rooms):
        stages = []
        for st, room in zip(pipe.stages, pipe_rooms):
            budget = room.budget()
            if budget < room.in_flight:
                raise InfeasibleError(f"strategy {label or cost.name!r}: pipeline stage on devices "
                                      f"{list(room.devices)} has no memory left for activations")
            stages.append(dataclasses.replace(st, activation_budget_tokens=budget))
        pipes.append(PipelineCost(tuple(stages)))
    return dataclasses.replace(cost, pipelines=tuple(pipes))


def stage_seconds(cm: CostModel, pipe: Pipeline, k: int, s: int) -> float:
    """One micro-batch of s tokens through stage k of ``pipe`` (forward + backward, TP collectives) and its
    activation sent on and gradient received back (blocking, as on gloo), by the cost model."""
    n = len(pipe.stages)
    st = pipe.stages[k]
    dtype = cm.cluster.device(st.devices[0]).type
    t = cm.stage(dtype, st.tp, st.num_layers, k == 0, k == n - 1, st.recompute, 1, s, st.recomputed_layers).time_s
    if k + 1 < n:
        link = cm.link(st.devices[0], pipe.stages[k + 1].devices[0])
        nbytes = s * cm.boundary_bytes() / cm.seq_len
        t += 2 * (link.latency_s + nbytes / (link.bandwidth_gbs * 1e9))
    return t


def fixed_step_seconds(cm: CostModel, strategy: Strategy, schedule: Schedule = "1f1b") -> float:
    """A step's time outside its pipelines (gradient sync, clip, optimizer), by ``CostModel.estimate``."""
    est = cm.estimate(strategy, sum(p.micro_batches for p in strategy.pipelines), schedule, False)
    return est.step_time_s - max(p.time_s for p in est.pipelines)


# ---------------------------------------------------------------------------------------------------------
# Step times, switching, traces


def round_robin(lengths: Sequence[int], pipelines: Sequence[PipelineCost]) -> Assignment:
    """The HotSPa-like baseline's dispatch: documents dealt to the pipelines in turn (in the order drawn,
    skipping a pipeline whose micro-batch cannot hold the document), each pipeline filling its current
    micro-batch until the next document no longer fits. No cost balancing."""
    check_lengths(lengths)
    caps = [p.capacity for p in pipelines]
    layout: list[list[list[int]]] = [[] for _ in pipelines]
    used = [0] * len(pipelines)
    turn = 0
    for d, s in enumerate(lengths):
        for i in range(len(pipelines)):
            p = (turn + i) % len(pipelines)
            if s <= caps[p]:
                break
        else:
            raise InfeasibleError(f"document {d} ({s} tokens) fits no pipeline's micro-batch memory")
        turn = (p + 1) % len(pipelines)
        if layout[p] and used[p] + s <= caps[p]:
            layout[p][-1].append(d)
            used[p] += s
        else:
            layout[p].append([d])
            used[p] = s
    return finish(lengths, pipelines, layout, lower_bound(lengths, pipelines), "greedy")


# hspmd's own is ``runtime.torchfree.dispatch.assign`` (ILP where small, LPT otherwise), the default below.
Dispatcher = Callable[[Sequence[int], Sequence[PipelineCost]], Assignment]


def packed_rows(row_len: int, weights: Sequence[int]) -> Dispatcher:
    """The fixed-length data path (a fixed strategy as Megatron-style training runs it): the step's
    documents packed into rows of ``row_len`` tokens (``runtime.documents.pack_rows``, first-fit
    decreasing), one row per micro-batch, rows dealt to the pipelines in proportion to ``weights`` (the
    plan's micro-batch counts: each row to the pipeline with the fewest rows per weight, ties by index)."""
    if not weights or min(weights) < 1:
        raise ValueError("packed_rows needs a weight >= 1 per pipeline")

    def deal(lengths: Sequence[int], pipelines: Sequence[PipelineCost]) -> Assignment:
        check_lengths(lengths)
        if len(pipelines) != len(weights):
            raise ValueError(f"{len(weights)} weights for {len(pipelines)} pipelines")
        rows = pack_rows(lengths, row_len)
        layout: list[list[list[int]]] = [[] for _ in pipelines]
        for row in rows:
            p = min(range(len(pipelines)), key=lambda i: (len(layout[i]) / weights[i], i))
            if sum(lengths[d] for d in row) > pipelines[p].capacity:
                raise InfeasibleError(f"a row of {row_len} tokens does not fit pipeline {p}'s micro-batch memory")
            layout[p].append(list(row))
        return finish(lengths, pipelines, layout, lower_bound(lengths, pipelines), "greedy")

    return deal


@dataclass(frozen=True)
class StepRecord:
    step: int
    strategy: str
    documents: int
    tokens: int
    longest: int
    compute_s: float            # slowest pipeline (dispatch's makespan)
    fixed_s: float              # gradient sync, clip, optimizer
    switch_s: float             # the fused BSR into this step's strategy (0: no switch)
    pipeline_s: tuple[float, ...]
    method: str
    gap_bound: float
    assignment: Assignment

    @property
    def time_s(self) -> float:
        return self.compute_s + self.fixed_s + self.switch_s

    @property
    def idle_s(self) -> tuple[float, ...]:
        """Per pipeline: how long it waits for the slowest one."""
        return tuple(self.compute_s - t for t in self.pipeline_s)

    @property
    def imbalance(self) -> float:
        return self.assignment.imbalance

    def to_json(self) -> dict[str, object]:
        return {"step": self.step, "strategy": self.strategy, "documents": self.documents, "tokens": self.tokens,
                "longest": self.longest, "time_s": self.time_s, "compute_s": self.compute_s,
                "fixed_s": self.fixed_s, "switch_s": self.switch_s, "pipeline_s": list(self.pipeline_s),
                "idle_s": list(self.idle_s), "imbalance": self.imbalance, "method": self.method,
                "gap_bound": self.gap_bound,
                "microbatch_tokens": [list(p.tokens) for p in self.assignment.pipelines]}


@dataclass(frozen=True)
class Trace:
    steps: tuple[StepRecord, ...]

    @property
    def total_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    @property
    def mean_step_s(self) -> float:
        return self.total_s / len(self.steps) if self.steps else 0.0

    @property
    def switches(self) -> int:
        return sum(1 for a, b in zip(self.steps, self.steps[1:]) if a.strategy != b.strategy)

    def to_json(self) -> dict[str, object]:
        return {"steps": [s.to_json() for s in self.steps], "total_s": self.total_s,
                "mean_step_s": self.mean_step_s, "switches": self.switches,
                "strategy_steps": {n: sum(1 for s in self.steps if s.strategy == n)
                                   for n in dict.fromkeys(s.strategy for s in self.steps)}}


def step_times(strategies: Sequence[LengthStrategy], lengths: Sequence[int],
               dispatcher: Dispatcher = assign) -> list[tuple[float, Assignment] | None]:
    """Per strategy its modelled step time on these documents and the assignment (None: cannot serve)."""
    longest = max(lengths, default=0)
    out: list[tuple[float, Assignment] | None] = []
    for ls in strategies:
        a = dispatcher(lengths, ls.cost.pipelines) if ls.cost.holds(longest) else None
        out.append(None if a is None else (a.makespan + ls.fixed_s, a))
    return out


def play(strategies: Sequence[LengthStrategy], lengths_of: Callable[[int], Sequence[int]], steps: Sequence[int],
         switch_s: Callable[[int, int], float], dispatcher: Dispatcher = assign) -> Trace:
    """A trace of ``steps``: each step's documents dispatched on every strategy that can serve it, the step
    run where the runtime's rule puts it (``runtime.torchfree.dispatch.choose``: predicted makespans, hysteresis against
    switching); with ``assign`` (the default) exactly ``runtime.torchfree.dispatch.dispatch``'s choice and
    assignment."""
    records = []
    current: int | None = None
    for step in steps:
        lengths = list(lengths_of(step))
        timed = step_times(strategies, lengths, dispatcher)
        i = choose([None if x is None else x[1].makespan for x in timed], current, switch_s)
        sw = 0.0 if current is None or current == i else switch_s(current, i)
        current = i
        _, a = timed[i]  # type: ignore[misc]
        ls = strategies[i]
        records.append(StepRecord(step, ls.name, len(lengths), sum(lengths), max(lengths, default=0), a.makespan,
                                  ls.fixed_s, sw, tuple(p.time for p in a.pipelines), a.method, a.gap_bound, a))
    return Trace(tuple(records))


class SwitchCosts:
    """Modelled switch times between strategies of one plan context, staged as the runtime switches
    (runtime/torchfree/elastic/staging.py: one fused BSR per unit, one after the other; computed once per pair)."""

    def __init__(self, ctx: PlanContext, strategies: Sequence[Strategy]) -> None:
        self.ctx = ctx
        self.strategies = list(strategies)
        self._memo: dict[tuple[int, int], float] = {}

    def __call__(self, a: int, b: int) -> float:
        if a == b:
            return 0.0
        if (a, b) not in self._memo:
            src, dst = (StrategyHandle(self.ctx, self.strategies[i]) for i in (a, b))
            self._memo[a, b] = plan_staged_switch(src, dst).modelled_time(self.ctx.cluster)
        return self._memo[a, b]


# ---------------------------------------------------------------------------------------------------------
# Candidates


def bucket_settings(length: int, settings: LengthSettings) -> PlanSettings:
    """The planner's request for one bucket: a step's tokens as sequences of the bucket's maximum length."""
    return PlanSettings(global_batch=max(1, math.ceil(settings.tokens_per_step / length)), seq_len=length,
                        micro_batch=1, use_zero=False, time_limit_s=settings.time_limit_s, top_k=settings.top_k,
                        schedule=settings.schedule, seed=settings.seed, memory_margin=settings.memory_margin,
                        sequence_parallel=False)   # documents plans run without it (their training settings)


def node_splits(cluster: Cluster) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Ways to cut the cluster in two along its node entries (a prefix and the rest, in both roles): (long
    part, short part) pairs, each non-empty; one per composition (types and sizes of the parts' nodes)."""
    # One part per node entry (a node lists each of its device types once; device ids follow the entries).
    starts = itertools.accumulate((n.count for n in cluster.nodes), initial=0)
    per_node = [tuple(range(a, a + n.count)) for a, n in zip(starts, cluster.nodes)]
    kinds = [(n.device_type, n.count) for n in cluster.nodes]
    out, seen = [], set()
    for k in range(1, len(per_node)):
        head = tuple(d for ids in per_node[:k] for d in ids)
        tail = tuple(d for ids in per_node[k:] for d in ids)
        for pair, key in (((head, tail), (tuple(kinds[:k]), tuple(kinds[k:]))),
                          ((tail, head), (tuple(kinds[k:]), tuple(kinds[:k])))):
            # nodes of the same types and sizes in each part: the same plans on other device ids
            key = tuple(tuple(sorted(part)) for part in key)
            if key not in seen:
                seen.add(key)
                out.append(pair)
    return out


class Candidates:
    """Planner searches per (bucket, device set), each run once."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                 settings: LengthSettings) -> None:
        self.model, self.cluster, self.profiles, self.settings = model, cluster, profiles, settings
        self._plans: dict[tuple[int, tuple[int, ...]], list[Strategy]] = {}
        self._cms: dict[int, CostModel] = {}
        self.notes: list[str] = []

    def cost_model(self, length: int) -> CostModel:
        if length not in self._cms:
            self._cms[length] = CostModel(self.model, self.cluster, self.profiles, micro_batch=1, seq_len=length)
        return self._cms[length]

    def searched(self, length: int, devices: tuple[int, ...]) -> list[Strategy]:
        """The planner's best strategies at ``seq_len = length`` on ``devices`` (empty if none fits)."""
        key = (length, devices)
        if key not in self._plans:
            try:
                res = plan(self.model, self.cluster, self.profiles, bucket_settings(length, self.settings),
                           devices=devices, baselines=False)
                self._plans[key] = [c.strategy for c in res.candidates]
            except InfeasibleError as e:
                if len(devices) == self.cluster.num_devices:
                    self.notes.append(f"bucket {length}: {e}")
                self._plans[key] = []
        return self._plans[key]

    def priced(self, strategy: Strategy, length: int, origin: str, label: str) -> LengthStrategy | None:
        cm = self.cost_model(length)
        # Op costs at the length it serves: what the plan carries and the runtime orders its lists by.
        tagged = cm.with_op_costs(dataclasses.replace(strategy, max_seq_len=length, estimates=None),
                                  self.settings.schedule)
        try:
            cost = strategy_cost(cm, tagged, length, self.settings.memory_margin)
        except InfeasibleError as e:
            self.notes.append(str(e))
            return None
        if not cost.holds(length):
            return None
        est = cm.estimate(tagged, sum(p.micro_batches for p in tagged.pipelines), self.settings.schedule, False)
        rooms = stage_rooms(cm, tagged, self.settings.memory_margin)
        estimates = strategy_estimates(est)
        estimates["peak_memory_gib"] = round(documents_peak_bytes(cost, rooms, self.settings.tokens_per_step) / GIB, 4)
        return LengthStrategy(tagged, cost, fixed_step_seconds(cm, tagged, self.settings.schedule),
                              f"{label}: {describe(tagged, self.cluster)}", origin, estimates, rooms)

    def all(self) -> list[LengthStrategy]:
        """Whole-cluster candidates per bucket, then composites (a long part and a short part by nodes)."""
        everything = tuple(range(self.cluster.num_devices))
        out: list[LengthStrategy] = []
        lengths = self.settings.lengths
        for length in lengths:
            for s in self.searched(length, everything)[:self.settings.top_k]:
                ls = self.priced(s, length, "planned", f"planned at {length}")
                if ls is not None:
                    out.append(ls)
        if self.settings.composites:
            for long_devs, short_devs in node_splits(self.cluster):
                if len(long_devs) > len(short_devs):
                    continue   # the long part serves the tail: the bulk of the tokens goes to the rest
                for li, long_len in enumerate(lengths):
                    if long_len * 2 < self.settings.max_len:
                        continue   # most steps hold a document longer than max/4 (docs/lengths.md) ...
                    long = self.searched(long_len, long_devs)
                    if not long:
                        continue
                    # ... and 97% of the documents are at most max/4 long: the short part's buckets
                    for short_len in [x for x in lengths[:li] if x * 4 <= self.settings.max_len]:
                        short = self.searched(short_len, short_devs)
                        for a, b in itertools.product(long[:COMPOSITE_TOP], short[:COMPOSITE_TOP]):
                            merged = Strategy("composite", a.pipelines + b.pipelines)
                            ls = self.priced(merged, long_len, "composite", f"{long_len} on {len(long_devs)} + "
                                                                            f"{short_len} on {len(short_devs)} devices")
                            if ls is not None:
                                out.append(ls)
        return out


# ---------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class LengthPlanResult:
    model: ModelSpec
    cluster: Cluster
    settings: LengthSettings
    distribution: LengthDistribution
    strategies: tuple[LengthStrategy, ...]      # chosen, by ascending max_seq_len (the last: max_len)
    candidates: tuple[LengthStrategy, ...]      # every candidate priced
    expected_step_s: float                      # played over the planning sample, switching included
    single_best: LengthStrategy                 # the best whole-cluster plan at max_len, on the same sample
    single_expected_s: float
    notes: tuple[str, ...] = ()

    def to_plan(self, model_ref: str, cluster_ref: str) -> Plan:
        return build_plan(self.strategies, self.settings, model_ref, cluster_ref)


def build_plan(strategies: Sequence[LengthStrategy], settings: LengthSettings, model_ref: str,
               cluster_ref: str) -> Plan:
    """One plan of the strategies (named by their range's top), documents mode.

    Per step the dispatcher decides each pipeline's micro-batches; the plan's per-pipeline counts are the
    planner's for the bucket, scaled to one ``global_batch`` shared by every strategy (the plan format's
    fixed form: global_batch = the micro-batches of the strategy with most, micro_batch 1)."""
    global_batch = max(sum(p.micro_batches for p in ls.strategy.pipelines) for ls in strategies)
    out = []
    for ls in strategies:
        counts = scale_counts([p.micro_batches for p in ls.strategy.pipelines], global_batch)
        pipes = tuple(dataclasses.replace(p, micro_batches=m) for p, m in zip(ls.strategy.pipelines, counts))
        out.append(dataclasses.replace(ls.strategy, name=f"len-{ls.max_seq_len}", pipelines=pipes,
                                       estimates=dict(ls.estimates)))
    training = TrainingSettings(global_batch=global_batch, micro_batch=1, seq_len=settings.max_len, zero=False,
                                schedule=settings.schedule, seed=settings.seed,
                                tokens_per_step=settings.tokens_per_step)
    return Plan(PLAN_VERSION, model_ref, cluster_ref, training, tuple(out))


def scale_counts(counts: Sequence[int], total: int) -> list[int]:
    """``counts`` scaled to sum to ``total`` >= their sum (largest remainders; never below the original)."""
    have = sum(counts)
    exact = [c * total / have for c in counts]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: (-(exact[i] - out[i]), i))[:total - sum(out)]:
        out[i] += 1
    return out


def switch_fits(strategies: Sequence[LengthStrategy], ctx: PlanContext) -> bool:
    """Whether every switch between two of ``strategies`` (the plan ``ctx``'s, in order) fits memory as the
    runtime makes it (runtime/torchfree/elastic/staging.py): between two steps, activations and gradients freed, a
    device holds at most the staged switch's ``peak`` of state and buffers, its bytes scaled to the cost model's
    (``unit_scales``), within its ``state_room``. Each strategy's own steps hold its state alone (its rooms)."""
    if len(strategies) < 2:
        return True
    room = {d: (r.state_room, r.unit_scales) for ls in strategies for pipe in ls.rooms for r in pipe for d in r.devices}
    units = switch_units(ctx.model.num_layers)
    for i, j in itertools.permutations(range(len(strategies)), 2):
        a, b = ctx.plan.strategies[i], ctx.plan.strategies[j]
        sw = plan_staged_switch(StrategyHandle(ctx, a), StrategyHandle(ctx, b))
        order = [units.index(s.unit) for s in sw.stages]
        table = [{d: scaled(b, room[d][1][u] if d in room and room[d][1] else 1.0) for d, b in row.items()}
                 for u, row in zip(order, sw.table)]
        for d, peak in switch_peak(table, range(len(table))).items():
            if peak > room.get(d, (math.inf, ()))[0]:
                return False
    return True


def scaled(b: UnitBytes, k: float) -> UnitBytes:
    return UnitBytes(b.src * k, b.dst * k, b.buffers * k)


def shared(strategies: Sequence[LengthStrategy], model: ModelSpec, cluster: Cluster,
           settings: LengthSettings) -> list[LengthStrategy] | None:
    """``strategies`` as one documents run holds them: each with its own activation budgets (only the running
    strategy holds its state), None when some switch between two of them does not fit memory
    (``switch_fits``); one strategy alone is unchanged."""
    if len(strategies) < 2:
        return list(strategies)
    p = build_plan(strategies, settings, model.name, cluster.name)
    return list(strategies) if switch_fits(strategies, PlanContext(p, model, cluster, Path("plan"))) else None


def context_for(strategies: Sequence[LengthStrategy], model: ModelSpec, cluster: Cluster, settings: LengthSettings,
                path: Path = Path("plan"), side_by_side: bool = True) -> tuple[list[LengthStrategy], SwitchCosts]:
    """``strategies`` as one plan's (named ``len-N``) and the switch costs between them. ``side_by_side``: their
    memory as this runtime holds them (``shared``: each alone, every staged switch between them fitting;
    InfeasibleError if one does not); False: each strategy's memory alone, switches unchecked (a baseline
    system)."""
    together = shared(strategies, model, cluster, settings) if side_by_side else list(strategies)
    if together is None:
        raise InfeasibleError("a switch between the strategies does not fit memory "
                              "(runtime/torchfree/elastic/staging.py)")
    p = build_plan(together, settings, model.name, cluster.name)
    members = [dataclasses.replace(ls, strategy=s, cost=dataclasses.replace(ls.cost, name=s.name))
               for ls, s in zip(together, p.strategies)]
    return members, SwitchCosts(PlanContext(p, model, cluster, path), list(p.strategies))


def plan_lengths(model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                 distribution: LengthDistribution, settings: LengthSettings) -> LengthPlanResult:
    """Strategies and their length ranges, chosen together (module docstring)."""
    if settings.max_len > model.max_seq_len:
        raise InfeasibleError(f"maximum length {settings.max_len} exceeds {model.name}'s max_seq_len "
                              f"{model.max_seq_len}")
    found = Candidates(model, cluster, profiles, settings)
    cands = found.all()
    if not any(c.max_seq_len == settings.max_len and c.origin == "planned" for c in cands):
        raise InfeasibleError(f"no strategy on {cluster.name} holds a document of {settings.max_len} tokens of "
                              f"{model.name}" + (f" ({'; '.join(found.notes)})" if found.notes else ""))
    lengths_of = SyntheticDocuments(distribution, settings.tokens_per_step, settings.max_len, 1,
                                    settings.seed + PLANNING_SEED_OFFSET).lengths
    sample = [lengths_of(t) for t in range(settings.sample_steps)]
    times = [[None if x is None else x[0] for x in step_times(cands, ls)] for ls in sample]
    sets = ranked_sets(cands, times, settings)
    # What planning for the longest document alone gives (``hspmd plan --seq-len max``): the comparison,
    # and always replayed, so that the plan is never worse than it on the sample.
    singles = [i for i, c in enumerate(cands) if c.max_seq_len == settings.max_len and c.origin == "planned"]
    single = min(singles, key=lambda i: (sum(t[i] for t in times), i))   # type: ignore[misc]
    # Sets whose members do not fit memory side by side (``shared``) are dropped before the replay.
    replayed = list(itertools.islice((chosen for _, chosen in sets
                                      if shared([cands[i] for i in chosen], model, cluster, settings) is not None),
                                     SETS_REPLAYED))
    if (single,) not in replayed:
        replayed.append((single,))
    best: tuple[float, tuple[int, ...]] | None = None
    for chosen in replayed:
        members, switch = context_for([cands[i] for i in chosen], model, cluster, settings)
        trace = play(members, lambda t: sample[t], range(len(sample)), switch)
        if best is None or trace.mean_step_s < best[0]:
            best = (trace.mean_step_s, chosen)
    assert best is not None
    chosen_named, _ = context_for([cands[i] for i in best[1]], model, cluster, settings)
    return LengthPlanResult(model, cluster, settings, distribution, tuple(chosen_named), tuple(cands),
                            best[0], cands[single], sum(t[single] for t in times) / len(times),  # type: ignore[misc]
                            tuple(found.notes))


def ranked_sets(cands: Sequence[LengthStrategy], times: Sequence[Sequence[float | None]],
                settings: LengthSettings) -> list[tuple[float, tuple[int, ...]]]:
    """Sets of candidates (distinct max_seq_len, ascending, the last holding max_len) by their expected step
    time when each step runs on the set's cheapest eligible member (no switching), best first."""
    order = sorted(range(len(cands)), key=lambda i: (cands[i].max_seq_len, i))
    tops = [i for i in order if cands[i].max_seq_len == settings.max_len]
    below = [i for i in order if cands[i].max_seq_len < settings.max_len]
    out = []
    for top in tops:
        # No more below the top than there are (--max-strategies 10**9 looped a billion empty combinations).
        for r in range(min(settings.max_strategies, len(below) + 1)):
            for rest in itertools.combinations(below, r):
                if len({cands[i].max_seq_len for i in rest}) < r:
                    continue
                members = rest + (top,)
                total = sum(min(row[i] for i in members if row[i] is not None) for row in times)  # type: ignore
                out.append((total / len(times), members))
    out.sort(key=lambda x: (x[0], len(x[1]), x[1]))
    return out


# ---------------------------------------------------------------------------------------------------------
# Baselines for the benchmark


def symmetric_candidates(model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                         settings: LengthSettings) -> list[LengthStrategy]:
    """The HotSPa-like set: per bucket the best symmetric (Megatron-style) strategy over every device that
    holds the bucket's maximum length (``planner.baselines.best_symmetric``), priced like the others."""
    found = Candidates(model, cluster, profiles, settings)
    out = []
    devices = tuple(range(cluster.num_devices))
    for length in settings.lengths:
        cm = found.cost_model(length)
        base = None
        n = max(1, math.ceil(settings.tokens_per_step / length))
        for gb in range(n, 2 * n + 1):   # a batch the data-parallel degrees divide
            base = best_symmetric({1: cm}, devices, gb, False, schedule=settings.schedule)
            if base.strategy is not None:
                break
        if base is None or base.strategy is None:
            continue
        ls = found.priced(base.strategy, length, "symmetric", f"symmetric at {length}")
        if ls is not None:
            out.append(ls)
    return out


def length_ranges(p: Plan) -> dict[str, tuple[int, int]]:
    """Each strategy's document lengths [lo, hi]: from one past the previous strategy's ``max_seq_len`` (in
    the plan's order; 1 for the first) to its own (``training.seq_len`` where unset)."""
    out = {}
    lo = 1
    for s in p.strategies:
        hi = p.training.seq_len if s.max_seq_len is None else s.max_seq_len
        out[s.name] = (lo, hi)
        lo = hi + 1
    return out


def chrome_trace(trace: Trace) -> dict[str, object]:
    """Chrome trace-event JSON of a trace (Perfetto): process 0 the steps (strategy, switches), one process
    per pipeline index with its modelled compute, its idle wait for the slowest pipeline, and the step's
    gradient sync + optimizer; times in microseconds, steps back to back."""
    out: list[dict[str, object]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "steps"}}]
    pipes = max((len(r.pipeline_s) for r in trace.steps), default=0)
    for p in range(pipes):
        out.append({"ph": "M", "name": "process_name", "pid": p + 1, "args": {"name": f"pipeline {p}"}})
    t = 0.0

    def span(name: str, cat: str, pid: int, start: float, dur: float, **args: object) -> None:
        if dur > 0:
            out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": 0, "ts": start * 1e6,
                        "dur": dur * 1e6, "args": args})

    for r in trace.steps:
        span(f"switch to {r.strategy}", "switch", 0, t, r.switch_s)
        begin = t + r.switch_s
        span(f"step {r.step}: {r.strategy}", "step", 0, begin, r.compute_s + r.fixed_s, documents=r.documents,
             tokens=r.tokens, longest=r.longest, imbalance=round(r.imbalance, 4), method=r.method)
        for p, (pt, load) in enumerate(zip(r.pipeline_s, r.assignment.pipelines)):
            span(f"compute ({len(load.microbatches)} micro-batches)", "compute", p + 1, begin, pt,
                 tokens=sum(load.tokens), microbatch_tokens=list(load.tokens))
            span("idle", "idle", p + 1, begin + pt, r.compute_s - pt)
            span("grad sync + optimizer", "step_end", p + 1, begin + r.compute_s, r.fixed_s)
        t = begin + r.compute_s + r.fixed_s
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"total_s": trace.total_s}}
