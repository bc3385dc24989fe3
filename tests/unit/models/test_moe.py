"""The MoE decoder on one device: routing and dispatch against a per-token computation, the capacity rule,
the load-balancing loss and its gradient, aux-loss-free bias balancing, stages composing into the whole
model, and the parameter table matching the module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from runtime.models.llama import LlamaDecoderLayer, causal_lm_loss_sum
from runtime.models.moe import MoeBlock, MoeDecoderLayer, MoeForCausalLM, balance_loss, causal_lm, expert_outputs
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_model

TINY = load_model("moe-tiny")


def tiny(**moe) -> MoeForCausalLM:
    spec = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, **moe)) if moe else TINY
    model = causal_lm(spec)
    assert isinstance(model, MoeForCausalLM)
    model.init_weights(5)
    return model


def per_token(block: MoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output token by token, from its own definition (softmax, top-k, weighted experts)."""
    moe = block.moe
    rows = []
    for t in x:
        probs = F.softmax(block.router(t).float(), dim=-1)
        top = torch.topk(probs, moe.top_k).indices
        w = probs[top] / probs[top].sum() if moe.norm_topk_prob else probs[top]
        y = sum(w[i] * block.experts[int(e)](t) for i, e in enumerate(top))
        if block.shared is not None:
            y = y + torch.sigmoid(block.shared_gate(t)) * block.shared(t)
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("norm", [True, False])
def test_sorted_dispatch_equals_the_per_token_definition(norm: bool):
    model = tiny(norm_topk_prob=norm)
    block = model.model.layers["1"].block
    x = torch.randn(2, 9, TINY.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(block(x).reshape(-1, TINY.hidden_size), per_token(block, x.reshape(-1, 64)),
                                   rtol=1e-5, atol=1e-6)


def test_layers_follow_the_spec_and_the_table_is_the_module():
    model = tiny()
    kinds = {i: type(layer) for i, layer in model.model.layers.items()}
    assert kinds == {"0": LlamaDecoderLayer, **{str(i): MoeDecoderLayer for i in range(1, 6)}}
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == \
        {p.name: p.shape for p in llama_parameters(TINY)}
    assert sum(p.numel() for p in model.parameters()) == TINY.total_params()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in dict(model.named_parameters())
    assert not any("load" in n or "bias" in n for n in model.state_dict())  # router buffers are not weights
    mixtral = load_model("mixtral-8x7b")
    names = {p.name for p in llama_parameters(dataclasses.replace(mixtral, num_layers=1))}
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.7.w2.weight"} \
        <= names


def test_capacity_keeps_each_experts_first_tokens_in_token_order():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(3))
    x = torch.randn(6, 4)
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0], [1, 2], [0, 1]])
    weights = torch.rand(6, 2)
    capped = expert_outputs(x, chosen, weights, experts, capacity=2)
    want = torch.zeros_like(x)
    taken = [0, 0, 0]
    for t in range(6):
        for j in range(2):
            e = int(chosen[t, j])
            if taken[e] < 2:
                want[t] += weights[t, j] * experts[e](x[t])
            taken[e] += 1
    torch.testing.assert_close(capped, want)
    full = expert_outputs(x, chosen, weights, experts, capacity=None)
    assert not torch.allclose(capped[5], full[5])  # token 5 lost expert 0 (its 5th token) and 1 (its 4th)
    torch.testing.assert_close(capped[0], full[0])


def test_balance_loss_is_one_when_even_and_grows_with_skew():
    even_probs = torch.full((8, 4), 0.25)
    even_chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    assert balance_loss(even_probs, even_chosen, 4).item() == pytest.approx(1.0)
    skew_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    skew_chosen = torch.tensor([[0, 1]] * 8)
    assert balance_loss(skew_probs, skew_chosen, 4).item() == pytest.approx(4 * (0.5 * 0.7 + 0.5 * 0.1))


def test_aux_loss_gradient_is_that_of_the_weighted_loss():
    """With aux_loss_coef c, the gradient of the language loss alone is the gradient of language loss +
    c * sum of the layers' balance losses computed by hand from the routers' outputs (the attached term
    reaches the routers)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 256, (2, 16), generator=g)
    y = torch.randint(0, 256, (2, 16), generator=g)
    attached = tiny(aux_loss_coef=0.5)
    plain = tiny(aux_loss_coef=0.0)
    causal_lm_loss_sum(attached(x), y).backward()
    logits: list[torch.Tensor] = []
    for block in plain.moe_blocks():
        block.router.register_forward_hook(lambda _m, _a, out: logits.append(out))
    loss = causal_lm_loss_sum(plain(x), y)
    by_hand = 0.0
    for lg in logits:
        probs = F.softmax(lg.float(), dim=-1)
        counts = torch.bincount(torch.topk(probs, 2).indices.reshape(-1), minlength=4).float()
        by_hand = by_hand + 4 * (counts / counts.sum() * probs.mean(0)).sum()
    torch.testing.assert_close(plain.balance_loss(), by_hand.detach())
    (loss + 0.5 * by_hand).backward()
    for (name, a), (_, b) in zip(attached.named_parameters(), plain.named_parameters()):
        # (fp32 rounding of two summation orders: ~1e-6 of gradients of order 1; without the term: ~1e-2)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=name)
    router = attached.get_parameter("model.layers.2.mlp.gate.weight")
    no_aux = tiny(aux_loss_coef=0.0)
    causal_lm_loss_sum(no_aux(x), y).backward()
    assert not torch.allclose(router.grad, no_aux.get_parameter("model.layers.2.mlp.gate.weight").grad)


def test_bias_balancing_moves_choice_not_weights():
    model = tiny(bias_update_rate=0.1)
    block = model.model.layers["1"].block
    x = torch.randn(32, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    model.train()
    with torch.no_grad():
        probs, chosen, weights = block.router.route(block.router(x))
    load = torch.bincount(chosen.reshape(-1), minlength=4).float()
    assert torch.equal(block.router.load, load)
    model.update_router_biases()
    assert torch.equal(block.router.load, torch.zeros(4))
    assert torch.equal(block.router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    block.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # forces experts 0 and 1
    with torch.no_grad():
        probs, chosen, weights = block.router.route(block.router(x))
    assert torch.equal(chosen.sort(dim=-1).values, torch.tensor([[0, 1]] * 32))
    torch.testing.assert_close(weights, probs.gather(-1, chosen) / probs.gather(-1, chosen).sum(-1, keepdim=True))


def test_stages_compose_into_the_whole_model():
    full = tiny()
    first = causal_lm(TINY, range(0, 3), head=False)
    last = causal_lm(TINY, range(3, 6), embed=False)
    for stage in (first, last):
        stage.init_weights(5)
        for n, p in stage.named_parameters():
            assert torch.equal(p, full.get_parameter(n)), n
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(last(first(x)), full(x), rtol=0, atol=0)


def test_bf16_autocast_runs_the_experts_and_stays_near_fp32():
    model = tiny()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(x)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()
