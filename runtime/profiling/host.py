"""Running a process on given cores with a given intra-op thread count: ``WorkerCpus``, which the launcher
(``TrainOptions.worker_cpus``) and the profiler take from their caller; no policy of its own. Importing this
loads no torch (``pinned`` loads it when it runs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerCpus:
    """The CPU share of a run's workers: intra-op threads each (None: torch's default) and, per device, the
    cores its worker is pinned to (a device not listed: not pinned)."""

    threads: int | None = None
    cpus: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")


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
