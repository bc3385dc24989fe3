"""Documents-run jobs for a persistent gloo world (runtime.comm.world.LocalWorld): a plan's strategies, the
run's own dispatch and switching (runtime/launch/session.py ``DocumentSteps``), a few steps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from runtime.comm.world import WorkerContext

OP_TIMEOUT = timedelta(seconds=60)
BINS = ((2, 16, 96.0), (17, 64, 4.0))  # mostly short documents, now and then one that only `long` holds


def source(ctx, bins=BINS, tokens_per_step: int | None = None, seed: int = 0):
    from runtime.documents import LengthBin, LengthDistribution, SyntheticDocuments

    t = ctx.plan.training
    dist = LengthDistribution("test", tuple(LengthBin(*b) for b in bins))
    return SyntheticDocuments(dist, tokens_per_step or t.tokens_per_step, t.seq_len, ctx.model.vocab_size, seed)


def scaled_costs(ctx, names: tuple[str, ...], slower: dict[str, float]):
    """The plan-derived cost models, with the named strategies made ``slower`` times slower (so that the
    hysteresis takes switches both ways on this tiny model: what is under test is the switch, not the model)."""
    from runtime.torchfree.dispatch import CostModel, PipelineCost, StageCost, StrategyCost, plan_strategy_cost

    out = []
    for n in names:
        c = plan_strategy_cost(ctx.plan.strategy(n), ctx.model, ctx.cluster, ctx.plan.training)
        f = slower.get(n, 1.0)
        pipes = tuple(PipelineCost(tuple(StageCost(CostModel(s.cost.a * f, s.cost.b * f, s.cost.c * f),
                                                   s.activation_budget_tokens, s.microbatch_overhead * f)
                                         for s in p.stages)) for p in c.pipelines)
        out.append(StrategyCost(c.name, c.max_seq_len, pipes))
    return out


@dataclass
class Result:
    device: int
    strategies: list[str]
    switched: list[str | None]
    losses: list[float | None]     # None where the step's strategy left this device idle
    grad_norms: list[float | None]
    documents: list[int]
    micro_batches: list[list[list[int]]]   # per step, per pipeline: each micro-batch's tokens
    state: dict[str, np.ndarray] | None    # the final strategy's local_state()
    regions: dict[str, tuple[tuple[int, int], ...]]
    primary: dict[str, bool]


def documents_job(w: WorkerContext, plan: str, names: tuple[str, ...], steps: tuple[int, ...],
                  slower: dict[str, float] | None = None, load_dir: str | None = None,
                  save_dir: str | None = None, bins=BINS, tokens_per_step: int | None = None) -> Result:
    from pathlib import Path

    from runtime.engine.api import WorkerContext as EngineContext
    from runtime.engine.program import DeviceProgram
    from runtime.launch.session import DocumentSteps
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan)

    def build(handle):
        return DeviceProgram(EngineContext(handle, w.device, w.ranks, torch.device("cpu"), OP_TIMEOUT), w.groups)

    run = DocumentSteps(ctx, names, me=w.device, groups=w.groups, device=torch.device("cpu"), build=build,
                        source=source(ctx, bins, tokens_per_step), costs=scaled_costs(ctx, names, slower or {}))
    if load_dir is not None:
        assert run.load(Path(load_dir)) == steps[0] - 1
    res = Result(w.device, [], [], [], [], [], [], None, {}, {})
    for step in steps:
        program, batch, info = run.prepare(step)
        res.strategies.append(info.strategy)
        res.switched.append(info.switched_from)
        res.documents.append(info.documents)
        res.micro_batches.append([[m.shape[1] for m in p] for p in batch.pipelines])
        if program is None:
            res.losses.append(None)
            res.grad_norms.append(None)
            continue
        stats = program.train_step(batch)
        res.losses.append(stats.loss)
        res.grad_norms.append(stats.grad_norm)
    if save_dir is not None:
        from runtime.checkpoint_series import Saver, TrainerState

        run.save(Saver(Path(save_dir), None, lambda _line: None), TrainerState(steps[-1], ctx.plan.training.seed,
                                                                              {"step": steps[-1]}, b""),
                 background=False)
    program = run.current_program
    if program is not None:
        res.state = {k: v.detach().numpy().copy() for k, v in program.local_state().items()}
        ann = program.param_annotations()
        res.regions = {n: tuple((s.start, s.stop) for s in a.region) for n, a in ann.items()}
        res.primary = {n: a.primary for n, a in ann.items()}
    return res



def held_bytes(program) -> int:
    """Bytes of the training state a program holds, counted from its tensors (not from its own accounting):
    the distinct storages of its modules' parameters (local shards) and of its optimizer's AdamW moments."""
    if program is None:
        return 0
    from torch.distributed.tensor import DTensor

    tensors = [p.to_local() if isinstance(p, DTensor) else p for m in program.chunks for p in m.parameters()]
    tensors += [v for st in program.optimizer.optimizer.state.values() for k, v in st.items()
                if k in ("exp_avg", "exp_avg_sq")]
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@dataclass
class Holdings:
    device: int
    strategies: list[str]
    between_steps: list[list[int]]   # after each step: per strategy the bytes its program holds
    stages: list[tuple[str, int, str, list[int]]]   # per switch stage event: (unit, index, phase, per strategy)
    modelled: dict[str, dict]        # per switch "a>b": the plan's held-after per stage, peak, start, end


def holdings_job(w: WorkerContext, plan: str, names: tuple[str, ...], steps: tuple[int, ...],
                 slower: dict[str, float] | None = None) -> Holdings:
    """A documents run that records what each strategy's program holds after every step and at both phases
    of every switch stage (``DocumentSteps``'s observer), beside the staged switch plan's model of it."""
    from runtime.engine.api import WorkerContext as EngineContext
    from runtime.engine.program import DeviceProgram
    from runtime.launch.session import DocumentSteps
    from runtime.torchfree.elastic.staging import end_bytes, stage_bytes, start_bytes
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan)
    out = Holdings(w.device, [], [], [], {})
    programs: list = []

    def build(handle):
        return DeviceProgram(EngineContext(handle, w.device, w.ranks, torch.device("cpu"), OP_TIMEOUT), w.groups)

    def observe(k, stage, phase):
        out.stages.append((str(stage.unit), k, phase, [held_bytes(p) for p in programs]))

    run = DocumentSteps(ctx, names, me=w.device, groups=w.groups, device=torch.device("cpu"), build=build,
                        source=source(ctx), costs=scaled_costs(ctx, names, slower or {}), observe=observe)
    programs.extend(run.programs)
    for step in steps:
        before = run.holder
        program, batch, info = run.prepare(step)
        out.strategies.append(info.strategy)
        if run.holder != before:
            sw = run.switch_plan(before, run.holder)
            out.modelled[f"{before}>{run.holder}"] = {
                "held": [h.get(w.device, 0.0) for h in sw.held()], "peak": sw.peak().get(w.device, 0.0),
                "dst": [r[w.device].dst if w.device in r else 0.0 for r in sw.table],
                "start": start_bytes(sw.table).get(w.device, 0.0), "end": end_bytes(sw.table).get(w.device, 0.0),
                "stage_max": max((stage_bytes(r[w.device]) for r in sw.table if w.device in r), default=0.0)}
        if program is not None:
            program.train_step(batch)
        out.between_steps.append([held_bytes(p) for p in programs])
    return out
