"""Stage boundaries: the activation going forward and its gradient coming back.

A boundary tensor is duplicated inside the sending stage's TP group (row-parallel outputs are
all-reduced) and must arrive duplicated inside the receiving group; its gradient is duplicated in the
receiving group (DTensor all-reduces the column-parallel input gradient) and must arrive duplicated on
every device of the sending group, since each one runs the backward of its own copy of the graph.
The communication layer resolves both directions from the annotations (send/recv between groups of the
same size, BSR between different TP degrees; specialize.py ``stage_boundaries``); here their messages
are posted, together with the other transfers of the same schedule tick, in one batch_isend_irecv.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.comm.execute import pack_message, recv_buffer, start_output, unpack_message
from runtime.comm.resolve import CommOp


class P2PBatch:
    """The messages of one schedule tick, posted together and waited for together."""

    def __init__(self, me: int, ranks: dict[int, int]) -> None:
        self.me = me
        self.ranks = ranks
        self.ops: list[dist.P2POp] = []
        self._unpack: list[tuple[CommOp, object, torch.Tensor, torch.Tensor]] = []

    def send(self, op: CommOp, x: torch.Tensor) -> None:
        """Post this device's messages of ``op`` with local source ``x``."""
        for m in op.sends(self.me):
            self.ops.append(dist.P2POp(dist.isend, pack_message(op, m, x, self.me), self.ranks[m.peer]))

    def recv(self, op: CommOp, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Post this device's receives of ``op``; the returned tensor is complete after ``run``."""
        out = start_output(op, None, self.me, dtype=dtype, device=device)
        if out is None:
            raise RuntimeError(f"device {self.me} is not a destination of this boundary")
        for m in op.recvs(self.me):
            buf = recv_buffer(m, dtype=dtype, device=device)
            self._unpack.append((op, m, buf, out))
            self.ops.append(dist.P2POp(dist.irecv, buf, self.ranks[m.peer]))
        return out

    def run(self) -> None:
        if self.ops:
            for req in dist.batch_isend_irecv(self.ops):
                req.wait()
        for op, m, buf, out in self._unpack:
            unpack_message(op, m, buf, out, self.me)  # type: ignore[arg-type]
        self.ops.clear()
        self._unpack.clear()

