"""Documents runs train exactly like the single-process reference that runs each document alone: packed
micro-batches on a plan with TP and uneven pipelines, two strategies switched in memory between steps, and a
resume from a checkpoint mid-trace (losses, grad norms, final parameters).

One 4-process gloo world serves the module; the run's own dispatch and switching code drives every step
(tests/integration/lengths_world.py), the reference is computed here in the test process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lengths_world import BINS, Result, documents_job, holdings_job, source
from oracles import train_documents

from runtime.comm.world import LocalWorld
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_plan_context

PLANS = Path(__file__).parent / "engine_plans"
PLAN = str(PLANS / "lengths-two.yaml")
TP_PP = str(PLANS / "lengths-tp-pp.yaml")
RTOL = 1e-5
ATOL_STEPS = 1e-3  # x lr: see test_engine_correctness.py
BOTH = ("short", "long")
SLOWER = {"long": 50.0}  # makes the hysteresis switch back to `short` as soon as a step allows it


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(4, timeout_s=60)
    w.start()
    yield w
    w.close()


@pytest.fixture(scope="module")
def ctx():
    return load_plan_context(PLAN)


def reference(ctx, steps, **kw):
    trainer = ReferenceTrainer(ctx.model, ctx.plan.training)
    src = source(ctx, **kw)
    stats = [train_documents(trainer, [d.tokens for d in src.documents(k).documents]) for k in steps]
    return stats, trainer


def run(world, names, steps, plan=PLAN, **kw) -> dict[int, Result]:
    out = world.run(documents_job, plan, names, tuple(steps), kw.get("slower"), kw.get("load_dir"),
                    kw.get("save_dir"), kw.get("bins", BINS), kw.get("tokens_per_step"), timeout_s=300)
    return {r.device: r for r in out}


def step_values(results: dict[int, Result], key: str) -> list[float]:
    """Per step the value every active device reports (they must agree)."""
    per_step = []
    for k in range(len(next(iter(results.values())).strategies)):
        vals = [getattr(r, key)[k] for r in results.values() if getattr(r, key)[k] is not None]
        assert vals, f"step {k}: no device ran it"
        assert max(vals) - min(vals) <= 1e-6 * max(1.0, abs(vals[0])), f"{key} differs across devices: {vals}"
        per_step.append(vals[0])
    return per_step


def assemble(results: dict[int, Result], name: str, shape) -> torch.Tensor:
    full = torch.full(shape, float("nan"))
    for r in results.values():
        if r.state is not None and name in r.regions and r.primary[name]:
            full[tuple(slice(a, b) for a, b in r.regions[name])] = torch.from_numpy(r.state[name])
    assert not torch.isnan(full).any(), f"{name}: primary shards do not cover it"
    return full


def check_against_reference(ctx, results, steps, **data):
    ref_stats, trainer = reference(ctx, steps, **data)
    torch.testing.assert_close(step_values(results, "losses"), [s.loss for s in ref_stats], rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(step_values(results, "grad_norms"), [s.grad_norm for s in ref_stats], rtol=1e-4,
                               atol=1e-6)
    ref = trainer.parameters()
    atol = ATOL_STEPS * ctx.plan.training.optimizer.lr
    for info in llama_parameters(ctx.model):
        got = assemble(results, info.name, info.shape)
        torch.testing.assert_close(got, ref[info.name], rtol=RTOL, atol=atol,
                                   msg=lambda m, n=info.name: f"{n}: {m}")


@pytest.mark.parametrize("plan, name", [(PLAN, "long"), (TP_PP, "mixed")])
def test_packed_documents_on_tp_and_uneven_pipelines(world, plan, name):
    ctx = load_plan_context(plan)
    steps = (1, 2, 3)
    results = run(world, (name,), steps, plan)
    r0 = results[0]
    assert r0.strategies == [name] * 3
    # several documents share a micro-batch (fewer micro-batches than documents), on both pipelines
    for docs, mbs in zip(r0.documents, r0.micro_batches):
        assert sum(len(p) for p in mbs) < docs
        assert all(mbs), "every pipeline gets work"
        assert sum(sum(p) for p in mbs) == ctx.plan.training.tokens_per_step
    check_against_reference(ctx, results, steps)


def test_a_pipeline_may_get_no_document(world, ctx):
    data = {"bins": ((20, 20, 1.0),), "tokens_per_step": 20}   # one document per step, two pipelines
    results = run(world, ("long",), (1, 2), **data)
    assert all(sorted(len(p) for p in mbs) == [0, 1] for mbs in results[0].micro_batches)
    check_against_reference(ctx, results, (1, 2), **data)


@pytest.fixture(scope="module")
def switched(world):
    return run(world, BOTH, (1, 2, 3, 4), slower=SLOWER)


def test_two_strategies_switched_between_steps(switched, ctx):
    r0 = switched[0]
    assert r0.strategies == ["short", "long", "short", "long"]
    assert r0.switched == [None, "short", "long", "short"]
    assert all(r.strategies == r0.strategies for r in switched.values())
    # `short` is four single-device pipelines: each device ran steps 1 and 3 itself
    assert all(r.losses[0] is not None for r in switched.values())
    check_against_reference(ctx, switched, (1, 2, 3, 4))


def test_resume_mid_trace_continues_identically(world, switched, ctx, tmp_path):
    save = tmp_path / "ckpt"
    first = run(world, BOTH, (1, 2), slower=SLOWER, save_dir=str(save))
    assert first[0].strategies == ["short", "long"]
    assert (save / "step-00000002" / "dispatch.json").is_file() and (save / "latest").read_text() == "step-00000002\n"
    rest = run(world, BOTH, (3, 4), slower=SLOWER, load_dir=str(save))
    assert rest[0].strategies == switched[0].strategies[2:]
    assert rest[0].switched == switched[0].switched[2:]     # the hysteresis resumed on `long`, as it was
    torch.testing.assert_close(step_values(rest, "losses"), step_values(switched, "losses")[2:], rtol=1e-6, atol=0.0)
    for info in llama_parameters(ctx.model):
        torch.testing.assert_close(assemble(rest, info.name, info.shape), assemble(switched, info.name, info.shape),
                                   rtol=1e-6, atol=1e-8)


def test_only_the_current_strategy_holds_state_and_a_switch_moves_it_in_stages(world, ctx):
    """The bytes each program's tensors hold (counted from the tensors), after every step and at both phases
    of every stage of every switch, against the staged switch plan (runtime/torchfree/elastic/staging.py): the other
    strategy holds nothing, each stage adds the destination's unit and then frees the source's, and the peak
    stays within max(A, B) + one stage, below the A + B of keeping both."""
    out = {h.device: h for h in world.run(holdings_job, PLAN, BOTH, (1, 2, 3, 4), SLOWER, timeout_s=300)}
    index = {n: i for i, n in enumerate(BOTH)}
    assert out[0].strategies == ["short", "long", "short", "long"]
    for dev, h in out.items():
        for name, held in zip(h.strategies, h.between_steps):
            i = index[name]
            assert held[i] > 0, f"device {dev}: {name} ran but its program holds nothing"
            assert all(b == 0 for j, b in enumerate(held) if j != i), f"device {dev}: idle strategies hold {held}"
        assert set(h.modelled) == {"0>1", "1>0"}
        # the stage events in order: two switches (short>long, long>short, short>long), each stage twice
        events = iter(h.stages)
        for (a, b), before, after in zip(((0, 1), (1, 0), (0, 1)), h.between_steps, h.between_steps[1:]):
            m = h.modelled[f"{a}>{b}"]
            assert m["start"] == sum(before), f"device {dev}: the model's start state {m['start']} vs held {before}"
            assert m["end"] == sum(after), f"device {dev}: the model's end state {m['end']} vs held {after}"
            held_before = m["start"]
            peak = held_before
            for k, (done, dst) in enumerate(zip(m["held"], m["dst"])):
                unit, ka, phase, allocated = next(events)
                assert (ka, phase) == (k, "allocated")
                assert sum(allocated) == held_before + dst, f"device {dev} {a}>{b} {unit}: allocated {allocated}"
                peak = max(peak, sum(allocated))
                unit2, kd, phase, freed = next(events)
                assert (unit2, kd, phase) == (unit, k, "done")
                assert sum(freed) == done, f"device {dev} {a}>{b} {unit}: {freed} held after, model {done}"
                held_before = done
            bound = max(m["start"], m["end"]) + m["stage_max"]
            assert peak <= m["peak"] <= bound, f"device {dev} {a}>{b}: peak {peak}, model {m['peak']}, bound {bound}"
            assert m["peak"] < m["start"] + m["end"], f"device {dev}: no better than holding both"
        assert next(events, None) is None
