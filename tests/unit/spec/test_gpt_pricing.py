"""GPT-style decoders (GPT-2, OPT, GPT-NeoX, GPT-Neo) priced from a Hugging Face config or a model YAML:
their parameter table, per-component counts, the cost model's stage parameters and the gradient-sync
volume equal the ``transformers`` model's (tiny configs built here, nothing downloaded); ``hspmd train``
refuses them with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hetu_cli.main import cli
from planner.cost import CostModel
from runtime.torchfree.errors import SpecError
from runtime.torchfree.models.decoders import model_parameters
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.hf import load_hf_model
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

transformers = pytest.importorskip("transformers")

CPU4 = load_cluster("cpu-hetero4")


def configs() -> dict[str, tuple[object, type]]:
    t = transformers
    return {
        "gpt2": (t.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0,
                              eos_token_id=0), t.GPT2LMHeadModel),
        "gpt2-inner": (t.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_inner=40, vocab_size=96, n_positions=32,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0), t.GPT2LMHeadModel),
        "opt": (t.OPTConfig(num_hidden_layers=3, hidden_size=32, ffn_dim=48, num_attention_heads=4, vocab_size=96,
                            max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0,
                            pad_token_id=1), t.OPTForCausalLM),
        "gpt_neox": (t.GPTNeoXConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                     vocab_size=96, max_position_embeddings=64, bos_token_id=0, eos_token_id=0),
                     t.GPTNeoXForCausalLM),
        "gpt_neo": (t.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=96, max_position_embeddings=64,
                                   attention_types=[[["global", "local"], 1]], bos_token_id=0, eos_token_id=0),
                    t.GPTNeoForCausalLM),
    }


def component(name: str, layers: int) -> str:
    """Which component a transformers parameter belongs to, by its module name."""
    if any(k in name for k in ("wte", "wpe", "embed_tokens", "embed_positions", "embed_in")):
        return "embedding"
    if not any(f".{i}." in name for i in range(layers)):
        return "head"   # final norm, lm_head
    module = name.rsplit(".", 2)[-2]
    if module in ("ln_1", "ln_2", "self_attn_layer_norm", "final_layer_norm", "input_layernorm",
                  "post_attention_layernorm"):
        return "norm"
    return "attention" if any(k in name for k in ("attn", "attention")) else "mlp"


@pytest.fixture(scope="module", params=list(configs()))
def family(request, tmp_path_factory):
    """(our spec read from the config.json, the transformers model built from the same config)."""
    import torch

    cfg, cls = configs()[request.param]
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.manual_seed(0)
    return load_hf_model(d), cls(cfg)


def test_parameter_table_equals_transformers(family):
    spec, hf = family
    ours = {p.name: p.numel for p in model_parameters(spec)}
    theirs = {n: p.numel() for n, p in hf.named_parameters()}   # a tied head is the embedding: listed once
    assert ours == theirs
    assert spec.total_params() == sum(theirs.values())


def test_component_counts_equal_transformers(family):
    spec, hf = family
    by: dict[str, int] = {}
    for n, p in hf.named_parameters():
        c = component(n, spec.num_layers)
        by[c] = by.get(c, 0) + p.numel()
    tied = spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings else 0
    assert spec.embedding_params() == by["embedding"]
    assert spec.num_layers * spec.attention_params() == by["attention"]
    assert spec.num_layers * spec.mlp_params() == by["mlp"]
    assert spec.num_layers * 2 * spec.norm_params == by["norm"]
    assert spec.head_params() == by["head"] + tied      # the last stage's own copy of a tied head
    # The cost model's components (what stage memory, gradients and optimizer states are priced from).
    cm = CostModel(spec, CPU4, resolve_profiles(CPU4.device_types), micro_batch=1, seq_len=16)
    comps = cm.components("cpu-fast", 1)
    assert comps["embedding"].params == by["embedding"]
    assert comps["attention"].params * spec.num_layers == by["attention"]
    assert comps["mlp"].params * spec.num_layers == by["mlp"]
    assert comps["norm"].params * 2 * spec.num_layers == by["norm"]
    assert comps["norm"].params + comps["head"].params == by["head"] + tied
    middle = cm.stage("cpu-fast", 1, spec.num_layers, False, False)
    assert middle.params == by["attention"] + by["mlp"] + by["norm"]
    mem = cm.stage_memory("cpu-fast", 1, spec.num_layers, True, False, False, 1)
    assert mem.params == (by["embedding"] + by["attention"] + by["mlp"] + by["norm"]) * 4.0
    assert mem.optimizer == mem.params * 2   # AdamW's two fp32 moments


def test_tp_shards_and_gradient_sync_volume(family):
    spec, hf = family
    total = sum(p.numel() for p in hf.parameters())
    cm = CostModel(spec, CPU4, resolve_profiles(CPU4.device_types), micro_batch=1, seq_len=16)
    n = spec.num_layers
    dp = Strategy("dp", (Pipeline(2, (Stage((0,), (0, n)),)), Pipeline(2, (Stage((1,), (0, n)),))))
    (group,) = cm.sync_plan(dp)
    assert group.numel == total                         # every parameter all-reduced once
    # TP 2: column-parallel weights and biases split, row-parallel biases and LayerNorms whole on each shard.
    h, f = spec.hidden_size, spec.ffn_hidden_size
    comps = cm.components("cpu-fast", 2)
    assert comps["mlp"].params == (h * f + f) // 2 + h * f // 2 + h
    tp = Strategy("tp", (Pipeline(2, (Stage((0, 1), (0, n)),)), Pipeline(2, (Stage((2, 3), (0, n)),))))
    assert sum(g.numel for g in cm.sync_plan(tp)) == total   # each slice synced by the devices holding it


def test_model_yaml_with_architecture(tmp_path: Path):
    path = tmp_path / "gpt-tiny.yaml"
    path.write_text(yaml.safe_dump({"name": "gpt-tiny", "architecture": "gpt2", "num_layers": 2, "hidden_size": 32,
                                    "ffn_hidden_size": 128, "num_heads": 4, "num_kv_heads": 4, "vocab_size": 96,
                                    "max_seq_len": 64, "tie_word_embeddings": True}))
    spec = load_model(str(path))
    assert isinstance(spec, ModelSpec) and spec.gpt and spec.position_rows == 64
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96,
                                                               n_positions=64, bos_token_id=0, eos_token_id=0))
    assert spec.total_params() == sum(p.numel() for p in hf.parameters())
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("num_kv_heads: 4", "num_kv_heads: 2"))
    with pytest.raises(SpecError, match="num_kv_heads: a gpt2 decoder has multi-head attention"):
        load_model(str(bad))


def test_train_refuses_a_gpt_model_with_one_line(tmp_path: Path):
    plan_src = Path(__file__).resolve().parents[3] / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
    data = yaml.safe_load(plan_src.read_text())
    model = tmp_path / "gpt-tiny.yaml"
    model.write_text(yaml.safe_dump({"name": "gpt-tiny", "architecture": "opt", "num_layers": 6, "hidden_size": 64,
                                     "ffn_hidden_size": 128, "num_heads": 8, "num_kv_heads": 8, "vocab_size": 256,
                                     "max_seq_len": 256}))
    data["model"] = str(model)
    data["cluster"] = str(Path(plan_src).parents[1] / "clusters" / f"{data['cluster']}.yaml") \
        if not str(data["cluster"]).endswith(".yaml") else data["cluster"]
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(data))
    sim = CliRunner().invoke(cli, ["simulate", "--plan", str(plan)])
    assert sim.exit_code == 0, sim.output                       # priced
    res = CliRunner().invoke(cli, ["train", "--plan", str(plan), "--steps", "1"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [(
        f"error: {model}: architecture: opt is priced by the planner and simulator, not trained: the runtime trains "
        "the Llama family (llama, mistral, qwen2)")]


def test_profile_refuses_to_measure_a_gpt_model(tmp_path: Path):
    model = tmp_path / "gpt.yaml"
    model.write_text(yaml.safe_dump({"name": "gpt", "architecture": "gpt_neox", "num_layers": 2, "hidden_size": 64,
                                     "ffn_hidden_size": 128, "num_heads": 8, "num_kv_heads": 8, "vocab_size": 256,
                                     "max_seq_len": 256}))
    res = CliRunner().invoke(cli, ["profile", "--cluster", "cpu-hetero4", "--model", str(model), "--out",
                                   str(tmp_path / "out")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: --model: {model}: gpt_neox is not measured here (hspmd profile times the runtime's Llama modules); "
        "bring its timings with hspmd profile import"]
