"""Aux-loss-free balancing's pure parts: which devices sum a router's load (the router's gradient summands,
in groups the strategy creates), and a recomputed layer counting its load once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml

from runtime.engine.balancing import load_entries, load_sync_buckets
from runtime.engine.program import checkpoint_layers
from runtime.models.llama import causal_lm_loss_sum
from runtime.models.moe import MoeForCausalLM, causal_lm
from runtime.torchfree.annotations.from_plan import param_annotations, strategy_groups
from runtime.torchfree.spec import load_model, load_plan_context
from runtime.torchfree.spec.io import read_yaml

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def balanced_plan(tmp_path: Path, pipelines: list[dict]):
    model = read_yaml(CONFIGS / "models" / "moe-tiny.yaml")
    model["moe"]["bias_update_rate"] = 0.01
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    plan = {"version": 1, "model": "model.yaml", "cluster": "cpu-hetero4",
            "training": {"global_batch": sum(p["micro_batches"] for p in pipelines), "micro_batch": 1, "seq_len": 16},
            "strategies": [{"name": "s", "pipelines": pipelines}]}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return load_plan_context(tmp_path / "plan.yaml")


def summands(ctx) -> dict[str, set[int]]:
    """Per router bias: the devices whose loads its buckets add (first replicas only)."""
    strategy = ctx.plan.strategies[0]
    entries = load_entries(ctx.model, param_annotations(strategy, ctx.model))
    buckets = load_sync_buckets(entries)
    groups = set(strategy_groups(strategy, ctx.model, ctx.plan.training))
    assert buckets and all(b.devices in groups for b in buckets)   # created with the strategy's groups
    out: dict[str, set[int]] = {n: set() for n, _, _ in entries}
    for b in buckets:
        for i, _region in b.entries:
            name, shape, ann = entries[i]
            lay = ann.layout(shape)
            out[name] |= {d for d in b.devices if lay.by_device[d].replica == 0}
    return out


def test_an_expert_parallel_stage_adds_its_slices_and_the_pipelines_add_theirs(tmp_path: Path) -> None:
    ctx = balanced_plan(tmp_path, [
        {"micro_batches": 2, "stages": [{"devices": [0, 2], "layers": [0, 6], "experts": {0: [0, 1, 2], 2: [3]}}]},
        {"micro_batches": 2, "stages": [{"devices": [1], "layers": [0, 3]}, {"devices": [3], "layers": [3, 6]}]}])
    got = summands(ctx)
    assert len(got) == 5  # moe-tiny: layer 0 dense
    for name, devices in got.items():
        layer = int(name.split(".")[2])
        assert devices == {0, 2, 1 if layer < 3 else 3}, name


def test_a_tp_split_stage_counts_its_tokens_once(tmp_path: Path) -> None:
    ctx = balanced_plan(tmp_path, [{"micro_batches": 2, "stages": [{"devices": [0, 1], "layers": [0, 6]}]},
                                   {"micro_batches": 2, "stages": [{"devices": [2, 3], "layers": [0, 6]}]}])
    for devices in summands(ctx).values():
        assert devices == {0, 2}   # one rank of each TP-2 stage: its pipeline's tokens once


def test_a_recomputed_layer_counts_its_load_once() -> None:
    spec = load_model("moe-tiny")
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, bias_update_rate=0.01))
    x = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loads = []
    for recompute in (False, True):
        model = causal_lm(spec)
        assert isinstance(model, MoeForCausalLM)
        model.init_weights(0)
        if recompute:
            checkpoint_layers(model)
        causal_lm_loss_sum(model(x[:, :-1]), x[:, 1:]).backward()
        loads.append({n: r.load.clone() for n, r in model.routers().items()})
    assert loads[0].keys() == loads[1].keys() and loads[0]
    for n, load in loads[0].items():
        assert float(load.sum()) == 2 * 16 * spec.moe.top_k
        assert torch.equal(loads[1][n], load), n
