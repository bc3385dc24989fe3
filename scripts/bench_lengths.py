#!/usr/bin/env python3
"""Mixed-length documents: hspmd's multi-strategy plan with balanced dispatch vs one fixed strategy and vs a
HotSPa-like baseline (issue 13).

1. Modelled, at the HSPMD paper's scale (llama-32b, 200K-token steps, 100 steps of the default long-tailed
   distribution, clusters h20-32 and h800-h20-48), every step priced by ``runtime.dispatch``'s time model on
   the profiles' cost model (planner/lengths.py):
   * hspmd: ``plan_lengths``'s strategies, per step the dispatcher's choice (switches at their modelled
     fused-BSR cost), documents balanced over pipelines and micro-batches (``runtime.dispatch.assign``);
   * fixed: the best whole-cluster plan the planner gives for the longest document (``planned at max``
     candidates; the best on these very 100 steps) on the fixed-length data path: documents packed into
     rows of the maximum length, one row per micro-batch, rows dealt by the plan's micro-batch counts
     (``planner.lengths.packed_rows``); ``fixed_balanced``: the same strategies with hspmd's dispatch
     (``speedup_over_fixed_balanced``: what the multi-strategy plan alone gains);
   * hotspa_like: per bucket the best symmetric strategy (``planner.baselines.best_symmetric``), switching
     among them by the same rule, documents dealt round-robin (``planner.lengths.round_robin``).
   ``speedup_over_fixed`` = fixed / hspmd total time, ``speedup_over_hotspa_like`` likewise.
2. Measured on cpu-hetero4 (sleep-emulated) with llama-tiny: needs ``hspmd train --lengths ... --metrics``
   (branch lengths-rt); reported "unavailable" with the reason until the command exists.

    python scripts/bench_lengths.py --json [--part modelled|measured|all] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.lengths import (  # noqa: E402
    LengthSettings,
    balanced,
    context_for,
    packed_rows,
    plan_lengths,
    play,
    round_robin,
    symmetric_candidates,
)
from runtime.documents import DEFAULT_DISTRIBUTION, SyntheticDocuments, length_distribution  # noqa: E402
from runtime.profiling.profile import resolve_profiles  # noqa: E402
from runtime.spec import load_cluster, load_model  # noqa: E402

TARGET_OVER_FIXED = 1.3
TARGET_OVER_HOTSPA = 1.1


def modelled(cluster_name: str, model_name: str, tokens: int, steps: int, seed: int) -> dict:
    t0 = time.perf_counter()
    model = load_model(model_name, file="--model", field="")
    cluster = load_cluster(cluster_name, file="--cluster", field="")
    profiles = resolve_profiles(cluster.device_types, [])
    max_len = model.max_seq_len
    dist = length_distribution(DEFAULT_DISTRIBUTION, max_len)
    settings = LengthSettings(tokens_per_step=tokens, max_len=max_len, seed=seed)
    result = plan_lengths(model, cluster, profiles, dist, settings)
    lengths_of = SyntheticDocuments(dist, tokens, max_len, model.vocab_size, seed).lengths
    run = range(steps)

    def trace_of(members, dispatcher=balanced):
        named, switch = context_for(members, model, cluster, settings)
        return play(named, lengths_of, run, switch, dispatcher)

    hspmd = trace_of(list(result.strategies))
    singles = [c for c in result.candidates if c.origin == "planned" and c.max_seq_len == max_len]
    rows = [(trace_of([c], packed_rows(max_len, [p.micro_batches for p in c.strategy.pipelines])), c)
            for c in singles]
    fixed_trace, fixed_cand = min(rows, key=lambda x: x[0].total_s)
    fixed_bal_trace, fixed_bal_cand = min(((trace_of([c]), c) for c in singles), key=lambda x: x[0].total_s)
    sym = symmetric_candidates(model, cluster, profiles, settings)
    sym = [c for c in sym if c.max_seq_len < max_len] + [c for c in sym if c.max_seq_len == max_len][:1]
    hotspa = trace_of(sym, round_robin) if any(c.max_seq_len == max_len for c in sym) else None

    def summary(tr):
        return {"total_s": tr.total_s, "mean_step_s": tr.mean_step_s, "switches": tr.switches,
                "switch_s": sum(s.switch_s for s in tr.steps),
                "mean_imbalance": sum(s.imbalance for s in tr.steps) / len(tr.steps),
                "strategy_steps": tr.to_json()["strategy_steps"]}

    out = {
        "cluster": cluster_name, "model": model_name, "tokens_per_step": tokens, "steps": steps,
        "distribution": dist.name, "max_len": max_len,
        "strategies": [{"name": f"len-{c.max_seq_len}", "max_seq_len": c.max_seq_len, "summary": c.summary}
                       for c in result.strategies],
        "hspmd": summary(hspmd),
        "fixed": {**summary(fixed_trace), "summary": fixed_cand.summary,
                  "dispatch": f"documents packed into rows of {max_len} tokens, rows dealt by micro-batch counts"},
        "fixed_balanced": {**summary(fixed_bal_trace), "summary": fixed_bal_cand.summary,
                           "dispatch": "hspmd's balanced dispatch (runtime.dispatch.assign)"},
        "hotspa_like": None if hotspa is None else {**summary(hotspa),
                                                    "strategies": [c.summary for c in sym]},
        "speedup_over_fixed": fixed_trace.total_s / hspmd.total_s,
        "speedup_over_hotspa_like": None if hotspa is None else hotspa.total_s / hspmd.total_s,
        # The multi-strategy plan's share of the gain: the fixed strategy given hspmd's dispatch too.
        "speedup_over_fixed_balanced": fixed_bal_trace.total_s / hspmd.total_s,
        "targets": {"speedup_over_fixed": TARGET_OVER_FIXED, "speedup_over_hotspa_like": TARGET_OVER_HOTSPA},
        "model_of_time": "runtime.dispatch pipeline_time on the profiles' cost model (planner/lengths.py "
                         "strategy_cost) + gradient sync / optimizer (CostModel.estimate) + modelled fused-BSR "
                         "switches",
        "wall_s": time.perf_counter() - t0,
    }
    return out


def measured_unavailable() -> dict | None:
    """Why the measured part cannot run here, or None when ``hspmd train`` has ``--lengths`` and ``--metrics``."""
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--help"], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 or "--lengths" not in text or "--metrics" not in text:
        return {"status": "unavailable",
                "reason": "hspmd train has no --lengths/--metrics documents mode in this tree (branch lengths-rt "
                          "not merged); no measured numbers"}
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="Print the results as JSON.")
    ap.add_argument("--part", choices=("modelled", "measured", "all"), default="all")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clusters", nargs="+", default=["h20-32", "h800-h20-48"])
    args = ap.parse_args()
    out: dict = {}
    if args.part in ("modelled", "all"):
        out["modelled"] = {c: modelled(c, "llama-32b", args.tokens, args.steps, args.seed) for c in args.clusters}
    if args.part in ("measured", "all"):
        out["measured"] = measured_unavailable() or measured()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for c, r in out.get("modelled", {}).items():
            print(f"{c}: hspmd {r['hspmd']['mean_step_s']:.3f} s/step, fixed {r['fixed']['mean_step_s']:.3f}, "
                  f"speedup over fixed {r['speedup_over_fixed']:.3f}, over hotspa-like "
                  f"{r['speedup_over_hotspa_like']}")
        if "measured" in out:
            print("measured:", json.dumps(out["measured"]))
    return 0


def measured() -> dict:
    raise NotImplementedError


if __name__ == "__main__":
    sys.exit(main())
