"""The search's pruning is exact: what it leaves unpriced could not have changed a plan."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from test_search_exhaustive import CASES, TINY

from planner.api import PlanSettings, plan
from planner.cost import CostModel
from planner.schedule_choice import spare_activation_limits
from planner.search import EXACT_REALIZED, Searcher
from planner.simulate import simulate, simulated_step_time
from planner.tp_groups import tp_choices
from runtime.profiling.profile import resolve_profiles
from runtime.spec import load_cluster, load_model


def combined(searcher: Searcher) -> tuple[list[str], list]:
    """The types and the ranked combinations ``Searcher.run`` hands to ``_realize_best``."""
    choices = tp_choices(searcher.cluster, searcher.model, searcher.devices)
    types = [t for t, tps in choices.items() if tps]
    single = searcher._single_type_blocks(choices, types)
    best_rate = {t: max((c.rate for c in single[t]), default=0.0) for t in types}
    total = sum(best_rate.values()) or 1.0
    blocks = {frozenset([t]): searcher._keep(single[t], best_rate[t] / total) for t in types}
    blocks.update(searcher._mixed_blocks(choices, types, blocks, best_rate, total))
    return types, searcher.combine(types, blocks)


def cases() -> list[tuple[CostModel, PlanSettings]]:
    out = []
    for cluster, batch in CASES:
        profiles = resolve_profiles(cluster.device_types, include_shipped=False)
        out.append((CostModel(TINY, cluster, profiles, micro_batch=1, seq_len=64),
                    PlanSettings(global_batch=batch, seq_len=64, micro_batch=1, schedule="auto")))
    model, cluster = load_model("llama-7b"), load_cluster("hexiscale-mixed")
    out.append((CostModel(model, cluster, resolve_profiles(cluster.device_types), micro_batch=1, seq_len=4096),
                PlanSettings(global_batch=64, seq_len=4096, schedule="auto")))
    return out


CASE_LIST = cases()


class PriceAll(Searcher):
    """Prices every realized plan before ranking any (the floor of a plan that fits: 0)."""

    def _estimate_floor(self, strategy, proxy):
        return 0.0 if math.isfinite(super()._estimate_floor(strategy, proxy)) else math.inf


@pytest.mark.parametrize("case", range(len(CASE_LIST)))
def test_realized_plans_priced_by_their_floor_are_the_fully_sorted_ones(case: int) -> None:
    """``_realize_best`` prices plans in order of ``_estimate_floor``: the floor never exceeds the estimate
    (inf exactly where the plan does not fit), and the plans it returns are those that pricing every
    plan first gives: the front of all realized plans sorted by their estimate, through the best
    ``EXACT_REALIZED`` and the best one using each type."""
    cm, settings = CASE_LIST[case]
    far = time.perf_counter() + 3600.0
    lazy = Searcher(cm, settings, range(cm.cluster.num_devices), far)
    eager = PriceAll(cm, settings, range(cm.cluster.num_devices), far)
    types, scored = combined(lazy)
    every = []
    for _, combo, alloc in scored:
        strategy, proxy = lazy.draft(combo, alloc)
        floor, cand = lazy._estimate_floor(strategy, proxy), lazy._scored(strategy, proxy)
        assert (cand is None) == (floor == math.inf)
        if cand is not None:
            assert floor <= cand.step_time_s
            every.append(cand.step_time_s)
    got = lazy._realize_best(types, scored)
    want = eager._realize_best(types, scored)
    assert got, "some plan is realized"
    assert [(c.summary, c.step_time_s, combo) for c, combo, _ in got] == \
        [(c.summary, c.step_time_s, combo) for c, combo, _ in want]
    times = [c.step_time_s for c, _, _ in got]
    assert times == sorted(times)
    assert len(got) >= min(EXACT_REALIZED, len(every))


@pytest.mark.parametrize("case", range(len(CASE_LIST)))
def test_simulated_step_time_is_the_simulations(case: int) -> None:
    """The simulator check's short path plays the same step as ``simulate``."""
    cm, settings = CASE_LIST[case]
    result = plan(cm.model, cm.cluster, cm.profiles, dataclasses.replace(settings, simulate_top=2), baselines=False)
    for cand in result.candidates[:3]:
        full = simulate(cm, cand.strategy, settings.global_batch, settings.default_schedule, settings.zero)
        assert simulated_step_time(cm, cand.strategy, settings.default_schedule, settings.zero) == full.step_time_s


def test_raised_limits_never_speed_up_a_plan_whose_slowest_pipeline_keeps_its_own() -> None:
    """What ``Searcher.with_spare_limits`` leaves unpriced: where a slowest pipeline gets no raised limits, the
    raised plan's estimate is never below the plan's (so it would not have been taken)."""
    checked = 0
    for cm, settings in CASE_LIST:
        plain = dataclasses.replace(settings, spare_activations=False)
        searcher = Searcher(cm, plain, range(cm.cluster.num_devices), time.perf_counter() + 3600.0)
        for cand in searcher.run():
            zd = searcher.zero_degree(len(cand.strategy.pipelines))
            pipes = []
            for pi, pipe in enumerate(cand.strategy.pipelines):
                name = pipe.schedule if pipe.schedule is not None else settings.default_schedule
                limits = spare_activation_limits(cm, cand.strategy, pi, name, zd, settings.memory_margin)
                pipes.append(pipe if limits is None else dataclasses.replace(pipe, activation_limits=limits))
            times = [p.time_s for p in cand.estimate.pipelines]
            kept = [a is b for a, b in zip(pipes, cand.strategy.pipelines)]
            if all(kept) or not any(k for k, t in zip(kept, times) if t == max(times)):
                continue
            raised = dataclasses.replace(cand.strategy, pipelines=tuple(pipes))
            est = cm.estimate(raised, settings.global_batch, settings.default_schedule, settings.zero)
            assert not est.fits or est.step_time_s >= cand.step_time_s - 1e-12
            checked += 1
    assert checked, "some plan raises the limits of a pipeline other than its slowest"
