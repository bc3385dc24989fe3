"""The planner's cuts that keep its answer: the simulator check plays out only the plans that can still win
(planner/api.py ``simulator_check``, the simulator's ``cutoff``), the layer split's slots are shared between
ZeRO degrees where they are equal (planner/layer_split.py ``slot_costs``), and a time limit returns the best
plan found so far, promptly, saying that the search was cut short."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from planner.api import PlanResult, aligned, plan, simulator_check
from planner.cost import CostModel
from planner.layer_split import slot_costs
from planner.schedule_choice import schedule_choices
from planner.search import Candidate, PlanSettings
from planner.simulate import simulated_step_time
from planner.tp_groups import GroupKind
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model, validate_plan

SETTINGS = PlanSettings(global_batch=32, seq_len=2048, time_limit_s=300, simulate_top=6, top_k=12, schedule="auto")


@pytest.fixture(scope="module")
def unchecked() -> PlanResult:
    """hexiscale-mixed's ranked candidates without the check (plans of alike and unlike pipelines)."""
    c = load_cluster("hexiscale-mixed")
    return plan(load_model("llama-7b"), c, resolve_profiles(c.device_types),
                dataclasses.replace(SETTINGS, simulate_top=0))


def _cms(result: PlanResult) -> dict[int, CostModel]:
    prof = resolve_profiles(result.cluster.device_types)
    return {b: CostModel(result.model, result.cluster, prof, micro_batch=b, seq_len=result.settings.seq_len,
                         sequence_parallel=result.settings.sequence_parallel)
            for b in {c.micro_batch for c in result.candidates}}


def test_the_cutoff_only_stops_steps_that_pass_it(unchecked: PlanResult) -> None:
    cms = _cms(unchecked)
    for cand in unchecked.candidates[:4]:
        args = (cms[cand.micro_batch], cand.strategy, SETTINGS.default_schedule, SETTINGS.zero)
        full = simulated_step_time(*args)
        assert simulated_step_time(*args, cutoff=math.inf) == full
        assert simulated_step_time(*args, cutoff=full) == full                 # a tie is played out
        assert simulated_step_time(*args, cutoff=full * (1 + 1e-6)) == full
        assert simulated_step_time(*args, cutoff=full * (1 - 1e-6)) == math.inf
        assert simulated_step_time(*args, cutoff=full * 0.5) == math.inf


def _full_check(ranked: list[Candidate], cms: dict[int, CostModel], picks: list[Candidate]) -> Candidate:
    """The best by (checked time, estimate) with every pick simulated to the end, ties in pick order."""
    sims = [dataclasses.replace(c, simulated_s=simulated_step_time(cms[c.micro_batch], c.strategy,
                                                                   SETTINGS.default_schedule, SETTINGS.zero))
            for c in picks]
    return min(sims, key=lambda c: (c.checked_s, c.step_time_s))


@pytest.mark.parametrize("top", [1, 3, 6])
def test_the_pruned_check_picks_what_the_full_check_picks(unchecked: PlanResult, top: int) -> None:
    cms = _cms(unchecked)
    ranked = list(unchecked.candidates)
    # Estimates made optimistic for some (as the closed form is for chains of sync waits): the winner
    # then is not the estimate's favourite, and some picks are cut off mid-simulation.
    skewed = [dataclasses.replace(c, estimate=dataclasses.replace(c.estimate, step_time_s=c.step_time_s * f))
              for c, f in zip(ranked, [0.9, 1.0, 0.95, 1.0, 0.97, 1.0, 1.0, 0.99] + [1.0] * len(ranked))]
    for cands in (ranked, sorted(skewed, key=lambda c: c.step_time_s)):
        settings = dataclasses.replace(SETTINGS, simulate_top=top)
        out = simulator_check(cands, cms, settings)
        picks = list(cands[:top])   # as simulator_check picks them (no baselines here)
        picks += [c for c in [c for c in cands if aligned(c.strategy)][:3] if all(c is not p for p in picks)]
        want = _full_check(cands, cms, picks)
        assert out[0].strategy == want.strategy and out[0].simulated_s == want.simulated_s
        # Every candidate is there once; the checked come first, ranked by the worse of the two.
        assert len(out) == len(cands) and all(any(o.strategy is c.strategy for o in out) for c in cands)
        checked = [c for c in out if c.simulated_s is not None]
        assert out[:len(checked)] == checked
        assert [c.checked_s for c in checked] == sorted(c.checked_s for c in checked)
        # A pick left unchecked cannot beat the choice: its estimate or its simulation is above it.
        for c in picks:
            if all(c.strategy is not o.strategy for o in checked):
                sim = simulated_step_time(cms[c.micro_batch], c.strategy, SETTINGS.default_schedule, SETTINGS.zero)
                assert max(c.step_time_s, sim) > out[0].checked_s
        assert simulator_check(cands, cms, settings, workers=2) == out


def test_a_tiny_time_limit_returns_a_valid_plan_promptly() -> None:
    """A large global batch (every schedule lists each of 1024 micro-batches): with a limit of 0.05 s the
    planner stops at the first plan it can return, says which phases it cut, and that plan is valid."""
    c = load_cluster("hexiscale-mixed")
    model = load_model("llama-7b")
    settings = dataclasses.replace(SETTINGS, global_batch=1024, time_limit_s=0.05, simulate_top=8)
    t0 = time.perf_counter()
    result = plan(model, c, resolve_profiles(c.device_types), settings)
    took = time.perf_counter() - t0
    assert result.stats.truncated and result.stats.cut_short
    assert result.candidates and result.best.step_time_s > 0
    assert validate_plan(result.to_plan("llama-7b", "hexiscale-mixed"), model, c, "plan") == []
    assert took < 60, f"{took:.1f} s"


def test_cli_time_limit_says_the_search_was_cut_short(tmp_path) -> None:
    """``hspmd plan --time-limit 1`` on a large batch: a plan written, valid, and the text and the JSON say
    what the limit cut."""
    from click.testing import CliRunner

    from hetu_cli.main import cli

    args = ["plan", "--model", "llama-7b", "--cluster", "hexiscale-mixed", "--global-batch", "1024", "--seq-len",
            "2048", "--time-limit", "1"]
    runner = CliRunner()
    t0 = time.perf_counter()
    res = runner.invoke(cli, [*args, "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 0, res.output
    assert "time limit reached: search cut short" in " ".join(res.output.split())
    assert runner.invoke(cli, ["validate", str(tmp_path / "p.yaml")]).exit_code == 0
    res = runner.invoke(cli, [*args, "--format", "json"])
    assert res.exit_code == 0, res.output
    search = json.loads(res.output)["search"]
    assert search["truncated"] is True and search["cut_short"]
    assert time.perf_counter() - t0 < 120


@hyp_settings(max_examples=25, deadline=None)
@given(degrees=st.lists(st.integers(1, 40), min_size=1, max_size=8), schedule=st.sampled_from(["1f1b", "zb-v"]),
       template=st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=6))
def test_slots_reused_between_zero_degrees_are_the_computed_ones(degrees: list[int], schedule: str,
                                                                 template: list[int]) -> None:
    """``slot_costs`` takes a slot at a ZeRO degree from the degrees around it where those agree: the same
    slots as a cold cost model computes, in whatever order the degrees come (h2-example's chip-b, 32 GB,
    binds memory for llama-13b; recompute and partial tables included)."""
    c = load_cluster("h2-example")
    model = load_model("llama-13b")
    kinds = [GroupKind("chip-a", 2), GroupKind("chip-b", 2), GroupKind("chip-b", 1)]
    warm = CostModel(model, c, resolve_profiles(c.device_types), micro_batch=1, seq_len=4096)
    choice = schedule_choices(schedule)[0]
    for zd in degrees:
        got = slot_costs(warm, tuple(kinds[k] for k in template), zero_degree=zd, schedule=choice)
        cold = CostModel(model, c, resolve_profiles(c.device_types), micro_batch=1, seq_len=4096)
        assert got == slot_costs(cold, tuple(kinds[k] for k in template), zero_degree=zd, schedule=choice)
