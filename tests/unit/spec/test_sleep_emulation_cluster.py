"""The cluster format's sleep-mode section (``emulate: {target: {profile, model}, time_scale}``): bad values
are one line naming the cluster file and the field, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_cluster
from runtime.torchfree.spec.io import read_yaml

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "configs" / "clusters" / "cpu-hetero4-sleep.yaml"
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
FIELD = "device_types.emu-h20.emulate"

CASES = {
    "negative_scale": ({"target": {"profile": "H20", "model": "llama-32b"}, "time_scale": -1},
                       f"{FIELD}.time_scale: must be a positive number of wall seconds per target second"),
    "missing_scale": ({"target": {"profile": "H20", "model": "llama-32b"}},
                      f"{FIELD}.time_scale: sleep mode needs 'time_scale'"),
    "both_modes": ({"slowdown": 3.0, "target": {"profile": "H20", "model": "llama-32b"}, "time_scale": 10},
                   f"{FIELD}.slowdown: give either 'slowdown' (stretch mode) or 'target' (sleep mode), not both"),
    "scale_without_target": ({"slowdown": 2.0, "time_scale": 10},
                             f"{FIELD}.time_scale: only meaningful with 'target'"),
    "unknown_profile": ({"target": {"profile": "H2O", "model": "llama-32b"}, "time_scale": 10},
                        f"{FIELD}.target.profile: unknown device profile 'H2O'"),
    "unknown_model": ({"target": {"profile": "H20", "model": "llama-3b"}, "time_scale": 10},
                      f"{FIELD}.target.model: unknown model 'llama-3b'"),
    "missing_model": ({"target": {"profile": "H20"}, "time_scale": 10}, f"{FIELD}.target.model: "),
    "unknown_key": ({"target": {"profile": "H20", "model": "llama-32b"}, "time_scale": 10, "speed": 2},
                    f"{FIELD}.speed: "),
    "zero_seq_scale": ({"target": {"profile": "H20", "model": "llama-32b"}, "time_scale": 10, "seq_scale": 0},
                       f"{FIELD}.seq_scale: must be a whole number of target tokens per real token in [1, 4096], "
                       "got 0"),
    "fractional_seq_scale": ({"target": {"profile": "H20", "model": "llama-32b"}, "time_scale": 10,
                              "seq_scale": 1.5}, f"{FIELD}.seq_scale: expected an integer, got 1.5"),
    "seq_scale_without_target": ({"slowdown": 2.0, "seq_scale": 8},
                                 f"{FIELD}.seq_scale: only meaningful with 'target'"),
    "bad_memory": ({"target": {"profile": "H20", "model": "llama-32b"}, "time_scale": 10, "memory": "both"},
                   f"{FIELD}.memory: must be 'real' or 'target', got 'both'"),
    "memory_without_target": ({"slowdown": 2.0, "memory": "target"},
                              f"{FIELD}.memory: only meaningful with 'target'"),
}


def bad_cluster(tmp_path: Path, emulate: dict) -> Path:
    data = read_yaml(CLUSTER)
    data["device_types"]["emu-h20"]["emulate"] = emulate
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_shipped_sleep_cluster_loads():
    c = load_cluster("cpu-hetero4-sleep")
    assert all(t.sleep_emulated for t in c.device_types.values()) and c.emulated
    assert all(t.emulate.seq_scale == 1 and t.emulate.memory == "real" for t in c.device_types.values())
    long = load_cluster("cpu-hetero4-long")
    assert all(t.sleep_emulated and t.emulate.seq_scale == 128 and t.emulate.memory == "target"
               for t in long.device_types.values())
    assert not any(t.sleep_emulated for t in load_cluster("cpu-hetero4").device_types.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_sleep_section_is_one_line_naming_file_and_field(case, tmp_path):
    emulate, expect = CASES[case]
    path = bad_cluster(tmp_path, emulate)
    with pytest.raises(SpecError) as err:
        load_cluster(str(path))
    lines = err.value.lines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: {expect}"), lines
    res = CliRunner().invoke(cli, ["validate", str(PLAN), "--cluster", str(path)])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"error: {line}" for line in lines]


def test_cli_exit_2_without_traceback(tmp_path):
    path = bad_cluster(tmp_path, CASES["unknown_profile"][0])
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "validate", str(PLAN), "--cluster", str(path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"error: {path}: {FIELD}.target.profile: unknown device profile"), out
