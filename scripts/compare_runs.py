"""Side-by-side measured step times of several `hspmd train --metrics` files.

    python scripts/compare_runs.py NAME=metrics.jsonl NAME=metrics.jsonl [--skip 2] [--json]

The first run is the reference of the ratio column. Warm-up steps (--skip) are left out of the means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def step_times(path: Path, skip: int) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and "event" not in r]
    if len(times) <= skip:
        raise SystemExit(f"error: {path}: only {len(times)} steps, need more than --skip {skip}")
    return times[skip:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=metrics.jsonl")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps to leave out (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    results = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"error: {spec!r}: expected NAME=metrics.jsonl")
        times = step_times(Path(path), args.skip)
        results[name] = {"mean_step_time_s": statistics.fmean(times), "median_step_time_s": statistics.median(times),
                         "steps": len(times)}
    ref = next(iter(results.values()))["mean_step_time_s"]
    for r in results.values():
        r["over_first"] = r["mean_step_time_s"] / ref
    if args.json:
        print(json.dumps(results))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(f"measured step time, mean over the steps after the first {args.skip}:")
    table = Table()
    for col in ("run", "steps", "mean s", "median s", "x first"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, r in results.items():
        table.add_row(name, str(r["steps"]), f"{r['mean_step_time_s']:.4f}", f"{r['median_step_time_s']:.4f}",
                      f"{r['over_first']:.2f}x")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
