"""Op by op: a measured `hspmd train --trace` run next to the simulator's timeline of the same plan.

    python scripts/compare_trace.py --plan PLAN [--profile DIR] --trace DIR [--skip 2] [--json]

For every compute op (device, F / B / W, micro-batch, chunk) and the optimizer step: the simulator's start
and duration (planner/simulate.py ``Event``) and the measured medians over the steps after ``--skip``
warm-up steps (start from the step's first device start; duration from the compute span's start to the end
of the emulation sleep that follows it, if any), with their ratio, then per device and op kind the sums
per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.cost import CostModel  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.spec import load_plan_context  # noqa: E402

# runtime/torchfree/engine/describe.py COMPUTE_NAMES -> the simulator's labels (its F, B, W; B also the fused backward)
LETTER = {"forward": "F", "backward": "B", "input_grad": "B", "weight_grad": "W", "optimizer": "opt"}
Key = tuple[int, str, int, int]   # device, letter, micro-batch (-1: none), chunk


def simulated(plan: Path, profiles: list[Path]) -> tuple[float, dict[Key, tuple[float, float]]]:
    """The simulated step time and per op (start, duration) in seconds."""
    ctx = load_plan_context(plan)
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, resolve_profiles(ctx.cluster.device_types, profiles))
    t = ctx.plan.training
    strat = ctx.plan.strategies[0]
    res = simulate(cm, strat, t.global_batch, t.schedule, t.zero)
    ops: dict[Key, tuple[float, float]] = {}
    for e in res.events:
        if e.category not in ("forward", "backward", "optimizer"):
            continue
        letter, _, chunk = e.name.partition("/")
        letter = "opt" if e.category == "optimizer" else letter[0]
        for d in strat.pipelines[e.pipeline].stages[e.stage].devices:
            ops[d, letter, -1 if e.micro_batch is None else e.micro_batch, int(chunk or 0)] = (
                e.start_s, e.end_s - e.start_s)
    return res.step_time_s, ops


def measured(trace_dir: Path, skip: int) -> tuple[float, dict[Key, tuple[float, float]]]:
    """The median step (first device's start to last device's end) and per op the medians of (start,
    duration with its emulation sleep) in seconds, over the steps after ``skip``."""
    events = [e for e in json.loads((trace_dir / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    by_dev: dict[int, list[dict]] = defaultdict(list)
    steps: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_dev[e["pid"]].append(e)
        if e["cat"] == "step":
            steps[int(e["name"].split()[-1])].append(e)
    for lst in by_dev.values():
        lst.sort(key=lambda e: e["ts"])
    samples: dict[Key, list[tuple[float, float]]] = defaultdict(list)
    spans = []
    for n in sorted(steps)[skip:]:
        t0 = min(e["ts"] for e in steps[n])
        t1 = max(e["ts"] + e["dur"] for e in steps[n])
        spans.append((t1 - t0) / 1e6)
        for dev, lst in by_dev.items():
            mine = [e for e in lst if t0 <= e["ts"] <= t1 and e["cat"] in ("compute", "emulation")]
            for i, e in enumerate(mine):
                if e["cat"] != "compute" or e["name"] not in LETTER:
                    continue
                end = e["ts"] + e["dur"]
                if i + 1 < len(mine) and mine[i + 1]["cat"] == "emulation":
                    end = mine[i + 1]["ts"] + mine[i + 1]["dur"]
                a = e.get("args", {})
                mb = -1 if e["name"] == "optimizer" else int(a.get("micro_batch", -1))
                samples[dev, LETTER[e["name"]], mb, int(a.get("chunk", 0))].append(
                    ((e["ts"] - t0) / 1e6, (end - e["ts"]) / 1e6))
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(2)) for k, v in samples.items()}
    return (statistics.median(spans) if spans else 0.0), med  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--profile", type=Path, action="append", default=[],
                    help="profile directory to simulate with (repeatable; default: the cluster's own figures)")
    ap.add_argument("--trace", type=Path, required=True, help="the --trace directory of an `hspmd train` run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps to leave out (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    sim_step, sim = simulated(args.plan, args.profile)
    meas_step, meas = measured(args.trace, args.skip)
    keys = sorted(set(sim) & set(meas), key=lambda k: (k[0], sim[k][0]))
    rows = [{"device": k[0], "op": k[1], "micro_batch": k[2], "chunk": k[3],
             "sim_start_ms": sim[k][0] * 1e3, "sim_ms": sim[k][1] * 1e3,
             "meas_start_ms": meas[k][0] * 1e3, "meas_ms": meas[k][1] * 1e3}
            for k in keys]
    figures = ("sim_ms", "meas_ms")
    sums: dict[tuple[int, str], dict[str, float]] = defaultdict(lambda: dict.fromkeys(figures, 0.0))
    for r in rows:
        for f in figures:
            sums[r["device"], r["op"]][f] += r[f]
    totals = [{"device": d, "op": op, **s} for (d, op), s in sorted(sums.items())]
    if args.json:
        print(json.dumps({"simulated_step_s": sim_step, "measured_step_s": meas_step, "ops": rows, "totals": totals}))
        return 0
    print(f"step: simulated {sim_step * 1e3:.1f} ms, measured {meas_step * 1e3:.1f} ms (median span, first start "
          "to last end)")
    print(f"{'dev':>3} {'op':>3} {'mb':>3} {'ch':>2} | {'sim start':>9} {'dur':>7} | {'meas start':>10} "
          f"{'dur':>7} | {'dur x':>5}")
    for r in rows:
        print(f"{r['device']:>3} {r['op']:>3} {r['micro_batch']:>3} {r['chunk']:>2} | {r['sim_start_ms']:9.2f} "
              f"{r['sim_ms']:7.2f} | {r['meas_start_ms']:10.2f} {r['meas_ms']:7.2f} | "
              f"{r['meas_ms'] / max(1e-9, r['sim_ms']):5.2f}")
    print("per device and op, per step (ms): simulated duration  |  measured duration")
    for t in totals:
        print(f"  device {t['device']} {t['op']:>3}: {t['sim_ms']:8.2f}  |  {t['meas_ms']:8.2f}   "
              f"x{t['meas_ms'] / max(1e-9, t['sim_ms']):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
