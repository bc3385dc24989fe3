"""The search's pruning is exact: what it leaves unpriced could not have changed a plan."""

from __future__ import annotations

import dataclasses
import time

import pytest
from test_search_exhaustive import CASES, TINY

from planner.api import PlanSettings, plan
from planner.cost import CostModel
from planner.schedule_choice import spare_activation_limits
from planner.search import Searcher
from planner.simulate import simulate, simulated_step_time
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model


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


@pytest.mark.parametrize("case", range(len(CASE_LIST)))
def test_simulated_step_time_is_the_simulations(case: int) -> None:
    """The simulator check's short path plays the same step as ``simulate``."""
    cm, settings = CASE_LIST[case]
    result = plan(cm.model, cm.cluster, cm.profiles, dataclasses.replace(settings, simulate_top=2), baselines=False)
    for cand in result.candidates[:3]:
        full = simulate(cm, cand.strategy, settings.global_batch, settings.default_schedule, settings.zero)
        assert simulated_step_time(cm, cand.strategy, settings.default_schedule, settings.zero) == full.step_time_s


def test_raised_limits_never_speed_up_a_plan_whose_slowest_pipeline_keeps_its_own() -> None:
    """What ``ExactPricer.with_spare_limits`` leaves unpriced: where a slowest pipeline gets no raised limits, the
    raised plan's estimate is never below the plan's (so it would not have been taken)."""
    checked = 0
    for cm, settings in CASE_LIST:
        plain = dataclasses.replace(settings, spare_activations=False)
        searcher = Searcher(cm, plain, range(cm.cluster.num_devices), time.perf_counter() + 3600.0)
        for cand in searcher.run():
            zd = searcher.space.zero_degree(len(cand.strategy.pipelines))
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
