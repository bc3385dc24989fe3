"""A schedule's communication, derived from its compute order (torch-free).

Messages are derived from the compute order (``derive_actions``): a ``PostSend`` right after the
producing op, a ``PostRecv`` at the simulated moment the peer sends, a ``WaitRecv`` right before the
consuming op, and a final ``WaitSends``. Every pair of devices posts its messages, in both directions,
in one order on both sides (the simulated send time), so in-order matching without tags (NCCL) and
per-pair serialization (one NCCL stream per pair) are both safe; docs/schedules.md has the
deadlock-freedom argument, and ``check_schedule`` (``runtime.torchfree.schedule_check``) verifies it on the action
lists themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.torchfree.schedule_policies import Layout
from runtime.torchfree.schedule_types import Action, Compute, Message, PostRecv, PostSend, TimedOp, WaitRecv, WaitSends


def produced_message(op: Compute, layout: Layout) -> Message | None:
    """The message an op's output travels in, if its consumer sits on another device."""
    j, last = op.stage, layout.num_stages - 1
    if op.kind == "F" and j < last and layout.device(j + 1) != layout.device(j):
        return Message("activation", op.micro_batch, j, j + 1, layout.device(j), layout.device(j + 1))
    if op.kind in ("B", "BW") and j > 0 and layout.device(j - 1) != layout.device(j):
        return Message("gradient", op.micro_batch, j, j - 1, layout.device(j), layout.device(j - 1))
    return None


def needed_message(op: Compute, layout: Layout) -> Message | None:
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
            out = produced_message(t.op, layout)
            if out is not None:
                k = (t.end, 0, d, seq)
                keyed[d].append((k, PostSend(out)))
                keyed[out.dst].append((k, PostRecv(out)))
            need = needed_message(t.op, layout)
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

