"""Hugging Face checkpoint directories without a world: sharded writing, per-device slicing, torn saves,
``hspmd export``, and ``hspmd train``'s one-line refusals of Hugging Face inputs it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from test_checkpoint_format import FakeProgram  # the same stand-in DeviceProgram

from hetu_cli.main import cli
from runtime.checkpoint import (
    CHECKPOINT_FILE,
    FORMAT,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    checkpoint_info,
    expected_tensors,
    load_checkpoint,
    read_saved,
    write_checkpoint,
)
from runtime.models.llama import LlamaForCausalLM
from runtime.torchfree.errors import HspmdError, SpecError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_model, load_plan_context

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "tests" / "integration" / "engine_plans" / "cpu-emu8.yaml"
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def model_dir(path: Path, **overrides) -> Path:
    transformers.LlamaConfig(**{**TINY, **overrides}).save_pretrained(path)
    return path


def plan_file(path: Path, model: Path, tp: int = 2, seq_len: int = 8) -> Path:
    path.write_text(f"""version: 1
model: {model}
cluster: {CLUSTER}
training: {{global_batch: 2, micro_batch: 1, seq_len: {seq_len}}}
strategies:
- name: s
  pipelines:
  - micro_batches: 2
    stages:
    - {{devices: {list(range(tp))}, layers: [0, 1]}}
    - {{devices: [{tp}], layers: [1, 3]}}
""")
    return path


def random_state(spec, moments: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    names = expected_tensors(spec) if moments else {p.name: p.shape for p in llama_parameters(spec)}
    return {n: torch.randn(shape, generator=g) for n, shape in names.items()}




REGIONS = {"model.layers.2.mlp.down_proj.weight": (slice(0, 32), slice(32, 64)),  # row-parallel TP rank 1
           "model.layers.0.self_attn.q_proj.weight": (slice(16, 32), slice(0, 32)),  # column-parallel rank 1
           "model.embed_tokens.weight": (slice(0, 32), slice(0, 32)),
           "lm_head.weight": (slice(32, 64), slice(0, 32))}


def test_sharded_save_opens_in_transformers_and_each_device_reads_its_region(tmp_path: Path):
    src = model_dir(tmp_path / "src")
    ctx = load_plan_context(plan_file(tmp_path / "plan.yaml", src))
    state = random_state(ctx.model)
    weights = {p.name: state[p.name] for p in llama_parameters(ctx.model)}
    moments = {k: v for k, v in state.items() if k not in weights}
    ck = tmp_path / "ck"
    write_checkpoint(ck, ctx.model, weights, moments=moments, step=4, saved_by="test",
                     source_config=json.loads((src / "config.json").read_text()), shard_bytes=20_000)
    index = json.loads((ck / WEIGHTS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (ck / WEIGHTS_FILE).exists() and set(index["weight_map"]) == set(weights)
    config = json.loads((ck / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    for name, w in weights.items():
        assert torch.equal(hf.get_parameter(name), w), name
    info = checkpoint_info(ck, ctx.model)
    assert (info.step, info.kind, info.moments) == (4, "hspmd", True)
    program = FakeProgram(REGIONS)
    assert load_checkpoint(program, ck, ctx) == 4
    for name, region in REGIONS.items():
        for suffix in ("", ".exp_avg", ".exp_avg_sq"):
            assert torch.equal(program.loaded[name + suffix], state[name + suffix][region])
    # Saved again unsharded into the same directory: the old shards and index are gone.
    write_checkpoint(ck, ctx.model, weights, moments=moments, step=5, saved_by="test")
    assert {p.name for p in ck.iterdir()} == {"config.json", WEIGHTS_FILE, OPTIMIZER_FILE}
    assert checkpoint_info(ck, ctx.model).step == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plain_transformers_checkpoint_loads_weights_only(tmp_path: Path, dtype: torch.dtype):
    src = tmp_path / "pretrained"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).to(dtype)
    hf.save_pretrained(src)
    ctx = load_plan_context(plan_file(tmp_path / "plan.yaml", src))
    program = FakeProgram(REGIONS)
    assert load_checkpoint(program, src, ctx) == 0
    assert float(program.loaded["step"]) == 0.0
    for name, region in REGIONS.items():
        assert program.loaded[name].dtype == torch.float32  # fp32 master weights, whatever the file holds
        assert torch.equal(program.loaded[name], hf.get_parameter(name).detach()[region].float())
        assert not program.loaded[name + ".exp_avg"].any() and not program.loaded[name + ".exp_avg_sq"].any()


def test_a_torn_save_is_refused_naming_the_files(tmp_path: Path):
    spec = load_model(str(model_dir(tmp_path / "m")))
    state = random_state(spec, moments=False)
    for d in ("a", "b"):
        write_checkpoint(tmp_path / d, spec, state, moments=None, step=1, saved_by="t", shard_bytes=20_000)
    checkpoint_info(tmp_path / "a", spec)
    index = (tmp_path / "a" / WEIGHTS_INDEX).read_bytes()
    (tmp_path / "a" / WEIGHTS_INDEX).write_bytes((tmp_path / "b" / WEIGHTS_INDEX).read_bytes())
    with pytest.raises(SpecError, match=f"holds files of different saves .*{WEIGHTS_INDEX}.*a save was interrupted"):
        checkpoint_info(tmp_path / "a", spec)
    (tmp_path / "a" / WEIGHTS_INDEX).write_bytes(index)
    shard = sorted((tmp_path / "a").glob("model-*.safetensors"))[0]
    shard.write_bytes((tmp_path / "b" / shard.name).read_bytes())
    with pytest.raises(SpecError, match="holds files of different saves .*a save was interrupted"):
        checkpoint_info(tmp_path / "a", spec)


def test_shape_and_config_mismatches_are_listed_and_train_writes_nothing(tmp_path: Path):
    plan_model = model_dir(tmp_path / "model")
    wrong = tmp_path / "wrong"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**TINY, "intermediate_size": 96})) \
        .save_pretrained(wrong)
    plan = plan_file(tmp_path / "plan.yaml", plan_model)
    save, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    res = CliRunner().invoke(cli, ["train", "--plan", str(plan), "--load", str(wrong), "--save", str(save),
                                   "--metrics", str(metrics)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0] == (f"error: {wrong / 'config.json'}: intermediate_size: 96 differs from the plan's model "
                        "model (ffn_hidden_size: 64)")
    weights = wrong / WEIGHTS_FILE
    assert lines[1:] == [f"error: {weights}: model.layers.{i}.mlp.{p}.weight: has shape {s}, model model needs {w}"
                         for i in range(3) for p, s, w in sorted(
                             [("gate_proj", [96, 32], [64, 32]), ("up_proj", [96, 32], [64, 32]),
                              ("down_proj", [32, 96], [32, 64])])]
    assert not save.exists() and not metrics.exists()


def test_train_refuses_what_it_cannot_run_in_one_line(tmp_path: Path):
    runner = CliRunner()
    odd = model_dir(tmp_path / "odd", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    plan = plan_file(tmp_path / "odd.yaml", odd)
    res = runner.invoke(cli, ["train", "--plan", str(plan), "--save", str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {plan}: strategies[0].pipelines[0].stages[0].devices: TP degree 2 does not divide num_heads 3, "
        "num_kv_heads 3 of odd"]
    window = tmp_path / "mistral"
    transformers.MistralConfig(**TINY, sliding_window=4).save_pretrained(window)
    plan = plan_file(tmp_path / "mistral.yaml", window)
    res = runner.invoke(cli, ["train", "--plan", str(plan), "--save", str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {window / 'config.json'}: sliding_window: attention window 4 is shorter than seq_len 8; the "
        "runtime trains full causal attention only"]
    assert not (tmp_path / "out").exists()
    assert runner.invoke(cli, ["validate", str(plan)]).exit_code == 0  # the planner side still takes it
    res = runner.invoke(cli, ["simulate", "--plan", str(plan)])
    assert res.exit_code == 0 and res.stderr.strip().splitlines() == [
        "note: mistral: sliding_window: priced as full causal attention (attention window 4 is shorter than "
        "seq_len 8; the runtime trains full causal attention only; hspmd train refuses it)"]


def test_export_writes_a_transformers_directory_from_either_format(tmp_path: Path):
    spec = load_model("llama-tiny")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    state = random_state(spec)
    save_file(state, str(legacy / CHECKPOINT_FILE), metadata={"format": FORMAT, "step": "9", "model": "llama-tiny"})
    out = tmp_path / "hf"
    res = CliRunner().invoke(cli, ["export", "--checkpoint", str(legacy), "--out", str(out), "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert {p.name for p in out.iterdir()} == {"config.json", WEIGHTS_FILE}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.bfloat16
    ours = LlamaForCausalLM(spec)
    ours.load_state_dict({p.name: state[p.name].to(torch.bfloat16).float() for p in llama_parameters(spec)})
    x = torch.randint(0, spec.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf.float()(x).logits, ours(x), rtol=1e-5, atol=1e-5)
    # And from a --save directory (config.json inside), back to fp32: the weights round-trip exactly.
    again = tmp_path / "fp32"
    res = CliRunner().invoke(cli, ["export", "--checkpoint", str(out), "--out", str(again), "--format", "json"])
    assert res.exit_code == 0, res.output
    saved, _ = read_saved(again)
    assert all(torch.equal(saved[p.name], state[p.name].to(torch.bfloat16).float()) for p in llama_parameters(spec))


def test_export_refusals_write_nothing(tmp_path: Path):
    runner = CliRunner()
    res = runner.invoke(cli, ["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {tmp_path / 'nope'}: --checkpoint: no such directory"
    (tmp_path / "empty").mkdir()
    res = runner.invoke(cli, ["export", "--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "no checkpoint in this directory" in res.stderr
    assert not (tmp_path / "o").exists()
    with pytest.raises(HspmdError, match="is the checkpoint itself"):
        from runtime.checkpoint import export_checkpoint

        export_checkpoint(tmp_path / "empty", tmp_path / "empty")
