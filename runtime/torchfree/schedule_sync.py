"""Where a device's host waits for the device during a step, and the NCCL rule those waits must obey.

``check_schedule`` (runtime/torchfree/schedule_check.py) plays action lists on NCCL's machine: posts never block,
``WaitRecv``/``WaitSends`` block until their operations complete, one FIFO stream per pair of devices. On a
GPU that holds only while the host never waits for the device between the waits the lists name: a host sync
(reading a tensor's value, ``torch.cuda.synchronize``) waits for every earlier action of its device,
including receives it has only posted, since a device-wide synchronize also waits for NCCL's streams. A
receive hoisted ahead of the computation that lets its peer send it then never completes: interleaved 1F1B
with 3 or more stages deadlocks when the host syncs after every action (which tracing once did), and every
other schedule turns each post into a blocking one.

The rule, checked: **an action's host sync waits for every earlier action of its device.** A host sync after
action i is played as the waits it implies: every receive posted so far, and every send
(``with_host_syncs``). ``engine_host_syncs`` says where the engine's host syncs fall: after a step's last
action (the step's statistics are read there; the trace reads its CUDA events there too) and, where a
tracer syncs in its spans, after every action.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

from runtime.torchfree.schedule_types import Action, PostRecv, WaitRecv, WaitSends


def engine_host_syncs(actions: Sequence[Sequence[Action]], *,
                      syncs_in_spans: bool = False) -> tuple[frozenset[int], ...]:
    """Per device, the indices of the actions after which the engine's host waits for the device:
    the last action (reading the step's statistics), and every action when the tracer syncs in its spans
    (``syncs_in_spans``; runtime/trace.py ``TraceRecorder.SYNCS_IN_SPANS``)."""
    return tuple(frozenset(range(len(acts))) if syncs_in_spans else frozenset({len(acts) - 1}) - {-1}
                 for acts in actions)


def with_host_syncs(actions: Sequence[Sequence[Action]], syncs: Sequence[Collection[int]]
                    ) -> tuple[tuple[Action, ...], ...]:
    """Each device's action list with its host syncs made explicit: after action i of ``syncs[d]``, a
    ``WaitRecv`` of every receive posted so far and not yet waited for, then a ``WaitSends``."""
    out = []
    for acts, at in zip(actions, syncs, strict=True):
        posted: dict[Hashable, None] = {}  # receives posted and not yet waited for, in post order
        seq: list[Action] = []
        for i, a in enumerate(acts):
            seq.append(a)
            if isinstance(a, PostRecv):
                posted[a.message] = None
            elif isinstance(a, WaitRecv):
                posted.pop(a.message, None)
            if i in at:
                seq += [WaitRecv(m) for m in posted]
                posted.clear()
                seq.append(WaitSends())
        out.append(tuple(seq))
    return tuple(out)
