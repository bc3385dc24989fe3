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


def keep_blocks(blocks: BlockBuilder, found: Sequence[BlockCandidate | BlockJob], share: float) -> list[BlockCandidate]:
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
            late = any_built[0] and blocks.budget.out_of_time("mixed-type pipelines")
            built[i] = None if late else blocks.build_block(x)
            any_built[0] |= built[i] is not None
        return built[i]

    def built_draft(i: int) -> BlockCandidate:   # asked only of drafts whose bound came up: built, not None
        d = draft(i)
        assert d is not None
        return d

    def sync_view(i: int) -> BlockCandidate:
        if i not in synced:
            synced[i] = blocks.with_sync(built_draft(i))
        return synced[i]

    def full(i: int) -> BlockCandidate:
        if i not in done:
            done[i] = blocks.with_spare_gains(partial.pop(i, None) or sync_view(i))
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
        if len(todo) < 2 or time.perf_counter() > blocks.budget.deadline:
            return None   # (past the limit ``full`` decides, and records the cut, as before)
        j = max(todo, key=lambda j: (len(d.classes[j].members) * (d.classes[j].option().fixed_s
                                      - d.classes[j].floor_option().fixed_s) / d.classes[j].split.max_s, -j))
        partial[i] = blocks.with_spare_gains(d, only=j)
        return partial[i]

    out: list[BlockCandidate] = []
    shares = (share, 1.0) if share < 0.999 else (1.0,)
    for k, sh in enumerate(shares):
        # overheads() adds sync + optimizer >= 0 to the clip; the floor span, what the spare limits may save
        # (below it, for blocks not built yet, their templates' bound).
        lower = [blocks.job_bound(x, sh) if isinstance(x, BlockJob) else
                 blocks.span_alone(x, sh, floor=True) + blocks.space.clip_s for x in found]

        def cheap(i: int, sh: float = sh) -> float:   # ``lower``'s bound once the block is built
            d = draft(i)
            return math.inf if d is None else blocks.span_alone(d, sh, floor=True) + blocks.space.clip_s

        first = cheap if lazy else None

        def score(i: int, sh: float = sh) -> float:
            return blocks.span_alone(full(i), sh) + blocks.overheads([full(i)])

        def middle(i: int, sh: float = sh) -> float:   # the overheads are the score's; the floor span below its
            d = partial.get(i) or sync_view(i)
            return blocks.span_alone(d, sh, floor=True) + blocks.overheads([d])

        def refine(i: int, sh: float = sh) -> float | None:
            # ``middle`` with one more class priced: a priced class's floor is its option, at or above its
            # floor before, and the greedy makespan only grows with a class's fixed time; the overheads
            # are the score's (the spare gains change none of their terms). The margin: an unpriced
            # class's floor (from the bound) and its option (from the played time) are rounded apart, and
            # a bound an ulp above the score could reorder ties. (``middle`` reads the draft ``step`` priced.)
            return None if step(i) is None else middle(i, sh) * (1 - BOUND_ROUNDING) - 1e-12

        kept = [full(i) for i in pareto_front(view, len(found), lower, score, BLOCK_KEEP if k == 0 else BLOCK_KEEP // 2,
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
