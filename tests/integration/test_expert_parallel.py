"""Expert parallelism equals the single-device reference: every step's loss, the global gradient norm, the
final parameters and the AdamW moments, over 3 steps.

One strategy of 7 devices: pipeline 0 is an expert-parallel stage of 4 devices holding 3, 1, 2 and 2 of the 8
experts (attention TP-4) followed by a TP-1 stage holding every expert of its layers; pipeline 1 is one
expert-parallel stage of 2 devices holding 5 and 4 experts (expert 4 on both: a replicated expert whose
holders share the senders), so the two pipelines run different EP degrees and the experts' gradients are
summed across the pipelines and the replicas. Top-2 routing with a gated shared expert and a dense layer 0;
dropless and under a capacity factor, under 1F1B, ZB-H1 (split backward) and with recompute. A checkpoint
saved under one placement continues under another.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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


def write_plan(tmp_path: Path, pipelines: list[dict] = PIPELINES, recompute: bool = False, **moe) -> Path:
    model = read_yaml(CONFIGS / "models" / "moe-tiny.yaml")
    model["moe"].update({"num_experts": 8, **moe})
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    plan = {"version": 1, "model": "model.yaml", "cluster": str(CLUSTER),
            "training": {"global_batch": 5, "micro_batch": 1, "seq_len": 16, "schedule": "1f1b", "seed": 7,
                         "optimizer": {"lr": 0.001, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5,
                                       "grad_clip": 1.0}},
            "strategies": [{"name": "ep", "pipelines": [
                {**p, "stages": [{**st, "recompute": recompute} for st in p["stages"]]} for p in pipelines]}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


CASES = [({}, None), ({"capacity_factor": 1.0, "aux_loss_coef": 0.1}, "zb-h1"),
         ({"recompute": True, "capacity_factor": 0.5}, None)]


@pytest.mark.parametrize("moe,schedule", CASES, ids=["dropless", "capacity-zb-h1", "capacity-recompute"])
def test_expert_parallel_plan_matches_single_device_reference(world: EngineWorld, tmp_path: Path, moe: dict,
                                                              schedule: str | None) -> None:
    path = write_plan(tmp_path, **moe)
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, schedule)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=ctx.plan.training.micro_batch)
    check_against_reference(path, results, batches, ref=ref)
    # Each device of an expert-parallel stage keeps its own experts only.
    held = {n for n in results[1].state if ".experts." in n}
    assert held and all(".experts.3." in n for n in held)
