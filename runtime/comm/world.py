"""A local world of persistent worker processes (gloo on CPU), started once and fed jobs.

Tests and benchmarks pay the start-up cost of a process group once per module instead of once per
case: ``LocalWorld(n)`` starts n workers that join one torch.distributed world (the store lives in
this process), then ``world.run(fn, *args)`` calls ``fn(ctx, *args)`` on every worker and returns
the results by rank. ``fn`` must be importable (a module-level function); results must pickle
(use numpy arrays or lists rather than tensors). Every wait has a timeout, so a bug that hangs a
collective fails the job instead of the test session.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime.comm.groups import ProcessGroups


@dataclass
class WorkerContext:
    """What a job sees on one worker."""

    rank: int
    size: int
    device: int  # this rank's device id
    ranks: dict[int, int]  # device id -> rank
    groups: ProcessGroups
    state: dict[str, Any] = field(default_factory=dict)  # survives between jobs on this worker


class WorkerError(RuntimeError):
    """A job raised on some worker; the message carries its traceback."""


def _worker(rank: int, size: int, port: int, devices: list[int], timeout_s: float, backend: str,
            jobs: Any, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        ranks = {d: r for r, d in enumerate(devices)}
        ctx = WorkerContext(rank, size, devices[rank], ranks,
                            ProcessGroups([], ranks, timeout=timedelta(seconds=timeout_s)))
        results.put((rank, -1, True, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, -1, False, traceback.format_exc()))
        return
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, fn, args = job
        try:
            out = fn(ctx, *args)
            results.put((rank, job_id, True, out))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((rank, job_id, False, traceback.format_exc()))
    with contextlib.suppress(Exception):  # shutting down anyway
        dist.destroy_process_group()


class LocalWorld:
    """``size`` worker processes joined in one gloo world; device ids ``devices[rank]``."""

    def __init__(self, size: int, *, devices: Sequence[int] | None = None, timeout_s: float = 60.0,
                 backend: str = "gloo") -> None:
        self.size = size
        self.devices = list(devices) if devices is not None else list(range(size))
        if len(self.devices) != size or len(set(self.devices)) != size:
            raise ValueError("devices must list one distinct device id per rank")
        self.timeout_s = timeout_s
        self.backend = backend
        self._procs: list[mp.process.BaseProcess] = []
        self._job_id = 0
        self._store: dist.TCPStore | None = None

    def __enter__(self) -> LocalWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        # A fork server that has imported torch once forks every worker: much cheaper than spawning
        # fresh interpreters that each import torch, and safe (it holds no threads or sockets).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "runtime.comm.world"])
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                                    timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.size)]
        for r in range(self.size):
            p = ctx.Process(target=_worker, args=(r, self.size, self._store.port, self.devices, self.timeout_s,
                                                  self.backend, self._jobs[r], self._results), daemon=True)
            p.start()
            self._procs.append(p)
        self._collect(-1, self.timeout_s + 60)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call ``fn(ctx, *args)`` on every worker; results by rank. Raises WorkerError on failure."""
        self._job_id += 1
        for q in self._jobs:
            q.put((self._job_id, fn, args))
        return self._collect(self._job_id, timeout_s or self.timeout_s)

    def _collect(self, job_id: int, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(out) + len(errors) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(force=True)
                raise WorkerError(f"job {job_id}: no answer from ranks "
                                  f"{sorted(set(range(self.size)) - set(out))} within {timeout_s:.0f} s")
            try:
                rank, jid, ok, value = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close(force=True)
                    raise WorkerError(f"job {job_id}: worker rank(s) {dead} died") from None
                continue
            if jid != job_id:
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                out[rank] = None
                if len(errors) == 1:
                    # Other ranks may now wait forever on a collective: give them a short grace period.
                    deadline = min(deadline, time.monotonic() + 10)
        if errors:
            raise WorkerError(f"job {job_id} failed\n" + "\n".join(errors))
        return [out[r] for r in range(self.size)]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._jobs:
                q.put(None)
            deadline = time.monotonic() + 5
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._store = None
