"""Time and progress as the device sees them, without making the host wait for the device.

On a GPU the host only enqueues work: a host clock read around an action measures its launch, and a
``torch.cuda.synchronize`` to make it mean more waits for every stream of the device, NCCL's included, which
turns a posted receive into a blocking one (docs/design.md §7, "Tracing on GPUs"). So device time is taken
with CUDA events recorded on the current stream: ``mark`` enqueues one and returns at once, and the event's
time is read later, once it has completed (``ready``) or at the step's end, where the host waits for the
stream anyway. On a CPU the work is done when the call returns, and a mark is simply the host clock.

``Progress`` is the same idea for failure detection: the engine marks the device's stream after each action,
and the heartbeat thread asks how long the device has had unfinished work without finishing any of it. A
wedged GPU or a hung NCCL kernel leaves the host thread alive (its heartbeats keep coming) but its marks
unfinished, which only this can tell.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Mark(Protocol):
    """A point on the device's timeline."""

    def done(self) -> bool: ...  # the device has reached it (never waits)

    def seconds_since(self, earlier: Mark) -> float: ...  # device seconds from ``earlier`` (waits for both)


class DeviceClock(Protocol):
    def mark(self) -> Mark: ...

    def bind_thread(self) -> None: ...  # before a thread other than the marking one asks about marks


class _HostMark:
    __slots__ = ("t",)

    def __init__(self, t: float) -> None:
        self.t = t

    def done(self) -> bool:
        return True

    def seconds_since(self, earlier: Mark) -> float:
        assert isinstance(earlier, _HostMark)
        return self.t - earlier.t


class HostClock:
    """The device is the host (CPU): a mark is the moment it is taken."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def mark(self) -> Mark:
        return _HostMark(self._clock())

    def bind_thread(self) -> None:
        pass


class _EventMark:
    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def seconds_since(self, earlier: Mark) -> float:
        assert isinstance(earlier, _EventMark)
        self.event.synchronize()  # this event only: the stream up to here, never the whole device
        return float(earlier.event.elapsed_time(self.event)) / 1e3


class EventClock:
    """A CUDA device: a mark is a timing event recorded on the current stream (``event_factory``:
    ``torch.cuda.Event``, imported at the first mark; a test passes a stand-in). ``device``: where another
    thread that asks about marks must point CUDA first (a thread's CUDA calls go to device 0 until it
    says otherwise, which would open a context there)."""

    def __init__(self, event_factory: Callable[..., Any] | None = None, device: Any = None) -> None:
        self._event, self._device = event_factory, device
        self._bound = threading.local()

    def mark(self) -> Mark:
        if self._event is None:
            import torch

            self._event = torch.cuda.Event
        event = self._event(enable_timing=True)
        event.record()  # on the current stream, behind the work enqueued so far
        return _EventMark(event)

    def bind_thread(self) -> None:
        if self._device is not None and not getattr(self._bound, "done", False):
            import torch

            torch.cuda.set_device(self._device)
            self._bound.done = True


def device_clock(device: Any) -> DeviceClock:
    """The clock of a torch device: events on CUDA, the host clock elsewhere."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return EventClock(device=device) if kind == "cuda" else HostClock()


class Progress:
    """Whether the device keeps finishing its work (thread-safe: the main thread marks, the heartbeat
    thread asks).

    ``mark(kind)`` (after each action; kind "compute" or "comm") enqueues a mark; ``stall`` says how long
    the device has held an unfinished mark without finishing any (0 while it finishes work or has none),
    and the kind of the oldest: a device stalled behind a "comm" mark waits for a peer, one stalled behind
    a "compute" mark is stuck in its own work. Finished marks are dropped as they are found, so the queue
    holds only the device's backlog."""

    def __init__(self, clock: DeviceClock, now: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._now = clock, now
        self._lock = threading.Lock()
        self._pending: deque[tuple[Mark, str]] = deque()
        self._since = now()  # when the device last finished something (or had nothing to do)

    def mark(self, kind: str = "compute") -> None:
        m = self._clock.mark()
        with self._lock:
            if not self._pending:
                self._since = self._now()  # idle until now: the stall, if any, starts here
            if not m.done():
                self._pending.append((m, kind))

    def stall(self) -> tuple[float, str]:
        """(seconds without finishing pending work, the kind of the oldest pending mark); (0, "") when none."""
        with self._lock:
            if self._pending:  # marks exist: the marking thread has set its device up; this one follows
                self._clock.bind_thread()
            finished = False
            while self._pending and self._pending[0][0].done():
                self._pending.popleft()
                finished = True
            if finished or not self._pending:
                self._since = self._now()
            if not self._pending:
                return 0.0, ""
            return self._now() - self._since, self._pending[0][1]

    def stalled_s(self) -> float:
        return self.stall()[0]


class ProgressHooks:
    """The engine's ``Hooks`` (runtime/engine/api.py) that mark ``progress`` as each span closes, around
    ``inner`` (tracing, emulation)."""

    def __init__(self, progress: Progress, inner: Any) -> None:
        self.progress, self.inner = progress, inner

    @contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        with self.inner.span(kind, name, **args):
            yield
        self.progress.mark(kind)


class SpanTimes:
    """Device seconds per kind of span over one step (the engine's ``compute_s``/``comm_s``). Marks are taken
    as spans open and close and read by ``seconds``, which the engine calls once the host has waited for the
    step's statistics (the device is done with every span by then: reading them waits for nothing)."""

    def __init__(self, clock: DeviceClock, kinds: tuple[str, ...] = ("compute", "comm")) -> None:
        self._clock, self.kinds = clock, kinds
        self._spans: list[tuple[str, Mark, Mark]] = []
        self._totals = dict.fromkeys(kinds, 0.0)

    def reset(self) -> None:
        self._spans.clear()
        self._totals = dict.fromkeys(self.kinds, 0.0)

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        if kind not in self._totals:
            yield
            return
        start = self._clock.mark()
        yield
        self._spans.append((kind, start, self._clock.mark()))

    def seconds(self, kind: str) -> float:
        for k, start, end in self._spans:
            self._totals[k] += end.seconds_since(start)
        self._spans.clear()
        return self._totals[kind]
