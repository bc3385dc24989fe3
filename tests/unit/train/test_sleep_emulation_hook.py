"""runtime/trace.py EmulatedTarget: sleep-mode blocks last their target; overruns are recorded, not hidden."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.trace import EmulatedTarget, TraceRecorder


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def target_hook(targets: dict[str, float], inner=None):
    clock = FakeClock()
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    hook = EmulatedTarget(lambda name, args: targets.get(name), inner, sleep=sleep, clock=clock, spin_s=0.0)
    return hook, clock, slept


def test_a_block_that_finishes_early_sleeps_until_its_target():
    hook, clock, slept = target_hook({"forward": 0.050, "backward": 0.120})
    t0 = clock.t
    with hook.span("compute", "forward", micro_batch=0):
        clock.t += 0.011
    assert clock.t - t0 == pytest.approx(0.050)   # the block lasted its target
    assert hook.last == pytest.approx((0.050, 0.011, 0.039))
    with hook.span("comm", "send forward 0"):
        clock.t += 0.5                              # communication is never stretched
    with hook.span("compute", "backward", micro_batch=0):
        clock.t += 0.020
    assert slept == pytest.approx([0.039, 0.100])
    assert hook.take_emulated_s() == pytest.approx(0.139)
    assert hook.take_emulated_s() == 0.0
    assert hook.take_overrun_s() == 0.0


def test_an_overrun_is_recorded_as_a_span_and_a_metric():
    rec = TraceRecorder(5, "device 5")
    hook, clock, slept = target_hook({"forward": 0.010}, rec)
    with hook.span("compute", "forward", micro_batch=3):
        clock.t += 0.016
    assert slept == []                              # nothing to hide it in: the block took what it took
    assert hook.last == pytest.approx((0.010, 0.016, 0.0))
    assert hook.take_overrun_s() == pytest.approx(0.006)
    assert hook.take_overrun_s() == 0.0
    assert hook.take_emulated_s() == 0.0
    over = [e for e in rec.events if e["cat"] == "emulation"]
    assert len(over) == 1 and "overran" in over[0]["name"]
    assert over[0]["args"]["overrun_s"] == pytest.approx(0.006)
    assert over[0]["args"]["target_s"] == pytest.approx(0.010)


def test_the_trace_records_target_compute_and_sleep_of_each_block():
    rec = TraceRecorder(0, "device 0", cpu_clock=None)   # wall times only: the args are the hook's
    hook, clock, _ = target_hook({"forward": 0.030}, rec)
    with hook.span("compute", "forward", micro_batch=0):
        clock.t += 0.004
    sleep = [e for e in rec.events if e["cat"] == "emulation"]
    assert [e["name"] for e in rec.events] == ["forward", "forward (until its target)"]
    assert sleep[0]["args"] == {"target_s": 0.03, "compute_s": 0.004, "sleep_s": 0.026}


def test_blocks_without_a_target_and_nested_blocks_run_as_they_are():
    hook, clock, slept = target_hook({"forward": 0.050})
    with hook.span("compute", "optimizer"):        # no target: the real step, no sleep
        clock.t += 0.003
    with hook.span("compute", "forward"):
        with hook.span("compute", "forward"):       # nested: only the outermost block has a target
            clock.t += 0.010
    assert slept == pytest.approx([0.040])


def test_the_pricing_sees_the_span_name_and_args():
    seen = []
    clock = FakeClock()
    hook = EmulatedTarget(lambda name, args: seen.append((name, dict(args))) or None, clock=clock,
                          sleep=lambda s: None, spin_s=0.0)
    with hook.span("compute", "backward", micro_batch=2):
        pass
    with hook.span("comm", "grad_sync"):
        pass
    assert seen == [("backward", {"micro_batch": 2})]


@given(target=st.floats(0.0, 10.0), real=st.floats(0.0, 10.0))
@settings(max_examples=200, deadline=None)
def test_every_block_lasts_the_longer_of_its_target_and_its_real_work(target, real):
    hook, clock, _ = target_hook({"forward": target})
    with hook.span("compute", "forward"):
        clock.t += real
    assert clock.t == pytest.approx(max(target, real))
    slept, over = hook.take_emulated_s(), hook.take_overrun_s()
    assert slept >= 0 and over >= 0 and min(slept, over) == pytest.approx(0.0, abs=1e-9)
    assert slept - over == pytest.approx(target - real)


class WakingClock(FakeClock):
    """A host whose sleeps wake ``wake_late_s`` after their end and whose clock advances 1 us per reading
    (so a spin on it ends)."""

    def __init__(self, wake_late_s: float) -> None:
        super().__init__()
        self.wake_late_s = wake_late_s

    def __call__(self) -> float:
        self.t += 1e-6
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s + self.wake_late_s


def one_late_block(wake_late_s: float) -> tuple[EmulatedTarget, TraceRecorder, float]:
    """A 20 ms target, 3 ms of real work, on a host whose sleeps wake ``wake_late_s`` late, with the 0.5 ms
    spin: the hook, its trace and how long the block lasted."""
    clock, rec = WakingClock(wake_late_s), TraceRecorder(0, "device 0", cpu_clock=None)
    hook = EmulatedTarget(lambda name, args: 0.020, rec, clock=clock, sleep=clock.sleep, spin_s=0.0005)
    t0 = clock.t
    with hook.span("compute", "forward"):
        clock.t += 0.003
    return hook, rec, clock.t - t0


@pytest.mark.parametrize("wake_late_s", [0.0, 0.0002, 0.00049])
def test_the_spin_absorbs_a_late_wake_up(wake_late_s):
    """The OS sleep ends 0.5 ms before the deadline and the spin waits out the rest: a wake-up up to that
    late still ends the block at its target (to the fake clock's 1 us readings), and nothing is overrun."""
    hook, rec, lasted = one_late_block(wake_late_s)
    assert lasted == pytest.approx(0.020, abs=5e-6)
    assert hook.take_overrun_s() == 0.0
    assert not [e for e in rec.events if "woke past" in e["name"]]


def test_a_wake_up_later_than_the_spin_is_an_overrun():
    """Woken 2 ms late, past the 0.5 ms spin: the block lasts 1.5 ms beyond its target, reported as overrun
    and recorded in the trace."""
    hook, rec, lasted = one_late_block(0.002)
    assert lasted == pytest.approx(0.0215, abs=5e-6)
    assert hook.take_overrun_s() == pytest.approx(0.0015, abs=5e-6)
    assert hook.take_emulated_s() == pytest.approx(0.017, abs=5e-6)
    late = [e for e in rec.events if e["cat"] == "emulation" and "woke past" in e["name"]]
    assert len(late) == 1 and late[0]["args"]["overrun_s"] == pytest.approx(0.0015, abs=5e-6)
