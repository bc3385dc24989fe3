"""The plain Llama: parameter table agreement, stage composition, deterministic init, causality."""

from __future__ import annotations

import torch

from runtime.models.llama import LlamaForCausalLM, causal_lm_loss_sum
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_model

SPEC = load_model("llama-tiny")


def test_names_and_shapes_match_parameter_table():
    m = LlamaForCausalLM(SPEC)
    got = {n: tuple(p.shape) for n, p in m.named_parameters()}
    want = {p.name: p.shape for p in llama_parameters(SPEC)}
    assert got == want
    assert sum(p.numel() for p in m.parameters()) == SPEC.total_params()


def test_stages_compose_to_full_model_with_same_init():
    full = LlamaForCausalLM(SPEC)
    full.init_weights(3)
    a = LlamaForCausalLM(SPEC, range(0, 2), head=False)
    b = LlamaForCausalLM(SPEC, range(2, 5), embed=False, head=False)
    c = LlamaForCausalLM(SPEC, range(5, 6), embed=False)
    for s in (a, b, c):
        s.init_weights(3)
        for n, p in s.named_parameters():
            assert torch.equal(p, full.get_parameter(n)), n
    x = torch.randint(0, SPEC.vocab_size, (2, 12))
    assert torch.equal(full(x), c(b(a(x))))


def test_init_depends_on_seed():
    a, b = LlamaForCausalLM(SPEC), LlamaForCausalLM(SPEC)
    a.init_weights(0)
    b.init_weights(1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert torch.equal(a.model.norm.weight, torch.ones(SPEC.hidden_size))


def test_causal():
    m = LlamaForCausalLM(SPEC)
    m.init_weights(0)
    x = torch.randint(0, SPEC.vocab_size, (1, 10))
    y = x.clone()
    y[0, 7:] = (y[0, 7:] + 1) % SPEC.vocab_size
    assert torch.allclose(m(x)[0, :7], m(y)[0, :7])
    assert not torch.allclose(m(x)[0, 7:], m(y)[0, 7:])


def test_loss_is_token_sum():
    logits = torch.randn(2, 5, SPEC.vocab_size)
    labels = torch.randint(0, SPEC.vocab_size, (2, 5))
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, SPEC.vocab_size), labels.reshape(-1))
    assert torch.allclose(causal_lm_loss_sum(logits, labels), mean * 10)
