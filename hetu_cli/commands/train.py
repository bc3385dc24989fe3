"""``hspmd train --plan PLAN``: run a plan, one worker process per device, with a live progress bar.

Under torchrun (``torchrun ... -m hetu_cli train --plan PLAN``) the same command runs as one of torchrun's
workers instead of launching its own; rank 0 shows the progress and writes the metrics.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hetu_cli.output import console, err_console
from runtime.launch import StepRecord, TorchrunEnv, TrainOptions, WorkerFailure, launch, run_torchrun
from runtime.launch.worker import TRACE_MERGED


class MetricsFile:
    """One JSON object per step; each line is a single O_APPEND write, so a reader never sees half a line.
    Opened (and truncated) at the first step, so a run refused at start-up leaves no file behind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def write(self, record: StepRecord) -> None:
        if self.fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.write(self.fd, (json.dumps(record.to_json()) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


class StepDisplay:
    """A live progress bar (step, loss, step time, tokens/s) on a terminal; one plain line per step elsewhere
    (CI logs, pipes), where a redrawn bar would only leave noise."""

    def __init__(self, steps: int, last_step: int | None) -> None:
        self.console = console()
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]train[/bold]"), BarColumn(bar_width=30),
            TextColumn("step {task.fields[step]}/{task.fields[last]}"),
            TextColumn("loss [cyan]{task.fields[loss]}[/cyan]"),
            TextColumn("{task.fields[step_time]} s/step"),
            TextColumn("{task.fields[tps]} tokens/s"),
            TimeElapsedColumn(), console=self.console, disable=not self.live)
        self.task = self.progress.add_task("train", total=steps, step="-", loss="-", step_time="-", tps="-",
                                           last="?" if last_step is None else last_step)
        self.steps = steps
        self.records: list[StepRecord] = []

    def __enter__(self) -> StepDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def step(self, r: StepRecord) -> None:
        if not self.records:
            self.progress.update(self.task, last=r.step + self.steps - 1)
        self.records.append(r)
        self.progress.update(self.task, advance=1, step=r.step, loss=f"{r.loss:.4f}",
                             step_time=f"{r.step_time_s:.3f}", tps=f"{r.tokens_per_s:,.0f}")
        if not self.live:
            emu = f", emulation {r.emulation_s:.3f} s" if r.emulation_s else ""
            self.console.print(f"step {r.step}: loss {r.loss:.4f}, {r.step_time_s:.3f} s/step, "
                               f"{r.tokens_per_s:,.0f} tokens/s{emu}")

    def log(self, message: str) -> None:
        self.progress.console.print(f"[dim]{escape(message)}[/dim]")


@click.command()
@click.option("--plan", "plan", required=True, type=click.Path(path_type=Path), help="The plan file.")
@click.option("--strategy", "strategy", help="Strategy of the plan to run (default: its first).")
@click.option("--steps", type=click.IntRange(min=0), default=20, show_default=True, help="Optimizer steps to run.")
@click.option("--metrics", type=click.Path(path_type=Path), help="Write one JSON line per step here.")
@click.option("--trace", "trace_dir", type=click.Path(path_type=Path),
              help="Write per-device Chrome traces (and a merged trace.json) here; open in ui.perfetto.dev.")
@click.option("--data", "data_file", type=click.Path(path_type=Path),
              help="Train on this local text file as byte tokens (default: a synthetic token stream).")
@click.option("--save", "save_dir", type=click.Path(path_type=Path), help="Save a checkpoint here at the end.")
@click.option("--load", "load_dir", type=click.Path(path_type=Path), help="Start from this checkpoint.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              help="Seconds any collective or store operation may take before the run fails.")
def train(plan: Path, strategy: str | None, steps: int, metrics: Path | None, trace_dir: Path | None,
          data_file: Path | None, save_dir: Path | None, load_dir: Path | None, timeout_s: float) -> None:
    """Train with PLAN: every device runs its own specialized program (gloo on CPU, NCCL on GPU).

    Started by torchrun (`torchrun ... -m hetu_cli train --plan PLAN`), runs as one of its workers
    instead of launching its own: the multi-node path (README, 'Training').
    """
    options = TrainOptions(plan=plan, strategy=strategy, steps=steps, trace_dir=trace_dir, data_file=data_file,
                           save_dir=save_dir, load_dir=load_dir, timeout_s=timeout_s)
    env = TorchrunEnv.detect(os.environ)
    if env is not None and env.rank != 0:
        run_torchrun(options, env)
        return
    sink = MetricsFile(metrics) if metrics is not None else None
    display = StepDisplay(steps, None if load_dir is not None else steps)

    def on_step(record: StepRecord) -> None:
        display.step(record)
        if sink is not None:
            sink.write(record)

    try:
        with display:
            if env is not None:
                run_torchrun(options, env, on_step=on_step, on_log=display.log)
            else:
                launch(options, on_step=on_step, on_log=display.log)
    except WorkerFailure as failure:
        if failure.kind == "error" and failure.traceback:
            err_console().print(f"[dim]{escape(failure.traceback.rstrip())}[/dim]")
        for line in failure.lines():
            click.echo(f"error: {line}", err=True)
        sys.exit(failure.exit_code)
    finally:
        if sink is not None:
            sink.close()
    _summary(display.records, metrics, trace_dir, save_dir)


def _summary(records: list[StepRecord], metrics: Path | None, trace_dir: Path | None, save_dir: Path | None) -> None:
    out = console()
    if records:
        steady = records[1:] or records  # the first step pays for warm-up
        mean = sum(r.step_time_s for r in steady) / len(steady)
        tps = sum(r.tokens_per_s for r in steady) / len(steady)
        n = f"{len(records)} step" + ("s" if len(records) != 1 else "")
        out.print(f"{n} of strategy {records[-1].strategy!r}: loss {records[0].loss:.4f} -> "
                  f"{records[-1].loss:.4f}, {mean:.3f} s/step, {tps:,.0f} tokens/s (mean after step 1)")
    if metrics is not None:
        out.print(f"metrics: {escape(str(metrics))}")
    if trace_dir is not None:
        out.print(f"traces: {escape(str(trace_dir / TRACE_MERGED))} (all devices; per device: "
                  f"{escape(str(trace_dir))}/device<N>.json) - open in https://ui.perfetto.dev")
    if save_dir is not None:
        out.print(f"checkpoint: {escape(str(save_dir))}")
