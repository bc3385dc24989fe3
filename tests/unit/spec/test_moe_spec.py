"""The ``moe`` block of a model file: each bad figure is one line naming the file and the field path; the
verbs that cannot train a MoE model as planned refuse it in one line (exit 2); plan and simulate price it and say
how."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.io import read_yaml

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY = read_yaml(CONFIGS / "models" / "moe-tiny.yaml")


def problems(tmp_path: Path, **edits) -> list[str]:
    data = {**TINY, **{k: v for k, v in edits.items() if k != "moe"}}
    data["moe"] = {**TINY["moe"], **edits.get("moe", {})}
    data["moe"] = {k: v for k, v in data["moe"].items() if v is not None}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_model(str(path))
    return [line.removeprefix(f"{path}: ") for line in err.value.lines()]


CASES = {
    "top-k": ({"moe": {"top_k": 5}},
              ["moe.top_k: 5 is more than num_experts 4 (a token is routed to top_k distinct experts)"]),
    "experts": ({"moe": {"num_experts": 0, "top_k": 0}},
                ["moe.num_experts: must be in [1, 4096], got 0", "moe.top_k: must be at least 1, got 0"]),
    "dense": ({"moe": {"dense_layers": [0, 6, 0]}},
              ["moe.dense_layers: lists a layer twice"]),
    "beyond": ({"moe": {"dense_layers": [0, 6]}}, ["moe.dense_layers[1]: layer 6 is beyond num_layers 6"]),
    "none routed": ({"moe": {"sparse_step": 7}},
                    ["moe: no layer of 6 is a MoE layer (sparse_step 7, dense_layers [0])"]),
    "gate": ({"moe": {"shared_experts": 0, "shared_ffn_size": None}},
             ["moe.shared_gate: true without shared_experts (it gates their output)"]),
    "load": ({"moe": {"expert_load": [1, 0, 2]}}, ["moe.expert_load: has 3 shares, num_experts is 4"]),
    "load sign": ({"moe": {"expert_load": [1, -1, 2, 0]}}, ["moe.expert_load[1]: must be at least 0, got -1"]),
    "capacity": ({"moe": {"capacity_factor": 0}},
                 ["moe.capacity_factor: must be in (0, num_experts 4] (at num_experts an expert can take every "
                  "token: dropless), got 0"]),
    "rates": ({"moe": {"aux_loss_coef": -1, "bias_update_rate": 2}},
              ["moe.aux_loss_coef: must be in [0, 100], got -1", "moe.bias_update_rate: must be in [0, 1), got 2"]),
    "unknown": ({"moe": {"experts": 8}}, ["moe.experts: unknown key (expected one of: num_experts, top_k, "
                                          "expert_ffn_size, shared_experts, shared_ffn_size, shared_gate, sparse_step, "
                                          "dense_layers, norm_topk_prob, aux_loss_coef, bias_update_rate, "
                                          "capacity_factor, expert_load)"]),
    "dense family": ({"family": "llama"},
                     ["family: llama has no MoE layers; a model with moe is family mixtral, qwen2_moe, qwen3_moe"]),
    "qwen3": ({"family": "qwen3_moe"},
              ["qk_norm: false for family qwen3_moe (q/k norms are Qwen3-MoE's, and it has them)",
               "moe.shared_experts: must be 0 for family qwen3_moe"]),
    "mixtral": ({"family": "mixtral"},
                ["moe.shared_experts: must be 0 for family mixtral",
                 "moe.dense_layers: family mixtral has no dense layers (sparse_step 1, dense_layers [])",
                 "ffn_hidden_size: 128 differs from moe.expert_ffn_size 64 (Mixtral's intermediate_size is its "
                 "experts' width)"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_moe_figures_are_one_line_each(tmp_path: Path, case: str):
    edits, lines = CASES[case]
    assert problems(tmp_path, **edits) == lines


def test_a_moe_family_needs_its_moe_block(tmp_path: Path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in TINY.items() if k != "moe"}))
    with pytest.raises(SpecError) as err:
        load_model(str(path))
    assert err.value.lines() == [f"{path}: moe: missing: family qwen2_moe is a mixture-of-experts decoder"]


def test_experts_over_all_layers_are_bounded(tmp_path: Path):
    assert problems(tmp_path, num_layers=1024, moe={"num_experts": 4096, "dense_layers": [], "top_k": 2}) == [
        "moe.num_experts: 1024 MoE layers of 4096 experts are 4,194,304 experts in all (at most 65,536: every "
        "expert is three tensors of the parameter table)"]


def test_tp_must_split_the_experts(tmp_path: Path):
    model = load_model("moe-tiny")
    assert model.tp_problem(2) is None
    assert model.tp_problem(128) is not None and "moe.expert_ffn_size 64" in model.tp_problem(128)


NOTE = ("note: moe-tiny: moe: MoE layers priced from the dense layer of the same shapes: router, routed and shared "
        "experts as GEMMs at the time per FLOP and per call the profile gives the dense MLP, per device type (fewer "
        "rows per expert assumed as efficient); expert loads even (no moe.expert_load given)")


def test_simulate_prices_it_and_train_names_what_it_cannot_run(tmp_path: Path):
    plan = tmp_path / "plan.yaml"
    plan.write_text((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text().replace("model: llama-tiny",
                                                                                     "model: moe-tiny"))
    res = CliRunner().invoke(cli, ["validate", str(plan)])
    assert res.exit_code == 0, res.output  # the plan itself is well-formed
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(plan)])
    assert res.exit_code == 0, res.output   # priced, saying how
    assert NOTE in res.stderr.splitlines()
    # Aux-loss-free balancing is trained (tests/integration/test_expert_parallel.py); packed documents are not.
    plan.write_text(plan.read_text().replace("  seq_len:", "  tokens_per_step: 512\n  seq_len:"))
    res = CliRunner().invoke(cli, ["train", "--plan", str(plan), "--steps", "1"])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        f"error: {plan}: training.tokens_per_step: a MoE model does not train on packed documents yet (its "
        "load-balancing loss is weighted by fixed micro-batches)"]
