"""Everything the planner and the simulator output on fixed inputs, as exact text: to show a refactoring of
the cost model, the search or the simulator changes no number.

    python scripts/pricing_fingerprint.py --write before.json    # on the code before the change
    python scripts/pricing_fingerprint.py --check before.json    # after it: exit 1 and the first differences

Covered: the planner quality cases of scripts/bench_planner.py (global batch 64; every ranked candidate's
plan, estimate and simulated step), every shipped plan (configs/plans: each strategy's simulation and
estimate, per stage and event), and the simulator-fidelity plans of scripts/bench_simulator.py on the
sleep-mode cluster's datasheet profiles. Floats are written with ``repr``: equal text means equal bits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_planner  # noqa: E402
import bench_simulator  # noqa: E402

from planner.cost import CostModel  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.profiling.profile import resolve_profiles  # noqa: E402
from runtime.spec import load_cluster, load_model, load_plan_context  # noqa: E402


def exact(x: object) -> object:
    """``x`` with every float as its repr (JSON would round-trip it, but say so explicitly)."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): exact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [exact(v) for v in x]
    return x


def simulated_plan(path: Path) -> dict:
    ctx = load_plan_context(path)
    t = ctx.plan.training
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, resolve_profiles(ctx.cluster.device_types))
    out = {}
    for s in ctx.plan.strategies:
        r = simulate(cm, s, t.global_batch, t.schedule, t.zero)
        est = cm.estimate(s, t.global_batch, t.schedule, t.zero)
        out[s.name] = {"simulation": r.to_json(),
                       "events": [[e.name, e.category, e.pipeline, e.stage, e.start_s, e.end_s] for e in r.events],
                       "estimate": [est.step_time_s, est.tokens_per_s, est.mfu, list(est.oom_devices)]}
    return out


def fingerprint() -> dict:
    out: dict = {"quality": {}, "plans": {}, "fidelity_plans": {}}
    for name, cluster, model in bench_planner.CASES:
        r = bench_planner.run_plan(load_model(model), load_cluster(cluster), 64)
        out["quality"][name] = {"candidates": [[c.summary, c.step_time_s, c.simulated_s] for c in r.candidates],
                                "lower_bound": r.lower_bound.step_time_s, "efficiency": r.efficiency}
        print(f"quality {name}: {r.best.summary}", file=sys.stderr, flush=True)
    for path in sorted((REPO / "configs" / "plans").glob("*.yaml")):
        out["plans"][path.name] = simulated_plan(path)
    tmp = REPO / ".fingerprint-plans"
    tmp.mkdir(exist_ok=True)
    try:
        for name, pipelines in bench_simulator.PLANS.items():
            path = bench_simulator.write_plan(name, pipelines, tmp, bench_simulator.MODES["sleep"])
            out["fidelity_plans"][name] = simulated_plan(path)
    finally:
        for p in tmp.glob("*.yaml"):
            p.unlink()
        tmp.rmdir()
    return exact(out)  # type: ignore[return-value]


def differences(a: object, b: object, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only on one side" for k in sorted(set(a) ^ set(b))]
        return out + [d for k in a if k in b for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="write the fingerprint to this file")
    group.add_argument("--check", type=Path, help="compare with the fingerprint in this file")
    args = ap.parse_args()
    now = fingerprint()
    if args.write:
        args.write.write_text(json.dumps(now, indent=1, sort_keys=True))
        return 0
    diff = differences(json.loads(args.check.read_text()), now)
    for d in diff[:20]:
        print(d)
    print(f"{len(diff)} difference(s)" if diff else "identical")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
