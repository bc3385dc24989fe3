"""Sequence parallelism in the cost model (``training.sequence_parallel``): what it saves and what it adds,
as runtime/engine/tensor_parallel.py lays it out, and the plan field that switches it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import CostModel, has_tp_stage
from planner.simulate import simulate
from runtime.torchfree.profiling.profile import eval_fit, resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.plan import PLAN_VERSION, Pipeline, Plan, Stage, Strategy, TrainingSettings
from runtime.torchfree.spec.schema import to_data

L13 = load_model("llama-13b")
H2 = load_cluster("h2-example")
PROFILES = resolve_profiles(H2.device_types)


def models(seq_len: int = 4096) -> tuple[CostModel, CostModel]:
    return tuple(CostModel(L13, H2, PROFILES, micro_batch=1, seq_len=seq_len, sequence_parallel=sp)
                 for sp in (False, True))  # type: ignore[return-value]


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("device_type", ["chip-a", "chip-b"])
def test_only_the_norms_shrink(device_type: str, tp: int) -> None:
    """A layer saves its two norms' activations on 1/tp of the tokens and everything else as before (the
    blocks' inputs are gathered whole: the integration test measures the same split); the norms' time
    shrinks alike; the layer's collectives carry the same bytes."""
    off, on = models()
    a, b = off.layer(device_type, tp), on.layer(device_type, tp)
    norm = off.components(device_type, tp)["norm"]
    saved = 2 * eval_fit(norm.activation_bytes, 1, 4096) * (1 - 1 / tp)
    assert b.activation_bytes == pytest.approx(a.activation_bytes - saved, rel=1e-12)
    assert b.forward_s == pytest.approx(a.forward_s - 2 * eval_fit(norm.forward_s, 1, 4096) * (1 - 1 / tp))
    assert (b.tp_forward_s, b.tp_backward_s) == (a.tp_forward_s, a.tp_backward_s)
    assert b.checkpoint_bytes == pytest.approx(a.checkpoint_bytes / tp)
    assert b.params == a.params


@pytest.mark.parametrize("first,last", [(True, False), (False, False), (False, True), (True, True)])
def test_a_stage_adds_one_all_gather_each_way(first: bool, last: bool) -> None:
    """The stage's ends stay replicated: its last layer's output gathered (forward), its first layer's input
    gradient gathered (backward); the embedding, final norm and head cost what they did."""
    off, on = models()
    a, b = off.extras("chip-b", 2, first, last), on.extras("chip-b", 2, first, last)
    ag = off._tp_allgather("chip-b", 2, off.activation_tensor_bytes("chip-b"))
    assert ag > 0
    assert b.tp_forward_s == pytest.approx(a.tp_forward_s + ag)
    assert b.tp_backward_s == pytest.approx(a.tp_backward_s + ag)
    assert (b.forward_s, b.backward_s, b.activation_bytes) == (a.forward_s, a.backward_s, a.activation_bytes)


def test_tp_1_is_untouched() -> None:
    off, on = models()
    for t in H2.device_types:
        assert on.layer(t, 1) == off.layer(t, 1)
        assert on.stage(t, 1, 5, True, True) == off.stage(t, 1, 5, True, True)
        assert on.stage_memory(t, 1, 5, True, True, False, 3) == off.stage_memory(t, 1, 5, True, True, False, 3)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 20), tp=st.sampled_from([2, 4, 8]), in_flight=st.integers(1, 8),
       first=st.booleans(), last=st.booleans(), recompute=st.booleans())
def test_memory_is_strictly_less_on_every_tp_stage(layers: int, tp: int, in_flight: int, first: bool, last: bool,
                                                   recompute: bool) -> None:
    off, on = models()
    a = off.stage_memory("chip-b", tp, layers, first, last, recompute, in_flight)
    b = on.stage_memory("chip-b", tp, layers, first, last, recompute, in_flight)
    assert b.activations < a.activations
    assert (b.params, b.grads, b.optimizer, b.overhead) == (a.params, a.grads, a.optimizer, a.overhead)


def sp_strategy() -> Strategy:
    chip_b = [d.id for d in H2.devices if d.type == "chip-b"][:2]
    chip_a = [d.id for d in H2.devices if d.type == "chip-a"][:2]
    return Strategy("s", (Pipeline(8, (Stage(tuple(chip_a), (0, 20)), Stage(tuple(chip_b), (20, 40)))),))


def test_estimate_and_simulator_price_it_alike() -> None:
    """One model for both: the simulator's step and memory under sequence parallelism follow the estimate's,
    and both differ from the plan priced without it."""
    off, on = models()
    s = sp_strategy()
    assert has_tp_stage(s)
    for cm in (off, on):
        est = cm.estimate(s, 8, "1f1b")
        sim = simulate(cm, s, 8, "1f1b", 0)
        assert sim.step_time_s == pytest.approx(est.step_time_s, rel=0.02)
    e_off, e_on = off.estimate(s, 8, "1f1b"), on.estimate(s, 8, "1f1b")
    assert all(e_on.memory[d].total < e_off.memory[d].total for d in s.devices)
    s_off, s_on = simulate(off, s, 8, "1f1b", 0), simulate(on, s, 8, "1f1b", 0)
    assert all(s_on.peak_memory_gib[d] < s_off.peak_memory_gib[d] for d in s.devices)
    assert s_on.step_time_s != s_off.step_time_s


def test_for_plan_reads_the_switch_and_plans_write_it_only_when_on() -> None:
    t = TrainingSettings(global_batch=8, micro_batch=1, seq_len=4096)
    plan = Plan(PLAN_VERSION, "llama-13b", "h2-example", t, (sp_strategy(),))
    assert not CostModel.for_plan(plan, L13, H2, PROFILES).sequence_parallel
    assert "sequence_parallel" not in to_data(t)   # plans without it read and write as before
    on = dataclasses.replace(plan, training=dataclasses.replace(t, sequence_parallel=True))
    assert CostModel.for_plan(on, L13, H2, PROFILES).sequence_parallel
    assert to_data(on.training)["sequence_parallel"] is True
