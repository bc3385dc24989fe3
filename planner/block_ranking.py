"""Which blocks the search keeps (planner/search.py, phase 2): per block, the candidates on the front of
(throughput up, fill-and-drain down) by a score as if the block ran alone, and the best of identical
pipelines in each placement. Ranked lazily (``lazily_sorted``): each candidate's dear parts (dealing its
groups, its sync terms, the list plays of its raised bounds) are priced only when a lower bound of its
score comes up."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from planner.blocks import BlockBuilder
from planner.pipelines import (
    PLACEMENTS,
)
from planner.search_types import (
    BOUND_ROUNDING,
    BlockCandidate,
    BlockJob,
)

BLOCK_KEEP = 8          # block candidates kept per block (after the Pareto filter)


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


def pareto_front(view: Callable[[int], BlockCandidate], n: int, lower: Sequence[float], score: Callable[[int], float],
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


def keep_blocks(blocks: BlockBuilder, found: Sequence[BlockCandidate | BlockJob], share: float
                ) -> list[BlockCandidate]:
    """The block candidates worth combining, completed (``BlockBuilder.complete``): the best when the block
    gets ``share`` of the batch (its expected share next to the other types), and the best when it gets all
    of it; each scored as if it ran alone (makespan plus its ``overheads``). Drafts are completed in
    order of a lower bound of that score (makespan plus clip), so only those that may be kept are; and
    before the spare gains, which play the schedule, each gets a tighter bound (the floor makespan plus
    its own sync and optimizer terms, ``with_sync``), so that only those that still may be kept play it.
    Blocks not built yet (``BlockJob``, the mixed blocks) are built when a bound of that bound from their
    templates (``job_bound``) comes up: those that cannot be kept never deal their groups."""
    drafts = Drafts(blocks, found)
    out: list[BlockCandidate] = []
    for k, sh in enumerate((share, 1.0) if share < 0.999 else (1.0,)):
        for c in drafts.best(sh, BLOCK_KEEP if k == 0 else BLOCK_KEEP // 2):
            if all(c is not o for o in out):
                out.append(c)
    return out


class Drafts:
    """The drafts of one ``keep_blocks`` call, each built, synced and priced only as far as the ranking asks
    (each step kept for the next share)."""

    def __init__(self, blocks: BlockBuilder, found: Sequence[BlockCandidate | BlockJob]) -> None:
        self.blocks = blocks
        self.found = found
        self.built: dict[int, BlockCandidate | None] = {}
        self.done: dict[int, BlockCandidate] = {}
        self.synced: dict[int, BlockCandidate] = {}
        self.partial: dict[int, BlockCandidate] = {}   # drafts with some classes' spare gains priced (``step``)
        self.lazy = any(isinstance(x, BlockJob) for x in found)
        self.any_built = False

    def draft(self, i: int) -> BlockCandidate | None:
        x = self.found[i]
        if isinstance(x, BlockCandidate):
            return x
        if i not in self.built:
            # Past the time limit no more blocks are built once one is (the ones so far are kept).
            late = self.any_built and self.blocks.budget.out_of_time("mixed-type pipelines")
            self.built[i] = None if late else self.blocks.build_block(x)
            self.any_built |= self.built[i] is not None
        return self.built[i]

    def built_draft(self, i: int) -> BlockCandidate:   # asked only of drafts whose bound came up: built, not None
        d = self.draft(i)
        assert d is not None
        return d

    def sync_view(self, i: int) -> BlockCandidate:
        if i not in self.synced:
            self.synced[i] = self.blocks.with_sync(self.built_draft(i))
        return self.synced[i]

    def full(self, i: int) -> BlockCandidate:
        if i not in self.done:
            self.done[i] = self.blocks.with_spare_gains(self.partial.pop(i, None) or self.sync_view(i))
        return self.done[i]

    def view(self, i: int) -> BlockCandidate:
        return self.done.get(i) or self.partial.get(i) or self.built_draft(i)

    def step(self, i: int) -> BlockCandidate | None:
        """The draft with one more class's spare gain priced (None when at most one is left: the score's
        own work), so that a draft whose classes are priced one at a time can fall out of the ranking
        before it plays them all. Which class first: the one whose floor is furthest below its option
        at the draft's rate (``floor_overhead``'s term), the likeliest to lift the bound."""
        if i in self.done:
            return None
        d = self.partial.get(i) or self.sync_view(i)
        todo = [j for j, c in enumerate(d.classes) if c.spare_s is None and c.spare_room]
        if len(todo) < 2 or time.perf_counter() > self.blocks.budget.deadline:
            return None   # (past the limit ``full`` decides, and records the cut, as before)
        j = max(todo, key=lambda j: (len(d.classes[j].members) * (d.classes[j].option().fixed_s
                                      - d.classes[j].floor_option().fixed_s) / d.classes[j].split.max_s, -j))
        self.partial[i] = self.blocks.with_spare_gains(d, only=j)
        return self.partial[i]

    def lower(self, sh: float) -> list[float]:
        """Each draft's first bound at share ``sh``: overheads() adds sync + optimizer >= 0 to the clip; the
        floor span, what the spare limits may save (below it, for blocks not built yet, their templates'
        bound)."""
        blocks = self.blocks
        return [blocks.job_bound(x, sh) if isinstance(x, BlockJob) else
                blocks.span_alone(x, sh, floor=True) + blocks.space.clip_s for x in self.found]

    def cheap(self, i: int, sh: float) -> float:   # ``lower``'s bound once the block is built
        d = self.draft(i)
        return math.inf if d is None else self.blocks.span_alone(d, sh, floor=True) + self.blocks.space.clip_s

    def score(self, i: int, sh: float) -> float:
        return self.blocks.span_alone(self.full(i), sh) + self.blocks.overheads([self.full(i)])

    def middle(self, i: int, sh: float) -> float:   # the overheads are the score's; the floor span below its
        d = self.partial.get(i) or self.sync_view(i)
        return self.blocks.span_alone(d, sh, floor=True) + self.blocks.overheads([d])

    def refine(self, i: int, sh: float) -> float | None:
        # ``middle`` with one more class priced: a priced class's floor is its option, at or above its
        # floor before, and the greedy makespan only grows with a class's fixed time; the overheads
        # are the score's (the spare gains change none of their terms). The margin: an unpriced
        # class's floor (from the bound) and its option (from the played time) are rounded apart, and
        # a bound an ulp above the score could reorder ties. (``middle`` reads the draft ``step`` priced.)
        return None if self.step(i) is None else self.middle(i, sh) * (1 - BOUND_ROUNDING) - 1e-12

    def best(self, sh: float, keep: int) -> list[BlockCandidate]:
        """At share ``sh``: the first ``keep`` on the front (``pareto_front``), then the best with identical
        pipelines in each placement."""
        lower = self.lower(sh)
        first = (lambda i: self.cheap(i, sh)) if self.lazy else None
        score = lambda i: self.score(i, sh)
        middle = lambda i: self.middle(i, sh)
        refine = lambda i: self.refine(i, sh)
        kept = [self.full(i) for i in pareto_front(self.view, len(self.found), lower, score, keep, middle, first,
                                                   refine)]
        # ... and the best with identical pipelines (their gradient sync has no chains of waits, which
        # the closed form does not price: see api.simulator_check), in each placement: where the
        # pipelines' stages sit decides between boundary and sync costs, which the ranking prices apart.
        for place in PLACEMENTS:
            aligned = [i for i, c in enumerate(self.found) if c.aligned and c.placement == place]
            kept += [self.full(i) for _, i in itertools.islice(lazily_sorted(lower, score, aligned, middle=middle,
                                                                             first=first, refine=refine), 1)]
        return kept
