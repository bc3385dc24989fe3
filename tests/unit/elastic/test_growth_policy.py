"""ElasticPolicy's returns without worker processes: a scripted source feeds the one supervisor loop, links
record what the coordinator sends. A return is adopted at the step boundary the trace names (its commit
waits for the newcomer's start-up), by a transition to a new world with it in it; a newcomer that dies
after the growth was decided does not leave the others holding forever."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from runtime.elastic.coordinator import ElasticPolicy
from runtime.elastic.protocol import Commit, Left, Ready, Switched, Transition
from runtime.launch.messages import Exited, StepDone
from runtime.launch.options import Rejoin, StepReport, TrainOptions, WorkerSpec, rank_map
from runtime.launch.supervise import Run, RunSummary, WorkerHandle
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

REPO = Path(__file__).resolve().parents[3]
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"


class Recorder:
    def __init__(self) -> None:
        self.sent: list[object] = []
        self.killed = False

    def send(self, msg: object) -> None:
        self.sent.append(msg)

    def kill(self) -> None:
        self.killed = True


class Source:
    """Starts handles with recording links (a joiner's spec comes from ``make_spec``)."""

    def __init__(self) -> None:
        self.started: list[WorkerHandle] = []

    def start(self, spec: WorkerSpec, loop) -> WorkerHandle:
        w = WorkerHandle(spec, Recorder())
        w.started = True
        self.started.append(w)
        return w

    def poll(self, timeout_s: float):
        return iter(())

    def returned_devices(self) -> list[int]:
        return []

    def kill_node(self, node: str) -> None:
        raise AssertionError("no node kills here")


def report(step: int, device: int) -> StepDone:
    return StepDone(StepReport(step=step, rank=device, device=device, loss=1.0, grad_norm=1.0, tokens=64, wall_s=0.1,
                               compute_s=0.1, comm_s=0.0, emulation_s=0.0))


def setup(tmp: Path, steps: int, grow):
    """Devices 0, 2, 3 train (device 1 is away); it returns for step 3."""
    plan = load_plan(PLAN)
    without = Strategy("without1", (Pipeline(5, (Stage((0,), (0, 6)),)),
                                    Pipeline(3, (Stage((2,), (0, 3)), Stage((3,), (3, 6))))))
    path = tmp / "without1.yaml"
    save_plan(replace(plan, model="llama-tiny", cluster="cpu-hetero4", strategies=(without,)), path)
    ctx = load_plan_context(path)
    options = TrainOptions(plan=path, steps=steps, elastic=True, timeout_s=20.0, heartbeat_timeout_s=3.0,
                           rejoins=(Rejoin(1, 3),))
    policy = ElasticPolicy(None, None, grow)
    start = policy.prepare(options, ctx, "without1")
    ranks = rank_map(start)
    workers = {d: WorkerHandle(WorkerSpec(options, "without1", d, ranks[d], ranks, "gloo", "cpu"), Recorder())
               for d in start}
    source = Source()
    run = Run(options, ctx, "without1", workers, RunSummary("without1", tuple(start), "gloo"), None,
              lambda _m: None, time.perf_counter(), source=source,
              make_spec=lambda d: WorkerSpec(options, "without1", d, -1, ranks, "gloo", "cpu", joining=True))
    return policy, run, source


def step(policy: ElasticPolicy, run: Run, s: int) -> None:
    for d in policy.active:
        w = run.workers[d]
        policy.on_message(w, Ready(policy.gen, s))
    policy.tick()
    for d in policy.active:
        policy.on_message(run.workers[d], report(s, d))
    policy.tick()


def sent(w: WorkerHandle) -> list[object]:
    return w.link.sent  # type: ignore[attr-defined]


def test_a_return_waits_for_its_newcomer_and_a_voided_hold_is_released(tmp_path):
    ctx = load_plan_context(PLAN)
    asked: list = []

    def grow(joining, current, strategy, steps_left):
        asked.append((joining, steps_left))
        return ctx  # dp-pp: device 1 holds the whole model again

    policy, run, source = setup(tmp_path, 6, grow)
    policy.begin(run)
    for w in run.workers.values():
        w.up = True
    step(policy, run, 1)  # committed 1: device 1's worker starts now, for step 3
    (joiner,) = source.started
    assert joiner.device == 1 and joiner.spec.joining and run.workers[1] is joiner
    for d in policy.active:
        policy.on_message(run.workers[d], Ready(policy.gen, 2))
    policy.tick()
    assert not any(isinstance(m, Commit) and m.step == 2 for m in sent(run.workers[0]))  # waits for it
    joiner.up = True
    policy.tick()
    commit = [m for m in sent(run.workers[0]) if isinstance(m, Commit) and m.step == 2]
    assert commit == [Commit(0, 2, "hold")] and asked == [(frozenset({1}), 4)]
    for d in (0, 2, 3):
        policy.on_message(run.workers[d], report(2, d))
    # The joiner dies before the transition starts: the others must not hold forever.
    policy.on_failure(joiner, "died", "worker process was killed by SIGKILL")
    policy.tick()
    released = [m for m in sent(run.workers[0]) if isinstance(m, Transition)]
    assert len(released) == 1 and released[0].world is None and released[0].target.devices == policy.ref.devices
    assert not any(isinstance(m, Transition) for m in sent(joiner))


def test_a_return_joins_a_new_world_with_every_member(tmp_path):
    ctx = load_plan_context(PLAN)
    policy, run, source = setup(tmp_path, 6, lambda joining, current, strategy, steps_left: ctx)
    policy.begin(run)
    for w in run.workers.values():
        w.up = True
    step(policy, run, 1)
    (joiner,) = source.started
    joiner.up = True
    for d in (0, 2, 3):
        policy.on_message(run.workers[d], Ready(0, 2))
    policy.tick()
    for d in (0, 2, 3):
        policy.on_message(run.workers[d], report(2, d))
    policy.tick()
    (t,) = [m for m in sent(joiner) if isinstance(m, Transition)]
    assert t.world is not None and t.world.generation == 1 and sorted(t.world.ranks) == [0, 1, 2, 3]
    assert t.steps_done == 2 and t.bsr.total_bytes > 0  # device 1 receives the whole model
    assert [m for m in sent(run.workers[0]) if isinstance(m, Transition)] == [t]
    assert not [m for m in sent(joiner) if isinstance(m, Exited)]


def _plan(tmp: Path, name: str, pipelines: tuple[Pipeline, ...]):
    path = tmp / f"{name}.yaml"
    save_plan(replace(load_plan(PLAN), model="llama-tiny", cluster="cpu-hetero4",
                      strategies=(Strategy(name, pipelines),)), path)
    return load_plan_context(path)


def test_a_growth_decided_right_after_a_recovery_waits_for_the_redone_step_to_hold(tmp_path):
    # The bench's trace: device 1 returns but stays spare; a failure (device 3) is recovered; the spares are
    # then reconsidered and device 1 adopted. The survivors resumed training the redone step, so the new
    # world must wait for that step's "hold": a transition sent mid-step is never read as one, and the
    # newcomer waited for its peers in the new world until the op timeout.
    survivors = _plan(tmp_path, "survivors", (Pipeline(4, (Stage((0,), (0, 6)),)), Pipeline(4, (Stage((2,), (0, 6)),))))
    grown = _plan(tmp_path, "grown", (Pipeline(3, (Stage((0,), (0, 6)),)), Pipeline(2, (Stage((1,), (0, 6)),)),
                                      Pipeline(3, (Stage((2,), (0, 6)),))))
    answers = [None, grown]  # not worth it at first; after the failure it is
    policy, run, source = setup(tmp_path, 8, lambda joining, current, strategy, steps_left: answers.pop(0))
    policy.replan = lambda failed, current, strategy, steps_left: survivors
    policy.begin(run)
    for w in run.workers.values():
        w.up = True
    step(policy, run, 1)
    (joiner,) = source.started
    joiner.up = True
    step(policy, run, 2)  # device 1 is up; the grower says "stay spare"
    assert answers == [grown] and policy.recorded == 2
    assert [m for m in sent(run.workers[0]) if isinstance(m, Commit)][-1] == Commit(0, 2, "next")
    policy.on_failure(run.workers[3], "died", "worker process was killed by SIGKILL")  # during step 3
    for d in (0, 2):
        policy.on_message(run.workers[d], Left(0))
    policy.tick()
    (recovery,) = [m for m in sent(run.workers[0]) if isinstance(m, Transition)]
    assert recovery.world is not None and sorted(recovery.world.ranks) == [0, 2]
    for d in (0, 2):
        policy.on_message(run.workers[d], Switched(recovery.epoch, 0.0, 0.0, 0.0))
    policy.tick()  # Resume: devices 0 and 2 redo step 3
    policy.tick()  # the spare is reconsidered: adopted
    assert [m for m in sent(run.workers[0]) if isinstance(m, Transition)] == [recovery]  # nothing mid-step
    assert not any(isinstance(m, Transition) for m in sent(joiner))
    assert answers == [] and policy.growth is not None and policy.growth.joining == (1,)
    step(policy, run, 3)
    assert [m for m in sent(run.workers[0]) if isinstance(m, Commit)][-1] == Commit(1, 3, "hold")
    (t,) = [m for m in sent(joiner) if isinstance(m, Transition)]
    assert t.world is not None and t.world.generation == 2 and sorted(t.world.ranks) == [0, 1, 2]
    assert t.steps_done == 3 and [m for m in sent(run.workers[0]) if isinstance(m, Transition)] == [recovery, t]
