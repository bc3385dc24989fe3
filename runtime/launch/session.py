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
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from runtime.errors import HspmdError
from runtime.launch.messages import FaultFiring, Log
from runtime.launch.options import Fault, StepReport, WorkerSpec
from runtime.spec.handle import StrategyHandle

TRACE_MERGED = "trace.json"


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
            torch.cuda.set_device(self.device)
        self.timeout = timedelta(seconds=options.timeout_s)
        t = self.ctx.plan.training
        self.source = token_source(vocab_size=self.ctx.model.vocab_size, global_batch=t.global_batch,
                                   seq_len=t.seq_len, seed=t.seed, data_file=options.data_file)
        self.hooks, self.recorder, self.emulator = _hooks(spec, self.ctx, self.device)
        if self.emulator is not None:
            report(Log(emulation_line(self.me, self.emulator)))
        self.faults = {f.step: f for f in options.faults if f.device == self.me}
        self.ranks: dict[int, int] = {}  # device -> rank in the current world
        self.groups: Any = None  # its ProcessGroups

    @property
    def rank(self) -> int:
        return self.ranks[self.me]

    def join(self, prefix: str, ranks: Mapping[int, int]) -> None:
        """Form a world under the store ``prefix`` (fresh per generation), with no subgroups yet."""
        import torch.distributed as dist

        from runtime.comm.groups import ProcessGroups

        dist.init_process_group(self.spec.backend, store=dist.PrefixStore(prefix, self.store),
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
            self.emulator.target_s = stage_block_targets(handle.ctx, handle.name, self.me)
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

    def fire_fault(self, step: int) -> None:
        """An injected fault due at the start of ``step`` (once: a step redone after a failure runs clean)."""
        fault = self.faults.pop(step, None)
        if fault is not None:
            self.report(FaultFiring(fault.kind, time.time()))
            inject(fault)

    def step(self, program: Any, step: int, before_update: Callable[[], None] | None = None) -> StepReport:
        """Run ``step`` (the exceptions of a failed step pass through)."""
        batch = self.source.batch(step)
        with self.recorder.span("step", f"step {step}") if self.recorder is not None else nullcontext():
            t0 = time.perf_counter()
            stats = program.train_step(batch, before_update=before_update)
            wall = time.perf_counter() - t0
        return StepReport(step=step, rank=self.rank, device=self.me, loss=float(stats.loss),
                          grad_norm=float(stats.grad_norm), tokens=int(stats.tokens), wall_s=wall,
                          compute_s=float(stats.compute_s), comm_s=float(stats.comm_s),
                          emulation_s=self.emulator.take_emulated_s() if self.emulator is not None else 0.0,
                          emulation_overrun_s=self.emulator.take_overrun_s() if self.emulator is not None else 0.0)

    def finish(self, program: Any, handle: StrategyHandle, step: int, *, sync: bool = True) -> None:
        """Save ``--save`` (when this device holds state), write the traces, leave the world. ``sync``: wait
        for every device of the world first (needed to merge the traces; an elastic run skips it without
        traces, so that a device idle in the plan that died unnoticed cannot fail the end of the run)."""
        import torch.distributed as dist

        save_dir = self.options.save_dir
        if program is not None and save_dir is not None:
            from runtime.checkpoint import save_checkpoint

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
    try:
        pg.abort()
    except (AttributeError, RuntimeError, NotImplementedError):
        pass
