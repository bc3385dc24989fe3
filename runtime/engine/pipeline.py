"""Stage boundaries: the activation going forward and its gradient coming back.

A boundary tensor is duplicated inside the sending stage's TP group (row-parallel outputs are
all-reduced) and must arrive duplicated inside the receiving group; its gradient is duplicated in the
receiving group (DTensor all-reduces the column-parallel input gradient) and must arrive duplicated on
every device of the sending group, since each one runs the backward of its own copy of the graph.
The communication layer resolves both directions from the annotations (send/recv between groups of the
same size, BSR between different TP degrees; specialize.py ``stage_routes``). Here each message is
posted as a non-blocking ``isend`` / ``irecv`` when the schedule's action list says so
(runtime/torchfree/schedule_types.py: ``PostSend``, ``PostRecv``, ``WaitRecv``, ``WaitSends``).

The action lists post a device pair's messages in one and the same order on both sides, which is what
NCCL needs (it matches a pair's operations in post order, on one stream per pair). Gloo matches by tag:
each message gets the running count of messages posted so far on its (sender, receiver) pair, which is
the same number on both sides for the same reason, so the two backends pair the same messages.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime.comm.execute import pack_message, recv_buffer, start_output, unpack_message
from runtime.torchfree.comm.resolve import CommOp


def connect_peers(me: int, peers: set[int], ranks: dict[int, int], device: torch.device) -> None:
    """One blocking exchange with every boundary peer, pairs in one global order (by (lower, higher)
    device id): the globally first unfinished pair always has both ends waiting for it, so this cannot
    deadlock. NCCL sets a pair's communicator up on its first message, blocking until both ends post
    one; a schedule that posts a receive early could otherwise block there while its peer waits for it."""
    for peer in sorted(peers, key=lambda p: (min(me, p), max(me, p))):
        out, back = torch.ones(1, device=device), torch.empty(1, device=device)
        if me < peer:
            dist.send(out, ranks[peer])
            dist.recv(back, ranks[peer])
        else:
            dist.recv(back, ranks[peer])
            dist.send(out, ranks[peer])


@dataclass
class _PendingRecv:
    op: CommOp
    out: torch.Tensor
    parts: list[tuple[object, torch.Tensor, dist.Work]] = field(default_factory=list)


class BoundaryChannel:
    """One step's boundary messages of this device: posted without blocking, completed on demand."""

    def __init__(self, me: int, ranks: dict[int, int]) -> None:
        self.me = me
        self.ranks = ranks
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # the buffer lives until its send completes
        self._recvs: dict[Hashable, _PendingRecv] = {}
        self._count: dict[tuple[int, int], int] = {}  # (sender, receiver) -> messages posted on that pair

    def _tag(self, src: int, dst: int) -> int:
        n = self._count.get((src, dst), 0)
        self._count[src, dst] = n + 1
        return n

    def post_send(self, op: CommOp, x: torch.Tensor) -> None:
        """Start sending this device's messages of ``op`` with local source ``x``."""
        for m in op.sends(self.me):
            buf = pack_message(op, m, x, self.me)
            work = dist.isend(buf, self.ranks[m.peer], tag=self._tag(self.me, m.peer))
            self._sends.append((work, buf))

    def post_recv(self, key: Hashable, op: CommOp, *, dtype: torch.dtype, device: torch.device) -> None:
        """Start receiving this device's messages of ``op`` into fresh buffers; ``wait_recv(key)`` completes
        them."""
        if key in self._recvs:
            raise RuntimeError(f"device {self.me}: receive {key} posted twice")
        out = start_output(op, None, self.me, dtype=dtype, device=device)
        if out is None:
            raise RuntimeError(f"device {self.me} is not a destination of this boundary")
        pending = _PendingRecv(op, out)
        for m in op.recvs(self.me):
            buf = recv_buffer(m, dtype=dtype, device=device)
            work = dist.irecv(buf, self.ranks[m.peer], tag=self._tag(m.peer, self.me))
            pending.parts.append((m, buf, work))
        self._recvs[key] = pending

    def wait_recv(self, key: Hashable) -> torch.Tensor:
        """Block until receive ``key`` has arrived; its tensor, assembled in this device's layout."""
        pending = self._recvs.pop(key)
        for m, buf, work in pending.parts:
            work.wait()
            unpack_message(pending.op, m, buf, pending.out, self.me)  # type: ignore[arg-type]
        return pending.out

    def wait_sends(self) -> None:
        """Block until every send posted has completed (and nothing is left unreceived)."""
        if self._recvs:
            raise RuntimeError(f"device {self.me}: receives {sorted(map(str, self._recvs))} were never waited for")
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
