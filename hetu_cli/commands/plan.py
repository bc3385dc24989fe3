"""``hspmd plan``: the fastest plan that fits, for a model on a (heterogeneous) cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetu_cli.commands.lengths_report import plan_for_lengths
from hetu_cli.expert_load import with_measured_load
from hetu_cli.output import (
    FORMAT_OPTION,
    PROFILE_OPTION,
    FiniteFloatRange,
    IntRange,
    console,
    emit_json,
    memory_margin_option,
    printable,
    refuse_given,
)
from planner.api import PlanSettings
from planner.api import plan as run_planner
from planner.margin import MemoryMargin, margin_said
from planner.provenance import check_profiles, provenance, strategy_tps, with_profiles
from planner.report import print_report, result_json
from planner.schedule_choice import AUTO
from planner.survival import NODE_PREFERENCE_TOLERANCE, plan_survival, prefer_node_survivable
from runtime.torchfree.errors import InfeasibleError, Problem, SpecError
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES
from runtime.torchfree.spec import dump_plan, load_cluster, load_model, validate_plan
from runtime.torchfree.spec.catalog import recorded_ref
from runtime.torchfree.spec.io import atomic_write_files, check_output_file
from runtime.torchfree.spec.plan import MAX_TOKENS_PER_STEP, Plan

MAX_STRATEGIES = 8   # every set of up to this many candidates is priced: C(n, k) grows fast past it


@click.command()
@click.option("--model", "model_ref", required=True, help="Model (catalog name or path).")
@click.option("--cluster", "cluster_ref", required=True, help="Cluster (catalog name or path).")
@PROFILE_OPTION
@click.option("--global-batch", type=IntRange(min=1), help="Sequences per step (required without --lengths).")
@click.option("--seq-len", type=IntRange(min=1),
              help="Tokens per sequence (required without --lengths); with --lengths the longest document "
                   "(default: the model's max_seq_len).")
@click.option("--micro-batch", type=IntRange(min=1),
              help="Sequences per micro-batch (default: the planner chooses among 1, 2, 4).")
@click.option("--elastic", is_flag=True,
              help="Keep every parameter on >= 2 pipelines (failure recovery); ZeRO-1 only with 2 copies of each "
                   "moment chunk, and only when that plan is faster (both are searched).")
@click.option("--node-loss-tolerance", type=FiniteFloatRange(min=0.0, max=10.0), default=NODE_PREFERENCE_TOLERANCE,
              show_default=True,
              help="With --elastic: a layout whose state survives more whole-node losses in memory is preferred when "
                   "its step time is within this fraction of the fastest's.")
@click.option("--zero/--no-zero", "use_zero", default=None,
              help="ZeRO-1 (optimizer states sharded over the pipelines; with --elastic, 2 copies of each chunk). "
                   "Default: on; with --elastic, whichever is faster.")
@click.option("--time-limit", "time_limit", type=FiniteFloatRange(min=1.0), default=120.0, show_default=True,
              help="Seconds the search may take (it stops early and keeps what it found).")
@click.option("--top-k", type=IntRange(min=1), default=5, show_default=True,
              help="Near-best candidates to list.")
@click.option("--schedule", type=click.Choice([AUTO, *SCHEDULE_NAMES]), default=AUTO, show_default=True,
              help="Pipeline schedule: 'auto' searches the schedule and its model chunks per pipeline "
                   "(docs/schedules.md); a name fixes it for every pipeline (interleaved: chunks searched).")
@click.option("--check-top", type=IntRange(min=0), default=8, show_default=True,
              help="Re-check this many of the best plans (and the best with identical pipelines, and the "
                   "baselines) with the step simulator and rank them by the worse of the two predictions "
                   "(0: rank by the closed-form estimate alone).")
@click.option("--sequence-parallel/--no-sequence-parallel", default=True, show_default=True,
              help="Plan TP stages with Megatron sequence parallelism (training.sequence_parallel): less "
                   "activation memory, the same TP traffic.")
@memory_margin_option()
@click.option("--workers", type=IntRange(min=1), default=1, show_default=True,
              help="Processes for the independent searches and the simulator's checks (the same plan, less wall "
                   "time on a multi-core host; worth it on large clusters).")
@click.option("--expert-load", "expert_load", type=click.Path(path_type=Path),
              help="MoE: plan for the router skew a run measured (the metrics of hspmd train --metrics, or a list of "
                   "one share per expert) instead of the model file's moe.expert_load.")
@click.option("-o", "--out", "out_path", type=click.Path(path_type=Path), help="Write the plan here (YAML).")
@click.option("--symmetric-out", "symmetric_path", type=click.Path(path_type=Path),
              help="Also write the best symmetric baseline as a plan here (to measure it with hspmd train).")
@click.option("--lengths", help="Documents of mixed length: a distribution name (longtail, uniform, fixed) or a "
                                "histogram YAML file; plans several strategies, each for a length range.")
@click.option("--tokens-per-step", type=IntRange(min=1, max=MAX_TOKENS_PER_STEP),
              help="With --lengths: the tokens of one step.")
@click.option("--max-strategies", type=IntRange(min=1, max=MAX_STRATEGIES), default=3, show_default=True,
              help="With --lengths: the most strategies in the plan.")
@click.option("--fixed-out", "fixed_path", type=click.Path(path_type=Path),
              help="With --lengths: also write the best single plan for the longest document (the comparison the "
                   "report prints) as a documents plan here (to measure it with hspmd train).")
@FORMAT_OPTION
def plan(model_ref: str, cluster_ref: str, profile_dirs: tuple[Path, ...], global_batch: int | None,
         seq_len: int | None, micro_batch: int | None, elastic: bool, node_loss_tolerance: float,
         use_zero: bool | None, time_limit: float,
         top_k: int, schedule: str, check_top: int, sequence_parallel: bool, memory_margin: MemoryMargin,
         workers: int, expert_load: Path | None, out_path: Path | None,
         symmetric_path: Path | None,
         lengths: str | None, tokens_per_step: int | None, max_strategies: int, fixed_path: Path | None,
         fmt: str) -> None:
    """Search TP groups, pipelines, layer splits (ILP), micro-batches (ILP) and recompute for the fastest
    plan that fits memory; compare it with the best symmetric plans and the lower bound. With --lengths:
    one plan of several strategies, each serving a range of document lengths (planner/lengths.py)."""
    for path, option in ((out_path, "-o"), (symmetric_path, "--symmetric-out"), (fixed_path, "--fixed-out")):
        if path is not None:
            check_output_file(path, option)   # before the search, which may take minutes
    if lengths is not None:
        unused = {"--global-batch": global_batch, "--micro-batch": micro_batch, "--elastic": elastic or None,
                  "--zero/--no-zero": use_zero, "--symmetric-out": symmetric_path, "--expert-load": expert_load}
        plan_for_lengths(model_ref, cluster_ref, profile_dirs, lengths, tokens_per_step, seq_len, unused,
                         max_strategies, time_limit, out_path, fmt, fixed_path, memory_margin)
        return
    refuse_given("only with --lengths", "tokens_per_step", "max_strategies", "fixed_path")
    if not elastic:
        refuse_given("only with --elastic", "node_loss_tolerance")
    if global_batch is None or seq_len is None:
        raise click.UsageError("--global-batch and --seq-len are required (or --lengths with --tokens-per-step)")
    model = load_model(model_ref, file="--model", field="")
    measured = None
    if expert_load is not None:
        model, measured = with_measured_load(model, expert_load)
    # What the plan assumes, said once it exists (a refused request prints its one error line only).
    notes = [n for n in (model.pricing_note(seq_len), measured) if n is not None]
    cluster = load_cluster(cluster_ref, file="--cluster", field="")
    profiles = resolve_profiles(cluster.device_types, list(profile_dirs))
    for line in check_profiles(profiles, model, cluster, profile_dirs, cluster_ref):
        click.echo(f"warning: {printable(line)}", err=True)
    settings = PlanSettings(global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch, elastic=elastic,
                            use_zero=use_zero, time_limit_s=time_limit, top_k=top_k, simulate_top=check_top,
                            schedule=schedule, sequence_parallel=sequence_parallel)  # type: ignore[arg-type]
    err = console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("planning", total=None)

        def report(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total)

        try:
            result = run_planner(model, memory_margin.apply(cluster), profiles, settings, progress=report,
                                 workers=workers)
        except InfeasibleError as err:
            raise margin_said(err, memory_margin) from None
    for note in notes:
        click.echo(f"note: {note}", err=True)
    node_choice = None
    if elastic:   # among near-equals, the layout whose replicas span nodes (planner/survival.py)
        result, node_choice = prefer_node_survivable(result, profiles, model_ref, cluster_ref, node_loss_tolerance)
    result = dataclasses.replace(result, cluster=cluster)   # the report weighs each stage against the real capacity
    def refs(path: Path | None) -> tuple[str, str]:   # relative to the file the plan is written to
        return recorded_ref(model_ref, "models", plan_file=path), recorded_ref(cluster_ref, "clusters", plan_file=path)

    def recorded(p: Plan | None, path: Path | None) -> Plan | None:   # with the profiles that priced it
        return None if p is None else with_profiles(p, profiles, model, cluster, path)

    planned = recorded(result.to_plan(*refs(out_path)), out_path)
    symmetric = recorded(result.baseline_plan(result.symmetric, *refs(symmetric_path)), symmetric_path)
    assert planned is not None
    priced = provenance(profiles, model, strategy_tps(planned, cluster))
    survives = plan_survival(planned, model, cluster)
    if symmetric_path is not None and symmetric is None:
        raise SpecError([Problem("--symmetric-out", "", f"no symmetric plan to write: {result.symmetric.description}")])
    for p, path in ((planned, out_path), (symmetric, symmetric_path)):
        problems = [] if p is None else validate_plan(p, model, cluster, str(path or "plan"))
        if problems:   # a planner bug, not a user error: refuse to write it
            raise RuntimeError("planner produced an invalid plan: " + "; ".join(str(x) for x in problems))
    # Both files or neither: a symmetric baseline that cannot be written leaves no plan beside it.
    atomic_write_files([(path, dump_plan(p).encode()) for p, path in ((planned, out_path), (symmetric, symmetric_path))
                        if path is not None and p is not None])
    written = None if out_path is None else str(out_path)
    if fmt == "json":
        out = result_json(result, planned, written, memory_margin)
        out["profiles"] = {n: t.to_json() for n, t in priced.items()}
        out["failures"] = survives.to_json()
        out["node_choice"] = node_choice
        out["symmetric_output"] = None if symmetric_path is None else str(symmetric_path)
        emit_json(out)
        return
    con = console()
    for t in priced.values():
        con.print(escape(t.line()))
    if node_choice is not None:
        con.print(escape(node_choice))
    print_report(con, result, written, memory_margin)
    for line in survives.lines():
        con.print(escape(line))
    if symmetric_path is not None:
        con.print(f"symmetric baseline written to [bold]{escape(str(symmetric_path))}[/bold]")
