"""``hspmd profile --cluster C``: measure this machine's device types and write their profiles;
``hspmd profile import FILE --type NAME``: a profile from a flat table measured elsewhere;
``hspmd profile export FILE``: a profile's flat table; ``hspmd profile show FILE``: print any profile."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetu_cli.output import FORMAT_OPTION, FiniteFloatRange, IntRange, console, emit_json, int_list, refuse_given, table
from planner.provenance import unmeasured, unmeasured_text
from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.profiling.profile import (
    COMPONENTS,
    PROFILES_DIR,
    DeviceProfile,
    Fit,
    LinkFit,
    eval_fit,
    load_profile,
)
from runtime.torchfree.spec import load_cluster, load_model
from runtime.torchfree.spec.catalog import resolve_profile_ref
from runtime.torchfree.spec.cluster import type_name_problem
from runtime.torchfree.spec.io import check_output_file
from runtime.torchfree.spec.schema import to_data

MAX_BUDGET_S = 10.0  # per timed point; a profile times hundreds (every component, length and type)


@click.group(invoke_without_command=True)
@click.option("--cluster", "cluster_ref", help="Cluster (name or path) whose device types to profile.")
@click.option("--model", "model_refs", multiple=True, default=("llama-tiny",), show_default=True,
              help="Model(s) whose components to time (repeatable).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=PROFILES_DIR, show_default="profiles/",
              help="Directory for the <type>.measured.yaml files.")
@click.option("--device-type", help="Which cluster device type this machine's GPU is (GPU clusters).")
@click.option("--seq-lens", default="16,32,64,128,256", show_default=True,
              help="Sequence lengths to time (comma-separated; capped at each model's max_seq_len).")
@click.option("--budget", type=FiniteFloatRange(0.0, MAX_BUDGET_S), default=0.1, show_default=True,
              help=f"Seconds of repeats per timed point (at least 5 repeats each; at most {MAX_BUDGET_S:g}: a profile "
                   "times hundreds of points, and --budget 1e29 timed the first for ever).")
@click.option("--link-processes", type=IntRange(2), default=4, show_default=True,
              help="Most local processes for the link measurement.")
@click.option("--no-comm", is_flag=True, help="Skip the link measurement (keeps the spec link figures).")
@FORMAT_OPTION
@click.pass_context
def profile(ctx: click.Context, cluster_ref: str | None, model_refs: tuple[str, ...], out_dir: Path,
            device_type: str | None, seq_lens: str, budget: float, link_processes: int, no_comm: bool,
            fmt: str) -> None:
    """Time forward and backward of each Llama component (embedding, attention, MLP, norm, head+loss)
    and the optimizer step per TP degree and sequence length, fit a*s^2+b*s+c, measure link latency
    and bandwidth, and write one profile per device type. A measured profile overrides a spec one.
    Subcommands: import a table measured elsewhere, export one, show a profile."""
    if ctx.invoked_subcommand is not None:
        refuse_given(f"only when measuring, not before 'profile {ctx.invoked_subcommand}' (its own options follow it)",
                     *(p.name for p in ctx.command.params if p.name is not None))
        return
    if cluster_ref is None:
        raise click.UsageError("give --cluster C to measure, or a subcommand (import, export, show)")
    from hetu_cli.emulation import profiler_cpus
    from runtime.profiling.profiler import ProfileSettings, count_steps, plan_targets, profile_cluster

    cluster = load_cluster(cluster_ref, file="--cluster", field="")
    if cluster.emulated:   # every type is derived from this CPU's measurement: a --device-type was ignored
        refuse_given(f"only for GPU clusters (cluster {cluster.name!r} is CPU-emulated: all its types are "
                     "measured on this CPU)", "device_type")
    models = [load_model(m, file="--model", field="") for m in model_refs]
    for ref, m in zip(model_refs, models):
        if m.gpt:   # the profiler times the runtime's own (Llama) modules
            raise SpecError([Problem("--model", "", f"{ref}: {m.architecture} is not measured here (hspmd profile "
                                                    "times the runtime's Llama modules); bring its timings with "
                                                    "hspmd profile import")])
        if m.moe is not None:   # its dense modules are not what its MoE layers cost
            raise SpecError([Problem("--model", "", f"{ref}: mixture-of-experts layers are not measured "
                                                    "(hspmd profile times dense Llama components; hspmd plan prices "
                                                    "MoE layers from the dense model of the same shapes)")])
    try:
        lens = tuple(sorted(set(int_list(seq_lens))))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {seq_lens!r}",
                                 param_hint="--seq-lens") from None
    if len(lens) < 3 or lens[0] < 1:
        raise click.BadParameter("give at least 3 positive lengths (three coefficients are fitted)",
                                 param_hint="--seq-lens")
    settings = ProfileSettings(seq_lens=lens, measure_comm=not no_comm, component_budget_s=budget,
                               comm_processes=link_processes)
    cpus = profiler_cpus(cluster)
    targets = plan_targets(cluster, models, device_type, cpus=cpus)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(stderr=True), transient=fmt == "json") as bar:
        task = bar.add_task("profiling", total=count_steps(targets, models, settings))

        def report(what: str, done: int) -> None:
            if what:
                bar.update(task, description=what)
            if done:
                bar.advance(task, done)

        written = profile_cluster(cluster, models, out_dir, device_type=device_type, settings=settings,
                                  progress=report, cpus=cpus)
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
        fits = table(f"{p.device_type} -> {path} (per micro-batch of 1 x s tokens; fits a*s^2+b*s+c)",
                     ("model", "TP", "component", "fwd @s=min", "fwd @s=max", "bwd @s=max", "params", "resid"),
                     left=("model", "component"))
        for name, m in p.models.items():
            lo, hi = m.seq_lens[0], m.seq_lens[-1]
            for tp, comps in m.tp.items():
                for comp in COMPONENTS:
                    c = comps[comp]
                    fits.add_row(name, str(tp), comp, _ms(c.forward_s, lo), _ms(c.forward_s, hi),
                                 _ms(c.backward_s, hi), f"{c.params:,}", f"{c.residual:.2f}")
        con.print(fits)
        if p.comm.p2p is not None:
            con.print(f"  p2p: {_link(p.comm.p2p)}; "
                      + ", ".join(f"all-reduce x{n}: {_link(f)}" for n, f in p.comm.allreduce.items()))
    con.print(f"profiled {len(written)} device type(s) in {elapsed:.1f} s")


def _ms(fit: Fit, s: int, b: int = 1) -> str:
    return f"{eval_fit(fit, b, s) * 1e3:.3f} ms"


def _link(f: LinkFit) -> str:
    return f"{f.latency_s * 1e3:.3f} ms + bytes / {f.bandwidth_gbs:.2f} GB/s"


def _profile_file(ref: str, option: str) -> tuple[Path, DeviceProfile]:
    """A profile given by path or by a shipped profile's name, loaded."""
    path = resolve_profile_ref(ref)
    if path is None and os.path.lexists(ref):  # a directory, a looping link: the reader says which, not "no profile"
        path = Path(ref)
    if path is None:
        import difflib

        shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        near = difflib.get_close_matches(ref, shipped, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise SpecError([Problem(option, "", f"no profile {ref!r} (a path, or a name in profiles/: "
                                             f"{', '.join(shipped)}){hint}")])
    return path, load_profile(path)


@profile.command("import")
@click.argument("table", type=click.Path(path_type=Path))
@click.option("--type", "device_type", required=True, help="Device type name the profile is for (as clusters name it).")
@click.option("--model", "model_ref", required=True, help="Model (name or path) whose layer shapes the table measured.")
@click.option("--format", "table_fmt", type=click.Choice(["csv", "json"]), help="Table format (default: by suffix).")
@click.option("--base", "base_ref", help="Profile whose other figures (memory, throughput, link latency) the "
                                          "imported one keeps [default: the shipped profile of --type].")
@click.option("--includes-tp-comm", is_flag=True, help="The TP rows' times include their collectives.")
@click.option("--serialised-send-recv", is_flag=True, help="A send and a receive posted together serialise.")
@click.option("--out", "out_path", type=click.Path(path_type=Path),
              help="Where to write it [default: profiles/<type>.imported.yaml].")
def import_(table: Path, device_type: str, model_ref: str, table_fmt: str | None, base_ref: str | None,
            includes_tp_comm: bool, serialised_send_recv: bool, out_path: Path | None) -> None:
    """Convert a flat table measured elsewhere (docs/profiles.md) into a profile of provenance imported."""
    from runtime.torchfree.profiling.flat_table import import_profile
    from runtime.torchfree.profiling.profile import save_profile

    bad = type_name_problem(device_type)
    if bad is not None:
        raise SpecError([Problem("--type", "", bad)])
    out = out_path or PROFILES_DIR / f"{device_type}.imported.yaml"
    check_output_file(out, "--out")
    model = load_model(model_ref, file="--model", field="")
    if base_ref is None and resolve_profile_ref(device_type) is None:
        raise SpecError([Problem("--base", "", f"no shipped profile of {device_type!r} to start from: give --base")])
    base_path, base = _profile_file(base_ref or device_type, "--base")
    prof = import_profile(table, device_type=device_type, model=model, base=base, fmt=table_fmt,
                          includes_tp_comm=includes_tp_comm, serialised_send_recv=serialised_send_recv,
                          base_name=str(base_path))
    save_profile(prof, out)
    click.echo(f"wrote {out} ({device_type}, imported from {table})")
    measured = prof.measured_model(model)
    if measured is not None:
        for line in unmeasured_text(measured):   # what the table left out is priced otherwise: said, not silent
            click.echo(f"note: {model.name} {line} (base {base_path})")
        if imported_whole_layers(table, table_fmt):
            click.echo("note: whole-layer rows split into attention, mlp and norm by their derived shares at each "
                       "point (docs/profiles.md, 'Whole-layer rows')")


def imported_whole_layers(table: Path, fmt: str | None) -> bool:
    from runtime.torchfree.profiling.flat_table import read_rows
    from runtime.torchfree.profiling.layer_rows import LAYER_ROW

    return any(str(cells.get("component", "")).strip() == LAYER_ROW for _, cells in read_rows(table, fmt))


@profile.command("export")
@click.argument("profile_ref")
@click.option("--format", "table_fmt", type=click.Choice(["csv", "json"]), default="csv", show_default=True)
@click.option("--model", "model_key", help="Which of the profile's models (when it holds several).")
@click.option("--out", "out_path", type=click.Path(path_type=Path), help="Write here (default: standard output).")
def export(profile_ref: str, table_fmt: str, model_key: str | None, out_path: Path | None) -> None:
    """Write a profile's measurements as the flat table ``profile import`` reads."""
    from runtime.torchfree.profiling.flat_table import format_rows, table_rows, write_rows

    if out_path is not None:
        check_output_file(out_path, "--out")
    _, prof = _profile_file(profile_ref, "PROFILE")
    rows = table_rows(prof, model_key)
    if out_path is None:
        click.echo(format_rows(rows, table_fmt), nl=False)   # type: ignore[arg-type]
    else:
        write_rows(rows, out_path, table_fmt)   # type: ignore[arg-type]


@profile.command("show")
@click.argument("profile_ref")
@FORMAT_OPTION
def show(profile_ref: str, fmt: str) -> None:
    """Print a profile: its figures, its models' fits and tables, its link curves."""
    path, prof = _profile_file(profile_ref, "PROFILE")
    if fmt == "json":
        sources = {name: {str(tp): {c: how if base is None else f"{how} from tp{base}" for c, (how, base) in m.items()}
                          for tp, m in unmeasured(mm).items()} for name, mm in prof.models.items()}
        emit_json({"path": str(path), "profile": to_data(prof), "unmeasured": sources})
        return
    con = console()
    c, m = prof.compute, prof.memory
    con.print(f"[bold]{prof.device_type}[/bold] ({prof.provenance}, {path}): {prof.memory_gib:g} GiB, "
              f"{c.peak_tflops:g} TFLOPS x {c.matmul_efficiency:g} matmul, {c.memory_bandwidth_gbs:g} GB/s; "
              f"bytes/param {m.param_bytes:g}+{m.grad_bytes:g}+{m.optimizer_bytes:g}"
              + (f"; {prof.iteration_s * 1e3:.3f} ms per iteration" if prof.iteration_s else ""))
    if prof.source.note:
        con.print(f"  source: {prof.source.note}")
    for name, mm in prof.models.items():
        out = table(f"{name} (h={mm.hidden_size}, ffn={mm.ffn_hidden_size}, heads={mm.num_heads}/"
                    f"{mm.num_kv_heads}, vocab={mm.vocab_size})"
                    + (": TP times include their collectives" if mm.includes_tp_comm else ""),
                    ("TP", "layer", "component", "source", "points", "fwd ms", "bwd ms", "opt ms"),
                    left=("component", "source", "points", "layer"))
        for tp, fits in mm.tp.items():
            for comp in COMPONENTS:
                f = fits[comp]
                s = mm.seq_lens[-1]
                out.add_row(str(tp), "", comp, "fit", f"B={mm.micro_batch} s={s}",
                            _ms(f.forward_s, s, mm.micro_batch), _ms(f.backward_s, s, mm.micro_batch), "")
        rows = [(tp, "", comps) for tp, comps in mm.tables.items()]
        rows += [(tp, str(i), comps) for i, by_tp in mm.layers.items() for tp, comps in by_tp.items()]
        for tp, layer, comps in rows:
            for comp, t in comps.items():
                out.add_row(str(tp), layer, comp, "table",
                            f"B {','.join(map(str, t.micro_batches))} x s {','.join(map(str, t.seq_lens))}",
                            f"{t.forward_s[-1][-1] * 1e3:.3f}", f"{t.backward_s[-1][-1] * 1e3:.3f}",
                            "" if t.optimizer_s is None else f"{t.optimizer_s * 1e3:.3f}")
        for tp, missing in unmeasured(mm).items():
            for comp, (how, base) in missing.items():
                out.add_row(str(tp), "", comp, how if base is None else f"{how} from tp{base}", "", "", "", "")
        con.print(out)
    cm = prof.comm
    if cm.p2p is not None:
        con.print(f"  p2p: {_link(cm.p2p)}")
    for n, f in cm.allreduce.items():
        con.print(f"  all-reduce x{n}: {_link(f)}")
    curves = [(f"{cls} {d}", c) for cls, lc in cm.links.items() for d, c in (("send", lc.send), ("recv", lc.recv))]
    curves += [(f"{cls} all-reduce x{n}", c) for cls, by_n in cm.allreduce_curves.items() for n, c in by_n.items()]
    for what, c in curves:
        if c is not None:
            con.print(f"  {what}: " + ", ".join(f"{b:,} B @ {bw:g} GB/s" for b, bw in zip(c.bytes, c.bandwidth_gbs)))
    if cm.serialised_send_recv:
        con.print("  a send and a receive posted together serialise")
