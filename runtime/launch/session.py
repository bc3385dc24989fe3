"""One device's part of a run: join a world, build its program, load, step, save, trace, leave.

Written once for both worker loops: the plain one (runtime/launch/worker.py ``train_worker``) runs these in
a straight line; the elastic one (runtime/elastic/worker.py) joins and leaves several worlds and builds
several programs in between. Torch is imported inside the methods: the launcher names the process entry
point without paying for torch.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from runtime.comm.abort import abort_world, apply_nccl_environment, sever_tcp_connections
from runtime.device_clock import Progress, ProgressHooks
from runtime.launch.messages import FaultFiring, Log
from runtime.launch.options import Fault, FaultPoint, LengthsStep, StepReport, TrainOptions, WorkerSpec
from runtime.launch.placement import check_placement, pin_gpu_order
from runtime.torchfree.errors import HspmdError, Problem, SpecError
from runtime.torchfree.precision import uses_bf16
from runtime.torchfree.spec import PlanContext
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.plan import TrainingSettings

TRACE_MERGED = "trace.json"
DISPATCH_STATE = "dispatch.json"  # beside a documents run's checkpoint: the strategy its last step ran
# A new world's members count themselves in on one store counter; the last to arrive sets ``ALL_ARRIVED``,
# on which the others wait (server-side, in slices so that they can see the launcher give the world up).
ARRIVED = "hspmd-arrived"
ALL_ARRIVED = "hspmd-all-arrived"
ARRIVAL_SLICE_S = 0.1


class WorldAbandoned(RuntimeError):
    """The launcher gave up a world while its members gathered (one of them failed)."""


def read_dispatch_state(load_dir: Path) -> str | None:
    """The strategy a documents run's last saved step ran (``DISPATCH_STATE`` beside its checkpoint), or
    None where none is recorded. Read strictly: a broken file is the user's, not a worker's crash."""
    from runtime.checkpoint import resolve_checkpoint
    from runtime.torchfree.spec.hf import read_config

    path = resolve_checkpoint(load_dir) / DISPATCH_STATE
    if not os.path.lexists(path):
        return None
    name = read_config(path).get("strategy")
    if not isinstance(name, str):
        raise SpecError([Problem(str(path), "strategy", f"expected a strategy name, got {name!r}"[:200])])
    return name


def documents_mode(options: TrainOptions, training: TrainingSettings) -> bool:
    """Whether the run trains on whole documents (docs/lengths.md) rather than fixed windows: the plan sets
    ``training.tokens_per_step``, or the command asks for synthetic lengths, a tokenizer or a JSONL corpus.
    A plain text ``--data`` with none of these keeps its old meaning (byte windows)."""
    from runtime.documents import data_format

    jsonl = options.data_file is not None and data_format(options.data_file) == "jsonl"
    return training.tokens_per_step is not None or options.lengths is not None or options.tokenizer is not None \
        or jsonl


def run_strategies(ctx: PlanContext, options: TrainOptions) -> tuple[str, ...]:
    """The strategies a run trains with: ``--strategy`` alone when given; in documents mode, every strategy of a
    plan that tags length ranges (``max_seq_len``; dispatch picks one per step); else the plan's first."""
    if options.strategy is not None:
        return (ctx.strategy(options.strategy).name,)
    strategies = ctx.plan.strategies
    if documents_mode(options, ctx.plan.training) and any(s.max_seq_len is not None for s in strategies):
        return tuple(s.name for s in strategies)
    return (strategies[0].name,)


def run_devices(ctx: PlanContext, options: TrainOptions) -> list[int]:
    """Every device some strategy of the run uses (one worker each)."""
    return sorted({d for name in run_strategies(ctx, options) for d in ctx.strategy(name).devices})


def documents_problems(ctx: PlanContext, options: TrainOptions) -> list[str]:
    """Why a documents run cannot start (empty: it can): every document must fit some strategy."""
    t = ctx.plan.training
    names = run_strategies(ctx, options)
    longest = max(ctx.strategy(n).max_len_of(t) for n in names)
    problems = []
    if t.seq_len < 2:  # every piece one token: it trained on nothing, loss 0.0000 (one step at 8 tokens/s)
        problems.append(f"{ctx.path}: training.seq_len: documents cut at {t.seq_len} token leave no next token to "
                        "predict (a documents run needs seq_len >= 2)")
    if longest < t.seq_len:
        problems.append(f"{ctx.path}: --strategy: {names[0]!r} serves documents up to {longest} tokens, but the "
                        f"run's documents reach training.seq_len {t.seq_len}")
    if len(names) > 1 and t.zero:
        problems.append(f"{ctx.path}: training.zero: switching between strategies in memory needs full AdamW "
                        "replicas (use zero: false, or one strategy with --strategy)")
    if options.coordinated:
        problems.append("--elastic/--switch: documents runs switch between their plan's strategies themselves; "
                        "they do not take --elastic or --switch yet")
    return problems


def document_source_of(ctx: PlanContext, options: TrainOptions):  # -> runtime.documents.DocumentSource
    """The run's documents (raises SpecError naming the file and field for bad input)."""
    from runtime.documents import DEFAULT_DISTRIBUTION, document_source

    t = ctx.plan.training
    return document_source(tokens_per_step=t.tokens_per_step or t.global_batch * t.seq_len, max_len=t.seq_len,
                           vocab_size=ctx.model.vocab_size, seed=t.seed, data_file=options.data_file,
                           tokenizer=options.tokenizer, lengths=options.lengths or DEFAULT_DISTRIBUTION,
                           long_documents=options.long_documents)  # type: ignore[arg-type]


def peak_memory(device: Any) -> int:
    """The device's peak memory so far: the CUDA caching allocator's peak allocation, or on a CPU device
    the worker process' peak resident set (its only memory)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def restore_trainer_state(load_dir: Path, seed: int, source: Any) -> str | None:
    """The random state a step checkpoint recorded (a checkpoint without trainer state leaves it as is: the
    data's position is the step itself, runtime/data.py). Returns a note where the run's data differs from
    the checkpoint's (another seed or source: the run continues at the same step of its own data)."""
    from runtime.checkpoint import resolve_checkpoint
    from runtime.checkpoint_series import read_trainer_state, restore_rng

    state = read_trainer_state(resolve_checkpoint(load_dir))
    if state is None:
        return None
    restore_rng(state.rng)
    theirs, ours = state.data.get("source"), source.position(state.step).get("source")
    if state.seed != seed or theirs != ours:
        return (f"note: {load_dir} was saved reading {theirs} with seed {state.seed}; this run reads {ours} with "
                f"seed {seed}, from the position of step {state.step}")
    return None


def trace_file(trace_dir: Path, device: int) -> Path:
    return trace_dir / f"device{device}.json"


Reporter = Callable[[object], None]  # where a worker's words go: the launcher's pipe, or rank 0's console


class Session:
    """One device of a run, in whichever world it is in now (none between two generations)."""

    def __init__(self, spec: WorkerSpec, store: Any, report: Reporter, progress: Progress | None = None) -> None:
        import torch

        from runtime.data import token_source
        from runtime.torchfree.spec import load_plan_context

        self.spec, self.store, self.report = spec, store, report
        self.options = options = spec.options
        self.me = spec.device_id
        self.ctx = load_plan_context(options.plan, options.cluster, options.model)  # the plan the run starts with
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.device = torch.device(spec.torch_device)
        if self.device.type == "cuda":
            # Before CUDA allocates anything: this machine, this GPU index, this GPU type are the plan's.
            pin_gpu_order()
            check_placement(self.ctx.cluster, self.me, spec.rank, spec.node if spec.node is not None else options.node,
                            self.device.index or 0, options.gpus, bf16=uses_bf16(options.precision, "cuda"))
            torch.cuda.set_device(self.device)
        if spec.backend == "nccl":  # before the first process group: NCCL reads it as a group is created
            replaced = apply_nccl_environment(elastic=options.coordinated)
            if replaced:
                report(Log(f"device {self.me}: {replaced}"))
        self.timeout = timedelta(seconds=options.timeout_s)
        t = self.ctx.plan.training
        self.documents = documents_mode(options, t)
        if self.documents:
            self.source: Any = document_source_of(self.ctx, options)
        else:
            self.source = token_source(vocab_size=self.ctx.model.vocab_size, global_batch=t.global_batch,
                                       seq_len=t.seq_len, seed=t.seed, data_file=options.data_file)
        self.hooks, self.recorder, self.emulator = _hooks(spec, self.ctx, self.device)
        if progress is not None:  # the heartbeat reports whether the device keeps finishing its actions
            self.hooks = ProgressHooks(progress, self.hooks)
        self._targets: dict[str, Any] = {}  # sleep mode: each built strategy's block pricing, by name
        if self.emulator is not None:
            report(Log(emulation_line(self.me, self.emulator)))
        self.faults = {(f.step, f.point): f for f in options.faults if f.device == self.me}
        self.ranks: dict[int, int] = {}  # device -> rank in the current world
        self.groups: Any = None  # its ProcessGroups
        # The world torch holds now (or held last): ``abort`` may come from another thread at any time,
        # ``leave`` from this one; the lock keeps torch's group registry out of their race.
        self._world_lock = threading.Lock()
        self._world_tag: int | None = None  # the caller's name for it (an elastic run's generation)
        self._aborted = False  # its groups were aborted: torch no longer holds them
        self._shut = False  # gloo: its connections were shut down
        self.saver: Any = None  # --save's checkpoints (runtime/checkpoint_series.py Saver)
        self.saved_step: int | None = None
        if options.save_dir is not None:
            from runtime.checkpoint_series import Saver

            self.saver = Saver(options.save_dir, options.keep, lambda line: report(Log(line)))

    @property
    def rank(self) -> int:
        return self.ranks[self.me]

    def join(self, prefix: str, ranks: Mapping[int, int], abandoned: Callable[[], bool] | None = None,
             tag: int = 0) -> None:
        """Form a world under the store ``prefix`` (fresh per generation), with no subgroups yet; ``tag``
        names it for ``abort``.

        ``abandoned``: asked while waiting for the other members; True (the launcher gave this world up: a
        member failed) ends the wait at once with an error instead of after the timeout."""
        import torch.distributed as dist

        from runtime.comm.groups import ProcessGroups

        with self._world_lock:
            self._world_tag = None  # a late abort of the last world must not touch this one
        store = dist.PrefixStore(prefix, self.store)
        # Every member arrives before torch forms the group: a member that died makes this wait fail while
        # torch's global state is untouched (an init_process_group that fails midway leaves its group counter
        # advanced, and the next world's groups would be named unlike the other members').
        if store.add(ARRIVED, 1) == len(ranks):
            store.set(ALL_ARRIVED, b"1")
        end = time.monotonic() + self.timeout.total_seconds()
        while not _arrived(store, ARRIVAL_SLICE_S):
            if abandoned is not None and abandoned():
                raise WorldAbandoned(f"world {prefix!r} given up by the launcher while its members gathered")
            if time.monotonic() > end:
                raise TimeoutError(f"world {prefix!r}: not every member arrived within "
                                   f"{self.timeout.total_seconds():g} s")
        dist.init_process_group(self.spec.backend, store=store,
                                rank=ranks[self.me], world_size=len(ranks), timeout=self.timeout,
                                device_id=self.device if self.device.type == "cuda" else None)
        self.ranks = dict(ranks)
        groups = ProcessGroups([], ranks, timeout=self.timeout, device=self.device)
        with self._world_lock:
            self.groups = groups
            self._world_tag, self._aborted, self._shut = tag, False, False

    def ensure_groups(self, handle: StrategyHandle) -> None:
        """Create the process groups a strategy's programs use (collective over the world)."""
        from runtime.engine.program import DeviceProgram

        self.groups.ensure(DeviceProgram.required_groups(handle))

    def build(self, handle: StrategyHandle) -> Any:
        """This device's program of ``handle`` (collective: every device of the world builds its own)."""
        from runtime.engine.api import WorkerContext
        from runtime.engine.program import DeviceProgram
        from runtime.trace import EmulatedTarget

        self.ensure_groups(handle)
        if isinstance(self.emulator, EmulatedTarget):   # blocks with minimum durations, given anew per strategy
            # A documents run builds every strategy's program up front: each block is priced by the strategy
            # its span names (the engine puts it in the span's args), the latest built where none is named.
            assert self.options.block_targets is not None
            latest = self.options.block_targets.for_device(handle.ctx, handle.name, self.me) or _no_target
            self._targets[handle.name] = latest
            targets = self._targets
            self.emulator.target_s = lambda name, args: targets.get(args.get("strategy"), latest)(name, args)
        worker = WorkerContext(strategy=handle, device_id=self.me, ranks=dict(self.ranks),
                               torch_device=self.device, timeout=self.timeout, precision=self.options.precision)
        return DeviceProgram(worker, self.groups, self.hooks)

    def load(self, program: Any) -> int:
        """Load ``--load`` into ``program`` (None: this device holds nothing yet); the steps it holds."""
        load_dir = self.options.load_dir
        if load_dir is None:
            return 0
        from runtime.checkpoint import load_checkpoint, read_checkpoint_info

        if program is None:
            return read_checkpoint_info(load_dir, self.ctx).step
        done = load_checkpoint(program, load_dir, self.ctx)
        note = restore_trainer_state(load_dir, self.ctx.plan.training.seed, self.source)
        if self.rank == 0:
            self.report(Log(f"loaded {load_dir} (step {done})"))
            if note is not None:
                self.report(Log(note))
        return done

    def fire_fault(self, step: int, point: FaultPoint = "start") -> None:
        """An injected fault due at ``point`` of ``step`` (once: a step redone after a failure runs clean)."""
        fault = self.faults.pop((step, point), None)
        if fault is not None:
            self.report(FaultFiring(fault.kind, time.time()))
            inject(fault)

    def step(self, program: Any, step: int, before_update: Callable[[Any], None] | None = None) -> StepReport:
        """Run ``step`` (the exceptions of a failed step pass through)."""
        return self.run_step(program, step, self.source.batch(step), before_update)

    def run_step(self, program: Any, step: int, batch: Any, before_update: Callable[[Any], None] | None = None,
                 lengths: LengthsStep | None = None) -> StepReport:
        """One step of ``program`` on ``batch`` (windows, or a documents run's packed ``StepBatch``)."""
        with self.recorder.span("step", f"step {step}") if self.recorder is not None else nullcontext():
            t0 = time.perf_counter()
            stats = program.train_step(batch, before_update=before_update)
            wall = time.perf_counter() - t0
        return self.step_report(step, stats, wall, lengths)

    def step_report(self, step: int, stats: Any, wall: float, lengths: LengthsStep | None = None) -> StepReport:
        """What this worker reports of ``step`` (``stats``: the program's ``StepStats``)."""
        return StepReport(step=step, rank=self.rank, device=self.me, loss=float(stats.loss),
                          grad_norm=float(stats.grad_norm), tokens=int(stats.tokens), wall_s=wall,
                          compute_s=float(stats.compute_s), comm_s=float(stats.comm_s), lr=float(stats.lr),
                          emulation_s=self.emulator.take_emulated_s() if self.emulator is not None else 0.0,
                          emulation_overrun_s=self.emulator.take_overrun_s() if self.emulator is not None else 0.0,
                          lengths=lengths, peak_memory_bytes=peak_memory(self.device),
                          expert_loads=stats.expert_loads)

    def trainer_state(self, step: int) -> Any:
        """What a checkpoint of ``step`` records besides the model: the data's position, seed and RNG."""
        from runtime.checkpoint_series import TrainerState, torch_rng_state

        return TrainerState(step=step, seed=self.ctx.plan.training.seed, data=self.source.position(step),
                            rng=torch_rng_state())

    def save(self, program: Any, handle: StrategyHandle, step: int, *, background: bool,
             extra: Mapping[str, bytes] | None = None) -> None:
        """Checkpoint ``step`` into ``--save``'s series (collective over ``handle``'s devices)."""
        assert self.saver is not None
        self.saver.save(program, self.groups, plan=handle.ctx, strategy=handle.name,
                        trainer=self.trainer_state(step), extra=extra, background=background)
        self.saved_step = step

    def save_documents(self, steps: DocumentSteps, step: int, *, background: bool) -> None:
        """A documents run's checkpoint of ``step`` (its program holding the state, and the dispatch state)."""
        if steps.save(self.saver, self.trainer_state(step), background=background):
            self.saved_step = step

    def periodic_save_due(self, step: int, last: int) -> bool:
        """Whether ``step`` (not the run's last: that one is saved by ``finish``) is a ``--save-every`` step."""
        every = self.options.save_every
        return self.saver is not None and every > 0 and step % every == 0 and step != last

    def finish(self, program: Any, handle: StrategyHandle, step: int,
               save: Callable[[int], None] | None = None, *, sync: bool = True) -> None:
        """Save ``--save``'s last checkpoint (when this device holds state and ``step`` is not saved yet;
        ``save``: how, for a documents run) and wait for every save in flight, write the traces, leave the
        world. ``sync``: wait for every device of the world first (needed to merge the traces; an elastic
        run skips it without traces, so that a device idle in the plan that died unnoticed cannot fail the
        end of the run)."""
        import torch.distributed as dist

        if self.saver is not None and (save is not None or program is not None):
            if self.saved_step != step:
                if save is not None:
                    save(step)
                else:
                    self.save(program, handle, step, background=False)
            self.saver.wait()
        if self.recorder is not None:
            assert self.options.trace_dir is not None
            self.recorder.write(trace_file(self.options.trace_dir, self.me))
        if sync or self.recorder is not None:
            dist.barrier()
        if self.recorder is not None and self.rank == 0:
            _merge_traces(self.options.trace_dir, sorted(self.spec.ranks))
        self.leave()

    def abort(self, tag: int | None = None) -> bool:
        """Abort every process group of the world ``tag`` (None: whichever this device is in), the world
        group included, if this device is in it or has just left it; whether it did. Safe from any thread:
        the launcher's abort arrives on the control-pipe thread while this device's training thread is
        blocked in that world (runtime/comm/abort.py says why nothing else can end the block on NCCL)."""
        with self._world_lock:
            if self._world_tag is None or (tag is not None and tag != self._world_tag):
                return False
            return self._abort_locked(shut=True)

    def _abort_locked(self, *, shut: bool) -> bool:
        did = False
        if not self._aborted:
            abort_world(shut_connections=False, keep_port=self.store.port)
            self._aborted = did = True
        if shut and self.spec.backend == "gloo" and not self._shut:
            sever_tcp_connections(keep_port=self.store.port)
            self._shut = did = True
        return did

    def leave(self, *, abandon: bool = False) -> None:
        """Leave the world: destroy this device's process groups and its world (nothing if it is in none:
        leaving twice is harmless).

        ``abandon``: a step or switch failed (a peer vanished) and the caller has dropped its program. Every
        group is aborted instead of destroyed (destroying an NCCL group waits for its kernels, which wait
        for the dead peer). On gloo the connections are also shut down (``gloo_shut_on_leave``), so that a
        peer blocked on this device errors at once instead of waiting for the launcher's abort.
        """
        import torch.distributed as dist

        with self._world_lock:
            groups, self.groups = self.groups, None
            if abandon or self._aborted:
                self._abort_locked(shut=abandon and self.options.gloo_shut_on_leave)
                if groups is not None:
                    groups.forget()  # aborted: torch holds them no more
            else:
                if groups is not None:
                    groups.destroy()
                if dist.is_initialized():
                    dist.destroy_process_group()
                self._world_tag = None  # left in good order: nothing of it remains to abort
        del groups
        if abandon:
            gc.collect()  # the last references to the groups go now: their sockets close


def _arrived(store: Any, within_s: float) -> bool:
    """Whether every member of the world has arrived; when not yet, after a pause of ``within_s``. One key
    checked per request: a store ``wait`` that times out would log a C++ warning every time."""
    if store.check([ALL_ARRIVED]):
        return True
    time.sleep(within_s)
    return False


def _no_target(name: str, args: Mapping[str, Any]) -> None:
    return None


def sleep_mode_problem(ctx: PlanContext, options: TrainOptions) -> str | None:
    """Why ``options`` cannot run ``ctx``'s sleep-mode devices: their blocks' targets are not given."""
    sleepers = [t for t, dt in ctx.cluster.device_types.items() if dt.emulate is not None and dt.emulate.sleeps]
    if not sleepers or options.block_targets is not None:
        return None
    return (f"cluster {ctx.cluster.name!r}: sleep-mode device types ({', '.join(sleepers)}) need their blocks' "
            "target durations (TrainOptions.block_targets; hspmd train gives them)")


def _hooks(spec: WorkerSpec, plan_ctx: Any, device: Any) -> tuple[Any, Any, Any]:
    from runtime.engine.api import NULL_HOOKS
    from runtime.trace import EmulatedSlowdown, EmulatedTarget, TraceRecorder

    options = spec.options
    missing = sleep_mode_problem(plan_ctx, options) if device.type == "cpu" else None
    if missing is not None:
        raise HspmdError(missing)
    dev_type = plan_ctx.cluster.type_of(spec.device_id)
    em = dev_type.emulate if device.type == "cpu" else None
    emulate = em is not None and em.slowdown > 1.0
    sleeps = em is not None and em.sleeps
    recorder = None
    if options.trace_dir is not None:
        from runtime.device_clock import device_clock

        label = f"device {spec.device_id} ({plan_ctx.cluster.device(spec.device_id).type}"
        if sleeps:
            assert em is not None and em.target is not None
            label += f", emulating {em.target.profile} running {em.target.model} x{em.time_scale:g})"
        else:
            label += f", emulated {dev_type.emulate.slowdown:g}x slower)" if emulate else ")"
        recorder = TraceRecorder(spec.device_id, label, clock=device_clock(device))
    emulator: EmulatedSlowdown | EmulatedTarget | None = None
    if sleeps:
        assert options.block_targets is not None
        targets = options.block_targets.for_device(plan_ctx, spec.strategy, spec.device_id) or _no_target
        emulator = EmulatedTarget(targets, inner=recorder)
    elif emulate:
        emulator = EmulatedSlowdown(dev_type.emulate.slowdown, inner=recorder)
    return emulator or recorder or NULL_HOOKS, recorder, emulator


def emulation_line(device: int, emulator: Any) -> str:
    """The log line saying how a worker emulates its device (stretch or sleep mode)."""
    from runtime.trace import EmulatedTarget

    if isinstance(emulator, EmulatedTarget):
        return (f"device {device}: emulating its target device (each forward / backward block lasts its "
                "target time: the real compute, then a sleep)")
    return (f"device {device}: emulating a {emulator.slowdown:g}x slower device "
            f"(sleeps {emulator.slowdown - 1:g}x each measured compute block)")


def _merge_traces(trace_dir: Path | None, devices: list[int]) -> None:
    from runtime.trace import merge_chrome_traces

    assert trace_dir is not None
    # Under a multi-node torchrun the directory may not be shared: merge what this node can see.
    paths = [trace_file(trace_dir, d) for d in devices if trace_file(trace_dir, d).is_file()]
    merge_chrome_traces(paths, trace_dir / TRACE_MERGED)


def inject(fault: Fault) -> None:
    if fault.kind == "error":
        raise RuntimeError(f"injected fault on device {fault.device} at step {fault.step}")
    if fault.kind == "user-error":
        raise HspmdError(f"injected user error on device {fault.device} at step {fault.step}")
    if fault.kind == "exit":
        os._exit(3)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)


def documents_line(source: Any) -> str:
    """What a documents run trains on, with what loading skipped or cut (empty documents are counted)."""
    from runtime.documents import CorpusDocuments

    if isinstance(source, CorpusDocuments):
        per_step = f"{source.tokens_per_step} tokens per step, at most {source.max_len} per document, epoch order"
        c = source.corpus
        if c is None:
            d = source.stream.docs
            return (f"data: {d.origin}: {len(d.lengths)} prepared documents, {d.tokens} tokens (EOS id {d.eos}), "
                    f"{per_step}")
        eos = f"EOS id {c.eos} after each" if c.eos is not None else "no EOS token (bytes, or a tokenizer whose " \
                                                                        "tokenizer_config.json names none)"
        return (f"data: {c.path}: {len(c.documents)} documents after cutting ({c.skipped_empty} empty skipped, "
                f"{c.split_documents} split, {c.truncated_documents} truncated; {eos}), {per_step}")
    return (f"data: synthetic documents, lengths {source.distribution.name} up to {source.max_len} tokens, "
            f"{source.tokens_per_step} tokens per step")


class DocumentSteps:
    """A documents run on one device: every strategy's program built once at start-up; per step the dispatch
    (runtime/torchfree/dispatch.py: the strategy, with hysteresis against switching, and each document's pipeline and
    micro-batch), computed identically on every device so nothing is communicated; a switch when the step's
    strategy is not the one holding the state; then the step on the chosen strategy's program (devices it
    leaves idle sit it out).

    Only one strategy holds the training state at a time (``holder``): the others' programs stay built with
    their parameters' storage and moments freed; a switch moves the state in stages (docs/design.md §4).

    ``build`` makes this device's program of a strategy (collective, like ``Session.build``); ``costs``
    replaces the plan-derived cost models dispatch weighs (``dispatch.plan_strategy_cost``), e.g. measured ones;
    ``observe``: told of each stage of a switch (``runtime.elastic.move.StageObserver``).
    """

    def __init__(self, ctx: PlanContext, names: tuple[str, ...], *, me: int, groups: Any, device: Any,
                 build: Callable[[StrategyHandle], Any], source: Any, costs: list[Any] | None = None,
                 recorder: Any = None, observe: Callable[[int, Any, str], None] | None = None) -> None:
        from runtime.engine.program import DeviceProgram
        from runtime.torchfree.dispatch import plan_strategy_cost

        self.ctx, self.me, self.groups, self.device = ctx, me, groups, device
        self.source, self.recorder, self.observe = source, recorder, observe
        self.handles = [StrategyHandle.of(ctx, n) for n in names]
        for h in self.handles:  # collective: every device creates every strategy's groups, in plan order
            groups.ensure(DeviceProgram.required_groups(h))
        self.programs: list[Any] = []
        for i, h in enumerate(self.handles):
            program = build(h) if me in h.devices else None
            if program is not None and i > 0:   # a fresh run starts in strategy 0's state
                program.release_state()
            self.programs.append(program)
        self.holder = 0   # the strategy whose program holds the state (the same on every device)
        self.costs = costs if costs is not None else [
            plan_strategy_cost(h.strategy, h.model, h.cluster, h.training) for h in self.handles]
        self.current: int | None = None   # the strategy of the previous step (dispatch's hysteresis)
        self.note: str | None = None   # what loading found different about the data (restore_trainer_state)
        self._switches: dict[tuple[int, int], Any] = {}

    def switch_plan(self, src: int, dst: int) -> Any:
        """The staged switch moving every parameter and moment from strategy ``src``'s layout to ``dst``'s."""
        if (src, dst) not in self._switches:
            from runtime.torchfree.elastic.staging import plan_staged_switch

            self._switches[src, dst] = plan_staged_switch(self.handles[src], self.handles[dst])
        return self._switches[src, dst]

    def switch_cost(self, src: int, dst: int) -> float:
        return float(self.switch_plan(src, dst).modelled_time(self.ctx.cluster))

    def load(self, load_dir: Path) -> int:
        """A checkpoint into the program of the strategy the saved run's last step ran (``DISPATCH_STATE``; the
        first strategy where none is recorded), which then holds the state, so that the hysteresis continues
        as it would have."""
        from runtime.checkpoint import load_checkpoint, read_checkpoint_info

        done = read_checkpoint_info(load_dir, self.ctx).step
        name = read_dispatch_state(load_dir)
        names = [h.name for h in self.handles]
        if name is not None:  # a name this plan lacks (another plan saved it): its first strategy
            self.current = names.index(name) if name in names else None
        holder = self.current if self.current is not None else 0
        if holder != self.holder and self.programs[self.holder] is not None:
            self.programs[self.holder].release_state()
        self.holder = holder
        if self.programs[holder] is not None:
            load_checkpoint(self.programs[holder], load_dir, self.ctx)
        self.note = restore_trainer_state(load_dir, self.ctx.plan.training.seed, self.source)
        return done

    def save(self, saver: Any, trainer: Any, *, background: bool) -> bool:
        """Save from the program holding the state (collective over its devices) into ``saver``'s series
        (runtime/checkpoint_series.py), the dispatch state beside; False where this device holds none."""
        import json

        handle, program = self.current_handle, self.current_program
        if program is None:
            return False
        saver.save(program, self.groups, plan=self.ctx, strategy=handle.name, trainer=trainer,
                   extra={DISPATCH_STATE: (json.dumps({"strategy": handle.name}) + "\n").encode()},
                   background=background)
        return True

    @property
    def current_handle(self) -> StrategyHandle:
        return self.handles[self.holder]

    @property
    def current_program(self) -> Any:
        return self.programs[self.holder]

    def prepare(self, step: int) -> tuple[Any, Any, LengthsStep]:
        """Dispatch ``step``, switch state when its strategy differs from the previous step's, and return
        the program to run (None: idle here), the packed ``StepBatch`` and what was decided."""
        from runtime.elastic.move import move_state_staged
        from runtime.engine.microbatch import documents_step_batch
        from runtime.torchfree.dispatch import dispatch

        t_dispatch = time.perf_counter()
        docs = self.source.documents(step)
        previous = self.current
        d = dispatch(docs.lengths, self.costs, current=previous, switch_cost=self.switch_cost)
        dispatch_s = time.perf_counter() - t_dispatch
        switch_s, sent, gain = 0.0, 0, 0.0
        if d.strategy != self.holder:   # a switch (or, at a run's first step, the move out of strategy 0)
            plan = self.switch_plan(self.holder, d.strategy)
            t0 = time.perf_counter()
            span = self.recorder.span("comm", f"switch to {d.strategy_name}") if self.recorder else nullcontext()
            with span:
                move_state_staged(plan, self.programs[self.holder], self.programs[d.strategy], self.groups,
                                  step - 1, self.device, self.observe)
            self.holder = d.strategy
            switch_s = time.perf_counter() - t0
            sent = plan.sent_bytes(self.me)
            old = None if previous is None else d.predicted[previous]
            gain = 0.0 if old is None else old - d.assignment.makespan
        self.current = d.strategy
        t_pack = time.perf_counter()
        batch = documents_step_batch(docs, [[list(mb) for mb in p.microbatches] for p in d.assignment.pipelines])
        dispatch_s += time.perf_counter() - t_pack
        slots = sum(m.shape[0] * m.shape[1] for p in batch.pipelines for m in p)
        info = LengthsStep(strategy=d.strategy_name, documents=len(docs.documents),
                           padding_fraction=1.0 - batch.num_tokens / slots if slots else 0.0,
                           imbalance=d.assignment.imbalance, predicted_s=d.assignment.makespan,
                           method=d.assignment.method, dispatch_s=dispatch_s,
                           switched_from=None if previous in (None, d.strategy) else self.handles[previous].name,
                           switch_s=switch_s, switch_bytes=sent, switch_modelled_s=d.switch_cost, switch_gain_s=gain)
        return self.programs[d.strategy], batch, info


def document_steps(session: Session) -> DocumentSteps:
    """A session's documents run: its strategies, programs built by the session (emulation and tracing hooks)."""
    names = run_strategies(session.ctx, session.options)
    costs = session.options.dispatch_costs
    if costs is not None and tuple(c.name for c in costs) != names:
        raise ValueError(f"dispatch_costs price strategies {[c.name for c in costs]}, the run has {list(names)}")
    return DocumentSteps(session.ctx, names, me=session.me, groups=session.groups, device=session.device,
                         build=session.build, source=session.source, costs=list(costs) if costs else None,
                         recorder=session.recorder)


def documents_step(session: Session, steps: DocumentSteps, step: int,
                   before_update: Callable[[Any], None] | None = None) -> StepReport:
    """One documents step as the session reports it (an idle device reports that it sat the step out)."""
    program, batch, info = steps.prepare(step)
    if program is None:
        return StepReport(step=step, rank=session.rank, device=session.me, loss=0.0, grad_norm=0.0,
                          tokens=batch.num_tokens, wall_s=0.0, compute_s=0.0, comm_s=0.0, emulation_s=0.0,
                          lengths=info, idle=True)
    return session.run_step(program, step, batch, before_update, info)
