"""``hspmd show PLAN``: the plan as tables (pipelines x stages, and per device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from hetu_cli.output import FORMAT_OPTION, console, emit_json
from runtime.spec import PlanContext, Strategy, load_plan_context
from runtime.spec.schema import to_data


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
            if si == 0:
                roles.append("embedding")
            roles.append(f"layers {stage.layers[0]}-{stage.layers[1] - 1}")
            if si == len(pipe.stages) - 1:
                roles.append("head+loss")
            row.update(pipeline=pi, stage=si, tp_rank=rank, tp=stage.tp, layers=list(stage.layers),
                       role=", ".join(roles), micro_batches=pipe.micro_batches,
                       recompute=stage.recompute)
        rows.append(row)
    return rows


def _strategy_tables(ctx: PlanContext, strategy: Strategy) -> tuple[Table, Table]:
    t = ctx.plan.training
    stages = Table(title=f"strategy {strategy.name!r}: pipelines x stages", title_justify="left")
    for col in ("pipeline", "micro-batches", "samples", "stage", "devices", "type", "node", "TP",
                "layers", "recompute"):
        stages.add_column(col, justify="right" if col in ("micro-batches", "samples", "TP") else "left")
    for pi, pipe in enumerate(strategy.pipelines):
        for si, stage in enumerate(pipe.stages):
            first = ctx.cluster.device(stage.devices[0])
            stages.add_row(
                str(pi) if si == 0 else "", str(pipe.micro_batches) if si == 0 else "",
                str(pipe.micro_batches * t.micro_batch) if si == 0 else "", str(si),
                _span(stage.devices), first.type, first.node, str(stage.tp),
                f"[{stage.layers[0]}, {stage.layers[1]})", "yes" if stage.recompute else "no",
                end_section=si == len(pipe.stages) - 1)
    devices = Table(title=f"strategy {strategy.name!r}: per device", title_justify="left")
    for col in ("device", "type", "node", "pipeline", "stage", "TP rank", "holds"):
        devices.add_column(col)
    for row in device_rows(ctx, strategy):
        if row["pipeline"] is None:
            devices.add_row(str(row["device"]), row["type"], row["node"], "-", "-", "-", "[dim]idle[/dim]")
        else:
            devices.add_row(str(row["device"]), row["type"], row["node"], str(row["pipeline"]),
                            str(row["stage"]), f"{row['tp_rank']}/{row['tp']}", row["role"])
    return stages, devices


def _span(devices: tuple[int, ...]) -> str:
    if len(devices) > 2 and list(devices) == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)


@click.command()
@click.argument("plan", type=click.Path(path_type=Path))
@click.option("--strategy", "strategy_name", help="Show only this strategy (default: all).")
@click.option("--cluster", help="Use this cluster (name or path) instead of the plan's.")
@FORMAT_OPTION
def show(plan: Path, strategy_name: str | None, cluster: str | None, fmt: str) -> None:
    """Show PLAN: its settings, every strategy's pipelines and stages, and each device's role."""
    ctx = load_plan_context(plan, cluster=cluster)
    strategies = [ctx.plan.strategy(strategy_name)] if strategy_name else list(ctx.plan.strategies)
    if fmt == "json":
        emit_json({
            "plan": to_data(ctx.plan),
            "model": to_data(ctx.model),
            "cluster": ctx.cluster.name,
            "devices": {s.name: device_rows(ctx, s) for s in strategies},
        })
        return
    out = console()
    t = ctx.plan.training
    out.print(f"[bold]{ctx.model.name}[/bold] on [bold]{ctx.cluster.name}[/bold] "
              f"({ctx.cluster.num_devices} devices): global batch {t.global_batch}, micro-batch "
              f"{t.micro_batch}, sequence {t.seq_len}, schedule {t.schedule}, "
              f"ZeRO-1 {'on' if t.zero else 'off'}")
    for s in strategies:
        stages, devices = _strategy_tables(ctx, s)
        out.print(stages)
        out.print(devices)
        if s.estimates:
            out.print("estimates: " + ", ".join(f"{k} = {v:.4g}" for k, v in s.estimates.items()))
