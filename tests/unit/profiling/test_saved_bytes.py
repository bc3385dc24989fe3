"""The profiler's activation bytes per micro-batch leave out autocast's bf16 weight copies, which the engine
makes once per step (``step_casts``) and the cost model prices once (``cast_bytes``): under bf16 autocast
the saved bytes are linear in the sequence length through zero, as in fp32, instead of carrying a
2-bytes-per-parameter constant."""

from __future__ import annotations

import pytest
import torch

from runtime.profiling.compute import _Component
from runtime.torchfree.spec import load_model

MODEL = load_model("llama-tiny")


@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_bf16_saved_bytes_have_no_weight_copy_term(name: str) -> None:
    torch.manual_seed(0)
    comp = _Component(name, MODEL, 1, torch.device("cpu"), precision="bf16")
    lens = (16, 32, 64)
    saved = [comp.saved_bytes(comp.inputs(1, s)) for s in lens]
    slope = (saved[2] - saved[1]) / (lens[2] - lens[1])
    intercept = saved[1] - slope * lens[1]
    # The weight copies would add 2 * params bytes at every length; what is left is a few scalars' worth.
    assert abs(intercept) < 0.05 * 2 * comp.params, (saved, comp.params)
    assert saved[0] == pytest.approx(intercept + slope * lens[0], rel=0.02)
