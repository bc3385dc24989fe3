"""scripts/bench_elastic.py: a failed measured part still prints the modelled figures, the measured part
marked unavailable with its reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_elastic_under_test", REPO / "scripts" / "bench_elastic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_failed_measured_part_still_prints_the_modelled_figures(monkeypatch, capsys):
    bench = load_bench()
    calls = []

    def measured_fails(args):
        calls.append("measured")
        raise bench.MeasureFailed("hspmd run failed (1): the coordinator lost its agents")

    def small_model(steps):
        calls.append(("modelled", steps))
        return {"modelled_goodput_over_restart": 1.25, "modelled_goodput_over_oobleck_like": 1.5,
                "modelled_goodput_over_megatron_restart": 1.75,
                "modelled_goodput_over_restart_same_checkpoints": 1.2,
                "modelled_goodput_over_oobleck_like_same_checkpoints": 1.4, "steps": steps,
                **{name: {"initial_step_time_s": s} for name, s in
                   (("hspmd", 6.0), ("restart", 5.9), ("megatron_restart", 7.5), ("oobleck_like", 6.0))}}

    monkeypatch.setattr(bench, "measured_part", measured_fails)
    monkeypatch.setattr(bench, "modelled", small_model)
    monkeypatch.setattr(sys, "argv", ["bench_elastic.py", "--json", "--paper-steps", "7", "--skip-zero"])
    bench.main()
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert calls == ["measured", ("modelled", 7)]
    assert out["measured"] == {"available": False,
                               "reason": "hspmd run failed (1): the coordinator lost its agents"}
    assert out["goodput_over_restart"] is None
    assert out["modelled_goodput_over_restart"] == 1.25 and out["modelled_goodput_over_oobleck_like"] == 1.5
    assert out["modelled_goodput_over_restart_same_checkpoints"] == 1.2
    assert out["modelled_goodput_over_megatron_restart"] == 1.75
    assert out["modelled_restart_step_time_s"] == 5.9 and out["modelled_megatron_restart_step_time_s"] == 7.5
    assert out["modelled_hspmd_step_time_s"] == 6.0
    assert "measured part unavailable" in captured.err


def test_a_run_that_does_not_end_counts_as_a_failed_measured_part(monkeypatch, tmp_path):
    bench = load_bench()

    def hangs(*args, **kwargs):
        raise bench.subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(bench.subprocess, "run", hangs)
    monkeypatch.setattr(bench, "keep_agent", lambda *a: None)
    with pytest.raises(bench.subprocess.TimeoutExpired):  # main() reports it as the measured part's reason
        bench.measured_hspmd(tmp_path / "plan.yaml", tmp_path / "trace.yaml", 5, tmp_path, 0.1)
