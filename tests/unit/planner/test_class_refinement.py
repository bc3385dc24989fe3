"""``block_ranking.keep_blocks`` prices a block draft's spare gains (each a list play) one class at a time (``refine``):
after each, the draft's floor score is a tighter lower bound of its score, so a draft can fall out of the
ranking before it plays every class. That is only exact if (1) ``lazily_sorted`` with those extra levels
yields what it yields without them and its consumer keeps the same entries, (2) the partly priced floor never
exceeds the score, and (3) ``keep_blocks`` keeps the same blocks, completed alike, with the refinement as without."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner.block_ranking as ranking_mod
from planner.block_ranking import keep_blocks, lazily_sorted
from planner.search import BOUND_ROUNDING
from tests.unit.planner.test_lazy_blocks import JOBS, searcher


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.0, 7.0, math.inf]), st.sampled_from([0.0, 0.5, 1.0]),
                          st.lists(st.sampled_from([0.0, 0.25, 0.5]), max_size=3), st.sampled_from([0.0, 0.5]),
                          st.integers(0, 3), st.integers(0, 3)), max_size=25),
       st.integers(1, 8), st.booleans())
def test_refine_levels_keep_what_is_kept(items: list, keep: int, with_middle: bool) -> None:
    """Each item: lower, a step to its middle bound, refinement steps (each a tighter bound), a last step to
    its exact value, and two attributes; the consumer keeps, in yield order, items no kept one dominates
    (both attributes at least as good), ``keep`` of them, and ``skip`` drops what the kept ones dominate
    (more as the search goes on, as ``pareto_front``'s ``beaten``). With the refinement the same items are kept,
    every value yielded is the exact one, and ``exact`` is asked of no item that was not asked without it."""
    lower = [lo for lo, *_ in items]
    middles = [lo + a for lo, a, *_ in items]
    steps = []
    for mi, (_, _, extra, _, _, _) in zip(middles, items):
        out, v = [], mi
        for e in extra:
            v += e
            out.append(v)
        steps.append(out)
    exact = [(s[-1] if s else mi) + c for s, mi, (_, _, _, c, _, _) in zip(steps, middles, items)]
    attrs = [(x, y) for *_, x, y in items]

    def run(refined: bool) -> tuple[list, set]:
        kept: list[int] = []
        asked: set[int] = set()
        done: dict[int, int] = {}

        def dominated(i: int) -> bool:
            return any(attrs[j][0] <= attrs[i][0] and attrs[j][1] <= attrs[i][1] for j in kept)

        def ex(i: int) -> float:
            asked.add(i)
            return exact[i]

        def refine(i: int) -> float | None:
            n = done.get(i, 0)
            if n >= len(steps[i]):
                return None
            done[i] = n + 1
            return steps[i][n]

        for v, i in lazily_sorted(lower, ex, range(len(items)), dominated, (lambda i: middles[i]) if with_middle
                                  else None, None, refine if refined else None):
            assert v == exact[i]
            if dominated(i):
                continue
            kept.append(i)
            if len(kept) >= keep:
                break
        return kept, asked

    kept, asked = run(False)
    kept_r, asked_r = run(True)
    assert kept_r == kept
    assert asked_r <= asked


def multi_class_drafts(case: int, limit: int) -> list:
    s = searcher(case)
    out = []
    for job in JOBS[case]:
        d = s.blocks.build_block(job)
        if d is not None and sum(c.spare_room for c in d.classes) >= 2:
            out.append(job)
            if len(out) >= limit:
                break
    return out


DRAFTS = {case: multi_class_drafts(case, 40) for case in (0, 1)}


@pytest.mark.parametrize("case", [0, 1])
def test_drafts_with_several_priced_classes_exist(case: int) -> None:
    assert len(DRAFTS[case]) >= 5   # else the property below checks nothing


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([0, 1]), st.data(), st.floats(0.05, 1.0))
def test_partly_priced_floor_never_exceeds_the_score(case: int, data: st.DataObject, share: float) -> None:
    """Classes priced one at a time, in any order: the floor score (``keep_blocks``'s ``refine``) after each never
    exceeds the score of the draft with every class priced (beyond rounding: ``refine`` takes a margin), and
    that draft is the one pricing all at once gives."""
    s = searcher(case)
    job = data.draw(st.sampled_from(DRAFTS[case]))
    d = s.blocks.with_sync(s.blocks.build_block(job))
    full = s.blocks.with_spare_gains(d)
    score = s.blocks.span_alone(full, share) + s.blocks.overheads([full])
    order = data.draw(st.permutations([j for j, c in enumerate(d.classes) if c.spare_room]))
    part = d
    for j in order:
        part = s.blocks.with_spare_gains(part, only=j)
        floor = s.blocks.span_alone(part, share, floor=True) + s.blocks.overheads([part])
        assert floor * (1 - BOUND_ROUNDING) - 1e-12 <= score   # (``refine``'s margin against rounding)
        assert floor <= score * (1 + 1e-12)
    assert part.classes == full.classes


def block_key(b) -> tuple:
    return (b.choice, b.pipelines, b.order, b.placement, b.layouts, b.classes, b.grad_bytes, b.opt_terms,
            b.sync_rings, b.sync_self_s)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([0, 1]), st.data(), st.floats(0.05, 1.0))
def test_keep_keeps_the_same_blocks_with_the_refinement(case: int, data: st.DataObject, share: float) -> None:
    """Random lists of mixed-block jobs (several with more than one class to price among them): ``keep_blocks``
    keeps the same blocks, completed alike, as a ``keep_blocks`` whose ranking prices every class at once."""
    pool = JOBS[case][:120]
    jobs = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=30, unique_by=id)) + DRAFTS[case][:4]
    got = [block_key(b) for b in keep_blocks(searcher(case).blocks, jobs, share)]
    plain = lazily_sorted

    def unrefined(*args, **kwargs):
        if len(args) > 6:
            args = args[:6]
        kwargs.pop("refine", None)
        return plain(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ranking_mod, "lazily_sorted", unrefined)
        want = [block_key(b) for b in keep_blocks(searcher(case).blocks, jobs, share)]
    assert got == want


def test_refinement_saves_list_plays() -> None:
    """Not a vacuous change: on these drafts the refined ranking plays fewer classes than the plain one."""
    calls = {True: 0, False: 0}
    plain = lazily_sorted
    for refined in (True, False):
        s = searcher(0)
        orig = s.pricer.spare_gain

        def counted(*a, refined: bool = refined, orig=orig):
            calls[refined] += 1
            return orig(*a)

        s.pricer.spare_gain = counted   # type: ignore[method-assign]

        def unrefined(*args, **kwargs):
            kwargs.pop("refine", None)
            return plain(*args[:6], **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            if not refined:
                mp.setattr(ranking_mod, "lazily_sorted", unrefined)
            keep_blocks(s.blocks, list(itertools.chain(JOBS[0])), 0.5)
    assert calls[True] < calls[False]
