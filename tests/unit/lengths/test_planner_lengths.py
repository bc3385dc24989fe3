"""The mixed-length planner (planner/lengths.py): one plan of several strategies whose length ranges cover
[1, max], each fitting memory at its max_seq_len; dispatch's cost model agrees with the planner's; the
baselines' dispatchers and the switching rule obey their rules for every input; the CLI verbs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetu_cli.main import cli
from planner.cost import CostModel
from planner.lengths import (
    LengthSettings,
    context_for,
    length_ranges,
    packed_rows,
    plan_lengths,
    play,
    quadratic_through,
    round_robin,
    stage_seconds,
    strategy_cost,
)
from runtime.documents import SyntheticDocuments, length_distribution
from runtime.torchfree.dispatch import CostModel as TokenCost
from runtime.torchfree.dispatch import PipelineCost, StageCost, dispatch, pipeline_time
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model, load_plan, save_plan, validate_plan

SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MAX_LEN = 256
TOKENS = 2048


@pytest.fixture(scope="module")
def tiny():
    model, cluster = load_model("llama-tiny"), load_cluster("cpu-hetero4")
    profiles = resolve_profiles(cluster.device_types)
    s = LengthSettings(tokens_per_step=TOKENS, max_len=MAX_LEN, sample_steps=6)
    result = plan_lengths(model, cluster, profiles, length_distribution("longtail", MAX_LEN), s)
    return model, cluster, profiles, s, result


def test_quadratic_through_is_exact():
    a, b, c = quadratic_through([3.0, 10.0, 40.0], [2e-3 * x * x + 0.5 * x + 7 for x in (3.0, 10.0, 40.0)])
    assert (a, b, c) == pytest.approx((2e-3, 0.5, 7.0), rel=1e-9)


def test_ranges_cover_one_to_max_and_the_plan_is_valid(tiny, tmp_path):
    model, cluster, _, s, result = tiny
    p = result.to_plan("llama-tiny", "cpu-hetero4")
    assert validate_plan(p, model, cluster, "plan") == []
    tops = [st_.max_seq_len for st_ in p.strategies]
    assert tops == sorted(set(tops)) and tops[-1] == MAX_LEN       # strictly ascending, the last the maximum
    ranges = list(length_ranges(p).values())
    assert ranges[0][0] == 1 and ranges[-1][1] == MAX_LEN
    assert all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:]))   # no gap, no overlap
    assert p.training.tokens_per_step == TOKENS and not p.training.zero
    save_plan(p, tmp_path / "p.yaml")
    back = load_plan(tmp_path / "p.yaml")
    assert back == p


def test_each_strategy_fits_memory_at_its_max_seq_len(tiny):
    model, cluster, profiles, _, result = tiny
    for ls in result.strategies:
        top = ls.max_seq_len
        cm = CostModel(model, cluster, profiles, micro_batch=1, seq_len=top)
        est = cm.estimate(ls.strategy, sum(p.micro_batches for p in ls.strategy.pipelines), "1f1b", False)
        assert est.fits, (ls.name, est.oom_devices)
        assert ls.cost.holds(top)                      # some pipeline's micro-batch holds a document that long
        # and dispatch's budget is the cost model's memory of the strategy alone (a documents run holds only the
        # running strategy's state): one more token per in-flight micro-batch would not fit
        for pipe, pc in zip(ls.strategy.pipelines, ls.cost.pipelines):
            n = len(pipe.stages)
            for k, (st_, sc) in enumerate(zip(pipe.stages, pc.stages)):
                dtype = cluster.device(st_.devices[0]).type
                base = cm.stage_memory(dtype, st_.tp, st_.num_layers, k == 0, k == n - 1, st_.recompute, 0)
                full = cm.stage_memory(dtype, st_.tp, st_.num_layers, k == 0, k == n - 1, st_.recompute, n - k)
                per_token = (full.total - base.total) / ((n - k) * top)
                cap = cluster.device_types[dtype].memory_gib * 2**30
                assert base.total + sc.activation_budget_tokens * per_token <= cap * (1 + 1e-9)
                assert base.total + (sc.activation_budget_tokens + 1) * per_token > cap * (1 - 1e-9)



def test_peak_memory_estimate_is_each_pipeline_at_its_own_capacity(tiny):
    """A plan's ``peak_memory_gib`` is what a device can reach in a documents step: its state plus its
    in-flight micro-batches at its pipeline's capacity (never past its memory), not every pipeline at the
    strategy's longest length."""
    model, cluster, profiles, s, result = tiny
    for ls in result.strategies:
        cm = CostModel(model, cluster, profiles, micro_batch=1, seq_len=ls.max_seq_len)
        want = 0.0
        for pipe, pc in zip(ls.strategy.pipelines, ls.cost.pipelines):
            n = len(pipe.stages)
            for k, st_ in enumerate(pipe.stages):
                dtype = cluster.device(st_.devices[0]).type
                base = cm.stage_memory(dtype, st_.tp, st_.num_layers, k == 0, k == n - 1, st_.recompute, 0)
                full = cm.stage_memory(dtype, st_.tp, st_.num_layers, k == 0, k == n - 1, st_.recompute, n - k)
                per_token = (full.total - base.total) / ((n - k) * ls.max_seq_len)
                used = base.total + min((n - k) * pc.capacity, s.tokens_per_step) * per_token
                assert used <= cluster.device_types[dtype].memory_gib * 2**30 * (1 + 1e-9)
                want = max(want, used)
        assert ls.estimates["peak_memory_gib"] == pytest.approx(want / 2**30, abs=1e-4)


def test_every_switch_between_the_strategies_fits_memory_at_its_staged_peak(tiny):
    """Between two steps a device holds at most the staged switch's peak (runtime/torchfree/elastic/staging.py, real
    fp32 bytes: this cluster prices the model itself), within its memory less the framework's overhead."""
    from itertools import permutations

    from runtime.torchfree.elastic.staging import plan_staged_switch
    from runtime.torchfree.spec import PlanContext
    from runtime.torchfree.spec.handle import StrategyHandle

    model, cluster, profiles, _, result = tiny
    p = result.to_plan("llama-tiny", "cpu-hetero4")
    ctx = PlanContext(p, model, cluster, Path("plan"))
    cm = CostModel(model, cluster, profiles, micro_batch=1, seq_len=MAX_LEN)
    for a, b in permutations(p.strategies, 2):
        for d, peak in plan_staged_switch(StrategyHandle(ctx, a), StrategyHandle(ctx, b)).peak().items():
            dtype = cluster.device(d).type
            overhead = cm.stage_memory(dtype, 1, 1, False, False, False, 0).overhead
            assert peak <= cluster.device_types[dtype].memory_gib * 2**30 - overhead

def test_dispatch_costs_reproduce_the_cost_model(tiny):
    """A micro-batch of one document of s tokens costs, on every stage, what the planner's cost model says."""
    model, cluster, profiles, _, result = tiny
    for ls in result.candidates[:6]:
        cm = CostModel(model, cluster, profiles, micro_batch=1, seq_len=ls.max_seq_len)
        cost = strategy_cost(cm, ls.strategy, ls.max_seq_len)
        for pipe, pc in zip(ls.strategy.pipelines, cost.pipelines):
            for k, sc in enumerate(pc.stages):
                for s in (1, 17, ls.max_seq_len // 3, ls.max_seq_len):
                    assert sc.time([s]) == pytest.approx(stage_seconds(cm, pipe, k, s), rel=1e-6)


def test_the_plan_is_never_worse_than_the_best_single_strategy(tiny):
    *_, result = tiny
    assert result.expected_step_s <= result.single_expected_s * (1 + 1e-12)


def test_play_runs_each_step_on_a_strategy_that_holds_it_deterministically(tiny):
    model, cluster, _, s, result = tiny
    members, switch = context_for(list(result.strategies), model, cluster, s)
    source = SyntheticDocuments(length_distribution("longtail", MAX_LEN), TOKENS, MAX_LEN, 256, 3)
    a = play(members, source.lengths, range(8), switch)
    b = play(members, source.lengths, range(8), switch)
    assert a == b
    by_name = {m.name: m for m in members}
    current = None
    for r in a.steps:                      # the runtime's own dispatch makes the same choice and assignment
        d = dispatch(list(source.lengths(r.step)), [m.cost for m in members], current=current, switch_cost=switch)
        assert (members[d.strategy].name, d.assignment) == (r.strategy, r.assignment)
        assert r.switch_s == d.switch_cost
        current = d.strategy
        assert by_name[r.strategy].cost.holds(r.longest)
        assert r.tokens == TOKENS
        assert r.compute_s == max(r.pipeline_s) and min(r.idle_s) == 0.0
        placed = sorted(d for p in r.assignment.pipelines for mb in p.microbatches for d in mb)
        assert placed == list(range(r.documents))


# ---------------------------------------------------------------------------------------------------------
# Rules for every input


@st.composite
def pipelines(draw) -> PipelineCost:
    n = draw(st.integers(1, 3))
    stages = []
    for k in range(n):
        cost = TokenCost(draw(st.sampled_from([0.0, 1e-3, 1e-2])), draw(st.sampled_from([0.1, 1.0])), 0.0)
        stages.append(StageCost(cost, (n - k) * draw(st.integers(5, 120)), draw(st.sampled_from([0.0, 0.5]))))
    return PipelineCost(tuple(stages))


def check_layout(lengths, pipes, a) -> None:
    placed = sorted(d for ld in a.pipelines for mb in ld.microbatches for d in mb)
    assert placed == list(range(len(lengths)))                       # every document exactly once
    for pipe, ld in zip(pipes, a.pipelines):
        assert all(t <= pipe.capacity for t in ld.tokens)             # memory
        assert ld.time == pipeline_time(pipe.stage_times([[lengths[d] for d in mb] for mb in ld.microbatches]))
    assert a.makespan == max(ld.time for ld in a.pipelines)


@settings(max_examples=60, **SLOW)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40), pipes=st.lists(pipelines(), min_size=1,
                                                                                      max_size=4))
def test_round_robin_places_each_document_once_within_memory(lengths, pipes):
    assume(max(lengths) <= max(p.capacity for p in pipes))
    a = round_robin(lengths, pipes)
    check_layout(lengths, pipes, a)
    assert a == round_robin(list(lengths), list(pipes))              # deterministic


@settings(max_examples=60, **SLOW)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40), pipes=st.lists(pipelines(), min_size=1,
                                                                                      max_size=4),
       weights=st.lists(st.integers(1, 5), min_size=4, max_size=4))
def test_packed_rows_places_each_document_once_within_memory(lengths, pipes, weights):
    row = min(p.capacity for p in pipes)
    assume(max(lengths) <= row)
    deal = packed_rows(row, weights[:len(pipes)])
    a = deal(lengths, pipes)
    check_layout(lengths, pipes, a)
    assert all(t <= row for ld in a.pipelines for t in ld.tokens)
    rows = [len(ld.microbatches) for ld in a.pipelines]              # dealt in proportion to the weights
    w = weights[:len(pipes)]
    assert max(r / x for r, x in zip(rows, w)) - min(r / x for r, x in zip(rows, w)) <= 1.0 / min(w) + 1e-12
    assert a == deal(list(lengths), list(pipes))


# ---------------------------------------------------------------------------------------------------------
# CLI


TINY = ["--model", "llama-tiny", "--cluster", "cpu-hetero4"]


def test_cli_plan_show_simulate(tmp_path: Path):
    out = tmp_path / "lengths.yaml"
    res = CliRunner().invoke(cli, ["plan", *TINY, "--lengths", "longtail", "--tokens-per-step", str(TOKENS),
                                   "-o", str(out), "--format", "json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["output"] == str(out) and report["strategies"][-1]["range"][1] == MAX_LEN
    assert report["expected_step_time_s"] <= report["single_strategy"]["expected_step_time_s"] * (1 + 1e-12)
    res = CliRunner().invoke(cli, ["show", str(out)])
    assert res.exit_code == 0, res.output
    for lo, hi in length_ranges(load_plan(out)).values():
        assert f"serves documents of {lo} to {hi} tokens" in res.output
    trace = tmp_path / "t.json"
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(out), "--lengths", "longtail", "--steps", "5",
                                   "--trace", str(trace), "--format", "json"])
    assert res.exit_code == 0, res.output
    sim = json.loads(res.output)
    assert [s["step"] for s in sim["steps"]] == [1, 2, 3, 4, 5]      # the steps hspmd train --steps 5 runs
    assert sim["total_s"] == pytest.approx(sum(s["time_s"] for s in sim["steps"]))
    assert all(math.isclose(s["compute_s"], max(s["pipeline_s"])) for s in sim["steps"])
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("cat") == "step") == 5
    last = load_plan(out).strategies[-1].name                       # one strategy alone, as train --strategy
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(out), "--lengths", "longtail", "--steps", "3",
                                   "--strategy", last, "--format", "json"])
    assert res.exit_code == 0, res.output
    assert {s["strategy"] for s in json.loads(res.output)["steps"]} == {last}


@pytest.mark.parametrize("args, needle", [
    (["--lengths", "no-such-shape", "--tokens-per-step", "100"], "no-such-shape: lengths: neither a known"),
    (["--lengths", "longtail"], "--tokens-per-step"),
    (["--lengths", "longtail", "--tokens-per-step", "100", "--seq-len", "9999"], "--seq-len"),
    (["--lengths", "longtail", "--tokens-per-step", "100", "--global-batch", "8"], "--global-batch"),
    (["--lengths", "longtail", "--tokens-per-step", "100", "--zero"], "--zero/--no-zero"),
])
def test_cli_plan_lengths_bad_input(args, needle, tmp_path):
    out = tmp_path / "p.yaml"
    res = CliRunner().invoke(cli, ["plan", *TINY, *args, "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert not out.exists()


def test_cli_simulate_lengths_needs_tokens_per_step():
    plan = Path(__file__).resolve().parents[3] / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(plan), "--lengths", "longtail"])
    assert res.exit_code == 2, res.output
    assert "training.tokens_per_step" in res.output


def test_cli_plan_from_a_histogram_file(tmp_path: Path):
    """A histogram whose documents are all short still yields a plan covering [1, max] (the last strategy
    holds the maximum length), and a malformed one is refused with one line naming the field."""
    hist = tmp_path / "h.yaml"
    hist.write_text("scale: tokens\nbins:\n  - {lo: 1, hi: 32, weight: 9}\n  - {lo: 33, hi: 256, weight: 1}\n")
    out = tmp_path / "p.yaml"
    res = CliRunner().invoke(cli, ["plan", *TINY, "--lengths", str(hist), "--tokens-per-step", "1024", "-o", str(out),
                                   "--format", "json"])
    assert res.exit_code == 0, res.output
    ranges = list(length_ranges(load_plan(out)).values())
    assert ranges[0][0] == 1 and ranges[-1][1] == MAX_LEN
    hist.write_text("bins:\n  - {lo: 5, hi: 2, weight: 1}\n")
    res = CliRunner().invoke(cli, ["plan", *TINY, "--lengths", str(hist), "--tokens-per-step", "1024"])
    assert res.exit_code == 2 and "bins[0]" in res.output and "Traceback" not in res.output
