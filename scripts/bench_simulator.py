"""Simulator fidelity on the emulated CPU cluster: simulated (`hspmd simulate`) vs measured (`hspmd train`)
step time of a set of plans on cpu-hetero4-sleep (2 A800 + 2 H20 running llama-32b's layer shapes,
runtime/torchfree/spec/cluster.py ``Emulation``, sleep mode): each forward / backward block sleeps until it has lasted
its target's price, so the devices barely load the host's cores and the step is set by the plan, the
schedule and the communication, as on GPUs.

Each round profiles the cluster (`hspmd profile`: every figure the simulator uses comes from it, measured
independently of the plans), simulates one step of every plan with that profile, then trains every plan
once (the plans take turns). A plan's measured step time in a round is the median of its steps after 2
warm-up steps (each step's time is the slowest worker's); over rounds, the medians. A run during which
other processes used more than ``--max-foreign`` cores on average is repeated once.

Targets: every plan's relative error within 5%, and every pair of plans measured more than 5% apart ranked
in the measured order.

    python scripts/bench_simulator.py [--steps 10] [--rounds 1] [--modes sleep] [--profile DIR]
                                      [--plans a,b] [--json]

`--json` prints one JSON object: per mode (``sleep``) `errors` (relative error per plan), `max_abs_error`,
`rank_preserved` (the whole order), `separated_pairs_ranked` ("k/n": pairs measured more than 5% apart that
the simulator orders the same way), `within_target`, `simulated_s`, `measured_s`, the per-round figures,
`rounds_max_overrun_s` (per plan and round, the most a step's blocks overran their targets: 0 when the host
kept up) and `foreign_cores`; top level `max_abs_error`, `rank_preserved` and `within_target` by mode.
Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.cost import CostModel  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.spec import load_plan_context  # noqa: E402

# Sequences of 256 tokens (llama-tiny's longest): per micro-batch the compute dominates the fixed costs of
# a step, as in real training; a global batch of 8 in micro-batches of 1 gives every pipeline 8 (or at
# least 2 per DP replica) micro-batches, so 1F1B reaches its steady state and the bubbles still show.
TRAINING = {"global_batch": 8, "micro_batch": 1, "seq_len": 256, "zero": False, "schedule": "1f1b", "seed": 0,
            "optimizer": {"lr": 0.001, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "eps": 1.0e-08,
                          "grad_clip": 1.0}}
WARMUP = 2
# Relative error allowed per plan; plans measured further apart than this must be ranked right.
TARGET = 0.05


def stage(devices: list[int], a: int, b: int) -> dict:
    return {"devices": devices, "layers": [a, b], "recompute": False}


def chunks(devices: list[int], *ranges: tuple[int, int]) -> dict:
    """A stage holding several model chunks (interleaved 1F1B, ZB-V)."""
    return {"devices": devices, "layers": [list(r) for r in ranges], "recompute": False}


# Emulation mode -> the cluster.
MODES = {"sleep": "cpu-hetero4-sleep"}

# name -> pipelines (micro_batches, stages). Devices 0-1 are A800s, 2-3 H20s (~1.8x slower per block).
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
    """(median step time after warm-up, foreign CPU cores during the run, the most any step's blocks overran
    their targets) of one `hspmd train` run."""
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


def simulate_plans(paths: dict[str, Path], prof_dir: Path) -> dict[str, float]:
    """Each plan's simulated step time."""
    out = {}
    for name, path in paths.items():
        ctx = load_plan_context(path)
        profiles = resolve_profiles(ctx.cluster.device_types, [prof_dir])
        cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
        t = ctx.plan.training
        out[name] = simulate(cm, ctx.plan.strategies[0], t.global_batch, t.schedule, t.zero).step_time_s
    return out


def separated_pairs(simulated: dict[str, float], measured: dict[str, float],
                    gap: float = TARGET) -> tuple[int, int]:
    """(pairs ranked right, pairs) among the plans whose measured times lie more than ``gap`` apart
    (relative to the faster one)."""
    names = sorted(measured)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
             if abs(measured[a] - measured[b]) > gap * min(measured[a], measured[b])]
    right = sum(1 for a, b in pairs if (simulated[a] - simulated[b]) * (measured[a] - measured[b]) > 0)
    return right, len(pairs)


def run_mode(mode: str, names: list[str], args: argparse.Namespace, out: Path) -> dict:
    """Every round of one emulation mode: profile, simulate, train each plan; the figures as JSON data."""
    cluster = MODES[mode]
    sims: dict[str, list[float]] = {n: [] for n in names}
    runs: dict[str, list[float]] = {n: [] for n in names}
    foreign_cores: dict[str, list[float]] = {n: [] for n in names}
    overruns: dict[str, list[float]] = {n: [] for n in names}
    profile_s: list[float] = []
    mode_dir = out / mode
    mode_dir.mkdir()
    paths = {name: write_plan(name, PLANS[name], mode_dir, cluster) for name in names}
    for r in range(args.rounds):
        prof_dir = args.profile
        if prof_dir is None:
            prof_dir = mode_dir / f"profiles-{r}"
            log(f"{mode} round {r + 1}: profiling {cluster} (hspmd profile) ...")
            secs, foreign = profile_now(prof_dir, cluster)
            profile_s.append(round(secs, 1))
            log(f"profiled in {secs:.1f} s (other processes: {foreign:.2f} cores)")
        sim = simulate_plans(paths, prof_dir)
        for name in names:
            step, foreign, overrun = measured_step(paths[name], args.steps, mode_dir)
            if foreign > args.max_foreign:
                log(f"{name}: other processes used {foreign:.2f} cores during the run; once more")
                step, foreign, overrun = measured_step(paths[name], args.steps, mode_dir)
            sims[name].append(sim[name])
            runs[name].append(step)
            foreign_cores[name].append(round(foreign, 3))
            overruns[name].append(round(overrun, 5))
            log(f"{mode} round {r + 1} {name:16s} simulated {sim[name]:.4f} s  measured {step:.4f} s  "
                f"(other processes {foreign:.2f} cores; blocks overran their targets by up to {overrun * 1e3:.2f} ms)")
    simulated = {n: statistics.median(v) for n, v in sims.items()}
    measured = {n: statistics.median(v) for n, v in runs.items()}
    errors = {n: (simulated[n] - measured[n]) / measured[n] for n in names}
    rank_sim = sorted(names, key=lambda n: simulated[n])
    rank_meas = sorted(names, key=lambda n: measured[n])
    right, separated = separated_pairs(simulated, measured)
    max_err = max(abs(e) for e in errors.values())
    return {
        "cluster": cluster, "target": TARGET,
        "errors": {n: round(e, 4) for n, e in errors.items()},
        "max_abs_error": round(max_err, 4),
        "rank_preserved": rank_sim == rank_meas,
        "separated_pairs_ranked": f"{right}/{separated}",
        "within_target": max_err <= TARGET and right == separated,
        "simulated_s": {n: round(v, 5) for n, v in simulated.items()},
        "measured_s": {n: round(v, 5) for n, v in measured.items()},
        "simulated_rounds_s": {n: [round(x, 5) for x in v] for n, v in sims.items()},
        "measured_rounds_s": {n: [round(x, 5) for x in v] for n, v in runs.items()},
        "foreign_cores": foreign_cores,
        "rounds_max_overrun_s": overruns,
        "rank_simulated": rank_sim, "rank_measured": rank_meas,
        "profile_s": profile_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help=f"training steps per run (the first {WARMUP} are warm-up)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of profile + one run per plan (medians kept)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated emulation modes: " + ", ".join(MODES))
    ap.add_argument("--max-foreign", type=float, default=0.25,
                    help="repeat a run once if other processes used more CPU cores than this during it")
    ap.add_argument("--profile", type=Path, help="use this profile directory in every round instead of profiling")
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
