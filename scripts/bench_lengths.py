#!/usr/bin/env python3
"""Mixed-length documents: hspmd's multi-strategy plan with balanced dispatch vs one fixed strategy and vs a
HotSPa-like baseline.

1. Modelled, at the HSPMD paper's scale (llama-32b, 200K-token steps, 100 steps of the default long-tailed
   distribution, clusters h20-32 and h800-h20-48), every step priced by ``runtime.torchfree.dispatch``'s time model on
   the profiles' cost model (planner/lengths.py):
   * hspmd: ``plan_lengths``'s strategies, per step the dispatcher's choice (switches at their modelled
     fused-BSR cost), documents balanced over pipelines and micro-batches (``runtime.torchfree.dispatch.assign``);
   * fixed: the best whole-cluster plan the planner gives for the longest document (``planned at max``
     candidates; the best on these very 100 steps) on the fixed-length data path: documents packed into
     rows of the maximum length, one row per micro-batch, rows dealt by the plan's micro-batch counts
     (``planner.lengths.packed_rows``); ``fixed_balanced``: the same strategies with hspmd's dispatch
     (``speedup_over_fixed_balanced``: what the multi-strategy plan alone gains);
   * hotspa_like: per bucket the best symmetric strategy (``planner.baselines.best_symmetric``), switching
     among them by the same rule, documents dealt round-robin (``planner.lengths.round_robin``), each
     strategy's memory priced alone (HotSPa frees a strategy's state when it switches away; hspmd's plans
     are priced with every strategy's state side by side, as this runtime keeps them: ``planner.lengths
     .shared``).
   ``speedup_over_fixed`` = fixed / hspmd total time, ``speedup_over_hotspa_like`` likewise.
2. Measured with llama-tiny on cpu-hetero4-long64k (sleep mode at paper-scale lengths and memory: each real
   token stands for 256 of llama-70b's layer shapes, the devices' memory is the A800's and H20's for those
   shapes; configs/clusters/cpu-hetero4-long64k.yaml: at these lengths the plan has two strategies, switched
   per step), lengths up to its maximum, 512-token steps, 20 steps after a warm-up step: hspmd's plan
   (``plan_lengths`` on that cluster) vs the best single strategy for the longest document (``single_best``,
   as a one-strategy plan), both trained by ``hspmd train --lengths longtail --dispatch-costs profiles
   --metrics`` (the runtime's dispatch with the planner's costs):
   ``measured_speedup_over_fixed`` from the mean measured step times, and per run the simulator's error on
   the same steps (``predicted_steps``: each step's documents on the strategy the run chose, priced as in
   part 1), what of it the blocks' overruns of their sleep targets explain, whether the run dispatched
   as modelled, its per-step strategy choices and switches (measured transfer time and bytes). A run that
   fails makes the part "unavailable" with the reason (never numbers).

    python scripts/bench_lengths.py --json [--part modelled|measured|all] [--steps 100]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.lengths import (  # noqa: E402
    LengthSettings,
    build_plan,
    context_for,
    packed_rows,
    plan_lengths,
    play,
    round_robin,
    symmetric_candidates,
)
from runtime.documents import DEFAULT_DISTRIBUTION, SyntheticDocuments, length_distribution  # noqa: E402
from runtime.torchfree.dispatch import assign  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.spec import load_cluster, load_model, save_plan  # noqa: E402

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

    def trace_of(members, dispatcher=assign, side_by_side=True):
        named, switch = context_for(members, model, cluster, settings, side_by_side=side_by_side)
        return play(named, lengths_of, run, switch, dispatcher)

    hspmd = trace_of(list(result.strategies))
    singles = [c for c in result.candidates if c.origin == "planned" and c.max_seq_len == max_len]
    rows = [(trace_of([c], packed_rows(max_len, [p.micro_batches for p in c.strategy.pipelines])), c)
            for c in singles]
    fixed_trace, fixed_cand = min(rows, key=lambda x: x[0].total_s)
    fixed_bal_trace, fixed_bal_cand = min(((trace_of([c]), c) for c in singles), key=lambda x: x[0].total_s)
    sym = symmetric_candidates(model, cluster, profiles, settings)
    sym = [c for c in sym if c.max_seq_len < max_len] + [c for c in sym if c.max_seq_len == max_len][:1]
    # HotSPa frees a strategy's state when it switches away: each of its strategies is priced with its own
    # memory alone (hspmd's with every strategy's state side by side, as this runtime keeps them).
    hotspa = trace_of(sym, round_robin, side_by_side=False) if any(c.max_seq_len == max_len for c in sym) else None

    def summary(tr):
        return {"total_s": tr.total_s, "mean_step_s": tr.mean_step_s, "switches": tr.switches,
                "switch_s": sum(s.switch_s for s in tr.steps),
                "mean_imbalance": sum(s.imbalance for s in tr.steps) / len(tr.steps),
                "strategy_steps": tr.to_json()["strategy_steps"]}

    return {
        "cluster": cluster_name, "model": model_name, "tokens_per_step": tokens, "steps": steps,
        "distribution": dist.name, "max_len": max_len,
        "strategies": [{"name": f"len-{c.max_seq_len}", "max_seq_len": c.max_seq_len, "summary": c.summary}
                       for c in result.strategies],
        "hspmd": summary(hspmd),
        "fixed": {**summary(fixed_trace), "summary": fixed_cand.summary,
                  "dispatch": f"documents packed into rows of {max_len} tokens, rows dealt by micro-batch counts"},
        "fixed_balanced": {**summary(fixed_bal_trace), "summary": fixed_bal_cand.summary,
                           "dispatch": "hspmd's balanced dispatch (runtime.torchfree.dispatch.assign)"},
        "hotspa_like": None if hotspa is None else {**summary(hotspa), "strategies": [c.summary for c in sym],
                                                    "memory": "each strategy alone (states freed on a switch)"},
        "speedup_over_fixed": fixed_trace.total_s / hspmd.total_s,
        "speedup_over_hotspa_like": None if hotspa is None else hotspa.total_s / hspmd.total_s,
        # The multi-strategy plan's share of the gain: the fixed strategy given hspmd's dispatch too.
        "speedup_over_fixed_balanced": fixed_bal_trace.total_s / hspmd.total_s,
        "targets": {"speedup_over_fixed": TARGET_OVER_FIXED, "speedup_over_hotspa_like": TARGET_OVER_HOTSPA},
        "model_of_time": "runtime.torchfree.dispatch pipeline_time on the profiles' cost model (planner/lengths.py "
                         "strategy_cost) + gradient sync / optimizer (CostModel.estimate) + modelled fused-BSR "
                         "switches",
        "wall_s": time.perf_counter() - t0,
    }


def train(plan: Path, lengths: str, steps: int, metrics: Path, timeout_s: float,
          profile_dirs: list[Path]) -> tuple[list[dict], str | None]:
    """``hspmd train`` on documents, dispatching with the planner's costs (``--dispatch-costs profiles``, as the
    simulator prices the steps); (per-step metrics, None) or ([], why it did not run)."""
    cmd = [sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--lengths", lengths,
           "--steps", str(steps), "--metrics", str(metrics), "--dispatch-costs", "profiles"]
    for d in profile_dirs:
        cmd += ["--profile", str(d)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return [], f"hspmd train did not finish within {timeout_s:g} s"
    if proc.returncode != 0:
        lines = [x for x in (proc.stderr + proc.stdout).splitlines() if x.strip()]
        return [], (lines[-1] if lines else f"hspmd train exited with {proc.returncode}")
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return [r for r in records if "event" not in r], None


def predicted_steps(plan_path: Path, lengths: str, records: list[dict],
                    profile_dirs: list[Path]) -> list[tuple[float, float]]:
    """The model's (step time, makespan) for each measured step, on the strategy the run chose for it: balanced
    dispatch of that step's documents (the run's own source, a pure function of seed and step) priced by the
    profiles' cost model (planner/lengths.py, the strategies' memory side by side as the run holds them), plus
    gradient sync / optimizer, plus the modelled switch where the run switched."""
    from hetu_cli.commands.lengths_report import strategies_of
    from runtime.launch.options import TrainOptions
    from runtime.launch.session import document_source_of
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan_path)
    profiles = resolve_profiles(ctx.cluster.device_types, profile_dirs)
    members = {m.name: m for m in strategies_of(ctx, profiles)}
    source = document_source_of(ctx, TrainOptions(plan=plan_path, lengths=lengths))
    out = []
    for r in records:
        m = members[r["strategy"]]
        a = assign(list(source.lengths(r["step"])), m.cost.pipelines)
        out.append((a.makespan + m.fixed_s + (r.get("switch_modelled_s") or 0.0), a.makespan))
    return out


def run_summary(records: list[dict], predicted: list[tuple[float, float]]) -> dict:
    """Measured against modelled over a run's steady steps. ``emulation_overrun_s``: how long blocks ran past
    their sleep targets (the host's own compute floor, which the targets and so the model do not carry);
    ``dispatch_s``: the dispatch's own computing time (measured, not modelled)."""
    meas = [r["step_time_s"] for r in records]
    pred = [p for p, _ in predicted]
    over = [r.get("emulation_overrun_s", 0.0) for r in records]
    n = len(meas)
    return {"steps": n, "measured_step_s": sum(meas) / n, "simulated_step_s": sum(pred) / n,
            "simulator_error": (sum(pred) - sum(meas)) / sum(meas),
            "simulator_step_error": sum(abs(p - m) / m for p, m in zip(pred, meas)) / n,
            "emulation_overrun_s": sum(over) / n,
            "simulator_error_without_overrun": (sum(pred) - (sum(meas) - sum(over))) / sum(meas),
            "dispatch_s": sum(r.get("dispatch_s", 0.0) for r in records) / n,
            # the run's own dispatch predicted the same makespan as the model: it dispatched as modelled
            "dispatch_as_modelled": sum(1 for r, (_, mk) in zip(records, predicted)
                                        if abs(r.get("predicted_s", -1.0) - mk) <= 1e-9 * max(1.0, mk)) / n,
            "switches": sum(1 for r in records if r.get("switched_from")),
            "switch_s": sum(r.get("switch_s", 0.0) for r in records if r.get("switched_from")),
            "switch_bytes": sum(r.get("switch_bytes", 0) for r in records if r.get("switched_from")),
            "choices": [r["strategy"] for r in records],
            "strategy_steps": {s: sum(1 for r in records if r["strategy"] == s)
                               for s in dict.fromkeys(r["strategy"] for r in records)}}


def measured(cluster_name: str, steps: int, tokens: int, seed: int, timeout_s: float,
             profile_dirs: list[Path]) -> dict:
    """hspmd's plan vs the best single strategy for the longest document, both trained on the same documents
    (``hspmd train --lengths``, the runtime's own dispatch with the planner's costs), measured step times
    after the first step."""
    t0 = time.perf_counter()
    model = load_model("llama-tiny", file="--model", field="")
    dist_name = DEFAULT_DISTRIBUTION
    cluster = load_cluster(cluster_name, file="--cluster", field="")
    profiles = resolve_profiles(cluster.device_types, profile_dirs)
    max_len = model.max_seq_len
    settings = LengthSettings(tokens_per_step=tokens, max_len=max_len, seed=seed)
    result = plan_lengths(model, cluster, profiles, length_distribution(dist_name, max_len), settings)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        plans = {"hspmd": Path(tmp) / "hspmd.yaml", "fixed": Path(tmp) / "fixed.yaml"}
        save_plan(result.to_plan("llama-tiny", cluster_name), plans["hspmd"])
        save_plan(build_plan([result.single_best], settings, "llama-tiny", cluster_name), plans["fixed"])
        for key, path in plans.items():
            records, why = train(path, dist_name, steps + 1, Path(tmp) / f"{key}.jsonl", timeout_s, profile_dirs)
            if why is not None:
                return {"status": "unavailable", "cluster": cluster_name, "reason": f"{key}: {why}"}
            steady = records[1:]   # the first step pays for allocations and warm-up
            runs[key] = {"strategies": [s.summary for s in (result.strategies if key == "hspmd"
                                                             else [result.single_best])],
                         **run_summary(steady, predicted_steps(path, dist_name, steady, profile_dirs))}
    return {"status": "measured", "cluster": cluster_name, "model": "llama-tiny", "tokens_per_step": tokens,
            "steps": steps, "distribution": dist_name,
            "plan": [{"name": f"len-{c.max_seq_len}", "max_seq_len": c.max_seq_len, "summary": c.summary}
                     for c in result.strategies], **runs,
            "fixed_is": "the best single whole-cluster plan for the longest document, trained with hspmd's "
                        "dispatch (the modelled part's fixed_balanced: what the plan's strategies alone gain)",
            "measured_speedup_over_fixed": runs["fixed"]["measured_step_s"] / runs["hspmd"]["measured_step_s"],
            "simulated_speedup_over_fixed": runs["fixed"]["simulated_step_s"] / runs["hspmd"]["simulated_step_s"],
            "planned_speedup_over_fixed": result.single_expected_s / result.expected_step_s,
            "wall_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="Print the results as JSON.")
    ap.add_argument("--part", choices=("modelled", "measured", "all"), default="all")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clusters", nargs="+", default=["h20-32", "h800-h20-48"])
    ap.add_argument("--measured-cluster", default="cpu-hetero4-long64k",
                    help="Cluster of the measured part (default: sleep mode at paper-scale lengths and memory, 64K).")
    ap.add_argument("--measured-steps", type=int, default=20, help="Measured steps after the first (warm-up).")
    ap.add_argument("--measured-tokens", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=1200.0, help="Seconds per hspmd train run.")
    ap.add_argument("--profile", type=Path, action="append", default=[],
                    help="Measured profile directory for the measured part's planning and prediction (repeatable).")
    args = ap.parse_args()
    out: dict = {}
    if args.part in ("modelled", "all"):
        out["modelled"] = {c: modelled(c, "llama-32b", args.tokens, args.steps, args.seed) for c in args.clusters}
    if args.part in ("measured", "all"):
        out["measured"] = measured(args.measured_cluster, args.measured_steps, args.measured_tokens, args.seed,
                                   args.timeout, args.profile)
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


if __name__ == "__main__":
    sys.exit(main())
