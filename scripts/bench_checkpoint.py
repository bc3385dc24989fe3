#!/usr/bin/env python
"""Step-time cost of periodic checkpoints: ``hspmd train --save DIR --save-every N`` against the same run
without saving, side by side in one run (alternating, so that drift of the machine hits both alike).

Each run trains the plan for ``--steps`` steps; its time per step is the wall time from the end of step 2 to
the end of the last step but one, divided by the steps between: it includes the periodic saves' pause of
training (the collective gather and the copy to host; the files are written by a background thread) and
excludes start-up and the run's last, synchronous save. ``checkpoint_overhead`` = median time per step with
saving / without (target <= 1.05). ``--json`` prints one JSON object (nothing else on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"


def per_step(options) -> float:
    """Seconds per step between the end of step 2 and the end of the last step but one."""
    from hetu_cli.emulation import emulated
    from runtime.launch import launch

    stamps: dict[int, float] = {}
    launch(emulated(options), on_step=lambda r: stamps.__setitem__(r.step, time.perf_counter()),
           on_log=lambda _line: None)
    first, last = 2, options.steps - 1
    return (stamps[last] - stamps[first]) / (last - first)


def main() -> None:
    from runtime.checkpoint import latest_checkpoint
    from runtime.launch import TrainOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, default=PLAN)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"save": [], "plain": []}
    saves = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in ("save", "plain") if rep % 2 == 0 else ("plain", "save"):
                if mode == "save":
                    out = Path(tmp) / f"ck{rep}"
                    opts = TrainOptions(plan=args.plan, steps=args.steps, save_dir=out, save_every=args.save_every)
                else:
                    opts = TrainOptions(plan=args.plan, steps=args.steps)
                times[mode].append(per_step(opts))
                if mode == "save":
                    latest = latest_checkpoint(out)
                    assert latest is not None and latest.name == f"step-{args.steps:08d}"
                    saves = sum(1 for p in out.iterdir() if p.name.startswith("step-"))
        size = sum(f.stat().st_size for f in (latest or Path(tmp)).iterdir())
    med = {k: statistics.median(v) for k, v in times.items()}
    out_json = {
        "checkpoint_overhead": round(med["save"] / med["plain"], 4),
        "step_s_with_saves": round(med["save"], 4),
        "step_s_without": round(med["plain"], 4),
        "save_every": args.save_every,
        "steps": args.steps,
        "checkpoints_per_run": saves,
        "checkpoint_bytes": size,
        "reps": args.reps,
        "plan": str(args.plan.relative_to(REPO)) if args.plan.is_relative_to(REPO) else str(args.plan),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(out_json))
    else:
        for k, v in out_json.items():
            print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
