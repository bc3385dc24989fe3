"""A stage's expert placement (``experts:``): parsing, write-back, what each device holds, and every refusal in
one line with its field path (the `hspmd validate` and `hspmd train` reading)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from plan_files import load, problems

from runtime.torchfree.annotations.from_plan import annotate_strategy
from runtime.torchfree.engine.specialize import parameter_shards, stage_role
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.schema import to_data

REPO = Path(__file__).resolve().parents[3]
STAGE = "strategies[0].pipelines[0].stages[0]"


def plan(tmp_path: Path, experts: object, *, num_experts: int = 8, top_k: int = 2, layers: list[int] = (0, 6),
         model: str | None = None, devices: list[int] = (0, 1, 2, 3)) -> dict:
    """moe-tiny with ``num_experts`` experts on cpu-emu8: one pipeline, one stage of ``devices``."""
    spec = yaml.safe_load((REPO / "configs" / "models" / "moe-tiny.yaml").read_text())
    spec["moe"].update(num_experts=num_experts, top_k=top_k)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(spec))
    stages = [{"devices": list(devices), "layers": list(layers), "experts": experts}]
    if layers[1] < 6:
        stages.append({"devices": [7], "layers": [layers[1], 6]})
    return {"version": 1, "model": model or "model.yaml",
            "cluster": str(REPO / "tests" / "integration" / "engine_plans" / "cpu-emu8.yaml"),
            "training": {"global_batch": 2, "micro_batch": 1, "seq_len": 16},
            "strategies": [{"name": "ep", "pipelines": [{"micro_batches": 2, "stages": stages}]}]}


UNEVEN = {0: [0, 1, 2], 1: [3], 2: [4, 5], 3: [6, 7]}


def test_placement_parses_writes_back_and_shards(tmp_path: Path) -> None:
    ctx = load(tmp_path, plan(tmp_path, {3: [6, 7], 0: [0, 1, 2], 2: [4, 5], 1: [3]}))
    stage = ctx.plan.strategies[0].pipelines[0].stages[0]
    assert stage.experts == ((0, (0, 1, 2)), (1, (3,)), (2, (4, 5)), (3, (6, 7)))  # the stage's device order
    assert stage.expert_holders(4) == (2,) and stage.experts_of(3) == (6, 7)
    assert to_data(ctx.plan)["strategies"][0]["pipelines"][0]["stages"][0]["experts"] == UNEVEN
    handle = StrategyHandle.of(ctx)
    ann = annotate_strategy(ctx.plan.strategies[0], ctx.model, ctx.plan.training)
    for device, held in UNEVEN.items():
        role = stage_role(handle, device)
        assert role.experts == tuple(held)
        shards = {s.name: s for s in parameter_shards(ctx.model, role, ann)}
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in shards if ".experts." in n}
        assert experts == set(held)
        # Whole experts; attention split over the stage's 4 devices; the router whole on every device.
        gate = shards[f"model.layers.1.mlp.experts.{held[0]}.gate_proj.weight"]
        assert gate.local_shape == gate.info.shape
        assert shards["model.layers.1.self_attn.q_proj.weight"].local_shape[0] == 64 // 4
        assert shards["model.layers.1.mlp.gate.weight"].local_shape == (8, 64)
    # Gradients: an expert's summed over its holders' shares, the router's over the whole stage.
    assert ann.param("model.layers.1.mlp.gate.weight").grad.layout((8, 64)).is_partial


def test_counts_place_consecutive_experts_in_the_stage_s_device_order(tmp_path: Path) -> None:
    ctx = load(tmp_path, plan(tmp_path, {3: 2, 1: 1, 0: 3, 2: 2}))
    stage = ctx.plan.strategies[0].pipelines[0].stages[0]
    assert stage.experts == ((0, (0, 1, 2)), (1, (3,)), (2, (4, 5)), (3, (6, 7)))
    assert to_data(ctx.plan)["strategies"][0]["pipelines"][0]["stages"][0]["experts"] == UNEVEN  # written as lists


def test_a_replicated_expert_is_partial_over_its_holders(tmp_path: Path) -> None:
    ctx = load(tmp_path, plan(tmp_path, {0: [0, 1, 2, 3], 1: [3, 4, 5, 6, 7]}, devices=[0, 1]))
    ann = annotate_strategy(ctx.plan.strategies[0], ctx.model, ctx.plan.training)
    shape = (64, 64)
    grad = ann.param("model.layers.1.mlp.experts.3.gate_proj.weight").grad.layout(shape)
    assert grad.is_partial and set(grad.by_device) == {0, 1}
    assert not ann.param("model.layers.1.mlp.experts.4.gate_proj.weight").grad.layout(shape).is_partial


def test_refusals_name_the_field(tmp_path: Path) -> None:
    cases = {
        "unheld": (dict(experts={0: [0, 1], 1: [2], 2: [4, 5], 3: [6, 7]}),
                   [f"{STAGE}.experts: leaves expert(s) [3] unheld: every expert needs at least one device"]),
        "unknown device": (dict(experts={**UNEVEN, 9: [1]}),
                           [f"{STAGE}.experts.9: device 9 is not one of the stage's devices [0, 1, 2, 3]"]),
        "unknown expert": (dict(experts={**UNEVEN, 3: [6, 7, 8]}),
                           [f"{STAGE}.experts.3: expert(s) [8] do not exist: moe-tiny has experts 0-7"]),
        "degree": (dict(experts={0: [0, 1], 1: [2], 2: [], 3: [3]}, num_experts=4),
                   [f"{STAGE}.experts: device(s) [2] hold no expert: 4 experts cannot spread over 4 devices without "
                    "replicas (replicate hot experts, or place the experts on fewer devices)"]),
        "no moe layer": (dict(experts=UNEVEN, layers=[0, 1]),
                         [f"{STAGE}.experts: the stage holds no MoE layer of moe-tiny (layers [0, 1))"]),
        "not a list": (dict(experts={0: "3", 1: [0, 1, 2, 3, 4, 5, 6, 7]}),
                       [f"{STAGE}.experts.0: expected a list, got '3' (str)"]),
        "lists and counts": (dict(experts={0: 3, 1: [0, 1, 2, 3, 4, 5, 6, 7]}),
                             [f"{STAGE}.experts: give every device a list or every device a count, not both"]),
        "negative count": (dict(experts={0: -1, 1: 9}, devices=[0, 1]),
                           [f"{STAGE}.experts.0: must be a count of experts in [0, 4096] or a list of expert "
                            "indices, got -1"]),
        "huge count": (dict(experts={0: 10 ** 15, 1: 1}, devices=[0, 1]),
                       [f"{STAGE}.experts.0: must be a count of experts in [0, 4096] or a list of expert indices, "
                        "got 1000000000000000"]),
        "counts short": (dict(experts={0: 3, 1: 1, 2: 2, 3: 1}),
                         [f"{STAGE}.experts: leaves expert(s) [7] unheld: every expert needs at least one device"]),
        "twice": (dict(experts={0: [0, 0], 1: [1, 2, 3, 4, 5, 6, 7]}, devices=[0, 1]),
                  [f"{STAGE}.experts.0: lists expert(s) [0] more than once"]),
    }
    for name, (kwargs, want) in cases.items():
        experts = kwargs.pop("experts")
        got = problems(tmp_path, plan(tmp_path, experts, **kwargs))
        assert got == want, name


def test_a_dense_model_has_no_experts_to_place(tmp_path: Path) -> None:
    data = plan(tmp_path, UNEVEN, model="llama-tiny")
    assert problems(tmp_path, data) == [f"{STAGE}.experts: llama-tiny has no mixture-of-experts layers to place"]


def test_validate_refuses_in_one_line_with_exit_2(tmp_path: Path) -> None:
    data = plan(tmp_path, {0: [0, 1], 1: [2], 2: [4, 5], 3: [6, 7]})
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    run = subprocess.run([sys.executable, "-m", "hetu_cli", "validate", str(tmp_path / "plan.yaml")],
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert lines == [f"error: {tmp_path / 'plan.yaml'}: {STAGE}.experts: leaves expert(s) [3] unheld: every "
                     "expert needs at least one device"]


def test_a_moe_run_switches_only_to_plans_of_its_micro_batch_size(tmp_path: Path) -> None:
    """A switch or replan may change the micro-batch size of a dense model, not of a MoE model: its balance
    loss and capacity are per forward."""
    import pytest

    from runtime.torchfree.elastic.state import check_compatible
    from runtime.torchfree.errors import HspmdError

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = load(tmp_path / "a", plan(tmp_path / "a", UNEVEN))
    data = plan(tmp_path / "b", UNEVEN)
    data["training"]["micro_batch"] = 2
    data["strategies"][0]["pipelines"][0]["micro_batches"] = 1
    two = load(tmp_path / "b", data)
    check_compatible(one, one)
    with pytest.raises(HspmdError, match="training.micro_batch 1 vs 2"):
        check_compatible(one, two)
