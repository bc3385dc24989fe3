"""Per-rank timelines and emulated slowness, both as implementations of the engine's ``Hooks``.

The engine brackets its work in ``hooks.span(kind, name, **args)`` with kind "compute" or "comm" (a wait
is a "comm" span; idle time is the gap between spans). ``TraceRecorder``
turns those spans into Chrome-trace events (open the JSON in
https://ui.perfetto.dev). The two CPU emulation modes of runtime/torchfree/spec/cluster.py ``Emulation`` wrap another
Hooks: ``EmulatedSlowdown`` (stretch mode), after each outermost compute span, sleeps (k - 1) x the compute
time it measured; ``EmulatedTarget`` (sleep mode) sleeps until the block has lasted its target time (the
targets come from ``TrainOptions.block_targets``, runtime/launch/options.py: the runtime prices nothing). Both
record their sleep as an "emulation" span. All are plain objects handed to the program: no global switch
turns them on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from runtime.device_clock import DeviceClock, HostClock, Mark
from runtime.torchfree.spec.io import atomic_write_text


class TraceRecorder:
    """Records spans as Chrome-trace complete events for one process (one device).

    Span boundaries are marks of the device's ``clock`` (runtime/device_clock.py): on a GPU, events on the
    current stream, so a span spans what the device did and the host never waits for the device inside a
    step (a device-wide synchronize there would wait for NCCL's streams too, which turns posted receives
    into blocking ones: interleaved 1F1B with 3+ stages deadlocks, every schedule serialises). A span's
    times are read once its end mark has completed, or when the trace is written."""

    # Whether the host waits for the device in a span (runtime/torchfree/schedule_sync.py checks every schedule with
    # it).
    SYNCS_IN_SPANS = False

    def __init__(self, pid: int, process_name: str, *, clock: DeviceClock | None = None,
                 cpu_clock: Callable[[], float] | None = time.thread_time) -> None:
        self.pid = pid
        self.process_name = process_name
        # Each span's CPU time (``cpu_ms``; the main thread's by default, where the engine computes):
        # a span whose wall time exceeds it waited (for its core, a message, a sleep), which a wall-clock
        # timeline alone cannot tell apart from slow compute. None: wall times only.
        self._cpu_clock = cpu_clock
        self._clock = clock if clock is not None else HostClock()
        # Wall-clock anchor + device-clock offsets: comparable across the processes of one run.
        self._wall0_us = time.time_ns() / 1e3
        self._anchor = self._clock.mark()
        self._open: list[tuple[dict[str, Any], Mark, Mark]] = []  # events whose marks are not read yet
        self.events: list[dict[str, Any]] = []

    def _resolve(self, *, wait: bool) -> None:
        """Give the spans whose marks the device has reached (every span: ``wait``) their times."""
        keep = []
        for event, start, end in self._open:
            if wait or end.done():
                t0 = start.seconds_since(self._anchor)
                event["ts"] = round(self._wall0_us + t0 * 1e6, 3)
                event["dur"] = round((end.seconds_since(self._anchor) - t0) * 1e6, 3)
            else:
                keep.append((event, start, end))
        self._open = keep

    @contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        if self._open:
            self._resolve(wait=False)
        start = self._clock.mark()
        cpu0 = self._cpu_clock() if self._cpu_clock is not None else 0.0
        try:
            yield
        finally:
            end = self._clock.mark()
            event = {"name": name, "cat": kind, "ph": "X", "ts": 0.0, "dur": 0.0, "pid": self.pid, "tid": 0}
            out = {k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v) for k, v in args.items()}
            if self._cpu_clock is not None:
                out["cpu_ms"] = round((self._cpu_clock() - cpu0) * 1e3, 4)
            if out:
                event["args"] = out
            self.events.append(event)
            self._open.append((event, start, end))
            if end.done():  # a host clock's always are: the times are known now
                self._resolve(wait=False)

    def chrome_events(self) -> list[dict[str, Any]]:
        self._resolve(wait=True)
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": self.process_name}},
            {"name": "process_sort_index", "ph": "M", "pid": self.pid, "tid": 0, "args": {"sort_index": self.pid}},
            {"name": "thread_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": "program"}},
        ]
        return meta + self.events

    def write(self, path: str | Path) -> None:
        write_chrome_trace(path, self.chrome_events())


def write_chrome_trace(path: str | Path, events: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, json.dumps({"traceEvents": list(events), "displayTimeUnit": "ms"}))


def merge_chrome_traces(paths: Iterable[str | Path], out: str | Path) -> None:
    """One file holding every rank's timeline (one process track per device)."""
    events: list[dict[str, Any]] = []
    for p in paths:
        events.extend(json.loads(Path(p).read_text(encoding="utf-8"))["traceEvents"])
    write_chrome_trace(out, events)


class _Emulation:
    """What both emulation modes share: the wrapped hooks, the seconds slept (``take_emulated_s`` resets
    them, for the per-step log) and the seconds blocks overran their targets (``take_overrun_s``)."""

    def __init__(self, inner: Any, sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
        self.inner = inner
        self.emulated_s = 0.0
        self.overrun_s = 0.0  # stays 0 in stretch mode: a stretched block has no target to overrun
        self._sleep = sleep
        self._clock = clock
        self._compute_depth = 0

    def take_emulated_s(self) -> float:
        out, self.emulated_s = self.emulated_s, 0.0
        return out

    def take_overrun_s(self) -> float:
        out, self.overrun_s = self.overrun_s, 0.0
        return out

    def _inner_span(self, kind: str, name: str, **args: Any) -> AbstractContextManager[None]:
        return self.inner.span(kind, name, **args) if self.inner is not None else nullcontext()


class EmulatedSlowdown(_Emulation):
    """Stretches compute ``slowdown`` times by sleeping after each outermost compute span.

    The compute time of a span is the process's CPU time in it, capped by its wall time (minus any
    comm/idle spans nested in it). CPU time, because a compute span may wait inside a collective the
    engine cannot bracket (DTensor's TP all-reduce inside a layer): stretching that wait would make two
    emulated TP partners sleep on each other's sleeps, step after step. Capped by wall time, because
    several intra-op threads accumulate CPU time faster than the clock.
    """

    def __init__(self, slowdown: float, inner: Any = None, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be at least 1.0, got {slowdown}")
        super().__init__(inner, sleep, clock)
        self.slowdown = slowdown
        self._cpu_clock = cpu_clock
        self._other_depth = 0
        self._base_depth = 0  # non-compute nesting depth at which the current outermost compute span began
        self._excluded = (0.0, 0.0)  # (wall, cpu) seconds of non-compute spans directly inside it

    @contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        compute = kind == "compute"
        outermost = compute and self._compute_depth == 0
        if outermost:
            self._excluded = (0.0, 0.0)
            self._base_depth = self._other_depth
        wall0, cpu0 = self._clock(), self._cpu_clock()
        self._compute_depth += compute
        self._other_depth += not compute
        try:
            with self._inner_span(kind, name, **args):
                yield
        finally:
            self._compute_depth -= compute
            self._other_depth -= not compute
            if not compute and self._compute_depth and self._other_depth == self._base_depth:
                wall, cpu = self._excluded
                self._excluded = (wall + self._clock() - wall0, cpu + self._cpu_clock() - cpu0)
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


class EmulatedTarget(_Emulation):
    """Sleep mode: each outermost compute block that ``target_s`` prices lasts its target.

    After the block's real work the hook waits until the block's wall time since it began reaches
    ``target_s(name, args)`` (None: a block with no target, e.g. the optimizer step, runs as is). Wall
    time, not CPU time as in stretch mode: the target is what the block takes on the emulated device,
    waits inside it (a TP collective) included, and a wait to a deadline keeps the block's length
    independent of how long the real work happened to take. The wait is the OS's sleep to ``spin_s``
    before the deadline, then a spin on the clock: a plain sleep wakes 0.1-0.2 ms late on this host (timer
    slack and wake-up), which over a step's hundreds of blocks would add the host's timer to the emulated
    device's time; the spin costs the core ``spin_s`` per block, a few percent of a mostly sleeping device.
    The device mostly sleeps, so the host's cores are not contended. A block whose real work took longer
    than its target is not hidden: it is recorded as an "emulation" span named "... overran its target"
    (zero length, with the overrun) and summed in ``overrun_s``, and the block simply lasts as long as it
    took; a wait whose sleep woke past its deadline (later than ``spin_s`` after its end) is recorded as an
    "... woke past its target" span and adds its lateness to ``overrun_s`` too: every second a block lasted
    beyond its target. ``last`` holds the latest block's (target, real, slept) seconds, so a test can check
    the rule without timing anything.
    """

    SPIN_S = 0.0005   # on this host a sleep wakes within 0.5 ms of its end 99% of the time with 4 such devices

    def __init__(self, target_s: Callable[[str, Mapping[str, Any]], float | None], inner: Any = None, *,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter,
                 spin_s: float = SPIN_S) -> None:
        super().__init__(inner, sleep, clock)
        self.target_s = target_s
        self.spin_s = spin_s
        self.last: tuple[float, float, float] | None = None

    @contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        target = self.target_s(name, args) if kind == "compute" and self._compute_depth == 0 else None
        if kind == "compute":
            self._compute_depth += 1
        t0 = self._clock()
        try:
            with self._inner_span(kind, name, **args):
                yield
        finally:
            if kind == "compute":
                self._compute_depth -= 1
        if target is None:
            return
        real = self._clock() - t0
        left = target - real
        if left > 0:
            with self._inner_span("emulation", f"{name} (until its target)", target_s=round(target, 6),
                                  compute_s=round(real, 6), sleep_s=round(left, 6)):
                late = self._wait_until(t0 + target)
            self.emulated_s += left
            self.last = (target, real, left)
            if late > 0:   # woke past the deadline, before the spin could start: recorded, not hidden
                with self._inner_span("emulation", f"{name} woke past its target", target_s=round(target, 6),
                                      overrun_s=round(late, 6)):
                    pass
                self.overrun_s += late
        else:
            with self._inner_span("emulation", f"{name} overran its target", target_s=round(target, 6),
                                  compute_s=round(real, 6), overrun_s=round(-left, 6)):
                pass
            self.overrun_s += -left
            self.last = (target, real, 0.0)

    def _wait_until(self, deadline: float) -> float:
        """Sleep, then spin, to ``deadline``; how late the sleep woke past it (0 when the spin ran: it ends
        within a clock reading of the deadline)."""
        coarse = deadline - self._clock() - self.spin_s
        if coarse > 0:
            self._sleep(coarse)
        woke = self._clock()
        if woke >= deadline:   # (within a microsecond, a clock reading's grain: on time)
            return woke - deadline if woke - deadline > 1e-6 else 0.0
        if self.spin_s > 0:
            while self._clock() < deadline:
                pass
        return 0.0
