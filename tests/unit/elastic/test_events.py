"""Failure traces (--events): parsed against the cluster and the devices running at each step; every bad
trace is refused with one line naming the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.elastic.events import load_trace, parse_trace
from runtime.launch.options import Fault, NodeKill, Rejoin
from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_cluster

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
CLUSTER = load_cluster("cpu-hetero4")
PAPER = load_cluster("h800-h20-48")


def test_a_trace_replays_kills_hangs_and_rejoins_of_devices_and_nodes():
    # Two nodes (the slow pair on cpu1): killing the only node would leave no device running (refused).
    two = dataclasses.replace(CLUSTER, nodes=(CLUSTER.nodes[0], dataclasses.replace(CLUSTER.nodes[1], name="cpu1")))
    trace = parse_trace({"events": [{"step": 3, "action": "kill", "devices": [1]},
                                    {"step": 3, "action": "hang", "devices": [2]},
                                    {"step": 5, "action": "rejoin", "devices": [1]},
                                    {"step": 7, "action": "kill", "node": "cpu1"},
                                    {"step": 9, "action": "rejoin", "node": "cpu1"}]}, two, [0, 1, 2, 3], "t.yaml")
    assert trace.faults() == (Fault(1, 3, "kill"), Fault(2, 3, "hang"))
    assert trace.node_kills() == (NodeKill("cpu1", 7),)
    # The node kill takes its devices running then (3; 2 hung); the node's rejoin brings back both.
    assert [e.devices for e in trace.events] == [(1,), (2,), (1,), (3,), (2, 3)]
    assert trace.rejoins() == (Rejoin(1, 5), Rejoin(2, 9), Rejoin(3, 9))
    assert (trace.failures, trace.returns) == (3, 2)


@pytest.mark.parametrize("events,message", [
    ([{"step": 3, "action": "kill", "devices": [9]}],
     "t.yaml: events[0].devices[0]: unknown device 9 (cluster 'cpu-hetero4' has devices 0-3)"),
    ([{"step": 5, "action": "kill", "devices": [1]}, {"step": 3, "action": "kill", "devices": [2]}],
     "t.yaml: events[1].step: step 3 comes after step 5: events must be in step order"),
    ([{"step": 3, "action": "kill", "node": "cpu7"}],
     "t.yaml: events[0].node: unknown node 'cpu7' (cluster 'cpu-hetero4' has nodes cpu0)"),
    ([{"step": 3, "action": "explode", "devices": [1]}],
     "t.yaml: events[0].action: must be one of kill, hang, rejoin, got 'explode'"),
    ([{"step": 3, "action": "rejoin", "devices": [1]}],
     "t.yaml: events[0].devices[0]: device 1 is running at step 3: nothing to rejoin"),
    ([{"step": 3, "action": "kill", "devices": [1]}, {"step": 4, "action": "kill", "devices": [1]}],
     "t.yaml: events[1].devices[0]: device 1 is not running at step 4"),
    ([{"step": 3, "action": "kill", "devices": [1], "node": "cpu0"}],
     "t.yaml: events[0]: give exactly one of 'devices' or 'node'"),
    ([{"step": 0, "action": "kill", "devices": [1]}], "t.yaml: events[0].step: must be an integer >= 1, got 0"),
    ([{"step": 3, "action": "kill", "devices": [1], "when": 2}],
     "t.yaml: events[0].when: unknown field (have: step, action, devices, node)"),
])
def test_a_bad_trace_is_one_line_naming_the_field(events, message):
    with pytest.raises(SpecError) as err:
        parse_trace({"events": events}, CLUSTER, [0, 1, 2, 3], "t.yaml")
    assert err.value.lines() == [message]


def flapping(n: int) -> list[dict]:
    return [{"step": i + 2, "action": "kill" if i % 2 == 0 else "rejoin", "devices": [3]} for i in range(n)]


@pytest.mark.parametrize("data,message", [
    # Each event is a replan (~0.2 s on llama-tiny): 20,000 of them ran simulate --events for an hour.
    ({"events": flapping(1001)}, "t.yaml: events: 1,001 events: hspmd models traces of at most 1,000 (each is a "
                                 "replan)"),
    # Modelled as given: 1152921504606846976 steps, 5.6e16 s of hspmd.
    ({"steps": 2**60, "events": flapping(1)}, "t.yaml: steps: 1,152,921,504,606,846,976 steps: hspmd models traces "
                                              "of at most 1,000,000,000"),
    ({"events": [{"step": 10**20, "action": "kill", "devices": [3]}]},
     "t.yaml: events[0].step: step 100,000,000,000,000,000,000: hspmd models traces of at most 1,000,000,000 steps"),
])
def test_a_trace_past_the_bounds_is_one_line(data, message):
    with pytest.raises(SpecError) as err:
        parse_trace(data, CLUSTER, [0, 1, 2, 3], "t.yaml")
    assert err.value.lines() == [message]
    assert parse_trace({"steps": 10**9, "events": flapping(1000)}, CLUSTER, [0, 1, 2, 3], "t.yaml").steps == 10**9


def test_cli_refuses_a_bad_trace_and_a_rejoin_outside_the_cluster(tmp_path):
    trace = tmp_path / "trace.yaml"
    trace.write_text("events:\n  - {step: 4, action: kill, devices: [2]}\n"
                     "  - {step: 2, action: rejoin, devices: [2]}\n")
    res = CliRunner().invoke(cli, ["train", "--plan", str(TINY), "--steps", "6", "--elastic", "--events", str(trace)])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == (f"error: {trace}: events[1].step: step 2 comes after step 4: "
                                                   "events must be in step order")
    res = CliRunner().invoke(cli, ["train", "--plan", str(TINY), "--steps", "6", "--elastic", "--rejoin-device", "7",
                                   "--at-step", "3"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == ("error: --rejoin-device: device(s) [7] are not in cluster "
                                                   "'cpu-hetero4' (devices 0-3)")
    res = CliRunner().invoke(cli, ["train", "--plan", str(TINY), "--elastic", "--agents", "2"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == ("error: --agents: give the job token with --token (every agent "
                                                   "presents it)")


def test_a_paper_scale_trace_loads_from_a_file(tmp_path):
    trace = tmp_path / "t.yaml"
    trace.write_text("events:\n  - {step: 100, action: kill, devices: [40]}\n"
                     "  - {step: 300, action: rejoin, devices: [40]}\n")
    t = load_trace(trace, PAPER, range(48))
    assert t.failures == 1 and t.returns == 1
