"""``hspmd plan --lengths`` and ``hspmd simulate --lengths``: the mixed-length halves of those verbs (kept
apart from their fixed-length code: one concern per file)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape

from hetu_cli.output import console, emit_json, table
from planner.cost import CostModel
from planner.lengths import (
    LengthSettings,
    LengthStrategy,
    SwitchCosts,
    build_plan,
    chrome_trace,
    fixed_step_seconds,
    length_ranges,
    plan_lengths,
    play,
    shared,
    stage_rooms,
    strategy_cost,
)
from planner.margin import MemoryMargin
from runtime.documents import length_distribution
from runtime.launch.options import TrainOptions
from runtime.launch.session import document_source_of
from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import dump_plan, load_cluster, load_model, validate_plan
from runtime.torchfree.spec.catalog import PlanContext, recorded_ref
from runtime.torchfree.spec.io import atomic_write_files, atomic_write_text


def plan_for_lengths(model_ref: str, cluster_ref: str, profile_dirs: Sequence[Path], lengths: str,
                     tokens_per_step: int | None, max_len: int | None, unused: Mapping[str, object],
                     max_strategies: int, time_limit: float, out_path: Path | None, fmt: str,
                     fixed_path: Path | None = None, margin: MemoryMargin = MemoryMargin()) -> None:
    """``margin``: the memory every device keeps free (planned on the capacity it leaves). ``unused``: the
    fixed-length options given (None where not), refused: a documents plan is micro-batch 1, ZeRO off
    (in-memory switches need full replicas) and a step is ``tokens_per_step`` tokens."""
    problems = [Problem(opt, "", "not used with --lengths (a step is --tokens-per-step tokens of documents, "
                                 "micro-batch 1, ZeRO off)") for opt, v in unused.items() if v is not None]
    if tokens_per_step is None:
        problems.append(Problem("--tokens-per-step", "", "is required with --lengths (the tokens of one step)"))
    if problems:
        raise SpecError(problems)
    model = load_model(model_ref, file="--model", field="")
    if model.moe is not None:   # what hspmd train refuses (runtime/torchfree/spec/catalog.py check_trainable)
        raise SpecError([Problem("--lengths", "", f"{model_ref}: a MoE model is not planned for packed documents "
                                                  "(hspmd train does not run it on them: its load-balancing loss "
                                                  "is weighted by fixed micro-batches)")])
    cluster = load_cluster(cluster_ref, file="--cluster", field="")
    profiles = resolve_profiles(cluster.device_types, list(profile_dirs))
    top = model.max_seq_len if max_len is None else max_len
    if top > model.max_seq_len:
        raise SpecError([Problem("--seq-len", "", f"{top} exceeds {model.name}'s max_seq_len {model.max_seq_len}")])
    dist = length_distribution(lengths, top)
    settings = LengthSettings(tokens_per_step=tokens_per_step, max_len=top, max_strategies=max_strategies,
                              time_limit_s=time_limit)
    result = plan_lengths(model, margin.apply(cluster), profiles, dist, settings)
    planned = result.to_plan(recorded_ref(model_ref, "models", plan_file=out_path),
                             recorded_ref(cluster_ref, "clusters", plan_file=out_path))
    problems = validate_plan(planned, model, cluster, str(out_path or "plan"))
    if problems:   # a planner bug, not a user error: refuse to write it
        raise RuntimeError("planner produced an invalid plan: " + "; ".join(str(x) for x in problems))
    fixed = build_plan([result.single_best], settings, recorded_ref(model_ref, "models", plan_file=fixed_path),
                       recorded_ref(cluster_ref, "clusters", plan_file=fixed_path))
    atomic_write_files([(path, dump_plan(p).encode()) for p, path in ((planned, out_path), (fixed, fixed_path))
                        if path is not None])
    ranges = length_ranges(planned)
    rows = [{"name": s.name, "range": list(ranges[s.name]), "max_seq_len": s.max_seq_len, "summary": ls.summary,
             "pipeline_capacity_tokens": [p.capacity for p in ls.cost.pipelines], "fixed_step_s": ls.fixed_s}
            for s, ls in zip(planned.strategies, result.strategies)]
    speedup = result.single_expected_s / result.expected_step_s
    if fmt == "json":
        emit_json({"model": model.name, "cluster": cluster.name, "distribution": dist.name,
                   "tokens_per_step": tokens_per_step, "max_len": top, "strategies": rows,
                   "expected_step_time_s": result.expected_step_s,
                   "single_strategy": {"summary": result.single_best.summary,
                                       "expected_step_time_s": result.single_expected_s},
                   "speedup_over_single": speedup, "planning_steps": settings.sample_steps,
                   "candidates": len(result.candidates), "notes": list(result.notes),
                   "output": None if out_path is None else str(out_path),
                   "fixed_output": None if fixed_path is None else str(fixed_path)})
        return
    con = console()
    con.print(f"[bold]{model.name}[/bold] on [bold]{cluster.name}[/bold]: documents of {dist.name} lengths up to "
              f"{top} tokens, {tokens_per_step:,} tokens per step; {len(result.candidates)} candidate strategies")
    cols = ("strategy", "lengths", "pipelines (micro-batch capacity, tokens)", "plan")
    out = table("strategies (each serves its length range)", cols, left=cols)
    for r in rows:
        out.add_row(r["name"], f"{r['range'][0]}-{r['range'][1]}",
                    ", ".join(f"{c:,}" for c in r["pipeline_capacity_tokens"]), escape(r["summary"]))
    con.print(out)
    con.print(f"expected step time {result.expected_step_s:.4g} s over {settings.sample_steps} sampled steps "
              f"(switches included) vs {result.single_expected_s:.4g} s for the best single plan at {top} "
              f"({escape(result.single_best.summary)}): {speedup:.3g}x")
    for n in result.notes:
        con.print(f"note: {escape(n)}")
    if out_path is not None:
        con.print(f"plan written to [bold]{escape(str(out_path))}[/bold]")
    if fixed_path is not None:
        con.print(f"the single plan for the longest document written to [bold]{escape(str(fixed_path))}[/bold]")


def strategies_of(ctx: PlanContext, profiles) -> list[LengthStrategy]:
    """The plan's strategies priced for dispatch, by ascending length range (as ``plan --lengths`` wrote them)."""
    t = ctx.plan.training
    out = []
    for s in ctx.plan.strategies:
        top = t.seq_len if s.max_seq_len is None else s.max_seq_len
        cm = CostModel(ctx.model, ctx.cluster, profiles, micro_batch=1, seq_len=top)
        out.append(LengthStrategy(s, strategy_cost(cm, s, top), fixed_step_seconds(cm, s, t.schedule), s.name,
                                  "plan", rooms=stage_rooms(cm, s)))
    settings = LengthSettings(tokens_per_step=t.tokens_per_step or t.global_batch * t.seq_len, max_len=t.seq_len)
    together = shared(out, ctx.model, ctx.cluster, settings)   # as a documents run holds and switches them
    if together is None:
        raise SpecError([Problem(str(ctx.path), "strategies", "a switch between the strategies does not fit "
                                 "memory (a documents run moves the state in stages: "
                                 "runtime/torchfree/elastic/staging.py)")])
    return together


def planner_dispatch_costs(options: TrainOptions, profile_dirs: Sequence[Path]) -> TrainOptions:
    """``options`` with the planner's dispatch costs (``strategies_of``) for the strategies the run trains, so
    that the run dispatches and switches as ``hspmd simulate --lengths`` plays it."""
    from runtime.launch.session import documents_mode, run_strategies
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(options.plan)
    if not documents_mode(options, ctx.plan.training):
        raise SpecError([Problem("--dispatch-costs", "", "only documents runs dispatch (give --lengths or --data "
                                                         "FILE.jsonl, or a plan with training.tokens_per_step)")])
    names = run_strategies(ctx, options)
    ctx = dataclasses.replace(ctx, plan=dataclasses.replace(
        ctx.plan, strategies=tuple(ctx.strategy(n) for n in names)))
    profiles = resolve_profiles(ctx.cluster.device_types, list(profile_dirs))
    return dataclasses.replace(options, dispatch_costs=tuple(m.cost for m in strategies_of(ctx, profiles)))


def simulate_lengths(ctx: PlanContext, profile_dirs: Sequence[Path], lengths: str, steps: int,
                     tokens_per_step: int | None, strategy_name: str | None, trace_path: Path | None,
                     fmt: str) -> None:
    """``strategy_name``: that strategy alone (as ``hspmd train --strategy`` runs it), else all of the plan's."""
    t = ctx.plan.training
    tokens = tokens_per_step or t.tokens_per_step
    if tokens is None:
        raise SpecError([Problem(str(ctx.path), "training.tokens_per_step",
                                 "not set: give --tokens-per-step (the tokens of one step) to simulate documents")])
    if tokens != t.tokens_per_step:
        ctx = dataclasses.replace(ctx, plan=dataclasses.replace(
            ctx.plan, training=dataclasses.replace(t, tokens_per_step=tokens)))
    if strategy_name is not None:
        only = ctx.strategy(strategy_name)
        ctx = dataclasses.replace(ctx, plan=dataclasses.replace(ctx.plan, strategies=(only,)))
    profiles = resolve_profiles(ctx.cluster.device_types, list(profile_dirs))
    dist = length_distribution(lengths, t.seq_len)
    members = strategies_of(ctx, profiles)
    longest = max(m.cost.max_seq_len for m in members)
    if longest < t.seq_len:
        raise SpecError([Problem(str(ctx.path), "strategies", f"the strategies serve documents up to {longest} "
                                                              f"tokens, not training.seq_len {t.seq_len}")])
    # The documents ``hspmd train --lengths`` trains (the runtime's own source), its steps 1..N.
    source = document_source_of(ctx, TrainOptions(plan=ctx.path, lengths=lengths))
    trace = play(members, source.lengths, range(1, steps + 1), SwitchCosts(ctx, list(ctx.plan.strategies)))
    if trace_path is not None:
        atomic_write_text(trace_path, json.dumps(chrome_trace(trace)))
    if fmt == "json":
        out: dict[str, Any] = {"plan": str(ctx.path), "distribution": dist.name, "tokens_per_step": tokens,
                               **trace.to_json(), "time_model": TIME_MODEL}
        if trace_path is not None:
            out["trace"] = str(trace_path)
        emit_json(out)
        return
    con = console()
    con.print(f"[bold]{ctx.model.name}[/bold] on [bold]{ctx.cluster.name}[/bold]: {steps} steps of "
              f"{tokens:,} tokens, {dist.name} lengths up to {t.seq_len}")
    per_step = table("per step (seconds)", ("step", "strategy", "docs", "longest", "time", "compute", "switch",
                                             "imbalance", "idle per pipeline"), left=("strategy", "idle per pipeline"))
    for r in trace.steps:
        per_step.add_row(str(r.step), r.strategy, str(r.documents), str(r.longest), f"{r.time_s:.4g}",
                         f"{r.compute_s:.4g}", f"{r.switch_s:.3g}" if r.switch_s else "", f"{r.imbalance:.3f}",
                         " ".join(f"{x:.3g}" for x in r.idle_s))
    con.print(per_step)
    counts = trace.to_json()["strategy_steps"]
    con.print(f"total {trace.total_s:.4g} s, mean {trace.mean_step_s:.4g} s/step, {trace.switches} switch(es) "
              f"({sum(r.switch_s for r in trace.steps):.3g} s); steps per strategy: "
              + ", ".join(f"{k} {v}" for k, v in counts.items()))
    con.print(f"time model: {TIME_MODEL}")
    if trace_path is not None:
        con.print(f"trace: {trace_path} (open in https://ui.perfetto.dev)")


TIME_MODEL = ("cost-model estimate per step (runtime.torchfree.dispatch.pipeline_time over each pipeline's "
              "micro-batches, "
              "documents priced a*s^2+b*s from the profiles) + gradient sync and optimizer (CostModel.estimate) "
              "+ the modelled fused-BSR switch; not the discrete-event simulator, which plays equal micro-batches only")
