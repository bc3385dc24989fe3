"""Schedules: every stage of a pipeline runs to completion with every transfer matched (no deadlock),
in a rendezvous model where a tick's batch of sends and receives completes only when each of them
meets its counterpart on the neighbouring stage."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.engine.schedules import (
    Comm,
    Compute,
    Transfer,
    build_schedule,
    gpipe,
    one_f_one_b,
    peak_live_activations,
)

MATCH = {"send_forward": "recv_forward", "send_backward": "recv_backward"}


@given(st.integers(1, 5), st.integers(1, 9), st.sampled_from(["1f1b", "gpipe"]))
def test_every_schedule_completes_without_deadlock(stages: int, micro_batches: int, name: str) -> None:
    programs = [build_schedule(name, stages, s, micro_batches) for s in range(stages)]
    simulate_pairs(programs)
    for prog in programs:
        fwd = [a.micro_batch for a in prog if isinstance(a, Compute) and a.kind == "forward"]
        bwd = [a.micro_batch for a in prog if isinstance(a, Compute) and a.kind == "backward"]
        assert sorted(fwd) == list(range(micro_batches)) and sorted(bwd) == list(range(micro_batches))


def simulate_pairs(programs: list[list]) -> None:
    """Rendezvous simulation where a batch completes once each of its transfers has been posted by
    the peer (in the peer's current batch): matched pairs complete together."""
    n = len(programs)
    pc = [0] * n
    posted: list[set[tuple[str, int]]] = [set() for _ in range(n)]  # transfers of the current batch
    matched: list[set[tuple[str, int]]] = [set() for _ in range(n)]
    fwd_done = [set() for _ in range(n)]
    bwd_done = [set() for _ in range(n)]
    acts = [set() for _ in range(n)]
    grads = [set() for _ in range(n)]
    steps = 0
    while any(pc[s] < len(programs[s]) for s in range(n)):
        steps += 1
        assert steps < 100_000
        progressed = False
        for s in range(n):
            while pc[s] < len(programs[s]) and isinstance(programs[s][pc[s]], Compute):
                a = programs[s][pc[s]]
                if a.kind == "forward":
                    assert s == 0 or a.micro_batch in acts[s], f"stage {s}: forward {a.micro_batch} without input"
                    fwd_done[s].add(a.micro_batch)
                else:
                    assert a.micro_batch in fwd_done[s]
                    assert s == n - 1 or a.micro_batch in grads[s], f"stage {s}: backward {a.micro_batch} w/o grad"
                    bwd_done[s].add(a.micro_batch)
                pc[s] += 1
                progressed = True
            if pc[s] < len(programs[s]) and not posted[s]:
                posted[s] = {(t.kind, t.micro_batch) for t in programs[s][pc[s]].transfers}
                matched[s] = set()
        for s in range(n):
            for kind, mb in list(posted[s] - matched[s]):
                if not kind.startswith("send"):
                    continue
                peer = s + (1 if kind == "send_forward" else -1)
                want = (MATCH[kind], mb)
                if want in posted[peer] and want not in matched[peer]:
                    assert mb in (fwd_done[s] if kind == "send_forward" else bwd_done[s])
                    matched[s].add((kind, mb))
                    matched[peer].add(want)
                    (acts if kind == "send_forward" else grads)[peer].add(mb)
                    progressed = True
        for s in range(n):
            if posted[s] and matched[s] == posted[s]:
                posted[s] = set()
                pc[s] += 1
                progressed = True
        if not progressed:
            raise AssertionError("deadlock at " + str([(s, programs[s][pc[s]] if pc[s] < len(programs[s]) else None)
                                                       for s in range(n)]))


def test_one_f_one_b_bounds_live_activations() -> None:
    for stages in range(1, 6):
        for m in range(stages, 10):
            for s in range(stages):
                assert peak_live_activations(one_f_one_b(stages, s, m)) == min(stages - s, m)
                assert peak_live_activations(gpipe(stages, s, m)) == m


def test_one_f_one_b_fuses_send_forward_with_recv_backward() -> None:
    prog = one_f_one_b(3, 1, 4)
    fused = [a for a in prog if isinstance(a, Comm) and len(a.transfers) == 2]
    kinds = {tuple(t.kind for t in a.transfers) for a in fused}
    assert ("send_forward", "recv_backward") in kinds and ("send_backward", "recv_forward") in kinds


def test_single_stage_has_no_transfers() -> None:
    prog = one_f_one_b(1, 0, 3)
    assert [(a.kind, a.micro_batch) for a in prog] == [("forward", 0), ("backward", 0), ("forward", 1),
                                                      ("backward", 1), ("forward", 2), ("backward", 2)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zb", 2, 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        build_schedule("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        build_schedule("gpipe", 2, 0, 0)


def test_simulator_detects_a_deadlock() -> None:
    # Unfused ticks in the wrong order: stage 0 waits for a gradient before sending the activation
    # stage 1 is waiting for. The simulator must report it (so a passing schedule means something).
    def c(kind: str, mb: int) -> Comm:
        return Comm((Transfer(kind, mb),))

    stage0 = [Compute("forward", 0), c("send_forward", 0), Compute("forward", 1), c("recv_backward", 0),
              c("send_forward", 1), Compute("backward", 0), c("recv_backward", 1), Compute("backward", 1)]
    stage1 = [c("recv_forward", 0), Compute("forward", 0), Compute("backward", 0), c("recv_forward", 1),
              c("send_backward", 0), Compute("forward", 1), Compute("backward", 1), c("send_backward", 1)]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate_pairs([stage0, stage1])
