"""Time and progress as the device sees them, without making the host wait for the device.

On a GPU the host only enqueues work: a host clock read around an action measures its launch, and a
``torch.cuda.synchronize`` to make it mean more waits for every stream of the device, NCCL's included, which
turns a posted receive into a blocking one (docs/design.md §6, "Tracing on GPUs"). So device time is taken
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
from collections.abc import Callable
from typing import Any, Protocol


class Mark(Protocol):
    """A point on the device's timeline."""

    def done(self) -> bool: ...  # the device has reached it (never waits)

    def seconds_since(self, earlier: Mark) -> float: ...  # device seconds from ``earlier`` (waits for both)


class DeviceClock(Protocol):
    def mark(self) -> Mark: ...


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
    ``torch.cuda.Event``; a test passes a stand-in)."""

    def __init__(self, event_factory: Callable[..., Any] | None = None) -> None:
        if event_factory is None:
            import torch

            event_factory = torch.cuda.Event
        self._event = event_factory

    def mark(self) -> Mark:
        event = self._event(enable_timing=True)
        event.record()  # on the current stream, behind the work enqueued so far
        return _EventMark(event)


def device_clock(device: Any) -> DeviceClock:
    """The clock of a torch device: events on CUDA, the host clock elsewhere."""
    return EventClock() if getattr(device, "type", device) == "cuda" else HostClock()


class Progress:
    """Whether the device keeps finishing its work (thread-safe: the main thread marks, the heartbeat
    thread asks).

    ``mark`` (after each action) enqueues a mark; ``stalled_s`` is how long the device has held an unfinished
    mark without finishing any: 0 while it finishes work or has none. Marks already finished are dropped as
    they are found, so the queue holds only the device's backlog."""

    def __init__(self, clock: DeviceClock, now: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._now = clock, now
        self._lock = threading.Lock()
        self._pending: deque[Mark] = deque()
        self._since = now()  # when the device last finished something (or had nothing to do)

    def mark(self) -> None:
        m = self._clock.mark()
        with self._lock:
            if not self._pending:
                self._since = self._now()  # idle until now: the stall, if any, starts here
            if not m.done():
                self._pending.append(m)

    def stalled_s(self) -> float:
        with self._lock:
            finished = False
            while self._pending and self._pending[0].done():
                self._pending.popleft()
                finished = True
            if finished or not self._pending:
                self._since = self._now()
            return self._now() - self._since if self._pending else 0.0
