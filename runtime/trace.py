"""Per-rank timelines and emulated slowness, both as implementations of the engine's ``Hooks``.

The engine brackets its work in ``hooks.span(kind, name, **args)`` with kind "compute", "comm" or
"idle". ``TraceRecorder`` turns those spans into Chrome-trace events (open the JSON in
https://ui.perfetto.dev); ``EmulatedSlowdown`` wraps another Hooks and, after each outermost compute
span, sleeps (k - 1) x the compute time it measured, recording that sleep as an "emulation" span. Both
are plain objects handed to the program: no global switch turns them on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from runtime.spec.io import atomic_write_text


class TraceRecorder:
    """Records spans as Chrome-trace complete events for one process (one device)."""

    def __init__(self, pid: int, process_name: str, *, sync: Callable[[], None] | None = None) -> None:
        self.pid = pid
        self.process_name = process_name
        # On GPUs work is asynchronous: a span only means something if it ends when the device is done.
        self._sync = sync
        # Wall-clock anchor + monotonic offsets: comparable across the processes of one run.
        self._wall0_us = time.time_ns() / 1e3
        self._mono0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def _now_us(self) -> float:
        return self._wall0_us + (time.perf_counter() - self._mono0) * 1e6

    @contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        start = self._now_us()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            end = self._now_us()
            event = {"name": name, "cat": kind, "ph": "X", "ts": round(start, 3), "dur": round(end - start, 3),
                     "pid": self.pid, "tid": 0}
            if args:
                event["args"] = {k: _jsonable(v) for k, v in args.items()}
            self.events.append(event)

    def chrome_events(self) -> list[dict[str, Any]]:
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": self.process_name}},
            {"name": "process_sort_index", "ph": "M", "pid": self.pid, "tid": 0, "args": {"sort_index": self.pid}},
            {"name": "thread_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": "program"}},
        ]
        return meta + self.events

    def write(self, path: str | Path) -> None:
        write_chrome_trace(path, self.chrome_events())


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def write_chrome_trace(path: str | Path, events: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, json.dumps({"traceEvents": list(events), "displayTimeUnit": "ms"}))


def merge_chrome_traces(paths: Iterable[str | Path], out: str | Path) -> None:
    """One file holding every rank's timeline (one process track per device)."""
    events: list[dict[str, Any]] = []
    for p in paths:
        events.extend(json.loads(Path(p).read_text(encoding="utf-8"))["traceEvents"])
    write_chrome_trace(out, events)


class EmulatedSlowdown:
    """Stretches compute ``slowdown`` times by sleeping after each outermost compute span.

    The compute time of a span is the process's CPU time in it, capped by its wall time (minus any
    comm/idle spans nested in it). CPU time, because a compute span may wait inside a collective the
    engine cannot bracket (DTensor's TP all-reduce inside a layer): stretching that wait would make two
    emulated TP partners sleep on each other's sleeps, step after step. Capped by wall time, because
    several intra-op threads accumulate CPU time faster than the clock. ``emulated_s`` accumulates the
    seconds slept, for the per-step log (``take_emulated_s`` resets it).
    """

    def __init__(self, slowdown: float, inner: Any = None, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be at least 1.0, got {slowdown}")
        self.slowdown = slowdown
        self.inner = inner
        self.emulated_s = 0.0
        self._sleep = sleep
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._compute_depth = 0
        self._other_depth = 0
        self._base_depth = 0  # non-compute nesting depth at which the current outermost compute span began
        self._excluded = (0.0, 0.0)  # (wall, cpu) seconds of non-compute spans directly inside it

    def take_emulated_s(self) -> float:
        out, self.emulated_s = self.emulated_s, 0.0
        return out

    def _inner_span(self, kind: str, name: str, **args: Any) -> AbstractContextManager[None]:
        return self.inner.span(kind, name, **args) if self.inner is not None else nullcontext()

    @contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        if kind != "compute":
            wall0, cpu0 = self._clock(), self._cpu_clock()
            self._other_depth += 1
            try:
                with self._inner_span(kind, name, **args):
                    yield
            finally:
                self._other_depth -= 1
                if self._compute_depth and self._other_depth == self._base_depth:
                    wall, cpu = self._excluded
                    self._excluded = (wall + self._clock() - wall0, cpu + self._cpu_clock() - cpu0)
            return
        outermost = self._compute_depth == 0
        if outermost:
            self._excluded = (0.0, 0.0)
            self._base_depth = self._other_depth
        wall0, cpu0 = self._clock(), self._cpu_clock()
        self._compute_depth += 1
        try:
            with self._inner_span(kind, name, **args):
                yield
        finally:
            self._compute_depth -= 1
        if not outermost:
            return
        wall = self._clock() - wall0 - self._excluded[0]
        cpu = self._cpu_clock() - cpu0 - self._excluded[1]
        compute = max(0.0, min(wall, cpu))
        extra = (self.slowdown - 1.0) * compute
        if extra > 0:
            with self._inner_span("emulation", f"{name} (emulated x{self.slowdown:g})",
                                  compute_s=round(compute, 6), slowdown=self.slowdown):
                self._sleep(extra)
            self.emulated_s += extra
