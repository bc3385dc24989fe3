"""Raised activation limits (``Pipeline.activation_limits``) on the planner's side: which limits a stage's
free memory allows (``spare_activation_limits``), that the cost model charges and the simulator plays
them, and that the search keeps them only where they pay. Also the gap breakdown (planner/gap.py)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.api import PlanSettings, plan
from planner.baselines import lower_bound, work_seconds
from planner.cost import GIB, CostModel
from planner.gap import CATEGORIES, gap_breakdown
from planner.schedule_choice import ScheduleChoice, refine_limits, spare_activation_limits, stage_layer_ranges
from planner.search import Candidate, auto_families, refined_limits
from planner.simulate import simulate
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.schedule_policies import device_limits
from runtime.torchfree.spec import load_cluster, load_model, validate_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

HEXI = load_cluster("hexiscale-mixed")
L7B = load_model("llama-7b")
CM = CostModel(L7B, HEXI, resolve_profiles(HEXI.device_types), micro_batch=1, seq_len=4096)
# HexiScale's plan: 3 A800 > 3 RTX 4090 > the RTX 3090 pair, whole layers 7/7/7/3/3/3/2.
GROUPS = [(0,), (1,), (2,), (3,), (4,), (5,), (6, 7)]
COUNTS = [7, 7, 7, 3, 3, 3, 2]


def hexi_pipeline(schedule: str = "zb-h1", m: int = 64, limits: tuple[int, ...] | None = None) -> Strategy:
    ranges = stage_layer_ranges(COUNTS, ScheduleChoice(schedule))
    pipe = Pipeline(m, tuple(Stage(g, r) for g, r in zip(GROUPS, ranges)), schedule, activation_limits=limits)
    return Strategy("s", (CM.costed_pipeline(pipe, schedule),))


def test_spare_limits_fill_each_stages_free_memory_exactly() -> None:
    """Each limit is the most activations (at the stage's chunk size) that fit beside its static memory,
    never below the schedule's own bound nor above m: one more would not fit."""
    s = hexi_pipeline()
    limits = spare_activation_limits(CM, s, 0, "zb-h1")
    assert limits is not None
    own = device_limits("zb-h1", 7, 64)
    for k, (st, lim) in enumerate(zip(s.pipelines[0].stages, limits)):
        dtype = HEXI.device(st.devices[0]).type
        first, last = st.layers[0][0] == 0, st.layers[0][1] == L7B.num_layers
        static = CM.device_memory(dtype, st.tp, ((st.num_layers, first, last),), False, 0).total
        per = CM.chunk_activation_bytes(dtype, st.tp, st.num_layers, first, False)
        cap = HEXI.device_types[dtype].memory_gib * GIB
        assert own[k] <= lim <= 64
        if lim > own[k]:
            assert static + lim * per <= cap and (lim == 64 or static + (lim + 1) * per > cap)
    # The RTX 4090 behind the A800s holds 4 under ZB-H1's own bound and has room for one more.
    assert limits[3] == own[3] + 1
    # A pipeline whose stages already hold every activation, or have no room: nothing to raise.
    assert spare_activation_limits(CM, hexi_pipeline("gpipe", m=8), 0, "gpipe") is None


def test_the_estimate_charges_and_the_simulator_plays_the_raised_limits() -> None:
    base = hexi_pipeline()
    limits = spare_activation_limits(CM, base, 0, "zb-h1")
    raised = hexi_pipeline(limits=limits)
    a, b = CM.estimate(base, 64, "1f1b", False), CM.estimate(raised, 64, "1f1b", False)
    assert b.fits and b.step_time_s < a.step_time_s - 0.2    # 14.90 -> 14.65 s: W deferred into the fill
    assert max(CM.pipeline_memory(raised, 0, "zb-h1")[k].total - CM.pipeline_memory(base, 0, "zb-h1")[k].total
               for k in range(7)) > 0                        # ... paid for with memory, charged
    sim = simulate(CM, raised, 64, "1f1b", False)
    assert sim.oom_devices == ()
    assert sim.step_time_s == pytest.approx(b.step_time_s, rel=0.01)
    for rep, lim in zip(sim.stages, limits):
        assert rep.peak_in_flight <= lim


def test_the_search_keeps_raised_limits_only_where_they_pay() -> None:
    res = plan(L7B, HEXI, resolve_profiles(HEXI.device_types),
               PlanSettings(global_batch=64, seq_len=4096, schedule="zb-h1", time_limit_s=120))
    best = res.best
    assert any(p.activation_limits is not None for p in best.strategy.pipelines)
    bare = dataclasses.replace(best.strategy, pipelines=tuple(dataclasses.replace(p, activation_limits=None)
                                                              for p in best.strategy.pipelines))
    cm = CostModel(L7B, HEXI, resolve_profiles(HEXI.device_types), micro_batch=best.micro_batch, seq_len=4096,
                   sequence_parallel=res.settings.sequence_parallel)   # as planned
    assert best.estimate.fits
    assert best.step_time_s < cm.estimate(bare, 64, "zb-h1", True).step_time_s
    assert validate_plan(res.to_plan("llama-7b", "hexiscale-mixed"), L7B, HEXI) == []
    # What `hspmd plan` reports per schedule: the chosen one as planned (its raised limits), the others
    # under their own bounds (the limits were sized for the chosen schedule's memory).
    for pi, options in enumerate(res.schedule_options):
        chosen = next(o for o in options if o.chosen)
        assert chosen.pipeline_s == pytest.approx(best.estimate.pipelines[pi].time_s)
        one_f = next(o for o in options if o.label == "1f1b")
        own = dataclasses.replace(bare.pipelines[pi], schedule="1f1b")
        plain = cm.costed_pipeline(own, "1f1b")
        assert one_f.pipeline_s == pytest.approx(cm.pipeline_step_time(Strategy("o", (plain,)), 0, "1f1b"))


def test_gap_breakdown_accounts_for_every_device_second() -> None:
    """Shares of the devices' capacity over the step (weighted by their best layer rate) sum to 1 with
    the useful work; a device left out is idle for its whole share; a one-pipeline plan has no
    imbalance between pipelines."""
    s = hexi_pipeline()
    est = CM.estimate(s, 64, "1f1b", False)
    lb = lower_bound({1: CM}, tuple(range(HEXI.num_devices)), 64).step_time_s
    g = gap_breakdown(CM, s, est, lb, tuple(range(HEXI.num_devices)), "1f1b")
    assert set(g.losses) == set(CATEGORIES)
    assert g.useful + sum(g.losses.values()) == pytest.approx(1.0)
    assert g.losses["idle_devices"] == 0.0 and g.losses["pipeline_imbalance"] == pytest.approx(0.0)
    assert g.losses["recompute"] == 0.0 and g.losses["fill_drain"] > 0.03 and g.losses["stage_imbalance"] > 0.03
    # The busiest stage (an A800, 64 x 222 ms) idles for the rest of the pipeline's time, every device of
    # the pipeline charged for it at its rate: fill_drain = (T - busiest) / step over the used share.
    pe = est.pipelines[0]
    busiest = 64 * max(sc.time_s for sc in pe.stages)
    rate = {d: 1.0 / work_seconds(CM, HEXI.device(d).type, 3 if d < 6 else 2)[0]["layer"] for d in range(8)}
    assert g.losses["fill_drain"] == pytest.approx((pe.time_s - busiest) / est.step_time_s)
    assert g.per_pipeline[0]["bubble_share"] == pytest.approx(
        sum((pe.time_s - 64 * sc.time_s) * rate[d] for st, sc in zip(s.pipelines[0].stages, pe.stages)
            for d in st.devices) / (pe.time_s * sum(rate.values())))
    assert g.efficiency == pytest.approx(lb / est.step_time_s)
    assert 0.0 <= g.residual < 0.05
    # Two A800s alone: the other six devices idle the whole step, their share of the cluster's rate.
    two = Strategy("two", (CM.costed_pipeline(Pipeline(64, (Stage((0,), (0, 16)), Stage((1,), (16, 32)))), "1f1b"),))
    g2 = gap_breakdown(CM, two, CM.estimate(two, 64, "1f1b", False), lb, tuple(range(HEXI.num_devices)), "1f1b")
    assert g2.losses["idle_devices"] == pytest.approx(sum(rate[d] for d in range(2, 8)) / sum(rate.values()))
    assert g2.useful + sum(g2.losses.values()) == pytest.approx(1.0)


def test_auto_also_searches_the_split_backward_schedules_as_if_fixed() -> None:
    """Under "auto" the search ranks as ZB-H1 and also runs as if ZB-V were fixed, so its best plan is
    never worse than the best plan with either fixed (on cpu-hetero4 / llama-tiny)."""
    assert auto_families(PlanSettings(global_batch=8, seq_len=64, schedule="zb-h1")) == [None]
    fams = auto_families(PlanSettings(global_batch=8, seq_len=64, schedule="auto"))
    assert fams[0] is None and [f[0].name for f in fams[1:]] == ["zb-v"]
    cluster, model = load_cluster("cpu-hetero4"), load_model("llama-tiny")
    profiles = resolve_profiles(cluster.device_types)

    def best(schedule: str) -> float:
        return plan(model, cluster, profiles, PlanSettings(global_batch=8, seq_len=64, schedule=schedule),
                    baselines=False).best.step_time_s

    auto = best("auto")
    assert auto <= min(best("zb-h1"), best("zb-v")) * (1 + 1e-9)


def test_refine_limits_lowers_stages_while_the_price_drops() -> None:
    """Nearest first, one stage and one step at a time, never below the own bound, within the budget."""
    target = (5, 3, 2)
    calls: list[tuple[int, ...]] = []

    def price(lim: tuple[int, ...]) -> float:
        calls.append(lim)
        return float(sum((a - b) ** 2 for a, b in zip(lim, target)))

    got, t = refine_limits(price, (4, 1, 2), (7, 6, 2), max_evaluations=20)
    assert got == target and t == 0.0
    assert all(all(x >= o for x, o in zip(c, (4, 1, 2))) for c in calls)
    got, _ = refine_limits(price, (4, 1, 2), (7, 6, 2), max_evaluations=3)
    assert got == (5, 6, 2)   # 3 prices: the start, then stage 0 at 6 and at 5
    # A price that only grows when a limit is lowered: the raised limits stay.
    assert refine_limits(lambda lim: -float(sum(lim)), (1, 1), (4, 4))[0] == (4, 4)


def test_the_best_plans_limits_are_refined_where_that_pays() -> None:
    """hexiscale-mixed's ZB-H1 plan: raising every stage all the way gives 14.626 s of pipeline; lowering
    single stages' limits (``refined_limits``) finds a faster choice, priced by the same lists."""
    s = hexi_pipeline(limits=spare_activation_limits(CM, hexi_pipeline(), 0, "zb-h1"))
    est = CM.estimate(s, 64, "1f1b", False)
    settings = PlanSettings(global_batch=64, seq_len=4096, schedule="zb-h1", use_zero=False)
    cand = Candidate(s, est, 1, (), "hexi")
    out = refined_limits(CM, settings, cand)
    assert out.step_time_s < cand.step_time_s - 0.05
    lim = out.strategy.pipelines[0].activation_limits
    assert all(a <= b for a, b in zip(lim, s.pipelines[0].activation_limits))
    assert out.estimate.fits
    assert simulate(CM, out.strategy, 64, "1f1b", False).step_time_s == pytest.approx(out.step_time_s, rel=0.01)
