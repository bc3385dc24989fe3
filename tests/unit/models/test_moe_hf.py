"""Mixtral and Qwen2-MoE in and out of Hugging Face's format, against transformers: a tiny model built and
saved by transformers (random weights, nothing downloaded) loads into hspmd with transformers' logits; hspmd's
own weights, written as a checkpoint, load into transformers with hspmd's logits; ``hspmd export`` of a
transformers directory writes the same tensors back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.checkpoint import checkpoint_info, read_saved, write_checkpoint
from runtime.models.moe import MoeForCausalLM, causal_lm
from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.hf import config_for, load_hf_model, read_config

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=4,
                                                  num_experts_per_tok=2),
    # Dense layer 1, unnormalised top-3 of 5 experts, a gated shared expert, q/k/v bias.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SHAPE, intermediate_size=40, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=16, num_experts=5,
                                                     num_experts_per_tok=3, mlp_only_layers=[1],
                                                     norm_topk_prob=False),
    # Per-head q/k norms, dense layer 0, renormalised top-2 of 4 experts, no shared expert.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, intermediate_size=40, moe_intermediate_size=24,
                                                     num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                                                     norm_topk_prob=True),
}


def saved_by_transformers(tmp_path: Path, kind: str) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).float().eval()
    with torch.no_grad():  # transformers initialises some weights (router, biases) to zero: spread them
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path / kind
    hf.save_pretrained(path)
    return path, hf


def tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_transformers_weights_load_with_transformers_logits(tmp_path: Path, kind: str):
    path, hf = saved_by_transformers(tmp_path, kind)
    spec = load_hf_model(path)
    assert spec.family == kind and spec.moe is not None
    info = checkpoint_info(path, spec)  # every tensor of the directory is a parameter of the table, and back
    assert info.kind == "huggingface"
    ours = causal_lm(spec).eval()
    weights, _ = read_saved(path)
    ours.load_state_dict(weights, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_hspmd_weights_export_to_transformers_with_the_same_logits(tmp_path: Path, kind: str):
    source, _ = saved_by_transformers(tmp_path, kind)
    spec = load_hf_model(source)
    ours = causal_lm(spec).eval()
    ours.init_weights(9)
    out = tmp_path / "out"
    write_checkpoint(out, spec, dict(ours.state_dict()), moments=None, step=0, saved_by="test",
                     source_config=read_config(source / "config.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert load_hf_model(out) == dataclasses.replace(spec, name="out")
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, ours(tokens()), rtol=1e-5, atol=1e-6)


def test_export_cli_writes_the_same_tensors(tmp_path: Path):
    source, _ = saved_by_transformers(tmp_path, "qwen2_moe")
    out = tmp_path / "exported"
    res = CliRunner().invoke(cli, ["export", "--checkpoint", str(source), "--out", str(out)])
    assert res.exit_code == 0, res.output
    a, b = read_saved(source)[0], read_saved(out)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shipped_model_files_export_as_their_family():
    tiny = load_model("moe-tiny")
    config = config_for(tiny, "float32")
    assert (config["model_type"], config["num_experts"], config["mlp_only_layers"], config["router_aux_loss_coef"],
            config["output_router_logits"]) == ("qwen2_moe", 4, [0], 0.01, True)
    model = causal_lm(tiny)
    assert isinstance(model, MoeForCausalLM)
    balanced = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, bias_update_rate=0.001))
    with pytest.raises(SpecError, match="moe.bias_update_rate: the router bias of aux-loss-free balancing"):
        config_for(balanced, "float32")
    # Options config.json has no keys for do not stop a checkpoint from loading under its own model.
    capped = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, capacity_factor=1.25))
    assert config_for(capped, "float32") == config
