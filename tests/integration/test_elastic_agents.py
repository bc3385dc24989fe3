"""Node agents: the workers of an elastic job run under one agent per (emulated) node, on loopback; the
coordinator runs the same supervisor loop over them. Losing a whole agent is the failure of every device
on its node, and the survivors go on training exactly like the single-process reference. Agents with a
wrong token or for an unknown node are refused (exit 2, one line), and the job goes on."""

from __future__ import annotations

import json
import socket
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
    write_nodes_cluster,
    write_plan,
)

from runtime.elastic.agents import AgentSettings, launch_agents
from runtime.elastic.coordinator import ElasticPolicy
from runtime.launch import TrainOptions
from runtime.launch.options import NodeKill, Rejoin

FAST = {"timeout_s": 20.0, "heartbeat_timeout_s": 3.0}
TOKEN = "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(port: int, node: str, token: str = TOKEN) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hetu_cli", "agent", "--coordinator", f"127.0.0.1:{port}",
                             "--node", node, "--token", token, "--timeout", "60"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_an_agent_killed_with_two_devices_is_a_failure_of_both_and_its_node_comes_back(tmp_path):
    cluster = write_nodes_cluster(tmp_path / "two-nodes.yaml", [("fast0", "cpu-fast", 2), ("slow0", "cpu-slow", 2)])
    tp = write_plan(tmp_path / "tp.yaml", "tp", [(2, [([0, 1], (0, 6))]), (2, [([2], (0, 3)), ([3], (3, 6))])],
                    global_batch=4, cluster=str(cluster))
    alone = write_plan(tmp_path / "alone.yaml", "alone", [(4, [([0, 1], (0, 6))])], global_batch=4,
                       cluster=str(cluster))
    port = free_port()
    good = [agent(port, "fast0"), agent(port, "slow0")]
    bad = [agent(port, "fast0", token="wrong"), agent(port, "nowhere")]
    logs: list[str] = []
    events: list[dict] = []
    calls: list = []
    grows: list = []
    back: list[subprocess.Popen] = []

    def on_event(e: dict) -> None:
        events.append(e)
        if e["event"] == "failure":  # the node is repaired: its agent starts again and says hello
            back.append(agent(port, "slow0"))

    steps = 8
    options = TrainOptions(plan=tp, steps=steps, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           node_kills=(NodeKill("slow0", 3),), rejoins=(Rejoin(2, 6), Rejoin(3, 6)))
    try:
        summary = launch_agents(options, ElasticPolicy(fixed_replan(alone, calls), on_event, fixed_grow(tp, grows)),
                                AgentSettings(2, TOKEN, "127.0.0.1", port), on_log=logs.append)
        outs = [p.communicate(timeout=60) for p in good + bad + back]
    finally:
        for p in good + bad + back:
            if p.poll() is None:
                p.kill()
    expected, trainer = reference(tp, steps)
    assert [r.step for r in summary.records] == list(range(1, steps + 1))
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in summary.records] == ["tp", "tp", "alone", "alone", "alone", "tp", "tp", "tp"]
    assert calls == [(frozenset({2, 3}), "tp")]
    assert grows == [(frozenset({2, 3}), "alone", 3)]
    e, r = events
    assert e["event"] == "failure" and e["step"] == 3 and e["failed"] == [2, 3] and e["survivors"] == [0, 1]
    assert "node 'slow0' lost" in e["cause"]["2"]
    # The returning node's devices got their state (every layer, from the TP pair) by fused BSR.
    assert r["event"] == "rejoin" and r["step"] == 6 and r["joined"] == [2, 3] and r["switch_bytes"] > 0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)
    # The agent of fast0 saw the job through; slow0's was killed; the refused ones said why, in one line.
    assert good[0].returncode == 0 and good[1].returncode == -9 and back[0].returncode == 0
    assert bad[0].returncode == 2 and bad[1].returncode == 2
    assert outs[2][1].strip().splitlines()[-1].endswith("node 'fast0' refused: wrong job token")
    assert "unknown node 'nowhere'" in outs[3][1]
    assert any("refused an agent for node 'fast0'" in line and "wrong job token" in line for line in logs)
    assert any("refused an agent for node 'nowhere'" in line for line in logs)


def test_cli_coordinator_replays_a_trace_over_agents(tmp_path):
    # `hspmd train --elastic --agents 2 --events` with the planner: device 3 dies at step 2, node slow0 (now
    # only device 2) at step 4; the run still trains the reference's numbers.
    cluster = write_nodes_cluster(tmp_path / "two-nodes.yaml", [("fast0", "cpu-fast", 2), ("slow0", "cpu-slow", 2)])
    plan = write_plan(tmp_path / "dp.yaml", "dp", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]),
                                                   (2, [([2], (0, 3)), ([3], (3, 6))])], global_batch=4,
                      cluster=str(cluster))
    trace = tmp_path / "trace.yaml"
    trace.write_text("events:\n  - {step: 2, action: kill, devices: [3]}\n  - {step: 4, action: kill, node: slow0}\n")
    port = free_port()
    agents = [agent(port, "fast0"), agent(port, "slow0")]
    metrics = tmp_path / "m.jsonl"
    try:
        proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", "10",
                               "--elastic", "--agents", "2", "--bind", f"127.0.0.1:{port}", "--token", TOKEN,
                               "--events", str(trace), "--metrics", str(metrics), "--save", str(tmp_path / "ck"),
                               # an agent may be silent for half the heartbeat timeout (agent_timeout_s): 4 s,
                               # not 1.5, so that a loaded box's starved beat thread is not a lost node
                               "--timeout", "20", "--heartbeat-timeout", "8"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        for p in agents:
            p.communicate(timeout=60)
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"coordinator listening on 127.0.0.1:{port}" in proc.stdout
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    expected, trainer = reference(plan, 10)
    assert [x["loss"] for x in lines if "event" not in x] == pytest.approx(expected, rel=1e-5)
    failures = [x for x in lines if x.get("event") == "failure"]
    assert failures[0]["failed"] == [3]
    # Device 2 may be idle in the survivors' plan: its node's loss is then seen by its agent's silence only,
    # steps later, and nothing is redone (or the run is already saving: the others do not wait for it).
    late = "device 2 (idle in the plan) failed while the run finished: node 'slow0' lost" in proc.stdout
    assert [f["failed"] for f in failures[1:]] == ([] if late else [[2]]), proc.stdout
    assert late or "node 'slow0' lost" in failures[1]["cause"]["2"]
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)
    assert [p.returncode for p in agents] == [0, -9]
