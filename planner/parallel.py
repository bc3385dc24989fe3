"""Independent planner work (the searches per schedule family, cut into parts; the simulator's check of the
finalists) spread over worker processes, with the results in the order of the inputs.

The planner is pure Python and CPU-bound, so threads would not help; processes do, on a multi-core planning
host. Every task is a deterministic function of its arguments, so the answer is the same with any number of
workers; ``workers=1`` runs in the calling process (the tests' path, and the default). Workers start from a
fork server, not by forking the caller: the caller may hold solver threads (HiGHS) that a fork would copy
in an unknown state.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def worker_count(workers: int | None, tasks: int) -> int:
    """Processes to use for ``tasks`` tasks: ``workers`` (None: every available core), never more than the
    tasks, at least 1."""
    want = available_cores() if workers is None else workers
    if want < 1:
        raise ValueError(f"workers must be >= 1 (or None for every core), got {workers}")
    return max(1, min(want, tasks))


class Tasks:
    """Calls started now and collected later (``submit`` returns the call that collects): over
    ``worker_count(workers, tasks)`` worker processes, or, with one, run in the calling process when
    collected (the serial path: the same calls, in the order they are collected)."""

    def __init__(self, workers: int | None, tasks: int) -> None:
        self.workers = worker_count(workers, tasks)
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context(method)) \
            if self.workers > 1 else None

    def submit(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        if self._pool is None:
            return functools.partial(fn, *args)
        return self._pool.submit(fn, *args).result

    def __enter__(self) -> Tasks:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if self._pool is not None:   # on an error, drop what has not started
            self._pool.shutdown(wait=kind is None, cancel_futures=kind is not None)


def ordered_map(fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], workers: int | None = 1) -> list[T]:
    """``[fn(*args) for args in calls]``, over ``worker_count(workers, len(calls))`` processes. ``fn`` and the
    arguments must pickle (a module-level function; planner/cost.py's ``CostModel`` pickles without its
    caches)."""
    with Tasks(workers, len(calls)) as tasks:
        pending = [tasks.submit(fn, *args) for args in calls]
        return [collect() for collect in pending]
