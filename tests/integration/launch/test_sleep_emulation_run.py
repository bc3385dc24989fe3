"""A small run on cpu-hetero4-sleep: every forward / backward block sleeps exactly to its target (or records
its overrun), the targets are the ones the block-pricing function gives the device's stage, and the per-step
metrics sum what the hooks recorded; without the harness's targets the launcher refuses the run. Behaviour,
not speed (speed: scripts/bench_simulator.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from train_helpers import EPS, HETERO_PLAN, reference

from hetu_cli.emulation import SleepBlockTargets, emulated
from runtime.launch import TrainOptions, launch
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

STEPS = 2
ROUND = 2e-6   # the trace rounds each figure to 1e-6 s


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sleep")
    base = load_plan(HETERO_PLAN)
    # Device 0 (an emulated A800) holds the embedding and layers 0-2, device 2 (an H20) layers 3-5 and the head.
    strategy = Strategy("pp2", (Pipeline(2, (Stage((0,), (0, 3)), Stage((2,), (3, 6)))),))
    t = base.training
    training = dataclasses.replace(t, global_batch=2, micro_batch=1, seq_len=64,
                                   optimizer=dataclasses.replace(t.optimizer, lr=1e-3, eps=EPS))
    plan = dataclasses.replace(base, cluster="cpu-hetero4-sleep", strategies=(strategy,), training=training)
    path = d / "pp2.yaml"
    save_plan(plan, path)
    traces = d / "traces"
    summary = launch(emulated(TrainOptions(plan=path, steps=STEPS, trace_dir=traces)))
    return path, traces, summary


def spans_of(traces: Path, device: int) -> list[dict]:
    events = json.loads((traces / f"device{device}.json").read_text())["traceEvents"]
    return sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))


def test_losses_are_the_reference(run):
    path, _, summary = run
    expected, _ = reference(path, STEPS)
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("device", [0, 2])
def test_each_block_sleeps_to_the_target_its_stage_is_priced_at(run, device):
    path, traces, _ = run
    price = SleepBlockTargets().for_device(load_plan_context(path), "pp2", device)
    spans = spans_of(traces, device)
    blocks = [e for e in spans if e["cat"] == "compute" and e["name"] in ("forward", "backward")]
    emulation = [e for e in spans if e["cat"] == "emulation" and "woke past" not in e["name"]]
    assert len(blocks) == STEPS * 2 * 2 and len(emulation) == len(blocks)   # 2 micro-batches, F and B
    for block, emu in zip(blocks, emulation):
        args = emu["args"]
        assert emu["name"].startswith(block["name"])
        assert emu["ts"] >= block["ts"] + block["dur"] - 1e-3        # right after its block
        assert args["target_s"] == pytest.approx(price(block["name"], {}), abs=ROUND)
        assert args["compute_s"] >= block["dur"] / 1e6 - ROUND      # the block's whole real work
        if "sleep_s" in args:                                        # finished early: slept the rest
            assert args["sleep_s"] == pytest.approx(args["target_s"] - args["compute_s"], abs=ROUND)
            # ... to the block's deadline, its start plus its target (the wait's spin ends on it)
            assert (emu["ts"] + emu["dur"]) / 1e6 >= (block["ts"] / 1e6 + args["target_s"]) - 5e-5
        else:                                                        # overran: recorded, not hidden
            assert "overran" in emu["name"]
            assert args["overrun_s"] == pytest.approx(args["compute_s"] - args["target_s"], abs=ROUND)
    # The optimizer step has no target: it runs as it is.
    assert any(e["cat"] == "compute" and e["name"] == "optimizer" for e in spans)


def test_step_metrics_sum_the_recorded_sleeps_and_overruns(run):
    _, traces, summary = run
    per_device = {}
    for device in (0, 2):
        spans = spans_of(traces, device)
        steps = [e for e in spans if e["cat"] == "step"]
        assert len(steps) == STEPS
        sums = []
        for st in steps:
            inside = [e for e in spans if e["cat"] == "emulation" and st["ts"] <= e["ts"] <= st["ts"] + st["dur"]]
            sums.append((sum(e["args"].get("sleep_s", 0.0) for e in inside),
                         sum(e["args"].get("overrun_s", 0.0) for e in inside)))
        per_device[device] = sums
    for i, rec in enumerate(summary.records):
        assert rec.emulation_s == pytest.approx(max(per_device[d][i][0] for d in per_device), abs=1e-5)
        assert rec.emulation_overrun_s == pytest.approx(max(per_device[d][i][1] for d in per_device), abs=1e-5)


def test_a_sleep_mode_run_without_its_targets_is_refused(run):
    path, _, _ = run
    with pytest.raises(HspmdError, match="sleep-mode device types .* target durations"):
        launch(TrainOptions(plan=path, steps=1))
