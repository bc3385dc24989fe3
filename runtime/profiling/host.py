"""How an emulated cluster's workers share this machine's CPU: each worker is a process on one host; the
launcher gives each its share of the cores (``emulated_cpu_shares``, ``pin_process``) and ``hspmd profile``
measures under the same share. Importing this loads no torch (``pinned`` loads it when it runs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence


def emulated_cpu_shares(devices: Sequence[int], cluster_devices: int,
                        cpus: Sequence[int]) -> tuple[int, dict[int, tuple[int, ...]]]:
    """The CPU share of each worker of an emulated cluster on this host: (intra-op threads, device ->
    cores to pin it to).

    Every worker gets the same thread count, ``max(1, cores // cluster devices)``, whichever devices the
    plan uses: an emulated device's speed must not depend on the plan (and one profile, measured at that
    count, fits every plan). The i-th device of the plan (in id order) is pinned to cores ``i*t ..
    i*t+t-1`` (mod the core count): left alone, the scheduler at times puts two communicating workers on
    one core while another core idles (wake-affine placement), and the same plan's step time varied by
    +-20% from run to run.
    """
    cores = list(cpus) or [0]
    t = max(1, len(cores) // max(1, cluster_devices))
    return t, {d: tuple(sorted({cores[(i * t + j) % len(cores)] for j in range(t)}))
               for i, d in enumerate(sorted(devices))}


def host_cpus() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_process(cpus: Sequence[int]) -> None:
    """Pin this process to ``cpus`` (where the OS allows it; none: left as it is)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def pinned(cpus: Sequence[int], threads: int | None = None) -> Iterator[None]:
    """The body runs on ``cpus`` (none: as it is) with ``threads`` intra-op threads (None: as they are), as
    the launcher runs a worker; this process's cores and threads are restored after."""
    import torch

    old_cpus, old_threads = host_cpus(), torch.get_num_threads()
    try:
        pin_process(cpus)
        if threads:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(old_threads)
        pin_process(old_cpus)
