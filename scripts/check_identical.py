"""Whether two checkouts of hspmd plan, simulate and model failure traces byte-identically.

A refactoring that moves code between modules must not change one output. This script captures, in one
checkout, what the user sees of the planner, the simulator and the failure-trace goodput model, as the CLI
prints it (``--format json``, and the plan files ``hspmd plan -o`` writes):

* ``hspmd plan`` on the planner's quality cases (scripts/bench_planner.py: ``CASES`` at global batch 64, the
  search choosing the schedule, ``--check-top 8``), on each fixed schedule of the search's own test cases, two
  cases at global batch 256 and one elastic plan (a refusal is captured as its exit status and message);
* ``hspmd simulate`` of every strategy of every shipped plan (configs/plans);
* ``hspmd simulate --events`` (planner/trace_model.py ``model_trace``) on traces of device and node losses
  and returns.

    python scripts/check_identical.py capture OUT.json [--quick] [--tree CHECKOUT]
    python scripts/check_identical.py compare A.json B.json
    python scripts/check_identical.py against OTHER_CHECKOUT [--quick]   # capture both, compare

``against`` runs ``capture`` in this checkout and in ``OTHER_CHECKOUT`` (each in its own process, with its
own tree first on the path) and compares. ``compare`` exits 1 and names every output that differs. The
checkout's own path and the temporary folder's are written as ``<checkout>`` and ``<tmp>``. A full capture
takes about a minute on an idle core.

Why a clock is frozen: the search stops at a time limit and the trace model charges the planner's measured
wall time as replan time, so two runs on a loaded machine differ by chance. ``capture`` fixes
``time.perf_counter`` at 0 for its whole process: no time limit cuts a search short and every measured wall
time reads 0, so the outputs depend on the code alone. (The ILP solver's own time limit is real time; none
of these cases comes near it.) Outputs are compared as text: any difference, a last digit included, counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (cluster, model, global batch, schedule): bench_planner's quality cases, then the search tests' cases
# under each fixed schedule (gpipe's refusal included), two at global batch 256, and an elastic plan.
PLAN_CASES = [("h800-h20-48", "llama-32b", 64, "auto"), ("h2-example", "llama-13b", 64, "auto"),
              ("hexiscale-mixed", "llama-7b", 64, "auto"), ("hexiscale-mixed", "llama-13b", 64, "auto"),
              ("h2-example", "llama-13b", 64, "1f1b"), ("h2-example", "llama-13b", 64, "zb-h1"),
              ("hexiscale-mixed", "llama-7b", 64, "interleaved"), ("h800-h20-48", "llama-32b", 64, "zb-v"),
              ("hexiscale-mixed", "llama-7b", 64, "gpipe"), ("h2-example", "llama-13b", 256, "auto"),
              ("hexiscale-mixed", "llama-7b", 256, "auto")]
ELASTIC_CASES = [("h2-example", "llama-13b", 64, "auto")]
QUICK_PLAN_CASES = [("h2-example", "llama-13b", 64, "auto"), ("hexiscale-mixed", "llama-7b", 64, "interleaved")]

TWO_NODES = """
nodes:
  - {name: a, device_type: cpu-fast, count: 2}
  - {name: b, device_type: cpu-slow, count: 2}
"""
# (plan, strategy, cluster override or None, trace): losses and returns of single devices and whole nodes.
TRACES = [("cpu-hetero4-dp-pp.yaml", "dp-pp", "two-nodes",
           {"events": [{"step": 50, "action": "kill", "node": "b"}, {"step": 150, "action": "kill", "devices": [1]},
                       {"step": 250, "action": "rejoin", "node": "b"}]}, 400),
          ("cpu-hetero4-dp-pp.yaml", "dp-pp", None,
           {"events": [{"step": 30, "action": "kill", "devices": [3]}, {"step": 60, "action": "rejoin",
                                                                         "devices": [3]}]}, 200),
          ("h800-h20-llama32b.yaml", "hetero", None,
           {"events": [{"step": 150, "action": "kill", "devices": [40]},
                       {"step": 400, "action": "rejoin", "devices": [40]}]}, 600)]


def _cli(args: list[str]) -> str:
    from click.testing import CliRunner

    from hetu_cli.main import cli
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    # A refusal is an output too (the case that cannot fit, and the message that says why).
    return r.stdout if r.exit_code == 0 else f"exit {r.exit_code}\n{r.output}"


def capture(tree: Path, quick: bool) -> dict[str, str]:
    """The outputs of the checkout at ``tree`` (its code imported: ``tree`` goes first on the path)."""
    sys.path.insert(0, str(tree))
    time.perf_counter = lambda: 0.0   # see the module docstring
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cases = QUICK_PLAN_CASES if quick else PLAN_CASES
        for elastic, group in ((False, cases), (True, [] if quick else ELASTIC_CASES)):
            for cluster, model, batch, schedule in group:
                key = f"plan {cluster} {model} b={batch} {schedule}" + (" elastic" if elastic else "")
                print(key, file=sys.stderr, flush=True)
                path = d / "plan.yaml"
                args = ["plan", "--model", model, "--cluster", cluster, "--global-batch", str(batch), "--seq-len",
                        "4096", "--schedule", schedule, "--check-top", "8", "--format", "json", "-o", str(path)]
                out[key] = _cli(args + (["--elastic"] if elastic else []))
                if path.exists():
                    out[key + " (plan file)"] = path.read_text()
                    path.unlink()
        from runtime.torchfree.spec import load_plan
        for plan in sorted((tree / "configs" / "plans").glob("*.yaml")):
            for s in load_plan(plan).strategies:
                key = f"simulate {plan.name} {s.name}"
                print(key, file=sys.stderr, flush=True)
                out[key] = _cli(["simulate", "--plan", str(plan), "--strategy", s.name, "--format", "json"])
        clusters = tree / "configs" / "clusters"
        text = (clusters / "cpu-hetero4.yaml").read_text()
        two = d / "two-nodes.yaml"
        two.write_text(text[:text.index("\nnodes:")].replace("name: cpu-hetero4", "name: cpu-hetero4-2node")
                       + TWO_NODES)
        for i, (plan, strategy, cluster, trace, steps) in enumerate(TRACES[:1] if quick else TRACES):
            key = f"simulate --events {plan} {strategy} trace {i}"
            print(key, file=sys.stderr, flush=True)
            events = d / "trace.yaml"
            events.write_text(json.dumps({"steps": steps, **trace}))
            args = ["simulate", "--plan", str(tree / "configs" / "plans" / plan), "--strategy", strategy,
                    "--events", str(events), "--format", "json"]
            out[key] = _cli(args + (["--cluster", str(two)] if cluster else []))
    # The checkout's and the temporary folder's paths (profile sources, output files) are not behaviour.
    return {k: v.replace(str(tree), "<checkout>").replace(tmp, "<tmp>") for k, v in out.items()}


def compare(a: dict[str, str], b: dict[str, str], names: tuple[str, str]) -> list[str]:
    problems = [f"only in {names[0]}: {k}" for k in a if k not in b]
    problems += [f"only in {names[1]}: {k}" for k in b if k not in a]
    problems += [f"differs: {k}" for k in a if k in b and a[k] != b[k]]
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("out", type=Path)
    c.add_argument("--quick", action="store_true", help="two plans, one trace (a smoke check)")
    c.add_argument("--tree", type=Path, default=REPO, help="the checkout to capture (default: this one)")
    m = sub.add_parser("compare")
    m.add_argument("a", type=Path)
    m.add_argument("b", type=Path)
    g = sub.add_parser("against")
    g.add_argument("other", type=Path)
    g.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.cmd == "capture":
        args.out.write_text(json.dumps(capture(args.tree.resolve(), args.quick), indent=1, sort_keys=True))
        return 0
    if args.cmd == "against":
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for tree in (REPO, args.other.resolve()):
                path = Path(tmp) / f"{len(files)}.json"
                env = {**os.environ, "PYTHONPATH": str(tree)}
                subprocess.run([sys.executable, __file__, "capture", str(path), "--tree", str(tree)]
                               + (["--quick"] if args.quick else []), check=True, env=env, cwd=tree)
                files.append(path)
            a, b = (json.loads(f.read_text()) for f in files)
        names = (str(REPO), str(args.other))
    else:
        a, b = json.loads(args.a.read_text()), json.loads(args.b.read_text())
        names = (str(args.a), str(args.b))
    problems = compare(a, b, names)
    for p in problems:
        print(p)
    print(f"{len(a)} outputs compared: " + ("identical" if not problems else f"{len(problems)} differ"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
