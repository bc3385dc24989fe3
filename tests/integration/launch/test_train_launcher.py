"""``hspmd train`` end to end: workers, metrics, traces, emulation, and failures that stop the run."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from train_helpers import HETERO_PLAN, REPO, reference, shrink, write_plan

from runtime.launch import Fault, TrainOptions, WorkerFailure, launch
from runtime.torchfree.spec import load_plan, save_plan

STEPS = 3


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plans")
    return {
        "hetero": scheduled(shrink(HETERO_PLAN, d / "hetero.yaml")),
        # Two fast devices in a 2-stage pipeline: the cheapest world that has a peer to be stuck on.
        "pp2": write_plan(d / "pp2.yaml", "pp2", [(2, [([0], (0, 3)), ([1], (3, 6))])], global_batch=2),
    }


def scheduled(path: Path) -> Path:
    """The plan with a 3-update warmup: each of the test's steps at its own learning rate."""
    plan = load_plan(path)
    optimizer = replace(plan.training.optimizer, warmup_steps=3)
    save_plan(replace(plan, training=replace(plan.training, optimizer=optimizer)), path)
    return path


def test_cli_trains_the_hetero_plan_with_metrics_traces_and_emulation(plans, tmp_path):
    metrics, traces = tmp_path / "m.jsonl", tmp_path / "traces"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plans["hetero"]), "--steps",
                           str(STEPS), "--metrics", str(metrics), "--trace", str(traces)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "metrics: " in proc.stdout and "trace.json" in proc.stdout

    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["strategy"] == "hetero" and x["step_time_s"] > 0 and x["tokens_per_s"] > 0 for x in lines)
    expected, _ = reference(plans["hetero"], STEPS)
    assert [x["loss"] for x in lines] == pytest.approx(expected, rel=1e-5)
    assert [x["lr"] for x in lines] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-12)  # the warmup's rates
    assert all(x["emulation_s"] > 0 for x in lines)  # devices 2 and 3 are emulated 3x slower

    events = json.loads((traces / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    for pid in range(4):
        kinds = {e["cat"] for e in spans if e["pid"] == pid}
        assert {"compute", "comm", "step"} <= kinds
        assert ("emulation" in kinds) == (pid in (2, 3))
    for pid in (2, 3):
        emulated = [e for e in spans if e["pid"] == pid and e["cat"] == "emulation"]
        measured = sum(e["args"]["compute_s"] for e in emulated)
        assert sum(e["dur"] for e in emulated) / 1e6 >= 0.95 * 2.0 * measured  # sleeps (3 - 1) x compute
        assert all(e["args"]["slowdown"] == 3.0 for e in emulated)
    for pid in range(4):
        assert (traces / f"device{pid}.json").is_file()


def test_a_killed_worker_stops_the_run_fast_and_names_the_device(plans):
    seen: list[float] = []
    options = TrainOptions(plan=plans["pp2"], steps=STEPS, faults=(Fault(device=1, step=2, kind="kill"),))
    with pytest.raises(WorkerFailure) as err:
        launch(options, on_step=lambda r: seen.append(time.monotonic()))
    took = time.monotonic() - seen[-1]
    assert len(seen) == 1  # step 1 finished, step 2 never did
    assert err.value.device == 1 and err.value.kind == "died" and err.value.exit_code == 1
    assert err.value.lines() == ["device 1 (rank 1): worker process was killed by SIGKILL"]
    assert took < 10.0, f"the launcher needed {took:.1f} s to notice and stop"
    assert multiprocessing.active_children() == []


def test_a_hung_worker_is_found_by_its_heartbeat(plans):
    options = TrainOptions(plan=plans["pp2"], steps=STEPS, heartbeat_timeout_s=3.0,
                           faults=(Fault(device=0, step=2, kind="hang"),))
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as err:
        launch(options)
    assert err.value.device == 0 and err.value.kind == "hung"
    assert "no heartbeat" in err.value.lines()[0]
    assert time.monotonic() - t0 < 60
    assert multiprocessing.active_children() == []


def test_a_user_error_in_a_worker_is_one_line_and_exit_code_2(tmp_path):
    plan = write_plan(tmp_path / "one.yaml", "one", [(2, [([0], (0, 6))])], global_batch=2)
    with pytest.raises(WorkerFailure) as err:
        launch(TrainOptions(plan=plan, steps=2, faults=(Fault(device=0, step=1, kind="user-error"),)))
    assert err.value.kind == "user" and err.value.exit_code == 2
    assert err.value.lines() == ["device 0 (rank 0): injected user error on device 0 at step 1"]


def test_cli_refuses_a_missing_data_file_in_one_line(plans, tmp_path):
    missing = tmp_path / "nope.txt"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plans["pp2"]), "--data",
                           str(missing)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {missing}: --data: file not found"]
