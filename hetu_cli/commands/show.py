"""``hspmd show PLAN``: the plan as tables (pipelines x stages, and per device)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table

from hetu_cli.output import FORMAT_OPTION, Int, console, emit_json, refuse_given, table
from planner.lengths import length_ranges
from planner.report import tp_text, zero_text
from runtime.torchfree.annotations.states import span
from runtime.torchfree.spec import PlanContext, Strategy, load_plan_context
from runtime.torchfree.spec.schema import to_data

if TYPE_CHECKING:
    from runtime.torchfree.engine.describe import OpLine

# A block of ops repeated this often (the steady state of a schedule over many micro-batches) is printed
# first and last with one line for the repetitions between; blocks up to MAX_PERIOD ops are looked for.
MIN_REPEATS = 4
MAX_PERIOD = 64


def device_rows(ctx: PlanContext, strategy: Strategy) -> list[dict[str, Any]]:
    """One row per cluster device: where the strategy puts it, or idle."""
    rows = []
    for dev in ctx.cluster.devices:
        where = strategy.locate(dev.id)
        row: dict[str, Any] = {"device": dev.id, "type": dev.type, "node": dev.node}
        if where is None:
            row.update(pipeline=None, stage=None, tp_rank=None, tp=None, layers=None, role="idle")
        else:
            pi, si, rank = where
            pipe = strategy.pipelines[pi]
            stage = pipe.stages[si]
            roles = []
            if si == pipe.embed_stage:
                roles.append("embedding")
            roles.append("layers " + ", ".join(f"{a}-{b - 1}" for a, b in stage.layers))
            if si == pipe.head_stage:
                roles.append("head+loss")
            row.update(pipeline=pi, stage=si, tp_rank=rank, tp=stage.tp, layers=stage.layers_data(),
                       role=", ".join(roles), micro_batches=pipe.micro_batches,
                       recompute=stage.recompute, recompute_layers=stage.recomputed_layers,
                       sequence_parallel=ctx.plan.training.sequence_parallel and stage.tp > 1)
        rows.append(row)
    return rows


def _strategy_tables(ctx: PlanContext, strategy: Strategy) -> tuple[Table, Table]:
    t = ctx.plan.training
    cols = ("pipeline", "micro-batches", "samples", "schedule", "stage", "devices", "type", "node", "TP", "layers",
            "recompute")
    stages = table(f"strategy {strategy.name!r}: pipelines x stages", cols,
                   left=set(cols) - {"micro-batches", "samples", "TP"})
    for pi, pipe in enumerate(strategy.pipelines):
        for si, stage in enumerate(pipe.stages):
            first = ctx.cluster.device(stage.devices[0])
            stages.add_row(
                str(pi) if si == 0 else "", str(pipe.micro_batches) if si == 0 else "",
                str(pipe.micro_batches * t.micro_batch) if si == 0 else "",
                strategy.schedule_of(pi, t) if si == 0 else "", str(si),
                span(stage.devices), first.type, first.node, tp_text(stage.tp, t.sequence_parallel),
                stage.layers_text(), stage.recompute_text() or "no",
                end_section=si == len(pipe.stages) - 1)
    cols = ("device", "type", "node", "pipeline", "stage", "TP rank", "holds")
    devices = table(f"strategy {strategy.name!r}: per device", cols, left=cols)
    for row in device_rows(ctx, strategy):
        if row["pipeline"] is None:
            devices.add_row(str(row["device"]), row["type"], row["node"], "-", "-", "-", "[dim]idle[/dim]")
        else:
            devices.add_row(str(row["device"]), row["type"], row["node"], str(row["pipeline"]),
                            str(row["stage"]), f"{row['tp_rank']}/{row['tp']}", row["role"])
    return stages, devices


@click.command()
@click.argument("plan", type=click.Path(path_type=Path))
@click.option("--strategy", "strategy_name", help="Show only this strategy (default: all).")
@click.option("--cluster", help="Use this cluster (name or path) instead of the plan's.")
@click.option("--annotations", is_flag=True,
              help="Show the HSPMD annotation of every parameter, the batch and stage-boundary activations.")
@click.option("--device", "device", type=Int(), default=None,
              help="Show the specialized program of this device: layers, shard shapes, ops in execution order.")
@click.option("--all-ops", "all_ops", is_flag=True,
              help=f"With --device: list every op (default: a block of ops repeated {MIN_REPEATS} or more times, "
                   "as a schedule's steady state is, is listed first and last with one line for the repetitions "
                   "between; --format json always lists every op).")
@click.option("--torchrun", "endpoint", metavar="HOST:PORT",
              help="Print the torchrun line to start on each node for the strategy (a documents plan: all of its "
                   "strategies' devices), with its c10d rendezvous at HOST:PORT (docs/gpu.md).")
@FORMAT_OPTION
def show(plan: Path, strategy_name: str | None, cluster: str | None, annotations: bool, device: int | None,
         all_ops: bool, endpoint: str | None, fmt: str) -> None:
    """Show PLAN: its settings, every strategy's pipelines and stages, and each device's role."""
    if endpoint is not None:
        _show_torchrun(load_plan_context(plan, cluster=cluster), plan, strategy_name, endpoint, fmt)
        return
    if device is None:
        refuse_given("only with --device N", "all_ops")
    else:
        refuse_given("not with --device (one view at a time)", "annotations")
    ctx = load_plan_context(plan, cluster=cluster)
    strategies = [ctx.strategy(strategy_name)] if strategy_name is not None else list(ctx.plan.strategies)
    if device is not None:
        _show_device(ctx, strategies, device, fmt, all_ops)
        return
    if annotations:
        _show_annotations(ctx, strategies, fmt)
        return
    if fmt == "json":
        emit_json({
            "plan": to_data(ctx.plan),
            "model": to_data(ctx.model),
            "cluster": ctx.cluster.name,
            "devices": {s.name: device_rows(ctx, s) for s in strategies},
            "length_ranges": {s.name: list(length_ranges(ctx.plan)[s.name]) for s in strategies},
        })
        return
    out = console()
    t = ctx.plan.training
    out.print(f"[bold]{ctx.model.name}[/bold] on [bold]{ctx.cluster.name}[/bold] "
              f"({ctx.cluster.num_devices} devices): global batch {t.global_batch}, micro-batch "
              f"{t.micro_batch}, sequence {t.seq_len}, schedule {t.schedule}, "
              f"ZeRO-1 {zero_text(t.zero_redundancy if t.zero else 0)}"
              f"{', sequence parallel on TP stages (TP: sp)' if t.sequence_parallel else ''}, "
              f"{escape(t.optimizer.schedule_text())}")
    for s in strategies:
        stages, devices = _strategy_tables(ctx, s)
        out.print(stages)
        lo, hi = length_ranges(ctx.plan)[s.name]
        out.print(f"strategy {s.name!r} serves documents of {lo} to {hi} tokens")
        out.print(devices)
        if s.estimates:
            out.print("estimates: " + ", ".join(f"{k} = {v:.4g}" for k, v in s.estimates.items()))


def _show_torchrun(ctx: PlanContext, plan: Path, strategy_name: str | None, endpoint: str, fmt: str) -> None:
    from runtime.launch.placement import torchrun_commands

    if ctx.plan.training.tokens_per_step is not None and strategy_name is None:   # a documents run: every strategy
        devices = sorted({d for s in ctx.plan.strategies for d in s.devices})
    else:
        devices = sorted(set(ctx.strategy(strategy_name).devices))
    lines = torchrun_commands(ctx.cluster, devices, str(plan), endpoint)
    if fmt == "json":
        emit_json({"torchrun": [{"node": n, "command": c} for n, c in lines]})
        return
    out = console()
    for node, command in lines:
        out.print(f"# on {node}", markup=False)
        out.print(command, markup=False, soft_wrap=True)


def _show_annotations(ctx: PlanContext, strategies: list[Strategy], fmt: str) -> None:
    from runtime.torchfree.annotations.from_plan import annotation_rows, strategy_groups

    t = ctx.plan.training
    data = {s.name: {"rows": annotation_rows(s, ctx.model, t),
                     "groups": [list(g) for g in strategy_groups(s, ctx.model, t)]} for s in strategies}
    if fmt == "json":
        emit_json({"model": ctx.model.name, "cluster": ctx.cluster.name, "annotations": data})
        return
    out = console()
    for name, d in data.items():
        cols = ("where", "tensor", "shape", "annotation", "grad / comm")
        out_t = table(f"strategy {name!r}: HSPMD annotations", cols, left=cols)
        out_t.caption, out_t.caption_justify = ("top tier: dup = HDim -1, partial = HDim -2, splitN(w:w) = HDim N "
                                                "with weights; per device group: S<d>×n split dim d, D×n duplicate, "
                                                "P×n partial"), "left"
        prev = None
        for r in d["rows"]:
            comm = f"HDim {r['grad_hdim']}: {r['sync']}" if r["kind"] == "parameter" else (r["sync"] or "-")
            out_t.add_row(r["where"] if r["where"] != prev else "", r["tensor"], "x".join(map(str, r["shape"])),
                          escape(r["text"]), comm, end_section=False)
            prev = r["where"]
        out.print(out_t)
        out.print(f"{len(d['groups'])} device groups: " + " ".join(f"({span(g)})" for g in d["groups"]))


def _show_device(ctx: PlanContext, strategies: list[Strategy], device: int, fmt: str, all_ops: bool) -> None:
    from runtime.torchfree.engine.describe import describe_program
    from runtime.torchfree.errors import Problem, SpecError
    from runtime.torchfree.spec.handle import StrategyHandle

    if not 0 <= device < ctx.cluster.num_devices:
        raise SpecError([Problem("--device", "", f"unknown device id {device} (cluster {ctx.cluster.name!r} has "
                                                 f"devices 0-{ctx.cluster.num_devices - 1})")])
    descs = [describe_program(StrategyHandle(ctx, s), device) for s in strategies]
    if fmt == "json":
        emit_json({"model": ctx.model.name, "cluster": ctx.cluster.name, "device": device,
                   "programs": [d.to_data() for d in descs]})
        return
    out = console()
    for d in descs:
        r = d.role
        if r is None:
            out.print(f"strategy {d.strategy!r}: device {device} is idle")
            continue
        out.print(f"[bold]strategy {d.strategy!r}, device {device}[/bold]: pipeline {r.pipeline} stage "
                  f"{r.stage} (of {r.num_stages}), TP rank {r.tp_rank} of [{span(r.devices)}]; holds {d.holds}; "
                  f"{r.micro_batches} micro-batches of {r.micro_batch} (samples {r.first_sample}-"
                  f"{r.first_sample + r.samples - 1}); schedule {d.schedule}, {d.order} (the faster of the "
                  f"list scheduler's and the published order on {d.order_by})")
        cols = ("name", "full shape", "local shard", "TP split dim", "counted once here")
        params = table("parameters (local shards)", cols, left=cols)
        for p in d.params:
            params.add_row(p.name, "x".join(map(str, p.info.shape)), "x".join(map(str, p.local_shape)),
                           "-" if p.tp_size == 1 or p.info.tp_dim is None else str(p.info.tp_dim),
                           "yes" if p.primary else "no")
        out.print(params)
        cols = ("#", "kind", "op", "detail")
        ops = table("one training step, in execution order", cols, left=cols)
        runs = {} if all_ops else {r[0]: r for r in steady_runs(d.ops)}
        i = 0
        while i < len(d.ops):
            first, period, repeats, step = runs.get(i, (i, 1, 1, 0))
            last = first + (repeats - 1) * period   # the run's last repetition
            for k in range(first, first + period):
                ops.add_row(str(k), d.ops[k].kind, escape(d.ops[k].name), escape(d.ops[k].detail))
            if repeats > 1:
                hidden = [mb for o in d.ops[first + period:last] if (mb := _micro_batch(o)) is not None]
                ops.add_row(f"{first + period}-{last - 1}", "", f"... the {period} ops above x {repeats - 2}",
                            f"[dim]each time every micro-batch {step} later (micro-batches {min(hidden)}-"
                            f"{max(hidden)}); --all-ops lists them[/dim]")
                for k in range(last, last + period):
                    ops.add_row(str(k), d.ops[k].kind, escape(d.ops[k].name), escape(d.ops[k].detail))
            i = first + repeats * period
        out.print(ops)


def _micro_batch(line: OpLine) -> int | None:
    a = line.action
    if a is None:
        return None
    if hasattr(a, "micro_batch"):
        return a.micro_batch
    message = getattr(a, "message", None)
    return None if message is None else message.micro_batch


def _shape(line: OpLine) -> Hashable:
    """What a line does but for its micro-batch (equal across a steady state's repetitions)."""
    from runtime.torchfree.pipeline_schedules import Compute, PostRecv, PostSend, WaitRecv

    a = line.action
    if isinstance(a, Compute):
        a = dataclasses.replace(a, micro_batch=0)
    elif isinstance(a, (PostSend, PostRecv, WaitRecv)):
        a = type(a)(dataclasses.replace(a.message, micro_batch=0))
    else:
        return (line.kind, line.name, line.detail)
    return (line.kind, line.detail, a)


def steady_runs(ops: Sequence[OpLine], min_repeats: int = MIN_REPEATS, max_period: int = MAX_PERIOD
                ) -> list[tuple[int, int, int, int]]:
    """``(first, period, repeats, step)`` of each run of lines ``[first, first + period)`` repeated ``repeats >=
    min_repeats`` times, each repetition the same ops on micro-batches ``step`` later (every line moving by
    the same step). Left to right, without overlaps; at each line the period covering the most lines
    (the shortest among equals). Linear in the lines for a fixed ``max_period``."""
    ids: dict[Hashable, int] = {}
    shape = [ids.setdefault(_shape(o), len(ids)) for o in ops]
    mbs = [_micro_batch(o) for o in ops]
    n = len(ops)

    def repeats(i: int, period: int) -> tuple[int, int]:
        a0, b0 = mbs[i], mbs[i + period]
        if a0 is None or b0 is None or b0 <= a0:
            return 1, 0
        step, r = b0 - a0, 1
        while i + (r + 1) * period <= n:
            base = i + (r - 1) * period
            for x in range(base, base + period):
                y = x + period
                if shape[x] != shape[y] or mbs[x] is None or mbs[y] is None or mbs[y] - mbs[x] != step:
                    return r, step
            r += 1
        return r, step

    out = []
    i = 0
    while i < n:
        best = (0, 0, 0, 0)   # (lines covered, period, repeats, step)
        for period in range(1, min(max_period, (n - i) // min_repeats) + 1):
            if shape[i] != shape[i + period]:
                continue
            r, step = repeats(i, period)
            if r >= min_repeats and r * period > best[0]:
                best = (r * period, period, r, step)
        if best[0]:
            out.append((i, best[1], best[2], best[3]))
            i += best[0]
        else:
            i += 1
    return out
