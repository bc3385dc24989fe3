"""Failure traces: which devices or nodes fail, hang and return, and when (``--events trace.yaml``).

::

    steps: 60                                      # optional: the steps it spans (simulate)
    events:
      - {step: 10, action: kill, devices: [3]}
      - {step: 25, action: kill, node: cpu1}       # the node's agent and every worker on it
      - {step: 40, action: rejoin, devices: [3]}
      - {step: 50, action: rejoin, node: cpu1}     # every device of the node that is not running

The same trace drives a training run (``hspmd train --elastic --events``: kills and hangs become injected
faults, node kills kill the node's agent, rejoins start workers that join the running job) and the
model of a run at paper scale (``hspmd simulate --events``). It is checked against the cluster and the
devices running at each step (replayed from the plan's devices): a trace that names an unknown device or
node, that goes back in steps, or that kills a device that is not running, is refused with one line
naming the field. Pure (no torch).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from runtime.launch.options import Fault, NodeKill, Rejoin
from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.io import read_yaml

Action = Literal["kill", "hang", "rejoin"]


@dataclass(frozen=True)
class TraceEvent:
    """One event, resolved: the devices it concerns (a node's devices that were running, or returning)."""

    step: int
    action: Action
    devices: tuple[int, ...]
    node: str | None = None  # set when the file named a node

    def __post_init__(self) -> None:
        if self.action not in get_args(Action):
            raise ValueError(f"unknown action {self.action!r}")
        if self.step < 1 or not self.devices:
            raise ValueError("an event needs a step >= 1 and at least one device")


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]
    steps: int | None = None  # the steps the trace spans (``hspmd simulate --events``; train has --steps)

    def faults(self) -> tuple[Fault, ...]:
        """Kills and hangs of named devices: injected in the workers (a node kill is the agent's)."""
        return tuple(Fault(d, e.step, e.action) for e in self.events if e.action != "rejoin" and e.node is None
                     for d in e.devices)  # type: ignore[arg-type]

    def node_kills(self) -> tuple[NodeKill, ...]:
        return tuple(NodeKill(e.node, e.step) for e in self.events if e.action == "kill" and e.node is not None)

    def rejoins(self) -> tuple[Rejoin, ...]:
        return tuple(Rejoin(d, e.step) for e in self.events if e.action == "rejoin" for d in e.devices)

    @property
    def failures(self) -> int:
        return sum(1 for e in self.events if e.action != "rejoin")

    @property
    def returns(self) -> int:
        return sum(1 for e in self.events if e.action == "rejoin")


# Bounds on what a (hostile) trace makes every reader enumerate: each event is a replan (~0.2 s on the tiny
# model; 20,000 events ran for an hour), and a step count past 10**9 is no run (2**60 steps was modelled).
MAX_TRACE_EVENTS = 1000
MAX_TRACE_STEPS = 10**9
# The planner searches one modelled trace may run by default (planner/trace_model.py ``TraceModel.max_searches``:
# every modelled line's, a device set searched before free). Each is 0.4 s on the tiny model, 8-10 s at paper
# scale: 100 bound ``simulate --events`` to ~15 min there. An event costs at most 7 (hspmd's search and its
# fallback, restart's, Megatron's two symmetric ones, the Oobleck-like template and restart), the start 3: the
# benchmark's paper-scale trace (6 events) at most 45. A hostile trace of 1000 distinct device sets was 1000+
# searches (hours).
MAX_TRACE_SEARCHES = 100


def load_trace(path: str | Path, cluster: Cluster, running: Collection[int]) -> Trace:
    """Read and check a trace file; ``running``: the devices the run starts on."""
    data = read_yaml(path)
    return parse_trace(data, cluster, running, str(path))


def parse_trace(data: Any, cluster: Cluster, running: Collection[int], file: str) -> Trace:
    def bad(field: str, message: str) -> SpecError:
        return SpecError([Problem(file, field, message)])

    if not isinstance(data, dict) or "events" not in data or not set(data) <= {"events", "steps"}:
        raise bad("", "expected a mapping with 'events' (a list of {step, action, devices | node}) and optionally "
                      "'steps'")
    items = data["events"]
    steps = data.get("steps")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise bad("steps", f"must be an integer >= 1, got {steps!r}")
    if steps is not None and steps > MAX_TRACE_STEPS:
        raise bad("steps", f"{steps:,} steps: hspmd models traces of at most {MAX_TRACE_STEPS:,}")
    if not isinstance(items, list):
        raise bad("events", "must be a list of {step, action, devices | node}")
    if len(items) > MAX_TRACE_EVENTS:
        raise bad("events", f"{len(items):,} events: hspmd models traces of at most {MAX_TRACE_EVENTS:,} (each is "
                            "a replan)")
    nodes = {n.name for n in cluster.nodes}
    node_devices = {name: tuple(d.id for d in cluster.devices if d.node == name) for name in nodes}
    alive = set(running)
    out: list[TraceEvent] = []
    last_step = 0
    for i, item in enumerate(items):
        at = f"events[{i}]"
        if not isinstance(item, dict):
            raise bad(at, "must be a mapping {step, action, devices | node}")
        unknown = sorted(set(map(str, item)) - {"step", "action", "devices", "node"})
        if unknown:
            raise bad(f"{at}.{unknown[0]}", "unknown field (have: step, action, devices, node)")
        step = item.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise bad(f"{at}.step", f"must be an integer >= 1, got {step!r}")
        if step > MAX_TRACE_STEPS:
            raise bad(f"{at}.step", f"step {step:,}: hspmd models traces of at most {MAX_TRACE_STEPS:,} steps")
        if step < last_step:
            raise bad(f"{at}.step", f"step {step} comes after step {last_step}: events must be in step order")
        last_step = step
        action = item.get("action")
        if action not in get_args(Action):
            raise bad(f"{at}.action", f"must be one of kill, hang, rejoin, got {action!r}")
        if ("devices" in item) == ("node" in item):
            raise bad(at, "give exactly one of 'devices' or 'node'")
        node = None
        if "node" in item:
            node = item["node"]
            if not isinstance(node, str) or node not in nodes:
                raise bad(f"{at}.node", f"unknown node {node!r} (cluster {cluster.name!r} has nodes "
                                        f"{', '.join(sorted(nodes))})")
            if action == "hang":
                raise bad(f"{at}.action", "a node can be killed or rejoin; hang names devices")
            if action == "kill":
                devices = tuple(d for d in node_devices[node] if d in alive)
                if not devices:
                    raise bad(f"{at}.node", f"no device of node {node!r} is running at step {step}")
            else:
                devices = tuple(d for d in node_devices[node] if d not in alive)
                if not devices:
                    raise bad(f"{at}.node", f"every device of node {node!r} is running at step {step}: nothing "
                                            "to rejoin")
        else:
            raw = item["devices"]
            if not isinstance(raw, list) or not raw:
                raise bad(f"{at}.devices", "must be a non-empty list of device ids")
            for j, d in enumerate(raw):
                if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < cluster.num_devices:
                    raise bad(f"{at}.devices[{j}]", f"unknown device {d!r} (cluster {cluster.name!r} has devices "
                                                    f"0-{cluster.num_devices - 1})")
                if action != "rejoin" and d not in alive:
                    raise bad(f"{at}.devices[{j}]", f"device {d} is not running at step {step}")
                if action == "rejoin" and d in alive:
                    raise bad(f"{at}.devices[{j}]", f"device {d} is running at step {step}: nothing to rejoin")
            if len(set(raw)) != len(raw):
                raise bad(f"{at}.devices", "names a device twice")
            devices = tuple(sorted(raw))
        if (action == "rejoin" or node is not None) and step < 2:
            raise bad(f"{at}.step", "a rejoin or a node kill comes after the first step (>= 2)")
        if action == "rejoin":
            alive |= set(devices)
        else:
            alive -= set(devices)
        if not alive:  # nothing left to train or replan on (the modelled run said "no devices to plan on")
            raise bad(at, f"leaves no device running at step {step}: a trace keeps at least one")
        out.append(TraceEvent(step, action, devices, node))
    if not out:
        raise bad("events", "is empty")
    if steps is not None and out[-1].step > steps:
        raise bad("steps", f"{steps} ends before the last event (step {out[-1].step})")
    return Trace(tuple(out), steps)


__all__ = ["Trace", "TraceEvent", "load_trace", "parse_trace"]
