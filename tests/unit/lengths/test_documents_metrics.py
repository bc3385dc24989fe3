"""A documents step's record: idle devices ignored, dispatch and switch time counted, switch bytes summed, and
the metrics file's switch event line (no worker processes)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import hetu_cli.commands.train as train_cmd
from hetu_cli.main import cli
from runtime.launch import StepRecord, StepReport
from runtime.launch.options import LengthsStep

PLAN = Path(__file__).resolve().parents[3] / "tests" / "integration" / "engine_plans" / "lengths-two.yaml"


def info(**kw) -> LengthsStep:
    base = dict(strategy="long", documents=7, padding_fraction=0.0, imbalance=1.25, predicted_s=0.002,
                method="greedy", dispatch_s=0.01)
    base.update(kw)
    return LengthsStep(**base)  # type: ignore[arg-type]


def report(rank: int, wall: float, lengths: LengthsStep, idle: bool = False, loss: float = 3.0) -> StepReport:
    return StepReport(step=2, rank=rank, device=rank, loss=0.0 if idle else loss, grad_norm=0.0 if idle else 1.5,
                      tokens=160, wall_s=0.0 if idle else wall, compute_s=0.0, comm_s=0.0, emulation_s=0.0,
                      lengths=lengths, idle=idle)


def test_record_of_a_switched_step_with_an_idle_rank_0():
    sw = dict(switched_from="short", switch_modelled_s=0.001, switch_gain_s=0.0)
    reports = [report(0, 0.0, info(switch_s=0.2, switch_bytes=100, **sw), idle=True),
               report(1, 1.0, info(switch_s=0.3, switch_bytes=50, **sw), loss=3.5),
               report(2, 1.5, info(switch_s=0.1, switch_bytes=0, **sw), loss=3.5)]
    r = StepRecord.combine(reports, "short")
    assert r.loss == 3.5 and r.grad_norm == 1.5            # from the lowest active rank, not the idle rank 0
    assert r.strategy == "long" and r.documents == 7 and r.tokens == 160 and r.imbalance == 1.25
    assert r.step_time_s == 1.5 + 0.01 + 0.1               # the slowest device, dispatch and switch included
    assert r.switch_s == 0.3 and r.switch_bytes == 150 and r.switched_from == "short"
    data = r.to_json()
    assert data["padding_fraction"] == 0.0 and data["dispatch_method"] == "greedy"


def test_window_records_keep_their_json():
    r = StepRecord.combine([StepReport(step=1, rank=0, device=0, loss=2.0, grad_norm=1.0, tokens=512, wall_s=1.0,
                                       compute_s=0.5, comm_s=0.1, emulation_s=0.0)], "hetero")
    assert set(r.to_json()) == {"step", "loss", "step_time_s", "tokens_per_s", "strategy", "grad_norm",
                                "emulation_s", "emulation_overrun_s", "lr"}


def test_metrics_get_a_switch_event_before_the_switched_step(monkeypatch, tmp_path):
    sw = info(switched_from="short", switch_s=0.2, switch_bytes=10, switch_modelled_s=0.001, switch_gain_s=0.0)

    def fake_launch(options, policy, on_step, on_log):
        assert options.lengths == "uniform" and options.long_documents == "truncate"
        on_step(StepRecord.combine([report(0, 1.0, info(strategy="short"))], "short"))
        on_step(StepRecord.combine([report(0, 1.0, sw)], "short"))

    monkeypatch.setattr(train_cmd, "launch", fake_launch)
    metrics = tmp_path / "m.jsonl"
    res = CliRunner().invoke(cli, ["train", "--plan", str(PLAN), "--lengths", "uniform", "--long-documents",
                                   "truncate", "--steps", "2", "--metrics", str(metrics)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x.get("event") for x in lines] == [None, "switch", None]
    event = lines[1]
    assert (event["step"], event["from"], event["to"], event["cause"]) == (2, "short", "long", "dispatch")
    assert "switch at step 2 from short to long (short cannot serve the step's longest document)" in res.output
    assert lines[2]["strategy"] == "long" and lines[2]["switched_from"] == "short"
    assert "2 steps (steps per strategy: short 1, long 1; 1 switches)" in res.output
