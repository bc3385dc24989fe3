"""Elastic training: a device dies or hangs mid-run, the survivors switch to a new plan in memory and redo
the step, and the run trains exactly like the uninterrupted single-process reference: every step's loss
and the final parameters and AdamW moments (saved with --save, compared with ReferenceTrainer)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time

import pytest
from elastic_helpers import (
    REPO,
    assert_matches_reference,
    fixed_replan,
    reference,
    saved_state,
    write_plan,
)

from runtime.elastic.coordinator import ElasticPolicy
from runtime.launch import Fault, TrainOptions, launch
from runtime.torchfree.spec import load_plan_context

STEPS = 4
FAST = {"timeout_s": 20.0, "heartbeat_timeout_s": 3.0}  # a bug fails fast instead of hanging


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic-plans")
    return {
        # Pipeline 0 is TP-2 on the fast devices, pipeline 1 two stages on the slow ones: every parameter
        # is held twice, at two TP degrees.
        "tp": write_plan(d / "tp.yaml", "tp", [(2, [([0, 1], (0, 6))]), (2, [([2], (0, 3)), ([3], (3, 6))])],
                         global_batch=4),
        # Device 1 gone: device 0 alone holds pipeline 0 (it had half of every TP-split tensor).
        "tp-after-1": write_plan(d / "tp1.yaml", "after1", [(2, [([0], (0, 6))]), (2, [([2], (0, 3)), ([3], (3, 6))])],
                                 global_batch=4),
        # Three pipelines: two whole-model replicas and a 2-stage pipeline.
        "dp": write_plan(d / "dp.yaml", "dp", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                              (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4),
        # Device 3 gone: device 2 (layers 0-2) becomes a whole-model replica.
        "dp-after-3": write_plan(d / "dp3.yaml", "after3", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                           (2, [([2], (0, 6))])], global_batch=4),
        # Then devices 1 and 2 gone too: device 0 alone.
        "dp-after-1-2-3": write_plan(d / "dp123.yaml", "after123", [(4, [([0], (0, 6))])], global_batch=4),
        # A 3-stage pipeline beside a whole-model replica.
        "pp3": write_plan(d / "pp3.yaml", "pp3", [(3, [([0], (0, 2)), ([1], (2, 4)), ([2], (4, 6))]),
                                                  (1, [([3], (0, 6))])], global_batch=4),
        "pp3-after-0": write_plan(d / "pp3-0.yaml", "after0",
                                  [(2, [([1], (0, 3)), ([2], (3, 6))]), (2, [([3], (0, 6))])], global_batch=4),
        # One pipeline: layers 3-5 live on device 1 only.
        "single": write_plan(d / "single.yaml", "single", [(2, [([0], (0, 3)), ([1], (3, 6))])], global_batch=2),
    }


def _run(options: TrainOptions, replan) -> tuple[list, list[dict]]:
    events: list[dict] = []
    summary = launch(options, ElasticPolicy(replan, on_event=events.append))
    assert multiprocessing.active_children() == []
    return summary.records, events


def test_a_killed_device_holding_a_tp_shard_is_replaced_in_memory(plans, tmp_path):
    calls: list = []
    options = TrainOptions(plan=plans["tp"], steps=STEPS, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(device=1, step=3, kind="kill"),))
    records, events = _run(options, fixed_replan(plans["tp-after-1"], calls))
    expected, trainer = reference(plans["tp"], STEPS)
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in records] == ["tp", "tp", "after1", "after1"]
    assert calls == [(frozenset({1}), "tp")]
    (e,) = events
    assert e["event"] == "failure" and e["step"] == 3 and e["failed"] == [1] and e["survivors"] == [0, 2, 3]
    assert "SIGKILL" in e["cause"]["1"] and e["replanned"] and e["devices"] == [0, 2, 3]
    # Device 0 received the halves of the TP-split tensors that device 1 held (x3: parameter + 2 moments).
    assert e["switch_bytes"] > 0
    for key in ("detect_s", "abandon_s", "replan_s", "regroup_s", "transfer_s", "total_s", "recovery_s"):
        assert e[key] >= 0
    assert e["abandon_s"] < FAST["timeout_s"] / 2  # the survivors left at once, not by op timeout
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_survivors_blocked_on_survivors_leave_at_once(plans, tmp_path):
    # Stage 0 dies: stage 1 fails at once (its peer is gone), stage 2 waits on stage 1, which is alive. It
    # is released only because stage 1 shuts its sockets down as it leaves (not by its 20 s op timeout).
    options = TrainOptions(plan=plans["pp3"], steps=STEPS, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(device=0, step=3, kind="kill"),))
    records, events = _run(options, fixed_replan(plans["pp3-after-0"], []))
    expected, trainer = reference(plans["pp3"], STEPS)
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    (e,) = events
    assert e["failed"] == [0] and e["abandon_s"] < 5.0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_the_launchers_abort_alone_releases_survivors_blocked_on_survivors(plans, tmp_path):
    # As above, but stage 1 leaves without shutting its connections down (gloo_shut_on_leave=False): stage 2,
    # blocked on stage 1, is released only by the abort that its control-pipe thread performs on the
    # launcher's word, the one way NCCL has (runtime/comm/abort.py), not by its 20 s op timeout.
    options = TrainOptions(plan=plans["pp3"], steps=STEPS, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(device=0, step=3, kind="kill"),), gloo_shut_on_leave=False)
    records, events = _run(options, fixed_replan(plans["pp3-after-0"], []))
    expected, trainer = reference(plans["pp3"], STEPS)
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    (e,) = events
    assert e["failed"] == [0] and e["abandon_s"] < 5.0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_a_hang_then_two_deaths_at_once_across_two_generations(plans, tmp_path):
    # Step 2: device 3 stops (SIGSTOP); its heartbeat stops, the launcher kills it, device 2 takes the whole
    # model. Step 4: devices 1 and 2 die together; device 0 trains alone. Generation 2, three devices lost.
    asked: list = []
    answers = {frozenset({3}): plans["dp-after-3"], frozenset({1, 2, 3}): plans["dp-after-1-2-3"]}

    def replan(failed, ctx, strategy, steps_left):
        asked.append((failed, strategy))
        return load_plan_context(answers[failed])

    options = TrainOptions(plan=plans["dp"], steps=STEPS + 1, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(3, 2, "hang"), Fault(1, 4, "kill"), Fault(2, 4, "kill")))
    t0 = time.monotonic()
    records, events = _run(options, replan)  # no process left behind: the hung one was killed
    expected, trainer = reference(plans["dp"], STEPS + 1)
    assert [r.step for r in records] == [1, 2, 3, 4, 5]
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    assert asked == [(frozenset({3}), "dp"), (frozenset({1, 2, 3}), "after3")]
    hang, deaths = events
    assert (hang["step"], hang["failed"]) == (2, [3]) and "no heartbeat" in hang["cause"]["3"]
    assert FAST["heartbeat_timeout_s"] <= hang["detect_s"] < FAST["timeout_s"]
    assert (deaths["step"], deaths["failed"], deaths["survivors"]) == (4, [1, 2], [0])
    assert time.monotonic() - t0 < 120
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_a_parameter_without_a_surviving_replica_stops_the_run_and_keeps_the_checkpoint(plans, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "checkpoint.safetensors").write_bytes(b"an earlier checkpoint")
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plans["single"]), "--steps", "4",
                           "--elastic", "--kill-device", "1", "--at-step", "2", "--save", str(ck), "--timeout", "20"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0] == ("error: device(s) 1 failed during step 2 and 29 parameter(s) have no surviving replica, "
                         "so the run cannot continue in memory:")
    assert "error:   decoder layers 3-5 (27 tensors): held only by failed device(s) 1" in errors
    assert any("left as it was" in e for e in errors) and "Traceback" not in proc.stderr
    assert "replan" not in proc.stdout  # nothing to replan: the state is gone
    assert (ck / "checkpoint.safetensors").read_bytes() == b"an earlier checkpoint"


def test_cli_elastic_run_replans_with_the_planner_and_logs_the_costs(tmp_path):
    plan = write_plan(tmp_path / "hetero.yaml", "hetero",
                      [(2, [([0, 1], (0, 6))]), (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", "4",
                           "--elastic", "--kill-device", "0", "--at-step", "3", "--metrics", str(metrics),
                           "--save", str(tmp_path / "ck"), "--timeout", "20", "--no-preplan"],  # planned at the failure
                          cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert "device 0 failed during step 3" in proc.stdout
    assert "replan: " in proc.stdout and "recovered from the failure of device(s) 0" in proc.stdout
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [x for x in lines if "event" not in x]
    events = [x for x in lines if "event" in x]
    expected, trainer = reference(plan, 4)
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert [x["loss"] for x in steps] == pytest.approx(expected, rel=1e-5)
    (e,) = events
    assert e["event"] == "failure" and e["failed"] == [0] and 0 not in e["devices"]
    for key in ("detect_s", "replan_s", "regroup_s", "transfer_s", "total_s"):
        assert e[key] >= 0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)
