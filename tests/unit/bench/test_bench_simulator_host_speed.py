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


def test_a_round_repeats_reprofiles_and_pairs_each_run_with_its_profile(monkeypatch, tmp_path):
    """run_mode's wiring, the cluster's processes replaced by scripted figures: three slow runs of the
    first plan re-profile the round; the plan's kept run is then compared with (and simulated from) the new
    profile, and the JSON says so. The measured time kept is the accepted run's, unscaled."""
    import argparse

    refs = iter([10.0,                       # after profile 0
                 12.0, 12.0, 12.0, 12.0, 12.0, 12.0,   # pp2-fast: three runs 20% slow -> re-profile
                 12.0,                       # after profile 1
                 12.1, 11.9,                 # pp2-fast at the new profile's speed: accepted
                 12.2, 11.8])                # dp2-fast: accepted
    steps = iter([0.30, 0.31, 0.32, 0.25, 0.20])
    profiles = []

    class Reference:
        def __init__(self, model, cluster_devices):
            pass

        def time_s(self):
            return next(refs)

    def profile_now(prof_dir, cluster):
        profiles.append(prof_dir.name)
        return 1.0, 0.0

    def simulate_plans(paths, prof_dir, handoff=True, p2p_actions=True):
        k = len(profiles)   # which profile this simulation used
        return {n: k + (0.5 if handoff else 0.0) - (0.0 if p2p_actions else 0.25) for n in paths}

    monkeypatch.setattr(bench, "HostReference", Reference)
    monkeypatch.setattr(bench, "profile_now", profile_now)
    monkeypatch.setattr(bench, "simulate_plans", simulate_plans)
    monkeypatch.setattr(bench, "profile_handoff", lambda prof_dir: {})
    monkeypatch.setattr(bench, "measured_step", lambda plan, n, out: (next(steps), 0.0, 0.0))
    args = argparse.Namespace(rounds=1, steps=10, max_foreign=0.25, profile=None)
    res = bench.run_mode("stretch", ["pp2-fast", "dp2-fast"], args, tmp_path)

    assert profiles == ["profiles-0-0", "profiles-0-1"]
    assert res["profile_reference_s"] == [[10.0, 12.0]]
    assert res["measured_rounds_s"] == {"pp2-fast": [0.25], "dp2-fast": [0.20]}
    assert res["simulated_rounds_s"] == {"pp2-fast": [2.5], "dp2-fast": [2.5]}   # the second profile's
    # ... and the ablation without the CPU per message, on the same profile
    assert res["simulated_without_p2p_actions_s"] == {"pp2-fast": 2.25, "dp2-fast": 2.25}
    pp2 = res["host_speed"]["pp2-fast"][0]
    assert [a["verdict"] for a in pp2["attempts"]] == ["retry", "retry", "reprofile", "accept"]
    assert (pp2["verdict"], pp2["reprofiles"], pp2["retries"], pp2["profile_s"]) == ("accept", 1, 0, 12.0)
    dp2 = res["host_speed"]["dp2-fast"][0]
    assert (dp2["verdict"], dp2["retries"], len(dp2["attempts"])) == ("accept", 0, 1)
    assert next(refs, None) is None and next(steps, None) is None   # nothing run beyond the script


def test_repeat_spread_is_the_range_over_the_median():
    assert bench.repeat_spread([0.5, 0.6, 0.4]) == pytest.approx(0.2 / 0.5)
    assert bench.repeat_spread([0.3]) == 0.0
