"""Discrete-event simulation of one training step of a strategy, on the costs of ``planner.cost``.

Where the cost model's ``estimate`` prices each pipeline by the list scheduler on its op costs, the
simulator plays the action lists the runtime executes (``StrategyHandle.pipeline_schedule``: the
same ``Schedule`` objects, runtime/torchfree/pipeline_schedules.py) as the engine runs them: every stage is a
resource running its actions in order — its chunks' F, B, W or fused BW ops (TP collectives in F and
B), ``PostSend`` / ``PostRecv`` (never block), ``WaitRecv`` (blocks until that message has arrived) and
a final ``WaitSends``; each pipeline has its own schedule and micro-batch count. A message is a transfer
on its pair of devices' link, in the pair's post order (one stream per pair), and takes ``latency +
bytes / bandwidth`` once both sides have posted it (a rendezvous: measured so on gloo, where a send
waits for its receive; NCCL's send/recv behave so too); a pair's two directions share one queue where
the profile says sends and receives serialise (planner/costmodel/network.py, the rule the cost model prices by too),
else each direction has its own. The measured fixed cost per iteration is added to the step. After its
stage's last action each device joins its gradient-sync groups (a group's all-reduce starts when its
last member joins), then the per-step all-reduce of loss and gradient norm, then its optimizer step, then
(ZeRO-1) the all-gathers of the updated parameter chunks, group by group in the gradient sync's order.
Every device is its own accelerator: an op's length is its price, whatever else runs meanwhile.

The result has the step time, per-stage compute / comm / bubble, the peak number of live chunk
activations each stage reached and its peak memory (``Schedule.peak_activation_memory`` of the lists
played), and a timeline for Chrome-trace / Perfetto.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from planner.cost import GIB, CostModel, StageCost, stage_recompute
from runtime.torchfree.comm.gradsync import SyncGroup
from runtime.torchfree.pipeline_schedules import ChunkCost, Compute, Message, PostRecv, PostSend, WaitRecv, WaitSends
from runtime.torchfree.pipeline_schedules import Schedule as PipelineSchedule
from runtime.torchfree.spec.plan import Schedule, Strategy


@dataclass(frozen=True)
class Event:
    """One interval of the timeline."""

    name: str
    category: str        # forward | backward | p2p | grad_sync | clip | optimizer | zero_gather
    pipeline: int
    stage: int
    lane: str            # 'stage', or 'link k<->j' for a message (its sender's stage k)
    start_s: float
    end_s: float
    micro_batch: int | None = None
    comm_s: float = 0.0  # part of the interval spent in TP collectives


@dataclass(frozen=True)
class StageReport:
    pipeline: int
    stage: int
    devices: tuple[int, ...]
    device_type: str
    tp: int
    layers: tuple[tuple[int, int], ...]  # one [start, stop) per chunk
    micro_batches: int
    compute_s: float
    comm_s: float        # TP collectives + gradient sync + loss/norm all-reduce + ZeRO-1 all-gathers
    p2p_s: float         # its messages' transfers (sent and received; they overlap compute, so bubble counts the waits)
    optimizer_s: float
    bubble_s: float      # step time minus its compute, comm and optimizer: waiting (for messages too)
    peak_in_flight: int  # chunk activations alive at once
    peak_memory_gib: float
    capacity_gib: float

    @property
    def oom(self) -> bool:
        return self.peak_memory_gib > self.capacity_gib

    def to_json(self) -> dict[str, Any]:
        layers = list(self.layers[0]) if len(self.layers) == 1 else [list(r) for r in self.layers]  # as in YAML
        return {**dataclasses.asdict(self), "devices": list(self.devices), "layers": layers,
                "oom": self.oom}


@dataclass(frozen=True)
class SimulationResult:
    strategy: str
    schedule: Schedule
    step_time_s: float
    tokens_per_s: float
    mfu: float
    formula_step_time_s: float      # the cost model's estimate (CostModel.estimate), for comparison
    pipeline_end_s: tuple[float, ...]
    stages: tuple[StageReport, ...]
    peak_memory_gib: dict[int, float]
    oom_devices: tuple[int, ...]
    events: tuple[Event, ...]
    pipeline_schedules: tuple[str, ...] = ()   # the schedule each pipeline ran

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "schedule": self.schedule, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "formula_step_time_s": self.formula_step_time_s, "pipeline_end_s": list(self.pipeline_end_s),
                "stages": [s.to_json() for s in self.stages],
                "peak_memory_gib": {str(d): g for d, g in sorted(self.peak_memory_gib.items())},
                "oom_devices": list(self.oom_devices),
                "pipeline_schedules": list(self.pipeline_schedules)}


class OpKind(Enum):
    """What a simulated op stands for (its timeline category)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    P2P = "p2p"
    STEP = "step"
    GRAD_SYNC = "grad_sync"
    CLIP = "clip"
    OPTIMIZER = "optimizer"
    ZERO_GATHER = "zero_gather"


@dataclass(frozen=True)
class SimOp:
    """One op of the event loop, run by its ``resource`` in the order added (the fields: ``EventLoop``).
    ``duration``: a fixed-length (communication) op; ``deps``: ops that must complete first."""

    name: str
    resource: str
    kind: OpKind | None = None
    pipeline: int = -1
    stage: int = -1
    micro_batch: int | None = None
    duration: float = 0.0
    deps: tuple[str, ...] = ()
    waits: tuple[tuple[str, float], ...] = ()
    compute: float = 0.0   # seconds of the device's own work
    comm: float = 0.0      # then seconds of blocking collectives inside the block (TP)
    message: Message | None = None  # a P2P op: the runtime's message it carries

    @property
    def computes(self) -> bool:
        return self.compute > 0 or self.comm > 0


class EventLoop:
    """Resources run their ops in a fixed order; an op starts when its resource is free and its
    dependencies have completed (time advances event by event).

    * A communication op's end is known once every op it ``waits`` on has started: a transfer of
      ``secs`` completes at ``max(own start, peer start) + secs`` (a rendezvous). A fixed op with
      ``deps`` (a wait for a message) starts once they have completed, its resource blocked meanwhile.
    * A compute op lasts its ``compute`` then its ``comm`` seconds once it starts.
    """

    def __init__(self) -> None:
        self.queue: dict[str, list[str]] = {}
        self.ops: dict[str, SimOp] = {}

    def add(self, op: SimOp) -> None:
        """Append ``op`` to its resource's queue."""
        self.ops[op.name] = op
        self.queue.setdefault(op.resource, []).append(op.name)

    def run(self, copies: Mapping[str, Sequence[str]] | None = None, until: float = math.inf
            ) -> dict[str, tuple[float, float]] | None:
        """(start, end) of every op. ``copies``: op ->
        ops that run exactly as it does (``pipeline_twins``), given its times instead of being played (their
        resources run nothing themselves). ``until``: None as soon as an event lies past it (the last op
        then ends past it too: every event is some op's end, or the start of work that ends later)."""
        run = _Run(self, copies or {})
        return run.run(until)


def pipeline_twins(loop: EventLoop) -> dict[str, list[str]]:
    """Op -> the ops of later pipelines that run at exactly its times: pipelines whose ops are alike (names
    and resources but for the ``p{pi}`` prefix, every other field equal) interact with nothing before the
    step's end, where nothing feeds back into them, so
    the event loop plays the same arithmetic on both. A planned strategy's pipelines of one class are such
    twins: playing one of them is the simulator's saving on large clusters."""
    by_pipe: dict[int, list[list[str]]] = {}
    for names in loop.queue.values():
        by_pipe.setdefault(loop.ops[names[0]].pipeline, []).append(names)
    # Pipelines of one shape (their queues' resources and lengths) may be twins: only those are compared,
    # each by its signature (built once, and only for a shape that more than one pipeline has).
    shapes: dict[tuple, list[int]] = {}
    for pi, queues in by_pipe.items():
        if pi >= 0:
            cut = len(f"p{pi}")
            shapes.setdefault(tuple((loop.ops[q[0]].resource[cut:], len(q)) for q in queues), []).append(pi)
    alike_shape = {pi for group in shapes.values() if len(group) > 1 for pi in group}
    reps: list[tuple[tuple, int]] = []   # (signature, pipeline): one per set of twins
    out: dict[str, list[str]] = {}
    for pi, queues in by_pipe.items():
        if pi not in alike_shape:
            continue
        sig = _signature(loop, queues, pi)
        rep = None if sig is None else next((r for other, r in reps if other == sig), None)
        if rep is None:
            if sig is not None:
                reps.append((sig, pi))
            continue
        for q, mine in zip(by_pipe[rep], queues):
            for x, y in zip(q, mine):
                out.setdefault(x, []).append(y)
    return out


def _signature(loop: EventLoop, queues: list[list[str]], pi: int) -> tuple | None:
    """What two pipelines must share to be twins (``pipeline_twins``), built once per pipeline: per queue,
    each op's name and resource without the ``p{pi}`` prefix, its dependencies' and waits' names so (with
    the waits' offsets) and every other field; None where an op depends on an op of another pipeline (such a
    pipeline has no twin)."""
    cut = len(f"p{pi}")
    ops = loop.ops
    fields = _TWIN_VALUES
    out = []
    for q in queues:
        row = []
        for x in q:
            o = ops[x]
            if o.pipeline != pi:
                return None
            for d in o.deps:
                if ops[d].pipeline != pi:
                    return None
            for d, _ in o.waits:
                if ops[d].pipeline != pi:
                    return None
            row.append((x[cut:], o.resource[cut:], tuple([d[cut:] for d in o.deps]),
                        tuple([(d[cut:], t) for d, t in o.waits]) if o.waits else (), fields(o)))
        out.append(tuple(row))
    return tuple(out)


def stage_resource(pi: int, k: int) -> str:
    """The event loop's resource of pipeline ``pi``'s stage ``k`` (its compute and messages, in order)."""
    return f"p{pi}s{k}"


_TWIN_FIELDS = tuple(f.name for f in dataclasses.fields(SimOp)
                     if f.name not in ("name", "resource", "pipeline", "deps", "waits"))
_TWIN_VALUES = operator.attrgetter(*_TWIN_FIELDS)   # the tuple of an op's _TWIN_FIELDS


class _Run:
    """The state of one ``EventLoop.run``."""

    def __init__(self, loop: EventLoop, copies: Mapping[str, Sequence[str]]) -> None:
        self.ops, self.queue = loop.ops, loop.queue
        self.copies = copies
        self.passive = {self.ops[c].resource for cs in copies.values() for c in cs}   # they run only copies
        if self.passive and any(self.ops[w].resource in self.passive for o in self.ops.values()
                                if o.waits and o.resource not in self.passive for w, _ in o.waits):
            # An op outside waits for a copy's start, which a copy has only once its original ends: play all.
            self.copies, self.passive = {}, set()
        self.head = {r: 0 for r in self.queue}
        self.busy: dict[str, str | None] = {r: None for r in self.queue}
        self.starts: dict[str, float] = {}
        self.times: dict[str, tuple[float, float]] = {}
        self.heap: list[tuple[float, int, str]] = []
        self.watchers: dict[str, set[str]] = {}     # op -> resources to wake when it starts or completes
        self.unstarted: dict[str, int] = {}         # op -> how many of the ops it waits on have not started
        self.undone: dict[str, int] = {}            # op -> how many of its dependencies have not completed
        self.needed_by: dict[str, list[str]] = {}   # op -> the ops that depend on it (once per dependency)
        self.waited_by: dict[str, list[str]] = {}   # op -> the ops that wait on it (once per wait)
        # Copies that ops outside the twins' pipelines depend on or wait for (the stages' last actions).
        self.awaited: set[str] = set()
        for op in self.ops.values():
            if op.resource in self.passive:   # a copy: it never starts or waits by itself
                continue
            for w in (*op.deps, *(w for w, _ in op.waits)):
                self.watchers.setdefault(w, set()).add(op.resource)
                if self.ops[w].resource in self.passive:
                    self.awaited.add(w)
            if op.deps:
                self.undone[op.name] = len(op.deps)
                for dep in op.deps:
                    self.needed_by.setdefault(dep, []).append(op.name)
            if op.waits:
                self.unstarted[op.name] = len(op.waits)
                for w, _ in op.waits:
                    self.waited_by.setdefault(w, []).append(op.name)
        self.now = 0.0
        self.seq = 0

    def run(self, until: float = math.inf) -> dict[str, tuple[float, float]] | None:
        for r in self.queue:
            self.advance(r)
        while self.heap:
            self.now = self.heap[0][0]
            if self.now > until:
                return None
            self.complete(heapq.heappop(self.heap)[2])
        missing = [op for op in self.ops if op not in self.times]
        if missing:  # a cycle: a bug in the schedule construction, not a user error
            raise RuntimeError(f"simulation deadlocked; unscheduled ops: {missing[:5]}")
        return self.times

    def complete(self, name: str) -> None:
        op = self.ops[name]
        for later in self.needed_by.get(name, ()):
            self.undone[later] -= 1
        r = op.resource
        self.busy[r] = None
        self.advance(r)
        for wr in self.watchers.get(name, ()):
            self.advance(wr)

    def advance(self, r: str) -> None:
        """Start resource ``r``'s next op if it is free and the op's dependencies are done."""
        if r in self.passive:
            return
        name = self.busy[r]
        if name is not None:
            if name not in self.times and not self.ops[name].computes:
                self.try_end(name)
            return
        if self.head[r] >= len(self.queue[r]):
            return
        name = self.queue[r][self.head[r]]
        op = self.ops[name]
        if self.undone.get(name, 0) > 0:   # (counted down as they complete)
            return
        self.head[r] += 1
        self.busy[r] = name
        self.starts[name] = self.now
        for waiter in self.waited_by.get(name, ()):
            self.unstarted[waiter] -= 1
        if op.computes:
            self.finish_at(name, self.now + op.compute + op.comm)
        else:
            self.try_end(name)
        for wr in self.watchers.get(name, ()):
            if wr != r:
                self.advance(wr)

    def finish_at(self, name: str, end: float) -> None:
        self.times[name] = (self.starts[name], end)
        self.seq += 1
        heapq.heappush(self.heap, (end, self.seq, name))
        for c in self.copies.get(name, ()):
            self.starts[c] = self.starts[name]
            self.times[c] = (self.starts[c], end)
            if c in self.awaited:   # the step's end waits on it: it completes then
                self.seq += 1
                heapq.heappush(self.heap, (end, self.seq, c))

    def try_end(self, name: str) -> bool:
        """End a started communication / fixed op once the ops it waits on have started."""
        op = self.ops[name]
        if self.unstarted.get(name, 0) > 0:   # (counted down as they start: collectives wait on many)
            return False
        start = self.starts[name]
        end = start + op.duration
        for w, secs in op.waits:
            end = max(end, max(start, self.starts[w]) + secs)
        self.finish_at(name, end)
        return True


def simulate(cm: CostModel, strategy: Strategy, global_batch: int, schedule: Schedule = "1f1b",
             zero: bool = False) -> SimulationResult:
    """Simulate one step of ``strategy`` with the costs of ``cm``; each pipeline runs its own schedule
    (``Pipeline.schedule``), else ``schedule``."""
    names = tuple(p.schedule if p.schedule is not None else schedule for p in strategy.pipelines)
    sim, costs, schedules, last_action, tp_s, labels, sync, times, step = _played(cm, strategy, schedule, zero)
    events, reports, memory = _reports(sim, times, costs, schedules, tp_s, labels, sync, zero, step)
    est = cm.estimate(strategy, global_batch, schedule, zero)
    return SimulationResult(
        strategy=strategy.name, schedule=schedule, step_time_s=step,
        tokens_per_s=global_batch * cm.seq_len / step if step > 0 else 0.0,
        mfu=cm.mfu(step, global_batch, strategy.devices), formula_step_time_s=est.step_time_s,
        pipeline_end_s=tuple(max(times[last_action[pi, k]][1] for k in range(len(p.stages)))
                             for pi, p in enumerate(strategy.pipelines)),
        stages=tuple(reports), peak_memory_gib=memory,
        oom_devices=tuple(sorted(d for d, g in memory.items() if g > cm.cluster.type_of(d).memory_gib)),
        events=tuple(sorted(events, key=lambda e: (e.start_s, e.pipeline, e.stage))),
        pipeline_schedules=names)


def simulated_step_time(cm: CostModel, strategy: Strategy, schedule: Schedule = "1f1b", zero: bool = False,
                        cutoff: float = math.inf) -> float:
    """``simulate(...).step_time_s`` without the per-stage reports, events and memory: what a caller ranking
    plans by the simulated step (``planner.api.simulator_check``) reads, played the same way. ``cutoff``: inf
    as soon as the step is sure to take longer (a caller that keeps only a plan beating it stops early)."""
    return _played(cm, strategy, schedule, zero, cutoff)[-1]


def _played(cm: CostModel, strategy: Strategy, schedule: Schedule, zero: bool, cutoff: float = math.inf) -> tuple:
    """The event loop of one step played: (loop, costs, schedules, each stage's last op, TP seconds, labels,
    the sync plan, every op's times, the step time; inf, with no times, once the step is sure to pass
    ``cutoff``)."""
    # The runtime's lists (StrategyHandle.pipeline_schedule), through the cost model's cache of them.
    schedules = tuple(cm.runtime_schedule(strategy, pi, schedule) for pi in range(len(strategy.pipelines)))
    costs = _Costs.of(cm, strategy)
    sim = EventLoop()
    opt_times = cm.optimizer_times(strategy, zero)
    last_action, tp_s, labels = _add_schedules(sim, costs, schedules)
    twins = pipeline_twins(sim)   # before the step's end joins the pipelines
    sync = cm.sync_plan(strategy)
    _add_step_end(sim, costs, last_action, sync, zero, opt_times)
    # The measured fixed cost per iteration (launches, synchronisation, logging) comes on top.
    fixed = cm.iteration_time(strategy)
    # (a margin far above rounding: a step cut off is longer than ``cutoff`` for sure, not by an ulp)
    times = sim.run(twins, cutoff - fixed + 1e-9 * max(1.0, abs(cutoff)))
    if times is None:   # an op ends past that, so the step passes cutoff
        return sim, costs, schedules, last_action, tp_s, labels, sync, None, math.inf
    step = max(end for _, end in times.values()) + fixed
    return sim, costs, schedules, last_action, tp_s, labels, sync, times, step


@dataclass(frozen=True)
class _Costs:
    """What the simulator reads from the cost model for one strategy, looked up once."""

    cm: CostModel
    strategy: Strategy
    type_of: dict[int, str]
    chunks: dict[tuple[int, int, int], tuple[StageCost, ChunkCost]]  # (pipeline, stage, chunk) -> its costs
    stage_of: dict[int, tuple[int, int]]  # device -> (pipeline, stage)

    @classmethod
    def of(cls, cm: CostModel, strategy: Strategy) -> _Costs:
        type_of = {d.id: d.type for d in cm.cluster.devices}
        chunks = {}
        for pi, pipe in enumerate(strategy.pipelines):
            for k, st in enumerate(pipe.stages):
                for c in range(st.chunks):
                    chunks[pi, k, c] = cm.stage_chunk(st, c)
        stage_of = {d: (pi, k) for pi, p in enumerate(strategy.pipelines) for k, st in enumerate(p.stages)
                    for d in st.devices}
        return cls(cm, strategy, type_of, chunks, stage_of)

    def op_parts(self, pi: int, k: int, op: Compute) -> tuple[float, float]:
        """(seconds, TP collective seconds) of a compute op, as the cost model prices its chunk: F and the
        fused BW as ``stage``, B and W as ``chunk_cost`` splits the backward (the TP collectives are B's)."""
        sc, cc = self.chunks[pi, k, op.chunk]
        if op.kind == "F":
            return sc.forward_s, sc.tp_forward_s
        if op.kind == "W":
            return cc.weight_grad, 0.0
        return (sc.backward_s if op.kind == "BW" else cc.input_grad), sc.tp_backward_s

    def device_op(self, name: str, device: int, kind: OpKind, **fields: Any) -> SimOp:
        """An op of one device's own resource after its stage's schedule."""
        pi, k = self.stage_of[device]
        return SimOp(name, f"dev{device}", kind, pi, k, **fields)


def _add_schedules(sim: EventLoop, costs: _Costs, schedules: Sequence[PipelineSchedule]
                   ) -> tuple[dict[tuple[int, int], str], dict[str, float], dict[str, str]]:
    """Every stage's action list as the runtime executes it: compute ops; posts that never block; each
    message a transfer on its pair's link (one queue per pair, in the pair's post order, which both
    sides share) once both sides have posted it; a ``WaitRecv`` blocks its stage until its message has
    arrived, the final ``WaitSends`` until its sends have. Returns each stage's last op, and each compute
    op's TP collective seconds and timeline label."""
    cm = costs.cm
    last: dict[tuple[int, int], str] = {}
    tp_s: dict[str, float] = {}
    labels: dict[str, str] = {}
    for pi, (pipe, sched) in enumerate(zip(costs.strategy.pipelines, schedules)):
        # Each message's transfer op name, and per (stage, transfer) the name of the stage's post of it.
        names: dict[Message, str] = {}
        posted: dict[tuple[int, str], str] = {}
        for k, acts in enumerate(sched.actions):
            for ai, a in enumerate(acts):
                if isinstance(a, (PostSend, PostRecv)):
                    msg = a.message
                    name = names.get(msg)
                    if name is None:
                        name = names[msg] = f"p{pi}m{msg.kind[0]}{msg.micro_batch}s{msg.src_stage}"
                    posted[k, name] = f"p{pi}s{k}a{ai}"

        # Per direction of a stage pair: its transfer time and its link (one queue per pair where sends and
        # receives serialise, else one per direction).
        pairs: dict[tuple[int, int], tuple[float, str]] = {}
        for k, acts in enumerate(sched.actions):   # the links, each pair's queue from its first device's list
            for a in acts:
                if isinstance(a, (PostSend, PostRecv)) and k == min(a.message.src, a.message.dst):
                    msg = a.message
                    pair = pairs.get((msg.src, msg.dst))
                    if pair is None:
                        src, dst = pipe.stages[msg.src].devices, pipe.stages[msg.dst].devices
                        pair = pairs[msg.src, msg.dst] = (
                            cm.p2p_time(src, dst), f"p{pi}link{k}-{max(msg.src, msg.dst)}"
                            if cm.serialises(src + dst) else f"p{pi}link{msg.src}>{msg.dst}")
                    name = names[msg]
                    sim.add(SimOp(name, pair[1], OpKind.P2P, pi, msg.src, msg.micro_batch, duration=pair[0],
                                  deps=(posted[msg.src, name], posted[msg.dst, name]), message=msg))
        for k, acts in enumerate(sched.actions):
            st, res = pipe.stages[k], stage_resource(pi, k)
            sent: list[str] = []
            for ai, a in enumerate(acts):
                name = f"{res}a{ai}"
                if isinstance(a, Compute):
                    total, tp = costs.op_parts(pi, k, a)
                    name = f"{res}{a.kind}{a.micro_batch}c{a.chunk}"
                    tp_s[name] = tp
                    # 'F3', 'B3' (the whole backward, or its input-gradient half), 'W3'; '/1' for chunk 1
                    labels[name] = (f"{a.kind[0]}{a.micro_batch}" + (f"/{a.chunk}" if len(st.layers) > 1 else ""))
                    kind = OpKind.FORWARD if a.kind == "F" else OpKind.BACKWARD
                    sim.add(SimOp(name, res, kind, pi, k, a.micro_batch, compute=total - tp, comm=tp))
                elif isinstance(a, (PostSend, PostRecv)):
                    sim.add(SimOp(name, res, None, pi, k, a.message.micro_batch))
                    if isinstance(a, PostSend):
                        sent.append(names[a.message])
                else:
                    deps = (names[a.message],) if isinstance(a, WaitRecv) else tuple(sent)
                    assert isinstance(a, (WaitRecv, WaitSends))
                    sim.add(SimOp(name, res, None, pi, k, deps=deps))
            last[pi, k] = name
    return last, tp_s, labels


def _add_step_end(sim: EventLoop, costs: _Costs, last_action: dict[tuple[int, int], str],
                  sync: Sequence[SyncGroup], zero: bool, opt_times: Mapping[int, float]) -> None:
    """After its stage's last action each device runs the step's own code (gradients collected, norm
    summed), joins its gradient-sync groups in the global order (a group's
    all-reduce completes when its last member has joined), then the step's loss / grad-norm all-reduce
    over every device, then its optimizer step, then (ZeRO-1) the all-gathers of the updated parameter
    chunks in every sync group it belongs to, in the same order (runtime/torchfree/engine/zero.py)."""
    cm, devices = costs.cm, costs.strategy.devices
    last_of = {d: last_action[costs.stage_of[d]] for d in devices}
    overhead = cm.step_overhead_times(costs.strategy)
    for d in devices:
        if overhead[d] > 0:
            sim.add(costs.device_op(f"over{d}", d, OpKind.STEP, deps=(last_of[d],), compute=overhead[d]))
            last_of[d] = f"over{d}"

    def collectives(prefix: str, kind: OpKind, groups: Sequence[SyncGroup], seconds: Sequence[float]) -> None:
        """One collective per sync group, in the runtime's global group order: each member joins after
        its previous op, and the group's op ends once its last member has joined (a rendezvous)."""
        for gi, (g, secs) in enumerate(zip(groups, seconds)):
            for d in g.devices:
                sim.add(costs.device_op(f"{prefix}{gi}d{d}", d, kind, duration=secs, deps=(last_of[d],),
                                        waits=tuple((f"{prefix}{gi}d{e}", secs) for e in g.devices if e != d)))
                last_of[d] = f"{prefix}{gi}d{d}"

    collectives("g", OpKind.GRAD_SYNC, sync, cm.sync_times(costs.strategy))
    loads = cm.load_sync_plan(costs.strategy)   # a MoE model's expert loads, after the gradients
    collectives("r", OpKind.GRAD_SYNC, loads, [cm.load_group_time(g) for g in loads])
    sim.add(SimOp("stats", "world", OpKind.CLIP, duration=cm.clip_time(devices),
                  deps=tuple(sorted(set(last_of.values())))))
    for d in devices:
        sim.add(costs.device_op(f"opt{d}", d, OpKind.OPTIMIZER, deps=("stats",), compute=opt_times[d]))
        last_of[d] = f"opt{d}"
    if zero:
        collectives("z", OpKind.ZERO_GATHER, sync, [cm.zero_gather_time(g) for g in sync])


def _reports(sim: EventLoop, times: dict[str, tuple[float, float]], costs: _Costs,
             schedules: Sequence[PipelineSchedule], tp_s: dict[str, float], labels: dict[str, str],
             sync: Sequence[SyncGroup], zero: bool, step: float
             ) -> tuple[list[Event], list[StageReport], dict[int, float]]:
    """The timeline, each stage's report and each device's peak memory."""
    events: list[Event] = []
    p2p_busy: dict[tuple[int, int], float] = {}
    fb_wall: dict[tuple[int, int], float] = {}
    tp_busy: dict[tuple[int, int], float] = {}
    for name, (start, end) in times.items():
        op = sim.ops[name]
        key = (op.pipeline, op.stage)
        if op.kind is OpKind.P2P and op.message is not None:
            msg = op.message
            for k in (msg.src, msg.dst):
                p2p_busy[op.pipeline, k] = p2p_busy.get((op.pipeline, k), 0.0) + op.duration
            events.append(Event(f"{msg.kind} {msg.micro_batch} (stage {msg.src_stage}->{msg.dst_stage})", "p2p",
                                op.pipeline, msg.src, f"link {msg.src}->{msg.dst}", start, end, op.micro_batch,
                                op.duration))
        elif op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
            fb_wall[key] = fb_wall.get(key, 0.0) + end - start
            tp_busy[key] = tp_busy.get(key, 0.0) + tp_s[name]
            label = labels[name]
            events.append(Event(label, op.kind.value, op.pipeline, op.stage, "stage", start, end, op.micro_batch,
                                tp_s[name]))
    stats0, stats1 = times["stats"]
    cm, pipes = costs.cm, costs.strategy.pipelines
    n_layers = cm.model.num_layers
    memory: dict[int, float] = {}
    reports = []

    def joined(prefix: str, groups: Sequence[SyncGroup], device: int, label: str, category: str,
               pi: int, k: int) -> float:
        """The device's collectives of ``groups`` as one event; returns their own (busy) seconds."""
        mine = [f"{prefix}{gi}d{device}" for gi, g in enumerate(groups) if device in g.devices]
        busy = sum(sim.ops[n].duration for n in mine)
        if mine:
            events.append(Event(label, category, pi, k, "stage", times[mine[0]][0], times[mine[-1]][1], None, busy))
        return busy

    for pi, (pipe, sched) in enumerate(zip(pipes, schedules)):
        # Activation bytes of one micro-batch per (stage, chunk): the lists' own peak, in the order played.
        sizes = [[cm.chunk_activation_bytes(costs.type_of[st.devices[0]], st.tp, b - a, a == 0, st.recompute,
                                            st.chunk_recompute(c))
                  for c, (a, b) in enumerate(st.layers)] for st in pipe.stages]
        peak_bytes = sched.peak_activation_memory(sizes)
        peak_count = sched.peak_activation_memory([[1.0] * len(row) for row in sizes])
        for k, st in enumerate(pipe.stages):
            d0 = st.devices[0]
            sync_busy = joined("g", sync, d0, "grad sync", "grad_sync", pi, k)
            if stats1 > stats0:
                events.append(Event("loss/norm all-reduce", "clip", pi, k, "stage", stats0, stats1, None,
                                    stats1 - stats0))
            slowest = max(st.devices, key=lambda d: times[f"opt{d}"][1])
            o0, o1 = times[f"opt{slowest}"]
            events.append(Event("optimizer", "optimizer", pi, k, "stage", o0, o1))
            gather_busy = joined("z", sync if zero else (), d0, "ZeRO-1 param all-gather", "zero_gather", pi, k)
            device_type = costs.type_of[d0]
            chunks = tuple((b - a, a == 0, b == n_layers) for a, b in st.layers)
            static = cm.device_memory(device_type, st.tp, chunks, st.recompute, 0, len(pipes) if zero else 1,
                                      stage_recompute(st))
            gib = (static.total + peak_bytes[k]) / GIB
            memory.update(dict.fromkeys(st.devices, gib))
            compute = fb_wall.get((pi, k), 0.0) - tp_busy.get((pi, k), 0.0)
            comm = tp_busy.get((pi, k), 0.0) + sync_busy + (stats1 - stats0) + gather_busy
            reports.append(StageReport(
                pipeline=pi, stage=k, devices=st.devices, device_type=device_type, tp=st.tp, layers=st.layers,
                micro_batches=pipe.micro_batches, compute_s=compute, comm_s=comm, p2p_s=p2p_busy.get((pi, k), 0.0),
                optimizer_s=o1 - o0, bubble_s=max(0.0, step - compute - comm - (o1 - o0)),
                peak_in_flight=round(peak_count[k]), peak_memory_gib=gib,
                capacity_gib=cm.cluster.type_of(d0).memory_gib))
    return events, reports, memory


def chrome_trace(result: SimulationResult, strategy: Strategy) -> dict[str, Any]:
    """Chrome trace-event JSON (open in Perfetto / chrome://tracing): a process per pipeline, a thread
    per stage and per link direction; times in microseconds."""
    out: list[dict[str, Any]] = []
    tids: dict[tuple[int, str, int], int] = {}
    for pi, pipe in enumerate(strategy.pipelines):
        out.append({"ph": "M", "name": "process_name", "pid": pi,
                    "args": {"name": f"pipeline {pi} ({pipe.micro_batches} micro-batches)"}})
    for e in result.events:
        key = (e.pipeline, e.lane, e.stage)
        if key not in tids:
            tid = len(tids)
            tids[key] = tid
            st = strategy.pipelines[e.pipeline].stages[e.stage]
            label = (f"stage {e.stage}: devices {','.join(map(str, st.devices))} layers "
                     + ", ".join(f"{a}-{b - 1}" for a, b in st.layers) if e.lane == "stage"
                     else f"stage {e.stage} {e.lane}")
            out.append({"ph": "M", "name": "thread_name", "pid": e.pipeline, "tid": tid, "args": {"name": label}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": e.pipeline, "tid": tid,
                        "args": {"sort_index": e.stage * 3 + (0 if e.lane == "stage" else 1)}})
        args: dict[str, Any] = {"comm_ms": round(e.comm_s * 1e3, 4)}
        if e.micro_batch is not None:
            args["micro_batch"] = e.micro_batch
        out.append({"ph": "X", "name": e.name, "cat": e.category, "pid": e.pipeline, "tid": tids[key],
                    "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"strategy": result.strategy, "schedule": result.schedule,
                          "step_time_s": result.step_time_s}}
