"""Pipeline schedules as plain action lists, one per stage: 1F1B (default) and GPipe.

A schedule is data, not control flow: the executor walks the list, ``describe`` prints it and the
unit tests simulate it (every transfer matched, no deadlock). Transfers that happen at the same
tick are grouped in one ``Comm`` action, executed as a single batch_isend_irecv: Megatron's
send_forward_recv_backward / send_backward_recv_forward, which is what keeps 1F1B deadlock-free when
neighbouring stages post sends to each other at the same time. Each pipeline has its own micro-batch
count; stages of one pipeline share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from runtime.spec.plan import Schedule

ComputeKind = Literal["forward", "backward"]
TransferKind = Literal["send_forward", "recv_forward", "send_backward", "recv_backward"]


@dataclass(frozen=True)
class Compute:
    kind: ComputeKind
    micro_batch: int


@dataclass(frozen=True)
class Transfer:
    kind: TransferKind
    micro_batch: int

    @property
    def peer_offset(self) -> int:
        """The stage this transfer talks to, relative to this one (+1 next, -1 previous)."""
        return +1 if self.kind in ("send_forward", "recv_backward") else -1

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("send")

    @property
    def counterpart(self) -> TransferKind:
        """The kind of the peer stage's transfer this one pairs with."""
        return _COUNTERPART[self.kind]


_COUNTERPART: dict[TransferKind, TransferKind] = {
    "send_forward": "recv_forward", "recv_forward": "send_forward",
    "send_backward": "recv_backward", "recv_backward": "send_backward"}


@dataclass(frozen=True)
class Comm:
    transfers: tuple[Transfer, ...]  # posted together, waited for together


Action = Compute | Comm


class _Builder:
    def __init__(self, stage: int, num_stages: int) -> None:
        self.first = stage == 0
        self.last = stage == num_stages - 1
        self.actions: list[Action] = []

    def comm(self, *transfers: Transfer | None) -> None:
        ts = tuple(t for t in transfers if t is not None)
        if ts:
            self.actions.append(Comm(ts))

    def recv_forward(self, mb: int) -> Transfer | None:
        return None if self.first else Transfer("recv_forward", mb)

    def send_forward(self, mb: int) -> Transfer | None:
        return None if self.last else Transfer("send_forward", mb)

    def recv_backward(self, mb: int) -> Transfer | None:
        return None if self.last else Transfer("recv_backward", mb)

    def send_backward(self, mb: int) -> Transfer | None:
        return None if self.first else Transfer("send_backward", mb)


def one_f_one_b(num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    """Non-interleaved 1F1B: stage s runs min(S - s - 1, m) warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards. At most S - s activations live."""
    _check(num_stages, stage, micro_batches)
    b = _Builder(stage, num_stages)
    warmup = min(num_stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    fwd = bwd = 0
    for _ in range(warmup):
        b.comm(b.recv_forward(fwd))
        b.actions.append(Compute("forward", fwd))
        b.comm(b.send_forward(fwd))
        fwd += 1
    if steady > 0:
        b.comm(b.recv_forward(fwd))
    for i in range(steady):
        b.actions.append(Compute("forward", fwd))
        b.comm(b.send_forward(fwd), b.recv_backward(bwd))
        fwd += 1
        b.actions.append(Compute("backward", bwd))
        if i == steady - 1:
            b.comm(b.send_backward(bwd))
        else:
            b.comm(b.send_backward(bwd), b.recv_forward(fwd))
        bwd += 1
    for _ in range(warmup):
        b.comm(b.recv_backward(bwd))
        b.actions.append(Compute("backward", bwd))
        b.comm(b.send_backward(bwd))
        bwd += 1
    return b.actions


def gpipe(num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    """All forwards, then all backwards (same micro-batch order): m activations live per stage."""
    _check(num_stages, stage, micro_batches)
    b = _Builder(stage, num_stages)
    for mb in range(micro_batches):
        b.comm(b.recv_forward(mb))
        b.actions.append(Compute("forward", mb))
        b.comm(b.send_forward(mb))
    for mb in range(micro_batches):
        b.comm(b.recv_backward(mb))
        b.actions.append(Compute("backward", mb))
        b.comm(b.send_backward(mb))
    return b.actions


SCHEDULES: dict[Schedule, Callable[[int, int, int], list[Action]]] = {"1f1b": one_f_one_b, "gpipe": gpipe}


def build_schedule(name: Schedule, num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r} (have: {', '.join(SCHEDULES)})") from None
    return fn(num_stages, stage, micro_batches)


def _check(num_stages: int, stage: int, micro_batches: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if micro_batches < 1:
        raise ValueError(f"need at least one micro-batch, got {micro_batches}")


def peak_live_activations(actions: list[Action]) -> int:
    """Most forward activations held at once (the memory the schedule needs, in micro-batches)."""
    live = peak = 0
    for a in actions:
        if isinstance(a, Compute):
            live += 1 if a.kind == "forward" else -1
            peak = max(peak, live)
    return peak
