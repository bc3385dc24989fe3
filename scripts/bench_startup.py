#!/usr/bin/env python
"""Start-up of the verbs that do not train, against the bare imports they cannot avoid.

Side by side, in one run, alternating so that drift of the machine hits both alike: wall time of
``hspmd validate PLAN`` (the installed entry point when it sits beside this interpreter, else
``python -m hetu_cli``) and of ``python -c "import yaml, click, rich"``; also ``hspmd --help`` and
``hspmd simulate``. ``ratio`` = median validate / median baseline; target <= 1.5 (docs/design.md §8:
the planning half imports no torch). ``--json`` prints one JSON object (nothing else on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"


def hspmd_command() -> list[str]:
    exe = Path(sys.executable).with_name("hspmd")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hetu_cli"]


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = ap.parse_args()
    hspmd = hspmd_command()
    cases = {
        "baseline": [sys.executable, "-c", "import yaml, click, rich"],
        "validate": [*hspmd, "validate", str(PLAN)],
        "help": [*hspmd, "--help"],
        "simulate": [*hspmd, "simulate", "--plan", str(PLAN)],
    }
    for cmd in cases.values():  # warm the file cache once
        timed(cmd)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.reps):
        for name, cmd in cases.items():
            times[name].append(timed(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        **{f"{k}_s": round(med[k], 4) for k in ("validate", "baseline", "help", "simulate")},
        "ratio": round(med["validate"] / med["baseline"], 3),
        "help_ratio": round(med["help"] / med["baseline"], 3),
        "reps": args.reps,
        "command": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(hspmd)),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
        "which_hspmd": shutil.which("hspmd"),
        # Without cached bytecode every start compiles our modules again (make install precompiles them).
        "bytecode_written": not sys.dont_write_bytecode,
        "bytecode_cached": (REPO / "runtime" / "__pycache__").is_dir(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>14}: {v}")


if __name__ == "__main__":
    main()
