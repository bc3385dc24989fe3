"""``hspmd plan --expert-load``: the router skew a run measured (its metrics, or a list) replaces the model
file's, is said in a note, and bad files are refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.expert_load import with_measured_load
from hetu_cli.main import cli
from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_model

MOE = load_model("moe-tiny")   # 4 experts


def metrics(tmp_path: Path, loads: list[list[float]]) -> Path:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 5.0}] + [{"step": i + 2, "loss": 5.0, "expert_load": x} for i, x in enumerate(loads)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_run_s_steps_add_up_to_the_shares_planned(tmp_path):
    model, note = with_measured_load(MOE, metrics(tmp_path, [[30, 10, 0, 0], [30, 10, 10, 10]]))
    assert model.moe.expert_load == pytest.approx((0.6, 0.2, 0.1, 0.1))
    assert "measured over the 2 steps of" in note and "2.40x the mean" in note


def test_a_list_of_shares(tmp_path):
    (tmp_path / "load.yaml").write_text("[4, 2, 1, 1]\n")
    model, _ = with_measured_load(MOE, tmp_path / "load.yaml")
    assert model.moe.expert_load == pytest.approx((0.5, 0.25, 0.125, 0.125))


@pytest.mark.parametrize("text,why", [
    ("[1, 2]\n", "expert_load of entry 1 has 2 values, the model has 4 experts"),
    ("[1, 2, 3, -1]\n", "expert_load of entry 1: expert 3: expected a number >= 0, got -1"),
    ("[0, 0, 0, 0]\n", "every expert's load is 0 (no token routed)"),
    ("{\"step\": 1}\n", "no step records expert_load"),
    ("a: 1\n", "expected a list of 4 shares"),
])
def test_bad_files_are_refused_in_one_line(tmp_path, text, why):
    path = tmp_path / "load.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=re.escape(why)):
        with_measured_load(MOE, path)


def test_hspmd_plan_plans_for_the_measured_skew_and_says_so(tmp_path):
    skew = metrics(tmp_path, [[70, 10, 10, 10]])
    res = CliRunner().invoke(cli, ["plan", "--model", "moe-tiny", "--cluster", "cpu-hetero4-sleep-moe",
                                   "--global-batch", "8", "--seq-len", "64", "--time-limit", "5",
                                   "--expert-load", str(skew), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert f"expert load measured over the 1 steps of {skew}" in res.stderr
    assert "expert loads from moe.expert_load" in res.stderr
    dense = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch",
                                     "8", "--seq-len", "64", "--expert-load", str(skew)])
    assert dense.exit_code == 2
    assert dense.stderr.strip().splitlines() == ["error: --expert-load: llama-tiny is not a mixture-of-experts model"]
