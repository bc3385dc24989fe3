"""`hspmd train --elastic / --switch / --kill-device / --hang-device`: bad requests are one line, exit 2, and
are refused before any worker starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.launch.options import PlannedSwitch, TrainOptions
from runtime.torchfree.spec import load_plan, save_plan

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"


def run(*args: str):
    return CliRunner().invoke(cli, ["train", "--plan", str(TINY), "--steps", "4", *args])


@pytest.mark.parametrize("args,message", [
    (["--kill-device", "1"], "error: --kill-device/--hang-device: say when with --at-step K"),
    (["--at-step", "2"], "error: --at-step: give the device to fail with --kill-device D or --hang-device D"),
    (["--kill-device", "1", "--hang-device", "1", "--at-step", "2"],
     "error: device(s) [1] given to both --kill-device and --hang-device"),
    (["--kill-device", "9", "--at-step", "2"],
     "error: fault injection: device(s) [9] run no worker in this run (devices 0, 1, 2, 3)"),
    (["--kill-device", "1", "--at-step", "2", "--fault-point", "after-commit"],
     "error: --fault-point after-commit: only an elastic run commits steps; add --elastic"),
    (["--switch", "three:x.yaml"],
     "error: --switch: expected STEP:PLAN such as 10:other-plan.yaml, got 'three:x.yaml'"),
    (["--switch", "3:nope.yaml"], "error: nope.yaml: --switch: file not found"),
    (["--switch", f"1:{TINY}"], "error: --switch 1:" + str(TINY) + ": the step must come after the first step of the "
                                "run (1) and at most at its last (4)"),
])
def test_bad_requests_are_one_line_and_exit_2(args, message):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines()[-1] == message


def test_elastic_needs_a_heartbeat_timeout_below_the_op_timeout():
    res = run("--elastic", "--timeout", "10", "--heartbeat-timeout", "20")
    assert res.exit_code == 2
    assert "heartbeat timeout (20 s) must be shorter than the op timeout" in res.output


def test_a_switch_to_a_plan_that_trains_differently_is_refused(tmp_path):
    plan = load_plan(TINY)
    other = tmp_path / "other.yaml"
    save_plan(replace(plan, model="llama-tiny", cluster="cpu-hetero4",
                      training=replace(plan.training, seq_len=32)), other)
    res = run("--switch", f"3:{other}")
    assert res.exit_code == 2
    assert "cannot switch" in res.output and "training.seq_len 64 vs 32" in res.output


def test_switch_steps_must_increase():
    with pytest.raises(ValueError, match="distinct and increasing"):
        TrainOptions(plan=TINY, switches=(PlannedSwitch(5, TINY), PlannedSwitch(3, TINY)))
