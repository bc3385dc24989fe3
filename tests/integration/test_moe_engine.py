"""A mixture-of-experts model trained by the engine equals the single-device reference: every step's loss,
the global gradient norm, the final parameters and the AdamW moments, over 3 steps.

Without expert parallelism: each stage is TP 1 and holds every expert of its MoE layers. The plans cover a
three-stage pipeline (MoE layers on every stage, top-2 routing, a gated shared expert, a dense layer 0, the
load-balancing loss on) beside a second pipeline holding the whole model (data parallelism: the experts'
gradients summed across the pipelines like any duplicated tensor), dropless and under a capacity factor.
The reference runs the plan's micro-batches (the balance loss and the capacity are per forward).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from engine_world import EngineWorld
from test_engine_correctness import check_against_reference, make_batches

from runtime.engine.reference import ReferenceTrainer
from runtime.spec import load_plan_context
from runtime.spec.io import read_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CLUSTER = Path(__file__).parent / "engine_plans" / "cpu-emu8.yaml"
PIPELINES = [
    {"micro_batches": 3, "stages": [{"devices": [0], "layers": [0, 2]}, {"devices": [1], "layers": [2, 4]},
                                    {"devices": [2], "layers": [4, 6]}]},
    {"micro_batches": 2, "stages": [{"devices": [3], "layers": [0, 6]}]},
]


@pytest.fixture(scope="module")
def world():
    w = EngineWorld(4)
    yield w
    w.close()


def write_plan(tmp_path: Path, **moe) -> Path:
    model = read_yaml(CONFIGS / "models" / "moe-tiny.yaml")
    model["moe"].update(moe)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    plan = {"version": 1, "model": "model.yaml", "cluster": str(CLUSTER),
            "training": {"global_batch": 5, "micro_batch": 1, "seq_len": 16, "schedule": "1f1b", "seed": 7,
                         "optimizer": {"lr": 0.001, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5,
                                       "grad_clip": 1.0}},
            "strategies": [{"name": "moe", "pipelines": PIPELINES}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.mark.parametrize("moe", [{}, {"capacity_factor": 1.0, "aux_loss_coef": 0.1}], ids=["dropless", "capacity"])
def test_moe_plan_matches_single_device_reference(world: EngineWorld, tmp_path: Path, moe: dict) -> None:
    path = write_plan(tmp_path, **moe)
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=ctx.plan.training.micro_batch)
    check_against_reference(path, results, batches, ref=ref)
