"""Simulator fidelity on the emulated CPU clusters: simulated (`hspmd simulate`) vs measured (`hspmd train`)
step time, in both emulation modes (runtime/spec/cluster.py ``Emulation``).

* ``stretch``: cpu-hetero4 (devices 2-3 sleep 2x each compute block: 3x slower). The devices are processes
  sharing this host's cores, so the simulator models the host (shared cores, the scheduler's hand-offs,
  cold caches). Target: every relative error <= 10%, the plans ranked in the same order.
* ``sleep``: cpu-hetero4-sleep (2 A800 + 2 H20 running llama-32b's layer shapes): each forward / backward
  block sleeps until it has lasted its target's price, so the devices barely load the cores and the step is
  set by the plan, the schedule and the communication. Target: every relative error <= 3%, ranking
  preserved.

Each round and mode profiles the mode's cluster (`hspmd profile`: every figure the simulator uses comes
from it, measured independently of the plans below), simulates one step of every plan with that profile,
then trains every plan once (the plans take turns). The same plan structures run in both modes (devices 0-1
fast, 2-3 slow).

    python scripts/bench_simulator.py [--steps 10] [--rounds 3] [--modes stretch,sleep] [--profile DIR]
                                      [--plans a,b] [--json]

The host's speed drifts by 10-30% over seconds to minutes (a shared VM: the same block, alone on its
pinned core, at times runs 1.5-2x slower for a few hundred ms), and the profile is taken on the same host:
so a profile and the runs it is compared with are taken close together, round after round, and both
sides use medians. In stretch mode each round also simulates every plan without the profile's
``core_handoff`` (plain processor sharing of the pinned cores, as before that figure existed), for
comparison. Measured step time of a plan in a round: the median of its steps after 2 warm-up steps (each
step's time is the slowest worker's); the plan's measured time is the median over the rounds, its
simulated time the median of the rounds' simulations. A run during which other processes used more than
``--max-foreign`` cores of CPU on average is repeated once.

Host-speed check (stretch mode): a fixed reference workload (``HostReference``) is timed right after the
round's profile and right before and after every run; ``host_verdict`` and the ``HOST_*`` figures below say
which runs are repeated, kept or re-profiled for. Measured times are never rescaled, only repeated; each
plan's simulation in a round is the one of the profile its run was compared with. With ``--profile`` the
reference is timed at each round's start and nothing is re-profiled; sleep mode records it and acts on none.

`--json` prints one JSON object: per mode
(``stretch``, ``sleep``) `errors` (relative error per plan), `max_abs_error`, `rank_preserved`, `target`,
`within_target` and the figures behind them (per round too; `rounds_max_overrun_s`: per plan and round,
the most a step's blocks overran their sleep-mode targets, which should be 0; `host_speed`: per plan and
round, the kept run's reference times (profile / before / after, in s, and their ratios), its verdict,
retries, the round's re-profiles so far and every attempt; `profile_reference_s`: per round, each
profile's reference time; `repeat_spread`: per plan, (slowest - fastest) / median of all its attempts, the
measurement's own reproducibility, and `median_repeat_spread` over the plans run more than once); top level,
`max_abs_error`, `rank_preserved` and `within_target` by mode. Each mode also re-simulates every plan on the same
profiles without the executor's CPU per boundary message (``errors_without_p2p_actions``, the model before
``comm.p2p_actions``): an ablation on the same measured runs. Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.cost import CostModel  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.profiling.host import emulated_cpu_shares, host_cpus, pinned  # noqa: E402
from runtime.profiling.profile import ProfileSet, ResolvedProfile, load_profile, resolve_profiles  # noqa: E402
from runtime.spec import load_plan_context  # noqa: E402

# Sequences of 256 tokens (llama-tiny's longest): per micro-batch the compute dominates the fixed costs of
# a step, as in real training; a global batch of 8 in micro-batches of 1 gives every pipeline 8 (or at
# least 2 per DP replica) micro-batches, so 1F1B reaches its steady state and the bubbles still show.
TRAINING = {"global_batch": 8, "micro_batch": 1, "seq_len": 256, "zero": False, "schedule": "1f1b", "seed": 0,
            "optimizer": {"lr": 0.001, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "eps": 1.0e-08,
                          "grad_clip": 1.0}}
WARMUP = 2


def stage(devices: list[int], a: int, b: int) -> dict:
    return {"devices": devices, "layers": [a, b], "recompute": False}


def chunks(devices: list[int], *ranges: tuple[int, int]) -> dict:
    """A stage holding several model chunks (interleaved 1F1B, ZB-V)."""
    return {"devices": devices, "layers": [list(r) for r in ranges], "recompute": False}


# Per emulation mode: the cluster and the largest relative error the simulator should make there.
MODES = {"stretch": ("cpu-hetero4", 0.10), "sleep": ("cpu-hetero4-sleep", 0.03)}

# name -> pipelines (micro_batches, stages). Devices 0-1 are fast, 2-3 slower (stretch: 3x; sleep: H20s
# next to A800s, ~1.8x).
# Structurally different: pure DP (even on the fast pair, symmetric over all four, uneven micro-batches),
# pipelines of 2 and 4 stages (uneven layers: the slow devices get fewer), TP 2, and a heterogeneous mix
# (a TP-2 pipeline of fast devices next to a 2-stage pipeline of slow ones, uneven micro-batches).
PLANS: dict[str, list[dict]] = {
    "pp2-fast": [{"micro_batches": 8, "stages": [stage([0], 0, 3), stage([1], 3, 6)]}],
    "dp2-fast": [{"micro_batches": 4, "stages": [stage([0], 0, 6)]},
                 {"micro_batches": 4, "stages": [stage([1], 0, 6)]}],
    "dp4-symmetric": [{"micro_batches": 2, "stages": [stage([d], 0, 6)]} for d in range(4)],
    "dp-uneven": [{"micro_batches": 3, "stages": [stage([0], 0, 6)]},
                  {"micro_batches": 3, "stages": [stage([1], 0, 6)]},
                  {"micro_batches": 1, "stages": [stage([2], 0, 6)]},
                  {"micro_batches": 1, "stages": [stage([3], 0, 6)]}],
    "pp4-uneven": [{"micro_batches": 8, "stages": [stage([0], 0, 2), stage([2], 2, 3), stage([3], 3, 4),
                                                   stage([1], 4, 6)]}],
    "tp2-fast": [{"micro_batches": 8, "stages": [stage([0, 1], 0, 6)]}],
    "hetero-tp2-pp2": [{"micro_batches": 6, "stages": [stage([0, 1], 0, 6)]},
                       {"micro_batches": 2, "stages": [stage([2], 0, 3), stage([3], 3, 6)]}],
    # The schedules beyond 1F1B (docs/schedules.md): split backward, model chunks (uneven), the V.
    "pp4-uneven-zb-h1": [{"micro_batches": 8, "schedule": "zb-h1",
                          "stages": [stage([0], 0, 2), stage([2], 2, 3), stage([3], 3, 4), stage([1], 4, 6)]}],
    "pp2-interleaved": [{"micro_batches": 8, "schedule": "interleaved",
                         "stages": [chunks([0], (0, 2), (4, 5)), chunks([2], (2, 4), (5, 6))]}],
    "pp3-interleaved": [{"micro_batches": 8, "schedule": "interleaved",
                         "stages": [chunks([0], (0, 1), (3, 4)), chunks([2], (1, 2), (4, 5)),
                                    chunks([1], (2, 3), (5, 6))]}],
    "pp2-zb-v": [{"micro_batches": 8, "schedule": "zb-v",
                  "stages": [chunks([0], (0, 2), (5, 6)), chunks([2], (2, 4), (4, 5))]}],
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# The host-speed check. This VM's host at times runs it at about half speed for seconds (one fixed block,
# alone on its core: 15, 25, 25, 25, 25, 24, 11, 12, 12, 12 ms in consecutive 1-s windows), so a profile and a
# run taken in different speed spells disagree by 25-45% whatever the simulator does. A run is compared
# only with a profile taken at the same host speed; measured times are never rescaled, only repeated.
# 5%: half the 10% stretch-mode target, so a shift the check lets through cannot by itself miss it; the
# reference's own spread on a quiet box is a few percent (median of its blocks), spells are 2x.
HOST_TOLERANCE = 0.05
# Runs of one plan per profile (the first and two repeats): a spell lasts seconds, a run 2-10 s, so a
# third try usually lands in the profile's speed or the shift is persistent (then the streak rule acts).
HOST_TRIES = 3
# This many consecutive runs (any plans) all off in the same direction: the host's speed has moved, not
# spiked; the profile is retaken (and every plan re-simulated) rather than waiting for the old speed.
HOST_STREAK = 3
# Re-profiles per round at most (each costs a profile, about 2 minutes), so a restless host ends the round.
HOST_REPROFILES = 2
# The reference workload: the block the profiler times for pp2-fast's first stage (embedding + 3 layers,
# 256 tokens, forward + backward: 11-12 ms on a quiet full-speed core, 17-19 ms at load 1.3); the median of
# REFERENCE_REPS blocks (0.3-0.5 s: shorter than a spell, long enough that a preemption does not move it).
REFERENCE_LAYERS, REFERENCE_SEQ, REFERENCE_REPS, REFERENCE_WARMUP = 3, 256, 20, 2

Verdict = Literal["accept", "retry", "reprofile", "keep"]


@dataclasses.dataclass(frozen=True)
class HostCheck:
    """The reference workload's time right after the profile and right before and after one run."""

    profile_s: float
    before_s: float
    after_s: float

    def __post_init__(self) -> None:
        if min(self.profile_s, self.before_s, self.after_s) <= 0:
            raise ValueError(f"reference times must be positive: {self}")

    def direction(self, tolerance: float = HOST_TOLERANCE) -> int:
        """+1: before and after both slower than the profile's host by more than ``tolerance``; -1: both
        faster; 0: otherwise (at the profile's speed, or off on one side only: a drift)."""
        ratios = (self.before_s / self.profile_s, self.after_s / self.profile_s)
        if all(r > 1 + tolerance for r in ratios):
            return 1
        if all(r < 1 - tolerance for r in ratios):
            return -1
        return 0

    def matches(self, tolerance: float = HOST_TOLERANCE) -> bool:
        """The run ran at the profile's host speed: before and after within ``tolerance`` of the profile's
        and of each other (no speed change during the run)."""
        return (abs(self.before_s / self.profile_s - 1) <= tolerance
                and abs(self.after_s / self.profile_s - 1) <= tolerance
                and abs(self.after_s / self.before_s - 1) <= tolerance)

    def as_json(self) -> dict:
        return {"profile_s": round(self.profile_s, 6), "before_s": round(self.before_s, 6),
                "after_s": round(self.after_s, 6), "before_ratio": round(self.before_s / self.profile_s, 4),
                "after_ratio": round(self.after_s / self.profile_s, 4)}


def host_verdict(recent: Sequence[HostCheck], tries: int, reprofiles: int, *, tolerance: float = HOST_TOLERANCE,
                 max_tries: int = HOST_TRIES, streak: int = HOST_STREAK,
                 max_reprofiles: int = HOST_REPROFILES) -> Verdict:
    """What to do with the latest run (``recent[-1]``): ``accept`` it (the profile's host speed), ``retry``
    it, ``reprofile`` (the last ``streak`` runs since the profile all off in one direction), or ``keep`` it
    although off (``tries`` runs of this plan against this profile and no re-profile left: recorded as
    such). ``recent``: the round's runs since its latest profile, oldest first; ``reprofiles``: so far."""
    last = recent[-1]
    if last.matches(tolerance):
        return "accept"
    d = last.direction(tolerance)
    if (d != 0 and reprofiles < max_reprofiles and len(recent) >= streak
            and all(c.direction(tolerance) == d for c in recent[-streak:])):
        return "reprofile"
    return "retry" if tries < max_tries else "keep"


class HostReference:
    """The fixed reference workload, run in this process on the cores (and with the thread count) the
    launcher gives device 0 of ``cluster_devices``, so it sees the host as the first device does."""

    def __init__(self, model: object, cluster_devices: int) -> None:
        from runtime.profiling.compute import StageRun

        self.threads, pins = emulated_cpu_shares([0], cluster_devices, host_cpus())
        self.cpus = pins[0]
        self.run = StageRun(model, 1, REFERENCE_LAYERS, True, False, 1, REFERENCE_SEQ, "cpu")  # type: ignore[arg-type]

    def time_s(self) -> float:
        """The median forward + backward time of the block; this process's affinity and threads restored
        after (the training runs it starts must get every core)."""
        with pinned(self.cpus, self.threads):
            for _ in range(REFERENCE_WARMUP):
                self.run.prepare_backward()()
            times = []
            for _ in range(REFERENCE_REPS):
                t0 = time.perf_counter()
                self.run.prepare_backward()()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def write_plan(name: str, pipelines: list[dict], out: Path, cluster: str) -> Path:
    plan = {"version": 1, "model": "llama-tiny", "cluster": cluster, "training": TRAINING,
            "strategies": [{"name": name, "pipelines": pipelines}]}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


class ForeignCpu:
    """CPU used by processes other than ours (and our children) while a block runs, in cores."""

    def __enter__(self) -> ForeignCpu:
        self.busy0, self.ours0, self.t0 = _busy_s(), _children_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(1e-9, time.perf_counter() - self.t0)
        self.cores = max(0.0, ((_busy_s() - self.busy0) - (_children_s() - self.ours0)) / wall)


def _busy_s() -> float:
    """Seconds all cores spent busy since boot (Linux /proc/stat; 0 elsewhere)."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measured_step(plan: Path, steps: int, out: Path) -> tuple[float, float, float]:
    """(median step time after warm-up, foreign CPU cores during the run, the most any step's sleep-mode
    blocks overran their targets: 0 in stretch mode) of one `hspmd train` run."""
    metrics = out / f"{plan.stem}.jsonl"
    with ForeignCpu() as foreign:
        proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps",
                               str(steps), "--metrics", str(metrics)], capture_output=True, text=True, timeout=900,
                              cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"hspmd train failed on {plan.name}: {proc.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows]
    overrun = max((r.get("emulation_overrun_s", 0.0) for r in rows[WARMUP:]), default=0.0)
    return statistics.median(times[WARMUP:]), foreign.cores, overrun


def profile_now(prof_dir: Path, cluster: str) -> tuple[float, float]:
    """Run `hspmd profile` of ``cluster`` into ``prof_dir``: (seconds, foreign CPU cores meanwhile)."""
    t0 = time.perf_counter()
    with ForeignCpu() as foreign:
        proc = subprocess.run([sys.executable, "-m", "hetu_cli", "profile", "--cluster", cluster,
                               "--out", str(prof_dir), "--format", "json"], capture_output=True, text=True,
                              timeout=600, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"hspmd profile failed: {proc.stderr.strip()}")
    return time.perf_counter() - t0, foreign.cores


def simulate_plans(paths: dict[str, Path], prof_dir: Path, handoff: bool = True,
                   p2p_actions: bool = True) -> dict[str, float]:
    """Each plan's simulated step time; ``handoff=False``: without the profile's ``core_handoff`` (the
    scheduler's delays and cold caches on a busy core), i.e. plain processor sharing, for comparison;
    ``p2p_actions=False``: without the executor's CPU per boundary message (the model before it)."""
    out = {}
    for name, path in paths.items():
        ctx = load_plan_context(path)
        profiles = resolve_profiles(ctx.cluster.device_types, [prof_dir])
        if not handoff:
            profiles = ProfileSet({t: ResolvedProfile(dataclasses.replace(profiles[t], models={
                k: dataclasses.replace(m, core_handoff={}) for k, m in profiles[t].models.items()}), None)
                for t in profiles})
        if not p2p_actions:
            profiles = ProfileSet({t: ResolvedProfile(dataclasses.replace(profiles[t], comm=dataclasses.replace(
                profiles[t].comm, p2p_actions=None)), None) for t in profiles})
        cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
        t = ctx.plan.training
        out[name] = simulate(cm, ctx.plan.strategies[0], t.global_batch, t.schedule, t.zero).step_time_s
    return out


def profile_handoff(prof_dir: Path) -> dict:
    """The measured ``core_handoff`` of the profile (its first type; every emulated type has the same), in ms."""
    for path in sorted(prof_dir.glob("*.measured.yaml")):
        for m in load_profile(path).models.values():
            return {s: {k: round(v * 1e3, 3) for k, v in dataclasses.asdict(h).items()}
                    for s, h in sorted(m.core_handoff.items())}
    return {}


def repeat_spread(times: Sequence[float]) -> float:
    """(slowest - fastest) / median of repeated measurements of one plan; 0 for a single run."""
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0


def run_mode(mode: str, names: list[str], args: argparse.Namespace, out: Path) -> dict:
    """Every round of one emulation mode: profile, simulate, train each plan (each run checked against the
    profile's host speed); the figures as JSON data."""
    cluster, target = MODES[mode]
    host_model = mode == "stretch"   # sleep-mode devices are outside the simulator's host model
    sims: dict[str, list[float]] = {n: [] for n in names}
    plain: dict[str, list[float]] = {n: [] for n in names}   # without core_handoff
    bare: dict[str, list[float]] = {n: [] for n in names}    # without the CPU per boundary message
    handoffs: list[dict] = []
    runs: dict[str, list[float]] = {n: [] for n in names}
    foreign_cores: dict[str, list[float]] = {n: [] for n in names}
    overruns: dict[str, list[float]] = {n: [] for n in names}   # sleep mode: blocks past their targets
    host_speed: dict[str, list[dict]] = {n: [] for n in names}
    profile_s: list[float] = []
    profile_foreign: list[float] = []
    profile_reference_s: list[list[float]] = []   # per round: each profile's reference time (re-profiles too)
    mode_dir = out / mode
    mode_dir.mkdir()
    paths = {name: write_plan(name, PLANS[name], mode_dir, cluster) for name in names}
    ctx = load_plan_context(paths[names[0]])
    reference = HostReference(ctx.model, ctx.cluster.num_devices)
    # Sleep mode: recorded only; its blocks sleep up to their targets' prices whatever the host's speed
    # (``rounds_max_overrun_s`` shows when the host was too slow for that).
    max_reprofiles = HOST_REPROFILES if args.profile is None else 0   # a given profile cannot be retaken

    def profile(r: int, n: int) -> tuple[Path, float, dict[str, float], dict[str, float], dict[str, float]]:
        """A profile (unless given), its reference time, the plans' simulations (and without core_handoff)."""
        prof_dir = args.profile
        if prof_dir is None:
            prof_dir = mode_dir / f"profiles-{r}-{n}"
            log(f"{mode} round {r + 1}: profiling {cluster} (hspmd profile) ...")
            secs, foreign = profile_now(prof_dir, cluster)
            profile_s.append(round(secs, 1))
            profile_foreign.append(round(foreign, 3))
            log(f"profiled in {secs:.1f} s (other processes: {foreign:.2f} cores)")
        ref_s = reference.time_s()
        profile_reference_s[-1].append(round(ref_s, 6))
        log(f"host reference after the profile: {ref_s * 1e3:.2f} ms")
        sim = simulate_plans(paths, prof_dir)
        no_handoff: dict[str, float] = {}
        if host_model:
            no_handoff = simulate_plans(paths, prof_dir, handoff=False)
            handoffs.append(profile_handoff(prof_dir))
            log(f"core_handoff (ms): {handoffs[-1]}")
        return prof_dir, ref_s, sim, no_handoff, simulate_plans(paths, prof_dir, p2p_actions=False)

    for r in range(args.rounds):
        profile_reference_s.append([])
        reprofiles = 0
        _, ref_s, sim, no_handoff, no_actions = profile(r, reprofiles)
        recent: list[HostCheck] = []   # this round's runs since its latest profile
        for name in names:
            tries, attempts, foreign_rerun = 0, [], False
            while True:
                before = reference.time_s()
                step, foreign, overrun = measured_step(paths[name], args.steps, mode_dir)
                after = reference.time_s()
                if foreign > args.max_foreign and not foreign_rerun:
                    log(f"{name}: other processes used {foreign:.2f} cores during the run; once more")
                    foreign_rerun = True
                    continue
                check = HostCheck(ref_s, before, after)
                tries += 1
                recent.append(check)
                verdict: Verdict = host_verdict(recent, tries, reprofiles, max_reprofiles=max_reprofiles) \
                    if host_model else "accept"
                attempts.append({**check.as_json(), "measured_s": round(step, 5), "verdict": verdict})
                why = (f"host reference {before * 1e3:.2f} ms before, {after * 1e3:.2f} ms after the run, "
                       f"{ref_s * 1e3:.2f} ms after the profile")
                if verdict == "retry":
                    log(f"{name}: {why}: not the profile's host speed (tolerance {HOST_TOLERANCE:.0%}); once more")
                elif verdict == "reprofile":
                    log(f"{name}: {why}: {HOST_STREAK} runs in a row off in the same direction; the host's speed "
                        "moved: profiling again and re-simulating")
                    reprofiles += 1
                    _, ref_s, sim, no_handoff, no_actions = profile(r, reprofiles)
                    recent, tries = [], 0
                elif verdict == "keep":
                    log(f"{name}: {why}: still off after {tries} runs; kept, recorded as off")
                if verdict in ("accept", "keep"):
                    break
            # The simulation of the profile this run was accepted against (earlier plans of the round may
            # have been accepted against an earlier profile: theirs stays).
            sims[name].append(sim[name])
            bare[name].append(no_actions[name])
            if host_model:
                plain[name].append(no_handoff[name])
            runs[name].append(step)
            foreign_cores[name].append(round(foreign, 3))
            overruns[name].append(round(overrun, 5))
            host_speed[name].append({**check.as_json(), "verdict": verdict, "retries": tries - 1,
                                     "reprofiles": reprofiles, "attempts": attempts})
            log(f"{mode} round {r + 1} {name:16s} simulated {sims[name][-1]:.4f} s  measured {step:.4f} s  "
                f"(other processes {foreign:.2f} cores; host {before / ref_s:.3f}x / {after / ref_s:.3f}x "
                "the profile's reference time before / after)")
    simulated = {n: statistics.median(v) for n, v in sims.items()}
    measured = {n: statistics.median(v) for n, v in runs.items()}
    errors = {n: (simulated[n] - measured[n]) / measured[n] for n in names}
    rank_sim = sorted(names, key=lambda n: simulated[n])
    rank_meas = sorted(names, key=lambda n: measured[n])
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    concordant = sum(1 for a, b in pairs if (simulated[a] - simulated[b]) * (measured[a] - measured[b]) > 0)
    max_err = max(abs(e) for e in errors.values())
    # How far one plan's back-to-back runs (the host-speed check's retries, same profile) lie apart: an error
    # target below this spread cannot be told from the measurement's own noise.
    spread = {n: round(repeat_spread([a["measured_s"] for h in host_speed[n] for a in h["attempts"]]), 4)
              for n in names}
    repeated = [v for n, v in spread.items() if sum(len(h["attempts"]) for h in host_speed[n]) > 1]
    result = {
        "cluster": cluster, "target": target,
        "errors": {n: round(e, 4) for n, e in errors.items()},
        "max_abs_error": round(max_err, 4),
        "rank_preserved": rank_sim == rank_meas,
        "within_target": max_err <= target and rank_sim == rank_meas,
        "concordant_pairs": f"{concordant}/{len(pairs)}",
        "simulated_s": {n: round(v, 5) for n, v in simulated.items()},
        "measured_s": {n: round(v, 5) for n, v in measured.items()},
        "simulated_rounds_s": {n: [round(x, 5) for x in v] for n, v in sims.items()},
        "measured_rounds_s": {n: [round(x, 5) for x in v] for n, v in runs.items()},
        "foreign_cores": foreign_cores,
        "rounds_max_overrun_s": overruns,
        "rank_simulated": rank_sim, "rank_measured": rank_meas,
        "profile_s": profile_s, "profile_foreign_cores": profile_foreign,
        "host_speed": host_speed, "profile_reference_s": profile_reference_s,
        "host_tolerance": HOST_TOLERANCE,
        "repeat_spread": spread,
        "median_repeat_spread": round(statistics.median(repeated), 4) if repeated else None,
    }
    bare_sim = {n: statistics.median(v) for n, v in bare.items()}
    bare_errors = {n: (bare_sim[n] - measured[n]) / measured[n] for n in names}
    result.update({
        "errors_without_p2p_actions": {n: round(e, 4) for n, e in bare_errors.items()},
        "max_abs_error_without_p2p_actions": round(max(abs(e) for e in bare_errors.values()), 4),
        "simulated_without_p2p_actions_s": {n: round(v, 5) for n, v in bare_sim.items()},
    })
    if host_model:
        plain_sim = {n: statistics.median(v) for n, v in plain.items()}
        plain_errors = {n: (plain_sim[n] - measured[n]) / measured[n] for n in names}
        result.update({
            "errors_without_handoff": {n: round(e, 4) for n, e in plain_errors.items()},
            "max_abs_error_without_handoff": round(max(abs(e) for e in plain_errors.values()), 4),
            "rank_preserved_without_handoff": sorted(names, key=lambda n: plain_sim[n]) == rank_meas,
            "simulated_without_handoff_s": {n: round(v, 5) for n, v in plain_sim.items()},
            "core_handoff_ms": handoffs,
        })
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help=f"training steps per run (the first {WARMUP} are warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of profile + one run per plan (medians kept)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated emulation modes: " + ", ".join(MODES))
    ap.add_argument("--max-foreign", type=float, default=0.25,
                    help="repeat a run once if other processes used more CPU cores than this during it")
    ap.add_argument("--profile", type=Path, help="use this profile directory in every round instead of profiling "
                    "(it must hold the profiles of every mode's cluster)")
    ap.add_argument("--plans", help="comma-separated subset of: " + ", ".join(PLANS))
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures on stdout")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must be more than the {WARMUP} warm-up steps")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    names = args.plans.split(",") if args.plans else list(PLANS)
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        raise SystemExit(f"--plans: unknown plan(s) {', '.join(unknown)} (have: {', '.join(PLANS)})")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: unknown mode(s) {', '.join(bad)} (have: {', '.join(MODES)})")
    load_before = os.getloadavg()[0]
    log(f"load average {load_before:.2f} (prefer < 1.5: other processes distort the timings)")
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        per_mode = {mode: run_mode(mode, names, args, Path(tmp)) for mode in modes}
    result: dict = {
        **per_mode,
        "max_abs_error": {m: r["max_abs_error"] for m, r in per_mode.items()},
        "rank_preserved": {m: r["rank_preserved"] for m, r in per_mode.items()},
        "within_target": {m: r["within_target"] for m, r in per_mode.items()},
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "steps": args.steps, "warmup": WARMUP, "rounds": args.rounds, "training": TRAINING,
    }
    if args.json:
        print(json.dumps(result))
    else:
        log(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
