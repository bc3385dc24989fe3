"""Blocks: a set of device types whose TP groups are shared out over ``P`` pipelines, in a stage order and a
placement (planner/search.py, phase 2). ``block_job`` decides whether a block exists (its pipelines'
templates and their fast splits); ``build_block`` deals its groups and prices its pipeline classes;
``with_sync`` and ``with_spare_gains`` add the gradient sync, optimizer and raised-bound terms the ranking
needs; the single-type blocks of every TP degree are enumerated here (the mixed ones in
planner/mixed_blocks.py; which blocks are kept: planner/block_ranking.py)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

from planner.exact_pricing import ExactPricer
from planner.microbatch import PipelineClass, TimeOption, allocate_greedy
from planner.pipelines import (
    PipelineLayout,
    Template,
    build_pipelines,
    deal,
    kind_order,
    share_out,
)
from planner.schedule_choice import (
    stage_layer_ranges,
)
from planner.search_space import SearchSpace
from planner.search_types import (
    BOUND_ROUNDING,
    BlockCandidate,
    BlockJob,
    ClassInfo,
    Job,
    SearchBudget,
    TypeChoice,
)
from planner.tp_groups import GroupKind

SYNC_RINGS = 2          # costliest stage positions per block kept to price cross-block gradient sync


class BlockBuilder:
    """Builds and prices one search's blocks."""

    def __init__(self, space: SearchSpace, pricer: ExactPricer, budget: SearchBudget) -> None:
        self.space = space
        self.pricer = pricer
        self.budget = budget
        self.cm = space.cm   # (the space's, named here for short)
        self.settings = space.settings
        self.seen_blocks: set[tuple] = set()

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
        layouts and classes (``build_block``); ``job_bound`` bounds what ``keep_blocks`` ranks it by."""
        self.budget.stats.block_evaluations += 1
        groups = self.space.groups(choice)
        if stages is not None:
            (kind, gs), = groups.items()
            if pipelines * stages > len(gs):
                return None
            groups = {kind: gs[:pipelines * stages]}
        ranked = kind_order(list(groups), self.space.memory_gib, self.space.layer_s, order)
        zd = self.space.zero_degree(pipelines)
        # Templates first: a block whose pipelines cannot hold the model is dropped before dealing groups.
        if shares is None:
            shares = share_out({k: len(v) for k, v in groups.items() if v}, pipelines)
        if shares is None:
            return None
        templates = tuple(sorted(tuple(k for k in ranked for _ in range(sh.get(k, 0))) for sh in shares))
        # Another stage order or share-out that gives the same pipelines was evaluated already.
        seen_key = (choice, stages, placement, templates)
        if seen_key in self.seen_blocks:
            return None
        self.seen_blocks.add(seen_key)
        for template in set(templates):
            if len(template) > self.space.model.num_layers or \
                    all(self.space.fast_split(template, zd, c) is None for c in self.space.choices):
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
        zd = self.space.zero_degree(job.pipelines)
        by_class: dict[tuple[Template, float], list[int]] = {}
        for i, lay in enumerate(layouts):
            by_class.setdefault((lay.template, round(self.space.boundary_s(lay), 12)), []).append(i)
        classes = []
        m_each = max(1, self.space.micro_batches // job.pipelines)
        for (template, bnd), members in by_class.items():
            picked = self.space.class_schedule(template, bnd, zd, max(len(template), m_each))
            if picked is None:
                return None
            sched, split, fill, hops = picked
            m = max(len(template), m_each)
            room = self.pricer.spare_room(layouts[members[0]], zd, split, sched, m)
            classes.append(ClassInfo(template, bnd, tuple(members), split, sched, fill, hops, room, spare_count=m))
        return BlockCandidate(job.choice, job.pipelines, job.order, job.placement, tuple(layouts), tuple(classes))

    def job_bound(self, job: BlockJob, share: float) -> float:
        """A lower bound of ``keep_blocks``'s cheap bound of the block ``job`` builds (``span_alone`` on each
        class's ``floor_option``, plus the clip), from its templates alone: per template the least slowest
        stage over the schedules searched and a fixed time without the boundary transfers (``option`` adds
        ``hops * boundary >= 0``; ``pipeline_step_bound`` only grows with each transfer time, so
        ``open_bound``, the same bound with none, is at most ``spare_bound_s``). The greedy allocation's
        makespan only falls with per-micro-batch and fixed times, and pipelines alike in both count as one
        class; a margin against rounding (``BOUND_ROUNDING``)."""
        zd = self.space.zero_degree(job.pipelines)
        m_each = max(1, self.space.micro_batches // job.pipelines)
        counts = Counter(job.templates)
        classes = []
        for template, n in counts.items():
            m = max(len(template), m_each)
            per = fixed = math.inf
            for choice in self.space.choices:
                sp = self.space.fast_split(template, zd, choice)
                if sp is None:
                    continue
                fill_s = self.space.fill(template, choice)[0] * (sp.sum_s - sp.max_s)
                room_s = self.pricer.open_bound(template, job.groups, sp, choice, m) - m * sp.max_s
                per, fixed = min(per, sp.max_s), min(fixed, max(0.0, min(fill_s, room_s)))
            if not math.isfinite(per):
                return math.inf
            classes.append(PipelineClass((TimeOption(per, fixed),), len(template), n))
        m_total = max(sum(len(t) for t in job.templates), round(self.space.micro_batches * share))
        alloc = allocate_greedy(classes, m_total)
        if alloc is None:
            return math.inf
        return (alloc.makespan_s + self.space.clip_s) * (1 - BOUND_ROUNDING) - 1e-12

    def complete(self, draft: BlockCandidate) -> BlockCandidate:
        """``draft`` with its gradient sync and optimizer terms (what ``overheads`` prices) and each class's
        ``spare_gain`` (priced here, not for every draft: it plays the schedule)."""
        return self.with_spare_gains(self.with_sync(draft))

    def with_sync(self, draft: BlockCandidate) -> BlockCandidate:
        """``draft`` with its gradient sync and optimizer terms: what ``overheads`` prices (from the splits,
        layouts and schedules alone: the spare gains change none of them)."""
        grad_bytes, opt_terms = self.terms(draft.classes)
        rings = self.sync_rings(draft.layouts, draft.classes) if draft.pipelines > 1 else ()
        return dataclasses.replace(draft, grad_bytes=grad_bytes, opt_terms=opt_terms, sync_rings=rings[:SYNC_RINGS],
                                   sync_self_s=rings[0][2] if rings else 0.0)

    def with_spare_gains(self, draft: BlockCandidate, only: int | None = None) -> BlockCandidate:
        """``draft`` with each class's ``spare_gain`` where it has room and none is priced yet (``only``: that
        class alone; a class's gain reads nothing of the others')."""
        zd = self.space.zero_degree(draft.pipelines)
        classes = []
        late = any(c.spare_s is None and c.spare_room for c in draft.classes) and \
            self.budget.out_of_time("raised activation limits")   # past the limit: ranked without them
        for j, c in enumerate(draft.classes):
            if c.spare_s is None and c.spare_room and not late and only in (None, j):
                m = c.spare_count
                c = dataclasses.replace(c, spare_s=self.pricer.spare_gain(draft.layouts[c.members[0]], zd, c.split,
                                                                          c.schedule, m, c.option().time(m)))
            classes.append(c)
        return dataclasses.replace(draft, classes=tuple(classes))

    def sync_rings(self, layouts: Sequence[PipelineLayout], classes: Sequence[ClassInfo]
                   ) -> list[tuple[tuple[int, ...], float, float]]:
        """The block's own gradient sync as ``CostModel.sync_plan`` lays it out, from the fast splits: the
        layers cut where any class changes stage, each segment all-reduced among its holders (one device
        per pipeline; TP slices priced as one ring through the groups' first devices), a stage's segments
        with the same holders fused. Returns (ring, bytes, seconds) per stage of each class, costliest
        first."""
        n_layers = self.space.model.num_layers
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
                ring_keys[ring] = self.space.ring_key(ring)
            for ci, k in holders:
                nbytes = self.space.segment_grad_bytes(classes[ci].template[k], b - a, a == 0, b == n_layers)
                per = fused.setdefault((ci, k), {})
                per[ring] = per.get(ring, 0.0) + nbytes
        out = []
        for per in fused.values():
            secs = sum(self.space.keyed_ring_time(ring_keys[ring], ring, nbytes) for ring, nbytes in per.items())
            biggest = max(per, key=lambda r: (per[r], r))
            out.append((biggest, sum(per.values()), secs))
        out.sort(key=lambda r: (-r[2], r[0]))
        return out

    def terms(self, classes: Sequence[ClassInfo]) -> tuple[float, tuple[tuple[str, int, int], ...]]:
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
                    sync = max(sync, self.space.ring_time(tuple(sorted(ring + others)), nbytes))
        zd = self.space.zero_degree(p)
        opt = max(self.cm.optimizer_time(t, n, zd, k) for b in blocks for t, n, k in b.opt_terms)
        return sync + opt + self.space.clip_s

    def span_alone(self, cand: BlockCandidate, share: float = 1.0, floor: bool = False) -> float:
        """The greedy allocation's makespan of a block as if it took ``share`` of the batch alone (``floor``:
        with each class's ``floor_option``, a lower bound before ``complete``)."""
        m = max(cand.min_micro_batches, round(self.space.micro_batches * share))
        classes = [PipelineClass((c.floor_option() if floor else c.option(),), len(c.template), len(c.members))
                   for c in cand.classes]
        alloc = allocate_greedy(classes, m)
        return math.inf if alloc is None else alloc.makespan_s

    def single_type_jobs(self, choices: Mapping[str, Sequence[int]], types: Sequence[str]) -> Iterator[Job]:
        """Single-type blocks to evaluate: all of a type's groups, or P x S of them, at every TP degree."""
        for t in types:
            for c in [TypeChoice(t, tp, rem) for tp in choices[t] for rem in (True, False)]:
                choice = (c,)
                gs = self.space.groups(choice)
                total = sum(len(v) for v in gs.values())
                if total == 0 or (not c.remainder and len(self.space.groups((TypeChoice(t, c.tp),))) == len(gs)):
                    continue   # rem=False only differs where a node has left-over devices
                for p in self.space.pipeline_counts(total):
                    for sh in self.space.share_options(gs, p):
                        for place in self.space.placements(p):
                            yield choice, p, "memory", None, place, sh
                if len(gs) == 1:
                    for s in range(1, self.space.model.num_layers + 1):
                        p = min(total // s, self.space.micro_batches // s)
                        if p >= 1 and p * s < total:
                            for place in self.space.placements(p):
                                yield choice, p, "memory", s, place, None

    def single_type_blocks(self, choices: Mapping[str, Sequence[int]], types: Sequence[str]
                           ) -> dict[str, list[BlockCandidate]]:
        """Phase 2 for one type at a time: every feasible block of ``single_type_jobs``, by type."""
        single: dict[str, list[BlockCandidate]] = {t: [] for t in types}
        jobs = list(self.single_type_jobs(choices, types))
        self.budget.report("pipelines (single type)", 0, len(jobs))
        found = False
        for i, (choice, p, order, s, place, sh) in enumerate(jobs):
            if i % 64 == 0:
                self.budget.report("pipelines (single type)", i, len(jobs))
            # Past the time limit the search goes on only until it has a block (a plan to return).
            if found and self.budget.out_of_time("single-type pipelines"):
                break
            cand = self.evaluate_block(choice, p, order, s, place, sh)
            if cand is not None:
                single[choice[0].device_type].append(cand)
                found = True
        self.budget.report("pipelines (single type)", len(jobs), len(jobs))
        return single

    def top_choices(self, choices: Mapping[str, Sequence[int]], types: Sequence[str],
                    blocks: Mapping[frozenset[str], list[BlockCandidate]]) -> dict[str, tuple[TypeChoice, ...]]:
        """Per type, the TP choices of its best own pipelines, then every degree by time per layer (a type
        that cannot hold the model alone, small memory, tries them all)."""
        top: dict[str, tuple[TypeChoice, ...]] = {}
        for t in types:
            seen: list[TypeChoice] = []
            for c in blocks[frozenset([t])]:
                if c.choice[0] not in seen:
                    seen.append(c.choice[0])
            by_eff = sorted(choices[t], key=lambda tp: (tp * self.space.layer_s(GroupKind(t, tp)), tp))
            for tp in by_eff:
                if TypeChoice(t, tp) not in seen:
                    seen.append(TypeChoice(t, tp))
            top[t] = tuple(seen)
        return top
