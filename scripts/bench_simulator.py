"""Simulator fidelity on cpu-hetero4: simulated vs measured (`hspmd train`) step time of several plans.

Profiles the cluster (`hspmd profile`), then for each plan below simulates one step with that profile
and trains it for a few steps, and compares the median measured step time (after warm-up) with the
simulated one. Targets: every relative error <= 10%, and the plans ranked in the same order.

    python scripts/bench_simulator.py [--steps 8] [--profile DIR] [--json]

`--json` prints one JSON object: `errors` (relative error per plan), `max_abs_error`, `rank_preserved`,
plus the simulated and measured seconds. Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
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
from runtime.profiling.profile import resolve_profiles  # noqa: E402
from runtime.spec import load_plan_context  # noqa: E402

TRAINING = {"global_batch": 8, "micro_batch": 1, "seq_len": 64, "zero": False, "schedule": "1f1b", "seed": 0,
            "optimizer": {"lr": 0.001, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "eps": 1.0e-08,
                          "grad_clip": 1.0}}


def stage(devices: list[int], a: int, b: int) -> dict:
    return {"devices": devices, "layers": [a, b], "recompute": False}


# name -> pipelines (micro_batches, stages): DP, TP, PP and mixtures, fast and slow devices. Every plan
# uses at least 2 devices: the launcher gives each worker cores // devices threads, and the profile is
# measured at the 4-device share (1 thread on 2 cores).
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
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_plan(name: str, pipelines: list[dict], out: Path) -> Path:
    plan = {"version": 1, "model": "llama-tiny", "cluster": "cpu-hetero4", "training": TRAINING,
            "strategies": [{"name": name, "pipelines": pipelines}]}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def measured_step(plan: Path, steps: int, warmup: int, out: Path) -> float:
    metrics = out / f"{plan.stem}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", str(steps),
                           "--metrics", str(metrics)], capture_output=True, text=True, timeout=900, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"hspmd train failed on {plan.name}: {proc.stderr.strip().splitlines()[-1:]}")
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per plan (the first 2 are warm-up)")
    ap.add_argument("--profile", type=Path, help="use this profile directory instead of profiling now")
    ap.add_argument("--plans", help="comma-separated subset of: " + ", ".join(PLANS))
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures on stdout")
    args = ap.parse_args()
    names = args.plans.split(",") if args.plans else list(PLANS)
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        out = Path(tmp)
        prof_dir = args.profile
        t0 = time.perf_counter()
        if prof_dir is None:
            prof_dir = out / "profiles"
            log("profiling cpu-hetero4 ...")
            proc = subprocess.run([sys.executable, "-m", "hetu_cli", "profile", "--cluster", "cpu-hetero4", "--out",
                                   str(prof_dir), "--format", "json"], capture_output=True, text=True, timeout=600,
                                  cwd=REPO)
            if proc.returncode != 0:
                raise SystemExit(f"hspmd profile failed: {proc.stderr.strip()}")
        profile_s = time.perf_counter() - t0
        simulated, measured = {}, {}
        for name in names:
            path = write_plan(name, PLANS[name], out)
            ctx = load_plan_context(path)
            profiles = resolve_profiles(ctx.cluster.device_types, [prof_dir])
            cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
            t = ctx.plan.training
            simulated[name] = simulate(cm, ctx.plan.strategies[0], t.global_batch, t.schedule, t.zero).step_time_s
            measured[name] = measured_step(path, args.steps, min(2, args.steps - 1), out)
            log(f"{name:16s} simulated {simulated[name]:.4f} s  measured {measured[name]:.4f} s  "
                f"error {(simulated[name] - measured[name]) / measured[name]:+.1%}")
    errors = {n: (simulated[n] - measured[n]) / measured[n] for n in names}
    rank_sim = sorted(names, key=lambda n: simulated[n])
    rank_meas = sorted(names, key=lambda n: measured[n])
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    concordant = sum(1 for a, b in pairs if (simulated[a] - simulated[b]) * (measured[a] - measured[b]) > 0)
    result = {
        "errors": {n: round(e, 4) for n, e in errors.items()},
        "max_abs_error": round(max(abs(e) for e in errors.values()), 4),
        "rank_preserved": rank_sim == rank_meas,
        "concordant_pairs": f"{concordant}/{len(pairs)}",
        "simulated_s": {n: round(v, 5) for n, v in simulated.items()},
        "measured_s": {n: round(v, 5) for n, v in measured.items()},
        "rank_simulated": rank_sim, "rank_measured": rank_meas,
        "profile_s": round(profile_s, 1), "steps": args.steps,
    }
    if args.json:
        print(json.dumps(result))
    else:
        log(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
