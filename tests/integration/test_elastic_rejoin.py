"""Grow back: a device killed mid-run returns, joins the running job at a step boundary (a new world with
it in it), receives its state by fused BSR from the holders, and the run still trains exactly like the
uninterrupted single-process reference (every step's loss, the final parameters and AdamW moments)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

import pytest
from elastic_helpers import (
    REPO,
    assert_matches_reference,
    fixed_grow,
    fixed_replan,
    reference,
    saved_state,
    write_plan,
)

from runtime.elastic.coordinator import ElasticPolicy
from runtime.launch import Fault, TrainOptions, launch
from runtime.launch.options import Rejoin
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan_context

FAST = {"timeout_s": 20.0, "heartbeat_timeout_s": 3.0}


def kill_and_return_plans(tmp_path):
    """The plans of device 1's death and return: ``dp`` (whole-model replicas on 0 and 1 beside a 2-stage
    pipeline on 2, 3), ``without1`` (device 1 gone) and ``back`` (a whole-model replica on device 1 again,
    every tensor of it received from devices 0, 2, 3)."""
    dp = write_plan(tmp_path / "dp.yaml", "dp", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                 (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    without1 = write_plan(tmp_path / "dp1.yaml", "without1", [(2, [([0], (0, 6))]),
                                                              (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    back = write_plan(tmp_path / "back.yaml", "back", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                       (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    return dp, without1, back


def test_a_killed_device_rejoins_and_gets_its_state_back(tmp_path):
    dp, without1, back = kill_and_return_plans(tmp_path)
    steps = 6
    replans: list = []
    grows: list = []
    events: list[dict] = []
    options = TrainOptions(plan=dp, steps=steps, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(1, 2, "kill"),), rejoins=(Rejoin(1, 4),))
    summary = launch(options, ElasticPolicy(fixed_replan(without1, replans), events.append,
                                            fixed_grow(back, grows)))
    assert multiprocessing.active_children() == []
    expected, trainer = reference(dp, steps)
    records = summary.records
    assert [r.step for r in records] == list(range(1, steps + 1))
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in records] == ["dp", "without1", "without1", "back", "back", "back"]
    assert replans == [(frozenset({1}), "dp")]
    assert grows == [(frozenset({1}), "without1", 3)]
    failure, rejoin = events
    assert failure["event"] == "failure" and failure["failed"] == [1]
    assert rejoin["event"] == "rejoin" and rejoin["joined"] == [1] and rejoin["step"] == 4
    assert rejoin["devices"] == [0, 1, 2, 3] and rejoin["switch_bytes"] > 0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_a_return_decided_ahead_joins_without_the_foreground_grower(tmp_path):
    # After device 1's death the coordinator plans the new layout's losses, then decides device 1's return,
    # in the background; when device 1 comes back the decision is a lookup.
    dp, without1, back = kill_and_return_plans(tmp_path)
    steps = 7
    foreground: list = []
    ahead: list = []
    events: list[dict] = []

    def no_plan_ahead(failed, ctx, strategy, steps_left):
        raise HspmdError("not planned ahead here")  # the failure itself is planned in the foreground

    options = TrainOptions(plan=dp, steps=steps, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(1, 2, "kill"),), rejoins=(Rejoin(1, 5),))
    summary = launch(options, ElasticPolicy(fixed_replan(without1, []), events.append, fixed_grow(back, foreground),
                                            preplan=no_plan_ahead, preplan_grow=fixed_grow(back, ahead)))
    assert multiprocessing.active_children() == []
    expected, trainer = reference(dp, steps)
    records = summary.records
    assert [r.step for r in records] == list(range(1, steps + 1))
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in records] == ["dp", "without1", "without1", "without1", "back", "back", "back"]
    assert foreground == []  # the foreground grow planner was never called
    # decided once, on the layout without device 1, as its first step (the redone step 2) began: 6 steps left
    # then, one fewer for a return to gain on
    assert ahead == [(frozenset({1}), "without1", 5)]
    failure, rejoin = events
    assert failure["event"] == "failure" and failure["preplanned"] is False
    assert rejoin["event"] == "rejoin" and rejoin["joined"] == [1] and rejoin["step"] == 5
    assert rejoin["preplanned"] is True and rejoin["devices"] == [0, 1, 2, 3]
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_two_failures_in_consecutive_steps_then_the_rejoined_device_fails_again(tmp_path):
    # Step 2: device 3 dies (device 2 takes the whole model); step 3: device 1 dies (devices 0 and 2 go
    # on). Device 1 returns for step 5 and dies again in its first step back: a failure right after a
    # rejoin, recovered from the state it had just received (and the others').
    dp = write_plan(tmp_path / "dp.yaml", "dp", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                 (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    after3 = write_plan(tmp_path / "a3.yaml", "after3", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                         (2, [([2], (0, 6))])], global_batch=4)
    two = write_plan(tmp_path / "two.yaml", "two", [(2, [([0], (0, 6))]), (2, [([2], (0, 6))])], global_batch=4)
    three = write_plan(tmp_path / "three.yaml", "three", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                          (2, [([2], (0, 6))])], global_batch=4)
    answers = {frozenset({3}): after3, frozenset({1, 3}): two}
    asked: list = []

    def replan(failed, ctx, strategy, steps_left):
        asked.append((failed, strategy))
        return load_plan_context(answers[failed])

    steps = 7
    events: list[dict] = []
    options = TrainOptions(plan=dp, steps=steps, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(3, 2, "kill"), Fault(1, 3, "kill"), Fault(1, 5, "kill")),
                           rejoins=(Rejoin(1, 5),))
    summary = launch(options, ElasticPolicy(replan, events.append, fixed_grow(three, [])))
    assert multiprocessing.active_children() == []
    expected, trainer = reference(dp, steps)
    assert [r.step for r in summary.records] == list(range(1, steps + 1))
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in summary.records] == ["dp", "after3", "two", "two", "two", "two", "two"]
    assert asked == [(frozenset({3}), "dp"), (frozenset({1, 3}), "after3"), (frozenset({1, 3}), "three")]
    assert [(e["event"], e["step"]) for e in events] == [("failure", 2), ("failure", 3), ("rejoin", 5),
                                                         ("failure", 5)]
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_cli_kill_then_rejoin_asks_the_planner_whether_the_return_pays(tmp_path):
    # The planner decides (adopt or stay, both logged); either way the run trains the reference's numbers.
    plan = write_plan(tmp_path / "dp.yaml", "dp", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                   (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", "8", "--elastic",
                           "--kill-device", "1", "--at-step", "2", "--rejoin-device", "1", "--rejoin-at-step", "5",
                           "--metrics", str(metrics), "--save", str(tmp_path / "ck"), "--timeout", "20"],
                          cwd=REPO, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    assert "device 1 returns: its worker starts now, to train from step 5" in proc.stdout
    # decided in the foreground (the planner's line) or, when the background got there first, looked up
    grow = [line for line in proc.stdout.splitlines() if "grow: " in line or "grow decision was planned ahead" in line]
    assert len(grow) == 1, grow
    ahead = "planned ahead" in grow[0]
    adopt = ": adopt, without planning now" in grow[0] if ahead else "grow: adopt with device(s) 1" in grow[0]
    assert adopt or (": stay, without planning now" in grow[0] if ahead else "grow: stay" in grow[0]), grow
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    events = [x for x in lines if "event" in x]
    assert [x["event"] for x in events] == (["failure", "rejoin"] if adopt else ["failure"])
    assert all(x["preplanned"] == ahead for x in events if x["event"] == "rejoin")
    expected, trainer = reference(plan, 8)
    assert [x["loss"] for x in lines if "event" not in x] == pytest.approx(expected, rel=1e-5)
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


class KillDuringGrowth(ElasticPolicy):
    """Kills ``victim`` the moment the transition that adopts a returning device is sent: a holder dies
    while the newcomer receives its state by fused BSR."""

    def __init__(self, victim: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim = victim
        self.killed_at: int | None = None

    def start_growth(self) -> None:
        super().start_growth()
        if self.killed_at is None:
            self.killed_at = self.committed + 1
            self.workers[self.victim].kill()


def test_a_holder_dies_while_the_returning_device_receives_its_state(tmp_path):
    # Device 1 dies at step 2 and returns for step 4; while the transition that adopts it runs, device 3
    # (a holder, sending state to it) is killed. The growth is void: the survivors 0 and 2 recover from
    # their own state (device 2 takes the whole model), and device 1, still up, is asked for again on the
    # plan after the recovery and adopted then.
    dp, without1, back = kill_and_return_plans(tmp_path)
    two = write_plan(tmp_path / "two.yaml", "two", [(2, [([0], (0, 6))]), (2, [([2], (0, 6))])], global_batch=4)
    three = write_plan(tmp_path / "three.yaml", "three", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                          (2, [([2], (0, 6))])], global_batch=4)
    replans = {frozenset({1}): without1, frozenset({1, 3}): two, frozenset({3}): two}
    grows = {"without1": back, "two": three}
    asked: list = []

    def replan(failed, ctx, strategy, steps_left):
        asked.append(("replan", failed, strategy))
        return load_plan_context(replans[failed])

    def grow(joining, ctx, strategy, steps_left):
        asked.append(("grow", joining, strategy))
        return load_plan_context(grows[strategy])

    steps = 7
    events: list[dict] = []
    options = TrainOptions(plan=dp, steps=steps, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(1, 2, "kill"),), rejoins=(Rejoin(1, 4),))
    policy = KillDuringGrowth(3, replan, events.append, grow)
    summary = launch(options, policy)
    assert multiprocessing.active_children() == []
    assert policy.killed_at == 4
    expected, trainer = reference(dp, steps)
    assert [r.step for r in summary.records] == list(range(1, steps + 1))
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    assert asked[:2] == [("replan", frozenset({1}), "dp"), ("grow", frozenset({1}), "without1")]
    # The recovery is planned from the plan that ran (without1), without device 3; device 1 is asked again.
    assert asked[2][0] == "replan" and asked[2][1] >= {3} and asked[2][2] == "without1"
    assert asked[3:] == [("grow", frozenset({1}), "two")]
    strategies = [r.strategy for r in summary.records]
    assert strategies[:4] == ["dp", "without1", "without1", "two"] and strategies[-1] == "three"
    kinds = [(e["event"], e["step"]) for e in events]
    assert kinds[0] == ("failure", 2) and kinds[1] == ("failure", 4) and kinds[2][0] == "rejoin"
    assert events[1]["failed"] == [3] and events[2]["joined"] == [1]
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_a_new_device_joins_a_running_job(tmp_path):
    # Device 1 is in the cluster but not in the starting plan; it joins at step 3 and receives a whole
    # replica by fused BSR from devices 0, 2 and 3.
    start = write_plan(tmp_path / "start.yaml", "start", [(2, [([0], (0, 6))]),
                                                          (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    grown = write_plan(tmp_path / "grown.yaml", "grown", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                          (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    steps = 5
    grows: list = []
    events: list[dict] = []
    options = TrainOptions(plan=start, steps=steps, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           rejoins=(Rejoin(1, 3),))
    summary = launch(options, ElasticPolicy(fixed_replan(start, []), events.append, fixed_grow(grown, grows)))
    assert multiprocessing.active_children() == []
    expected, trainer = reference(start, steps)
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in summary.records] == ["start", "start", "grown", "grown", "grown"]
    assert grows == [(frozenset({1}), "start", 3)]
    (rejoin,) = events
    assert rejoin["event"] == "rejoin" and rejoin["joined"] == [1] and rejoin["step"] == 3
    assert rejoin["devices"] == [0, 1, 2, 3] and rejoin["switch_bytes"] > 0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)
