"""runtime/checkpoint.py without a world: format checks, and each device reading exactly its shards."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from hetu_cli.main import cli
from runtime.checkpoint import CHECKPOINT_FILE, FORMAT, expected_tensors, load_checkpoint, read_checkpoint_info
from runtime.torchfree.errors import HspmdError, SpecError
from runtime.torchfree.spec import load_plan_context

PLAN = "configs/plans/cpu-hetero4-tiny.yaml"


@pytest.fixture(scope="module")
def ctx(request):
    return load_plan_context(request.config.rootpath / PLAN)


def full_state(ctx) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=g) for n, shape in expected_tensors(ctx.model).items()}


def write(directory, tensors, step="7", fmt=FORMAT):
    directory.mkdir(exist_ok=True)
    save_file(tensors, str(directory / CHECKPOINT_FILE), metadata={"format": fmt, "step": step, "model": "x"})


def test_a_valid_checkpoint_reads_its_step(ctx, tmp_path):
    write(tmp_path / "ck", full_state(ctx))
    info = read_checkpoint_info(tmp_path / "ck", ctx)
    assert info.step == 7 and info.path == tmp_path / "ck" and info.kind == "legacy" and info.moments
    assert set(info.files.values()) == {tmp_path / "ck" / CHECKPOINT_FILE}


def test_missing_or_unreadable_checkpoints_are_one_line_errors(ctx, tmp_path):
    with pytest.raises(HspmdError, match="--load: no such directory"):
        read_checkpoint_info(tmp_path / "nope", ctx)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HspmdError, match=f"no checkpoint in this directory \\(.*{CHECKPOINT_FILE} not found\\)"):
        read_checkpoint_info(tmp_path / "empty", ctx)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / CHECKPOINT_FILE).write_bytes(b"not safetensors at all")
    with pytest.raises(HspmdError, match="not a readable safetensors file"):
        read_checkpoint_info(tmp_path / "bad", ctx)


def test_every_mismatch_is_listed_with_file_and_tensor(ctx, tmp_path):
    state = full_state(ctx)
    del state["lm_head.weight.exp_avg"]
    state["model.norm.weight"] = torch.zeros(3)
    write(tmp_path / "ck", state, step="x", fmt="other")
    with pytest.raises(SpecError) as err:
        read_checkpoint_info(tmp_path / "ck", ctx)
    path = tmp_path / "ck" / CHECKPOINT_FILE
    assert err.value.lines() == [
        f"{path}: metadata.format: expected '{FORMAT}', got 'other'",
        f"{path}: metadata.step: expected a step count, got 'x'",
        f"{path}: model.norm.weight: has shape [3], model llama-tiny needs [64] (saved for model 'x')",
        f"{path}: lm_head.weight.exp_avg: missing (model llama-tiny needs it)",
    ]


def test_cli_refuses_a_bad_load_dir_before_starting_workers(repo, tmp_path):
    res = CliRunner().invoke(cli, ["train", "--plan", str(repo / PLAN), "--load", str(tmp_path / "nope")])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: --load: no such directory"]


@dataclass
class Shard:
    region: tuple[slice, ...]


class FakeProgram:
    """What load_checkpoint needs of a DeviceProgram: what it holds, and a way to take the state."""

    def __init__(self, regions: dict[str, tuple[slice, ...]]) -> None:
        self.regions = regions
        self.loaded: dict[str, torch.Tensor] = {}

    def param_annotations(self):
        return {n: Shard(r) for n, r in self.regions.items()}

    def load_local_state(self, state):
        self.loaded = state


def test_each_device_loads_exactly_the_region_it_holds(ctx, tmp_path):
    state = full_state(ctx)
    write(tmp_path / "ck", state, step="5")
    regions = {"model.layers.2.mlp.down_proj.weight": (slice(0, 64), slice(64, 128)),  # row-parallel TP rank 1
               "model.layers.2.self_attn.q_proj.weight": (slice(32, 64), slice(0, 64)),  # column-parallel rank 1
               "model.norm.weight": (slice(0, 64),)}
    program = FakeProgram(regions)
    assert load_checkpoint(program, tmp_path / "ck", ctx) == 5
    assert float(program.loaded.pop("step")) == 5.0
    assert set(program.loaded) == {n + s for n in regions for s in ("", ".exp_avg", ".exp_avg_sq")}
    for name, region in regions.items():
        for suffix in ("", ".exp_avg", ".exp_avg_sq"):
            assert torch.equal(program.loaded[name + suffix], state[name + suffix][region])


def test_the_routers_biases_are_optimizer_state_and_refuse_an_export(tmp_path):
    """Aux-loss-free balancing: a training checkpoint holds each router's bias in its optimizer file (one
    missing is named), its config.json is the model's Hugging Face view, and ``hspmd export`` refuses it."""
    import dataclasses

    from runtime.checkpoint import checkpoint_info, export_checkpoint, optimizer_tensors, write_checkpoint
    from runtime.torchfree.models.params import llama_parameters, router_biases
    from runtime.torchfree.spec import load_model

    tiny = load_model("moe-tiny")
    model = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, bias_update_rate=0.01))
    biases = router_biases(model)
    assert len(biases) == 5 and all(n.endswith(".mlp.gate.expert_bias") for n in biases)
    weights = {p.name: torch.zeros(p.shape) for p in llama_parameters(model)}
    state = {n: torch.full(s, 0.5) for n, s in optimizer_tensors(model).items()}
    write_checkpoint(tmp_path / "ck", model, weights, moments=state, step=2, saved_by="test")
    info = checkpoint_info(tmp_path / "ck", model)
    assert info.moments and all(info.files[n].name == "optimizer.safetensors" for n in biases)
    with pytest.raises(SpecError, match="expert_bias: missing"):
        write_checkpoint(tmp_path / "short", model, weights, moments={n: t for n, t in state.items()
                                                                       if n not in biases}, step=2, saved_by="test")
        checkpoint_info(tmp_path / "short", model)
    with pytest.raises(HspmdError, match="moe.bias_update_rate: the checkpoint holds the routers' biases"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out")
    assert not (tmp_path / "out").exists()
