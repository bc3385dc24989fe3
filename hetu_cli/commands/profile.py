"""``hspmd profile --cluster C``: measure this machine's device types and write their profiles."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetu_cli.output import FORMAT_OPTION, console, emit_json, err_console
from runtime.profiling.profile import COMPONENTS, PROFILES_DIR, Fit, eval_fit
from runtime.spec import load_cluster, load_model


@click.command()
@click.option("--cluster", "cluster_ref", required=True, help="Cluster (name or path) whose device types to profile.")
@click.option("--model", "model_refs", multiple=True, default=("llama-tiny",), show_default=True,
              help="Model(s) whose components to time (repeatable).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=PROFILES_DIR, show_default="profiles/",
              help="Directory for the <type>.measured.yaml files.")
@click.option("--device-type", help="Which cluster device type this machine's GPU is (GPU clusters).")
@click.option("--seq-lens", default="16,32,64,128,256", show_default=True,
              help="Sequence lengths to time (comma-separated; capped at each model's max_seq_len).")
@click.option("--budget", type=click.FloatRange(0.0), default=0.1, show_default=True,
              help="Seconds of repeats per timed point (at least 5 repeats each).")
@click.option("--link-processes", type=click.IntRange(2), default=4, show_default=True,
              help="Most local processes for the link measurement.")
@click.option("--no-comm", is_flag=True, help="Skip the link measurement (keeps the spec link figures).")
@FORMAT_OPTION
def profile(cluster_ref: str, model_refs: tuple[str, ...], out_dir: Path, device_type: str | None, seq_lens: str,
            budget: float, link_processes: int, no_comm: bool, fmt: str) -> None:
    """Time forward and backward of each Llama component (embedding, attention, MLP, norm, head+loss)
    and the optimizer step per TP degree and sequence length, fit a*s^2+b*s+c, measure link latency
    and bandwidth, and write one profile per device type. A measured profile overrides a spec one."""
    from runtime.profiling.profiler import ProfileSettings, count_steps, plan_targets, profile_cluster

    cluster = load_cluster(cluster_ref, file="--cluster", field="")
    models = [load_model(m, file="--model", field="") for m in model_refs]
    try:
        lens = tuple(sorted({int(x) for x in seq_lens.split(",") if x.strip()}))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {seq_lens!r}",
                                 param_hint="--seq-lens") from None
    if len(lens) < 3 or lens[0] < 1:
        raise click.BadParameter("give at least 3 positive lengths (three coefficients are fitted)",
                                 param_hint="--seq-lens")
    settings = ProfileSettings(seq_lens=lens, measure_comm=not no_comm, component_budget_s=budget,
                               comm_processes=link_processes)
    targets = plan_targets(cluster, models, device_type)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console(), transient=fmt == "json") as bar:
        task = bar.add_task("profiling", total=count_steps(targets, models, settings))

        def progress(what: str, done: int) -> None:
            if what:
                bar.update(task, description=what)
            if done:
                bar.advance(task, done)

        written = profile_cluster(cluster, models, out_dir, device_type=device_type, settings=settings,
                                  progress=progress)
    elapsed = time.perf_counter() - t0
    summary = {
        "cluster": cluster.name, "out": str(out_dir), "seconds": round(elapsed, 2),
        "profiles": {p.device_type: {
            "path": str(path), "slowdown": p.source.slowdown, "peak_tflops": p.compute.peak_tflops,
            "p2p": None if p.comm.p2p is None else {"latency_s": p.comm.p2p.latency_s,
                                                    "bandwidth_gbs": p.comm.p2p.bandwidth_gbs},
            "max_fit_residual": max((c.residual for m in p.models.values() for t in m.tp.values()
                                     for c in t.values()), default=0.0),
            "tp_degrees": sorted({t for m in p.models.values() for t in m.tp})} for path, p in written},
    }
    if fmt == "json":
        emit_json(summary)
        return
    con = console()
    for path, p in written:
        table = Table(title=f"{p.device_type} -> {path} (per micro-batch of 1 x s tokens; fits a*s^2+b*s+c)",
                      title_justify="left")
        for col in ("model", "TP", "component", "fwd @s=min", "fwd @s=max", "bwd @s=max", "params", "resid"):
            table.add_column(col, justify="left" if col in ("model", "component") else "right")
        for name, m in p.models.items():
            lo, hi = m.seq_lens[0], m.seq_lens[-1]
            for tp, comps in m.tp.items():
                for comp in COMPONENTS:
                    c = comps[comp]
                    table.add_row(name, str(tp), comp, _ms(c.forward_s, lo), _ms(c.forward_s, hi),
                                  _ms(c.backward_s, hi), f"{c.params:,}", f"{c.residual:.2f}")
        con.print(table)
        if p.comm.p2p is not None:
            con.print(f"  p2p: {p.comm.p2p.latency_s * 1e3:.3f} ms + bytes / {p.comm.p2p.bandwidth_gbs:.2f} GB/s; "
                      + ", ".join(f"all-reduce x{n}: {f.latency_s * 1e3:.3f} ms + bytes / {f.bandwidth_gbs:.2f} GB/s"
                                  for n, f in p.comm.allreduce.items()))
    con.print(f"profiled {len(written)} device type(s) in {elapsed:.1f} s")


def _ms(fit: Fit, s: int) -> str:
    return f"{eval_fit(fit, 1, s) * 1e3:.3f} ms"
