"""Grow back: a device killed mid-run returns, joins the running job at a step boundary (a new world with
it in it), receives its state by fused BSR from the holders, and the run still trains exactly like the
uninterrupted single-process reference (every step's loss, the final parameters and AdamW moments)."""

from __future__ import annotations

import multiprocessing

import pytest
from elastic_helpers import assert_matches_reference, fixed_grow, fixed_replan, reference, saved_state, write_plan

from runtime.elastic.coordinator import ElasticPolicy
from runtime.launch import Fault, TrainOptions, launch
from runtime.launch.options import Rejoin

FAST = {"timeout_s": 20.0, "heartbeat_timeout_s": 3.0}


def test_a_killed_device_rejoins_and_gets_its_state_back(tmp_path):
    dp = write_plan(tmp_path / "dp.yaml", "dp", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                 (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    without1 = write_plan(tmp_path / "dp1.yaml", "without1", [(2, [([0], (0, 6))]),
                                                              (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
    # Back with device 1: a whole-model replica again, every tensor of it received from devices 0, 2, 3.
    back = write_plan(tmp_path / "back.yaml", "back", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                       (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4)
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
