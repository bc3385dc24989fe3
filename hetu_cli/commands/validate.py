"""``hspmd validate PLAN``: list every problem of a plan against its model and cluster."""

from __future__ import annotations

from pathlib import Path

import click

from hetu_cli.output import FORMAT_OPTION, emit_json, fail
from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_plan_context


@click.command()
@click.argument("plan", type=click.Path(path_type=Path))
@click.option("--cluster", help="Validate against this cluster (name or path) instead of the plan's.")
@FORMAT_OPTION
def validate(plan: Path, cluster: str | None, fmt: str) -> None:
    """Check PLAN: format, layer coverage, devices, TP divisibility, batch arithmetic."""
    try:
        ctx = load_plan_context(plan, cluster=cluster)
    except SpecError as err:
        if fmt == "json":
            emit_json({"valid": False, "problems": err.lines()})
            raise SystemExit(2) from None
        fail(err)
    summary = {
        "valid": True,
        "plan": str(plan),
        "model": ctx.model.name,
        "cluster": ctx.cluster.name,
        "strategies": [s.name for s in ctx.plan.strategies],
        "devices_used": {s.name: len(s.devices) for s in ctx.plan.strategies},
    }
    if fmt == "json":
        emit_json(summary)
        return
    used = ", ".join(f"{name}: {n}/{ctx.cluster.num_devices} devices"
                     for name, n in summary["devices_used"].items())
    click.echo(f"{click.style('valid', fg='green')} {plan} ({ctx.model.name} on {ctx.cluster.name}; {used})")
