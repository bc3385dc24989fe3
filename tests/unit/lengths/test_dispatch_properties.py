"""Dispatch rules that must hold for every input: each document placed once, memory respected, the modelled
times consistent, deterministic (also in another process), greedy within its stated bound of the ILP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runtime.torchfree.dispatch import (
    CostModel,
    PipelineCost,
    StageCost,
    StrategyCost,
    assign,
    dispatch,
    pipeline_time,
)

REPO = Path(__file__).resolve().parents[3]
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

coef = st.sampled_from([0.0, 0.001, 0.01, 0.05])
cost_models = st.builds(CostModel, coef, st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.sampled_from([0.0, 0.1, 1.0]))


@st.composite
def pipelines(draw, max_stages: int = 3) -> PipelineCost:
    n = draw(st.integers(1, max_stages))
    stages = []
    for k in range(n):
        budget = (n - k) * draw(st.integers(5, 120))
        overhead = draw(st.sampled_from([0.0, 0.0, 0.5, 2.0]))
        stages.append(StageCost(draw(cost_models), budget, overhead))
    return PipelineCost(tuple(stages))


lengths_small = st.lists(st.integers(1, 60), min_size=1, max_size=6)
lengths_large = st.lists(st.integers(1, 60), min_size=1, max_size=40)


def check_valid(lengths, pipes, a) -> None:
    placed = sorted(d for ld in a.pipelines for mb in ld.microbatches for d in mb)
    assert placed == list(range(len(lengths)))                       # every document exactly once
    assert len(a.pipelines) == len(pipes)
    for pipe, ld in zip(pipes, a.pipelines):
        n = len(pipe.stages)
        assert ld.tokens == tuple(sum(lengths[d] for d in mb) for mb in ld.microbatches)
        for k, stage in enumerate(pipe.stages):                       # 1F1B: S - k micro-batches in flight
            assert all(t * (n - k) <= stage.activation_budget_tokens for t in ld.tokens)
        assert all(mb for mb in ld.microbatches)
        times = pipe.stage_times([[lengths[d] for d in mb] for mb in ld.microbatches])
        assert ld.time == pipeline_time(times)
    assert a.makespan == max(ld.time for ld in a.pipelines)
    assert a.gap_bound >= 1.0
    assert a.lower_bound <= a.makespan * (1 + 1e-12)


@settings(max_examples=60, **SLOW)
@given(lengths=lengths_large, pipes=st.lists(pipelines(), min_size=1, max_size=4))
def test_greedy_places_each_document_once_within_memory(lengths, pipes):
    assume(max(lengths) <= max(p.capacity for p in pipes))
    a = assign(lengths, pipes, method="greedy")
    check_valid(lengths, pipes, a)
    assert a == assign(list(lengths), list(pipes), method="greedy")   # deterministic


@settings(max_examples=30, **SLOW)
@given(lengths=lengths_small, pipes=st.lists(pipelines(), min_size=1, max_size=3))
def test_greedy_within_its_bound_of_the_ilp(lengths, pipes):
    assume(max(lengths) <= max(p.capacity for p in pipes))
    g = assign(lengths, pipes, method="greedy")
    e = assign(lengths, pipes, method="ilp")
    check_valid(lengths, pipes, g)
    check_valid(lengths, pipes, e)
    assert e.method == "ilp"
    assert e.makespan <= g.makespan * (1 + 1e-9)                      # the exact one is never worse
    assert e.lower_bound <= e.makespan * (1 + 1e-9)                   # the lower bound is one
    assert g.makespan <= g.gap_bound * e.makespan * (1 + 1e-9)        # greedy within its stated bound


@settings(max_examples=30, **SLOW)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=7), m=st.integers(2, 3), model=cost_models,
       speeds=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=3, max_size=3), related=st.booleans())
def test_lpt_a_priori_bounds_on_classical_cases(lengths, m, model, speeds, related):
    """One stage, no overhead: identical pipelines are P||Cmax (4/3 - 1/(3m)), related ones Q||Cmax (2m/(m+1))."""
    assume(model(1) > 0)
    scale = speeds[:m] if related else [1.0] * m
    pipes = [PipelineCost((StageCost(CostModel(model.a * r, model.b * r, model.c * r), 10**6),)) for r in scale]
    g = assign(lengths, pipes, method="greedy")
    e = assign(lengths, pipes, method="ilp")
    bound = 2 * m / (m + 1) if related and len(set(scale)) > 1 else 4 / 3 - 1 / (3 * m)
    assert g.gap_bound <= bound + 1e-12
    assert g.makespan <= bound * e.makespan * (1 + 1e-9)


@settings(max_examples=25, **SLOW)
@given(lengths=lengths_large, strategies=st.lists(
    st.builds(lambda n, pipes: StrategyCost(f"s{n}", n, tuple(pipes)), st.integers(20, 80),
              st.lists(pipelines(max_stages=2), min_size=1, max_size=3)), min_size=1, max_size=3))
def test_strategy_choice_is_the_cheapest_that_holds(lengths, strategies):
    holds = [s.holds(max(lengths)) for s in strategies]
    assume(any(holds))
    d = dispatch(lengths, strategies, method="greedy")
    assert [p is not None for p in d.predicted] == holds
    cheapest = min(p for p in d.predicted if p is not None)
    assert d.assignment.makespan == cheapest == d.predicted[d.strategy]
    assert d.strategy == next(i for i, p in enumerate(d.predicted) if p == cheapest)
    check_valid(lengths, strategies[d.strategy].pipelines, d.assignment)


CROSS_PROCESS = """
import json, random, sys
from runtime.torchfree.dispatch import CostModel, PipelineCost, StageCost, StrategyCost, dispatch

def instances():
    rng = random.Random(5)
    out = []
    for i in range(12):
        pipes = []
        for _ in range(1 + i % 3):
            n = 1 + int(rng.random() * 3)
            pipes.append(PipelineCost(tuple(
                StageCost(CostModel(rng.random() * 1e-3, rng.random(), rng.random() * 0.1), (n - k) * 200,
                          rng.random() * (i % 2)) for k in range(n))))
        count = 6 if i < 6 else 40
        lengths = [1 + int(rng.random() * 150) for _ in range(count)]
        out.append((lengths, [StrategyCost("a", 100, tuple(pipes)), StrategyCost("b", 200, tuple(pipes[:1]))]))
    return out

result = []
for lengths, strategies in instances():
    d = dispatch(lengths, strategies)
    a = d.assignment
    layout = [list(map(list, p.microbatches)) for p in a.pipelines]
    result.append([d.strategy, a.method, a.makespan, a.gap_bound, layout])
assert not [m for m in ("torch", "planner") if m in sys.modules], "dispatch must stay torch- and planner-free"
print(json.dumps(result))
"""


def test_dispatch_identical_across_processes():
    """Every rank computes dispatch itself: other interpreters with other hash seeds must agree exactly."""
    outs = []
    for hash_seed in ("0", "987654"):
        env = {"PYTHONPATH": str(REPO), "PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"}
        run = subprocess.run([sys.executable, "-c", CROSS_PROCESS], env=env, capture_output=True, text=True,
                             check=True, cwd=REPO)
        outs.append(json.loads(run.stdout))         # stdout is nothing but the JSON (no solver banner)
    assert outs[0] == outs[1]
    assert {r[1] for r in outs[0]} == {"ilp", "greedy"}


def set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]
        yield [[first], *part]


def brute_force(lengths, pipes) -> float:
    """The optimum by enumeration: every pipeline choice per document, every split into micro-batches."""
    best = float("inf")
    n = len(lengths)
    for code in range(len(pipes) ** n):
        owner = [(code // len(pipes) ** d) % len(pipes) for d in range(n)]
        worst = 0.0
        for p, pipe in enumerate(pipes):
            mine = [d for d in range(n) if owner[d] == p]
            options = [pipe.time([[lengths[d] for d in mb] for mb in part]) for part in set_partitions(mine)
                       if all(sum(lengths[d] for d in mb) <= pipe.capacity for mb in part)]
            worst = max(worst, min(options, default=float("inf")))
        best = min(best, worst)
    return best


@settings(max_examples=25, **SLOW)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=5), pipes=st.lists(pipelines(), min_size=1,
                                                                                     max_size=2))
def test_ilp_is_the_optimum_of_pipeline_time(lengths, pipes):
    """The ILP is pipeline_time linearised: its makespan equals the brute-force optimum (within its gap)."""
    opt = brute_force(lengths, pipes)
    assume(opt < float("inf"))
    e = assign(lengths, pipes, method="ilp")
    assert opt * (1 - 1e-12) <= e.makespan <= opt * e.gap_bound * (1 + 1e-12)
    assert e.lower_bound <= opt * (1 + 1e-12)
