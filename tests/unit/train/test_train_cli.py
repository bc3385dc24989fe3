"""``hspmd train``'s own logic without worker processes: metrics lines, summary, failure rendering."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import hetu_cli.commands.train as train_cmd
from hetu_cli.main import cli
from runtime.launch import PlainPolicy, StepRecord, StepReport, WorkerFailure

PLAN = "configs/plans/cpu-hetero4-tiny.yaml"


def record(step: int, loss: float) -> StepRecord:
    return StepRecord(step=step, loss=loss, step_time_s=0.5, tokens_per_s=1024.0, strategy="hetero", grad_norm=1.0,
                      emulation_s=0.25)


def test_metrics_get_one_json_line_per_step_with_the_required_keys(monkeypatch, tmp_path, repo):
    def fake_launch(options, policy, on_step, on_log):
        assert isinstance(policy, PlainPolicy)
        assert options.steps == 2 and options.plan.name == "cpu-hetero4-tiny.yaml"
        on_log("started 4 workers")
        on_step(record(1, 5.5))
        on_step(record(2, 5.25))

    monkeypatch.setattr(train_cmd, "launch", fake_launch)
    metrics = tmp_path / "out" / "m.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("stale line from an earlier run\n")
    res = CliRunner().invoke(cli, ["train", "--plan", str(repo / PLAN), "--steps", "2", "--metrics", str(metrics)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    for x in lines:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "strategy"} <= set(x)
        assert x["strategy"] == "hetero" and x["tokens_per_s"] == 1024.0
    assert "loss 5.5000 -> 5.2500" in res.output and f"metrics: {metrics}" in res.output


def test_a_run_refused_at_start_up_leaves_no_metrics_file(tmp_path, repo):
    metrics = tmp_path / "m.jsonl"
    res = CliRunner().invoke(cli, ["train", "--plan", str(repo / PLAN), "--data", str(tmp_path / "nope.txt"),
                                   "--metrics", str(metrics)])
    assert res.exit_code == 2 and "--data: file not found" in res.stderr
    assert not metrics.exists()


@pytest.mark.parametrize("kind, code", [("user", 2), ("error", 1), ("died", 1)])
def test_worker_failures_print_one_error_line_and_a_traceback_only_for_bugs(monkeypatch, repo, kind, code):
    def fake_launch(options, policy, on_step, on_log):
        raise WorkerFailure(3, 2, kind, ("it broke",), "Traceback (most recent call last):\n  boom\n")

    monkeypatch.setattr(train_cmd, "launch", fake_launch)
    res = CliRunner().invoke(cli, ["train", "--plan", str(repo / PLAN)])
    assert res.exit_code == code
    err = res.stderr.strip().splitlines()
    assert err[-1] == "error: device 3 (rank 2): it broke"
    assert ("Traceback" in res.stderr) == (kind == "error")
    if kind != "error":
        assert len(err) == 1


def test_step_records_take_the_slowest_worker_and_rank_0s_loss():
    reports = [StepReport(step=4, rank=r, device=r + 10, loss=2.0 + r, grad_norm=0.5, tokens=4096, wall_s=w,
                          compute_s=0.1, comm_s=0.1, emulation_s=e)
               for r, w, e in [(1, 2.0, 1.0), (0, 1.0, 0.0), (2, 1.5, 0.5)]]
    r = StepRecord.combine(reports, "s")
    assert (r.step, r.loss, r.step_time_s, r.tokens_per_s, r.emulation_s) == (4, 2.0, 2.0, 2048.0, 1.0)


def test_resume_continues_from_latest_to_the_runs_last_step(monkeypatch, tmp_path, repo):
    """``--resume``: the options the workers get (from DIR/latest, the steps left), the finished run's command
    repeated (exit 0, no worker), a --steps behind the checkpoint (one line, exit 2), and no checkpoint yet."""
    seen = []
    monkeypatch.setattr(train_cmd, "launch", lambda options, policy, on_step, on_log: seen.append(options))
    ck = tmp_path / "ck"
    (ck / "step-00000008").mkdir(parents=True)
    (ck / "latest").write_text("step-00000008\n")
    base = ["train", "--plan", PLAN, "--save", str(ck), "--save-every", "4", "--resume"]
    res = CliRunner().invoke(cli, [*base, "--steps", "12"])
    assert res.exit_code == 0, res.output
    assert seen[-1].load_dir == ck / "step-00000008" and seen[-1].steps == 4 and seen[-1].save_every == 4
    res = CliRunner().invoke(cli, [*base, "--steps", "8"])
    assert res.exit_code == 0 and "nothing left to train" in res.output and len(seen) == 1
    res = CliRunner().invoke(cli, [*base, "--steps", "7"])
    assert res.exit_code == 2 and "the run is at step 8 already, past --steps 7" in res.output
    res = CliRunner().invoke(cli, ["train", "--plan", PLAN, "--save", str(tmp_path / "new"), "--resume",
                                   "--steps", "3"])
    assert res.exit_code == 0 and "no checkpoint in" in res.output and seen[-1].load_dir is None
    res = CliRunner().invoke(cli, ["train", "--plan", PLAN, "--save-every", "2"])
    assert res.exit_code == 2 and "--save-every, --keep and --resume work on --save DIR" in res.output
