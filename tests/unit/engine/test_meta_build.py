"""A chunk built on the meta device with only this device's shards materialised holds exactly the
single-device reference's initial weights (same seed), tied weights stay one parameter, and nothing of the
module ever lives outside its shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine.build import build_chunk
from runtime.models.llama import LlamaForCausalLM
from runtime.torchfree.engine.specialize import specialize
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

PLANS = Path(__file__).resolve().parents[3] / "tests" / "integration" / "engine_plans"


@pytest.mark.parametrize("plan", ["zb-v-hetero4.yaml", "interleaved-hetero4.yaml", "pp-uneven.yaml"])
def test_meta_build_equals_the_reference_build(plan: str) -> None:
    h = StrategyHandle.of(load_plan_context(PLANS / plan))
    seed = h.training.seed
    reference = LlamaForCausalLM(h.model)
    reference.init_weights(seed)
    want = dict(reference.named_parameters())
    checked = set()
    for device in h.devices:
        p = specialize(h, device)
        if p is None or p.role.tp > 1:  # TP stages need a mesh: the multi-process engine tests build those
            continue
        shards = {s.name: s for s in p.shards}
        for chunk in p.role.chunks:
            module = build_chunk(h.model, chunk, shards, seed=seed, device=torch.device("cpu"), mesh=None)
            for name, param in module.named_parameters():
                assert param.device.type == "cpu"
                torch.testing.assert_close(param, want[name][shards[name].region], rtol=0, atol=0)
                checked.add(name)
            if chunk.head and h.model.tie_word_embeddings:
                assert module.lm_head.weight is module.model.embed_tokens.weight
    assert checked


def test_init_weights_fill_sees_each_full_value_once() -> None:
    """A sharded build receives every parameter's full value, by name, with the reference's numbers."""
    h = StrategyHandle.of(load_plan_context(PLANS / "zb-v-hetero4.yaml"))
    reference = LlamaForCausalLM(h.model)
    reference.init_weights(5)
    with torch.device("meta"):
        meta = LlamaForCausalLM(h.model)
    seen: dict[str, torch.Tensor] = {}
    meta.init_weights(5, lambda name, param, value: seen.setdefault(name, value))
    assert seen.keys() == dict(reference.named_parameters()).keys()
    for name, p in reference.named_parameters():
        assert torch.equal(seen[name], p.detach())
