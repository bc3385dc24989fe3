"""Planned switching: A -> B -> A in memory moves parameters and AdamW moments with one fused BSR each
way and returns the state bit for bit; a run with switches trains exactly like the reference."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

import pytest
import torch
from elastic_helpers import (
    REPO,
    assert_matches_reference,
    fixed_replan,
    reference,
    saved_state,
    switch_roundtrip_job,
    write_plan,
)

from runtime.comm.world import LocalWorld
from runtime.elastic.coordinator import ElasticPolicy
from runtime.launch import TrainOptions, launch
from runtime.launch.options import PlannedSwitch


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("switch-plans")
    return {
        # A: TP-2 on the fast devices beside a 2-stage pipeline on the slow ones.
        "a": write_plan(d / "a.yaml", "a", [(2, [([0, 1], (0, 6))]), (2, [([2], (0, 3)), ([3], (3, 6))])],
                        global_batch=4),
        # B: other devices hold other slices: a 2-stage pipeline 0 -> 1 with another split, and device 3
        # alone with the whole model; device 2 is idle (it holds nothing under B).
        "b": write_plan(d / "b.yaml", "b", [(2, [([0], (0, 2)), ([1], (2, 6))]), (2, [([3], (0, 6))])],
                        global_batch=4, micro_batch=1),
    }


def test_switch_a_b_a_returns_bit_identical_state(plans):
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 256, (4, 17), generator=g).numpy() for _ in range(2)]
    with LocalWorld(4, timeout_s=60) as world:
        out = [r for r in world.run(switch_roundtrip_job, str(plans["a"]), str(plans["b"]), batches, timeout_s=120)
               if r is not None]
    assert sorted(r["device"] for r in out) == [0, 1, 2, 3]
    assert all(r["same_keys"] and r["moved"] for r in out)
    assert all(r["identical"] for r in out), [r["device"] for r in out if not r["identical"]]
    assert not next(r for r in out if r["device"] == 2)["held_on_b"]
    assert out[0]["bytes_forth"] > 0


def test_cli_switches_a_b_a_and_trains_like_the_reference(plans, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plans["a"]), "--steps", "5",
                           "--switch", f"3:{plans['b']}", "--switch", f"5:{plans['a']}", "--metrics", str(metrics),
                           "--save", str(tmp_path / "ck"), "--timeout", "30"],
                          cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [x for x in lines if "event" not in x]
    events = [x for x in lines if "event" in x]
    expected, trainer = reference(plans["a"], 5)
    assert [x["strategy"] for x in steps] == ["a", "a", "b", "b", "a"]
    assert [x["loss"] for x in steps] == pytest.approx(expected, rel=1e-5)
    assert [(e["event"], e["step"], e["strategy"]) for e in events] == [("switch", 3, "b"), ("switch", 5, "a")]
    assert all(e["switch_bytes"] > 0 and e["total_s"] > 0 for e in events)
    assert "switch at step 3" in proc.stdout
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


class KillDuringSwitch(ElasticPolicy):
    """Kills ``victim`` the moment a planned switch's transition is sent (right after the hold before it)."""

    def __init__(self, victim: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim = victim
        self.killed_at: int | None = None

    def start_switch(self, step: int) -> None:
        super().start_switch(step)
        if self.killed_at is None:
            self.killed_at = step
            self.workers[self.victim].kill()


def test_a_failure_during_a_planned_switch_goes_to_its_plan_and_trains_like_the_reference(plans, tmp_path):
    # Elastic run of A with a switch to B before step 3; device 2 (in A, idle in B) dies while the switch
    # runs. The switch is not lost: the recovery goes straight to B, and step 3 is trained on it.
    steps = 5
    events: list[dict] = []
    options = TrainOptions(plan=plans["a"], steps=steps, elastic=True, save_dir=tmp_path / "ck", timeout_s=20.0,
                           heartbeat_timeout_s=3.0, switches=(PlannedSwitch(3, plans["b"]),))
    asked: list = []
    policy = KillDuringSwitch(2, fixed_replan(plans["a"], asked), events.append)
    summary = launch(options, policy)
    assert multiprocessing.active_children() == []
    assert policy.killed_at == 3 and asked == []  # B avoids device 2: nothing to re-plan
    expected, trainer = reference(plans["a"], steps)
    assert [r.step for r in summary.records] == list(range(1, steps + 1))
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in summary.records] == ["a", "a", "b", "b", "b"]
    (failure,) = events
    assert failure["event"] == "failure" and failure["failed"] == [2] and failure["strategy"] == "b"
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)
