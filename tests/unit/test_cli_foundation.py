"""The CLI frame: validate/show output, --format json, exit code 2 without traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from hetu_cli.main import cli

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"


def test_validate_ok():
    res = CliRunner().invoke(cli, ["validate", str(PLANS / "cpu-hetero4-tiny.yaml")])
    assert res.exit_code == 0, res.output
    assert "valid" in res.output


def test_validate_json_ok():
    res = CliRunner().invoke(cli, ["validate", str(PLANS / "h800-h20-llama32b.yaml"), "--format", "json"])
    assert res.exit_code == 0
    data = json.loads(res.output)
    assert data["valid"] and data["devices_used"] == {"hetero": 48}


def test_validate_against_other_cluster():
    # The llama-tiny plan uses devices 0-3, which exist on h20-32 but are all H20 on one node: valid.
    res = CliRunner().invoke(cli, ["validate", str(PLANS / "cpu-hetero4-tiny.yaml"), "--cluster", "h20-32"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["validate", str(PLANS / "h800-h20-llama32b.yaml"), "--cluster", "h20-32"])
    assert res.exit_code == 2
    assert "unknown device id 32" in res.output


def test_show_text_and_json():
    res = CliRunner().invoke(cli, ["show", str(PLANS / "cpu-hetero4-tiny.yaml")])
    assert res.exit_code == 0, res.output
    assert "pipelines x stages" in res.output and "per device" in res.output
    res = CliRunner().invoke(cli, ["show", str(PLANS / "cpu-hetero4-tiny.yaml"), "--format", "json"])
    data = json.loads(res.output)
    rows = data["devices"]["hetero"]
    assert [r["pipeline"] for r in rows] == [0, 0, 1, 1]
    assert rows[3]["role"] == "layers 3-5, head+loss"


def test_bad_plan_exit_2_no_traceback(tmp_path: Path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("version: 1\nmodel: llama-tiny\ncluster: cpu-hetero4\n")
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "validate", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"error: {bad}: training: missing required field" in proc.stderr
    assert f"error: {bad}: strategies: missing required field" in proc.stderr
