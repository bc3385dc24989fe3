"""``hspmd train --plan PLAN``: run a plan, one worker process per device, with a live progress bar.

Under torchrun (``torchrun ... -m hetu_cli train --plan PLAN``) the same command runs as one of torchrun's
workers instead of launching its own; rank 0 shows the progress and writes the metrics.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hetu_cli.emulation import emulated
from hetu_cli.output import MAX_TIMEOUT_S, FiniteFloatRange, Int, IntRange, console, given, plan_argument, refuse_given
from runtime.elastic.agents import DEFAULT_PORT
from runtime.launch import Fault, StepRecord, TorchrunEnv, TrainOptions, WorkerFailure, launch, run_torchrun
from runtime.launch.options import ELASTIC_HEARTBEAT_TIMEOUT_S, ELASTIC_TIMEOUT_S, NodeKill, PlannedSwitch, Rejoin
from runtime.launch.session import TRACE_MERGED
from runtime.launch.supervise import PlainPolicy
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.precision import PRECISIONS
from runtime.torchfree.spec.io import check_append_file, check_output_dir, is_file, why_not

STDOUT = Path("-")   # ``--metrics -``: the JSON lines go to standard output (the progress lines to stderr)


class MetricsFile:
    """One JSON object per step; each line is a single O_APPEND write, so a reader never sees half a line.
    Opened (and truncated) at the first step, so a run refused at start-up leaves no file behind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def write(self, record: StepRecord) -> None:
        self.write_line(record.to_json())

    def write_line(self, obj: dict) -> None:
        """One JSON line: a step, or an event (``{"event": "failure"|"switch", ...}``)."""
        if self.path == STDOUT:
            click.echo(json.dumps(obj))
            return
        try:
            if self.fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            os.write(self.fd, (json.dumps(obj) + "\n").encode())
        except OSError as err:  # a full disk or /dev/full: os.write's error names no file (it was a traceback)
            raise HspmdError(f"{self.path}: --metrics: cannot write: {why_not(err)}") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


class TensorBoard:
    """The step metrics as TensorBoard scalars (torch's SummaryWriter; the tensorboard package is optional)."""

    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise HspmdError(f"{directory}: --tensorboard: needs the tensorboard package, which is not installed "
                             "(pip install tensorboard)") from None
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, r: StepRecord) -> None:
        scalars = {"loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": r.tokens_per_s,
                   "step_time_s": r.step_time_s, "mfu": r.mfu}
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(f"train/{name}", value, r.step)
        for device, peak in (r.peak_memory_bytes or {}).items():
            self.writer.add_scalar(f"memory/peak_gib/device{device}", peak / 2**30, r.step)

    def close(self) -> None:
        self.writer.close()


def mfu_of(plan: Path, cluster: str | None = None, model: str | None = None) -> Callable[[StepRecord], StepRecord]:
    """A step's record with its MFU: model FLOPs (planner/cost.py ``model_flops_per_token`` at the plan's
    seq_len, times the step's tokens) per second over the sum of the step strategy's devices' dense peaks."""
    from dataclasses import replace

    from planner.cost import model_flops_utilization
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan, cluster, model)
    t = ctx.plan.training

    def add(r: StepRecord) -> StepRecord:
        strategy = next((s for s in ctx.plan.strategies if s.name == r.strategy), None)
        if strategy is None:   # a strategy of another plan (an in-memory switch): no MFU rather than a wrong one
            return r
        devices = strategy.devices
        tokens = r.tokens if r.tokens is not None else t.global_batch * t.seq_len
        return replace(r, mfu=model_flops_utilization(ctx.model, ctx.cluster, devices, t.seq_len, tokens,
                                                      r.step_time_s))

    return add


class StepDisplay:
    """A live progress bar (step, loss, step time, tokens/s) on a terminal; one plain line per step elsewhere
    (CI logs, pipes), where a redrawn bar would only leave noise."""

    def __init__(self, steps: int, last_step: int | None, stderr: bool = False) -> None:
        self.console = console(stderr=stderr)
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
            if r.emulation_overrun_s:   # sleep mode: real compute took longer than the target (not hidden)
                emu += f", blocks overran their targets by {r.emulation_overrun_s:.3f} s"
            docs = (f", {r.strategy}: {r.documents} documents, imbalance {r.imbalance:.2f}"
                    if r.documents is not None and r.imbalance is not None else "")
            lr = f", lr {r.lr:.3g}" if r.lr is not None else ""
            mfu = f", MFU {r.mfu:.1%}" if r.mfu is not None else ""
            self.console.print(f"step {r.step}: loss {r.loss:.4f}{lr}, {r.step_time_s:.3f} s/step, "
                               f"{r.tokens_per_s:,.0f} tokens/s{mfu}{emu}{docs}")

    def log(self, message: str) -> None:
        self.progress.console.print(f"[dim]{escape(message)}[/dim]")

    def event(self, message: str) -> None:
        self.progress.console.print(f"[bold yellow]{escape(message)}[/bold yellow]")


@click.command()
@plan_argument("The plan to train")
@click.option("--cluster", "cluster_ref", help="Use this cluster (name or path) instead of the plan's.")
@click.option("--model", "model_ref", help="Use this model (name or path) instead of the plan's.")
@click.option("--strategy", "strategy", help="Strategy of the plan to run (default: its first).")
@click.option("--steps", type=IntRange(min=0), default=20, show_default=True, help="Optimizer steps to run.")
@click.option("--metrics", type=click.Path(path_type=Path),
              help="Write one JSON line per step here (-: standard output, the progress lines then on stderr): loss, "
                   "lr, grad_norm, step time, tokens/s, mfu, peak memory per device (docs/training.md).")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(path_type=Path),
              help="Also write the step metrics as TensorBoard scalars here (needs the tensorboard package).")
@click.option("--trace", "trace_dir", type=click.Path(path_type=Path),
              help="Write per-device Chrome traces (and a merged trace.json) here; open in ui.perfetto.dev.")
@click.option("--data", "data_file", type=click.Path(path_type=Path),
              help="Train on this local file (default: a synthetic stream). FILE.jsonl (a `text` field per line), "
                   "or plain text with --tokenizer or a plan with training.tokens_per_step, is trained "
                   "as whole documents (docs/lengths.md); plain text otherwise as byte windows.")
@click.option("--tokenizer", type=click.Path(path_type=Path),
              help="Tokenize --data with this local Hugging Face tokenizer.json (default: UTF-8 bytes).")
@click.option("--lengths", metavar="DIST|FILE",
              help="Train on synthetic documents whose lengths follow this distribution (longtail, uniform, fixed) "
                   "or histogram YAML file, scaled to training.seq_len.")
@click.option("--long-documents", type=click.Choice(["split", "truncate", "error"]), default="split",
              show_default=True, help="Documents longer than training.seq_len: split into pieces, keep the first "
                                      "seq_len tokens, or refuse the run.")
@click.option("--save", "save_dir", type=click.Path(path_type=Path),
              help="Save checkpoints here: DIR/step-<8 digits>/ at the end (and every --save-every steps), "
                   "DIR/latest naming the newest complete one (docs/training.md).")
@click.option("--save-every", type=IntRange(min=1), metavar="N",
              help="Also save every N steps (written in the background while training goes on).")
@click.option("--save-in-background/--save-in-foreground", default=True, show_default=True,
              help="--save-every: write from a host copy of the whole state on the strategy's first device while "
                   "training goes on, or write before training goes on, holding one transfer round at a time "
                   "(for a state larger than that host's memory).")
@click.option("--keep", type=IntRange(min=1), metavar="K",
              help="Keep the newest K checkpoints of --save [default: all].")
@click.option("--resume", is_flag=True,
              help="Continue from --save's latest checkpoint (step, learning-rate schedule, optimizer, data position, "
                   "random state); --steps is then the run's last step. Without one yet, start at step 0 "
                   "(from --load when given).")
@click.option("--load", "load_dir", type=click.Path(path_type=Path),
              help="Start from this checkpoint (a directory of one, or a --save directory: its latest).")
@click.option("--timeout", "timeout_s", type=FiniteFloatRange(min=1.0, max=MAX_TIMEOUT_S),
              help="Seconds any collective or store operation may take before the run fails "
                   f"[default: 120; {ELASTIC_TIMEOUT_S:g} with --elastic].")
@click.option("--elastic", is_flag=True,
              help="Survive device failures in memory: on a death or hang the survivors replan (the planner, "
                   "switch cost in view), move the state from surviving replicas (fused BSR) and redo the step.")
@click.option("--switch", "switch_specs", multiple=True, metavar="STEP:PLAN",
              help="Switch to PLAN's first strategy in memory before step STEP (repeatable: A->B->A). The workers "
                   "are the union of every plan's devices.")
@click.option("--kill-device", "kill_devices", multiple=True, type=IntRange(min=0), metavar="D",
              help="Fault injection: SIGKILL device D's worker at the start of --at-step (repeatable).")
@click.option("--hang-device", "hang_devices", multiple=True, type=IntRange(min=0), metavar="D",
              help="Fault injection: SIGSTOP device D's worker at the start of --at-step (the launcher kills it "
                   "once its heartbeat stops).")
@click.option("--at-step", "fault_step", type=IntRange(min=1), metavar="K",
              help="The step at which --kill-device / --hang-device fire.")
@click.option("--fault-point", type=click.Choice(["start", "after-commit"]), default="start", show_default=True,
              help="Where in --at-step they fire: its start, or (--elastic) once it is committed, as its optimizer "
                   "update and ZeRO-1 parameter all-gather begin.")
@click.option("--heartbeat-timeout", "heartbeat_timeout_s", type=FiniteFloatRange(min=1.0, max=MAX_TIMEOUT_S),
              help=f"A worker silent this long counts as hung [default: 30; {ELASTIC_HEARTBEAT_TIMEOUT_S:g} with "
                   "--elastic].")
@click.option("--profile", "profile_dirs", multiple=True, type=click.Path(path_type=Path),
              help="--elastic: device profiles for replanning; --dispatch-costs profiles: for pricing documents "
                   "(repeatable; before the shipped profiles/).")
@click.option("--dispatch-costs", type=click.Choice(["plan", "profiles"]), default="plan", show_default=True,
              help="Documents runs: what dispatch weighs per document and pipeline. plan: FLOPs at the devices' "
                   "peak rates and micro-batches of the strategy's max_seq_len; profiles: the planner's cost model "
                   "(the profiles' per-document costs and each stage's memory, the strategies' states side by "
                   "side), as `hspmd plan --lengths` and `hspmd simulate --lengths` price them.")
@click.option("--replan-tolerance", type=FiniteFloatRange(min=0.0), default=0.05, show_default=True,
              help="--elastic: only candidates this close to the fastest are considered; among them, the one "
                   "with the least modelled switch plus predicted step time over the steps left wins.")
@click.option("--preplan/--no-preplan", default=True, show_default=True,
              help="--elastic: between failures, plan in the background for the loss of each device and node of the "
                   "running layout, and decide the return of each device (and node) out of it, so that such a "
                   "failure or return switches without planning.")
@click.option("--rejoin-device", "rejoin_devices", multiple=True, type=Int(), metavar="D",
              help="--elastic: device D returns at the start of --rejoin-at-step (or --at-step) K: a worker is "
                   "started for it and joins the running job when the predicted gain beats the switch cost.")
@click.option("--rejoin-at-step", "rejoin_step", type=IntRange(min=1), metavar="K",
              help="The step at which --rejoin-device returns (default: --at-step).")
@click.option("--events", "events_file", type=click.Path(path_type=Path),
              help="--elastic: replay a failure trace (YAML: events: [{step, action: kill|hang|rejoin, devices: [..] "
                   "| node: NAME}]).")
@click.option("--agents", "agents", type=IntRange(min=1), metavar="N",
              help="--elastic: run the workers on N node agents (`hspmd agent --coordinator HOST:PORT --node NAME "
                   "--token T` on each node) instead of on this machine.")
@click.option("--bind", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True, metavar="HOST:PORT",
              help="--agents: where the coordinator's store listens (loopback unless told otherwise).")
@click.option("--token", help="--agents: the job token every agent must present.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="auto", show_default=True,
              help="Autocast policy: auto = bf16 on CUDA and fp32 on CPU; fp32 = no autocast; bf16 = bf16 autocast "
                   "on every device, the CPU included. Master weights and optimizer states stay fp32.")
@click.option("--node", metavar="NAME",
              help="This machine's node name in the cluster file (default: its host name). GPU clusters: every "
                   "worker checks it runs on its device's node, GPU index and GPU type before it builds; under "
                   "torchrun the node's devices of the run are its local ranks, in id order (docs/gpu.md).")
def train(plan_path: Path, cluster_ref: str | None, model_ref: str | None, strategy: str | None, steps: int,
          metrics: Path | None, tensorboard_dir: Path | None, trace_dir: Path | None,
          data_file: Path | None, tokenizer: Path | None, lengths: str | None, long_documents: str,
          save_dir: Path | None, save_every: int | None, save_in_background: bool, keep: int | None, resume: bool,
          load_dir: Path | None,
          timeout_s: float | None,
          elastic: bool, switch_specs: tuple[str, ...], kill_devices: tuple[int, ...], hang_devices: tuple[int, ...],
          fault_step: int | None, fault_point: str, heartbeat_timeout_s: float | None, profile_dirs: tuple[Path, ...],
          replan_tolerance: float, preplan: bool, rejoin_devices: tuple[int, ...], rejoin_step: int | None,
          events_file: Path | None, agents: int | None, bind: str, token: str | None, precision: str,
          dispatch_costs: str, node: str | None) -> None:
    """Train with PLAN: every device runs its own specialized program (gloo on CPU, NCCL on GPU).

    Started by torchrun (`torchrun ... -m hetu_cli train --plan PLAN`), runs as one of its workers
    instead of launching its own: the multi-node path (docs/training.md, 'Multi-node').
    """
    if lengths is not None and data_file is not None:
        raise HspmdError("--lengths: synthetic documents or --data FILE, not both")
    if (save_every is not None or keep is not None or resume) and save_dir is None:
        raise HspmdError("--save-every, --keep and --resume work on --save DIR; give it")
    if save_every is None:
        refuse_given("only with --save-every N", "save_in_background")
    if save_every is not None and (elastic or switch_specs):
        raise HspmdError("--save-every: an --elastic or --switch run saves at its end only")
    if resume:
        load_dir, steps = _resume(save_dir, load_dir, steps)
    if tokenizer is not None and data_file is None:
        raise HspmdError("--tokenizer: tokenizes --data FILE; give the file")
    check_outputs(metrics, trace_dir)
    faults = _faults(kill_devices, hang_devices, fault_step, bool(rejoin_devices), fault_point)
    rejoins = _rejoins(rejoin_devices, rejoin_step, fault_step, bool(faults))
    node_kills: tuple[NodeKill, ...] = ()
    if fault_point != "start" and not elastic:
        raise HspmdError("--fault-point after-commit: only an elastic run commits steps; add --elastic")
    if (rejoins or events_file or agents) and not elastic:
        raise HspmdError("--rejoin-device, --events and --agents need --elastic")
    if agents is not None and not token:
        raise HspmdError("--agents: give the job token with --token (every agent presents it)")
    if agents is None:
        refuse_given("only with --agents N", "bind", "token")
    if not elastic:
        refuse_given("only with --elastic", "replan_tolerance", "preplan")
        if dispatch_costs != "profiles":
            refuse_given("only with --elastic (replanning) or --dispatch-costs profiles", "profile_dirs")
    if events_file is not None:
        trace = _trace((plan_path, cluster_ref, model_ref), strategy, events_file)
        faults, rejoins, node_kills = faults + trace.faults(), rejoins + trace.rejoins(), trace.node_kills()
        if node_kills and agents is None:
            raise HspmdError(f"{events_file}: a node kill needs node agents (--agents N)")
    if timeout_s is None:
        timeout_s = ELASTIC_TIMEOUT_S if elastic else TrainOptions.timeout_s
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = ELASTIC_HEARTBEAT_TIMEOUT_S if elastic else TrainOptions.heartbeat_timeout_s
    options = TrainOptions(plan=plan_path, cluster=cluster_ref, model=model_ref, strategy=strategy, steps=steps,
                           trace_dir=trace_dir, data_file=data_file,
                           save_dir=save_dir, save_every=save_every or 0, keep=keep, load_dir=load_dir,
                           save_in_background=save_in_background,
                           timeout_s=timeout_s,
                           heartbeat_timeout_s=heartbeat_timeout_s, faults=faults, elastic=elastic,
                           switches=tuple(_parse_switch(s) for s in switch_specs), precision=precision,
                           lengths=lengths, tokenizer=tokenizer, long_documents=long_documents,
                           rejoins=rejoins, node_kills=node_kills, node=node)
    if given("long_documents"):
        from runtime.launch.session import documents_mode
        from runtime.torchfree.spec import load_plan_context

        if not documents_mode(options, load_plan_context(plan_path, cluster_ref, model_ref).plan.training):
            refuse_given("only for documents (--lengths, --tokenizer, --data FILE.jsonl, or a plan with "
                         "training.tokens_per_step); this run trains fixed windows", "long_documents")
    if dispatch_costs == "profiles":
        from hetu_cli.commands.lengths_report import planner_dispatch_costs

        options = planner_dispatch_costs(options, profile_dirs)
    options = emulated(options)   # an emulated cluster's harness: block targets, worker cores
    env = TorchrunEnv.detect(os.environ)
    if env is not None and (options.coordinated or faults):
        raise HspmdError("--elastic, --switch and fault injection run under hspmd's own launcher, not torchrun")
    if env is not None and env.rank != 0:
        run_torchrun(options, env)
        return
    if load_dir is None:
        note = random_weights_note(plan_path, model_ref)
        if note is not None:
            click.echo(f"note: {note}", err=True)
    sink = MetricsFile(metrics) if metrics is not None else None
    board = TensorBoard(tensorboard_dir) if tensorboard_dir is not None else None
    display = StepDisplay(steps, None if load_dir is not None else steps, stderr=metrics == STDOUT)
    with_mfu = mfu_of(plan_path, cluster_ref, model_ref)

    def on_step(record: StepRecord) -> None:
        record = with_mfu(record)
        if board is not None:
            board.write(record)
        if record.switched_from is not None:  # a documents run's dispatch changed strategy before this step
            event = _dispatch_switch_event(record)
            display.event(_dispatch_line(event))
            on_event(event)
        display.step(record)
        if sink is not None:
            sink.write(record)

    def on_event(event: dict) -> None:  # the elastic coordinator logs its events' lines itself
        if sink is not None:
            sink.write_line(event)

    try:
        with display:
            if env is not None:
                run_torchrun(options, env, on_step=on_step, on_log=display.log)
            elif options.coordinated:  # elastic and switching runs coordinate every step (runtime/elastic/)
                from runtime.elastic.coordinator import ElasticPolicy

                replan = planner_replan(profile_dirs, replan_tolerance, display.log) if elastic else None
                grow = _planner_grow(profile_dirs, display.log) if elastic else None
                ahead = ahead_grow = None
                if elastic and preplan:  # quiet: the background's lines would interleave with the run's
                    ahead = planner_replan(profile_dirs, replan_tolerance, lambda _line: None)
                    ahead_grow = _planner_grow(profile_dirs, lambda _line: None)
                policy = ElasticPolicy(replan, on_event, grow, ahead, ahead_grow)
                if agents is not None:
                    from runtime.elastic.agents import AgentSettings, launch_agents, parse_address

                    host, port = parse_address(bind, "--bind")
                    assert token is not None
                    launch_agents(options, policy, AgentSettings(agents, token, host, port), on_step=on_step,
                                  on_log=display.log)
                else:
                    launch(options, policy, on_step=on_step, on_log=display.log)
            else:
                launch(options, PlainPolicy(), on_step=on_step, on_log=display.log)
    except HspmdError as err:
        if isinstance(err, WorkerFailure) and err.kind == "error" and err.traceback:
            console(stderr=True).print(f"[dim]{escape(err.traceback.rstrip())}[/dim]")
        for line in err.lines():
            click.echo(f"error: {line}", err=True)
        sys.exit(getattr(err, "exit_code", 2))  # WorkerFailure, UnrecoverableFailure: 1 unless the user's input
    finally:
        if sink is not None:
            sink.close()
        if board is not None:
            board.close()
    _summary(display.records, metrics, trace_dir, save_dir, display.console)


def random_weights_note(plan_path: Path, model_ref: str | None) -> str | None:
    """One line when the plan's model is a Hugging Face directory holding weights that this run (no --load)
    does not start from: training from random weights by mistake costs a whole run."""
    from runtime.torchfree.spec.catalog import load_plan, model_source_config

    config = (model_source_config(model_ref) if model_ref is not None
              else model_source_config(load_plan(plan_path).model, plan_path.parent))
    if config is None:
        return None
    weights = sorted(p.name for pattern in ("*.safetensors", "pytorch_model*.bin")
                     for p in config.parent.glob(pattern) if p.is_file())
    if not weights:
        return None
    return (f"starting from random weights, not from {config.parent / weights[0]}; add --load {config.parent} "
            "to start from them")


def check_outputs(metrics: Path | None, trace_dir: Path | None) -> None:
    """The output paths, checked before any worker starts: a run of hours must not end by failing to write
    (``--save`` is checked with the checkpoint it may resume from, also before any worker starts)."""
    if metrics is not None and metrics != STDOUT:
        check_append_file(metrics, "--metrics")
    if trace_dir is not None:
        check_output_dir(trace_dir, "--trace")


def _resume(save_dir: Path, load_dir: Path | None, last_step: int) -> tuple[Path | None, int]:
    """--resume: the checkpoint to start from (``save_dir``'s latest, else ``load_dir``) and the steps left
    to reach ``last_step``."""
    from runtime.checkpoint import latest_checkpoint
    from runtime.checkpoint_series import step_of

    latest = latest_checkpoint(save_dir) if save_dir.is_dir() else None
    out = console(stderr=True)
    if latest is None:
        out.print(f"--resume: no checkpoint in {escape(str(save_dir))} yet: starting "
                  + (f"from {escape(str(load_dir))}" if load_dir is not None else "at step 0"), soft_wrap=True)
        return load_dir, last_step
    done = step_of(latest)
    if done == last_step:   # the run finished: repeating its command (a retry loop) is not an error
        out.print(f"--resume: {escape(str(latest))} is the run's last step ({done}): nothing left to train",
                  soft_wrap=True)
        sys.exit(0)
    if done > last_step:
        raise HspmdError(f"{latest}: --resume: the run is at step {done} already, past --steps {last_step} (--steps "
                         "is the run's last step when resuming)")
    out.print(f"--resume: continuing from {escape(str(latest))} (step {done}) to step {last_step}", soft_wrap=True)
    return latest, last_step - done


def _faults(kill: tuple[int, ...], hang: tuple[int, ...], step: int | None, rejoin: bool = False,
            point: str = "start") -> tuple[Fault, ...]:
    if (kill or hang) and step is None:
        raise HspmdError("--kill-device/--hang-device: say when with --at-step K")
    if step is not None and not (kill or hang or rejoin):
        raise HspmdError("--at-step: give the device to fail with --kill-device D or --hang-device D")
    both = sorted(set(kill) & set(hang))
    if both:
        raise HspmdError(f"device(s) {both} given to both --kill-device and --hang-device")
    assert step is not None or not (kill or hang)
    return tuple(Fault(d, step, "kill", point) for d in sorted(set(kill))) + \
        tuple(Fault(d, step, "hang", point) for d in sorted(set(hang)))  # type: ignore[arg-type]


def _rejoins(devices: tuple[int, ...], step: int | None, fault_step: int | None, faults: bool) -> tuple[Rejoin, ...]:
    if step is not None and not devices:
        raise HspmdError("--rejoin-at-step: give the returning device with --rejoin-device D")
    if not devices:
        return ()
    if step is None:
        if faults:
            raise HspmdError("--rejoin-device: a device cannot fail and return at the same --at-step: say when it "
                             "returns with --rejoin-at-step K")
        step = fault_step
    if step is None:
        raise HspmdError("--rejoin-device: say when with --rejoin-at-step K (or --at-step K)")
    return tuple(Rejoin(d, step) for d in sorted(set(devices)))


def _trace(plan: tuple[Path, str | None, str | None], strategy: str | None, events_file: Path):
    from runtime.elastic.events import load_trace
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(*plan)
    return load_trace(events_file, ctx.cluster, ctx.strategy(strategy).devices)


def _parse_switch(spec: str) -> PlannedSwitch:
    step, sep, path = spec.partition(":")
    if not sep or not (step.strip().isascii() and step.strip().isdigit()) or not path:  # int() refuses "²"
        raise HspmdError(f"--switch: expected STEP:PLAN such as 10:other-plan.yaml, got {spec!r}")
    if not is_file(path):
        raise HspmdError(f"{path}: --switch: file not found")
    if int(step) < 1:
        raise HspmdError(f"--switch {spec}: the step must be at least 1")
    return PlannedSwitch(int(step), Path(path))


def _planner_inputs(ctx, strategy: str, profile_dirs: tuple[Path, ...]) -> tuple[Any, Any, dict[str, str]]:
    """What the planner's replan and grow take from a running job: its strategy, the profiles and the refs
    its new plan records."""
    from hetu_cli.commands.replan import plan_refs
    from runtime.torchfree.profiling.profile import resolve_profiles
    from runtime.torchfree.spec.handle import StrategyHandle

    model_ref, cluster_ref = plan_refs(ctx)
    return (StrategyHandle.of(ctx, strategy), resolve_profiles(ctx.cluster.device_types, list(profile_dirs)),
            {"model_ref": model_ref, "cluster_ref": cluster_ref})


def planner_replan(profile_dirs: tuple[Path, ...], tolerance: float, log):
    """The runtime's Replanner: the planner on the survivors, switch cost in view (planner/replan.py)."""

    def replan(failed, ctx, strategy, steps_left):
        from planner.replan import replan as plan_for_survivors

        handle, profiles, refs = _planner_inputs(ctx, strategy, profile_dirs)
        result = plan_for_survivors(handle, failed, profiles, tolerance=tolerance, steps_left=steps_left, **refs)
        c = result.chosen
        fastest = result.options[0]
        vs = "the fastest" if c is fastest else (f"fastest: {fastest.label}, {fastest.step_time_s:.4g} s/step, moves "
                                                  f"{fastest.switch_bytes / 1e6:.3g} MB")
        log(f"replan: {len(result.options)} candidates; chose {c.label} ({c.step_time_s:.4g} s/step predicted, moves "
            f"{c.switch_bytes / 1e6:.3g} MB; {vs}); checkpoint-restart modelled at {result.restart.total_s:.3g} s")
        for note in result.notes:
            log(f"replan: {note}")
        return result.context

    return replan


def _dispatch_switch_event(r: StepRecord) -> dict:
    return {"event": "switch", "cause": "dispatch", "step": r.step, "from": r.switched_from, "to": r.strategy,
            "transfer_s": r.switch_s, "switch_bytes": r.switch_bytes, "modelled_cost_s": r.switch_modelled_s,
            "modelled_gain_s": r.switch_gain_s}


def _planner_grow(profile_dirs: tuple[Path, ...], log):
    """The runtime's Grower: a plan with the joining devices, adopted only when the predicted gain over the
    steps left beats the modelled switch cost (planner/replan.py ``grow``)."""

    def grow(joining, ctx, strategy, steps_left):
        from planner.replan import grow as plan_with

        handle, profiles, refs = _planner_inputs(ctx, strategy, profile_dirs)
        result = plan_with(handle, joining, profiles, steps_left=steps_left, **refs)
        log(f"grow: {result.reason}")
        return result.context if result.adopt else None

    return grow


def _dispatch_line(e: dict) -> str:
    why = (f"modelled gain {e['modelled_gain_s'] * 1e3:.3g} ms > switch cost {e['modelled_cost_s'] * 1e3:.3g} ms"
           if e["modelled_gain_s"] > 0 else f"{e['from']} cannot serve the step's longest document")
    return (f"switch at step {e['step']} from {e['from']} to {e['to']} ({why}): transfer {e['transfer_s']:.3f} s "
            f"({e['switch_bytes'] / 1e6:.3g} MB)")


def _summary(records: list[StepRecord], metrics: Path | None, trace_dir: Path | None, save_dir: Path | None,
             out: Any) -> None:
    if records:
        steady = records[1:] or records  # the first step pays for warm-up
        mean = sum(r.step_time_s for r in steady) / len(steady)
        tps = sum(r.tokens_per_s for r in steady) / len(steady)
        n = f"{len(records)} step" + ("s" if len(records) != 1 else "")
        used = list(dict.fromkeys(r.strategy for r in records))
        if len(used) == 1:
            which = f"of strategy {used[0]!r}"
        else:  # a documents run's dispatch chose per step
            counts = ", ".join(f"{s} {sum(r.strategy == s for r in records)}" for s in used)
            which = f"(steps per strategy: {counts}; {sum(r.switched_from is not None for r in records)} switches)"
        out.print(f"{n} {which}: loss {records[0].loss:.4f} -> "
                  f"{records[-1].loss:.4f}, {mean:.3f} s/step, {tps:,.0f} tokens/s (mean after step 1)")
    if metrics is not None and metrics != STDOUT:
        out.print(f"metrics: {escape(str(metrics))}")
    if trace_dir is not None:
        out.print(f"traces: {escape(str(trace_dir / TRACE_MERGED))} (all devices; per device: "
                  f"{escape(str(trace_dir))}/device<N>.json) - open in https://ui.perfetto.dev")
    if save_dir is not None:
        from runtime.checkpoint import latest_checkpoint

        latest = latest_checkpoint(save_dir) if save_dir.is_dir() else None
        out.print(f"checkpoint: {escape(str(latest or save_dir))}" + (" (latest)" if latest else ""))
