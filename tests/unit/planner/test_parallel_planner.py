"""The planner's exact speed paths: worker processes give the same plans as the calling process
(planner/parallel.py), a pickled cost model prices as the original, and the layer split's memory tables read
``device_memory_total``, which must be ``device_memory(...).total`` to the bit."""

from __future__ import annotations

import dataclasses
import operator
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.api import PlanResult, plan, simulator_check
from planner.cost import CostModel
from planner.parallel import Tasks, ordered_map, worker_count
from planner.search import PlanSettings, SearchStats, mixed_chunks, mixed_subsets
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model


def _cm(cluster: str = "h800-h20-48", model: str = "llama-32b") -> CostModel:
    c = load_cluster(cluster)
    return CostModel(load_model(model), c, resolve_profiles(c.device_types), micro_batch=1, seq_len=4096)


def test_ordered_map_keeps_the_input_order() -> None:
    calls = [(a, b) for a in range(5) for b in range(3)]
    want = [a * b for a, b in calls]
    assert ordered_map(operator.mul, calls, 1) == want
    assert ordered_map(operator.mul, calls, 3) == want


def test_serial_tasks_run_when_collected() -> None:
    ran: list[int] = []
    with Tasks(1, 3) as tasks:
        pending = [tasks.submit(ran.append, i) for i in range(3)]
        assert ran == []
        for collect in reversed(pending):
            collect()
    assert ran == [2, 1, 0]


@given(n=st.integers(0, 6))
def test_mixed_chunks_cover_every_subset_once(n: int) -> None:
    """The parallel path's tasks search each mixed subset exactly once: pairs in one chunk, the rest alone."""
    types = [f"t{i}" for i in range(n)]
    chunks = mixed_chunks(types)
    flat = [s for c in chunks for s in c]
    assert sorted(flat) == sorted(mixed_subsets(types))
    assert len(flat) == len(set(flat)) == 2 ** n - n - 1
    assert all(len(c) == 1 or {len(s) for s in c} == {2} for c in chunks)


def test_search_stats_add_counts_both_and_keeps_phases_once() -> None:
    a = SearchStats(1, 2, 3, 4, False, ["x"], ["single-type pipelines"])
    a.add(SearchStats(10, 20, 30, 40, True, ["y"], ["single-type pipelines", "simulator check"]))
    assert a == SearchStats(11, 22, 33, 44, True, ["x", "y"], ["single-type pipelines", "simulator check"])


def test_worker_count() -> None:
    assert worker_count(1, 10) == 1
    assert worker_count(8, 3) == 3
    assert worker_count(4, 0) == 1
    assert 1 <= worker_count(None, 100) <= 100
    with pytest.raises(ValueError):
        worker_count(0, 5)


def test_a_pickled_cost_model_drops_its_caches_and_prices_the_same() -> None:
    cm = _cm()
    mem = cm.device_memory("H800", 2, ((4, True, False),), False, 3, 2)
    layer = cm.layer("H800", 2)
    copy = pickle.loads(pickle.dumps(cm))
    assert not any(k.startswith("_memo_") for k in vars(copy))
    assert (copy.micro_batch, copy.seq_len, copy.sequence_parallel, copy.step_allreduce) == \
        (cm.micro_batch, cm.seq_len, cm.sequence_parallel, cm.step_allreduce)
    assert copy.device_memory("H800", 2, ((4, True, False),), False, 3, 2) == mem
    assert copy.layer("H800", 2) == layer


chunk = st.tuples(st.integers(0, 12), st.booleans(), st.booleans())


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(["H800", "H20"]), tp=st.sampled_from([1, 2, 4, 8]),
       chunks=st.lists(chunk, min_size=1, max_size=4), recompute=st.booleans(), live=st.integers(0, 40),
       zero=st.integers(0, 4), partial=st.booleans(), data=st.data())
def test_device_memory_total_is_the_breakdowns_total(dtype: str, tp: int, chunks: list, recompute: bool, live: int,
                                                     zero: int, partial: bool, data: st.DataObject) -> None:
    cm = _CM
    parts = tuple(chunks)
    rc = tuple(data.draw(st.integers(0, k)) for k, _, _ in parts) if partial and not recompute else None
    total = cm.device_memory_total(dtype, tp, parts, recompute, live, zero, rc)
    assert total == cm.device_memory(dtype, tp, parts, recompute, live, zero, rc).total
    # and from a cold cost model (no shared parts cached yet)
    assert total == _cm().device_memory(dtype, tp, parts, recompute, live, zero, rc).total


_CM = _cm()


SETTINGS = PlanSettings(global_batch=16, seq_len=2048, time_limit_s=300, simulate_top=3, top_k=6, schedule="auto")


@pytest.fixture(scope="module")
def serial() -> PlanResult:
    c = load_cluster("hexiscale-mixed")
    return plan(load_model("llama-7b"), c, resolve_profiles(c.device_types), SETTINGS)


def test_plan_with_workers_is_the_serial_plan(serial: PlanResult) -> None:
    """The whole result: every ranked candidate (strategy, estimate, simulated time), the baselines (run
    beside the searches), the statistics."""
    parallel = plan(serial.model, serial.cluster, resolve_profiles(serial.cluster.device_types), SETTINGS,
                    workers=2)
    assert serial.candidates == parallel.candidates
    assert (serial.symmetric, serial.symmetric_subset, serial.lower_bound) == \
        (parallel.symmetric, parallel.symmetric_subset, parallel.lower_bound)
    assert serial.symmetric.strategy is not None
    # The check ran (it plays out only the picks that can still win: planner/api.py simulator_check, and
    # tests/unit/planner/test_check_pruning.py that its choice is the full check's).
    assert parallel.best.simulated_s is not None
    assert (serial.stats.block_evaluations, serial.stats.combinations, serial.stats.finalists, serial.stats.ilps,
            serial.stats.notes) == (parallel.stats.block_evaluations, parallel.stats.combinations,
                                    parallel.stats.finalists, parallel.stats.ilps, parallel.stats.notes)
    assert serial.schedule_options == parallel.schedule_options


def test_simulator_check_with_workers_is_the_serial_check(serial: PlanResult) -> None:
    prof = resolve_profiles(serial.cluster.device_types)
    cms = {b: CostModel(serial.model, serial.cluster, prof, micro_batch=b, seq_len=SETTINGS.seq_len,
                        sequence_parallel=SETTINGS.sequence_parallel)
           for b in {r.micro_batch for r in serial.candidates}}
    ranked = [dataclasses.replace(c, simulated_s=None) for c in serial.candidates]
    check = dataclasses.replace(SETTINGS, simulate_top=5)
    one = simulator_check(ranked, cms, check)
    assert one[0].simulated_s is not None   # (only the picks that can win are played out: test_check_pruning.py)
    assert simulator_check(ranked, cms, check, workers=2) == one
