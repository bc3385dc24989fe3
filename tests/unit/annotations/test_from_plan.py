"""Plan -> annotations: parameters, gradients, batch, boundaries, groups, and `hspmd show --annotations`."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.torchfree.annotations import Annotation, DistributedStates
from runtime.torchfree.annotations.from_plan import annotate_strategy, annotation_rows, strategy_groups
from runtime.torchfree.comm.resolve import resolve
from runtime.torchfree.spec import load_plan_context

S = DistributedStates
PLANS = Path(__file__).resolve().parents[3] / "configs" / "plans"


def tiny():
    ctx = load_plan_context(PLANS / "cpu-hetero4-tiny.yaml")
    return ctx, ctx.plan.strategies[0]


def test_parameters_follow_stage_tp():
    ctx, strategy = tiny()
    ann = annotate_strategy(strategy, ctx.model, ctx.plan.training)
    q0 = ann.param("model.layers.0.self_attn.q_proj.weight")
    assert q0.param == Annotation.union(-1, [((0, 1), S.split(0, 2)), ((2,), S.of())])
    assert q0.grad == q0.param.with_hdim(-2)
    o5 = ann.param("model.layers.5.self_attn.o_proj.weight")  # row parallel, layer on stage 1 of pipeline 1
    assert o5.param == Annotation.union(-1, [((0, 1), S.split(1, 2)), ((3,), S.of())])
    norm = ann.param("model.layers.4.input_layernorm.weight")
    assert norm.param.ds.states[0] == S.duplicate(2)
    assert ann.param("model.embed_tokens.weight").param.dg.devices == (0, 1, 2)
    assert ann.param("lm_head.weight").param.dg.devices == (0, 1, 3)
    assert len(ann.params) == 6 * 9 + 3
    for p in ann.params:
        p.param.check(p.shape)
        assert resolve(p.grad, p.param, p.shape).kind == "split_all_reduce"


def test_batch_weighted_by_micro_batches():
    ctx, strategy = tiny()
    ann = annotate_strategy(strategy, ctx.model, ctx.plan.training)
    tokens = ann.tokens.layout(ann.batch_shape)
    assert tokens.region(0) == tokens.region(1) == ((0, 6), (0, 64))  # 6 micro-batches x 1 sample
    assert tokens.region(2) == ((6, 8), (0, 64))
    assert 3 not in tokens  # only first stages hold tokens
    labels = ann.labels.layout(ann.batch_shape)
    assert labels.region(3) == ((6, 8), (0, 64)) and 2 not in labels


def test_boundaries_and_groups():
    ctx, strategy = tiny()
    ann = annotate_strategy(strategy, ctx.model, ctx.plan.training)
    (b,) = ann.boundaries
    assert (b.pipeline, b.stage, b.shape) == (1, 0, (1, 64, 64))
    assert resolve(b.src, b.dst, b.shape).kind == "send_recv"
    groups = strategy_groups(strategy, ctx.model, ctx.plan.training)
    assert groups == sorted(groups, key=lambda k: (len(k), k))
    # TP group, the per-slice sync groups (TP-2 slice i with the TP-1 device), norms, the whole strategy.
    assert {(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (0, 1, 2), (0, 1, 3), (0, 1, 2, 3)} == set(groups)


def test_paper_plan_rows_grouped_by_layer_ranges():
    ctx = load_plan_context(PLANS / "h800-h20-llama32b.yaml")
    rows = annotation_rows(ctx.plan.strategies[0], ctx.model, ctx.plan.training)
    wheres = [r["where"] for r in rows]
    assert "layers 0-29" in wheres and "layers 30-59" in wheres
    assert sum(w.startswith("layers") for w in wheres) == 2 * 9
    norm = next(r for r in rows if r["tensor"] == "input_layernorm.weight")
    assert norm["text"] == "dup[ 0-7: D×8 | 16-23: D×8 | 32-39: D×8 ]" and norm["sync"] == "split_all_reduce"


def test_show_annotations_cli():
    res = CliRunner().invoke(cli, ["show", "--annotations", str(PLANS / "cpu-hetero4-tiny.yaml")])
    assert res.exit_code == 0, res.output
    assert "layers 0-2" in res.output and "split_all_reduce" in res.output and "send_recv" in res.output
    res = CliRunner().invoke(cli, ["show", "--annotations", "--format", "json", str(PLANS / "cpu-hetero4-tiny.yaml")])
    data = json.loads(res.output)["annotations"]["hetero"]
    assert [0, 1] in data["groups"]
    emb = data["rows"][0]
    assert emb["tensor"] == "embed_tokens.weight" and emb["annotation"]["hdim"] == -1
    assert emb["annotation"]["members"][0] == {"devices": [0, 1], "states": {"0": 2}, "order": [0]}


def gpt_plan(tmp_path: Path) -> Path:
    """The tiny plan on a GPT-2 architecture (priced by the planner, not trained)."""
    import yaml

    data = yaml.safe_load((PLANS / "cpu-hetero4-tiny.yaml").read_text())
    model = tmp_path / "gpt-tiny.yaml"
    model.write_text(yaml.safe_dump({"name": "gpt-tiny", "architecture": "gpt2", "num_layers": 6, "hidden_size": 64,
                                     "ffn_hidden_size": 256, "num_heads": 8, "num_kv_heads": 8, "vocab_size": 256,
                                     "max_seq_len": 256, "tie_word_embeddings": True}))
    data["model"] = str(model)
    data["cluster"] = str(PLANS.parent / "clusters" / f"{data['cluster']}.yaml")
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(data))
    return plan


def test_show_views_of_a_gpt_architecture(tmp_path: Path):
    """`hspmd show --annotations` and `--device` read the model's own parameter table, whatever decoder."""
    plan = str(gpt_plan(tmp_path))
    res = CliRunner().invoke(cli, ["show", "--annotations", "--format", "json", plan])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["annotations"]["hetero"]["rows"]
    by_where: dict[str, list[str]] = {}
    for r in rows:
        by_where.setdefault(r["where"], []).append(r["tensor"])
    assert by_where["embedding"] == ["wte.weight", "wpe.weight"]
    assert by_where["head"] == ["ln_f.weight", "ln_f.bias"]   # the head is the tied wte
    assert "attn.c_attn.weight" in by_where["layers 0-2"] and "mlp.c_proj.bias" in by_where["layers 3-5"]
    res = CliRunner().invoke(cli, ["show", "--annotations", plan])
    assert res.exit_code == 0 and "ln_f.bias" in res.output, res.output
    res = CliRunner().invoke(cli, ["show", "--device", "3", "--format", "json", plan])
    assert res.exit_code == 0, res.output
    (prog,) = json.loads(res.output)["programs"]
    names = [p["name"] for p in prog["params"]]
    assert names[0] == "transformer.wte.weight" and "transformer.ln_f.bias" in names   # tied head holds wte
    assert "transformer.h.3.mlp.c_fc.weight" in names and "transformer.h.2.mlp.c_fc.weight" not in names
    res = CliRunner().invoke(cli, ["show", "--device", "0", plan])
    assert res.exit_code == 0 and "attention and MLP outputs" in res.output, res.output
