"""The search builds a mixed block (deals its groups, prices its classes) only when ``keep_blocks``
(planner/block_ranking.py) may keep it: each block is first ranked by ``BlockBuilder.job_bound``, a bound
from its pipelines' templates alone, which is only sound if it never exceeds the bound ``keep_blocks`` ranks
the built block by; and ``lazily_sorted`` with that level below must ask everything it asks without it, in
the same order. The caches the blocks share (``spare_room``, ``spare_gain``) are keyed by each stage
boundary's transfer times (``SearchSpace.hops``): a cached price must be the price of the layout asked for,
whichever layout filled the cache."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import CostModel
from planner.pipelines import ORDERS, PipelineLayout
from planner.search import PlanSettings, Searcher, TypeChoice, lazily_sorted
from planner.tp_groups import tp_choices
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model

CASES = [("h2-example", "llama-13b", "auto"), ("hexiscale-mixed", "llama-7b", "auto"),
         ("h800-h20-48", "llama-32b", "zb-v"), ("hexiscale-mixed", "llama-7b", "interleaved")]


def searcher(case: int) -> Searcher:
    cluster_ref, model_ref, schedule = CASES[case]
    model, cluster = load_model(model_ref), load_cluster(cluster_ref)
    cm = CostModel(model, cluster, resolve_profiles(cluster.device_types), micro_batch=1, seq_len=4096,
                   sequence_parallel=True)
    settings_ = PlanSettings(global_batch=64, seq_len=4096, schedule=schedule)
    return Searcher(cm, settings_, range(cluster.num_devices), math.inf)


def mixed_jobs(s: Searcher, limit: int) -> list:
    """Up to ``limit`` mixed-block jobs, as ``mixed_blocks.mixed_block`` lists them (every TP degree of two types)."""
    choices = tp_choices(s.space.cluster, s.space.model, s.space.devices)
    types = [t for t, tps in choices.items() if tps]
    out = []
    for a, b in itertools.combinations(types, 2):
        for tpa, tpb in itertools.product(choices[a], choices[b]):
            combo = (TypeChoice(a, tpa), TypeChoice(b, tpb))
            gs = s.space.groups(combo)
            for p in s.space.pipeline_counts(sum(len(v) for v in gs.values())):
                for sh in s.space.share_options(gs, p):
                    for order in ORDERS:
                        for place in s.space.placements(p):
                            job = s.blocks.block_job(combo, p, order, None, place, sh)
                            if job is not None:
                                out.append(job)
                                if len(out) >= limit:
                                    return out
    return out


JOBS = {case: mixed_jobs(searcher(case), 400) for case in range(len(CASES))}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(CASES) - 1), st.data(), st.floats(0.05, 1.0))
def test_job_bound_never_exceeds_the_built_blocks_bound(case: int, data: st.DataObject, share: float) -> None:
    s = searcher(case)
    jobs = JOBS[case]
    assert jobs
    for job in data.draw(st.lists(st.sampled_from(jobs), min_size=1, max_size=8)):
        block = s.blocks.build_block(job)
        assert block is not None   # a job is a block that exists: only the dealing is left
        assert block.aligned == job.aligned and block.placement == job.placement
        assert sorted(lay.template for lay in block.layouts) == list(job.templates)
        cheap = s.blocks.span_alone(block, share, floor=True) + s.space.clip_s
        assert s.blocks.job_bound(job, share) <= cheap
        for c in block.classes:   # the transfers only add to the bound
            if c.spare_bound_s is not None:
                bound = s.pricer.open_bound(c.template, job.groups, c.split, c.schedule, c.spare_count)
                assert bound <= c.spare_bound_s


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.0, 2.5, 7.0, math.inf]), st.sampled_from([0.0, 0.5, 1.0]),
                          st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.0, 0.5, 1.0]), st.booleans()),
                max_size=25), st.data())
def test_a_first_level_asks_the_same_as_without_it(items: list[tuple[float, float, float, float, bool]],
                                                   data: st.DataObject) -> None:
    """``lazily_sorted(..., first=)``: with ``lower <= first <= middle <= exact`` (ties included) and a ``skip``
    that reads what was yielded so far, the same values come out and ``skip``, ``middle`` and ``exact`` are
    called with the same arguments in the same order as when ``first``'s values are the lower bounds."""
    base = [lo for lo, *_ in items]
    firsts = [lo + a for lo, a, *_ in items]
    middles = [f + b for f, (_, _, b, _, _) in zip(firsts, items)]
    exact = [mi + c for mi, (_, _, _, c, _) in zip(middles, items)]
    odd = [flag for *_, flag in items]
    k = data.draw(st.integers(1, max(1, len(items))))

    def run(lower: list[float], first: bool) -> tuple[list, list]:
        calls: list = []
        out: list = []

        def skip(i: int) -> bool:   # drops an odd item once an even one was yielded: reads the state
            calls.append(("skip", i))
            return odd[i] and any(not odd[j] for _, j in out)

        def mid(i: int) -> float:
            calls.append(("middle", i))
            return middles[i]

        def ex(i: int) -> float:
            calls.append(("exact", i))
            return exact[i]

        for v, i in lazily_sorted(lower, ex, range(len(items)), skip, mid, (lambda i: firsts[i]) if first else None):
            out.append((v, i))
            if len(out) >= k:
                break
        return out, calls

    assert run(base, True) == run(firsts, False)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_cached_spare_prices_are_the_layouts_own(data: st.DataObject) -> None:
    """Layouts of one template on random devices (some boundaries inside a node, some across, in any
    order: equal sums of different hops): the warm searcher's ``spare_room`` and ``spare_gain`` for each,
    asked after the others, are a cold searcher's for that layout alone."""
    warm = searcher(0)
    groups = warm.space.groups((TypeChoice("chip-a", 2), TypeChoice("chip-b", 2)))
    (ka, ga), (kb, gb) = sorted(groups.items(), key=lambda kv: -warm.space.memory_gib(kv[0]))
    zd = warm.space.zero_degree(1)
    n = data.draw(st.integers(2, min(4, len(ga))))
    template = (ka,) * n + (kb,)
    choice = warm.space.choices[0]
    split = warm.space.fast_split(template, zd, choice)
    assert split is not None
    layouts = [PipelineLayout(tuple(data.draw(st.permutations(ga))[:n]) + (gb[data.draw(st.integers(0, len(gb) - 1))],))
               for _ in range(3)]
    m = data.draw(st.sampled_from([n + 1, 16, 32]))
    proxy = data.draw(st.floats(1.0, 100.0))
    def prices(s: Searcher, lay: PipelineLayout) -> tuple:
        return s.pricer.spare_room(lay, zd, split, choice, m), s.pricer.spare_gain(lay, zd, split, choice, m, proxy)

    warm_prices = [prices(warm, lay) for lay in layouts]
    for lay, got in zip(layouts, warm_prices):
        cold = searcher(0)
        assert got == prices(cold, lay)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_cached_bare_pipelines_are_the_layouts_own(data: st.DataObject) -> None:
    """``ExactPricer.bare_pipeline`` is cached per (layout, split, count, schedule): after pricing other layouts,
    counts and schedules, a warm searcher's pipeline (and the costed one ``_pipeline`` builds on it) equals a
    cold searcher's for the same arguments alone."""
    warm = searcher(data.draw(st.sampled_from([0, 2])))
    case = 0 if warm.space.cluster.name == "h2-example" else 2
    both = tuple(TypeChoice(t, 2) for t in sorted(warm.space.cluster.device_types))
    (ka, ga), (kb, gb) = sorted(warm.space.groups(both).items(), key=lambda kv: -warm.space.memory_gib(kv[0]))
    n = data.draw(st.integers(1, min(4, len(ga))))
    template = (ka,) * n + (kb,)
    asks = []
    for _ in range(4):
        choice = data.draw(st.sampled_from(warm.space.choices))
        split = warm.space.fast_split(template, warm.space.zero_degree(1), choice)
        if split is None:
            continue
        lay = PipelineLayout(tuple(data.draw(st.permutations(ga))[:n]) + (gb[data.draw(st.integers(0, len(gb) - 1))],))
        asks.append((lay, split, data.draw(st.sampled_from([n + 1, 16, 32])), choice))
    got = [(warm.pricer.bare_pipeline(*a), warm.pricer.pipeline(*a)) for a in asks + asks[::-1]]
    for a, (bare, costed) in zip(asks + asks[::-1], got):
        cold = searcher(case)
        assert bare == cold.pricer.bare_pipeline(*a)
        assert costed == cold.pricer.pipeline(*a)
