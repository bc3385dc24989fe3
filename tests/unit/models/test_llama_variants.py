"""The Llama-family variants a Hugging Face config brings: tied embeddings (one weight, one init, held by
the lookup and the head stages), q/k/v biases, head_dim apart from hidden / heads; and the tie's HSPMD
annotation on the shipped hetero plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from runtime.models.llama import LlamaForCausalLM
from runtime.torchfree.annotations import Annotation, DistributedStates
from runtime.torchfree.annotations.from_plan import annotate_strategy, strategy_groups
from runtime.torchfree.comm.resolve import plan_reduce
from runtime.torchfree.engine.specialize import parameter_shards, stage_parameters, stage_role
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_model, load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

TINY = load_model("llama-tiny")
TIED = dataclasses.replace(TINY, tie_word_embeddings=True)
S = DistributedStates


def test_tied_model_has_one_weight_initialised_once_and_stages_compose():
    full = LlamaForCausalLM(TIED)
    full.init_weights(3)
    assert full.lm_head.weight is full.model.embed_tokens.weight
    assert {n for n, _ in full.named_parameters()} == {p.name for p in llama_parameters(TIED)}
    assert "lm_head.weight" not in {p.name for p in llama_parameters(TIED)}
    assert sum(p.numel() for p in full.parameters()) == TIED.total_params() == TINY.total_params() - 256 * 64
    untied = LlamaForCausalLM(TINY)
    untied.init_weights(3)
    assert torch.equal(full.model.embed_tokens.weight, untied.model.embed_tokens.weight)  # the embedding's init
    first = LlamaForCausalLM(TIED, range(0, 2), head=False)
    last = LlamaForCausalLM(TIED, range(2, 6), embed=False)
    for stage in (first, last):
        stage.init_weights(3)
        for n, p in stage.named_parameters():
            assert torch.equal(p, full.get_parameter(n)), n
    assert last.lm_head.weight is last.model.embed_tokens.weight  # the head stage holds the embedding
    x = torch.randint(0, 256, (2, 12))
    assert torch.equal(full(x), last(first(x)))


def test_biases_and_a_separate_head_dim_follow_the_parameter_table():
    spec = dataclasses.replace(TINY, qkv_bias=True, head_dim=16, family="qwen2")
    m = LlamaForCausalLM(spec)
    m.init_weights(0)
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == {p.name: p.shape for p in llama_parameters(spec)}
    assert m.get_parameter("model.layers.0.self_attn.q_proj.weight").shape == (8 * 16, 64)
    assert m.get_parameter("model.layers.0.self_attn.o_proj.weight").shape == (64, 8 * 16)
    assert not m.get_parameter("model.layers.0.self_attn.k_proj.bias").any()  # zeros, as the init says
    assert sum(p.numel() for p in m.parameters()) == spec.total_params()
    bias = next(p for p in llama_parameters(spec) if p.name == "model.layers.0.self_attn.v_proj.bias")
    assert bias.tp_dim == 0 and bias.shape == (4 * 16,)


def test_the_tied_weight_is_one_annotation_over_the_lookup_and_head_stages():
    ctx = load_plan_context(Path(__file__).resolve().parents[3] / "configs" / "plans" / "cpu-hetero4-tiny.yaml")
    ctx = dataclasses.replace(ctx, model=TIED)
    strategy = ctx.plan.strategies[0]
    ann = annotate_strategy(strategy, TIED, ctx.plan.training)
    embed = ann.param("model.embed_tokens.weight")
    # Pipeline 0 is one TP-2 stage (lookup and head); pipeline 1 looks up on device 2, multiplies on 3.
    assert embed.param == Annotation.union(-1, [((0, 1), S.split(0, 2)), ((2,), S.of()), ((3,), S.of())])
    assert embed.grad == embed.param.with_hdim(-2)
    # Its gradient: each half of the vocabulary summed over the TP rank holding it and both of pipeline 1's
    # copies, groups the untied model does not need.
    reduce = plan_reduce(embed.grad.layout(embed.shape), None)
    assert [(b.devices, b.regions) for b in reduce] == [((0, 2, 3), (((0, 128), (0, 64)),)),
                                                        ((1, 2, 3), (((128, 256), (0, 64)),))]
    tied_groups = set(strategy_groups(strategy, TIED, ctx.plan.training))
    assert tied_groups - set(strategy_groups(strategy, TINY, ctx.plan.training)) == {(0, 2, 3), (1, 2, 3)}
    for device in (0, 3):
        role = stage_role(StrategyHandle(ctx, strategy), device)
        assert "model.embed_tokens.weight" in {p.name for p in stage_parameters(TIED, role)}
        shard = next(s for s in parameter_shards(TIED, role, ann) if s.name == "model.embed_tokens.weight")
        assert shard.primary == (device == 0)
