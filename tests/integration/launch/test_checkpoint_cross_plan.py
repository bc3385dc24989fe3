"""A checkpoint saved under one plan and loaded under another continues exactly like an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from train_helpers import HETERO_PLAN, PARAM_ATOL, reference, reference_state, shrink, write_plan

from runtime.checkpoint import expected_tensors, read_saved
from runtime.launch import TrainOptions, launch
from runtime.torchfree.spec import load_plan_context


def read(directory) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    return read_saved(directory)


def assert_state_equal(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Parameters to 1e-3 of an Adam step, moments to 1e-5 of their scale (see train_helpers.EPS)."""
    assert set(saved) == set(expected)
    for name, want in expected.items():
        atol = 1e-5 * float(want.abs().max()) if name.endswith(("exp_avg", "exp_avg_sq")) else PARAM_ATOL
        torch.testing.assert_close(saved[name], want, rtol=1e-5, atol=atol, msg=name)


def test_save_under_two_pipelines_then_continue_under_another_plan(tmp_path):
    # A: the demo's TP-2 pipeline beside a 2-stage TP-1 pipeline (every parameter held twice, at two TP
    # degrees). B: one pipeline with another layer split, on other devices.
    plan_a = shrink(HETERO_PLAN, tmp_path / "a.yaml")
    plan_b = write_plan(tmp_path / "b.yaml", "b", [(8, [([3], (0, 1)), ([1], (1, 6))])], global_batch=8)
    first, second = tmp_path / "ck-a", tmp_path / "ck-b"
    expected_losses, trainer = reference(plan_a, 2)

    a = launch(TrainOptions(plan=plan_a, steps=2, save_dir=first))
    assert [r.loss for r in a.records] == pytest.approx(expected_losses, rel=1e-5)
    saved, meta = read(first)
    assert meta["step"] == "2" and meta["model"] == "llama-tiny"
    assert list(saved) and set(saved) == set(expected_tensors(load_plan_context(plan_a).model))
    assert_state_equal(saved, reference_state(trainer))

    b = launch(TrainOptions(plan=plan_b, steps=2, load_dir=first, save_dir=second))
    continued = [trainer.train_step(batch).loss for batch in _batches(plan_a, (3, 4))]
    assert [r.step for r in b.records] == [3, 4]
    assert [r.loss for r in b.records] == pytest.approx(continued, rel=1e-5)
    saved, meta = read(second)
    assert meta["step"] == "4"
    assert_state_equal(saved, reference_state(trainer))


def _batches(plan, steps):
    from runtime.data import SyntheticTokens

    ctx = load_plan_context(plan)
    t = ctx.plan.training
    src = SyntheticTokens(ctx.model.vocab_size, t.global_batch, t.seq_len, t.seed)
    return [src.batch(s) for s in steps]
