"""scripts/bench_simulator.py's host-speed check: which runs are accepted, repeated, or make the round
re-profile, from the reference workload's times alone (never a rescaled measurement)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[3]


def load_bench():
    name = "bench_simulator_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "bench_simulator.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod   # dataclasses resolve the module's annotations through sys.modules
        spec.loader.exec_module(mod)
    return sys.modules[name]


bench = load_bench()
Check = bench.HostCheck
TOL = bench.HOST_TOLERANCE


def test_a_run_at_the_profiles_speed_is_accepted():
    assert bench.host_verdict([Check(10.0, 10.3, 9.8)], tries=1, reprofiles=0) == "accept"


def test_a_run_in_a_slow_spell_is_repeated():
    assert bench.host_verdict([Check(10.0, 20.0, 19.5)], tries=1, reprofiles=0) == "retry"


def test_a_run_during_which_the_speed_changed_is_repeated():
    # before and after each within tolerance of the profile, but apart by more than it: a drift.
    assert bench.host_verdict([Check(10.0, 9.6, 10.45)], tries=1, reprofiles=0) == "retry"
    # off on one side only: not a persistent shift either, even at the end of a streak.
    drifting = [Check(10.0, 12.0, 12.0)] * 2 + [Check(10.0, 10.0, 12.0)]
    assert bench.host_verdict(drifting, tries=3, reprofiles=0) == "keep"


def test_several_runs_off_the_same_way_reprofile():
    slow = [Check(10.0, 12.0, 12.2)] * bench.HOST_STREAK
    assert bench.host_verdict(slow, tries=1, reprofiles=0) == "reprofile"
    fast = [Check(10.0, 8.0, 8.1)] * bench.HOST_STREAK
    assert bench.host_verdict(fast, tries=1, reprofiles=0) == "reprofile"


def test_off_in_both_directions_is_no_persistent_shift():
    mixed = [Check(10.0, 12.0, 12.0), Check(10.0, 8.0, 8.0), Check(10.0, 12.0, 12.0)]
    assert bench.host_verdict(mixed, tries=1, reprofiles=0) == "retry"


def test_an_accepted_run_breaks_the_streak():
    runs = [Check(10.0, 12.0, 12.0), Check(10.0, 10.0, 10.0), Check(10.0, 12.0, 12.0)]
    assert bench.host_verdict(runs, tries=1, reprofiles=0) == "retry"


def test_the_tries_and_the_reprofiles_are_bounded():
    slow = [Check(10.0, 12.0, 12.0)] * bench.HOST_STREAK
    assert bench.host_verdict(slow, tries=bench.HOST_TRIES, reprofiles=bench.HOST_REPROFILES) == "keep"
    assert bench.host_verdict(slow[:1], tries=bench.HOST_TRIES, reprofiles=0) == "keep"
    assert bench.host_verdict(slow, tries=1, reprofiles=0, max_reprofiles=0) == "retry"


def test_reference_times_must_be_positive():
    with pytest.raises(ValueError):
        Check(0.0, 1.0, 1.0)


ratios = st.floats(0.3, 3.0)


@given(st.lists(st.tuples(ratios, ratios), min_size=1, max_size=6), st.integers(1, 5), st.integers(0, 3))
def test_the_verdict_follows_from_the_ratios(pairs, tries, reprofiles):
    """Accepted exactly when the run was at the profile's speed; a re-profile only after a streak all off
    one way; never a retry past the bound."""
    recent = [Check(1.0, b, a) for b, a in pairs]
    v = bench.host_verdict(recent, tries, reprofiles)
    b, a = pairs[-1]
    at_speed = abs(b - 1) <= TOL and abs(a - 1) <= TOL and abs(a / b - 1) <= TOL
    assert (v == "accept") == at_speed
    if v == "reprofile":
        tail = recent[-bench.HOST_STREAK:]
        assert len(tail) == bench.HOST_STREAK and reprofiles < bench.HOST_REPROFILES
        assert len({c.direction() for c in tail}) == 1 and tail[0].direction() != 0
    if v == "retry":
        assert tries < bench.HOST_TRIES
    if v == "keep":
        assert tries >= bench.HOST_TRIES
