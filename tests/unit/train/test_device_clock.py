"""Device time without host waits (runtime/device_clock.py): the event clock and the trace never wait for
the device inside a span, and ``Progress`` tells a device that stopped finishing its work from an idle one.
CUDA events are played by a stand-in stream: records queue, the test lets the "device" run."""

from __future__ import annotations

from runtime.device_clock import EventClock, HostClock, Progress, ProgressHooks, SpanTimes
from runtime.trace import TraceRecorder


class FakeStream:
    """A device stream: recorded events complete when the test runs the device up to them."""

    def __init__(self) -> None:
        self.queued: list[FakeEvent] = []
        self.device_time_ms = 0.0
        self.host_waits = 0  # synchronize() calls on events the device had not reached

    def run(self, ms_each: float = 2.0, count: int | None = None) -> None:
        while self.queued and (count is None or count > 0):
            self.device_time_ms += ms_each
            self.queued.pop(0).time_ms = self.device_time_ms
            count = None if count is None else count - 1


class FakeEvent:
    stream: FakeStream

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.time_ms: float | None = None

    def record(self) -> None:
        self.stream.queued.append(self)

    def query(self) -> bool:
        return self.time_ms is not None

    def synchronize(self) -> None:
        if self.time_ms is None:
            self.stream.host_waits += 1
            self.stream.run()

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.time_ms is not None and end.time_ms is not None
        return end.time_ms - self.time_ms


def event_factory(stream: FakeStream):
    def make(**kw):
        e = FakeEvent(**kw)
        e.stream = stream
        return e
    return make


def test_event_trace_spans_never_wait_for_the_device_and_take_device_times():
    stream = FakeStream()
    rec = TraceRecorder(0, "device 0", clock=EventClock(event_factory(stream)), cpu_clock=None)
    for i in range(3):  # the host runs ahead: nothing completes while the spans are open
        with rec.span("compute", f"F{i}"):
            pass
    assert stream.host_waits == 0 and len(stream.queued) == 7  # anchor + 2 per span, all still queued
    stream.run(count=3)  # the device reaches the end of F0 only
    with rec.span("comm", "post"):
        pass
    assert stream.host_waits == 0
    f0 = rec.events[0]
    assert f0["dur"] == 2000.0  # 2 ms of device time, read without a wait
    events = rec.chrome_events()  # writing the trace may wait: the step is over
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["F0", "F1", "F2", "post"]
    assert all(e["dur"] == 2000.0 for e in spans)
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(spans, spans[1:]))


def test_progress_reports_a_device_that_stops_finishing_its_work():
    stream, now = FakeStream(), [0.0]
    progress = Progress(EventClock(event_factory(stream)), now=lambda: now[0])
    assert progress.stalled_s() == 0.0  # no work: not stalled, however long
    now[0] = 50.0
    assert progress.stalled_s() == 0.0
    progress.mark()
    now[0] = 53.0
    assert progress.stalled_s() == 3.0  # work queued at 50 s, nothing finished since
    stream.run()
    assert progress.stalled_s() == 0.0  # it finished: not stalled
    progress.mark()
    progress.mark()
    now[0] = 60.0
    stream.run(count=1)  # one of the two finishes at 60 s
    assert progress.stalled_s() == 0.0
    now[0] = 64.0
    assert progress.stall() == (4.0, "compute")  # the other has been pending since


def test_a_host_device_is_never_stalled():
    progress = Progress(HostClock())
    progress.mark()
    assert progress.stalled_s() == 0.0


def test_the_program_marks_progress_as_each_span_closes():
    stream = FakeStream()
    progress = Progress(EventClock(event_factory(stream)), now=lambda: 0.0)
    hooks = ProgressHooks(progress, TraceRecorder(0, "device 0", cpu_clock=None))
    with hooks.span("comm", "WaitRecv"):
        pass
    with hooks.span("compute", "F"):
        pass
    assert progress.stall() == (0.0, "comm")  # the receive, then the forward, wait on the device
    stream.run(count=1)  # the device finishes the receive
    assert progress.stall()[1] == "compute"


def test_step_span_times_are_device_times_read_after_the_step():
    stream = FakeStream()
    times = SpanTimes(EventClock(event_factory(stream)))
    for kind in ("compute", "comm", "compute", "step"):  # "step" is not a kind it sums
        with times.span(kind):
            pass
    assert len(stream.queued) == 6 and stream.host_waits == 0  # marks only: nothing waited for
    stream.run()  # the step's statistics are read: the device is done
    assert times.seconds("compute") == 4.0 / 1e3 and times.seconds("comm") == 2.0 / 1e3
    assert stream.host_waits == 0
    times.reset()
    assert times.seconds("compute") == 0.0
