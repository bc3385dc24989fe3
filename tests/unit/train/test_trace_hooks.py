"""runtime/trace.py: Chrome-trace spans and the emulated slowdown, both as Hooks."""

from __future__ import annotations

import json
import time

import pytest

from runtime.trace import EmulatedSlowdown, TraceRecorder, merge_chrome_traces


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class Clocks:
    """Wall and CPU clocks: ``work`` advances both, ``wait`` (blocked in a collective) only the wall."""

    def __init__(self) -> None:
        self.wall, self.cpu = FakeClock(), FakeClock()

    def work(self, s: float) -> None:
        self.wall.advance(s)
        self.cpu.advance(s)

    def wait(self, s: float) -> None:
        self.wall.advance(s)


def emulator(slowdown: float, inner=None):
    clocks = Clocks()
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clocks.wait(s)

    return EmulatedSlowdown(slowdown, inner, sleep=sleep, clock=clocks.wall, cpu_clock=clocks.cpu), clocks, slept


def test_each_compute_block_is_followed_by_k_minus_1_times_its_time():
    emu, clock, slept = emulator(3.0)
    with emu.span("compute", "forward"):
        clock.work(0.010)
    with emu.span("comm", "send"):
        clock.work(0.5)
    with emu.span("compute", "backward"):
        clock.work(0.020)
    assert slept == pytest.approx([0.020, 0.040])
    assert emu.take_emulated_s() == pytest.approx(0.060)
    assert emu.take_emulated_s() == 0.0


def test_comm_nested_in_compute_is_not_stretched_and_nested_compute_counts_once():
    emu, clock, slept = emulator(2.0)
    with emu.span("compute", "step"):
        clock.work(0.010)
        with emu.span("comm", "all-reduce"):
            clock.work(1.0)
            with emu.span("idle", "wait"):
                clock.work(1.0)
        with emu.span("compute", "inner"):
            clock.work(0.005)
        assert slept == []  # nothing until the outermost compute block ends
    assert slept == pytest.approx([0.015])


def test_no_sleep_when_compute_raises_or_slowdown_is_one():
    emu, clock, slept = emulator(4.0)
    with pytest.raises(ValueError):
        with emu.span("compute", "forward"):
            clock.work(0.1)
            raise ValueError("boom")
    assert slept == []
    emu, clock, slept = emulator(1.0)
    with emu.span("compute", "forward"):
        clock.work(0.1)
    assert slept == []
    with pytest.raises(ValueError):
        EmulatedSlowdown(0.5)


def test_trace_records_nested_spans_and_emulation_as_chrome_events(tmp_path):
    rec = TraceRecorder(2, "device 2 (cpu-slow)", cpu_clock=None)   # wall times only
    emu = EmulatedSlowdown(2.0, rec)
    with rec.span("step", "step 1"):
        with emu.span("compute", "forward", micro_batch=0):
            sum(range(20000))
        with emu.span("comm", "send", peer=3):
            pass
    cats = [e["cat"] for e in rec.events]
    assert cats == ["compute", "emulation", "comm", "step"]  # events are recorded as spans close
    by_cat = {e["cat"]: e for e in rec.events}
    assert by_cat["compute"]["args"] == {"micro_batch": 0}
    fwd, emu_ev, step = by_cat["compute"], by_cat["emulation"], by_cat["step"]
    assert emu_ev["ts"] >= fwd["ts"] + fwd["dur"]  # the sleep follows the block it stretches
    assert 0 < emu_ev["args"]["compute_s"] * 1e6 <= emu_ev["dur"] + 1  # slept (2 - 1) x compute
    assert step["ts"] <= fwd["ts"] and step["ts"] + step["dur"] >= emu_ev["ts"] + emu_ev["dur"]
    assert all(e["ph"] == "X" and e["pid"] == 2 for e in rec.events)

    rec.write(tmp_path / "device2.json")
    other = TraceRecorder(3, "device 3")
    with other.span("compute", "forward"):
        pass
    other.write(tmp_path / "device3.json")
    merge_chrome_traces([tmp_path / "device2.json", tmp_path / "device3.json"], tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {2: "device 2 (cpu-slow)", 3: "device 3"}
    assert sum(e["ph"] == "X" for e in events) == 5


def test_trace_spans_carry_their_cpu_time():
    """By default each span records the main thread's CPU time in it: a span that slept, or waited for its
    core or a message, shows wall time beyond its ``cpu_ms``."""
    ticks = iter([1.0, 1.004, 2.0, 2.0005])
    rec = TraceRecorder(0, "device 0", cpu_clock=lambda: next(ticks))
    with rec.span("compute", "forward", micro_batch=1):
        pass
    with rec.span("comm", "wait"):
        time.sleep(0.01)
    fwd, wait = rec.events
    assert fwd["args"] == {"micro_batch": 1, "cpu_ms": 4.0}
    assert wait["args"] == {"cpu_ms": 0.5} and wait["dur"] >= 10_000 > wait["args"]["cpu_ms"] * 1e3


def test_waiting_inside_a_compute_block_is_not_stretched_nor_are_extra_threads_counted_twice():
    emu, clock, slept = emulator(3.0)
    with emu.span("compute", "forward"):  # a TP layer: 10 ms of work, 500 ms blocked in its all-reduce
        clock.work(0.010)
        clock.wait(0.500)
    with emu.span("compute", "backward"):  # two intra-op threads: 40 ms of CPU in 20 ms of wall time
        clock.wall.advance(0.020)
        clock.cpu.advance(0.040)
    assert slept == pytest.approx([0.020, 0.040])
