"""The data of a pipeline schedule (torch-free): op costs, ops, messages, actions and the schedule itself.

Every consumer reads these: the list scheduler (``runtime.torchfree.list_scheduler``) times ops by ``Costs``, the
action lists (``runtime.torchfree.schedule_actions``) are ``Compute``s with the posts and waits of their ``Message``s,
the engine walks them, ``hspmd show`` prints them and the simulator and the cost model play them.

Vocabulary. A pipeline has ``S`` devices; each holds ``v`` chunks, so there are ``S*v`` virtual
stages ``j``. Placement ``"loop"``: virtual stage ``j`` is chunk ``j // S`` of device ``j % S``
(interleaved 1F1B). Placement ``"v"`` (``v == 2``): device ``j`` for ``j < S`` and ``2S-1-j`` after,
so the first and the last virtual stage share device 0 (the V shape of ZB-V). Ops per (micro-batch,
virtual stage): ``F``; then either ``BW`` (the whole backward) or ``B`` followed by ``W``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.torchfree.schedule_policies import POLICIES, Layout, OpKind, ScheduleName, device_limits

MessageKind = Literal["activation", "gradient"]
# What an order came from when it is the list scheduler's (else a ``canonical_labels`` line).
ORDER_LIST = "the list scheduler's order"



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


def op_kinds(name: str) -> tuple[OpKind, ...]:
    """The op kinds of one micro-batch on one virtual stage under schedule ``name``, in the order op numbers
    count them (``schedule_order``): F, then B and W (a split backward) or the fused BW."""
    return ("F", "B", "W") if POLICIES[name].split_backward else ("F", "BW")


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


def action_text(a: Action) -> str:
    """One line per action, for ``hspmd show`` and error messages."""
    if isinstance(a, Compute):
        return str(a)
    if isinstance(a, WaitSends):
        return "wait for sends"
    return f"{type(a).__name__} {a.message}"


# ---------------------------------------------------------------------------------------------------
# Timelines and the schedule


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
