"""A planned --switch in an elastic run, and a failure right after the "hold" before it (or during its
transition): the switch is never silently dropped. The recovery goes to the switch's plan (re-planned for
its survivors when it names the failed device); one that cannot be re-planned is dropped, logged and
reported. ElasticPolicy without processes: recording links, the one supervisor loop's calls."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from runtime.elastic.coordinator import ElasticPolicy
from runtime.elastic.protocol import Commit, Left, Ready, Switched, Transition
from runtime.launch.messages import StepDone
from runtime.launch.options import PlannedSwitch, StepReport, TrainOptions, WorkerSpec, rank_map
from runtime.launch.supervise import Run, RunSummary, WorkerHandle
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

REPO = Path(__file__).resolve().parents[3]
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"  # dp-pp: [0] | [1] | [2 -> 3]


class Recorder:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)

    def kill(self) -> None:
        pass


def plan(tmp: Path, name: str, pipelines: tuple[Pipeline, ...]) -> Path:
    path = tmp / f"{name}.yaml"
    save_plan(replace(load_plan(PLAN), model="llama-tiny", cluster="cpu-hetero4",
                      strategies=(Strategy(name, pipelines),)), path)
    return path


def whole(device: int, m: int) -> Pipeline:
    return Pipeline(m, (Stage((device,), (0, 6)),))


def setup(tmp: Path, replan):
    """dp-pp trains; a switch to b ([0] | [1]) is planned before step 3."""
    b = plan(tmp, "b", (whole(0, 4), whole(1, 4)))
    ctx = load_plan_context(PLAN)
    options = TrainOptions(plan=PLAN, steps=6, elastic=True, timeout_s=20.0, heartbeat_timeout_s=3.0,
                           switches=(PlannedSwitch(3, b),))
    events: list[dict] = []
    policy = ElasticPolicy(replan, events.append, None)
    start = policy.prepare(options, ctx, "dp-pp")
    ranks = rank_map(start)
    workers = {d: WorkerHandle(WorkerSpec(options, "dp-pp", d, ranks[d], ranks, "gloo", "cpu"), Recorder())
               for d in start}
    logs: list[str] = []
    run = Run(options, ctx, "dp-pp", workers, RunSummary("dp-pp", tuple(start), "gloo"), None, logs.append,
              time.perf_counter())
    policy.begin(run)
    for w in workers.values():
        w.up = True
    return policy, run, events, logs


def step(policy: ElasticPolicy, run: Run, s: int) -> None:
    for d in policy.active:
        policy.on_message(run.workers[d], Ready(policy.gen, s))
    policy.tick()
    for d in policy.active:
        policy.on_message(run.workers[d], StepDone(StepReport(step=s, rank=d, device=d, loss=1.0, grad_norm=1.0,
                                                              tokens=64, wall_s=0.1, compute_s=0.1, comm_s=0.0,
                                                              emulation_s=0.0)))


def sent(run: Run, d: int, kind: type) -> list:
    return [m for m in run.workers[d].link.sent if isinstance(m, kind)]  # type: ignore[attr-defined]


def fail_and_leave(policy: ElasticPolicy, run: Run, dead: int) -> Transition:
    """``dead`` dies; the others leave the generation; the recovery's transition (as device 0 got it)."""
    before = len(sent(run, 0, Transition))
    policy.on_failure(run.workers[dead], "died", "worker process was killed by SIGKILL")
    for d in sorted(policy.alive):
        policy.on_message(run.workers[d], Left(policy.gen))
    policy.tick()
    (t,) = sent(run, 0, Transition)[before:]
    return t


def test_a_failure_right_after_the_hold_goes_to_the_planned_switch(tmp_path):
    asked: list = []
    policy, run, events, logs = setup(tmp_path, lambda *a: asked.append(a))
    step(policy, run, 1)
    step(policy, run, 2)
    assert sent(run, 0, Commit)[-1] == Commit(0, 2, "hold")
    # Device 3 (not in b) dies before the switch is sent: the recovery switches to b, no replan needed.
    t = fail_and_leave(policy, run, 3)
    assert t.target.name == "b" and t.world is not None and sorted(t.world.ranks) == [0, 1, 2]
    assert asked == [] and policy.switches == {}
    assert any("the switch planned for step 3 is taken by the recovery" in line for line in logs)


def test_a_switch_whose_plan_lost_a_device_is_replanned(tmp_path):
    replanned = load_plan_context(plan(tmp_path, "b-without-1", (whole(0, 4), whole(2, 4))))
    asked: list = []

    def replan(failed, ctx, strategy, steps_left):
        asked.append((failed, strategy, steps_left))
        return replanned

    policy, run, events, logs = setup(tmp_path, replan)
    step(policy, run, 1)
    step(policy, run, 2)
    policy.tick()  # the hold is recorded: the switch to b is sent
    (switch,) = sent(run, 0, Transition)
    assert switch.target.name == "b" and switch.world is None
    # Device 1 (in b) dies during the switch's transition: b is re-planned for its survivors.
    t = fail_and_leave(policy, run, 1)
    assert asked == [(frozenset({1}), "b", 4)]
    assert t.target.name == "b-without-1" and sorted(t.world.ranks) == [0, 2, 3]
    assert policy.switches == {} and not [e for e in events if e["event"] == "switch_dropped"]
    assert any("names failed device(s) 1: re-planned" in line for line in logs)


def test_a_switch_that_cannot_be_replanned_is_dropped_and_reported(tmp_path):
    survivors = load_plan_context(plan(tmp_path, "survivors", (whole(0, 4), Pipeline(4, (Stage((2,), (0, 3)),
                                                                                          Stage((3,), (3, 6)))))))

    def replan(failed, ctx, strategy, steps_left):
        if strategy == "b":
            raise HspmdError("no plan fits")
        return survivors

    policy, run, events, logs = setup(tmp_path, replan)
    step(policy, run, 1)
    step(policy, run, 2)
    t = fail_and_leave(policy, run, 1)
    (dropped,) = [e for e in events if e["event"] == "switch_dropped"]
    assert dropped == {**dropped, "step": 3, "strategy": "b", "failed": [1], "reason": "no plan fits"}
    assert any("the switch planned for step 3 to" in line and "is dropped" in line for line in logs)
    assert t.target.name == "survivors" and policy.switches == {}
    # The run goes on: the survivors switch and redo step 3.
    for d in sorted(policy.alive):
        policy.on_message(run.workers[d], Switched(t.epoch, 0.0, 0.0, 0.0))
    policy.tick()
    step(policy, run, 3)
    assert sent(run, 0, Commit)[-1] == Commit(t.world.generation, 3, "next")
