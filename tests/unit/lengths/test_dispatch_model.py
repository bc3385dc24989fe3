"""Dispatch by hand: the pipeline time model, memory capacity, strategy choice, ILP vs LPT on known cases."""

from __future__ import annotations

import pytest

from runtime.torchfree.dispatch import (
    ILP_GAP_BOUND,
    CostModel,
    PipelineCost,
    StageCost,
    StrategyCost,
    assign,
    dispatch,
    lower_bound,
    pipeline_time,
)
from runtime.torchfree.errors import InfeasibleError


def pipe(*stages: tuple[float, float, float, int] | tuple[float, float, float, int, float]) -> PipelineCost:
    return PipelineCost(tuple(StageCost(CostModel(*s[:3]), *s[3:]) for s in stages))


def linear(budget: int = 10**6, b: float = 1.0, h: float = 0.0, stages: int = 1) -> PipelineCost:
    return pipe(*[(0.0, b, 0.0, budget, h)] * stages)


def test_pipeline_time_uniform_is_the_1f1b_formula():
    assert pipeline_time([[1.0, 2.0, 3.0]] * 4) == (4 - 1) * 3.0 + 6.0
    assert pipeline_time([[5.0]] * 3) == 15.0
    assert pipeline_time([]) == 0.0


def test_pipeline_time_varying_microbatches():
    # column sums (4, 3), column maxima (3, 2): stage 0: 4 + 2 = 6, stage 1: 3 + 3 = 6
    assert pipeline_time([[1.0, 2.0], [3.0, 1.0]]) == 6.0
    # bottleneck stage 1 does 10 + 1 + 1; stage 0 fills with its largest micro-batch, 2
    assert pipeline_time([[2.0, 10.0], [1.0, 1.0], [1.0, 1.0]]) == 12.0 + 2.0
    with pytest.raises(ValueError, match="one time per stage"):
        pipeline_time([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="not a time"):
        pipeline_time([[-1.0]])


def test_cost_model_and_capacity():
    m = CostModel(2.0, 3.0, 1.0)
    assert m(10) == 2 * 100 + 30 + 1
    assert CostModel.total([m, CostModel(1.0, 0.0, 0.0), CostModel(0.0, 0.0, 4.0)]) == CostModel(3.0, 3.0, 5.0)
    # 1F1B in-flight micro-batches: 3, 2, 1 -> 1000 // 3, 1000 // 2, 1000
    assert pipe((0, 1, 0, 1000), (0, 1, 0, 1000), (0, 1, 0, 1000)).capacity == 333
    assert pipe((0, 1, 0, 90), (0, 1, 0, 100)).capacity == 45
    p = pipe((1.0, 2.0, 3.0, 100, 0.5), (0.0, 1.0, 0.0, 100))
    assert p.stage_times([[2, 1], [3]]) == [[0.5 + 11 + 6, 3.0], [0.5 + 18, 3.0]]


def test_validation():
    with pytest.raises(ValueError, match="a: must be a finite number >= 0, got -1"):
        CostModel(-1.0)
    with pytest.raises(ValueError, match=r"stages\[0\].activation_budget_tokens: 1 tokens cannot hold"):
        pipe((0, 1, 0, 1), (0, 1, 0, 5))
    with pytest.raises(ValueError, match="pipelines: a strategy needs at least one pipeline"):
        StrategyCost("s", 10, ())
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        assign([3, 0], [linear()])


def test_lpt_classic_example_greedy_vs_exact():
    """Graham's example: LPT 10, optimum 9 (5+4 | 3+3+3) on two identical machines."""
    lengths = [5, 4, 3, 3, 3]
    g = assign(lengths, [linear(), linear()], method="greedy")
    assert g.method == "greedy" and g.makespan == 10.0
    assert sorted(ld.time for ld in g.pipelines) == [8.0, 10.0]
    assert g.lower_bound == 9.0                      # total work 18 over 2 pipelines
    assert g.gap_bound == pytest.approx(10 / 9)      # below LPT's 4/3 - 1/6
    e = assign(lengths, [linear(), linear()], method="ilp")
    assert e.method == "ilp" and e.makespan == 9.0 and e.gap_bound <= ILP_GAP_BOUND
    assert sorted(sorted(d for mb in ld.microbatches for d in mb) for ld in e.pipelines) == [[0, 1], [2, 3, 4]]
    assert assign(lengths, [linear(), linear()]).method == "ilp"             # auto: small -> exact
    assert assign(lengths * 2, [linear(), linear()], exact_max_binaries=64).method == "greedy"


def test_microbatch_overhead_makes_documents_share_a_microbatch():
    # overhead 1 per micro-batch: one micro-batch of 9 tokens costs 10; three alone would cost 12
    p = linear(budget=10, h=1.0)
    for method in ("greedy", "ilp"):
        a = assign([3, 3, 3], [p], method=method)
        assert a.pipelines[0].microbatches == ((0, 1, 2),) and a.makespan == 10.0
    # memory: at most 6 tokens per micro-batch -> two micro-batches, 7 + 4
    small = linear(budget=6, h=1.0)
    for method in ("greedy", "ilp"):
        a = assign([3, 3, 3], [small], method=method)
        assert a.pipelines[0].tokens == (6, 3) and a.makespan == 11.0


def test_two_stages_prefer_separate_microbatches_without_overhead():
    # separate: sums 6, maxima 4 -> 6 + 4 = 10; together: one micro-batch of 6 on both stages -> 12
    p = linear(stages=2)
    for method in ("greedy", "ilp"):
        a = assign([4, 2], [p], method=method)
        assert a.pipelines[0].microbatches == ((0,), (1,)) and a.makespan == 10.0


def test_faster_pipeline_gets_more_work():
    fast, slow = linear(b=1.0), linear(b=3.0)
    for method in ("greedy", "ilp"):
        a = assign([6, 6, 6, 6], [slow, fast], method=method)
        assert [sum(ld.tokens) for ld in a.pipelines] == [6, 18]
        assert a.makespan == 18.0 and a.imbalance == pytest.approx(18.0 / 18.0)
    # related pipelines: total work 24 over speeds 1 + 1/3
    assert lower_bound([6, 6, 6, 6], [slow, fast]) == pytest.approx(24 / (1 + 1 / 3))


def test_quadratic_cost_balances_by_cost_not_tokens():
    # one 8-token document costs 64 + 8; eight 1-token documents cost 8 * 2: the long one goes alone
    p = pipe((1.0, 1.0, 0.0, 10**6))
    a = assign([8] + [1] * 8, [p, p], method="greedy")
    loads = sorted(a.pipelines, key=lambda ld: -ld.time)
    assert [d for mb in loads[0].microbatches for d in mb] == [0]
    assert loads[0].time == 72.0 and loads[1].time == 16.0
    assert a.imbalance == pytest.approx(72.0 / 44.0)


def test_memory_keeps_long_documents_off_small_pipelines():
    big, small = linear(budget=100, b=2.0), linear(budget=5, b=1.0)
    for method in ("greedy", "ilp"):
        a = assign([50, 40, 4, 3], [small, big], method=method)
        on_small = [d for mb in a.pipelines[0].microbatches for d in mb]
        assert set(on_small) <= {2, 3}
    with pytest.raises(InfeasibleError, match=r"document 0 \(200 tokens\) fits no pipeline"):
        assign([200], [small, big])


def test_strategy_choice():
    short = StrategyCost("short", 1000, (linear(b=1.0), linear(b=1.0)))
    long_ = StrategyCost("long", 4000, (linear(b=1.5),))
    d = dispatch([800, 700, 100], [short, long_])
    assert (d.strategy, d.strategy_name) == (0, "short")
    assert d.predicted == (800.0, 1600 * 1.5)
    d = dispatch([3000, 100], [short, long_])
    assert (d.strategy, d.predicted) == (1, (None, 3100 * 1.5))
    # the cheapest eligible wins even when listed second
    d = dispatch([200, 200], [StrategyCost("slow", 4000, (linear(b=5.0),)), short])
    assert d.strategy_name == "short"
    with pytest.raises(InfeasibleError, match=r"longest document \(5000 tokens\): short up to 1000, long up to 4000"):
        dispatch([5000], [short, long_])
    # a strategy whose memory cannot hold the longest document is not eligible either
    tight = StrategyCost("tight", 4000, (linear(budget=500),))
    assert dispatch([900], [tight, long_]).strategy_name == "long"
