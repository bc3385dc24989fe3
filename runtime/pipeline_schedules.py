"""Pipeline schedules from one mechanism: a list scheduler over virtual stages (torch-free).

Why one mechanism: 1F1B, GPipe, interleaved 1F1B, ZB-H1 and ZB-V differ only in where the model chunks
sit (placement), whether the backward is split into its input-gradient half B and weight-gradient half
W, how many activations a device may hold, and which ready op a device prefers. Expressing each of
them as a policy for one event-driven list scheduler means the executor, ``hspmd show``, the
simulator and the cost model all read the same data, and a heterogeneous pipeline (stages of
different speeds, uneven chunks) is scheduled with its real op durations instead of a unit-time
template. The policies, layouts and memory bounds are in ``runtime.schedule_policies``. Each schedule's
published order (``runtime.canonical_schedules``) is played beside the list scheduler's with the same
durations, and the faster of the two is the order every consumer gets (``_list_run``), so no schedule
is slower than its textbook order.

Vocabulary. A pipeline has ``S`` devices; each holds ``v`` chunks, so there are ``S*v`` virtual
stages ``j``. Placement ``"loop"``: virtual stage ``j`` is chunk ``j // S`` of device ``j % S``
(interleaved 1F1B). Placement ``"v"`` (``v == 2``): device ``j`` for ``j < S`` and ``2S-1-j`` after,
so the first and the last virtual stage share device 0 (the V shape of ZB-V). Ops per (micro-batch,
virtual stage): ``F``; then either ``BW`` (the whole backward) or ``B`` followed by ``W``.

Memory. "Live activations" counts (micro-batch, chunk) activations a device holds: one is born at its
``F`` and dies at its ``BW``, or at its ``W`` when the backward is split (W still reads the saved
inputs). ``live_activation_limit`` is the documented bound, and the scheduler enforces exactly that
bound, so the memory the cost model charges and the memory the schedule uses cannot drift apart.

Communication. Messages are derived from the compute order (``derive_actions``): a ``PostSend`` right
after the producing op, a ``PostRecv`` at the simulated moment the peer sends, a ``WaitRecv`` right
before the consuming op, and a final ``WaitSends``. Every pair of devices posts its messages, in both
directions, in one order on both sides (the simulated send time), so in-order matching without tags
(NCCL) and per-pair serialization (one NCCL stream per pair) are both safe; docs/schedules.md has the
deadlock-freedom argument, and ``check_schedule`` verifies it on the action lists themselves.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.canonical_schedules import canonical_labels, canonical_orders, play_static
from runtime.schedule_policies import (
    POLICIES,
    Layout,
    OpKind,
    Policy,
    ScheduleName,
    device_limits,
    schedule_layout,
    schedule_problems,
)
from runtime.schedule_sync import with_host_syncs

MessageKind = Literal["activation", "gradient"]
# What an order came from when it is the list scheduler's (else a ``canonical_labels`` line).
ORDER_LIST = "the list scheduler's order"
# Which order ``schedule_timeline`` gives: the one every consumer runs, or one of its two candidates.
Source = Literal["best", "list", "textbook"]


# ---------------------------------------------------------------------------------------------------
# Shapes and costs


@dataclass(frozen=True)
class ChunkCost:
    """Durations of one chunk's ops for one micro-batch (any unit: the schedule only compares them).

    ``full_backward`` is the fused backward when it is not just B + W (e.g. measured separately)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0
    full_backward: float | None = None

    def __post_init__(self) -> None:
        # Strictly positive: an op that ends when it starts would let a send tie with its own producer
        # in the action-list order (the deadlock argument relies on time moving forward).
        for name in ("forward", "input_grad", "weight_grad", "full_backward"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: op durations must be positive, got {v}")

    def of(self, kind: OpKind) -> float:
        if kind == "F":
            return self.forward
        if kind == "B":
            return self.input_grad
        if kind == "W":
            return self.weight_grad
        return self.full_backward if self.full_backward is not None else self.input_grad + self.weight_grad


UNIT_COST = ChunkCost()


@dataclass(frozen=True)
class Costs:
    """Per-(device, chunk) op durations and per-boundary transfer times.

    ``chunks[d][c]`` is device ``d``'s chunk ``c`` (empty: unit costs everywhere); ``boundary[j]`` is
    the time of a message between virtual stages ``j`` and ``j + 1`` in either direction (empty: 0;
    ignored where both sit on one device)."""

    chunks: tuple[tuple[ChunkCost, ...], ...] = ()
    boundary: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for j, t in enumerate(self.boundary):
            if t < 0:
                raise ValueError(f"boundary[{j}]: transfer time must be >= 0, got {t}")

    @staticmethod
    def uniform(layout: Layout, cost: ChunkCost = UNIT_COST, transfer: float = 0.0) -> Costs:
        return Costs(tuple((cost,) * layout.chunks for _ in range(layout.num_devices)),
                     (transfer,) * max(layout.num_stages - 1, 0))

    def problems(self, layout: Layout) -> list[str]:
        """Shape mismatches against ``layout``, one line each (empty when the costs fit)."""
        out = []
        if self.chunks:
            if len(self.chunks) != layout.num_devices:
                out.append(f"costs.chunks: {len(self.chunks)} devices, the pipeline has {layout.num_devices}")
            for d, row in enumerate(self.chunks):
                if len(row) != layout.chunks:
                    out.append(f"costs.chunks[{d}]: {len(row)} chunks, the schedule has {layout.chunks}")
        if self.boundary and len(self.boundary) != layout.num_stages - 1:
            out.append(f"costs.boundary: {len(self.boundary)} boundaries, {layout.num_stages} virtual stages "
                       f"have {layout.num_stages - 1}")
        return out

    def chunk(self, device: int, chunk: int) -> ChunkCost:
        return self.chunks[device][chunk] if self.chunks else UNIT_COST

    def transfer(self, stage: int) -> float:
        """Message time between virtual stages ``stage`` and ``stage + 1``."""
        return self.boundary[stage] if self.boundary else 0.0


# ---------------------------------------------------------------------------------------------------
# Actions (the data every consumer reads)


@dataclass(frozen=True)
class Compute:
    """One op of one micro-batch on one virtual stage (``chunk``: its local chunk on the device)."""

    kind: OpKind
    micro_batch: int
    stage: int
    chunk: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W", "BW"):
            raise ValueError(f"kind: unknown op {self.kind!r} (have: F, B, W, BW)")
        if min(self.micro_batch, self.stage, self.chunk) < 0:
            raise ValueError(f"micro_batch, stage, chunk: must be >= 0, got {self}")

    def __str__(self) -> str:
        return f"{self.kind}(mb {self.micro_batch}, stage {self.stage})"


@dataclass(frozen=True)
class Message:
    """A boundary tensor between two devices: an activation going forward (stage j -> j+1) or its
    gradient coming back (j+1 -> j). Identified by its content, since NCCL matching ignores tags."""

    kind: MessageKind
    micro_batch: int
    src_stage: int
    dst_stage: int
    src: int
    dst: int

    def __post_init__(self) -> None:
        step = {"activation": 1, "gradient": -1}.get(self.kind)
        if step is None:
            raise ValueError(f"kind: unknown message {self.kind!r} (have: activation, gradient)")
        if self.dst_stage != self.src_stage + step or min(self.src_stage, self.dst_stage, self.micro_batch) < 0:
            raise ValueError(f"src_stage, dst_stage: an {self.kind} goes from stage j to j{step:+d}, "
                             f"got {self.src_stage} -> {self.dst_stage}")
        if self.src == self.dst:
            raise ValueError(f"src, dst: a message crosses devices, got {self.src} -> {self.dst}")

    def __str__(self) -> str:
        return (f"{self.kind}(mb {self.micro_batch}, stage {self.src_stage}->{self.dst_stage}, "
                f"dev {self.src}->{self.dst})")


@dataclass(frozen=True)
class PostSend:
    """Start a non-blocking send of ``message`` (its producing op has run)."""

    message: Message


@dataclass(frozen=True)
class PostRecv:
    """Start a non-blocking receive of ``message`` into a fresh buffer."""

    message: Message


@dataclass(frozen=True)
class WaitRecv:
    """Block until ``message`` has arrived (right before the op that reads it)."""

    message: Message


@dataclass(frozen=True)
class WaitSends:
    """Block until every send this device posted has completed (the step's last action)."""


Action = Compute | PostSend | PostRecv | WaitRecv | WaitSends


# One ``Compute`` per op, shared by the timelines that run it (they are immutable): the planner builds
# thousands of timelines of the same ops, and validating each op anew was a tenth of the list scheduler's time.
_compute = functools.lru_cache(maxsize=1 << 18)(Compute)


@dataclass(frozen=True)
class TimedOp:
    op: Compute
    start: float
    end: float


@dataclass(frozen=True)
class Schedule:
    """A generated schedule: per device its simulated compute timeline and its action list."""

    name: ScheduleName
    layout: Layout
    micro_batches: int
    costs: Costs
    timeline: tuple[tuple[TimedOp, ...], ...]  # [device], in execution order
    actions: tuple[tuple[Action, ...], ...]  # [device]
    # Per device the activation bound the lists were built under, where it was raised above the
    # schedule's own (``build_schedule``'s ``limits``); None: ``live_activation_limit`` everywhere.
    limits: tuple[int, ...] | None = None
    # Which order this is: ``ORDER_LIST`` or the published one that was faster (``canonical_labels``).
    origin: str = ORDER_LIST

    @property
    def split_backward(self) -> bool:
        return POLICIES[self.name].split_backward

    @property
    def makespan(self) -> float:
        """Simulated step time of the pipeline part (first op start to last op end)."""
        return max((t[-1].end for t in self.timeline if t), default=0.0)

    def order(self, device: int) -> tuple[Compute, ...]:
        return tuple(t.op for t in self.timeline[device])

    def idle(self, device: int) -> float:
        """The device's bubble: makespan minus its busy time."""
        return self.makespan - sum(t.end - t.start for t in self.timeline[device])

    def activation_limits(self) -> tuple[int, ...]:
        """Per device the bound this schedule was built under: ``live_activation_limit``, or the raised
        ``limits`` it was built with."""
        return device_limits(self.name, self.layout.num_devices, self.micro_batches, self.layout.chunks,
                             self.limits)

    def peak_activation_memory(self, sizes: Sequence[Sequence[float]]) -> tuple[float, ...]:
        """Per device, the most activation memory held at once, ``sizes[d][c]`` being one micro-batch's
        activation of chunk ``c`` on device ``d``: with uneven chunks the peak count alone does not
        say which chunks are live at the peak."""
        frees = "W" if self.split_backward else "BW"
        out = []
        for d, ops in enumerate(self.timeline):
            live = peak = 0.0
            for t in ops:
                if t.op.kind == "F":
                    live += sizes[d][t.op.chunk]
                    peak = max(peak, live)
                elif t.op.kind == frees:
                    live -= sizes[d][t.op.chunk]
            out.append(peak)
        return tuple(out)


# ---------------------------------------------------------------------------------------------------
# The list scheduler


def build_schedule(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                   costs: Costs | None = None, limits: Sequence[int] | None = None) -> Schedule:
    """Generate schedule ``name``: simulate the list scheduler, then derive the action lists.

    ``limits``: per device an activation bound raised above the schedule's own (``device_limits``).
    Raises ValueError (one line, ``FIELD: problem``) for shapes ``schedule_problems`` rejects, and for
    ``limits`` of another length than the devices."""
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    run, origin = _chosen(name, layout, micro_batches, costs, bounds)
    timeline = _timed(name, layout, *run)
    actions = derive_actions(timeline, layout)
    raised = None if limits is None else bounds
    return Schedule(name, layout, micro_batches, costs,  # type: ignore[arg-type]
                    tuple(tuple(t) for t in timeline), actions, raised, origin)


def schedule_timeline(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                      costs: Costs | None = None, limits: Sequence[int] | None = None, *,
                      source: Source = "best") -> tuple[tuple[TimedOp, ...], ...]:
    """``build_schedule(...).timeline`` without deriving the action lists: the compute order is all a
    caller that only times the order needs (the planner prices thousands of pipelines).

    ``source``: ``"best"``, the order every consumer runs (``_list_run``); ``"list"``, the list scheduler's
    alone; ``"textbook"``, the schedule's published static order (``canonical_orders``, its first) played
    with ``costs``: the two candidates, for tests and benchmarks that compare them."""
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    return tuple(tuple(t) for t in _list_schedule(name, layout, micro_batches, costs, bounds, source))


def schedule_order(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                   costs: Costs | None = None, limits: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """``schedule_timeline``'s op order alone: per device its ops in order, each numbered
    ``(micro_batch * virtual_stages + stage) * len(op_kinds(name)) + kind`` (``kind`` indexing ``op_kinds``).
    A caller that replays the order with other costs needs no ``TimedOp`` per op (building those was a fifth
    of the list scheduler's time in the planner, which prices thousands of orders)."""
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    order, _ = _list_run(name, layout, micro_batches, costs, bounds)
    return tuple(tuple(o for o, _ in ops) for ops in order)


def step_time(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
              costs: Costs | None = None, limits: Sequence[int] | None = None) -> float:
    """The pipeline's step time under ``name`` with ``costs``: the scheduler's simulated makespan.

    The one definition for the cost model and the simulator. Closed forms it reproduces with equal
    stages, per-op costs ``F, B, W`` (``BW = B + W``) and no transfer time (tested):

    * 1F1B and GPipe: ``(m + S - 1) * (F + BW)``;
    * ZB-H1: ``m * (F + B + W) + (S - 1) * (F + B)``: 1F1B's fill and drain without its ``W``s.
      (The zero-bubble paper's ZB-H1 reaches ``(S - 1) * (F + B - W)`` by letting later stages keep
      more W-pending micro-batches, whose memory it assumes smaller; here an activation counts in
      full until its W, and under that bound the last stage must run F, B, W per micro-batch in turn,
      which makes this the best any order can do);
    * interleaved with ``F = B = W`` per chunk, ``m`` a multiple of ``S``: ``(v*m + S - 1) * (F + BW)``,
      the fill and drain ``v`` times shorter than 1F1B's on chunks ``v`` times larger. For ``m`` not
      a multiple of ``S``, the last, partial group of micro-batches costs extra fill;
    * ZB-V with ``F = B = W``: less than ZB-H1 on the same model (its fill runs on half-size chunks).

    With uneven stages there is no closed form worth trusting: this simulation is exact for the
    given costs, which is why the planner should call it rather than a formula. ``limits``: as for
    ``build_schedule``.
    """
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    order, end = _list_run(name, layout, micro_batches, costs, bounds)
    return max((end[ops[-1][0]] for ops in order if ops), default=0.0)


def step_time_bound(name: str, num_stages: int, micro_batches: int, chunks: int, costs: Costs) -> float:
    """A lower bound on the pipeline's time under ``name`` with op durations and transfer times ``costs``,
    for any op order that respects the dependencies: what the runtime's action lists take when played
    (``CostModel.pipeline_step_time``) and what the list scheduler takes (``step_time``). Cheap (no lists
    built), so that the search skips pricing exactly what cannot beat a plan it has (docs/design.md §10).

    Per device ``d``: nothing runs before the first micro-batch's forward reaches its first virtual stage
    (``head``), it runs its ops one at a time, its last backward (B) is followed by the input-gradient
    chain down to stage 0 (``tail``), and no backward starts before the first micro-batch has gone
    through the pipeline and its gradient has come back to ``d`` (``back``). Exact for 1F1B on equal
    stages without transfers (``(m + S - 1) * (F + BW)``)."""
    layout = schedule_layout(name, num_stages, chunks)
    split = POLICIES[name].split_backward
    n, m = layout.num_stages, micro_batches
    dev = [layout.device(j) for j in range(n)]
    cost = [costs.chunk(dev[j], layout.chunk(j)) for j in range(n)]
    f = [c.forward for c in cost]
    b = [c.input_grad if split else c.of("BW") for c in cost]
    w = [c.weight_grad if split else 0.0 for c in cost]
    hop = [costs.transfer(j) if dev[j] != dev[j + 1] else 0.0 for j in range(n - 1)]
    head = [0.0] * n       # earliest start of F at virtual stage j
    tail = [w[0]] * n      # least time from the end of B at stage j to the end of the step
    for j in range(1, n):
        head[j] = head[j - 1] + f[j - 1] + hop[j - 1]
        tail[j] = tail[j - 1] + hop[j - 1] + b[j - 1]
    back = [0.0] * n       # earliest start of B at stage j
    back[n - 1] = head[n - 1] + f[n - 1]
    for j in range(n - 2, -1, -1):
        back[j] = max(head[j] + f[j], back[j + 1] + b[j + 1] + hop[j])
    best = 0.0
    for d in range(layout.num_devices):
        js = [j for j in range(n) if dev[j] == d]
        fs, bs, ws = (m * sum(x[j] for j in js) for x in (f, b, w))
        start, first_back, least_tail = min(head[j] for j in js), min(back[j] for j in js), min(tail[j] for j in js)
        best = max(best, start + fs + bs + ws, start + fs + bs + least_tail,
                   first_back + bs + ws, first_back + bs + least_tail)
    return best


def _checked(name: str, num_devices: int, micro_batches: int, chunks: int | None,
             costs: Costs | None, limits: Sequence[int] | None = None) -> tuple[Layout, Costs]:
    problems = schedule_problems(name, num_devices, micro_batches, chunks)
    if not problems and limits is not None and len(limits) != num_devices:
        # Only the shape: a limit below the schedule's own bound is raised to it (``device_limits``), so
        # that a plan's limits also build the lists of a step with fewer micro-batches (packed documents).
        problems = [f"activation_limits: lists {len(limits)} limit(s) for {num_devices} stage(s)"]
    if problems:
        raise ValueError("; ".join(problems))
    layout = schedule_layout(name, num_devices, chunks)
    costs = costs if costs is not None else Costs()
    problems = costs.problems(layout)
    if problems:
        raise ValueError("; ".join(problems))
    return layout, costs


@dataclass(slots=True)
class _DeviceState:
    """One device of the list scheduler. Its ready ops are kept by how the policy picks them, so that a
    choice reads the heads of a few queues instead of every ready op (with thousands of micro-batches a
    device has thousands ready: every first-stage forward is ready at the start)."""

    live: int = 0
    forwards_left: int = 0
    after_backward: bool = False  # the op run last was a backward (B or BW): 1F1B's alternation
    # (When it is free and when it is next worth looking at are ``_greedy_run``'s lists ``free`` and ``wake``.)
    # Ready ops (numbers, ``_list_schedule``): not yet due, as (ready time, op); due ones by kind, as
    # ``rank * ops + op`` (``_priority_keys``: least first): a micro-batch's first forward here, B or BW, W;
    # and its later chunks' forwards as op numbers (few: of micro-batches held here).
    pending: list[tuple[float, int]] = field(default_factory=list)
    first_forwards: list[int] = field(default_factory=list)
    later_forwards: list[int] = field(default_factory=list)
    backwards: list[int] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)
    # micro-batch -> forwards it still has to run here / activations it holds here (while it holds any)
    owed: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)

    def safe_forward(self, mb: int, limit: int, chunks: int) -> bool:
        """Banker's rule: after one more forward of ``mb`` here, can every micro-batch holding
        activations here, the oldest first, still run its remaining forwards within ``limit`` (and
        then, its backwards done, free every slot it holds)?"""
        free = limit - self.live - 1
        if free < 0:
            return False
        if chunks == 1:   # a micro-batch here owes no forward once it holds its one activation
            return True
        owed, held = self.owed, self.held
        # The state after that forward, read without copying it (this runs for every candidate forward).
        for k in sorted(owed) if mb in owed else sorted([*owed, mb]):
            if k == mb:
                if owed.get(k, chunks) - 1 > free:
                    return False
                free += held.get(k, 0) + 1
            else:
                if owed[k] > free:
                    return False
                free += held[k]
        return True

    def ready_ops(self, total: int) -> list[int]:
        return ([o for _, o in self.pending] + [x % total for x in self.first_forwards] + self.later_forwards
                + [x % total for x in self.backwards] + [x % total for x in self.weights])


def _priority_keys(pol: Policy, layout: Layout, kinds: tuple[str, ...], m: int) -> tuple[list[int], list[int]]:
    """Per op number (``_list_schedule``) its rank among a device's ready ops (least first), and the rank it
    has right after a backward (1F1B's alternation: one forward after each backward, the steady state).

    A rank is the tuple ``(kind's priority, then by order: micro-batch, later virtual stage first; or group of
    S micro-batches, chunk (forwards up, backwards down), micro-batch)`` numbered as one integer in the same
    order (ints: no tuple per op to build, compare or keep)."""
    rank = {k: i + 1 for i, k in enumerate(pol.priority)}   # 0: a forward right after a backward
    s, stages, v = layout.num_devices, layout.num_stages, layout.chunks
    groups = -(-m // s)
    # key = r * scale + rest: the kind's rank r first, then ``rest`` (below ``scale``) in the order's terms.
    scale = groups * (2 * v - 1) * m if pol.order == "groups" else m * stages
    keys, after = [], []
    for mb in range(m):
        for j in range(stages):
            c = layout.chunk(j)
            for kind in kinds:
                if pol.order == "groups":
                    rest = ((mb // s) * (2 * v - 1) + (c if kind == "F" else -c) + v - 1) * m + mb
                else:
                    # Oldest micro-batch first; between chunks of one micro-batch, the later virtual stage
                    # (it is closer to freeing memory: depth-first).
                    rest = mb * stages + stages - 1 - j
                keys.append(rank[kind] * scale + rest)
                after.append(rest if pol.alternate and kind == "F" else keys[-1])
    return keys, after


@functools.lru_cache(maxsize=1 << 10)
def _run_keys(name: str, layout: Layout, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``_priority_keys`` per (schedule, layout, micro-batch count), read-only: they do not read the costs or
    limits, and the planner lists the same shape at many costs (2 284 lists of 153 shapes at 64 GPUs)."""
    keys, after = _priority_keys(POLICIES[name], layout, op_kinds(name), m)
    return tuple(keys), tuple(after)


def _greedy_run(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]
                ) -> tuple[list[list[tuple[int, float]]], list[float]]:
    """Event-driven simulation: each idle device starts the best ready op its policy allows, holding at
    most ``limit[d]`` activations on device ``d``.

    Ops are numbered ``(mb * stages + j) * kinds + k`` (``k`` indexes ``kinds``: F, then B and W or the fused
    BW); an op's dependencies follow from its number: F after the previous stage's F (across the transfer
    time between them); B (BW) after its own F and the next stage's B (BW); W after its own B. A choice
    costs a few heap operations, not a scan of the ready ops, so a step of many micro-batches is scheduled
    in time linear in its ops (up to a logarithm); tests/unit/schedules/reference_scheduler.py states the
    rules plainly, and the tests hold this loop to its choices. The planner prices thousands of pipelines
    by this loop: it keeps ints in flat lists, not a tuple or list per op."""
    pol = POLICIES[name]
    n, stages = layout.num_devices, layout.num_stages
    last = stages - 1
    split = pol.split_backward
    kinds = ("F", "B", "W") if split else ("F", "BW")
    nk = len(kinds)
    frees = nk - 1   # W under a split backward, else BW: the op that frees its activation
    per_mb = stages * nk
    total = m * per_mb
    dev = [layout.device(j) for j in range(stages)]
    chunk = [layout.chunk(j) for j in range(stages)]
    dur = [[costs.chunk(dev[j], chunk[j]).of(k) for k in kinds] for j in range(stages)]  # type: ignore[arg-type]
    # A message between virtual stages j and j + 1 (either way) takes costs.transfer(j) across devices.
    hop = [costs.transfer(j) if dev[j] != dev[j + 1] else 0.0 for j in range(last)]
    # Per op of one micro-batch (``o % per_mb``): how many ops it waits for.
    waits = [(1 if j > 0 else 0) if k == 0 else (2 if j < last else 1) if k == 1 else 1
             for j in range(stages) for k in range(nk)]
    waiting = waits * m
    keys, after = _run_keys(name, layout, m)
    chunks = layout.chunks
    devs = [_DeviceState(forwards_left=m * chunks) for _ in range(n)]
    ready_at = [0.0] * total
    end = [0.0] * total
    for o in range(total):
        if waiting[o] == 0:
            st0 = devs[dev[(o // nk) % stages]]
            st0.pending.append((0.0, o))
    for st0 in devs:
        heapq.heapify(st0.pending)
    forwards_first = pol.forwards_first
    heappush, heappop = heapq.heappush, heapq.heappop

    def first_safe(st: _DeviceState, lim: int, beats: int | None, within: int | None) -> int | None:
        """Remove and return the best-ranked due first forward of a micro-batch here that the banker's rule
        allows and that ranks before ``beats`` (a backward's rank) and ``within`` (a forward's rank); None if
        none. Those forwards are of micro-batches holding nothing here, and the rule's answer for such a
        micro-batch depends only on how many of those that do hold activations here are older. Their ranks
        order them by micro-batch (a device's chunk-0 forwards all sit on one virtual stage, and either
        order compares the micro-batch first among them), so once one younger than every held micro-batch
        fails, every later one fails too."""
        heap = st.first_forwards
        ranks = after if st.after_backward else keys
        order: list[int] | None = None
        answers: dict[int, bool] = {}
        skipped: list[int] = []
        found = None
        while heap:
            o = heap[0] % total
            if (beats is not None and ranks[o] > beats) or (within is not None and keys[o] > within):
                break
            if chunks == 1:   # (safe_forward: any forward is, with a free slot)
                found = heappop(heap) % total
                break
            if order is None:
                order = sorted(st.owed)
            mb = o // per_mb
            p = bisect.bisect_left(order, mb)
            ok = answers.get(p)
            if ok is None:
                ok = answers[p] = st.safe_forward(mb, lim, chunks)
            if ok:
                found = heappop(heap) % total
                break
            if p == len(order):
                break
            skipped.append(heappop(heap))
        for x in skipped:
            heappush(heap, x)
        return found

    def take(st: _DeviceState, lim: int) -> int | None:
        """Remove and return the best-ranked due op the policy allows (None: none): the best B / BW or W
        (GPipe: no B before the device's last forward), unless a forward that the banker's rule allows ranks
        before it (forwards are checked in rank order: the banker's check is the expensive part, and only
        the best allowed forward matters)."""
        ranks = after if st.after_backward else keys
        best_heap: list[int] | None = None
        if st.backwards and not (forwards_first and st.forwards_left):
            best_heap = st.backwards
        if st.weights and (best_heap is None or st.weights[0] < best_heap[0]):
            best_heap = st.weights
        beats = None if best_heap is None else best_heap[0] // total   # (a backward ranks the same after either)
        if st.live < lim:   # else no forward fits (safe_forward)
            if chunks == 1:
                # One chunk: every forward is a first one, and the banker's rule allows any with a free slot
                # (``first_safe`` reduced to its first test).
                heap = st.first_forwards
                if heap and (beats is None or ranks[heap[0] % total] <= beats):
                    return heappop(heap) % total
                return None if best_heap is None else heappop(best_heap) % total
            later = None
            # A forward must leave the device in a state where the oldest micro-batch here can still reach
            # its backward (a banker's rule): a bounded device must not fill up with chunk-0 forwards of new
            # micro-batches while an older one still needs a slot for its later chunks.
            if st.later_forwards:
                for o in sorted(st.later_forwards, key=keys.__getitem__):
                    if beats is not None and ranks[o] > beats:
                        break
                    if st.safe_forward(o // per_mb, lim, chunks):
                        later = o
                        break
            if st.first_forwards:
                first = first_safe(st, lim, beats, None if later is None else keys[later])
                if first is not None:
                    return first
            if later is not None:
                st.later_forwards.remove(later)
                return later
        return None if best_heap is None else heappop(best_heap) % total

    # Per device its ops started, in order, as (op, start); built into ``TimedOp``s at the end.
    order: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    # Times that differ only by rounding are one moment: the order must not hinge on float noise
    # (a schedule on costs x * (1, 1, 1) is the schedule on (1, 1, 1), for any x).
    tol = 1e-9 * max(costs.chunk(d, c).of(k) for d in range(n) for c in range(chunks) for k in kinds)  # type: ignore[arg-type]
    # Event times, each as (time, device): the device whose op ends then or to which an op comes due then
    # (every device at 0).
    events = [(0.0, d) for d in range(n)]
    started = 0
    now = 0.0
    # Per op of one micro-batch (``o % per_mb``): its kind's index, virtual stage, and device.
    kind_of = [k for _ in range(stages) for k in range(nk)]
    stage_of = [j for j in range(stages) for _ in range(nk)]
    dev_num = [dev[j] for j in stage_of]
    first_chunk = [chunk[j] == 0 for j in stage_of]
    lasting = [dur[j][k] for j, k in zip(stage_of, kind_of)]
    hop_of = [hop[j] if j < last else 0.0 for j in stage_of]
    hop_in = [hop[j - 1] if j > 0 else 0.0 for j in stage_of]
    inf = math.inf
    # Per device: when its op ends (``free``), and ``wake``: the earliest time it is worth looking at, the
    # later of ``free`` and, when it last found no op it may run, when the next of its ready ops comes due
    # (until an op is started or readied there it would find none again). An event looks only at the
    # devices it names (``looks``), in device order, those with ``wake`` due: a device finds an op to
    # start, or one of its ready ops comes due, only at an event that names it (its op's end, that op's
    # ready time), so every other device would find none. (Scanning every device per event took 18 device
    # tests per op started at 64 GPUs, of which 1.3 found the device due.)
    free = [0.0] * n
    wake = [0.0] * n
    pend = [st.pending for st in devs]

    while started < total:
        if not events:
            stuck = [(d, sorted((kinds[o % nk], o // per_mb, (o // nk) % stages) for o in st.ready_ops(total)))
                     for d, st in enumerate(devs)]
            raise RuntimeError(f"{name}: the list scheduler stalled at t={now} (ready per device: {stuck}); "
                               "the activation bound is too small for this shape")
        now, d = heappop(events)
        due_by = now + tol
        looks = [d]
        if events and events[0][0] <= due_by:
            while events and events[0][0] <= due_by:
                looks.append(heappop(events)[1])
            looks = sorted(set(looks))
        i = 0
        while i < len(looks):
            d = looks[i]
            i += 1
            if wake[d] > due_by:   # busy, or it found nothing and nothing came due since
                continue
            st = devs[d]
            pending = pend[d]
            while pending and pending[0][0] <= due_by:
                o = heappop(pending)[1]
                r = o % per_mb
                k = kind_of[r]
                if k == 0:
                    if first_chunk[r]:
                        heappush(st.first_forwards, keys[o] * total + o)
                    else:
                        st.later_forwards.append(o)
                else:
                    heappush(st.backwards if k == 1 else st.weights, keys[o] * total + o)
            op = take(st, limit[d])
            if op is None:
                wake[d] = pending[0][0] if pending else inf
                continue
            r = op % per_mb
            k = kind_of[r]
            st.after_backward = k == 1
            start = now   # (``max(now, free[d], ready_at[op])`` written out)
            if free[d] > start:
                start = free[d]
            if ready_at[op] > start:   # never before its inputs, even by a rounding error
                start = ready_at[op]
            end[op] = free[d] = wake[d] = t = start + lasting[r]
            heappush(events, (t, d))
            order[d].append((op, start))
            started += 1
            if k == 0:
                st.live += 1
                st.forwards_left -= 1
                if chunks > 1:   # (the banker's rule reads them only with more than one chunk)
                    mb = op // per_mb
                    st.held[mb] = st.held.get(mb, 0) + 1
                    st.owed[mb] = st.owed.get(mb, chunks) - 1
            elif k == frees:
                st.live -= 1
                if chunks > 1:
                    mb = op // per_mb
                    st.held[mb] -= 1
                    if not st.held[mb]:
                        del st.held[mb], st.owed[mb]
            # What this op's end readies (its end is known now): its dependents whose last input it was.
            # Each joins its device's pending ops and wakes the device (``wake`` back to ``free``), and its
            # ready time is an event naming the device. A device woken by an op due after ``due_by`` would
            # find nothing new in this event; one later in device order that an op due now woke (a zero
            # duration or transfer) is looked at in this event, as a scan of every device in turn would
            # (``_woke``).
            if k == 0:
                nxt = op + 1   # its own backward (B or BW)
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    if stage_of[r] < last:
                        u = end[nxt + nk] + hop_of[r]
                        ready_t = t if t >= u else u
                    else:
                        ready_t = t
                    ready_at[nxt] = ready_t
                    td = dev_num[r + 1]
                    heappush(pend[td], (ready_t, nxt))
                    heappush(events, (ready_t, td))
                    if ready_t <= due_by and td > d and free[td] <= due_by:
                        _woke(looks, i, td)
                    wake[td] = free[td]
                if stage_of[r] < last:   # the next stage's forward
                    nxt = op + nk
                    waiting[nxt] -= 1
                    if not waiting[nxt]:
                        ready_t = t + hop_of[r]
                        ready_at[nxt] = ready_t
                        td = dev_num[r + nk]
                        heappush(pend[td], (ready_t, nxt))
                        heappush(events, (ready_t, td))
                        if ready_t <= due_by and td > d and free[td] <= due_by:
                            _woke(looks, i, td)
                        wake[td] = free[td]
            elif k == 1:
                if split:   # its W
                    nxt = op + 1
                    waiting[nxt] -= 1
                    if not waiting[nxt]:
                        ready_at[nxt] = t
                        td = dev_num[r + 1]
                        heappush(pend[td], (t, nxt))
                        heappush(events, (t, td))
                        if t <= due_by and td > d and free[td] <= due_by:
                            _woke(looks, i, td)
                        wake[td] = free[td]
                if stage_of[r] > 0:   # the previous stage's backward
                    nxt = op - nk
                    waiting[nxt] -= 1
                    if not waiting[nxt]:
                        u = end[op] + hop_in[r]
                        w = end[nxt - 1]
                        ready_t = w if w >= u else u
                        ready_at[nxt] = ready_t
                        td = dev_num[r - nk]
                        heappush(pend[td], (ready_t, nxt))
                        heappush(events, (ready_t, td))
                        if ready_t <= due_by and td > d and free[td] <= due_by:
                            _woke(looks, i, td)
                        wake[td] = free[td]
    return order, end


def _list_run(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]
              ) -> tuple[list[list[tuple[int, float]]], list[float]]:
    """The order every consumer gets (engine, simulator, cost model): ``_chosen``'s."""
    return _chosen(name, layout, m, costs, limit)[0]


def _chosen(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]
            ) -> tuple[tuple[list[list[tuple[int, float]]], list[float]], str]:
    """The list scheduler's order (``_greedy_run``) or the schedule's published static order
    (``canonical_orders``), whichever ends first when played with ``costs``, and which one it is (``ORDER_LIST``
    or a ``canonical_labels`` line); a tie keeps the list scheduler's. Both keep every device within
    ``limit`` (the published orders within the schedule's own bound, which ``limit`` only raises). Under
    1F1B with room for every micro-batch's activation on every device (GPipe's memory), GPipe's orders are
    candidates too, so 1F1B is never slower than GPipe where it may hold what GPipe holds. docs/schedules.md,
    "Never slower than the textbook", has why both are needed: each wins on some uneven pipeline."""
    best = _greedy_run(name, layout, m, costs, limit)
    best_t, origin = _makespan(best), ORDER_LIST
    names = [name]
    if name == "1f1b" and all(x >= m for x in limit):
        names.append("gpipe")
    for other in names:
        if other != name:
            run = _greedy_run(other, layout, m, costs, device_limits(other, layout.num_devices, m, layout.chunks))
            if _makespan(run) < best_t * (1 - 1e-12):
                best, best_t, origin = run, _makespan(run), f"{ORDER_LIST} under GPipe's policy"
        for played, label in zip(_played(other, layout, m, costs), canonical_labels(other)):
            if played is not None and _makespan(played) < best_t * (1 - 1e-12):
                best, best_t, origin = played, _makespan(played), label
    return best, origin


def _played(name: str, layout: Layout, m: int, costs: Costs
            ) -> list[tuple[list[list[tuple[int, float]]], list[float]] | None]:
    """Schedule ``name``'s published orders (``canonical_orders``) played with ``costs`` (None: one that
    deadlocks, which the tests rule out)."""
    kinds = op_kinds(name)
    stages = layout.num_stages
    dev = [layout.device(j) for j in range(stages)]
    dur = [[costs.chunk(dev[j], layout.chunk(j)).of(k) for k in kinds] for j in range(stages)]
    hop = [costs.transfer(j) if dev[j] != dev[j + 1] else 0.0 for j in range(stages - 1)]
    return [play_static(layout, dur, hop, order) for order in _canonical(name, layout, m)]


@functools.lru_cache(maxsize=1 << 8)
def _canonical(name: str, layout: Layout, m: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``canonical_orders``, cached: the planner prices one shape at many costs."""
    return canonical_orders(name, layout, m)


def _makespan(run: tuple[list[list[tuple[int, float]]], list[float]]) -> float:
    order, end = run
    return max((end[ops[-1][0]] for ops in order if ops), default=0.0)


def _woke(looks: list[int], i: int, d: int) -> None:
    """``_greedy_run``: device ``d``, woken in an event by an op due then, joins the devices that event still
    looks at (``looks[i:]``, in device order) unless it is there already."""
    p = bisect.bisect_left(looks, d, i)
    if p == len(looks) or looks[p] != d:
        looks.insert(p, d)


def _list_schedule(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int],
                   source: Source = "best") -> list[list[TimedOp]]:
    """Per device its ops with their start and end times, in the order ``_list_run`` gives them (``source``:
    as for ``schedule_timeline``)."""
    if source == "best":
        order, end = _list_run(name, layout, m, costs, limit)
    elif source == "list":
        order, end = _greedy_run(name, layout, m, costs, limit)
    else:
        played = _played(name, layout, m, costs)[0]
        if played is None:
            raise RuntimeError(f"{name}: the published order deadlocks on {layout} with {m} micro-batches")
        order, end = played
    return _timed(name, layout, order, end)


def _timed(name: str, layout: Layout, order: list[list[tuple[int, float]]], end: list[float]) -> list[list[TimedOp]]:
    """``TimedOp``s of a run (per device its ops as ``(op number, start)``, per op its end)."""
    kinds, stages = op_kinds(name), layout.num_stages
    nk = len(kinds)
    return [[TimedOp(_compute(kinds[o % nk], o // (stages * nk), (o // nk) % stages, layout.chunk((o // nk) % stages)),
                     start, end[o]) for o, start in ops] for ops in order]


def op_kinds(name: str) -> tuple[OpKind, ...]:
    """The op kinds of one micro-batch on one virtual stage under schedule ``name``, in the order op numbers
    count them (``schedule_order``): F, then B and W (a split backward) or the fused BW."""
    return ("F", "B", "W") if POLICIES[name].split_backward else ("F", "BW")


# ---------------------------------------------------------------------------------------------------
# Communication derived from the order


def _produced(op: Compute, layout: Layout) -> Message | None:
    """The message an op's output travels in, if its consumer sits on another device."""
    j, last = op.stage, layout.num_stages - 1
    if op.kind == "F" and j < last and layout.device(j + 1) != layout.device(j):
        return Message("activation", op.micro_batch, j, j + 1, layout.device(j), layout.device(j + 1))
    if op.kind in ("B", "BW") and j > 0 and layout.device(j - 1) != layout.device(j):
        return Message("gradient", op.micro_batch, j, j - 1, layout.device(j), layout.device(j - 1))
    return None


def _needed(op: Compute, layout: Layout) -> Message | None:
    """The message an op reads from another device, if any."""
    j, last = op.stage, layout.num_stages - 1
    if op.kind == "F" and j > 0 and layout.device(j - 1) != layout.device(j):
        return Message("activation", op.micro_batch, j - 1, j, layout.device(j - 1), layout.device(j))
    if op.kind in ("B", "BW") and j < last and layout.device(j + 1) != layout.device(j):
        return Message("gradient", op.micro_batch, j + 1, j, layout.device(j + 1), layout.device(j))
    return None


def derive_actions(timeline: Sequence[Sequence[TimedOp]], layout: Layout) -> tuple[tuple[Action, ...], ...]:
    """Per device: its computes with the posts and waits their messages need.

    First in simulated-time order, sort key ``(time, class, sender, sender's sequence)`` with class 0
    for posts (at the producer's end), 1 for waits and 2 for computes (at the consumer's start): a
    message's send and its receive carry the same key on their two devices, so each pair of devices
    posts its messages in one order on both sides. Then every ``PostRecv`` moves up to right after
    this device's previous post of the same pair (the pair's order is unchanged, and posts never
    block), so the data can flow while the receiver still computes."""
    keyed: list[list[tuple[tuple, Action]]] = [[] for _ in range(layout.num_devices)]
    for d, ops in enumerate(timeline):
        for seq, t in enumerate(ops):
            keyed[d].append(((t.start, 2, d, seq), t.op))
            out = _produced(t.op, layout)
            if out is not None:
                k = (t.end, 0, d, seq)
                keyed[d].append((k, PostSend(out)))
                keyed[out.dst].append((k, PostRecv(out)))
            need = _needed(t.op, layout)
            if need is not None:
                keyed[d].append(((t.start, 1, d, seq), WaitRecv(need)))
    result = []
    for d in range(layout.num_devices):
        keyed[d].sort(key=lambda ka: ka[0])
        result.append(_hoist_receives([a for _, a in keyed[d]], d) + (WaitSends(),))
    return tuple(result)


def _hoist_receives(actions: list[Action], me: int) -> tuple[Action, ...]:
    """Place each PostRecv right after the previous post this device makes to or from the same peer."""
    anchored: dict[int, list[int]] = {}  # index of an action (-1: the start) -> receives that follow it
    last_post: dict[int, int] = {}  # peer -> index of this device's latest post of that pair
    for i, a in enumerate(actions):
        if isinstance(a, (PostSend, PostRecv)):
            peer = a.message.dst if a.message.src == me else a.message.src
            if isinstance(a, PostRecv):
                anchored.setdefault(last_post.get(peer, -1), []).append(i)
            last_post[peer] = i
    out: list[Action] = []

    def emit_after(anchor: int) -> None:
        stack = list(reversed(anchored.get(anchor, ())))
        while stack:  # a receive anchored on a moved receive follows it directly
            r = stack.pop()
            out.append(actions[r])
            stack.extend(reversed(anchored.get(r, ())))

    emit_after(-1)
    for i, a in enumerate(actions):
        if not isinstance(a, PostRecv):
            out.append(a)
            emit_after(i)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------
# Checking action lists


@dataclass(frozen=True)
class ScheduleCheck:
    """What playing the action lists showed (``problems`` empty: every claim holds)."""

    problems: tuple[str, ...]
    transfers: int  # messages matched
    deadlock: bool
    peak_live: tuple[int, ...]  # [device] most live activations at once

    @property
    def ok(self) -> bool:
        return not self.problems


def check_schedule(actions: Sequence[Sequence[Action]], layout: Layout, micro_batches: int, *,
                   split_backward: bool, host_syncs: Sequence[Collection[int]] | None = None) -> ScheduleCheck:
    """Play per-device action lists on a simulated machine and report every violation.

    The machine: a device runs its actions in order; posts never block; ``WaitRecv`` blocks until the
    message's receive completes, ``WaitSends`` until all the device's sends have. Each pair of devices
    has one FIFO queue of posted operations per side (NCCL runs a pair's operations on one stream, in
    post order): an operation completes when it is at the head of its side's queue and the peer's
    head is its counterpart, the k-th send from a to b meeting the k-th receive at b from a (in-order
    matching, no tags). Checked: every message matched with the content its receiver expects; no
    deadlock; each micro-batch's F and B/W (or BW) exactly once per virtual stage, on the stage's device,
    after what it reads; sends after their producer; the peak of live activations per device.
    ``host_syncs``: per device, the actions after which its host waits for the device, each waiting for
    every earlier action of the device (runtime/schedule_sync.py: the NCCL rule).
    """
    if host_syncs is not None:
        actions = with_host_syncs(actions, host_syncs, post_recv=PostRecv, wait_recv=WaitRecv, wait_sends=WaitSends)
    n, last = layout.num_devices, layout.num_stages - 1
    problems: list[str] = []
    pc = [0] * n
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(n)]
    arrived: list[set[Message]] = [set() for _ in range(n)]  # messages whose receive completed here
    queues: dict[tuple[int, int], list[tuple[str, Message]]] = {}  # (me, peer) -> posted ops
    heads: dict[tuple[int, int], int] = {}
    recv_done: list[dict[Message, bool]] = [{} for _ in range(n)]
    pending_sends = [0] * n
    live = [0] * n
    peak = [0] * n
    matched = 0
    bk = "B" if split_backward else "BW"
    backward_kinds = {"B", "W"} if split_backward else {"BW"}

    def queue(me: int, peer: int) -> list[tuple[str, Message]]:
        return queues.setdefault((me, peer), [])

    def run_compute(d: int, op: Compute) -> None:
        k, mb, j = op.kind, op.micro_batch, op.stage
        name = f"device {d}: {op}"
        if not (0 <= j <= last and 0 <= mb < micro_batches) or (k != "F" and k not in backward_kinds):
            problems.append(f"{name}: not an op of this schedule")
            return
        if layout.device(j) != d or layout.chunk(j) != op.chunk:
            problems.append(f"{name}: virtual stage {j} is chunk {layout.chunk(j)} of device {layout.device(j)}")
        if (k, mb, j) in done[d]:
            problems.append(f"{name}: runs twice")
        need = _needed(op, layout)
        if k == "F":
            if j > 0 and need is None and ("F", mb, j - 1) not in done[d]:
                problems.append(f"{name}: before F of stage {j - 1}")
        elif k == "W":
            if ("B", mb, j) not in done[d]:
                problems.append(f"{name}: before its B")
        else:
            if ("F", mb, j) not in done[d]:
                problems.append(f"{name}: before its F")
            if j < last and need is None and (bk, mb, j + 1) not in done[d]:
                problems.append(f"{name}: before the backward of stage {j + 1}")
        if need is not None and need not in arrived[d]:
            problems.append(f"{name}: reads {need} before waiting for it")
        done[d].add((k, mb, j))
        if k == "F":
            live[d] += 1
            peak[d] = max(peak[d], live[d])
        elif k == ("W" if split_backward else "BW"):
            live[d] -= 1

    def progress_pair(a: int, b: int) -> None:
        """Complete the matching heads of the (a, b) pair's two queues."""
        nonlocal matched
        qa, qb = queue(a, b), queue(b, a)
        while heads.get((a, b), 0) < len(qa) and heads.get((b, a), 0) < len(qb):
            ha, hb = qa[heads.get((a, b), 0)], qb[heads.get((b, a), 0)]
            if ha[0] == "send" and hb[0] == "recv":
                src, dst, sent, want = a, b, ha[1], hb[1]
            elif ha[0] == "recv" and hb[0] == "send":
                src, dst, sent, want = b, a, hb[1], ha[1]
            else:
                return  # both sides wait to send (or to receive) first: this pair is stuck
            if sent != want:
                problems.append(f"device {dst}: its receive for {want} matches the send of {sent} "
                                "(the pair posts its messages in different orders)")
            heads[(a, b)] = heads.get((a, b), 0) + 1
            heads[(b, a)] = heads.get((b, a), 0) + 1
            pending_sends[src] -= 1
            recv_done[dst][want] = True
            arrived[dst].add(sent)
            matched += 1

    def step(d: int) -> None:
        """Run device d's actions until it blocks."""
        acts = actions[d]
        while pc[d] < len(acts):
            a = acts[pc[d]]
            if isinstance(a, Compute):
                run_compute(d, a)
            elif isinstance(a, PostSend):
                msg = a.message
                if msg.src != d or not _valid_message(msg, layout):
                    problems.append(f"device {d}: posts a send of {msg}, which is not its to send")
                else:
                    src_kind = "F" if msg.kind == "activation" else bk
                    if (src_kind, msg.micro_batch, msg.src_stage) not in done[d]:
                        problems.append(f"device {d}: sends {msg} before computing it")
                    queue(d, msg.dst).append(("send", msg))
                    pending_sends[d] += 1
            elif isinstance(a, PostRecv):
                msg = a.message
                if msg.dst != d or not _valid_message(msg, layout):
                    problems.append(f"device {d}: posts a receive of {msg}, which is not its to receive")
                else:
                    if msg in recv_done[d]:
                        problems.append(f"device {d}: posts a second receive of {msg}")
                    queue(d, msg.src).append(("recv", msg))
                    recv_done[d][msg] = False
            elif isinstance(a, WaitRecv):
                msg = a.message
                if msg not in recv_done[d]:
                    problems.append(f"device {d}: waits for {msg} without posting its receive")
                elif not recv_done[d][msg]:
                    progress_pair(d, msg.src)
                    if not recv_done[d][msg]:
                        return
            elif isinstance(a, WaitSends):
                for peer in range(n):
                    if peer != d:
                        progress_pair(d, peer)
                if pending_sends[d]:
                    return
            else:
                problems.append(f"device {d}: unknown action {a!r}")
            pc[d] += 1

    deadlock = False
    while any(pc[d] < len(actions[d]) for d in range(n)):
        before = (sum(pc), matched)
        for d in range(n):
            step(d)
        for a in range(n):
            for b in range(a + 1, n):
                progress_pair(a, b)
        if (sum(pc), matched) == before:
            deadlock = True
            blocked = [f"device {d} at action {pc[d]}: {action_text(actions[d][pc[d]])}"
                       for d in range(n) if pc[d] < len(actions[d])]
            problems.append("deadlock: " + "; ".join(blocked))
            break
    if not deadlock:
        for a in range(n):
            for b in range(a + 1, n):
                progress_pair(a, b)
        problems += [f"device {a}: its {kind} of {msg} is never matched"
                     for (a, b), q in sorted(queues.items()) for kind, msg in q[heads.get((a, b), 0):]]
        kinds = ("F", "B", "W") if split_backward else ("F", "BW")
        problems += [f"device {layout.device(j)}: {k}(mb {mb}, stage {j}) never runs"
                     for j in range(layout.num_stages) for mb in range(micro_batches) for k in kinds
                     if (k, mb, j) not in done[layout.device(j)]]
        problems += [f"device {d}: the action list does not end by waiting for its sends"
                     for d in range(n) if not actions[d] or not isinstance(actions[d][-1], WaitSends)]
    return ScheduleCheck(tuple(dict.fromkeys(problems)), matched, deadlock, tuple(peak))


def _valid_message(msg: Message, layout: Layout) -> bool:
    """Whether ``msg`` is a real boundary crossing of ``layout`` (its stages exist, on its devices)."""
    a, b = msg.src_stage, msg.dst_stage
    if max(a, b) >= layout.num_stages:
        return False
    return msg.src == layout.device(a) and msg.dst == layout.device(b)


def action_text(a: Action) -> str:
    """One line per action, for ``hspmd show`` and error messages."""
    if isinstance(a, Compute):
        return str(a)
    if isinstance(a, WaitSends):
        return "wait for sends"
    return f"{type(a).__name__} {a.message}"
