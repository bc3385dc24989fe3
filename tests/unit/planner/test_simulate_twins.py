"""The simulator plays one of each set of alike pipelines (``pipeline_twins``) and copies its times: the result
must be exactly the result of playing every pipeline."""

from __future__ import annotations

import dataclasses

import pytest

import planner.simulate as simulate_module
from planner.cost import CostModel
from planner.simulate import EventLoop, OpKind, SimOp, pipeline_twins, simulate
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

H2 = load_cluster("h2-example")
MODEL = load_model("llama-13b")


def pipe(m: int, devices: list[tuple[int, ...]], cuts: list[int], schedule: str | None = None) -> Pipeline:
    bounds = [0, *cuts, MODEL.num_layers]
    return Pipeline(m, tuple(Stage(d, (a, b)) for d, a, b in zip(devices, bounds, bounds[1:])), schedule=schedule)


# Device ids: chip-a 0-15 (nodes a-0, a-1), chip-b 16-19 (node b-0).
STRATEGIES = {
    "alike": Strategy("s", (pipe(8, [(0, 1), (2, 3)], [20]), pipe(8, [(4, 5), (6, 7)], [20]),
                            pipe(8, [(8, 9), (10, 11)], [20]))),
    "alike zb-h1 across nodes": Strategy("s", (pipe(6, [(0, 1), (16, 17)], [30], "zb-h1"),
                                               pipe(6, [(2, 3), (18, 19)], [30], "zb-h1"))),
    "other splits": Strategy("s", (pipe(8, [(0, 1), (2, 3)], [20]), pipe(8, [(4, 5), (6, 7)], [21]))),
    "other counts": Strategy("s", (pipe(8, [(0, 1), (2, 3)], [20]), pipe(7, [(4, 5), (6, 7)], [20]))),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_copies_give_the_times_of_playing_every_pipeline(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = STRATEGIES[name]
    cm = CostModel(MODEL, H2, resolve_profiles(H2.device_types), micro_batch=1, seq_len=4096)
    found: list[dict[str, list[str]]] = []
    real = pipeline_twins

    def recorded(loop: EventLoop) -> dict[str, list[str]]:
        found.append(real(loop))
        return found[-1]

    monkeypatch.setattr(simulate_module, "pipeline_twins", recorded)
    with_copies = simulate(cm, strategy, 24, "1f1b", True)
    monkeypatch.setattr(simulate_module, "pipeline_twins", lambda loop: {})
    played = simulate(cm, strategy, 24, "1f1b", True)
    assert with_copies.step_time_s == played.step_time_s
    assert with_copies.events == played.events
    assert with_copies.stages == played.stages
    copied = {c for cs in found[0].values() for c in cs}
    if name.startswith("alike"):
        # Every op of the later pipelines is a copy of the first one's.
        assert copied and all(c.startswith(("p1", "p2")) for c in copied)
        assert all(not o.startswith("p0") or o in found[0] for o in found[0])
    else:
        assert not copied


def two_pipelines() -> EventLoop:
    """Two pipelines of one compute op and one send each, the sends feeding a shared op of the step's end."""
    loop = EventLoop()
    for pi in range(2):
        loop.add(SimOp(f"p{pi}s0F0c0", f"p{pi}s0", OpKind.FORWARD, pi, 0, 0, compute=1.0))
        loop.add(SimOp(f"p{pi}s0a1", f"p{pi}s0", None, pi, 0, 0, duration=0.5, deps=(f"p{pi}s0F0c0",)))
    loop.add(SimOp("stats", "world", OpKind.CLIP, duration=0.25, deps=("p0s0a1", "p1s0a1")))
    return loop


def test_alike_pipelines_are_copies_played_once() -> None:
    loop = two_pipelines()
    assert pipeline_twins(loop) == {"p0s0F0c0": ["p1s0F0c0"], "p0s0a1": ["p1s0a1"]}
    times = loop.run(pipeline_twins(loop))
    assert times == two_pipelines().run() and times["stats"][1] == pytest.approx(1.75)


def test_an_op_that_waits_for_a_copys_start_has_every_pipeline_played() -> None:
    """A rendezvous on a pipeline's op (``waits``) needs that op's own start: such a loop is played in full."""
    loop = two_pipelines()
    loop.add(SimOp("peer", "world2", None, duration=0.1, waits=(("p1s0a1", 0.1),)))
    assert loop.run(pipeline_twins(loop)) == loop.run()


def test_pipelines_differing_in_one_field_or_dependency_are_not_twins() -> None:
    """Twins match op for op: one other duration, or a dependency on another pipeline's op, and neither copies."""
    base = two_pipelines()
    assert pipeline_twins(base)
    slower = two_pipelines()
    slower.ops["p1s0a1"] = dataclasses.replace(slower.ops["p1s0a1"], duration=0.6)
    assert pipeline_twins(slower) == {}
    crossed = two_pipelines()
    crossed.ops["p1s0a1"] = dataclasses.replace(crossed.ops["p1s0a1"], deps=("p0s0F0c0",))
    assert pipeline_twins(crossed) == {}
    three = EventLoop()
    for pi, cpu in enumerate((1.0, 2.0, 1.0)):   # the third is the first's twin, the second no one's
        three.add(SimOp(f"p{pi}s0F0c0", f"p{pi}s0", OpKind.FORWARD, pi, 0, 0, compute=cpu))
    assert pipeline_twins(three) == {"p0s0F0c0": ["p2s0F0c0"]}
