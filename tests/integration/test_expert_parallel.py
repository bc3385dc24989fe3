"""Expert parallelism equals the single-device reference: every step's loss, the global gradient norm, the
final parameters and the AdamW moments, over 3 steps.

One strategy of 7 devices: pipeline 0 is an expert-parallel stage of 4 devices holding 3, 1, 2 and 2 of the 8
experts (attention TP-4) followed by a TP-1 stage holding every expert of its layers; pipeline 1 is one
expert-parallel stage of 2 devices holding 5 and 4 experts (expert 4 on both: a replicated expert whose
holders share the senders), so the two pipelines run different EP degrees and the experts' gradients are
summed across the pipelines and the replicas. Top-2 routing with a gated shared expert and a dense layer 0;
dropless and under a capacity factor, under 1F1B, ZB-H1 (split backward), with recompute and with ZeRO-1. A checkpoint
saved under one placement continues under another. Aux-loss-free balancing (``bias_update_rate``): the
routers' biases equal the reference's on this plan, on TP-split stages, with recompute, after a checkpoint,
a planned switch and an elastic recovery.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from engine_world import EngineWorld
from test_engine_correctness import check_against_reference, make_batches

from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.io import read_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CLUSTER = Path(__file__).parent / "engine_plans" / "cpu-emu8.yaml"
UNEVEN = {0: [0, 1, 2], 1: [3], 2: [4, 5], 3: [6, 7]}
REPLICATED = {5: [0, 1, 2, 3, 4], 6: [4, 5, 6, 7]}
REPLICATED_45 = {4: [0, 1, 2, 3, 4], 5: [4, 5, 6, 7]}
PIPELINES = [
    {"micro_batches": 3, "stages": [{"devices": [0, 1, 2, 3], "layers": [0, 3], "experts": UNEVEN},
                                    {"devices": [4], "layers": [3, 6]}]},
    {"micro_batches": 2, "stages": [{"devices": [5, 6], "layers": [0, 6], "experts": REPLICATED}]},
]


@pytest.fixture(scope="module")
def world():
    w = EngineWorld(7)
    yield w
    w.close()


def write_plan(directory: Path, pipelines: list[dict] = PIPELINES, recompute: bool = False,
               cluster: str = str(CLUSTER), sequence_parallel: bool = False, seq_len: int = 16, **moe) -> Path:
    """moe-tiny with 8 experts (and ``moe``'s changes) in ``directory``, trained by ``pipelines``."""
    directory.mkdir(parents=True, exist_ok=True)
    model = read_yaml(CONFIGS / "models" / "moe-tiny.yaml")
    model["moe"].update({"num_experts": 8, **moe})
    (directory / "model.yaml").write_text(yaml.safe_dump(model))
    batch = sum(p["micro_batches"] for p in pipelines)
    plan = {"version": 1, "model": "model.yaml", "cluster": cluster,
            "training": {"global_batch": batch, "micro_batch": 1, "seq_len": seq_len, "schedule": "1f1b", "seed": 7,
                         "sequence_parallel": sequence_parallel,
                         "optimizer": {"lr": 0.001, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5,
                                       "grad_clip": 1.0}},
            "strategies": [{"name": "ep", "pipelines": [
                {**p, "stages": [{"recompute": recompute, **st} for st in p["stages"]]} for p in pipelines]}]}
    path = directory / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


CASES = [({}, None, False), ({"capacity_factor": 1.0, "aux_loss_coef": 0.1}, "zb-h1", False),
         ({"recompute": True, "capacity_factor": 0.5}, None, False), ({"capacity_factor": 1.5}, None, True)]


@pytest.mark.parametrize("moe,schedule,zero", CASES,
                         ids=["dropless", "capacity-zb-h1", "capacity-recompute", "capacity-zero1"])
def test_expert_parallel_plan_matches_single_device_reference(world: EngineWorld, tmp_path: Path, moe: dict,
                                                              schedule: str | None, zero: bool) -> None:
    path = write_plan(tmp_path, **moe)
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, schedule, zero=zero)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=ctx.plan.training.micro_batch)
    check_against_reference(path, results, batches, ref=ref)
    # Each device of an expert-parallel stage keeps its own experts only.
    held = {n for n in results[1].state if ".experts." in n}
    assert held and all(".experts.3." in n for n in held)
    check_expert_loads(ctx, results, batches)


def check_expert_loads(ctx, results: dict, batches: list) -> None:
    """Every step's expert loads each device reports for the routers it holds (summed over the devices that
    routed a share: TP ranks once, EP slices and pipelines added) are the single-device run's counts."""
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=ctx.plan.training.micro_batch)
    want = [ref.train_step(b).expert_loads for b in batches]
    assert all(sum(sum(v) for v in step.values()) > 0 for step in want)
    for device, r in results.items():
        assert len(r.expert_loads) == len(want)
        for got, expected in zip(r.expert_loads, want):
            assert got and got == {n: expected[n] for n in got}, device


# Another placement of the same model: pipeline 0 one EP-2 stage (4 experts each), pipeline 1 one TP-1
# device holding every expert.
OTHER = [
    {"micro_batches": 3, "stages": [{"devices": [2, 3], "layers": [0, 6], "experts": {2: [0, 1, 2, 3],
                                                                                     3: [4, 5, 6, 7]}}]},
    {"micro_batches": 2, "stages": [{"devices": [0], "layers": [0, 6]}]},
]


@pytest.mark.parametrize("rate", [0.0, 0.01], ids=["", "balancing"])
def test_a_checkpoint_continues_under_another_placement(world: EngineWorld, tmp_path: Path, rate: float) -> None:
    """Saved after 2 steps under one placement (the full tensors gathered from the experts' holders),
    continued for a step under another: equal to the reference continued, moments included. With
    aux-loss-free balancing the biases are saved with the optimizer's state and loaded under the other
    placement (the expert-parallel stage's routers now on other devices)."""
    from test_engine_correctness import check_saved

    first = write_plan(tmp_path / "a", bias_update_rate=rate)
    other = write_plan(tmp_path / "b", OTHER, bias_update_rate=rate)
    ctx = load_plan_context(first)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=1)
    saved = tmp_path / "saved"
    batches = make_batches(ctx, 2)
    check_against_reference(first, world.train(str(first), batches, save_dir=str(saved)), batches, ref=ref, steps=2)
    check_saved(saved, ref, 2)
    batches = make_batches(ctx, 1)
    results = world.train(str(other), batches, load_dir=str(saved), first_step=3)
    check_against_reference(other, results, batches, ref=ref, steps=3)
    if rate:
        check_biases(results, ref)


@pytest.mark.parametrize("rate", [0.0, 0.01], ids=["", "balancing"])
def test_a_killed_device_holding_experts_is_replaced_in_memory(tmp_path: Path, rate: float) -> None:
    """Device 1 holds experts 5-7 of pipeline 0's EP stage and dies in step 3: device 0 takes the whole
    model of pipeline 0 (its missing experts moved from pipeline 1's holders), the step is redone, and the
    run equals the uninterrupted reference (losses, saved parameters and moments; with aux-loss-free
    balancing the routers' biases too, carried to the new layout by the survivors)."""
    from elastic_helpers import assert_matches_reference, fixed_replan, reference, saved_state

    from runtime.elastic.coordinator import ElasticPolicy
    from runtime.launch import Fault, TrainOptions, launch

    cluster = str(Path(__file__).resolve().parents[2] / "configs" / "clusters" / "cpu-hetero4.yaml")
    two = [{"micro_batches": 2, "stages": [{"devices": [2], "layers": [0, 3]}, {"devices": [3], "layers": [3, 6]}]}]
    before = write_plan(tmp_path / "before", [
        {"micro_batches": 2, "stages": [{"devices": [0, 1], "layers": [0, 6],
                                         "experts": {0: [0, 1, 2, 3, 4], 1: [5, 6, 7]}}]}, *two], cluster=cluster,
        bias_update_rate=rate)
    after = write_plan(tmp_path / "after", [
        {"micro_batches": 2, "stages": [{"devices": [0], "layers": [0, 6]}]}, *two], cluster=cluster,
        bias_update_rate=rate)
    steps = 4
    calls: list = []
    options = TrainOptions(plan=before, steps=steps, elastic=True, save_dir=tmp_path / "ck", timeout_s=20.0,
                           heartbeat_timeout_s=3.0, faults=(Fault(device=1, step=3, kind="kill"),))
    summary = launch(options, ElasticPolicy(fixed_replan(after, calls)))
    expected, ref = reference(before, steps, micro_batch=1)
    records = summary.records
    assert [r.step for r in records] == [1, 2, 3, 4] and calls == [(frozenset({1}), "ep")]
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    saved = saved_state(tmp_path / "ck")
    biases = ref.router_biases()
    assert bool(rate) == bool(biases)
    assert not biases or any(bool(b.abs().sum() > 0) for b in biases.values())   # they moved
    for name, want in biases.items():
        torch.testing.assert_close(saved.pop(name), want, rtol=0, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert_matches_reference(saved, ref)


def test_a_planned_switch_carries_the_balancing_biases(tmp_path: Path) -> None:
    """``--switch`` before step 3 from an expert-parallel stage on devices 0 and 1 to device 0 alone (device 1
    idle, its biases lent to the move): the run equals the uninterrupted reference, the biases included."""
    from elastic_helpers import assert_matches_reference, fixed_replan, reference, saved_state

    from runtime.elastic.coordinator import ElasticPolicy
    from runtime.launch import TrainOptions, launch
    from runtime.launch.options import PlannedSwitch

    cluster = str(Path(__file__).resolve().parents[2] / "configs" / "clusters" / "cpu-hetero4.yaml")
    two = [{"micro_batches": 2, "stages": [{"devices": [2], "layers": [0, 3]}, {"devices": [3], "layers": [3, 6]}]}]
    before = write_plan(tmp_path / "before", [
        {"micro_batches": 2, "stages": [{"devices": [0, 1], "layers": [0, 6],
                                         "experts": {0: [0, 1, 2, 3, 4], 1: [5, 6, 7]}}]}, *two], cluster=cluster,
        bias_update_rate=0.01)
    after = write_plan(tmp_path / "after", [
        {"micro_batches": 2, "stages": [{"devices": [0], "layers": [0, 6]}]}, *two], cluster=cluster,
        bias_update_rate=0.01)
    steps = 4
    options = TrainOptions(plan=before, steps=steps, save_dir=tmp_path / "ck", timeout_s=20.0,
                           heartbeat_timeout_s=3.0, switches=(PlannedSwitch(3, after),))
    summary = launch(options, ElasticPolicy(fixed_replan(after, [])))
    expected, ref = reference(before, steps, micro_batch=1)
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    saved = saved_state(tmp_path / "ck")
    biases = ref.router_biases()
    assert any(bool(b.abs().sum() > 0) for b in biases.values())
    for name, want in biases.items():
        torch.testing.assert_close(saved.pop(name), want, rtol=0, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert_matches_reference(saved, ref)


# Sequence parallelism: a TP-split MoE stage (experts split over TP-2) before an expert-parallel TP-2 stage,
# and a TP-2 expert-parallel stage with a replicated expert in the other pipeline.
SEQUENCE_PARALLEL = [
    {"micro_batches": 3, "stages": [{"devices": [0, 1], "layers": [0, 3]},
                                    {"devices": [2, 3], "layers": [3, 6],
                                     "experts": {2: [0, 1, 2], 3: [3, 4, 5, 6, 7]}}]},
    {"micro_batches": 2, "stages": [{"devices": [4, 5], "layers": [0, 6], "experts": REPLICATED_45}]},
]


@pytest.mark.parametrize("schedule", [None, "zb-h1"], ids=["1f1b", "zb-h1"])
def test_moe_layers_under_sequence_parallelism_match_the_reference(world: EngineWorld, tmp_path: Path,
                                                                    schedule: str | None) -> None:
    """Each MoE block takes the gathered sequence and gives back this rank's share; the experts inside it,
    split over TP or placed whole, compute on the whole sequence's tokens."""
    path = write_plan(tmp_path, SEQUENCE_PARALLEL, sequence_parallel=True, capacity_factor=1.5)
    ctx = load_plan_context(path)
    assert ctx.plan.training.sequence_parallel
    batches = make_batches(ctx)
    results = world.train(str(path), batches, schedule)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=ctx.plan.training.micro_batch)
    check_against_reference(path, results, batches, ref=ref)
    check_expert_loads(ctx, results, batches)


def test_experts_split_over_tp_groups_match_the_reference(world: EngineWorld, tmp_path: Path) -> None:
    """Stages without a placement split every expert over their TP group like the dense MLP (columns of
    gate and up, rows of down): TP-2 stages beside a TP-1 stage, ZB-H1, the balance loss on."""
    tp = [{"micro_batches": 3, "stages": [{"devices": [0, 1], "layers": [0, 3]}, {"devices": [4], "layers": [3, 6]}]},
          {"micro_batches": 2, "stages": [{"devices": [5, 6], "layers": [0, 6]}]}]
    path = write_plan(tmp_path, tp, aux_loss_coef=0.1, capacity_factor=1.0)
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, "zb-h1")
    check_against_reference(path, results, batches, ref=ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=1))



def test_the_planner_replans_experts_onto_the_survivors(tmp_path: Path) -> None:
    """``hspmd train --elastic`` on the shipped expert-parallel plan: the slow device holding expert 3 of
    pipeline 0 dies in step 3, the planner prices the MoE model on the survivors and the run goes on equal
    to the uninterrupted reference (losses, saved parameters and moments)."""
    import json
    import subprocess
    import sys

    from elastic_helpers import assert_matches_reference, reference, saved_state


    repo = CONFIGS.parent
    plan = tmp_path / "plan.yaml"   # the shipped plan at the engine tests' eps (fp32 noise below the tolerance)
    plan.write_text((CONFIGS / "plans" / "cpu-hetero4-moe-ep.yaml").read_text().replace("eps: 1.0e-08", "eps: 1.0e-05"))
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", "4",
                           "--elastic", "--kill-device", "2", "--at-step", "3", "--metrics", str(metrics),
                           "--save", str(tmp_path / "ck"), "--timeout", "20", "--no-preplan"],
                          cwd=repo, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert "replan: " in proc.stdout and "recovered from the failure of device(s) 2" in proc.stdout
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    expected, ref = reference(plan, 4, micro_batch=load_plan_context(plan).plan.training.micro_batch)
    steps = [x for x in lines if "event" not in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert [x["loss"] for x in steps] == pytest.approx(expected, rel=1e-5)
    (event,) = [x for x in lines if "event" in x]
    assert event["failed"] == [2] and 2 not in event["devices"]
    assert_matches_reference(saved_state(tmp_path / "ck"), ref)


def check_biases(results: dict, ref: ReferenceTrainer) -> None:
    """Every router's bias (aux-loss-free balancing) on every device holding it equals the reference's, and
    every router is held somewhere; the biases moved."""
    want = ref.router_biases()
    assert want and all(bool(b.abs().sum() > 0) for b in want.values())
    held = set()
    for dev, r in results.items():
        for name, bias in r.biases.items():
            torch.testing.assert_close(torch.from_numpy(bias), want[name], rtol=0, atol=1e-7,
                                       msg=lambda m, n=name, d=dev: f"{n} on device {d}: {m}")
            held.add(name)
    assert held == set(want)


TP_SPLIT = [{"micro_batches": 3, "stages": [{"devices": [0, 1], "layers": [0, 3]}, {"devices": [4], "layers": [3, 6]}]},
            {"micro_batches": 2, "stages": [{"devices": [5, 6], "layers": [0, 6]}]}]
# Recompute on pipeline 0's expert-parallel stage alone: a load counted twice there would weigh its tokens
# twice against pipeline 1's (counting everything twice would move no bias differently).
RECOMPUTED = [{**PIPELINES[0], "stages": [{**PIPELINES[0]["stages"][0], "recompute": True}, PIPELINES[0]["stages"][1]]},
              PIPELINES[1]]
# Recompute on pipeline 0's second stage under ZB-H1: its layers' forward reruns for the input gradient and
# again for the weight gradient (a first stage's backward is one pass).
RECOMPUTED_LATER = [{**PIPELINES[0], "stages": [PIPELINES[0]["stages"][0],
                                                {**PIPELINES[0]["stages"][1], "recompute": True}]}, PIPELINES[1]]
BALANCING = [(PIPELINES, None, False), (TP_SPLIT, None, False), (RECOMPUTED, None, False),
             (RECOMPUTED_LATER, "zb-h1", False), (PIPELINES, "zb-h1", True)]


@pytest.mark.parametrize("pipelines,schedule,zero", BALANCING,
                         ids=["expert-parallel", "tp-split", "ep-recomputed", "ep-recomputed-zb-h1", "ep-zb-h1-zero1"])
def test_aux_loss_free_balancing_matches_the_reference(world: EngineWorld, tmp_path: Path, pipelines: list,
                                                       schedule: str | None, zero: bool) -> None:
    """``bias_update_rate``: each router's load summed over the devices that routed a share of its layer's
    tokens (an expert-parallel stage's slices, both pipelines; a TP-split stage's ranks once), the same bias
    step on every holder; a recomputed forward counts nothing twice; a split backward and ZeRO-1 change
    nothing. Losses, parameters, moments and the biases themselves equal the single-device reference's."""
    path = write_plan(tmp_path, pipelines, bias_update_rate=0.01, capacity_factor=1.0)
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, schedule, zero=zero)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=1)
    check_against_reference(path, results, batches, ref=ref)
    check_biases(results, ref)
