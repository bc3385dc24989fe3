"""Combination (planner/search.py, phases 3 and 4): the types in use partitioned into blocks, one kept
candidate per block, every combination ranked by a fast score (greedy micro-batch allocation plus the
gradient sync, optimizer and clip), and the best realized as plans the cost model estimates."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

from planner.blocks import BlockBuilder
from planner.exact_pricing import ExactPricer
from planner.microbatch import Allocation, PipelineClass, allocate_greedy
from planner.search_space import SearchSpace
from planner.search_types import (
    BlockCandidate,
    Candidate,
    Combo,
    SearchBudget,
)

_T = TypeVar("_T")

COMBOS_REALIZED = 40    # best combinations (by the fast score) realized and scored by the cost model
ALIGNED_REALIZED = 3    # best one-block plans of identical pipelines realized as well
COMBO_BUDGET = 400      # combinations scored per set partition of the types


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


def with_each_type(kept: list[_T], ranked: Sequence[_T], types: Sequence[str],
                   combo: Callable[[_T], Sequence[BlockCandidate]]) -> list[_T]:
    """``kept`` and, for each type, the best of ``ranked`` whose combination uses it (if not kept yet):
    so that idle devices can be explained with real numbers."""
    out = list(kept)
    for t in types:
        best = next((x for x in ranked if any(t in b.types for b in combo(x))), None)
        if best is not None and all(combo(best) is not combo(k) for k in out):
            out.append(best)
    return out


class Combiner:
    """Combines one search's kept blocks into plans."""

    def __init__(self, space: SearchSpace, blocks: BlockBuilder, pricer: ExactPricer, budget: SearchBudget) -> None:
        self.space = space
        self.blocks = blocks
        self.pricer = pricer
        self.budget = budget
        self.cm = space.cm   # (the space's, named here for short)
        self.settings = space.settings

    def score(self, blocks: Sequence[BlockCandidate]) -> tuple[float, Allocation] | None:
        """Fast step-time estimate of a combination (greedy allocation over the fast splits)."""
        p = sum(b.pipelines for b in blocks)
        if p < self.settings.min_pipelines:
            return None
        if sum(b.min_micro_batches for b in blocks) > self.space.micro_batches:
            return None
        classes = [PipelineClass((c.option(),), len(c.template), len(c.members)) for b in blocks for c in b.classes]
        alloc = allocate_greedy(classes, self.space.micro_batches)
        if alloc is None:
            return None
        return alloc.makespan_s + self.blocks.overheads(blocks), alloc

    def combine(self, types: Sequence[str], blocks: Mapping[frozenset[str], list[BlockCandidate]]
                ) -> list[tuple[float, Combo, Allocation]]:
        """Phase 3: every set partition of every subset of the types into blocks, a candidate per block;
        ranked by the fast score."""
        scored: list[tuple[float, Combo, Allocation]] = []
        subsets = [s for r in range(1, len(types) + 1) for s in itertools.combinations(types, r)]
        for si, subset in enumerate(subsets):
            self.budget.report("combining pipelines", si, len(subsets))
            for part in set_partitions(list(subset)):
                lists = [blocks.get(frozenset(b), []) for b in part]
                if any(not x for x in lists):
                    continue
                width = max(2, int(COMBO_BUDGET ** (1.0 / len(lists))))
                lists = [x[:width] for x in lists]
                for combo in itertools.product(*lists):
                    self.budget.stats.combinations += 1
                    res = self.score(combo)
                    if res is not None:
                        scored.append((res[0], tuple(combo), res[1]))
        self.budget.report("combining pipelines", len(subsets), len(subsets))
        scored.sort(key=lambda x: x[0])   # stable: ties keep the order found
        return scored

    def realize_best(self, types: Sequence[str], scored: Sequence[tuple[float, Combo, Allocation]]
                     ) -> list[tuple[Candidate, Combo, Allocation]]:
        """Phase 4: the best combinations by the fast score, the best using each type and the best aligned
        ones, realized (fast splits, greedy micro-batches) and scored by the cost model; best first."""
        ranked = [(c, a) for _, c, a in scored]
        picked = with_each_type(ranked[:COMBOS_REALIZED], ranked, types, lambda x: x[0])
        aligned = [(c, a) for c, a in ranked if len(c) == 1 and c[0].aligned][:ALIGNED_REALIZED]
        picked += [(c, a) for c, a in aligned if all(c is not p for p, _ in picked)]
        realized: list[tuple[Candidate, Combo, Allocation]] = []
        for i, (combo, alloc) in enumerate(picked):
            self.budget.report("scoring plans with the cost model", i, len(picked))
            if realized and self.budget.out_of_time("scoring plans"):
                break   # past the limit: no more once one plan is scored
            cand = self.pricer.realize(combo, alloc)
            if cand is not None:
                realized.append((cand, combo, alloc))
        self.budget.report("scoring plans with the cost model", len(picked), len(picked))
        realized.sort(key=lambda x: x[0].step_time_s)
        return realized
