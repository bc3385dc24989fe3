"""Exact prices of the search's pipelines and plans: a pipeline class's time played on the runtime's action
lists (``class_time``) and its bound without them (``class_bound``, ``open_bound``), the time raised
activation bounds save (``spare_room``, ``spare_gain``), and a combination of blocks realized as a plan and
estimated by the cost model (``realize``, ``candidate``, ``exact``, ``with_spare_limits``). The pipelines it
builds are cached per layout, split, count and schedule (each a pure function of them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from planner.layer_split import LayerSplit
from planner.microbatch import Allocation
from planner.pipelines import (
    PipelineLayout,
    Template,
)
from planner.schedule_choice import (
    ScheduleChoice,
    spare_activation_limits,
    stage_layer_ranges,
)
from planner.search_space import SearchSpace
from planner.search_types import (
    BOUND_ROUNDING,
    BlockCandidate,
    Candidate,
    SearchBudget,
    describe,
)
from planner.tp_groups import GroupKind, TPGroup
from runtime.torchfree.pipeline_schedules import Costs, step_time_bound
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy


class ExactPricer:
    """Pipelines and plans of one search, built and priced exactly (the cost model's estimate)."""

    # What they hold depends only on the cost model, the settings and the devices (``SearchSpace.SHARED_CACHES``).
    SHARED_CACHES = ("gain_cache", "room_cache", "open_cache", "bare_cache", "range_cache", "stage_cache")

    def __init__(self, space: SearchSpace, budget: SearchBudget) -> None:
        self.space = space
        self.budget = budget
        self.cm = space.cm   # (the space's, named here for short)
        self.settings = space.settings
        self.gain_cache: dict[tuple, float] = {}
        self.room_cache: dict[tuple, float | None] = {}
        self.open_cache: dict[tuple, float] = {}
        self.bare_cache: dict[tuple, Pipeline] = {}
        self.range_cache: dict[tuple, list[tuple[tuple[int, int], ...]]] = {}
        self.stage_cache: dict[tuple, Stage] = {}

    def share_caches(self, shared: dict[str, dict]) -> None:
        """Use (and fill) the caches in ``shared`` (another search's on the same cost model, settings, devices)."""
        for name in self.SHARED_CACHES:
            self.__dict__[name] = shared.setdefault(name, {})

    def open_bound(self, template: Template, groups: Mapping[GroupKind, Sequence[TPGroup]], split: LayerSplit,
                   choice: ScheduleChoice, micro_batches: int) -> float:
        """``pipeline_step_bound`` of a pipeline of ``template`` with ``split`` under ``choice`` and every
        transfer time 0: a bound of it on any devices of those kinds (the bound grows with each transfer,
        and the chunk costs read the devices' types only); cached per (template, split, schedule, count)."""
        key = (template, split, choice, micro_batches)
        hit = self.open_cache.get(key)
        if hit is None:
            taken: dict[GroupKind, int] = {}
            chain = []
            for kind in template:
                chain.append(groups[kind][taken.get(kind, 0)])
                taken[kind] = taken.get(kind, 0) + 1
            lay = PipelineLayout(tuple(chain))
            one = Strategy(name="class", pipelines=(self.bare_pipeline(lay, split, micro_batches, choice),))
            costs = self.cm.pipeline_costs(one, 0, choice.name)
            hit = self.open_cache[key] = step_time_bound(choice.name, len(template), micro_batches, choice.chunks,
                                                         Costs(costs.chunks))
        return hit

    def spare_room(self, lay: PipelineLayout, zero_degree: int, split: LayerSplit, choice: ScheduleChoice,
                   micro_batches: int) -> float | None:
        """Where a stage of the class's pipeline can hold more activations than its schedule's bound (by
        memory), a lower bound of its time with the bounds raised (``CostModel.pipeline_step_bound``: any
        op order; no lists built); None where none can."""
        if not self.settings.spare_activations:
            return None
        key = (lay.template, self.space.hops(lay), zero_degree, split, choice, micro_batches)
        if key not in self.room_cache:
            one = Strategy(name="class", pipelines=(self.bare_pipeline(lay, split, micro_batches, choice),))
            room = spare_activation_limits(self.cm, one, 0, choice.name, zero_degree,
                                           self.settings.memory_margin) is not None
            self.room_cache[key] = self.class_bound(lay, split, micro_batches, choice) if room else None
        return self.room_cache[key]

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
        key = (lay.template, self.space.hops(lay), zero_degree, split, choice, micro_batches, proxy_s)
        hit = self.gain_cache.get(key)
        if hit is None:
            # Memory and the bound from the bare pipeline (neither reads the op costs); the costed one only to play.
            one = Strategy(name="class", pipelines=(self.bare_pipeline(lay, split, micro_batches, choice),))
            limits = spare_activation_limits(self.cm, one, 0, choice.name, zero_degree, self.settings.memory_margin)
            hit = 0.0
            # The lists are played only where the time can fall below the proxy: ``pipeline_step_bound`` holds
            # for any op order, so for any activation limits (the same costs), up to rounding (the margin), and
            # above the proxy it leaves no gain (exact: the same 0 the played time would give).
            if limits is not None and \
                    self.cm.pipeline_step_bound(one, 0, choice.name) * (1 - BOUND_ROUNDING) - 1e-12 < proxy_s:
                pipe = self.pipeline(lay, split, micro_batches, choice)
                raised = Strategy(name="class", pipelines=(dataclasses.replace(pipe, activation_limits=limits),))
                hit = max(0.0, proxy_s - self.cm.pipeline_step_time(raised, 0, choice.name))
            self.gain_cache[key] = hit
        return hit

    def class_time(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                   ) -> float:
        """The exact pipeline time of one pipeline of a class (the runtime's lists played on its op costs)."""
        one = Strategy(name="class", pipelines=(self.pipeline(lay, split, micro_batches, choice),))
        return self.cm.pipeline_step_time(one, 0, choice.name)

    def class_bound(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                    ) -> float:
        """A lower bound of ``class_time`` that builds no lists (``CostModel.pipeline_step_bound``). On the bare
        pipeline: the bound reads the cost model's chunk and transfer costs, not the op costs a plan carries
        (``costed_pipeline``), so it is the same number without building them."""
        one = Strategy(name="class", pipelines=(self.bare_pipeline(lay, split, micro_batches, choice),))
        return self.cm.pipeline_step_bound(one, 0, choice.name)

    def pipeline(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                 ) -> Pipeline:
        """A pipeline of ``lay``'s groups with ``split``'s layers cut into ``choice``'s chunks (its schedule
        named unless it is the plan's default)."""
        # With its costs, as the plan will carry them: the runtime orders its lists by them (and so the price).
        return self.cm.costed_pipeline(self.bare_pipeline(lay, split, micro_batches, choice), choice.name)

    def bare_pipeline(self, lay: PipelineLayout, split: LayerSplit, micro_batches: int, choice: ScheduleChoice
                      ) -> Pipeline:
        """``pipeline`` without its op and transfer costs; cached (a pure function of its arguments: the
        bounds, the memory check and the play of one class each built it, validating every stage anew)."""
        key = (lay, split, micro_batches, choice)
        hit = self.bare_cache.get(key)
        if hit is None:
            partial = split.recompute_layers or (0,) * len(split.layers)
            # Stages and layer ranges shared between the pipelines that have them (each a pure function of
            # its arguments; a ``Stage`` is immutable): many layouts put one group on one layer range, and
            # each ``Stage`` validates itself when built.
            ranges = self.range_cache.get((split.layers, choice))
            if ranges is None:
                ranges = self.range_cache[split.layers, choice] = stage_layer_ranges(split.layers, choice)
            stages = []
            for g, r, rc, k in zip(lay.groups, ranges, split.recompute, partial):
                st = self.stage_cache.get((g.devices, r, rc, k))
                if st is None:
                    st = self.stage_cache[g.devices, r, rc, k] = Stage(devices=g.devices, layers=r, recompute=rc,
                                                                       recompute_layers=k or None)
                stages.append(st)
            stages = tuple(stages)
            own = None if choice.name == self.settings.default_schedule else choice.name
            hit = self.bare_cache[key] = Pipeline(micro_batches=micro_batches, stages=stages, schedule=own)
        return hit

    def candidate(self, layouts: Sequence[PipelineLayout], split_of: Mapping[int, LayerSplit],
                  mb_of: Mapping[int, int], choice_of: Mapping[int, ScheduleChoice],
                  proxy_s: Sequence[float] | None = None) -> Candidate | None:
        """The plan, estimated (``proxy_s``: with these pipeline times instead of the list scheduler's)."""
        pipes = tuple(self.pipeline(lay, split_of[idx], mb_of[idx], choice_of[idx]) for idx, lay in enumerate(layouts))
        strategy = Strategy(name="planned", pipelines=pipes)
        est = self.cm.estimate(strategy, self.settings.global_batch, self.settings.default_schedule,
                               self.settings.zero, pipeline_s=proxy_s)
        if not est.fits:
            self.budget.stats.notes.append(f"dropped a plan: the cost model reports OOM on devices {est.oom_devices}")
            return None
        used = set(strategy.devices)
        idle = tuple(d for d in self.space.devices if d not in used)
        summary = describe(strategy, self.space.cluster, self.settings.default_schedule)
        return Candidate(strategy, est, self.cm.micro_batch, idle, summary, proxy=proxy_s is not None)

    def exact(self, cand: Candidate) -> Candidate:
        """A proxy-priced candidate with the exact estimate (the list scheduler's pipeline times)."""
        est = self.cm.estimate(cand.strategy, self.settings.global_batch, self.settings.default_schedule,
                               self.settings.zero)
        return dataclasses.replace(cand, estimate=est, proxy=False)

    def realize(self, combo: Sequence[BlockCandidate], alloc: Allocation) -> Candidate | None:
        """The combination as it was scored: fast splits, greedy micro-batch counts, each class's schedule;
        scored by the cost model (its estimate, not the fast score), each pipeline's time by its class's
        ``time_option`` (a proxy: ``ExactPricer.exact`` prices the best ones by the list scheduler)."""
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
        return self.candidate(layouts, split_of, mb_of, choice_of, [proxy[i] for i in range(len(layouts))])

    def with_spare_limits(self, cand: Candidate) -> Candidate:
        """``cand`` with each pipeline's activation bound raised to what its stages' free memory holds
        (``spare_activation_limits``), where the exact estimate says that is faster; else ``cand``."""
        if not self.settings.spare_activations or self.budget.out_of_time("raised activation limits"):
            return cand
        zd = self.space.zero_degree(len(cand.strategy.pipelines))
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
