"""Elastic ZeRO-1 with two copies of every moment chunk (training.zero_redundancy: 2): a device dies mid-run,
the survivors rebuild the moments from the surviving copies in memory and train on exactly like the
uninterrupted single-process reference (every step's loss, the final parameters and AdamW moments saved with
--save); when both copies of a chunk die together the run stops, saying which state is lost, and leaves the
last checkpoint as it was."""

from __future__ import annotations

import dataclasses
import multiprocessing
import subprocess
import sys

import pytest
from elastic_helpers import (
    REPO,
    assert_matches_reference,
    fixed_replan,
    reference,
    saved_state,
    write_nodes_cluster,
    write_plan,
)

from runtime.elastic.coordinator import ElasticPolicy
from runtime.launch import Fault, TrainOptions, launch
from runtime.torchfree.elastic.state import moment_slices
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.handle import StrategyHandle

STEPS = 4
FAST = {"timeout_s": 20.0, "heartbeat_timeout_s": 3.0}


def zero_plan(path, pipelines, cluster, r: int = 2):
    write_plan(path, path.stem, pipelines, global_batch=4, cluster=str(cluster))
    plan = load_plan(path)
    save_plan(dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero=True, zero_redundancy=r)),
              path)
    load_plan_context(path)  # valid
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic-zero")
    # Two emulated nodes: devices 0, 1 on one, 2, 3 on the other (failure domains).
    cluster = write_nodes_cluster(d / "two-nodes.yaml", [("fast0", "cpu-fast", 2), ("slow0", "cpu-slow", 2)])
    out = {
        # Four whole-model replicas: each moment chunk on two devices, one per node (0+2, 1+3).
        "z4": zero_plan(d / "z4.yaml", [(1, [([0], (0, 6))]), (1, [([1], (0, 6))]), (1, [([2], (0, 6))]),
                                        (1, [([3], (0, 6))])], cluster),
    }
    # Device k gone: three replicas (one chunk, on two of them; the third keeps no moments).
    for k in range(4):
        rest = [d for d in range(4) if d != k]
        out[f"z3-{k}"] = zero_plan(d / f"z3-{k}.yaml", [(m, [([dev], (0, 6))]) for m, dev in zip((2, 1, 1), rest)],
                                   cluster)
    return out


def test_the_plan_places_each_chunk_on_both_nodes(plans) -> None:
    ref = StrategyHandle.of(load_plan_context(plans["z4"]))
    holders = {h for sl in moment_slices(ref).values() for s in sl for h in s.holders}
    assert holders == {(0, 2), (1, 3)}


@pytest.mark.parametrize("dead", [0, 1, 2, 3])
def test_a_killed_holder_is_replaced_from_the_other_copies(plans, tmp_path, dead: int) -> None:
    calls: list = []
    events: list[dict] = []
    options = TrainOptions(plan=plans["z4"], steps=STEPS, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(device=dead, step=3, kind="kill"),))
    summary = launch(options, ElasticPolicy(fixed_replan(plans[f"z3-{dead}"], calls), on_event=events.append))
    assert multiprocessing.active_children() == []
    expected, trainer = reference(plans["z4"], STEPS)
    records = summary.records
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in records] == ["z4", "z4", f"z3-{dead}", f"z3-{dead}"]
    assert calls == [(frozenset({dead}), "z4")]
    (e,) = events
    survivors = [d for d in range(4) if d != dead]
    assert e["event"] == "failure" and e["failed"] == [dead] and e["survivors"] == survivors
    assert e["moment_rebuild_bytes"] > 0 and e["switch_bytes"] >= e["moment_rebuild_bytes"]
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


# One holder of each chunk ({0, 2} hold chunk 0, {1, 3} chunk 1: 2 and 3 mirror 0 and 1), for the suite's time.
@pytest.mark.parametrize("dead", [0, 1])
def test_a_holder_killed_inside_the_parameter_all_gather_is_recovered(plans, tmp_path, dead: int) -> None:
    # The kill fires once step 2 is committed, as the update and the all-gather begin: the survivors have
    # updated their chunks and are left inside the all-gather; step 2 stays committed, step 3 runs on z3-dead.
    calls: list = []
    events: list[dict] = []
    options = TrainOptions(plan=plans["z4"], steps=STEPS, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(device=dead, step=2, kind="kill", point="after-commit"),))
    summary = launch(options, ElasticPolicy(fixed_replan(plans[f"z3-{dead}"], calls), on_event=events.append))
    assert multiprocessing.active_children() == []
    expected, trainer = reference(plans["z4"], STEPS)
    records = summary.records
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in records] == ["z4", "z4", f"z3-{dead}", f"z3-{dead}"]
    assert calls == [(frozenset({dead}), "z4")]
    (e,) = events
    assert e["event"] == "failure" and e["failed"] == [dead] and e["step"] == 3 and e["in_param_gather"]
    assert e["moment_rebuild_bytes"] > 0
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_a_failure_planned_ahead_switches_to_the_cached_plan_without_planning(plans, tmp_path) -> None:
    # The background replanner knows a plan for each single device lost (none for a node): the failure of
    # device 1 at step 3 finds its survivor set planned and the foreground replanner is never asked.
    ahead: list = []
    foreground: list = []
    events: list[dict] = []

    def plan_ahead(failed, ctx, strategy, steps_left):
        ahead.append(failed)
        if len(failed) != 1:
            raise HspmdError("no plan for a node here")
        return load_plan_context(plans[f"z3-{next(iter(failed))}"])

    options = TrainOptions(plan=plans["z4"], steps=STEPS, elastic=True, save_dir=tmp_path / "ck", **FAST,
                           faults=(Fault(device=1, step=3, kind="kill"),))
    policy = ElasticPolicy(fixed_replan(plans["z3-1"], foreground), on_event=events.append, preplan=plan_ahead)
    summary = launch(options, policy)
    expected, trainer = reference(plans["z4"], STEPS)
    assert [r.loss for r in summary.records] == pytest.approx(expected, rel=1e-5)
    assert [r.strategy for r in summary.records] == ["z4", "z4", "z3-1", "z3-1"]
    assert foreground == []
    # every device of the running layout, then each node (two of its devices) -- and, after the switch,
    # the new layout's devices and nodes, planned ahead again with device 1 already lost
    assert ahead[:6] == [frozenset({d}) for d in range(4)] + [frozenset({0, 1}), frozenset({2, 3})]
    assert set(ahead[6:]) <= {frozenset({1, d}) for d in (0, 2, 3)} | {frozenset({1, 2, 3})}
    (e,) = events
    assert e["event"] == "failure" and e["failed"] == [1] and e["preplanned"] is True and e["replanned"]
    assert_matches_reference(saved_state(tmp_path / "ck"), trainer)


def test_both_copies_of_a_chunk_dying_stops_the_run_and_keeps_the_checkpoint(plans, tmp_path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "checkpoint.safetensors").write_bytes(b"an earlier checkpoint")
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plans["z4"]), "--steps", "4",
                           "--elastic", "--kill-device", "0", "--kill-device", "2", "--at-step", "2", "--save",
                           str(ck), "--timeout", "20"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # Every parameter still has replicas (devices 1 and 3), but chunk 0 of every moment was on 0 and 2 only.
    assert errors[0].startswith("error: device(s) 0, 2 failed during step 2 and the ZeRO-1 AdamW moments of "), errors
    assert "parameter(s) have no surviving replica" not in errors[0]
    assert any(e.startswith("error:   AdamW moments of decoder layers 0-5") and
               e.endswith("held only by failed device(s) 0, 2") for e in errors), errors
    assert any("left as it was" in e for e in errors) and "Traceback" not in proc.stderr
    assert (ck / "checkpoint.safetensors").read_bytes() == b"an earlier checkpoint"
