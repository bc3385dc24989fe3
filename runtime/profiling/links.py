"""Timing the links among local processes (gloo on CPU, NCCL on GPUs), as the runtime uses them:
ping-pong for p2p, all-reduce and all-gather per group size; fitted as latency + bytes / bandwidth."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from runtime.comm.execute import all_gather_flat
from runtime.profiling.compute import time_once
from runtime.profiling.fit import link_fit, trimmed_mean


def p2p_and_allreduce(rank: int, world: int, sizes: Sequence[int], *, device: torch.device | str = "cpu",
                      reps: int = 15) -> dict:
    """Inside an initialised process group of ``world`` ranks: ping-pong between ranks 0 and 1, and an
    all-reduce over groups of 2 and of ``world`` ranks, at each message size. Rank 0 returns
    ``{"p2p": LinkFit, "allreduce": {group size: LinkFit}, "allgather": {group size: LinkFit}}`` (latency
    + bytes / bandwidth; for the all-reduce, bytes = 2(n-1)/n x size; for the all-gather of ``size``
    gathered bytes, as ZeRO-1 gathers its parameter chunks, (n-1)/n x size); the other ranks return {}."""
    device = torch.device(device)
    group_sizes = sorted({2, world}) if world >= 2 else []
    groups = {n: dist.new_group(list(range(n))) if n < world else None for n in group_sizes}

    def timed(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(reps + 2):
            dist.barrier()
            times.append(time_once(fn, device)[0])
        return trimmed_mean(times[2:])

    p2p_x, p2p_y = [], []
    ar: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in group_sizes}
    ag: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in group_sizes}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=device)
        nbytes = buf.numel() * 4

        def one(op: Callable, t: torch.Tensor, peer: int) -> None:
            # As the runtime posts a schedule tick's messages (runtime/engine/pipeline.py P2PBatch).
            for req in dist.batch_isend_irecv([dist.P2POp(op, t, peer)]):
                req.wait()

        def ping(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                one(dist.isend, buf, 1)
                one(dist.irecv, buf, 1)
            elif rank == 1:
                one(dist.irecv, buf, 0)
                one(dist.isend, buf, 0)

        p2p_x.append(nbytes)
        p2p_y.append(timed(ping) / 2)
        for n in group_sizes:
            g = groups[n]
            member = rank < n

            def reduce(g=g, member=member, buf: torch.Tensor = buf) -> None:
                if member:
                    dist.all_reduce(buf, group=g)

            ar[n][0].append(2.0 * (n - 1) / n * nbytes)
            ar[n][1].append(timed(reduce))
            part = max(1, buf.numel() // n)
            gathered = torch.zeros(part * n, device=device)

            def gather(g=g, member=member, gathered: torch.Tensor = gathered, part: int = part) -> None:
                if member:
                    all_gather_flat(gathered, gathered[:part].clone(), group=g)

            ag[n][0].append((n - 1) / n * part * n * 4)
            ag[n][1].append(timed(gather))
    if rank != 0:
        return {}
    return {"p2p": link_fit(p2p_x, p2p_y), "allreduce": {n: link_fit(x, y) for n, (x, y) in ar.items()},
            "allgather": {n: link_fit(x, y) for n, (x, y) in ag.items()}}
