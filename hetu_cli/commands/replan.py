"""``hspmd replan --plan PLAN --failed 5,6``: the plan to switch to when devices fail, and what the switch
costs against checkpoint-restart."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click
from rich import filesize
from rich.markup import escape
from rich.table import Table

from hetu_cli.output import (
    FORMAT_OPTION,
    PROFILE_OPTION,
    FiniteFloatRange,
    IntRange,
    console,
    emit_json,
    int_list,
    memory_margin_option,
    plan_argument,
    table,
)
from planner.api import plan as plan_on
from planner.margin import MemoryMargin, plan_headroom
from planner.provenance import with_profiles
from planner.replan import DEFAULT_TOLERANCE, LostStateError, ReplanResult, RestartModel, settings_for
from planner.replan import replan as run_replan
from runtime.torchfree.errors import HspmdError, InfeasibleError
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import PlanContext, load_plan_context, save_plan
from runtime.torchfree.spec.catalog import recorded_ref
from runtime.torchfree.spec.cluster import MAX_DEVICES
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.io import check_output_file
from runtime.torchfree.spec.schema import to_data
from runtime.torchfree.spec.validate import validate_plan

TOP_LINKS = 12


def parse_devices(text: str, option: str) -> list[int]:
    """'5,6' -> [5, 6]; a range '16-23' stands for its devices (a node's, say); anything else is a one-line user
    error."""
    out: list[int] = []
    try:
        for part in (x.strip() for x in text.split(",")):
            lo, sep, hi = part.partition("-")
            if sep and lo.strip() and hi.strip():
                a, b = int_list(lo)[0], int_list(hi)[0]
                if b < a or b >= MAX_DEVICES:   # a hostile range must not enumerate billions of ids
                    raise ValueError(part)
                out += range(a, b + 1)
            elif part:
                out += int_list(part)
    except (ValueError, IndexError):
        out = []
    if not out or any(d < 0 for d in out):
        raise HspmdError(f"{option}: expected comma-separated device ids or ranges such as 5,6 or 16-23, got {text!r}")
    return sorted(set(out))


def plan_refs(ctx: PlanContext, out_path: Path | None = None) -> tuple[str, str]:
    """What a new plan file records for the model and cluster: catalog names as they are, paths relative to
    the new file ``out_path`` (absolute without one: the new plan may live elsewhere than the one it replaces)."""
    return (recorded_ref(ctx.plan.model, "models", ctx.path.parent, out_path),
            recorded_ref(ctx.plan.cluster, "clusters", ctx.path.parent, out_path))


@click.command()
@plan_argument("The plan that was running")
@click.option("--strategy", "strategy_name", help="Its strategy that was running (default: the first).")
@click.option("--failed", "failed_text", required=True, help="The failed device ids, e.g. 5,6 or 16-23.")
@click.option("-o", "--out", "out_path", type=click.Path(path_type=Path), help="Write the new plan here (YAML).")
@PROFILE_OPTION
@click.option("--tolerance", type=FiniteFloatRange(min=0.0), default=DEFAULT_TOLERANCE, show_default=True,
              help="Candidates within this fraction of the fastest step time count as equally fast; among "
                   "them the one that moves the least state wins.")
@click.option("--time-limit", "time_limit", type=FiniteFloatRange(min=1.0), default=60.0, show_default=True,
              help="Seconds the planner may search.")
@click.option("--storage-gbs", type=FiniteFloatRange(min=0.001), default=RestartModel.storage_gbs, show_default=True,
              help="Checkpoint-restart model: aggregate storage bandwidth (GB/s) for writing and reading.")
@click.option("--restart-s", type=FiniteFloatRange(min=0.0), default=RestartModel.restart_s, show_default=True,
              help="Checkpoint-restart model: seconds to start new processes and process groups.")
@click.option("--checkpoint-interval", type=IntRange(min=1), default=RestartModel.checkpoint_interval_steps,
              show_default=True, help="Checkpoint-restart model: steps between checkpoints (half is lost on average).")
@click.option("--restart", is_flag=True,
              help="When memory alone cannot continue (some state lost every copy), write a plan for the surviving "
                   "devices to restart from the last checkpoint (hspmd train NEW --load CKPT) instead of refusing.")
@memory_margin_option()
@FORMAT_OPTION
def replan(plan_path: Path, strategy_name: str | None, failed_text: str, out_path: Path | None,
           profile_dirs: tuple[Path, ...], tolerance: float, time_limit: float, storage_gbs: float, restart_s: float,
           checkpoint_interval: int, restart: bool, memory_margin: MemoryMargin, fmt: str) -> None:
    """A new plan for the survivors of FAILED devices of PLAN, chosen with the switch cost in view, with the
    switch report (bytes per link, modelled fused-BSR time) and the modelled cost of checkpoint-restart.

    Exit code 2, nothing written, when some parameter has no surviving replica or (ZeRO-1) some moment chunk
    no surviving copy: the coordinator's own check, naming what is lost and who held it."""
    if out_path is not None:
        check_output_file(out_path, "-o")
    failed = parse_devices(failed_text, "--failed")
    ctx = load_plan_context(plan_path)
    profiles = resolve_profiles(ctx.cluster.device_types, list(profile_dirs))
    model_ref, cluster_ref = plan_refs(ctx, out_path)
    planning = dataclasses.replace(ctx, cluster=memory_margin.apply(ctx.cluster))   # the capacity the margin leaves
    try:
        result = run_replan(StrategyHandle.of(planning, strategy_name), failed, profiles, tolerance=tolerance,
                            time_limit_s=time_limit,
                            restart=RestartModel(storage_gbs, restart_s, checkpoint_interval),
                            model_ref=model_ref, cluster_ref=cluster_ref)
    except LostStateError as err:
        if not restart:
            raise WithRestartHint(err, f"hspmd replan {plan_path} --failed {failed_text} --restart writes a plan "
                                       "for the surviving devices to restart from that checkpoint") from None
        restart_plan(ctx, err, failed, profiles, memory_margin, time_limit, (model_ref, cluster_ref), out_path, fmt)
        return
    new = with_profiles(result.plan, profiles, ctx.model, ctx.cluster, out_path)   # records what priced it
    if out_path is not None:
        save_plan(new, out_path)
    memory = plan_headroom(new, ctx.model, ctx.cluster, profiles, memory_margin)
    if fmt == "json":
        out = replan_json(result, None if out_path is None else str(out_path))
        out["plan"] = to_data(new)
        out["memory_margin"] = {**memory_margin.to_json(), "text": memory_margin.text}
        out["memory"] = memory
        emit_json(out)
        return
    print_replan(result, None if out_path is None else str(out_path))
    print_headroom(memory, memory_margin)


class WithRestartHint(HspmdError):
    """The lost-state refusal with the way on: ``--restart``."""

    def __init__(self, lost: LostStateError, hint: str) -> None:
        super().__init__(str(lost))
        self.lost, self.hint = lost, hint

    def lines(self) -> list[str]:
        return [*self.lost.lines(), self.hint]


def restart_plan(ctx: PlanContext, lost: LostStateError, failed: list[int], profiles: Any, margin: MemoryMargin,
                 time_limit: float, refs: tuple[str, str], out_path: Path | None, fmt: str) -> None:
    """``--restart``: the state did not survive in memory, so the job restarts from its last checkpoint; the
    plan for that is a fresh plan on every surviving device of the cluster (the planner's own search, with
    the same batch, sequence length, seed and optimizer)."""
    t = ctx.plan.training
    survivors = [d for d in range(ctx.cluster.num_devices) if d not in set(failed)]
    settings = settings_for(t, ctx.model, schedule="auto", time_limit_s=time_limit, top_k=1, simulate_top=1)
    try:
        result = plan_on(ctx.model, margin.apply(ctx.cluster), profiles, settings, devices=survivors)
    except InfeasibleError as err:
        raise InfeasibleError(f"device(s) {', '.join(map(str, failed))}: {lost.lost.what()}, and no plan for the "
                              f"{len(survivors)} surviving devices fits to restart from the checkpoint: "
                              f"{err}") from None
    new = with_profiles(result.to_plan(*refs), profiles, ctx.model, ctx.cluster, out_path)
    problems = validate_plan(new, ctx.model, ctx.cluster, str(out_path or "plan"))
    if problems:   # a planner bug, not a user error: refuse to write it
        raise RuntimeError("planner produced an invalid plan: " + "; ".join(str(x) for x in problems))
    if out_path is not None:
        save_plan(new, out_path)
    memory = plan_headroom(new, ctx.model, ctx.cluster, profiles, margin)
    best = result.best
    said = (f"device(s) {', '.join(map(str, failed))}: {lost.lost.what()}: memory alone cannot continue; a plan "
            f"for the {len(survivors)} surviving devices restarts from the last checkpoint")
    if fmt == "json":
        emit_json({"restart": True, "reason": said, "plan": to_data(new), "output": None if out_path is None
                   else str(out_path), "failed": failed, "survivors": survivors, "step_time_s": best.step_time_s,
                   "summary": best.summary, "memory_margin": {**margin.to_json(), "text": margin.text},
                   "memory": memory})
        return
    con = console()
    con.print(f"[bold]replan --restart[/bold]: {escape(said)}")
    con.print(f"restart plan: {escape(best.summary)}, {best.step_time_s:.4g} s/step (cost model)")
    print_headroom(memory, margin)
    if out_path is not None:
        con.print(f"written to [bold]{escape(str(out_path))}[/bold]: continue with hspmd train "
                  f"{escape(str(out_path))} --load CHECKPOINT")
    else:
        con.print("plan not saved (use -o plan.yaml)")


def print_headroom(rows: list[dict[str, Any]], margin: MemoryMargin) -> None:
    """The new plan's stages: peak memory against capacity and the margin kept."""
    t = table(f"new plan's memory (margin {margin.text})", ("pipe", "stage", "type", "devices", "peak GiB", "cap GiB",
                                                           "margin GiB", "headroom"), left=("type", "devices"))
    for r in rows:
        t.add_row(str(r["pipeline"]), str(r["stage"]), r["device_type"], ",".join(map(str, r["devices"])),
                  f"{r['peak_gib']:.1f}", f"{r['capacity_gib']:g}", f"{r['margin_gib']:g}", f"{r['headroom_frac']:.0%}")
    console().print(t)


def replan_json(r: ReplanResult, out_path: str | None) -> dict[str, Any]:
    c = r.chosen
    return {
        "plan": to_data(r.plan),
        "output": out_path,
        "step_time_s": c.step_time_s,
        "switch_bytes": c.switch_bytes,
        "switch_time_s": c.modelled_switch_s,
        "restart_time_s": r.restart.total_s,
        "switch_lower_bound_s": c.lower_bound_s,
        "failed": list(r.failed),
        "survivors": list(r.survivors),
        "current_step_time_s": r.current_step_time_s,
        "chosen": c.label,
        "summary": c.summary,
        "tolerance": r.tolerance,
        "link_bytes": [{"src": s, "dst": d, "bytes": n} for (s, d), n in c.bsr.link_bytes().items()],
        "restart": r.restart.to_json(),
        "candidates": [{"candidate": o.label, "step_time_s": o.step_time_s, "switch_bytes": o.switch_bytes,
                        "switch_time_s": o.modelled_switch_s, "summary": o.summary, "chosen": o is c}
                       for o in r.options],
        "notes": list(r.notes),
    }


def print_replan(r: ReplanResult, out_path: str | None) -> None:
    con = console()
    c = r.chosen
    con.print(f"[bold]replan[/bold]: device(s) {', '.join(map(str, r.failed))} failed; "
              f"{len(r.survivors)} survivors; current plan {r.current_step_time_s:.4g} s/step (cost model)")
    for note in r.notes:
        con.print(f"note: {escape(note)}")
    cands = Table(title=f"candidates (within {r.tolerance:.0%} of the fastest, the one moving the least state wins)")
    for col in ("", "candidate", "s/step", "moves", "switch (modelled)", "plan"):
        cands.add_column(col, justify="right" if col in ("s/step", "moves", "switch (modelled)") else "left")
    for o in r.options:
        cands.add_row("*" if o is c else "", o.label, f"{o.step_time_s:.4g}", filesize.decimal(o.switch_bytes),
                      f"{o.modelled_switch_s:.4g} s", escape(o.summary))
    con.print(cands)
    links = sorted(c.bsr.link_bytes().items(), key=lambda kv: -kv[1])
    con.print(f"switch: {filesize.decimal(c.switch_bytes)} (every parameter and both AdamW moments, fp32) over "
              f"{len(links)} link(s); fused BSR modelled {c.modelled_switch_s:.4g} s (lower bound "
              f"{c.lower_bound_s:.4g} s)")
    lt = table("", ("from", "to", "bytes", "GB/s", "seconds"))
    cluster = r.context.cluster
    for (s, d), n in links[:TOP_LINKS]:
        bw = cluster.bandwidth_gbs(s, d)
        lt.add_row(str(s), str(d), filesize.decimal(n), f"{bw:g}", f"{n / (bw * 1e9):.4g}")
    if len(links) > TOP_LINKS:
        lt.add_row("...", "", f"{len(links) - TOP_LINKS} more links", "", "")
    con.print(lt)
    rc = r.restart
    con.print(f"checkpoint-restart (modelled): {rc.total_s:.4g} s = write {rc.write_s:.4g} s + read {rc.read_s:.4g} s "
              f"+ restart {rc.restart_s:.4g} s + lost work {rc.lost_work_s:.4g} s; the in-memory switch is "
              f"{c.modelled_switch_s:.4g} s ({c.modelled_switch_s / rc.total_s:.2g}x) before specialization")
    for line in rc.assumptions():
        con.print(f"  assumes: {escape(line)}")
    con.print(f"new plan: {escape(c.summary)}, {c.step_time_s:.4g} s/step (cost model)")
    if out_path is not None:
        con.print(f"written to [bold]{escape(out_path)}[/bold]")
