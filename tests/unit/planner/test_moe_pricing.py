"""Mixture-of-experts pricing (planner/costmodel/moe.py) and expert placement (planner/moe_placement.py): the
router's skew matters on expert-parallel stages and not on TP-split ones, a device holds only its experts'
state, the placement follows load and speed, the estimate and the simulator price one rule, and the planner
writes placements that validate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as hs

from hetu_cli.main import cli
from planner.cost import CostModel
from planner.costmodel.moe_gemms import expert_rows, holder_rows
from planner.moe_placement import choose_experts, even_placement, speed_placement
from planner.simulate import simulate
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model, load_plan_context, validate_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

SKEW = (0.4, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05)


def cost_model(model: str = "mixtral-8x7b", cluster: str = "h800-h20-48", skew=None, seq_len: int = 4096,
               capacity: float | None = None) -> CostModel:
    m, c = load_model(model), load_cluster(cluster)
    if skew is not None or capacity is not None:
        m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, expert_load=skew, capacity_factor=capacity))
    return CostModel(m, c, resolve_profiles(c.device_types), micro_batch=1, seq_len=seq_len)


def one_stage(devices, layers: int, experts=None, micro_batches: int = 4) -> Strategy:
    st = Stage(tuple(devices), ((0, layers),), experts=experts)
    return Strategy(name="s", pipelines=(Pipeline(stages=(st,), micro_batches=micro_batches),))


H800S = tuple(range(8))


def test_tp_split_pricing_ignores_skew_but_not_the_capacity_cut():
    split = Stage(H800S, ((0, 32),))   # no experts: each expert split over the TP group

    def time_s(cm: CostModel) -> float:
        return cm.stage_chunk(split, 0)[0].time_s

    even, skewed = cost_model(), cost_model(skew=SKEW)
    assert time_s(skewed) == pytest.approx(time_s(even))
    # A capacity factor of 1 drops the hot expert's overflow: fewer rows computed.
    assert time_s(cost_model(skew=SKEW, capacity=1.0)) < time_s(skewed)
    # Expert-parallel, the skew shows.
    assert skewed.ep_reference("H800", 8).time_s > even.ep_reference("H800", 8).time_s


def test_a_load_balancing_placement_beats_even_placement_under_skew():
    cm = cost_model(skew=SKEW)
    st = Stage(H800S, ((0, 32),))
    even = cm.ep_of(dataclasses.replace(st, experts=even_placement(H800S, 8)))
    # 64 micro-batches a step: replicating the hot expert pays for its replicas' gradient all-reduce.
    place = speed_placement(cm, st, dict.fromkeys(H800S, 8), micro_batches=64)
    placed = cm.ep_of(dataclasses.replace(st, experts=place))
    assert len(dataclasses.replace(st, experts=place).expert_holders(0)) > 1   # the hottest expert replicated
    assert max(placed.expert_s.values()) < max(even.expert_s.values())
    assert placed.time_s < even.time_s
    # One micro-batch a step: the replicas' all-reduce would cost more than they save.
    once = dataclasses.replace(st, experts=speed_placement(cm, st, dict.fromkeys(H800S, 8), micro_batches=1))
    assert all(len(once.expert_holders(e)) == 1 for e in range(8))
    # Under an even router both placements give every device its eighth of the rows.
    flat = cost_model()
    ep = flat.ep_of(dataclasses.replace(st, experts=speed_placement(flat, st, dict.fromkeys(H800S, 8))))
    assert set(round(r) for r in ep.rows.values()) == {4096 * 2 // 8}


def test_speed_aware_placement_gives_the_faster_type_more_rows():
    cm = cost_model()
    devices = (0, 1, 2, 3, 16, 17, 18, 19)   # 4 H800, 4 H20 (two nodes)
    st = Stage(devices, ((0, 32),))
    place = speed_placement(cm, st, dict.fromkeys(devices, 8), micro_batches=64)
    ep = cm.ep_of(dataclasses.replace(st, experts=place))
    even = cm.ep_of(dataclasses.replace(st, experts=even_placement(devices, 8)))
    assert sum(ep.rows[d] for d in devices[:4]) > sum(ep.rows[d] for d in devices[4:])
    assert max(ep.expert_s.values()) < max(even.expert_s.values())
    assert all(place[d] for d in devices)   # every device holds one at least (validation's rule)


def test_alike_devices_tied_at_the_slowest_are_relieved_together():
    """moe-tiny's 4 experts over 2 emulated A800 and 2 H20 at Mixtral's shapes: longest processing time first
    gives each device one, and the two H20s tie at the slowest, so no single move shortens the stage; one
    replica onto an A800 for each H20 together does."""
    cm = cost_model(model="moe-tiny", cluster="cpu-hetero4-sleep-moe", seq_len=64)
    devices = (0, 1, 2, 3)   # 2 A800, 2 H20
    st = Stage(devices, ((0, 6),))
    place = speed_placement(cm, st, dict.fromkeys(devices, 4), micro_batches=8)
    ep = cm.ep_of(dataclasses.replace(st, experts=place))
    even = cm.ep_of(dataclasses.replace(st, experts=even_placement(devices, 4)))
    assert max(ep.expert_s.values()) < 0.9 * max(even.expert_s.values())
    assert ep.rows[2] < even.rows[2] and ep.rows[3] < even.rows[3]   # both H20s relieved
    assert sum(len(place[d]) for d in devices) > 4                    # by replicas


def test_an_expert_parallel_device_holds_only_its_experts_state():
    cm = cost_model("qwen1.5-moe-a2.7b")
    model = cm.model
    devices = H800S
    place = {d: list(range(d * 7, d * 7 + 7)) for d in devices}   # 56 experts, 7 each ...
    place[0] = place[0] + [56, 57, 58]    # ... device 0 three more, device 1 one more
    place[1] = place[1] + [59]
    est = cm.estimate(one_stage(devices, model.num_layers, place), 4)
    mem0, mem1, mem2 = (est.memory[d] for d in (0, 1, 2))
    per_expert = model.num_layers * 3 * model.hidden_size * model.moe.expert_ffn_size
    mem = cm.profiles["H800"].memory
    assert mem0.params - mem2.params == pytest.approx(3 * per_expert * mem.param_bytes)
    assert mem1.params - mem2.params == pytest.approx(per_expert * mem.param_bytes)
    assert mem0.optimizer - mem2.optimizer == pytest.approx(3 * per_expert * mem.optimizer_bytes)
    # TP-split: every device its 1/8 of every expert, all alike.
    split = cm.estimate(one_stage(devices, model.num_layers), 4)
    assert len({round(split.memory[d].params) for d in devices}) == 1


def test_the_estimate_and_the_simulator_price_expert_parallel_stages_alike():
    cm = cost_model(skew=SKEW)
    for place in (even_placement(H800S, 8), speed_placement(cm, Stage(H800S, ((0, 32),)), dict.fromkeys(H800S, 8))):
        strategy = cm.with_op_costs(one_stage(H800S, 32, place), "1f1b")
        est = cm.estimate(strategy, 4)
        sim = simulate(cm, strategy, 4, "1f1b", 0)
        assert sim.step_time_s == pytest.approx(est.step_time_s, rel=0.02)


@settings(max_examples=40, deadline=None)
@given(n=hs.integers(1, 8), experts=hs.integers(1, 12), data=hs.data())
def test_every_routed_row_lands_on_a_holder(n: int, experts: int, data):
    """Whatever the placement, the rows the holders receive add up to the routed rows, expert by expert."""
    devices = tuple(range(n))
    place = {d: [] for d in devices}
    for e in range(experts):
        for d in data.draw(hs.sets(hs.sampled_from(devices), min_size=1)):
            place[d].append(e)
    rows = tuple(float(data.draw(hs.integers(0, 1000))) for _ in range(experts))
    got = holder_rows(devices, place, rows)
    for e in range(experts):
        assert sum(got[d].get(e, 0.0) for d in devices) == pytest.approx(rows[e])


def test_expert_rows_follow_the_load_and_the_capacity():
    m = load_model("mixtral-8x7b").moe
    assert sum(expert_rows(m, 100)) == pytest.approx(200)
    skewed = dataclasses.replace(m, expert_load=SKEW, capacity_factor=1.0)
    assert max(expert_rows(skewed, 100)) == 25   # ceil(1.0 * 100 * 2 / 8)


def test_the_planner_writes_placements_that_validate(tmp_path: Path):
    cm = cost_model("qwen1.5-moe-a2.7b")
    strategy, choices = choose_experts(cm, one_stage(H800S, cm.model.num_layers), 4, "1f1b", 0)
    assert [c.expert_parallel for c in choices] == [True]   # 60 small experts: TP-split pays 60 calls per rank
    st = strategy.pipelines[0].stages[0]
    assert sorted({e for d in H800S for e in st.experts_of(d)}) == list(range(60))
    assert "expert-parallel" in choices[0].why
    plan = {"version": 1, "model": "qwen1.5-moe-a2.7b", "cluster": "h800-h20-48",
            "training": {"global_batch": 4, "micro_batch": 1, "seq_len": 4096},
            "strategies": [{"name": "s", "pipelines": [{"micro_batches": 4, "stages": [
                {"devices": list(H800S), "layers": [0, cm.model.num_layers],
                 "experts": {d: list(st.experts_of(d)) for d in H800S}}]}]}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    ctx = load_plan_context(str(path))   # validates everything, raising on any problem
    assert validate_plan(ctx.plan, ctx.model, ctx.cluster) == []
    assert ctx.plan.strategies[0].pipelines[0].stages[0].experts == st.experts


def test_dense_models_are_left_alone():
    c = load_cluster("h800-h20-48")
    cm = CostModel(load_model("llama-7b"), c, resolve_profiles(c.device_types), micro_batch=1, seq_len=4096)
    strategy = one_stage(H800S, 32)
    assert choose_experts(cm, strategy, 4, "1f1b", 0) == (strategy, ())


def test_hspmd_plan_prices_a_moe_model_and_says_how(tmp_path: Path):
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(cli, ["plan", "--model", "moe-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8",
                                   "--seq-len", "128", "-o", str(out), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert any(line.startswith("note: moe-tiny: moe: MoE layers priced from the dense layer") for line in
               res.stderr.splitlines())
    report = json.loads(res.stdout)
    assert "experts" in report and report["step_time_s"] > 0
    ctx = load_plan_context(str(out))
    assert validate_plan(ctx.plan, ctx.model, ctx.cluster) == []
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(out)])
    assert res.exit_code == 0, res.output


def test_the_gradient_sync_sums_routers_and_replicas_as_the_annotations_lay_them_out():
    """One pipeline: nothing to sync TP-split; an expert-parallel stage all-reduces its routers' gradients (each
    device routed its own tokens), and a replicated expert's among its holders on top."""
    cm = cost_model()
    assert cm.grad_sync_time(one_stage(H800S, 32)) == 0.0
    single = cm.grad_sync_time(one_stage(H800S, 32, even_placement(H800S, 8)))
    replicated = {**even_placement(H800S, 8), 1: [0, 1]}
    assert 0.0 < single < cm.grad_sync_time(one_stage(H800S, 32, replicated))


def test_hspmd_plan_says_how_each_multi_device_stage_runs_its_experts(tmp_path: Path):
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(cli, ["plan", "--model", "mixtral-8x7b", "--cluster", "h800-h20-48", "--global-batch",
                                   "8", "--seq-len", "4096", "--check-top", "0", "-o", str(out), "--format", "json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    ctx = load_plan_context(str(out))
    assert ctx.plan.training.sequence_parallel   # as for a dense model: expert parallelism runs with it
    stages = {(pi, k): st for s in ctx.plan.strategies for pi, p in enumerate(s.pipelines)
              for k, st in enumerate(p.stages)}
    assert [(e["pipeline"], e["stage"]) for e in report["experts"]] == [k for k, st in stages.items() if st.tp > 1]
    for entry in report["experts"]:
        st = stages[entry["pipeline"], entry["stage"]]
        assert entry["experts"] == ("expert-parallel" if st.expert_parallel else "tp-split")
        assert entry["why"].startswith("expert-parallel: " if st.expert_parallel else "TP-split: ")
        if st.expert_parallel:
            assert sum(v["load"] for v in entry["per_device"].values()) == pytest.approx(1.0, abs=1e-3)


def test_under_sequence_parallelism_a_moe_layer_pays_its_whole_sequence_output():
    """A TP-split MoE block all-reduces its output where the dense MLP reduce-scatters it: one all-gather more
    per direction; expert parallelism, which gathers its token slices instead, does not pay it."""
    cm = cost_model("qwen1.5-moe-a2.7b")
    sp = CostModel(cm.model, cm.cluster, cm.profiles, micro_batch=1, seq_len=4096, sequence_parallel=True)
    plain, sharded = cm.moe_tp_delta("H800", 8), sp.moe_tp_delta("H800", 8)
    ag = sp._tp_allgather("H800", 8, sp.activation_tensor_bytes("H800"))
    assert ag > 0 and plain.tp_forward_s == 0.0 and sharded.tp_forward_s == pytest.approx(ag)
    assert sharded.tp_backward_s == pytest.approx(ag) and sharded.forward_s == pytest.approx(plain.forward_s)
    st = Stage(H800S, ((0, cm.model.num_layers),), experts=even_placement(H800S, cm.model.moe.num_experts))
    assert sp.ep_of(st).comm_forward_s == pytest.approx(cm.ep_of(st).comm_forward_s - ag)
    strategy, choices = choose_experts(sp, one_stage(H800S, cm.model.num_layers), 4, "1f1b", 0)
    assert len(choices) == 1 and "sequence parallelism" not in choices[0].why


def test_a_documents_plan_for_a_moe_model_is_refused_in_one_line():
    res = CliRunner().invoke(cli, ["plan", "--model", "qwen1.5-moe-a2.7b", "--cluster", "cpu-hetero4", "--lengths",
                                   "longtail", "--tokens-per-step", "4096"])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines()[-1] == (
        "error: --lengths: qwen1.5-moe-a2.7b: a MoE model is not planned for packed documents (hspmd train does not "
        "run it on them: its load-balancing loss is weighted by fixed micro-batches)")


@settings(max_examples=25, deadline=None)
@given(load=hs.lists(hs.floats(0.01, 1.0), min_size=8, max_size=8), micro_batches=hs.sampled_from([1, 8, 64]),
       devices=hs.sampled_from([H800S[:2], H800S[:4], H800S, (0, 1, 2, 3, 16, 17, 18, 19)]))
def test_the_placement_is_never_slower_than_even_placement(load, micro_batches, devices):
    """Whatever the router's skew and the stage, the speed- and load-aware placement's slowest device finishes
    its experts no later than even placement's, or the step saves the replicas' all-reduce."""
    cm = cost_model(skew=tuple(load))
    st = Stage(devices, ((0, 32),))
    place = speed_placement(cm, st, dict.fromkeys(devices, 8), micro_batches)
    placed = dataclasses.replace(st, experts=place)
    even = dataclasses.replace(st, experts=even_placement(devices, 8))

    def step_share(s: Stage) -> float:
        return micro_batches * 32 * max(cm.ep_of(s).expert_s.values()) + cm.stage_expert_sync(s, router=False)
    assert step_share(placed) <= step_share(even) * (1 + 1e-9)


def test_regrouping_stages_over_nodes_carries_each_rank_s_experts():
    """The node-survivable layout moves TP groups between stages (planner/survival.py): experts follow ranks."""
    from planner.survival import spread_over_nodes

    c = load_cluster("h800-h20-48")
    moving = tuple(range(24, 28))   # pipeline 0's second stage: the first node's second H20 group goes there
    place = {24: [0, 1, 2], 25: [3], 26: [4, 5], 27: [6, 7]}
    pipes = tuple(Pipeline(stages=(Stage(g, ((0, 16),), experts=even_placement(g, 8)),
                                   Stage(h, ((16, 32),), experts=place if h == moving else even_placement(h, 8))),
                           micro_batches=2)
                  for g, h in ((tuple(range(16, 20)), moving), (tuple(range(20, 24)), tuple(range(28, 32)))))
    spread = spread_over_nodes(Strategy(name="s", pipelines=pipes), c)
    assert spread.pipelines[0].stages[1].devices != moving
    for before, after in zip((st for p in pipes for st in p.stages),
                             (st for p in spread.pipelines for st in p.stages)):
        assert [after.experts_of(d) for d in after.devices] == [before.experts_of(d) for d in before.devices]


def test_a_stage_across_nodes_and_types_pays_its_slowest_links_and_type():
    """Attention under TP runs at the slowest member's pace, its collectives over the links between nodes."""
    cm = cost_model()
    mixed, h20s = (0, 1, 2, 3, 16, 17, 18, 19), tuple(range(16, 24))
    assert cm.tp_stretch(h20s) == 1.0 < cm.tp_stretch(mixed)
    assert cm.stage_type(Stage(mixed, ((0, 2),), experts=even_placement(mixed, 8))) == "H20"
    across = cm.stage_chunk(Stage(mixed, ((0, 2),), experts=even_placement(mixed, 8)), 0)[0]
    within = cm.stage_chunk(Stage(h20s, ((0, 2),), experts=even_placement(h20s, 8)), 0)[0]
    assert across.tp_forward_s > within.tp_forward_s


def test_the_expert_loads_all_reduce_is_priced_as_the_runtime_lays_it_out():
    """The per-step sum of the routers' loads (runtime/engine/balancing.py): the cost model's groups and bucket
    sizes are the runtime's, and the estimate and the simulator both pay it after the gradient sync."""
    from runtime.engine.balancing import load_entries, load_sync_buckets
    from runtime.torchfree.annotations.from_plan import param_annotations

    cm = cost_model(model="moe-tiny", cluster="h800-h20-48", seq_len=64)
    ep = Stage((0, 1, 2, 3), ((0, 6),), experts={0: [0], 1: [1], 2: [2], 3: [3]})
    tp = Stage((16, 17), ((0, 6),))
    strategy = cm.with_op_costs(Strategy("s", (Pipeline(2, (ep,)), Pipeline(2, (tp,)))), "1f1b")
    runtime = load_sync_buckets(load_entries(cm.model, param_annotations(strategy, cm.model)))
    priced = cm.load_sync_plan(strategy)
    assert [(b.devices, b.numel) for b in runtime] == [(b.devices, b.numel) for g in priced for b in g.buckets]
    assert cm.load_sync_time(strategy) > 0
    est = cm.estimate(strategy, 4)
    assert est.grad_sync_s == pytest.approx(cm.grad_sync_time(strategy) + cm.load_sync_time(strategy))
    assert simulate(cm, strategy, 4).step_time_s == pytest.approx(est.step_time_s, rel=0.05)
    dense = cost_model(model="llama-tiny", cluster="h800-h20-48", seq_len=64)
    assert dense.load_sync_plan(strategy) == [] and dense.load_sync_time(strategy) == 0.0
