"""Shared by the elastic and switching tests: small plans on cpu-hetero4, the single-process reference on
the launcher's data stream, and checks of a run's losses and saved state against it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from oracles import optimizer_state

from runtime.checkpoint import read_saved
from runtime.data import token_source
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.spec import PlanContext, load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

REPO = Path(__file__).resolve().parents[2]
HETERO_PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
LR = 1e-3
# The engine's tolerances (tests/integration/test_engine_correctness.py): losses rtol 1e-5; parameters
# rtol 1e-5 plus 1e-3 of an Adam step (eps 1e-5 keeps fp32 rounding noise below that); moments rtol 1e-5
# plus 1e-5 of their largest entry.
RTOL = 1e-5
EPS = 1e-5
PARAM_ATOL = 1e-3 * LR

Layout = list[tuple[int, list[tuple[list[int], tuple[int, int]]]]]


def write_plan(dst: Path, name: str, pipelines: Layout, *, global_batch: int, micro_batch: int = 1,
               seq_len: int = 16, cluster: str = "cpu-hetero4") -> Path:
    """A llama-tiny plan on cpu-hetero4 (or ``cluster``: a catalog name or a path) from [(micro_batches,
    [(devices, (first layer, end)), ...]), ...]."""
    plan = load_plan(HETERO_PLAN)
    strategy = Strategy(name, tuple(Pipeline(mb, tuple(Stage(tuple(d), lay) for d, lay in stages))
                                    for mb, stages in pipelines))
    optimizer = replace(plan.training.optimizer, lr=LR, eps=EPS)
    training = replace(plan.training, global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len,
                       optimizer=optimizer)
    save_plan(replace(plan, model="llama-tiny", cluster=cluster, training=training, strategies=(strategy,)), dst)
    load_plan_context(dst)  # valid
    return dst


def reference(plan: Path, steps: int, micro_batch: int | None = None) -> tuple[list[float], ReferenceTrainer]:
    """The uninterrupted single-process run: its losses and the trainer (parameters, moments); ``micro_batch``:
    the plan's forwards' size where the model depends on it (a MoE model's balance loss), else the whole batch."""
    ctx = load_plan_context(plan)
    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t, micro_batch=micro_batch)
    source = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len,
                          seed=t.seed)
    return [trainer.train_step(source.batch(s)).loss for s in range(1, steps + 1)], trainer


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    return read_saved(directory)[0]


def assert_matches_reference(saved: dict[str, torch.Tensor], trainer: ReferenceTrainer) -> None:
    expected = {**trainer.parameters(), **optimizer_state(trainer)}
    assert set(saved) == set(expected)
    for name, want in expected.items():
        atol = RTOL * float(want.abs().max()) if name.endswith(("exp_avg", "exp_avg_sq")) else PARAM_ATOL
        torch.testing.assert_close(saved[name], want, rtol=RTOL, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def write_nodes_cluster(dst: Path, nodes: list[tuple[str, str, int]]) -> Path:
    """cpu-hetero4's device types on the given nodes [(name, cpu-fast | cpu-slow, count), ...]: emulated
    nodes on this host, for node agents on loopback."""
    text = (REPO / "configs" / "clusters" / "cpu-hetero4.yaml").read_text()
    head = text[:text.index("nodes:")].replace("name: cpu-hetero4", f"name: {dst.stem}")
    dst.write_text(head + "nodes:\n" + "".join(f"  - {{name: {n}, device_type: {t}, count: {c}}}\n"
                                               for n, t, c in nodes))
    return dst


def fixed_grow(target: Path, calls: list[tuple[frozenset[int], str, int]]):
    """A Grower that always adopts with a hand-written plan and records what it was asked."""

    def grow(joining: frozenset[int], ctx: PlanContext, strategy: str, steps_left: int) -> PlanContext:
        calls.append((joining, strategy, steps_left))
        return load_plan_context(target)

    return grow


def fixed_replan(target: Path, calls: list[tuple[frozenset[int], str]]):
    """A Replanner that answers with a hand-written plan and records what it was asked."""

    def replan(failed: frozenset[int], ctx: PlanContext, strategy: str, steps_left: int) -> PlanContext:
        calls.append((failed, strategy))
        return load_plan_context(target)

    return replan


def switch_roundtrip_job(w, plan_a: str, plan_b: str, batches: list) -> dict | None:
    """On every worker of a LocalWorld: train plan A, switch to B and back to A in memory (the runtime's own
    ``plan_switch`` + ``move_state``), and report whether this device's state came back bit for bit."""
    from datetime import timedelta

    from runtime.elastic.move import move_state
    from runtime.engine.api import WorkerContext as EngineContext
    from runtime.engine.program import DeviceProgram
    from runtime.torchfree.elastic.state import plan_switch
    from runtime.torchfree.spec.handle import StrategyHandle

    timeout = timedelta(seconds=60)
    a, b = StrategyHandle.of(load_plan_context(plan_a), "a"), StrategyHandle.of(load_plan_context(plan_b), "b")

    def build(ref: StrategyHandle):
        w.groups.ensure(DeviceProgram.required_groups(ref))
        if w.device not in ref.devices:
            return None
        ctx = EngineContext(ref, w.device, w.ranks, torch.device("cpu"), timeout)
        return DeviceProgram(ctx, w.groups)

    program = build(a)
    for batch in batches:
        if program is not None:
            program.train_step(torch.from_numpy(batch))
    before = {k: v.clone() for k, v in program.local_state().items()} if program is not None else {}
    on_b = build(b)
    forth = plan_switch(a, b)
    move_state(forth, program.local_state() if program is not None else {}, w.groups, on_b, len(batches),
               torch.device("cpu"))
    back = build(a)
    move_state(plan_switch(b, a), on_b.local_state() if on_b is not None else {}, w.groups, back, len(batches),
               torch.device("cpu"))
    if back is None:
        return None
    after = back.local_state()
    return {"device": w.device, "held_on_b": on_b is not None, "bytes_forth": forth.total_bytes,
            "same_keys": set(after) == set(before),
            "identical": all(torch.equal(after[k], before[k]) for k in before),
            "moved": any(not torch.equal(after[k], torch.zeros_like(after[k])) for k in before if k != "step")}
