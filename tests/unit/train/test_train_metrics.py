"""Step metrics: MFU as docs/training.md defines it, and TensorBoard as an optional dependency."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetu_cli.commands.train import TensorBoard, mfu_of
from planner.cost import model_flops_per_token
from runtime.launch.options import StepRecord
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan_context

REPO = Path(__file__).resolve().parents[3]
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"


def record(**kw) -> StepRecord:
    base = dict(step=3, loss=2.0, step_time_s=0.5, tokens_per_s=1.0, strategy="hetero", grad_norm=1.0,
                emulation_s=0.0, lr=1e-3, peak_memory_bytes={"0": 2**30})
    return StepRecord(**{**base, **kw})


def test_mfu_is_model_flops_over_the_sum_of_the_strategy_devices_dense_peaks():
    ctx = load_plan_context(PLAN)
    t = ctx.plan.training
    peaks = sum(ctx.cluster.type_of(d).peak_bf16_tflops for d in ctx.strategy("hetero").devices) * 1e12
    want = model_flops_per_token(ctx.model, t.seq_len) * t.global_batch * t.seq_len / 0.5 / peaks
    assert mfu_of(PLAN)(record()).mfu == pytest.approx(want, rel=1e-12)
    # a documents step counts its own tokens; a strategy the plan lacks gets none rather than a wrong one
    assert mfu_of(PLAN)(record(tokens=100)).mfu == pytest.approx(want * 100 / (t.global_batch * t.seq_len))
    assert mfu_of(PLAN)(record(strategy="elsewhere")).mfu is None


def test_tensorboard_writes_scalars_or_says_in_one_line_it_is_missing(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(HspmdError, match="--tensorboard: needs the tensorboard package, which is not installed"):
            TensorBoard(tmp_path / "tb")
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoard(tmp_path / "tb")
    board.write(mfu_of(PLAN)(record()))
    board.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/mfu", "memory/peak_gib/device0"} <= tags
    assert events.Scalars("train/loss")[0].value == 2.0
