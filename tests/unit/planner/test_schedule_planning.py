"""The planner's side of the pipeline schedules: cost model (B/W split, step time, activation bounds),
the search's schedule choice and its proxy, and what ``hspmd plan`` reports about it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from played_lists import play_actions

from planner.api import PlanSettings, plan
from planner.cost import CostModel, planner_handle, weight_grad_fraction
from planner.report import result_json, schedule_rows
from planner.schedule_choice import AUTO, ScheduleChoice, chunk_sizes, fill_factor, schedule_choices, stage_layer_ranges
from planner.simulate import simulate
from runtime.torchfree.errors import InfeasibleError
from runtime.torchfree.pipeline_schedules import ChunkCost, Costs, build_schedule, step_time
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, chunk_problems, live_activation_limit, schedule_layout
from runtime.torchfree.spec import load_cluster, load_model, load_plan_context, validate_plan
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.io import dump_yaml
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy
from runtime.torchfree.spec.schema import to_data

TINY = load_model("llama-tiny")
CPU4 = load_cluster("cpu-hetero4")
PROFILES = resolve_profiles(CPU4.device_types)
CHOICES = [ScheduleChoice("1f1b"), ScheduleChoice("gpipe"), ScheduleChoice("zb-h1"), ScheduleChoice("interleaved", 2),
           ScheduleChoice("interleaved", 3), ScheduleChoice("zb-v", 2)]


def cost_model(seq_len: int = 64) -> CostModel:
    return CostModel(TINY, CPU4, PROFILES, micro_batch=1, seq_len=seq_len)


def pipeline(choice: ScheduleChoice, counts: list[int], m: int, devices: list[int] | None = None) -> Strategy:
    devices = devices or list(range(len(counts)))
    ranges = stage_layer_ranges(counts, choice)
    return Strategy("s", (Pipeline(m, tuple(Stage((d,), r) for d, r in zip(devices, ranges)), choice.name),))


# -- cost model -------------------------------------------------------------------------------------


def test_weight_grad_fraction_by_flops():
    # A layer: P parameters, hidden h, sequence s. Input gradients 2P + 8hs, weight gradients 2P per token.
    p, h, s = TINY.layer_params(), TINY.hidden_size, 64
    assert weight_grad_fraction(TINY, s, 3, False) == pytest.approx(2 * p / (4 * p + 8 * h * s))
    head = 2 * TINY.vocab_size * h
    with_head = (4 * p + head) / (2 * (4 * p + 8 * h * s) + 2 * head)
    assert weight_grad_fraction(TINY, s, 2, True) == pytest.approx(with_head)
    # Longer sequences: more attention, which has no weights.
    assert weight_grad_fraction(TINY, 256, 1, False) < weight_grad_fraction(TINY, 64, 1, False)


@pytest.mark.parametrize("recompute", [False, True])
def test_chunk_cost_splits_the_profiled_backward(recompute):
    """B and W as the engine runs them: W the FLOP share of the backward compute (the recompute forward
    and TP collectives stay in B); the first chunk's W its whole backward (it has no input gradient); a
    recompute chunk's W a second backward through the graph B kept."""
    cm = cost_model()
    for first, last in ((False, False), (False, True), (True, False)):
        sc = cm.stage("cpu-fast", 1, 3, first, last, recompute)
        cc = cm.chunk_cost("cpu-fast", 1, 3, first, last, recompute)
        assert cc.forward == sc.forward_s and cc.full_backward == sc.backward_s
        recomputed = 3 * cm.layer("cpu-fast", 1, recompute).recompute_s
        compute = sc.compute_s - (sc.forward_s - sc.tp_forward_s) - recomputed
        share = weight_grad_fraction(TINY, 64, 3, last) * compute
        if first:
            assert cc.input_grad < 1e-5 * sc.backward_s
            assert cc.input_grad + cc.weight_grad == pytest.approx(sc.backward_s)
        else:
            assert cc.input_grad == pytest.approx(sc.backward_s - share)
            assert cc.weight_grad == pytest.approx(compute if recompute else share)
            if not recompute:
                assert cc.input_grad + cc.weight_grad == pytest.approx(sc.backward_s)


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.label)
def test_estimate_plays_the_runtime_lists_on_the_op_costs(choice):
    """A pipeline's estimated time is the runtime's own action lists (StrategyHandle.pipeline_schedule)
    played with the cost model's op costs; ``ideal_step_time`` is the list scheduler on those costs."""
    cm = cost_model()
    s = pipeline(choice, [2, 2, 2] if choice.chunks <= 2 else [3, 3], 6)
    n = len(s.pipelines[0].stages)
    est = cm.estimate(s, 6, "1f1b")
    costs = cm.pipeline_costs(s, 0, choice.name)
    runtime = planner_handle(cm, s, 6).pipeline_schedule(0)
    assert est.pipelines[0].time_s == play_actions(runtime, costs)
    assert cm.ideal_step_time(s, 0, "1f1b") == step_time(choice.name, n, 6, choice.chunks, costs)
    assert est.pipelines[0].schedule == choice.name and est.pipelines[0].chunks == choice.chunks
    # Chunk 0 of stage 0 holds layer 0 (the embedding), the chunk with the last layer the head.
    layout = schedule_layout(choice.name, n, choice.chunks)
    assert costs.chunk(0, 0).forward > costs.chunk(layout.device(1), layout.chunk(1)).forward


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(CHOICES), st.integers(1, 4), st.integers(0, 6), st.data())
def test_play_actions_reproduces_the_list_schedulers_timeline(choice, stages, extra, data):
    """Playing a schedule's lists with the costs it was built on gives its own makespan: the player is
    faithful to the timeline the list scheduler simulated (random positive costs, transfers included)."""
    m = stages + extra
    layout = schedule_layout(choice.name, stages, choice.chunks)
    pos = st.floats(0.1, 3.0)
    chunk_costs = tuple(tuple(ChunkCost(data.draw(pos), data.draw(pos), data.draw(pos)) for _ in range(layout.chunks))
                        for _ in range(stages))
    costs = Costs(chunk_costs, tuple(data.draw(st.floats(0.0, 1.0)) for _ in range(layout.num_stages - 1)))
    sched = build_schedule(choice.name, stages, m, choice.chunks, costs)
    assert play_actions(sched, costs) == pytest.approx(sched.makespan, rel=1e-9, abs=1e-9)


def test_zero_bubble_beats_1f1b_on_equal_stages():
    """Two stages on the two cpu-fast devices: ZB-H1 runs W in 1F1B's drain at 1F1B's memory; GPipe keeps
    every micro-batch's activations. (Interleaved halves the fill but pays a stage's fixed time per chunk
    and twice the messages, so on a pipeline this short it need not win: the search compares, it does not
    assume.)"""
    cm = cost_model()
    est = {c.label: cm.estimate(pipeline(c, [3, 3], 8), 8) for c in CHOICES}
    assert est["zb-h1"].pipelines[0].time_s < est["1f1b"].pipelines[0].time_s
    assert est["zb-h1"].memory == est["1f1b"].memory
    assert est["gpipe"].memory[0].activations == pytest.approx(4 * est["1f1b"].memory[0].activations - 3 * (
        est["1f1b"].memory[0].activations - 2 * cm.chunk_activation_bytes("cpu-fast", 1, 3, True, False)))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(CHOICES), st.integers(1, 3), st.integers(0, 5), st.data())
def test_memory_bound_holds_for_the_lists_the_runtime_runs(choice, stages, extra, data):
    """The estimate charges each device ``live_activation_limit`` activations of its largest chunk: never
    less than the peak of the action lists the runtime executes (the simulator's exact figure), equal for
    one chunk when the bound is reached."""
    if stages * choice.chunks > TINY.num_layers:
        return
    m = stages + extra
    counts = [choice.chunks] * stages
    for _ in range(TINY.num_layers - sum(counts)):
        counts[data.draw(st.integers(0, stages - 1))] += 1
    s = pipeline(choice, counts, m)
    cm = cost_model()
    est = cm.estimate(s, m)
    sim = simulate(cm, s, m)
    for k, rep in enumerate(sim.stages):
        assert rep.peak_memory_gib <= est.memory[k].gib * (1 + 1e-12)
        assert rep.peak_in_flight <= live_activation_limit(choice.name, stages, k, m, choice.chunks)
    if choice.chunks == 1:   # one chunk: the bound is reached (equal-shape schedules on these lists)
        top = max(range(stages), key=lambda k: est.memory[k].activations)
        assert sim.stages[top].peak_in_flight == live_activation_limit(choice.name, stages, top, m)


# -- search helpers ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CHOICES), st.lists(st.integers(3, 9), min_size=1, max_size=6))
def test_stage_layer_ranges_form_the_pipeline(choice, counts):
    """The chunks the planner writes are what the plan validator accepts (runtime chunk_problems), each stage
    keeps its layer count, its chunks differ by at most one layer."""
    layout = schedule_layout(choice.name, len(counts), choice.chunks)
    ranges = stage_layer_ranges(counts, choice)
    assert chunk_problems(ranges, sum(counts), layout.placement) == []
    for n, rs in zip(counts, ranges):
        sizes = [b - a for a, b in rs]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and tuple(sizes) == chunk_sizes(n, choice.chunks)


def test_fill_factor_reproduces_the_documented_closed_forms():
    third = (1 / 3, 1 / 3, 1 / 3)
    for s in (2, 4, 6):
        assert fill_factor(ScheduleChoice("1f1b"), s, third)[0] == pytest.approx(1.0)
        assert fill_factor(ScheduleChoice("gpipe"), s, third)[0] == pytest.approx(1.0)
        assert fill_factor(ScheduleChoice("zb-h1"), s, third)[0] == pytest.approx(2 / 3)   # (F + B) / (F + B + W)
        for v in (2, 3):
            assert fill_factor(ScheduleChoice("interleaved", v), s, third)[0] == pytest.approx(1 / v)
        assert fill_factor(ScheduleChoice("zb-v", 2), s, third)[0] < 2 / 3
    # Crossings: S v - 1 boundaries on the loop, the V turns on its last stage without a message.
    assert fill_factor(ScheduleChoice("interleaved", 2), 4, third)[1] == pytest.approx(7 / 3)
    assert fill_factor(ScheduleChoice("zb-v", 2), 4, third)[1] == pytest.approx(2.0)


def test_schedule_choices():
    assert [c.label for c in schedule_choices(AUTO)] == ["1f1b", "interleaved v=2", "zb-h1", "zb-v"]
    assert [c.label for c in schedule_choices("interleaved")] == ["interleaved v=2", "interleaved v=4"]
    assert schedule_choices("gpipe") == (ScheduleChoice("gpipe"),)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_choices("dualpipe")
    assert set(SCHEDULE_NAMES) == {c.name for c in schedule_choices(AUTO)} | {"gpipe"}


# -- the search --------------------------------------------------------------------------------------


def test_auto_schedule_plans_are_valid_and_no_worse_than_1f1b():
    """``auto`` searches 1F1B too, so its best plan is at least as fast by the estimate; every candidate's
    schedule and chunks pass the plan validator, and the report says why each pipeline runs its schedule."""
    kw = dict(global_batch=16, seq_len=256, time_limit_s=60)
    fixed = plan(TINY, CPU4, PROFILES, PlanSettings(**kw))
    auto = plan(TINY, CPU4, PROFILES, PlanSettings(**kw, schedule=AUTO))
    assert auto.best.step_time_s <= fixed.best.step_time_s * (1 + 1e-9)
    assert all(p.schedule is None for c in fixed.candidates for p in c.strategy.pipelines)
    for i in range(len(auto.candidates)):
        p = auto.to_plan("llama-tiny", "cpu-hetero4", i)
        assert validate_plan(p, TINY, CPU4, "plan") == []
    rows = schedule_rows(auto)
    assert len(rows) == len(auto.best.strategy.pipelines)
    for row, pipe in zip(rows, auto.best.strategy.pipelines):
        chosen = [o for o in row["options"] if o["chosen"]]
        assert len(chosen) == 1 and row["chunks"] == pipe.stages[0].chunks
        assert row["reason"].startswith(chosen[0]["schedule"])
        assert chosen[0]["pipeline_s"] == pytest.approx(
            max(pe.time_s for pe, q in zip(auto.best.estimate.pipelines, auto.best.strategy.pipelines) if q is pipe))
    out = result_json(auto, auto.to_plan("llama-tiny", "cpu-hetero4"), None)
    assert out["schedules"] == rows


def test_the_search_respects_each_schedules_activation_bound():
    """Memory between 1F1B's need and GPipe's (m activations per stage) on a two-stage plan: the cost model
    flags GPipe's plan out of memory; a search with GPipe fixed returns only plans that fit under GPipe's
    bound (other layer splits, recompute, more stages) or none, ``auto`` plans that fit, by the estimate
    and by the simulator's peak of the runtime's lists."""
    cm = cost_model(256)
    one, gp = (cm.estimate(pipeline(ScheduleChoice(n), [3, 3], 16), 16) for n in ("1f1b", "gpipe"))
    need_1f1b, need_gpipe = max(m.gib for m in one.memory.values()), max(m.gib for m in gp.memory.values())
    assert need_gpipe > need_1f1b
    cap = (need_1f1b + need_gpipe) / 2
    small = dataclasses.replace(CPU4, device_types={k: dataclasses.replace(v, memory_gib=cap)
                                                    for k, v in CPU4.device_types.items()})
    profiles = resolve_profiles(small.device_types)
    tight = CostModel(TINY, small, profiles, micro_batch=1, seq_len=256)
    assert tight.estimate(pipeline(ScheduleChoice("gpipe"), [3, 3], 16), 16).oom_devices
    assert tight.estimate(pipeline(ScheduleChoice("1f1b"), [3, 3], 16), 16).fits
    for name in ("gpipe", AUTO):
        try:
            res = plan(TINY, small, profiles, PlanSettings(global_batch=16, seq_len=256, micro_batch=1,
                                                           time_limit_s=60, schedule=name, simulate_top=2))
        except InfeasibleError:
            assert name == "gpipe"   # none fits under GPipe's bound; auto has 1F1B's plan at least
            continue
        for c in res.candidates:
            assert c.estimate.fits
            assert max(s.peak_memory_gib for s in simulate(tight, c.strategy, 16, res.settings.default_schedule,
                                                            res.settings.zero).stages) <= cap


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_a_fixed_schedule_runs_every_planned_pipeline(name):
    """``--schedule NAME``: every candidate's pipelines run NAME (chunks as the schedule needs), the plan
    and the baseline plan pass the validator; baselines run the default one-chunk schedule."""
    res = plan(TINY, CPU4, PROFILES, PlanSettings(global_batch=16, seq_len=256, time_limit_s=60, schedule=name))
    default = res.settings.default_schedule
    assert default == (name if name in ("1f1b", "gpipe", "zb-h1") else "1f1b")
    for i, c in enumerate(res.candidates):
        if "baseline" in c.summary:
            continue
        for p in c.strategy.pipelines:
            assert (p.schedule or default) == name
            assert p.stages[0].chunks == schedule_layout(name, len(p.stages), p.stages[0].chunks).chunks
        assert validate_plan(res.to_plan("llama-tiny", "cpu-hetero4", i), TINY, CPU4, "plan") == []
    sym = res.baseline_plan(res.symmetric, "llama-tiny", "cpu-hetero4")
    assert sym is None or validate_plan(sym, TINY, CPU4, "plan") == []


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.label)
def test_a_planned_strategy_is_priced_in_the_order_of_its_op_costs(choice):
    """``with_op_costs``: every stage carries its chunks' ``chunk_cost`` (F, B, W), the pipeline its priced
    boundary transfers; the estimate is the lists the handle builds from those (``build_schedule`` on them,
    B + W fused) played with the priced costs, and the simulator plays the same lists (it adds link
    queues, not less work)."""
    cm = cost_model()
    s = cm.with_op_costs(pipeline(choice, [2, 2, 2] if choice.chunks <= 2 else [3, 3], 6), "1f1b")
    pipe = s.pipelines[0]
    n = len(pipe.stages)
    for stage in pipe.stages:
        want = tuple(cm.chunk_cost(CPU4.device(stage.devices[0]).type, stage.tp, b - a, a == 0,
                                   b == TINY.num_layers, stage.recompute) for a, b in stage.layers)
        assert stage.op_costs == tuple((c.forward, c.input_grad, c.weight_grad) for c in want)
    runtime = planner_handle(cm, s, 6).pipeline_schedule(0)
    costs = cm.pipeline_costs(s, 0, choice.name)
    assert pipe.transfer_costs == costs.boundary and any(t > 0 for t in costs.boundary)
    ordered = Costs(tuple(tuple(ChunkCost(*c) for c in stage.op_costs) for stage in pipe.stages), costs.boundary)
    assert runtime.actions == build_schedule(choice.name, n, 6, choice.chunks, ordered).actions
    est = cm.estimate(s, 6)
    assert est.pipelines[0].time_s == play_actions(runtime, costs)
    assert simulate(cm, s, 6).pipeline_end_s[0] >= est.pipelines[0].time_s * (1 - 1e-9)


def test_the_written_plan_carries_the_op_costs_it_was_priced_with(tmp_path):
    """``to_plan`` (and the baseline's plan): every stage's ``op_costs`` is its chunks' ``chunk_cost``, every
    pipeline's ``transfer_costs`` its priced boundary transfers, through
    the YAML unchanged; each pipeline's estimate is ``play_actions`` of the lists the loaded plan's handle
    builds."""
    res = plan(TINY, CPU4, PROFILES, PlanSettings(global_batch=16, seq_len=256, time_limit_s=60, schedule=AUTO))
    sym = res.baseline_plan(res.symmetric, "llama-tiny", "cpu-hetero4")
    for i, written in [(i, res.to_plan("llama-tiny", "cpu-hetero4", i)) for i in range(len(res.candidates))] + \
            ([(None, sym)] if sym is not None else []):
        est = res.symmetric.estimate if i is None else res.candidates[i].estimate
        cm = CostModel(TINY, CPU4, PROFILES, micro_batch=written.training.micro_batch, seq_len=256)
        path = tmp_path / "plan.yaml"
        path.write_text(dump_yaml(to_data(written)))
        ctx = load_plan_context(path)
        assert ctx.plan == written
        handle = StrategyHandle.of(ctx)
        for pi, pipe in enumerate(handle.strategy.pipelines):
            for stage in pipe.stages:
                assert stage.op_costs == cm.stage_op_costs(stage) and stage.op_costs is not None
            costs = cm.pipeline_costs(handle.strategy, pi, handle.schedule_name(pi))
            assert pipe.transfer_costs == costs.boundary
            assert est.pipelines[pi].time_s == play_actions(handle.pipeline_schedule(pi), costs)


def test_uneven_stages_run_faster_in_the_op_cost_order():
    """Stages whose times the layer counts misjudge (a slow device; the embedding and head on the end stages)
    under ZB-H1: the op-cost order beats the layer-count order on the priced costs, the reason plans carry
    op costs."""
    cm = cost_model()
    plain = pipeline(ScheduleChoice("zb-h1"), [1, 4, 1], 6, devices=[0, 1, 2])
    costed = cm.with_op_costs(plain, "1f1b")
    assert cm.estimate(costed, 6).pipelines[0].time_s < 0.9 * cm.estimate(plain, 6).pipelines[0].time_s
