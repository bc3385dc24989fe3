"""Mixed blocks (planner/search.py, phase 2): blocks of two or more device types, every TP degree of each
type when they hold two types, the best few per type otherwise; listed as jobs and built only where the
ranking (planner/block_ranking.py) may keep them. Small inputs (``MixedInputs``), so that a worker process
can build a subset's blocks (planner/search.py's parallel path)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.block_ranking import keep_blocks
from planner.blocks import BlockBuilder
from planner.pipelines import (
    ORDERS,
)
from planner.search_types import (
    BlockCandidate,
    BlockJob,
    TypeChoice,
)

TYPE_CHOICES_MULTI = (4, 2, 2)  # TP choices per type tried inside mixed blocks of 2, 3, 4+ types
UNEVEN_CHOICES = 2         # ... and in mixed blocks with each type's first two TP choices only


@dataclass(frozen=True)
class MixedInputs:
    """What the mixed blocks need of the single-type phase (``Searcher.start``): small, so that a worker
    process gets it with each subset of types (``search``'s parallel path)."""

    top_choice: Mapping[str, tuple[TypeChoice, ...]]   # per type, its TP choices best first (``top_choices``)
    alone: frozenset[str]   # the types with a kept single-type block
    best_rate: Mapping[str, float]   # per type, its best single-type block's throughput
    total_rate: float


def mixed_chunks(types: Sequence[str]) -> list[tuple[tuple[str, ...], ...]]:
    """``mixed_subsets`` cut into the tasks of ``search``'s parallel path: every pair together, each larger
    subset alone."""
    subsets = mixed_subsets(types)
    pairs = tuple(s for s in subsets if len(s) == 2)
    return ([pairs] if pairs else []) + [(s,) for s in subsets if len(s) > 2]


def mixed_subsets(types: Sequence[str]) -> list[tuple[str, ...]]:
    """The subsets of >= 2 types that form mixed blocks, in the search's order."""
    return [s for r in range(2, len(types) + 1) for s in itertools.combinations(types, r)]


def mixed_blocks(blocks: BlockBuilder, inputs: MixedInputs, subsets: Sequence[tuple[str, ...]]
                 ) -> list[list[BlockCandidate]]:
    """``mixed_block`` of each subset in turn (all of them in ``Searcher.run``, a chunk in a worker's task); past the
    time limit the rest are skipped once some block is kept."""
    out: list[list[BlockCandidate]] = []
    for done, subset in enumerate(subsets):
        blocks.budget.report("pipelines (mixed types)", done, len(subsets))
        out.append(mixed_block(blocks, inputs, subset, bool(inputs.alone) or any(out)))
    blocks.budget.report("pipelines (mixed types)", len(subsets), len(subsets))
    return out


def mixed_block(blocks: BlockBuilder, inputs: MixedInputs, subset: Sequence[str], have_blocks: bool
                ) -> list[BlockCandidate]:
    """Phase 2 for one subset of >= 2 types: the best TP choices per type, every stage order; the kept
    candidates (for the subset's expected share of the batch). ``have_blocks``: some block is kept
    already, so past the time limit this subset is skipped (``[]``)."""
    if have_blocks and blocks.budget.out_of_time("mixed-type pipelines"):
        return []
    found: list[BlockJob] = []   # built only where ``keep_blocks`` looks at them
    share = sum(inputs.best_rate[t] for t in subset) / inputs.total_rate
    width = TYPE_CHOICES_MULTI[min(len(subset), 4) - 2]
    lists = [inputs.top_choice[t][:width] if t in inputs.alone else inputs.top_choice[t] for t in subset]
    for combo in itertools.product(*lists):
        if found and blocks.budget.out_of_time("mixed-type pipelines"):
            break   # the subset's blocks so far are kept
        gs = blocks.space.groups(tuple(combo))
        total = sum(len(v) for v in gs.values())
        # Uneven shares only with each type's leading TP choices (they multiply the work).
        uneven = all(c in inputs.top_choice[t][:UNEVEN_CHOICES] for t, c in zip(subset, combo))
        for p in blocks.space.pipeline_counts(total):
            for sh in (blocks.space.share_options(gs, p) if uneven else [None]):
                for order in ORDERS:
                    for place in blocks.space.placements(p):
                        job = blocks.block_job(tuple(combo), p, order, None, place, sh)
                        if job is not None:
                            found.append(job)
    return keep_blocks(blocks, found, share)
