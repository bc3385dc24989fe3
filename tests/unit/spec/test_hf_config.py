"""Hugging Face config.json -> ModelSpec (runtime/torchfree/spec/hf.py), the runtime's Llama against transformers on
one device, the new catalog entries, and the one-line refusals of what the runtime cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.models.llama import LlamaForCausalLM, rope_frequencies
from runtime.torchfree.errors import SpecError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.hf import config_for, load_hf_model, spec_from_config
from runtime.torchfree.spec.model import RopeScaling

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=LLAMA3),
    "qwen2-tied": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "mistral-head-dim": lambda: transformers.MistralConfig(**{**TINY, "num_key_value_heads": 1}, head_dim=16,
                                                           sliding_window=None),
}
NEW_CATALOG = ["llama-3-8b", "llama-3.1-70b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b", "mixtral-8x7b",
               "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "moe-tiny"]


def write_config(path: Path, data: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))
    return path


def test_llama3_frequencies_equal_transformers_bit_for_bit():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
                                      max_position_embeddings=131072,
                                      rope_scaling={**LLAMA3, "original_max_position_embeddings": 8192})
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_frequencies(128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192), torch.device("cpu"))
    assert scale == 1.0 and torch.equal(got, want)
    plain = rope_frequencies(128, 500000.0, None, torch.device("cpu"))
    kept, slowed = (got == plain), torch.isclose(plain / got, torch.tensor(8.0))
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()  # all three bands are exercised


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_single_device_logits_equal_transformers(tmp_path: Path, kind: str):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).float().eval()
    hf.save_pretrained(tmp_path)
    spec = load_model(str(tmp_path))
    ours = LlamaForCausalLM(spec)
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == {p.name: p.shape for p in llama_parameters(spec)}
    state = {n: t for n, t in hf.state_dict().items() if "rotary" not in n}
    ours.load_state_dict(state)
    x = torch.randint(0, spec.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-5, atol=1e-6)


def test_config_fields_map_to_the_spec(tmp_path: Path):
    d = tmp_path / "Llama-3.2-tiny"
    CONFIGS["llama3"]().save_pretrained(d)
    spec = load_model(str(d))
    assert (spec.name, spec.family, spec.num_layers, spec.hidden_size, spec.ffn_hidden_size, spec.num_heads,
            spec.num_kv_heads, spec.vocab_size, spec.max_seq_len, spec.head_dim) == \
        ("Llama-3.2-tiny", "llama", 2, 32, 48, 4, 2, 96, 64, 8)
    assert spec.rope_theta == 500000.0 and spec.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert load_model(str(d / "config.json")) == spec
    # The transformers 4 spelling: rope_theta + rope_scaling (legacy key "type"), torch_dtype.
    v4 = {"model_type": "qwen2", **TINY, "rope_theta": 1e6, "rope_scaling": None, "torch_dtype": "bfloat16",
          "use_sliding_window": False, "sliding_window": 32, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
    q = load_hf_model(write_config(tmp_path / "q", v4))
    assert (q.family, q.qkv_bias, q.tie_word_embeddings, q.rope_theta, q.sliding_window, q.norm_eps) == \
        ("qwen2", True, True, 1e6, None, 1e-6)
    assert spec_from_config({**v4, "use_sliding_window": True}, "f", "q").sliding_window == 32
    assert spec_from_config({**v4, "layer_types": ["full_attention", "sliding_attention"]}, "f", "q").sliding_window \
        == 32
    legacy = {**v4, "model_type": "llama", "rope_scaling": {**LLAMA3, "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    assert spec_from_config(legacy, "f", "l").rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)


@pytest.mark.parametrize("name", NEW_CATALOG)
def test_catalog_entries_are_what_transformers_builds(name: str):
    """Round trip spec -> config.json -> spec, and transformers' own parameter count of that config."""
    spec = load_model(name)
    config = config_for(spec, "bfloat16")
    assert spec_from_config(config, "x", name) == spec
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == spec.total_params()
    assert spec.tie_word_embeddings == (name == "llama-3.2-1b")


BAD = {
    "falcon": ({"model_type": "falcon", "num_hidden_layers": 2}, [
        "model_type: 'falcon' is not supported (supported: llama, mistral, qwen2, mixtral, qwen2_moe, qwen3_moe, "
        "gpt2, opt, gpt_neox, gpt_neo)"]),
    "moe": ({"model_type": "deepseek_v3", **TINY}, ["model_type: 'deepseek_v3' is a mixture-of-experts model the "
                                                    "runtime does not build; supported: llama, mistral, qwen2, "
                                                    "mixtral, qwen2_moe, qwen3_moe"]),
    "qwen3-moe": ({"model_type": "qwen3_moe", **TINY, "moe_intermediate_size": 16, "attention_bias": True},
                  ["attention_bias: true is not supported (the runtime's o_proj has no bias)",
                   "num_experts: missing required field", "num_experts_per_tok: missing required field"]),
    "top-k": ({"model_type": "mixtral", **TINY, "num_local_experts": 2, "num_experts_per_tok": 3},
              ["num_experts_per_tok: 3 is more than num_experts 2 (a token is routed to top_k distinct experts)"]),
    "qwen-moe": ({"model_type": "qwen2_moe", **TINY, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 0, "shared_expert_intermediate_size": 16, "mlp_only_layers": [0, 5]},
                 ["mlp_only_layers[1]: 5 is not a layer index (num_hidden_layers is 2)",
                  "moe_intermediate_size: must be at least 1, got 0"]),
    "experts": ({"model_type": "mixtral", **TINY, "num_hidden_layers": 32, "num_local_experts": 4000},
                ["num_local_experts: 32 MoE layers of 4000 experts are 128,000 experts in all (at most 65,536: "
                 "every expert is three tensors of the parameter table)"]),
    "sparse": ({"model_type": "qwen3_moe", **TINY, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "decoder_sparse_step": 3},
               ["decoder_sparse_step: no layer of 2 is a MoE layer (sparse_step 3, dense_layers [])"]),
    "jitter": ({"model_type": "mixtral", **TINY, "router_jitter_noise": 0.1},
               ["router_jitter_noise: 0.1 is not supported (the runtime's router adds no noise)"]),
    "missing": ({"model_type": "llama", **{k: v for k, v in TINY.items() if k not in ("hidden_size", "vocab_size")}},
                ["hidden_size: missing required field", "vocab_size: missing required field"]),
    "types": ({"model_type": "llama", **TINY, "num_attention_heads": "4", "hidden_act": "gelu"},
              ["num_attention_heads: expected an integer, got '4'",
               "hidden_act: 'gelu' is not supported (the runtime's MLP is SwiGLU: silu)"]),
    "rope": ({"model_type": "llama", **TINY, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
             ["rope_parameters.rope_type: 'yarn' is not supported (supported: default, llama3)"]),
    "heads": ({"model_type": "llama", **TINY, "num_key_value_heads": 3},
              ["num_key_value_heads: num_heads 4 is not a multiple of num_kv_heads 3"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_configs_are_one_line_per_field(tmp_path: Path, case: str):
    data, lines = BAD[case]
    path = write_config(tmp_path / case, data)
    with pytest.raises(SpecError) as err:
        load_model(str(path))
    assert err.value.lines() == [f"{path / 'config.json'}: {line}" for line in lines]


def test_plan_cli_takes_a_config_dir_and_refuses_an_unsupported_one(tmp_path: Path):
    good = tmp_path / "llama"
    transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 4, "max_position_embeddings": 256}).save_pretrained(good)
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(cli, ["plan", "--model", str(good), "--cluster", "cpu-hetero4", "--global-batch", "8",
                                   "--seq-len", "64", "--check-top", "1", "--top-k", "1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "model: llama/config.json" in out.read_text()   # relative to the plan file
    res = CliRunner().invoke(cli, ["simulate", "--plan", str(out)])
    assert res.exit_code == 0, res.output
    bad = write_config(tmp_path / "falcon", {"model_type": "falcon"})
    res = CliRunner().invoke(cli, ["plan", "--model", str(bad), "--cluster", "cpu-hetero4", "--global-batch", "8",
                                   "--seq-len", "64", "-o", str(tmp_path / "no.yaml")])
    assert res.exit_code == 2 and not (tmp_path / "no.yaml").exists()
    assert res.stderr.strip().splitlines() == [
        f"error: {bad / 'config.json'}: model_type: 'falcon' is not supported (supported: llama, mistral, qwen2, "
        "mixtral, qwen2_moe, qwen3_moe, gpt2, opt, gpt_neox, gpt_neo)"]


def test_a_bare_name_is_the_catalog_entry_first_then_a_model_directory(tmp_path: Path):
    from runtime.torchfree.spec.catalog import recorded_ref

    CONFIGS["llama3"]().save_pretrained(tmp_path / "My-Llama")
    CONFIGS["llama3"]().save_pretrained(tmp_path / "llama-tiny")
    assert load_model("My-Llama", relative_to=tmp_path).name == "My-Llama"
    assert load_model("llama-tiny", relative_to=tmp_path).num_layers == 6  # the catalog's, not the directory
    assert recorded_ref("My-Llama", "models", tmp_path) == str((tmp_path / "My-Llama" / "config.json").resolve())
    assert recorded_ref("llama-tiny", "models", tmp_path) == "llama-tiny"
    with pytest.raises(SpecError, match="unknown model 'Nope'"):
        load_model("Nope", relative_to=tmp_path)
