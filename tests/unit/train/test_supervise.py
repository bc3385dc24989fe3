"""The supervisor's loop and the plain policy without worker processes: events come from a scripted
source (as a relay of remote nodes' events would feed them), so every rule is checked in milliseconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.elastic.protocol import Commit
from runtime.launch.messages import Exited, Heartbeat, Log, StepDone, Up, WorkerError
from runtime.launch.options import StepReport, TrainOptions, WorkerSpec, rank_map
from runtime.launch.supervise import (
    PRIORITY,
    FailureLog,
    PlainPolicy,
    Run,
    RunSummary,
    WorkerFailure,
    WorkerHandle,
    supervise,
)

PLAN = Path("configs/plans/cpu-hetero4-tiny.yaml")


def handles(n: int, options: TrainOptions) -> dict[int, WorkerHandle]:
    ranks = rank_map(list(range(n)))
    return {d: WorkerHandle(WorkerSpec(options, "s", d, ranks[d], ranks, "gloo", "cpu"), None)
            for d in range(n)}


class Script:
    """An event source that yields one scripted round per poll (then nothing)."""

    def __init__(self, rounds: list[list[tuple[int, object]]], workers: dict[int, WorkerHandle]) -> None:
        self.rounds, self.workers = list(rounds), workers
        self.timeouts: list[float] = []

    def poll(self, timeout_s: float):
        self.timeouts.append(timeout_s)
        if not self.rounds:
            time.sleep(min(timeout_s, 0.01))
        for d, msg in self.rounds.pop(0) if self.rounds else []:
            yield self.workers[d], msg


def report(step: int, device: int, loss: float, wall: float) -> StepReport:
    return StepReport(step=step, rank=device, device=device, loss=loss, grad_norm=1.0, tokens=64, wall_s=wall,
                      compute_s=wall, comm_s=0.0, emulation_s=0.0)


def make_run(options: TrainOptions, workers: dict[int, WorkerHandle], records: list, logs: list) -> Run:
    return Run(options, None, "s", workers, RunSummary("s", tuple(workers), "gloo"), records.append, logs.append,
               time.perf_counter())


def test_plain_run_records_a_step_once_every_worker_reported_it_and_ends_when_all_are_done():
    options = TrainOptions(plan=PLAN)
    workers = handles(2, options)
    records: list = []
    logs: list = []
    run = make_run(options, workers, records, logs)
    source = Script([[(0, Up()), (1, Up()), (0, Heartbeat()), (0, StepDone(report(1, 0, 2.5, 0.2)))],
                     [(1, Log("hello")), (1, StepDone(report(1, 1, 9.0, 0.4)))],
                     [(0, Exited(0)), (1, Exited(0))]], workers)
    policy = PlainPolicy()
    policy.begin(run)
    supervise(run, source, policy)
    (r,) = records
    assert (r.step, r.loss, r.step_time_s, r.tokens_per_s) == (1, 2.5, 0.4, 64 / 0.4)  # rank 0's loss, slowest
    assert logs == ["hello"] and run.summary.records == records
    assert all(w.up and w.finished and not w.failed for w in workers.values())


def test_a_death_outranks_the_errors_of_its_peers_and_is_raised_after_the_grace():
    options = TrainOptions(plan=PLAN, heartbeat_s=5.0)
    workers = handles(3, options)
    run = make_run(options, workers, [], [])
    comm = WorkerError("comm", ("DistBackendError: peer gone",), "")
    source = Script([[(0, Up()), (1, Up()), (2, Up())],
                     [(0, comm), (2, WorkerError("error", ("RuntimeError: x",), "tb"))],
                     [(1, Exited(-9))]], workers)
    policy = PlainPolicy()
    policy.begin(run)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as err:
        supervise(run, source, policy)
    assert err.value.device == 1 and err.value.kind == "died" and err.value.exit_code == 1
    assert err.value.lines() == ["device 1 (rank 1): worker process was killed by SIGKILL"]
    assert time.monotonic() - t0 >= 0.5  # the root cause had its grace to report
    # The loop waits a heartbeat for news, and no longer than the grace once a failure is in.
    assert source.timeouts[:2] == [5.0, 5.0] and max(source.timeouts[2:]) <= 0.5


def test_a_silent_worker_is_hung_after_the_heartbeat_limit_only_once_it_is_up():
    options = TrainOptions(plan=PLAN, timeout_s=60.0, heartbeat_s=0.01, heartbeat_timeout_s=0.05)
    workers = handles(2, options)
    run = make_run(options, workers, [], [])
    source = Script([[(0, Up())]], workers)  # device 1 never comes up: start-up gets the op timeout
    policy = PlainPolicy()
    policy.begin(run)
    with pytest.raises(WorkerFailure) as err:
        supervise(run, source, policy)
    assert err.value.device == 0 and err.value.kind == "hung" and workers[0].hung
    assert err.value.messages[0].startswith("no heartbeat for ")
    assert not workers[1].failed


def test_a_worker_whose_gpu_is_stuck_in_its_own_work_is_hung_though_it_beats():
    # Device 0's heartbeats keep coming (its host thread lives) but its GPU has finished nothing for 9 s,
    # stuck in a compute block; device 1 is stalled as long, behind a receive: it waits for device 0 and is
    # not blamed.
    options = TrainOptions(plan=PLAN, timeout_s=60.0, heartbeat_s=1.0, heartbeat_timeout_s=5.0)
    workers = handles(2, options)
    run = make_run(options, workers, [], [])
    source = Script([[(0, Up()), (1, Up())], [(0, Heartbeat(2.0, "compute")), (1, Heartbeat(9.0, "comm"))],
                     [(0, Heartbeat(9.0, "compute")), (1, Heartbeat(9.0, "comm"))]], workers)
    policy = PlainPolicy()
    policy.begin(run)
    with pytest.raises(WorkerFailure) as err:
        supervise(run, source, policy)
    assert err.value.device == 0 and err.value.kind == "hung" and workers[0].hung
    assert err.value.messages[0].startswith("its GPU finished no work for 9.0 s")
    assert not workers[1].failed and not workers[1].hung


def test_failure_ranking_user_first_then_silent_deaths_then_the_earliest_error():
    options = TrainOptions(plan=PLAN)
    for kinds, want in [(["comm", "error", "died"], 2), (["error", "comm"], 0), (["hung", "user"], 1),
                        (["error", "error"], 0)]:
        workers = handles(len(kinds), options)
        log = FailureLog(0.0)
        for d, kind in enumerate(kinds):
            log.add(workers[d], kind, (kind,))
        log.add(workers[0], "user", ("a second word from a failed worker is not news",))
        with pytest.raises(WorkerFailure) as err:
            log.raise_when_due()
        assert err.value.device == want, kinds
    assert sorted(PRIORITY, key=PRIORITY.get)[0] == "user"


def test_messages_are_validated_on_construction():
    with pytest.raises(ValueError, match="unknown error kind"):
        WorkerError("oops", (), "")
    with pytest.raises(ValueError, match="unknown continuation"):
        Commit(0, 1, "later")


def test_the_plain_policy_refuses_a_coordinated_run():
    with pytest.raises(ValueError, match="ElasticPolicy"):
        PlainPolicy().prepare(TrainOptions(plan=PLAN, elastic=True), None, "s")


def test_the_policy_is_ended_when_the_run_ends_and_when_it_fails():
    """``Policy.end`` (the elastic policy joins its background planner there) runs on both ways out of the loop."""
    class Counting(PlainPolicy):
        ended = 0

        def end(self) -> None:
            self.ended += 1

    options = TrainOptions(plan=PLAN, heartbeat_s=5.0)
    workers = handles(2, options)
    run = make_run(options, workers, [], [])
    policy = Counting()
    policy.begin(run)
    supervise(run, Script([[(0, Up()), (1, Up())], [(0, Exited(0)), (1, Exited(0))]], workers), policy)
    assert policy.ended == 1
    workers = handles(2, options)
    run = make_run(options, workers, [], [])
    policy = Counting()
    policy.begin(run)
    with pytest.raises(WorkerFailure):
        supervise(run, Script([[(0, Up()), (1, Up())], [(1, Exited(-9))]], workers), policy)
    assert policy.ended == 1
