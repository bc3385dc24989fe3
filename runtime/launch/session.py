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
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

from runtime.errors import HspmdError, Problem, SpecError
from runtime.launch.messages import FaultFiring, Log
from runtime.launch.options import Fault, FaultPoint, LengthsStep, StepReport, TrainOptions, WorkerSpec
from runtime.launch.placement import check_placement, pin_gpu_order
from runtime.precision import uses_bf16
from runtime.spec import PlanContext
from runtime.spec.handle import StrategyHandle
from runtime.spec.plan import TrainingSettings

TRACE_MERGED = "trace.json"
DISPATCH_STATE = "dispatch.json"  # beside a documents run's checkpoint: the strategy its last step ran
ARRIVED = "hspmd-arrived"  # the store keys by which the members of a new world show they are there
# The members poll one key (set by the last to arrive), first every ARRIVAL_POLL_S, backing off to every
# ARRIVAL_POLL_MAX_S: O(1) store requests, a few per second per member once a world is slow to gather.
# (A blocking store.wait with a timeout would do as well, but each of its timeouts logs socket warnings.)
ARRIVAL_POLL_S = 0.05
ARRIVAL_POLL_MAX_S = 0.5


class WorldAbandoned(RuntimeError):
    """The launcher gave up a world while its members gathered (one of them failed)."""


def read_dispatch_state(load_dir: Path) -> str | None:
    """The strategy a documents run's last saved step ran (``DISPATCH_STATE`` beside its checkpoint), or
    None where none is recorded. Read strictly: a broken file is the user's, not a worker's crash."""
    from runtime.spec.hf import read_config

    path = Path(load_dir) / DISPATCH_STATE
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


def trace_file(trace_dir: Path, device: int) -> Path:
    return trace_dir / f"device{device}.json"


Reporter = Callable[[object], None]  # where a worker's words go: the launcher's pipe, or rank 0's console


class Session:
    """One device of a run, in whichever world it is in now (none between two generations)."""

    def __init__(self, spec: WorkerSpec, store: Any, report: Reporter) -> None:
        import torch

        from runtime.data import token_source
        from runtime.spec import load_plan_context

        self.spec, self.store, self.report = spec, store, report
        self.options = options = spec.options
        self.me = spec.device_id
        self.ctx = load_plan_context(options.plan)  # the plan the run starts with
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.device = torch.device(spec.torch_device)
        if self.device.type == "cuda":
            # Before CUDA allocates anything: this machine, this GPU index, this GPU type are the plan's.
            pin_gpu_order()
            check_placement(self.ctx.cluster, self.me, spec.rank, spec.node if spec.node is not None else options.node,
                            self.device.index or 0, options.gpus, bf16=uses_bf16(options.precision, "cuda"))
            torch.cuda.set_device(self.device)
        self.timeout = timedelta(seconds=options.timeout_s)
        t = self.ctx.plan.training
        self.documents = documents_mode(options, t)
        if self.documents:
            self.source: Any = document_source_of(self.ctx, options)
        else:
            self.source = token_source(vocab_size=self.ctx.model.vocab_size, global_batch=t.global_batch,
                                       seq_len=t.seq_len, seed=t.seed, data_file=options.data_file)
        self.hooks, self.recorder, self.emulator = _hooks(spec, self.ctx, self.device)
        self._targets: dict[str, Any] = {}  # sleep mode: each built strategy's block pricing, by name
        if self.emulator is not None:
            report(Log(emulation_line(self.me, self.emulator)))
        self.faults = {(f.step, f.point): f for f in options.faults if f.device == self.me}
        self.ranks: dict[int, int] = {}  # device -> rank in the current world
        self.groups: Any = None  # its ProcessGroups

    @property
    def rank(self) -> int:
        return self.ranks[self.me]

    def join(self, prefix: str, ranks: Mapping[int, int], abandoned: Callable[[], bool] | None = None) -> None:
        """Form a world under the store ``prefix`` (fresh per generation), with no subgroups yet.

        ``abandoned``: asked while waiting for the other members; True (the launcher gave this world up: a
        member failed) ends the wait at once with an error instead of after the timeout."""
        import torch.distributed as dist

        from runtime.comm.groups import ProcessGroups

        store = dist.PrefixStore(prefix, self.store)
        # Every member arrives before torch forms the group: a member that died makes this wait fail while
        # torch's global state is untouched (an init_process_group that fails midway leaves its group counter
        # advanced, and the next world's groups would be named unlike the other members').
        # A counter; the last member to arrive sets the one key every member polls.
        if store.add(f"{ARRIVED}/count", 1) == len(ranks):
            store.set(f"{ARRIVED}/all", b"1")
        end = time.monotonic() + self.timeout.total_seconds()
        poll = ARRIVAL_POLL_S
        while not store.check([f"{ARRIVED}/all"]):
            if abandoned is not None and abandoned():
                raise WorldAbandoned(f"world {prefix!r} given up by the launcher while its members gathered")
            if time.monotonic() > end:
                raise TimeoutError(f"world {prefix!r}: not every member arrived within "
                                   f"{self.timeout.total_seconds():g} s")
            time.sleep(poll)
            poll = min(ARRIVAL_POLL_MAX_S, poll * 1.5)
        dist.init_process_group(self.spec.backend, store=store,
                                rank=ranks[self.me], world_size=len(ranks), timeout=self.timeout,
                                device_id=self.device if self.device.type == "cuda" else None)
        self.ranks = dict(ranks)
        self.groups = ProcessGroups([], ranks, timeout=self.timeout, device=self.device)

    def ensure_groups(self, handle: StrategyHandle) -> None:
        """Create the process groups a strategy's programs use (collective over the world)."""
        from runtime.engine.program import DeviceProgram

        self.groups.ensure(DeviceProgram.required_groups(handle))

    def build(self, handle: StrategyHandle) -> Any:
        """This device's program of ``handle`` (collective: every device of the world builds its own)."""
        from runtime.engine.api import WorkerContext
        from runtime.engine.program import DeviceProgram
        from runtime.trace import EmulatedTarget, stage_block_targets

        self.ensure_groups(handle)
        if isinstance(self.emulator, EmulatedTarget):   # sleep mode: this stage's blocks, priced anew per plan
            # A documents run builds every strategy's program up front: each block is priced by the strategy
            # its span names (the engine puts it in the span's args), the latest built where none is named.
            self._targets[handle.name] = latest = stage_block_targets(handle.ctx, handle.name, self.me)
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
        if self.rank == 0:
            self.report(Log(f"loaded {load_dir} (step {done})"))
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
        cuda = self.device.type == "cuda"
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
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
                          lengths=lengths, **self._peaks())

    def _peaks(self) -> dict[str, int]:
        """The CUDA allocator's peaks since the step began (nothing on the CPU)."""
        if self.device.type != "cuda":
            return {}
        import torch

        return {"peak_allocated": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved": torch.cuda.max_memory_reserved(self.device)}

    def finish(self, program: Any, handle: StrategyHandle, step: int,
               save: Callable[[Path, int], None] | None = None, *, sync: bool = True) -> None:
        """Save ``--save`` (when this device holds state; ``save``: how, for a documents run), write the
        traces, leave the world. ``sync``: wait for every device of the world first (needed to merge the
        traces; an elastic run skips it without traces, so that a device idle in the plan that died
        unnoticed cannot fail the end of the run)."""
        import torch.distributed as dist

        save_dir = self.options.save_dir
        if save_dir is not None and (save is not None or program is not None):
            from runtime.checkpoint import save_checkpoint

            if save is not None:
                save(save_dir, step)
            else:
                save_checkpoint(program, self.groups, save_dir, plan=handle.ctx, strategy=handle.name, step=step)
            if self.me == min(handle.devices):
                self.report(Log(f"saved {save_dir} (step {step})"))
        if self.recorder is not None:
            assert self.options.trace_dir is not None
            self.recorder.write(trace_file(self.options.trace_dir, self.me))
        if sync or self.recorder is not None:
            dist.barrier()
        if self.recorder is not None and self.rank == 0:
            _merge_traces(self.options.trace_dir, sorted(self.spec.ranks))
        self.leave()

    def leave(self, *, abandon: bool = False) -> None:
        """Destroy this device's process groups and its world (nothing if it is in none: leaving twice is
        harmless).

        ``abandon``: a step or switch failed (a peer vanished) and the caller has dropped its program. The
        sockets are shut down and the groups aborted first, so that a peer blocked on this device errors at
        once instead of waiting for its op timeout: the abort cascades through the survivors in milliseconds.
        """
        import torch.distributed as dist

        groups, self.groups = self.groups, None
        if abandon and self.spec.backend == "gloo":
            sever_tcp_connections(keep_port=self.store.port)
        if groups is not None:
            if abandon:
                for key in groups.keys:
                    if self.me in key:
                        _abort(groups.get(key))
            groups.destroy()
            del groups
        if dist.is_initialized():
            dist.destroy_process_group()
        if abandon:
            gc.collect()  # the last references to the groups go now: their sockets close


def _hooks(spec: WorkerSpec, plan_ctx: Any, device: Any) -> tuple[Any, Any, Any]:
    from runtime.engine.api import NULL_HOOKS
    from runtime.trace import EmulatedSlowdown, EmulatedTarget, TraceRecorder, stage_block_targets

    options = spec.options
    dev_type = plan_ctx.cluster.type_of(spec.device_id)
    em = dev_type.emulate if device.type == "cpu" else None
    emulate = em is not None and em.slowdown > 1.0
    sleeps = em is not None and em.sleeps
    recorder = None
    if options.trace_dir is not None:
        import torch

        label = f"device {spec.device_id} ({plan_ctx.cluster.device(spec.device_id).type}"
        if sleeps:
            assert em is not None and em.target is not None
            label += f", emulating {em.target.profile} running {em.target.model} x{em.time_scale:g})"
        else:
            label += f", emulated {dev_type.emulate.slowdown:g}x slower)" if emulate else ")"
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        recorder = TraceRecorder(spec.device_id, label, sync=sync)
    emulator: EmulatedSlowdown | EmulatedTarget | None = None
    if sleeps:
        emulator = EmulatedTarget(stage_block_targets(plan_ctx, spec.strategy, spec.device_id), inner=recorder)
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


def sever_tcp_connections(keep_port: int) -> int:
    """shutdown(2) every connected TCP socket of this process except those to ``keep_port`` (the store).

    Gloo cannot abort an op in flight, and after a peer's death it keeps the generation's other
    connections open even when its process groups are destroyed (the failed op pins the context), so
    peers blocked on this worker would wait for their op timeout. Shutting the sockets down is what a
    process exit would do: every pending op here and on the peers fails at once. The file descriptors
    stay gloo's (it closes them when it lets go). Returns how many were shut down.
    """
    import socket

    if not os.path.isdir("/proc/self/fd"):
        return 0  # not Linux: peers blocked on this worker wait for their op timeout instead
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(name))
        except OSError:
            continue
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and sock.getpeername()[1] != keep_port):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass  # listening or not connected
        finally:
            sock.detach()
    return count


def _abort(pg: Any) -> None:
    """Abort a group's communicators where the backend can (NCCL); gloo has nothing to abort."""
    with suppress(AttributeError, RuntimeError, NotImplementedError):
        pg.abort()


def documents_line(source: Any) -> str:
    """What a documents run trains on, with what loading skipped or cut (empty documents are counted)."""
    from runtime.documents import CorpusDocuments

    if isinstance(source, CorpusDocuments):
        c = source.corpus
        return (f"data: {c.path}: {len(c.documents)} documents after cutting ({c.skipped_empty} empty skipped, "
                f"{c.split_documents} split, {c.truncated_documents} truncated), {source.tokens_per_step} tokens "
                f"per step, at most {source.max_len} per document")
    return (f"data: synthetic documents, lengths {source.distribution.name} up to {source.max_len} tokens, "
            f"{source.tokens_per_step} tokens per step")


class DocumentSteps:
    """A documents run on one device: every strategy's program built once at start-up; per step the dispatch
    (runtime/dispatch.py: the strategy, with hysteresis against switching, and each document's pipeline and
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
        from runtime.dispatch import plan_strategy_cost
        from runtime.engine.program import DeviceProgram

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
        self._switches: dict[tuple[int, int], Any] = {}

    def switch_plan(self, src: int, dst: int) -> Any:
        """The staged switch moving every parameter and moment from strategy ``src``'s layout to ``dst``'s."""
        if (src, dst) not in self._switches:
            from runtime.elastic.staging import plan_staged_switch

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
        return done

    def save(self, save_dir: Path, step: int) -> None:
        """Save from the program holding the state (collective over its devices), the dispatch state beside."""
        import json

        from runtime.checkpoint import save_checkpoint
        from runtime.spec.io import atomic_write_text

        handle, program = self.current_handle, self.current_program
        if program is None:
            return
        save_checkpoint(program, self.groups, save_dir, plan=self.ctx, strategy=handle.name, step=step)
        if self.me == min(handle.devices):
            atomic_write_text(Path(save_dir) / DISPATCH_STATE, json.dumps({"strategy": handle.name}) + "\n")

    @property
    def current_handle(self) -> StrategyHandle:
        return self.handles[self.holder]

    @property
    def current_program(self) -> Any:
        return self.programs[self.holder]

    def prepare(self, step: int) -> tuple[Any, Any, LengthsStep]:
        """Dispatch ``step``, switch state when its strategy differs from the previous step's, and return
        the program to run (None: idle here), the packed ``StepBatch`` and what was decided."""
        from runtime.dispatch import dispatch
        from runtime.elastic.move import move_state_staged
        from runtime.engine.microbatch import documents_step_batch

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
