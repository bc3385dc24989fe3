"""A mixture-of-experts model trained by the engine equals the single-device reference: every step's loss,
the global gradient norm, the final parameters and the AdamW moments, over 3 steps.

Without expert parallelism: each stage is TP 1 and holds every expert of its MoE layers. The plans cover a
three-stage pipeline (MoE layers on every stage, top-2 routing, a gated shared expert, a dense layer 0, the
load-balancing loss on) beside a second pipeline holding the whole model (data parallelism: the experts'
gradients summed across the pipelines like any duplicated tensor), dropless and under a capacity factor,
under 1F1B and ZB-H1, with and without recompute.
The reference runs the plan's micro-batches (the balance loss and the capacity are per forward). A tiny
Mixtral saved by transformers trains from its weights, saves, and opens in transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from engine_world import EngineWorld
from test_engine_correctness import check_against_reference, make_batches

from runtime.checkpoint import read_saved
from runtime.engine.reference import ReferenceTrainer
from runtime.models.moe import causal_lm
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.io import read_yaml

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


def write_plan(tmp_path: Path, recompute: bool = False, **moe) -> Path:
    model = read_yaml(CONFIGS / "models" / "moe-tiny.yaml")
    model["moe"].update(moe)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    plan = {"version": 1, "model": "model.yaml", "cluster": str(CLUSTER),
            "training": {"global_batch": 5, "micro_batch": 1, "seq_len": 16, "schedule": "1f1b", "seed": 7,
                         "optimizer": {"lr": 0.001, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5,
                                       "grad_clip": 1.0}},
            "strategies": [{"name": "moe", "pipelines": [
                {**p, "stages": [{**st, "recompute": recompute} for st in p["stages"]]} for p in PIPELINES]}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


# (model's moe fields and the stages' recompute, schedule): zero-bubble's split backward computes the
# experts' and routers' weight gradients apart from the input gradients; recompute reruns the routing.
CASES = [({}, None), ({"capacity_factor": 1.0, "aux_loss_coef": 0.1}, None), ({}, "zb-h1"),
         ({"recompute": True, "capacity_factor": 1.0}, None)]


@pytest.mark.parametrize("moe,schedule", CASES, ids=["dropless", "capacity", "dropless-zb-h1", "capacity-recompute"])
def test_moe_plan_matches_single_device_reference(world: EngineWorld, tmp_path: Path, moe: dict,
                                                  schedule: str | None) -> None:
    path = write_plan(tmp_path, **moe)
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, schedule)
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=ctx.plan.training.micro_batch)
    check_against_reference(path, results, batches, ref=ref)


def test_a_transformers_mixtral_trains_from_its_weights_and_exports(world: EngineWorld, tmp_path: Path) -> None:
    """A tiny Mixtral saved by transformers (random weights, the load-balancing loss on) trains under hspmd
    from its weights (experts placed unevenly on an expert-parallel stage), equal to the reference started
    from the same weights; the first step's loss is transformers' on the same batch; the saved directory
    opens in transformers with hspmd's logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=0.02)
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    pretrained = tmp_path / "mixtral"
    hf.save_pretrained(pretrained)
    # Pipeline 0 starts with an expert-parallel stage holding 3 and 1 of the 4 experts.
    pipelines = [{"micro_batches": 3, "stages": [{"devices": [0, 1], "layers": [0, 2],
                                                  "experts": {0: [0, 1, 2], 1: [3]}},
                                                 {"devices": [2], "layers": [2, 4]}]},
                 {"micro_batches": 2, "stages": [{"devices": [3], "layers": [0, 4]}]}]
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "version": 1, "model": str(pretrained), "cluster": str(CLUSTER),
        "training": {"global_batch": 5, "micro_batch": 1, "seq_len": 16, "schedule": "1f1b", "seed": 7,
                     "optimizer": {"lr": 0.001, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5,
                                   "grad_clip": 1.0}},
        "strategies": [{"name": "moe", "pipelines": pipelines}]}, sort_keys=False))
    ctx = load_plan_context(plan)
    assert ctx.model.family == "mixtral" and ctx.model.moe.aux_loss_coef == 0.02
    batches = make_batches(ctx, 2)
    save = tmp_path / "tuned"
    results = world.train(str(plan), batches, load_dir=str(pretrained), save_dir=str(save))
    ref = ReferenceTrainer(ctx.model, ctx.plan.training, micro_batch=1)
    ref.module.load_state_dict(read_saved(pretrained)[0])
    check_against_reference(plan, results, batches, ref=ref, steps=2)
    with torch.no_grad():
        logits = hf.eval()(batches[0][:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batches[0][:, 1:].reshape(-1)).item()
    for dev, r in results.items():
        assert r.losses[0] == pytest.approx(want, rel=1e-5), dev
    saved, meta = read_saved(save)
    assert meta["step"] == "2"
    ours = causal_lm(ctx.model).eval()
    ours.load_state_dict({k: v for k, v in saved.items() if not k.endswith(("exp_avg", "exp_avg_sq"))})
    tokens = batches[1][:, :-1]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(theirs(tokens).logits, hf(tokens).logits)  # it trained
