"""``hspmd simulate --plan PLAN``: play one training step out on the cost model (discrete events)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
from rich.markup import escape

from hetu_cli.commands.lengths_report import simulate_lengths
from hetu_cli.output import (
    FORMAT_OPTION,
    PROFILE_OPTION,
    IntRange,
    console,
    emit_json,
    plan_argument,
    printable,
    refuse_given,
    table,
)
from planner.cost import CostModel, zero_copies
from planner.provenance import check_profiles, provenance, recorded_difference, strategy_tps
from planner.simulate import chrome_trace
from planner.simulate import simulate as run_simulation
from runtime.elastic.events import MAX_TRACE_SEARCHES
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.io import atomic_write_text, check_output_file
from runtime.torchfree.spec.plan import MAX_TOKENS_PER_STEP

MAX_TRACE_STEPS = 10_000
MAX_SEARCHES = 10_000  # the trace's own bound is 1000 events (runtime/elastic/events.py), a few searches each


@click.command()
@plan_argument("The plan to simulate")
@PROFILE_OPTION
@click.option("--strategy", "strategy_name", help="Strategy of the plan to simulate (default: the first).")
@click.option("--cluster", help="Use this cluster (name or path) instead of the plan's.")
@click.option("--model", "model_ref", help="Use this model (name or path) instead of the plan's.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path),
              help="Write a Chrome-trace JSON timeline here (open in https://ui.perfetto.dev).")
@click.option("--lengths", help="Play a trace of document steps (lengths from this distribution or histogram "
                                "file) on all of PLAN's strategies, as the dispatcher chooses.")
# Each step is drawn and priced in turn (~10 ms); a billion would not finish.
@click.option("--steps", type=IntRange(min=1, max=MAX_TRACE_STEPS), default=20, show_default=True,
              help="With --lengths: steps.")
@click.option("--tokens-per-step", type=IntRange(min=1, max=MAX_TOKENS_PER_STEP),
              help="With --lengths: tokens per step (default: the plan's training.tokens_per_step).")
@click.option("--events", "events_file", type=click.Path(path_type=Path),
              help="Model a failure trace instead (the --events file of hspmd train): goodput of hspmd vs "
                   "checkpoint-restart vs an Oobleck-like baseline.")
@click.option("--max-searches", type=IntRange(min=1, max=MAX_SEARCHES), default=MAX_TRACE_SEARCHES,
              show_default=True, help="With --events: the planner searches the model may run (a trace through "
                                      "more distinct device sets is refused before any; each is seconds at paper "
                                      "scale).")
@FORMAT_OPTION
def simulate(plan_path: Path, profile_dirs: tuple[Path, ...], strategy_name: str | None, cluster: str | None,
             model_ref: str | None,
             trace_path: Path | None, lengths: str | None, steps: int, tokens_per_step: int | None,
             events_file: Path | None, max_searches: int, fmt: str) -> None:
    """Simulate one training step of PLAN: step time, tokens/s, MFU, per-stage compute / comm /
    bubble, and peak memory per device with out-of-memory flags. With --lengths: a trace of steps of
    documents (per step: strategy, time, switch, idle per pipeline)."""
    if lengths is None:
        refuse_given("only with --lengths", "steps", "tokens_per_step")
    elif events_file is not None:
        refuse_given("not with --lengths (it models failures of fixed-length steps)", "events_file")
    if events_file is not None:
        refuse_given("not with --events (the failure model writes no timeline)", "trace_path")
    else:
        refuse_given("only with --events", "max_searches")
    if trace_path is not None:
        check_output_file(trace_path, "--trace")
    ctx = load_plan_context(plan_path, cluster=cluster, model=model_ref)
    if lengths is not None:
        simulate_lengths(ctx, profile_dirs, lengths, steps, tokens_per_step, strategy_name, trace_path, fmt)
        return
    profiles = resolve_profiles(ctx.cluster.device_types, list(profile_dirs))
    for line in check_profiles(profiles, ctx.model, ctx.cluster, profile_dirs, cluster or "the plan's cluster"):
        click.echo(f"warning: {printable(line)}", err=True)
    if events_file is not None:
        _events(ctx, strategy_name, profiles, events_file, max_searches, fmt)
        return
    strategy = ctx.strategy(strategy_name)
    t = ctx.plan.training
    note = ctx.model.pricing_note(t.seq_len)
    if note is not None:
        click.echo(f"note: {note}", err=True)
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
    result = run_simulation(cm, strategy, t.global_batch, t.schedule, zero_copies(t))
    if trace_path is not None:
        atomic_write_text(trace_path, json.dumps(chrome_trace(result, strategy)))
    priced = provenance(profiles, ctx.model, strategy_tps(dataclasses.replace(ctx.plan, strategies=(strategy,)),
                                                          ctx.cluster))
    drift = estimate_drift(ctx, strategy, result.formula_step_time_s, priced, (cluster, model_ref))
    if drift is not None:
        click.echo(f"warning: {printable(drift)}", err=True)
    if fmt == "json":
        out = result.to_json()
        out["profiles"] = {name: t.to_json() for name, t in priced.items()}
        out["estimate_drift"] = drift
        out["measured_fits"] = {name: any(cm.is_measured(name, s.tp) for p in strategy.pipelines for s in p.stages)
                                for name in profiles}
        if trace_path is not None:
            out["trace"] = str(trace_path)
        emit_json(out)
        return
    con = console()
    scheds = sorted(set(result.pipeline_schedules))
    con.print(f"[bold]{ctx.model.name}[/bold] on [bold]{ctx.cluster.name}[/bold], strategy {strategy.name!r}, "
              f"{', '.join(scheds)}, global batch {t.global_batch} x {t.seq_len} tokens")
    for t in priced.values():
        con.print(f"  {escape(t.line())}")
    stages = table("per stage (seconds per step)", ("pipe", "schedule", "stage", "devices", "type", "TP", "layers",
                   "mb", "compute", "comm", "p2p", "optim", "bubble", "in-flight", "peak GiB", "cap GiB"),
                   left=("devices", "type", "layers"))
    for s in result.stages:
        mem = f"[red]{s.peak_memory_gib:.2f} OOM[/red]" if s.oom else f"{s.peak_memory_gib:.2f}"
        sched = result.pipeline_schedules[s.pipeline] if s.stage == 0 else ""
        stages.add_row(str(s.pipeline), sched, str(s.stage), ",".join(map(str, s.devices)), s.device_type, str(s.tp),
                      " + ".join(f"[{a}, {b})" for a, b in s.layers), str(s.micro_batches), f"{s.compute_s:.4f}",
                      f"{s.comm_s:.4f}", f"{s.p2p_s:.4f}", f"{s.optimizer_s:.4f}", f"{s.bubble_s:.4f}",
                      str(s.peak_in_flight), mem, f"{s.capacity_gib:g}")
    con.print(stages)
    con.print(f"step time [bold]{result.step_time_s:.4f} s[/bold] (cost-model estimate "
              f"{result.formula_step_time_s:.4f} s), {result.tokens_per_s:,.0f} tokens/s, MFU {result.mfu:.1%}")
    if result.oom_devices:
        con.print(f"[red]out of memory on device(s) {', '.join(map(str, result.oom_devices))}[/red]")
    if trace_path is not None:
        con.print(f"trace: {trace_path} (open in https://ui.perfetto.dev)")


DRIFT = 0.05   # an estimate this far from the plan's recorded one is worth a warning


def estimate_drift(ctx, strategy, estimate_s: float, priced, overrides: tuple[str | None, str | None]) -> str | None:
    """A sentence when the cost model's step time now differs from the one the plan recorded by more than
    ``DRIFT``, saying why where it can (another profile, cluster or model than the plan was made with)."""
    recorded = (strategy.estimates or {}).get("step_time_s")
    if not recorded or abs(estimate_s / recorded - 1.0) <= DRIFT:
        return None
    why = recorded_difference(ctx.plan, priced, ctx.path.parent)
    if overrides[0] is not None:
        why.append(f"--cluster {overrides[0]} replaces the plan's cluster")
    if overrides[1] is not None:
        why.append(f"--model {overrides[1]} replaces the plan's model")
    if not why:
        why = ["the plan records no profiles to compare" if not ctx.plan.profiles else
               "the same profiles by name: their files, or the cost model, changed since the plan was made"]
    return (f"the cost model's step time {estimate_s:.4g} s differs from the plan's recorded estimate "
            f"{recorded:.4g} s by {estimate_s / recorded - 1.0:+.1%}: " + "; ".join(why))


def _events(ctx, strategy_name: str | None, profiles, events_file: Path, max_searches: int, fmt: str) -> None:
    from planner.trace_model import TraceModel, model_trace
    from runtime.elastic.events import load_trace
    from runtime.torchfree.spec.handle import StrategyHandle

    handle = StrategyHandle.of(ctx, strategy_name)
    trace = load_trace(events_file, ctx.cluster, handle.devices)
    steps = trace.steps or trace.events[-1].step + 100
    out = model_trace(handle, trace.events, steps, profiles, TraceModel(max_searches=max_searches),
                      source=str(events_file))
    if fmt == "json":
        emit_json(out)
        return
    con = console()
    con.print(f"{steps} steps, {trace.failures} failure(s), {trace.returns} return(s); initial step time "
              f"{out['initial_step_time_s']:.3f} s")
    for name in ("hspmd", "restart", "megatron_restart", "oobleck_like"):
        line = out[name]
        con.print(f"  {name:16s} {line['total_s']:10.1f} s, goodput {line['goodput_steps_per_s']:.4f} steps/s "
                  f"(step {line['initial_step_time_s']:.3f} s)")
    con.print(f"goodput over restart {out['modelled_goodput_over_restart']:.2f}x (planned layout), over Megatron's "
              f"restart {out['modelled_goodput_over_megatron_restart']:.2f}x (symmetric layout), over oobleck-like "
              f"{out['modelled_goodput_over_oobleck_like']:.2f}x (modelled)")
