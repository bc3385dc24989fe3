"""Ending a world one of whose members failed: every process group aborted at once, from any thread.

On NCCL a survivor is not blocked in the collective or receive its dead peer never completes: ``work.wait()``
only makes the current stream wait, so the host runs on and blocks at its next host sync, behind a kernel
that waits forever. Nothing on that thread can end it. ``abort_world`` ends it from another thread (the one
that receives the launcher's abort): ``ncclCommAbort`` on every communicator of the world (the world
group's, which holds the pipeline's pair communicators, and every subgroup's) makes the hung kernels exit,
the host sync returns, and the next operation on an aborted group raises, which the training loop takes as
"this world is over". torch's ``_abort_process_group`` does it in one NCCL group call (so that aborting one
communicator cannot wait on another) and drops every group from torch's registry, resetting the group
counter so that the next world's groups are named alike on every member.

Gloo has no abort for an operation in flight: ``ProcessGroup.abort`` returns and a receive from a live peer
that never sends stays blocked until its op timeout. Its equivalent is what a process exit does: shutting
this process's connections down (``sever_tcp_connections``), after which every pending operation here and on
the peers fails at once.

The NCCL watchdog must not kill the process when it finds a timed-out or failed operation (torch's default,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``): an elastic run survives failures in memory. ``nccl_environment``
says what a worker sets before its first process group exists (ProcessGroupNCCL reads the variable when a
group is created; its options have no field for it).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# 2: on an error or timeout the watchdog aborts the communicators and the operation raises; the process
# lives (torch's "CleanUpOnly"). 3, torch's default: the process is torn down.
NCCL_ABORT_WITHOUT_EXIT = "2"


def nccl_environment(*, elastic: bool) -> Mapping[str, str]:
    """What a worker of a run sets before its first NCCL process group: an elastic run's watchdog aborts
    communicators without killing the process; a plain run keeps torch's default (a failed plain run is
    over: its processes end)."""
    return {NCCL_ERROR_HANDLING: NCCL_ABORT_WITHOUT_EXIT} if elastic else {}


def apply_nccl_environment(*, elastic: bool) -> str | None:
    """Set ``nccl_environment`` in this process; a line saying what it replaced, if anything."""
    changed = []
    for key, value in nccl_environment(elastic=elastic).items():
        old = os.environ.get(key)
        if old is not None and old != value:
            changed.append(f"{key}={old} replaced by {value} (an elastic run must survive a failed communicator)")
        os.environ[key] = value
    return "; ".join(changed) or None


def abort_world(*, shut_connections: bool, keep_port: int) -> None:
    """Abort every process group of this process's world, the world group included (nothing if there is
    none); ``shut_connections``: also shut down its TCP connections except the store's (gloo's abort)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    if dist.is_initialized():
        _abort_process_group()
    if shut_connections:
        sever_tcp_connections(keep_port)


def sever_tcp_connections(keep_port: int) -> int:
    """shutdown(2) every connected TCP socket of this process except those to ``keep_port`` (the store).

    Gloo cannot abort an op in flight, and after a peer's death it keeps the generation's other
    connections open even when its process groups are destroyed (the failed op pins the context), so
    peers blocked on this worker would wait for their op timeout. Shutting the sockets down is what a
    process exit would do: every pending op here and on the peers fails at once. The file descriptors
    stay gloo's (it closes them when it lets go). Returns how many were shut down.
    """
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
