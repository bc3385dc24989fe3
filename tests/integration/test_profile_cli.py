"""`hspmd profile` end to end on cpu-hetero4 (spawns the link-test processes), then `simulate` on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.torchfree.profiling.profile import load_profile, resolve_profiles
from runtime.torchfree.spec import load_cluster

REPO = Path(__file__).resolve().parents[2]


def test_profile_then_simulate(tmp_path: Path):
    out = tmp_path / "prof"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "profile", "--cluster", "cpu-hetero4", "--out", str(out),
                           "--seq-lens", "16,32,64", "--budget", "0", "--link-processes", "2", "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert set(summary["profiles"]) == {"cpu-fast", "cpu-slow"}
    fast = load_profile(out / "cpu-fast.measured.yaml")
    slow = load_profile(out / "cpu-slow.measured.yaml")
    assert fast.provenance == "measured" and fast.source.torch_version and fast.source.host
    assert sorted(fast.models["llama-tiny"].tp) == [1, 2]
    # The slow type is the same measurement stretched 3x; links are not stretched.
    f = fast.models["llama-tiny"].tp[1]["attention"].forward_s
    s = slow.models["llama-tiny"].tp[1]["attention"].forward_s
    assert s[2] == pytest.approx(3 * f[2]) and s[1] == pytest.approx(3 * f[1])
    assert fast.comm.p2p is not None and fast.comm.p2p == slow.comm.p2p and sorted(fast.comm.allreduce) == [2]
    assert 0 < fast.comm.p2p.latency_s < 0.1
    # Whole stage blocks through the runtime's stage module, stretched like the components; the TP
    # stage modules' overhead (DTensor and collectives) per block.
    mm, ms = fast.models["llama-tiny"], slow.models["llama-tiny"]
    assert sorted(mm.blocks) == [1, 2] and sorted(mm.tp_blocks) == [2]
    # ... and with sequence parallelism on, timed apart
    assert sorted(mm.tp_blocks_sp) == [2]
    assert mm.tp_blocks_sp[2]["layer"].forward_s != mm.tp_blocks[2]["layer"].forward_s
    assert ms.blocks[1]["layer"].forward_s[2] == pytest.approx(3 * mm.blocks[1]["layer"].forward_s[2])
    # No figure about the host that emulates the devices.
    text = (out / "cpu-fast.measured.yaml").read_text()
    assert not any(k in text for k in ("resume", "core_sharing", "core_handoff", "p2p_actions", "host_cores"))
    assert fast.optimizer.seconds_per_tensor > 0 and fast.step_overhead.seconds_per_tensor >= 0
    # Measured beats the spec fallback, and simulate uses it.
    ps = resolve_profiles(load_cluster("cpu-hetero4").device_types, [out])
    assert ps["cpu-slow"].provenance == "measured"
    sim = CliRunner().invoke(cli, ["simulate", "--plan", str(REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"),
                                   "--profile", str(out), "--format", "json"])
    assert sim.exit_code == 0, sim.output
    data = json.loads(sim.output)
    assert data["measured_fits"] == {"cpu-fast": True, "cpu-slow": True}
    assert data["step_time_s"] > 0


def test_profile_bad_input_exit_2(tmp_path: Path):
    res = CliRunner().invoke(cli, ["profile", "--cluster", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "error: --cluster: unknown cluster 'nope'" in res.output
    res = CliRunner().invoke(cli, ["profile", "--cluster", "h20-32", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "no CUDA GPU" in res.output and not list(tmp_path.iterdir())
