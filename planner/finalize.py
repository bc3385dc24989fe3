"""Exact pricing and the ILPs (planner/search.py, phases 4b and 5): the best realized plans priced on the
runtime's action lists, under "auto" each pipeline class also on the schedule that runs it fastest, and the
finalists' layer splits and micro-batch counts chosen together by the layer-split and allocation ILPs, then
refined by the exact price."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.combination import with_each_type
from planner.exact_pricing import ExactPricer
from planner.layer_split import LayerSplit, refine_split, split_ilp
from planner.microbatch import Allocation, PipelineClass, TimeOption, allocate_ilp
from planner.pipelines import (
    PipelineLayout,
)
from planner.schedule_choice import (
    ScheduleChoice,
)
from planner.search_space import SearchSpace
from planner.search_types import (
    BlockCandidate,
    Candidate,
    ClassKey,
    Combo,
    SearchBudget,
    time_option,
)

COMBOS_FINAL = 6        # best realized plans solved exactly (ILPs)
EXACT_REALIZED = 8      # best realized plans (by their proxy) priced exactly as they are

# Exact pipeline-time prices per class and finalist when moving layers (refine_split): as many as fit in
# this many scheduled ops (stages x chunks x micro-batches x op kinds), between 3 and 24.
REFINE_OPS = 4_000


@dataclass(frozen=True)
class ComboClasses:
    """A combination's pipeline classes (``Finalizer.combo_classes``): pipelines alike in template, boundary
    cost and schedule, across its blocks."""

    layouts: tuple[PipelineLayout, ...]   # every pipeline of the combination, block after block
    keys: tuple[ClassKey, ...]            # the classes, in the order first met
    members: Mapping[ClassKey, list[int]]   # per class, its pipelines (indices into ``layouts``)
    most: Mapping[ClassKey, int]          # per class, the largest micro-batch count the hint gave a pipeline
    fills: Mapping[ClassKey, tuple[float, float]]   # per class, its schedule's (fill, hops)


class Finalizer:
    """Prices one search's best plans exactly and solves its finalists."""

    def __init__(self, space: SearchSpace, pricer: ExactPricer, budget: SearchBudget) -> None:
        self.space = space
        self.pricer = pricer
        self.budget = budget
        self.cm = space.cm   # (the space's, named here for short)
        self.settings = space.settings

    def price_best(self, realized: Sequence[tuple[Candidate, Combo, Allocation]]
                   ) -> list[tuple[Candidate, Combo, Allocation]]:
        """Phase 4b: the best ``EXACT_REALIZED`` realized plans (by the proxy) priced exactly, and with
        ``schedule="auto"`` each also with every pipeline class on the schedule that runs it fastest
        (``best_schedules``). Best first, each with its raised activation limits (``with_spare_limits``) as
        it will be returned: the finalists are the best of these, and a plan the raised limits make fast
        ranks low at the schedules' own bounds."""
        out = []
        for cand, combo, alloc in realized[:EXACT_REALIZED]:
            if self.budget.out_of_time("exact pricing"):
                break   # past the limit (``run`` falls back on the best proxy-priced plan if none is priced)
            out.append((self.pricer.with_spare_limits(self.pricer.exact(cand)), combo, alloc))
            if self.budget.out_of_time("schedule per pipeline class"):
                continue
            variant = self.best_schedules(combo, alloc)
            if variant is not None:
                alt = self.pricer.realize(variant, alloc)
                if alt is not None:
                    out.append((self.pricer.with_spare_limits(self.pricer.exact(alt)), variant, alloc))
        out.sort(key=lambda x: x[0].step_time_s)
        return out

    def best_schedules(self, combo: Combo, alloc: Allocation) -> Combo | None:
        """``combo`` with each pipeline class on the schedule of ``variant_choices`` (its own fast split
        under that schedule's memory) whose exact pipeline time (``CostModel.pipeline_step_time``: the
        runtime's lists played on the op costs) at the class's micro-batch count is least; None when no
        class changes. The search itself ranks pipelines by ZB-H1's proxy under "auto", where the
        proxies of the other schedules mislead (per-chunk fixed costs, v times the messages)."""
        if not self.space.variant_choices:
            return None
        zd = self.space.zero_degree(sum(b.pipelines for b in combo))
        blocks, changed, hj = [], False, 0
        for b in combo:
            classes = []
            for c in b.classes:
                mb = max(alloc.per_class[hj])
                hj += 1
                lay = b.layouts[c.members[0]]
                best = (self.pricer.class_time(lay, c.split, mb, c.schedule), c)
                for choice in self.space.variant_choices:
                    sp = self.space.fast_split(c.template, zd, choice)
                    if choice == c.schedule or sp is None or (choice.name == "interleaved" and mb < len(c.template)):
                        continue
                    if self.pricer.class_bound(lay, sp, mb, choice) >= best[0] - 1e-12:
                        continue   # cannot beat the best so far: not worth its action lists
                    t = self.pricer.class_time(lay, sp, mb, choice)
                    if t < best[0] - 1e-12:
                        fill, hops = self.space.fill(c.template, choice)
                        proxy = time_option(sp, c.boundary_s, fill, hops).time(mb)
                        best = (t, dataclasses.replace(
                            c, split=sp, schedule=choice, fill=fill, hops=hops,
                            spare_bound_s=self.pricer.spare_room(lay, zd, sp, choice, mb), spare_count=mb,
                            spare_s=self.pricer.spare_gain(lay, zd, sp, choice, mb, proxy)))
                changed |= best[1] is not c
                classes.append(best[1])
            blocks.append(dataclasses.replace(b, classes=tuple(classes)))
        return tuple(blocks) if changed else None

    def finalize_best(self, types: Sequence[str], realized: Sequence[tuple[Candidate, Combo, Allocation]]
                      ) -> list[Candidate]:
        """Phase 5: exact layer splits and micro-batches (ILPs) for the best realized plans and the best
        one using each type."""
        finalists = with_each_type(list(realized[:COMBOS_FINAL]), realized, types, lambda x: x[1])
        out: list[Candidate] = []
        for i, (_, combo, alloc) in enumerate(finalists):
            self.budget.report("exact layer split + micro-batches (ILP)", i, len(finalists))
            if self.budget.out_of_time("exact layer splits and micro-batches"):
                break   # the exactly priced plans stand (``price_best`` prices at least one)
            out.extend(self.finalize(combo, alloc))
        self.budget.report("exact layer split + micro-batches (ILP)", len(finalists), len(finalists))
        self.budget.stats.finalists += len(finalists)
        return out

    def finalize(self, combo: Sequence[BlockCandidate], hint: Allocation) -> list[Candidate]:
        """Exact layer splits and micro-batches for a combination, scored by ``CostModel.estimate``: each
        class offers its fast split and the ILP splits for the micro-batch counts it may get (under its
        schedule's memory and fill), the allocation ILP picks counts and splits together, then each class
        is re-split for its count (``allocate``) and the split refined by the exact price (``refined``).
        Where a class's split recomputes part of a stage, the plan is also returned with that class split
        without partial recompute (``plain``): the closed form the splits are chosen by prices partial
        recompute's extra forwards, but not the activation limits a plain split's free memory buys later
        (``with_spare_limits``), which can make it the faster."""
        cc = self.combo_classes(combo, hint)
        zd = self.space.zero_degree(len(cc.layouts))
        limit = max(1.0, min(10.0, self.budget.deadline - time.perf_counter()))   # seconds per ILP
        options = self.split_options(cc, zd, limit)
        if options is None:
            return []
        allocated = self.allocate(cc, options, zd, limit)
        if allocated is None:
            return []
        alloc, chosen = allocated
        chosen, plain = self.refined(cc, alloc, chosen, zd)
        out = []
        for splits in (chosen, plain) if any(p is not c for p, c in zip(plain, chosen)) else (chosen,):
            if all(sp is not None for sp in splits):
                cand = self.candidate(cc, alloc, splits)
                if cand is not None:
                    out.append(cand)
        return out

    def split_options(self, cc: ComboClasses, zd: int, limit: float) -> list[list[LayerSplit]] | None:
        """Per class, its fast split and the layer-split ILP's for its fewest micro-batches and for the count
        the hint gave it (None: some class has no split that fits)."""
        options: list[list[LayerSplit]] = []
        for key in cc.keys:
            template, _, choice = key
            fill = cc.fills[key][0]
            slots = self.space.slots(template, zd, choice)
            fast = self.space.fast_split(template, zd, choice)
            if fast is None:
                return None
            found = [fast]
            for mb in sorted({len(template), cc.most[key]}):
                self.budget.stats.ilps += 1
                sp = split_ilp(slots, self.space.model.num_layers, mb, limit, incumbent=fast, fill=fill)
                if sp is not None and sp not in found and min(sp.layers) >= choice.chunks:
                    found.append(sp)
            options.append(found)
        return options

    def allocate(self, cc: ComboClasses, options: list[list[LayerSplit]], zd: int, limit: float
                 ) -> tuple[Allocation, list[LayerSplit]] | None:
        """The allocation ILP over every class's split options, then each class re-split by the layer-split
        ILP for the count it got (where that is a count not solved yet) and, if any split changed, the
        allocation solved again on the new splits (kept where not slower)."""
        m_total = self.space.micro_batches

        def option(key: ClassKey, sp: LayerSplit) -> TimeOption:
            return time_option(sp, key[1], *cc.fills[key])

        classes = [PipelineClass(tuple(option(key, s) for s in opts), len(key[0]), len(cc.members[key]))
                   for key, opts in zip(cc.keys, options)]
        self.budget.stats.ilps += 1
        alloc = allocate_ilp(classes, m_total, limit)
        if alloc is None:
            return None
        chosen = [opts[o] for opts, o in zip(options, alloc.option)]
        changed = False
        for j, key in enumerate(cc.keys):
            mb = max(alloc.per_class[j])
            if mb in (cc.most[key], len(key[0])):
                continue   # already solved for this count
            self.budget.stats.ilps += 1
            fill = cc.fills[key][0]
            sp = split_ilp(self.space.slots(key[0], zd, key[2]), self.space.model.num_layers, mb, limit,
                           incumbent=chosen[j], fill=fill)
            if sp is not None and min(sp.layers) >= key[2].chunks and \
                    sp.pipeline_s(mb, fill=fill) < chosen[j].pipeline_s(mb, fill=fill) - 1e-12:
                chosen[j] = sp
                changed = True
        if changed:
            classes = [PipelineClass((option(key, s),), len(key[0]), len(cc.members[key]))
                       for key, s in zip(cc.keys, chosen)]
            self.budget.stats.ilps += 1
            again = allocate_ilp(classes, m_total, limit)
            if again is not None and again.makespan_s <= alloc.makespan_s + 1e-12:
                alloc = again
        return alloc, chosen

    def refined(self, cc: ComboClasses, alloc: Allocation, chosen: list[LayerSplit], zd: int
                ) -> tuple[list[LayerSplit], list[LayerSplit | None]]:
        """Each class's split refined by its exact pipeline time (``refine_split``: the exact price has the last
        word), and where it recomputes part of a stage, its split without partial recompute refined alike
        (``plain``; None where none fits; the chosen split itself where it recomputes no part)."""
        chosen = list(chosen)
        plain: list[LayerSplit | None] = list(chosen)
        for j, key in enumerate(cc.keys):
            lay, mb, choice = cc.layouts[cc.members[key][0]], max(alloc.per_class[j]), key[2]

            def price(sp: LayerSplit, lay: PipelineLayout = lay, mb: int = mb, choice: ScheduleChoice = choice
                      ) -> float:
                return self.pricer.class_time(lay, sp, mb, choice)

            def bound(sp: LayerSplit, lay: PipelineLayout = lay, mb: int = mb, choice: ScheduleChoice = choice
                      ) -> float:
                return self.pricer.class_bound(lay, sp, mb, choice)

            budget = max(3, min(24, REFINE_OPS // (3 * len(key[0]) * choice.chunks * mb)))
            slots = self.space.slots(key[0], zd, choice)
            chosen[j] = refine_split(slots, chosen[j], price, choice.chunks, budget, bound)
            if any(chosen[j].recompute_layers):
                sp = self.space.fast_split(key[0], zd, choice, False)
                plain[j] = None if sp is None else \
                    refine_split(self.space.slots(key[0], zd, choice, False), sp, price, choice.chunks, budget, bound)
        return chosen, plain

    def candidate(self, cc: ComboClasses, alloc: Allocation, splits: Sequence[LayerSplit]) -> Candidate | None:
        """The plan of these splits per class and the allocation's counts, estimated (None: out of memory)."""
        split_of: dict[int, LayerSplit] = {}
        mb_of: dict[int, int] = {}
        choice_of: dict[int, ScheduleChoice] = {}
        for j, key in enumerate(cc.keys):
            for idx, mb in zip(cc.members[key], alloc.per_class[j]):
                mb_of[idx] = mb
                split_of[idx] = splits[j]
                choice_of[idx] = key[2]
        return self.pricer.candidate(cc.layouts, split_of, mb_of, choice_of)

    @staticmethod
    def combo_classes(combo: Sequence[BlockCandidate], alloc: Allocation) -> ComboClasses:
        """Classes over the whole combination (identical template, boundary cost and schedule)."""
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
        return ComboClasses(tuple(layouts), tuple(keys), members, most, fills)
