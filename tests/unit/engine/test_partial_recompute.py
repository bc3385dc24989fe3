"""Partial recompute in the engine: exactly the stage's lowest ``recompute_layers`` layers are checkpointed,
and a checkpointed layer keeps only its input for the backward (what the cost model's ``checkpoint_bytes``
prices), the others their whole activations."""

from __future__ import annotations

import torch

from runtime.engine.program import checkpoint_layers
from runtime.models.llama import LlamaForCausalLM
from runtime.torchfree.engine.specialize import chunk_roles
from runtime.torchfree.schedule_policies import schedule_layout
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.plan import Pipeline, Stage

TINY = load_model("llama-tiny")


def saved_bytes(module: LlamaForCausalLM, tokens: torch.Tensor) -> int:
    """Bytes the forward saves for the backward, parameters excluded, each storage once."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(tokens)
    return sum(seen.values())


def test_each_checkpointed_layer_keeps_only_its_input() -> None:
    tokens = torch.randint(0, TINY.vocab_size, (1, 32))
    sizes = []
    for ids in ((), (2,), (2, 3), (0, 1, 2, 3, 4, 5)):
        m = LlamaForCausalLM(TINY)
        m.init_weights(7)
        checkpoint_layers(m, ids)
        sizes.append(saved_bytes(m, tokens))
    none, one, two, every = sizes
    # Equal layers: each checkpointed one drops the same bytes, nearly all it saved (its input remains).
    layer_input = 32 * TINY.hidden_size * 4   # the fp32 residual stream entering the layer
    assert none > one > two > every
    drop = none - one
    assert two == one - drop
    assert every == none - 6 * drop
    full_layer = drop + layer_input   # what one layer saved without recompute (its input among it)
    assert layer_input < 0.2 * full_layer


def test_the_stage_lowest_layers_recompute_across_its_chunks() -> None:
    """ZB-V: stage 0 holds layers [0, 2) and [4, 6); 3 recomputed layers are 0, 1 and 4."""
    stages = (Stage(devices=(0,), layers=((0, 2), (4, 6)), recompute_layers=3),
              Stage(devices=(1,), layers=((2, 3), (3, 4))))
    pipe = Pipeline(micro_batches=4, stages=stages)
    roles = chunk_roles(pipe, 0, schedule_layout("zb-v", 2, 2))
    assert [r.recomputed for r in roles] == [(0, 1), (4,)]
    assert [r.recomputes_all for r in roles] == [True, False]
    assert [st.chunk_recompute(c) for st in stages for c in range(st.chunks)] == [2, 1, 0, 0]
