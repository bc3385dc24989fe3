"""``hspmd check-numerics --types cpu,cuda``: each model component's forward and backward on each local
device type and dtype against an fp64 CPU reference (H2-style cross-chip validation)."""

from __future__ import annotations

import sys

import click

from hetu_cli.output import FORMAT_OPTION, IntRange, console, emit_json, table
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.schema import MAX_INT

EXIT_FLAGGED = 3  # ran, and some component is outside its tolerance (2 stays "bad input")


def _list(text: str, option: str, allowed: list[str]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in allowed]
    if not items or unknown:
        raise HspmdError(f"{option}: expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(items))


@click.command("check-numerics")
@click.option("--types", "types_text", help="Device types to check, comma-separated [default: every local "
                                            "one: cpu, and cuda when a GPU is visible].")
@click.option("--dtypes", "dtypes_text", default="fp32,bf16", show_default=True,
              help="Dtypes to run each component in (fp32, bf16, fp16).")
@click.option("--model", "model_ref", default="llama-tiny", show_default=True,
              help="Model (catalog name or path) whose component shapes to check.")
@click.option("--batch", type=IntRange(min=1), default=2, show_default=True)
@click.option("--seq-len", type=IntRange(min=2), default=32, show_default=True)
@click.option("--seed", type=IntRange(min=0, max=MAX_INT), default=0, show_default=True,
              help="Seed of the inputs and weights (torch takes at most 64 bits: a larger one was a traceback).")
@FORMAT_OPTION
def check_numerics(types_text: str | None, dtypes_text: str, model_ref: str, batch: int, seq_len: int, seed: int,
                   fmt: str) -> None:
    """Relative error of embedding, attention, MLP, norm and head+loss (forward output and the worst
    gradient) per device type and dtype against fp64 on the CPU; a component over its dtype's tolerance
    is flagged and the exit code is 3."""
    from runtime.profiling.numerics import DTYPES, NumericsSettings, local_devices, size_problem
    from runtime.profiling.numerics import check_numerics as run_check
    from runtime.torchfree.spec import load_model

    here = local_devices()
    types = here if types_text is None else _list(types_text, "--types", here)
    dtypes = _list(dtypes_text, "--dtypes", list(DTYPES))
    spec = load_model(model_ref, file="--model", field="")
    if spec.moe is not None:
        raise HspmdError(f"--model: {spec.name}: mixture-of-experts blocks are not checked yet (check-numerics "
                         "runs dense Llama components)")
    if seq_len > spec.max_seq_len:
        raise HspmdError(f"--seq-len: {seq_len} exceeds {spec.name}'s max_seq_len {spec.max_seq_len}")
    settings = NumericsSettings(batch=batch, seq_len=seq_len, seed=seed)
    too_big = size_problem(spec, settings)
    if too_big is not None:
        raise HspmdError(f"--model: {too_big}")
    results = run_check(spec, types, dtypes, settings)
    flagged = [r for r in results if r.flagged]
    if fmt == "json":
        emit_json({"model": spec.name, "reference": "cpu fp64", "batch": batch, "seq_len": seq_len,
                   "tolerances": {d: settings.tolerances[d] for d in dtypes},
                   "results": [r.to_json() for r in results], "ok": not flagged,
                   "flagged": [f"{r.device} {r.dtype} {r.component}" for r in flagged]})
    else:
        out = table(f"{spec.name}: relative error against fp64 on the CPU (batch {batch} x {seq_len} tokens)",
                    ("device", "dtype", "component", "forward", "backward (worst)", "tolerance", ""),
                    left=("device", "dtype", "component", ""))
        for r in results:
            out.add_row(r.device, r.dtype, r.component, f"{r.forward_error:.2e}",
                        f"{r.backward_error:.2e} ({r.worst_gradient})", f"{r.tolerance:.0e}",
                        "[red]FLAGGED[/red]" if r.flagged else "[green]ok[/green]")
        con = console()
        con.print(out)
        if flagged:
            con.print(f"[red]{len(flagged)} component(s) outside tolerance:[/red] "
                      + ", ".join(f"{r.device} {r.dtype} {r.component}" for r in flagged))
        else:
            con.print(f"every component within tolerance on {', '.join(types)} ({', '.join(dtypes)})")
    if flagged:
        sys.exit(EXIT_FLAGGED)
