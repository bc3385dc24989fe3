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
   its exact time with the bounds raised (``ExactPricer.spare_gain``: every returned plan gets them raised,
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
(``ExactPricer.with_spare_limits``, ``PlanSettings.spare_activations``).

The search is deterministic: every enumeration runs in a fixed order and ties break on that order.
A time limit stops the enumeration early (the result says so) and caps each ILP.

Where each part lives: the data (settings, blocks, candidates) in planner/search_types.py; type choices,
templates, fast splits and link prices in planner/search_space.py (phase 1); blocks in planner/blocks.py,
which of them are kept in planner/block_ranking.py and the mixed ones in planner/mixed_blocks.py (phase 2);
the combination in planner/combination.py (phases 3 and 4); exact prices in planner/exact_pricing.py and
the ILPs in planner/finalize.py (phases 4b and 5). This module wires them into one search (``Searcher``) and
runs the searches of every micro-batch size and schedule family (``search``), serially or as tasks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from planner.block_ranking import keep_blocks, lazily_sorted
from planner.blocks import BlockBuilder
from planner.combination import Combiner, set_partitions
from planner.cost import CostModel
from planner.exact_pricing import ExactPricer
from planner.finalize import Finalizer
from planner.mixed_blocks import MixedInputs, mixed_blocks, mixed_chunks, mixed_subsets
from planner.parallel import Tasks, worker_count
from planner.schedule_choice import AUTO, ScheduleChoice, refine_limits, schedule_choices
from planner.search_space import SearchSpace
from planner.search_types import (
    BOUND_ROUNDING,
    BlockCandidate,
    Candidate,
    PlanSettings,
    Progress,
    SearchBudget,
    SearchStats,
    TypeChoice,
    describe,
    schedule_label,
    structure_key,
)
from planner.tp_groups import tp_choices
from runtime.torchfree.schedule_policies import device_limits
from runtime.torchfree.spec.plan import Pipeline, Strategy

__all__ = ["AUTO_FAMILIES", "BOUND_ROUNDING", "LIMITS_REFINED", "MICRO_BATCHES", "Candidate", "PlanSettings",
           "Progress", "SearchStart", "SearchStats", "Searcher", "TypeChoice", "auto_families", "describe",
           "lazily_sorted", "mixed_chunks", "mixed_subsets", "rank", "refined_limits", "schedule_label", "search",
           "set_partitions", "structure_key"]

MICRO_BATCHES = (1, 2, 4)   # the micro-batch sizes searched when the settings name none


@dataclass(frozen=True)
class SearchStart:
    """``Searcher.start``'s result: the types searched, their kept single-type blocks, the mixed blocks' inputs."""

    types: tuple[str, ...]
    singles: Mapping[frozenset[str], list[BlockCandidate]]
    mixed: MixedInputs


class Searcher:
    """One search at one micro-batch size (one cost model): its phases' parts wired together, run in order."""

    def __init__(self, cm: CostModel, settings: PlanSettings, devices: Sequence[int], deadline: float,
                 progress: Progress | None = None, choices: tuple[ScheduleChoice, ...] | None = None,
                 shared: dict[str, dict] | None = None) -> None:
        """``choices``: under "auto", search as if these schedules were fixed (``auto_families``), every
        pipeline naming its own. ``shared``: the caches of another search on the same cost model, settings
        and devices (``SearchSpace.SHARED_CACHES``, ``ExactPricer.SHARED_CACHES``: what they hold depends on
        nothing else), used and filled."""
        self.budget = SearchBudget(deadline, progress)
        self.space = SearchSpace(cm, settings, devices, choices)
        self.pricer = ExactPricer(self.space, self.budget)
        self.blocks = BlockBuilder(self.space, self.pricer, self.budget)
        self.combiner = Combiner(self.space, self.blocks, self.pricer, self.budget)
        self.finalizer = Finalizer(self.space, self.pricer, self.budget)
        if shared is not None:
            self.space.share_caches(shared)
            self.pricer.share_caches(shared)

    @property
    def stats(self) -> SearchStats:
        return self.budget.stats

    def run(self) -> list[Candidate]:
        """The phases of the module docstring, each on what the one before kept (``search``'s parallel path
        runs the same three parts, ``start``, ``mixed_blocks`` per chunk of subsets of types and ``finish``, as
        tasks)."""
        start = self.start()
        subsets = mixed_subsets(start.types)
        return self.finish(start, dict(zip(map(frozenset, subsets), self.mixed_blocks(start.mixed, subsets))))

    def start(self) -> SearchStart:
        """Phase 1 and phase 2's single-type blocks: what the mixed blocks and ``finish`` build on."""
        choices = tp_choices(self.space.cluster, self.space.model, self.space.devices)
        types = tuple(t for t, tps in choices.items() if tps)
        single = self.blocks.single_type_blocks(choices, types)
        # Share of the batch a block of these types would get, from the single-type throughputs.
        best_rate = {t: max((c.rate for c in single[t]), default=0.0) for t in types}
        total_rate = sum(best_rate.values()) or 1.0
        blocks = {frozenset([t]): keep_blocks(self.blocks, single[t], best_rate[t] / total_rate) for t in types}
        mixed = MixedInputs(self.blocks.top_choices(choices, types, blocks),
                            frozenset(t for t in types if blocks[frozenset([t])]), best_rate, total_rate)
        return SearchStart(types, blocks, mixed)

    def finish(self, start: SearchStart, mixed: Mapping[frozenset[str], list[BlockCandidate]]) -> list[Candidate]:
        """Phases 3-5 on the kept blocks, single-type and mixed."""
        types = start.types
        blocks = {**start.singles, **mixed}
        realized = self.combiner.realize_best(types, self.combiner.combine(types, blocks))
        exact = self.finalizer.price_best(realized)
        if not exact and realized:
            # Past the time limit before any exact price (the runtime's lists of a large batch take long to
            # play): the best plan by its proxy, marked as such (``Candidate.proxy``).
            return [realized[0][0]]
        rest = [r for r in realized if all(r[1] is not e[1] for e in exact)]
        final = self.finalizer.finalize_best(types, exact + rest)
        # Only exactly priced plans are returned, so that every candidate is compared on the same estimate
        # (``exact`` has its raised limits already).
        return [c for c, _, _ in exact] + [self.pricer.with_spare_limits(c) for c in final]

    def mixed_blocks(self, inputs: MixedInputs, subsets: Sequence[tuple[str, ...]]) -> list[list[BlockCandidate]]:
        """Phase 2's mixed blocks of each subset of types (planner/mixed_blocks.py ``mixed_blocks``)."""
        return mixed_blocks(self.blocks, inputs, subsets)


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
