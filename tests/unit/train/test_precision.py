"""--precision: bf16 autocast runs on the CPU too; fp32 and auto are the same thing there."""

from __future__ import annotations

from click.testing import CliRunner

import hetu_cli.commands.train as train_cmd
from hetu_cli.main import cli
from runtime.data import token_source
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.spec import load_plan_context

PLAN = "configs/plans/cpu-hetero4-tiny.yaml"


def losses(ctx, precision: str, steps: int = 3) -> list[float]:
    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t, precision=precision)
    source = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len,
                          seed=t.seed)
    return [trainer.train_step(source.batch(s)).loss for s in range(1, steps + 1)]


def test_bf16_on_cpu_is_close_to_fp32_but_not_equal(repo):
    ctx = load_plan_context(repo / PLAN)
    fp32, auto, bf16 = losses(ctx, "fp32"), losses(ctx, "auto"), losses(ctx, "bf16")
    assert fp32 == auto  # on the CPU, auto is fp32
    assert bf16 != fp32  # bf16 really ran: its rounding shows
    for a, b in zip(fp32, bf16):
        assert abs(a - b) / abs(a) < 2e-2


def test_train_passes_the_precision_to_the_launcher(monkeypatch, repo):
    seen = []
    monkeypatch.setattr(train_cmd, "launch",
                        lambda options, policy=None, *, on_step, on_log: seen.append(options.precision))
    for argv, want in (([], "auto"), (["--precision", "bf16"], "bf16"), (["--precision", "fp32"], "fp32")):
        res = CliRunner().invoke(cli, ["train", "--plan", str(repo / PLAN), "--steps", "1", *argv])
        assert res.exit_code == 0, res.output
        assert seen[-1] == want
    res = CliRunner().invoke(cli, ["train", "--plan", str(repo / PLAN), "--precision", "fp8"])
    assert res.exit_code == 2 and "fp8" in res.output
