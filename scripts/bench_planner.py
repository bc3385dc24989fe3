"""Planner quality and speed, all scored by the same cost model (planner/cost.py CostModel.estimate).

Quality (simulated): for each heterogeneous cluster, the planned step time against the best symmetric
(Megatron-style) plan over all devices, the best symmetric plan over the best one-type subset, and the
lower bound (LP: every device at its best compute rate, no comm, no bubbles, no optimizer); and the
planned MFU against the best plan on a homogeneous cluster of the clusters' strongest type with the
same total peak FLOPS (MFU over all devices of each cluster, idle ones included). Each case runs at
global batch 64 (the issue's figure) and 256 (more micro-batches: smaller pipeline bubbles).

Scale: wall time of the whole planner (search + ILPs + baselines) on synthetic clusters of 4 GPU types
(H800, H20, A100-80G, L40S; a quarter each, nodes of 8) at 64, 256 and 1024 GPUs, llama-32b, one
4K sequence per GPU per step.

Measured (``--measured PROFILE_DIR``): plans llama-tiny on cpu-hetero4 with a measured profile, writes
the plan and the best symmetric plan, trains each with ``hspmd train`` and compares the measured step
times (mean over the steps after warm-up).

    python scripts/bench_planner.py [--json] [--scale 64,256,1024] [--no-quality] [--measured DIR]
                                    [--batches 64,256] [--cases h800-h20-48,...] [--no-per-schedule]

Every plan searches the pipeline schedule and its chunk count per pipeline (``--schedule auto``, as
``hspmd plan`` defaults); per quality case, ``per_schedule`` gives the best plan with each schedule
fixed (``hspmd plan --schedule NAME``), so the gain of each is visible.

Every plan is chosen as ``hspmd plan`` chooses it (``--check-top 8``: the best candidates re-checked with
the step simulator, ranked by the worse of estimate and simulation). Figures are the closed-form
estimate's, as for the baselines; ``*_simulated*`` keys give the simulator's for comparison.

``--json`` prints one JSON object: ``quality`` (per cluster: ``efficiency``, ``speedup_over_symmetric``,
``mfu_gap_vs_homogeneous``, ``gap``: where the plan's step goes against the lower bound, planner/gap.py,
``activation_limits``: the best plan's raised activation bounds per pipeline, ...), ``quality_batch_256``,
``scale_seconds`` (keyed by GPU count), ``scale_cpu_seconds`` (the planner's CPU time: on a shared machine
its wall time also measures the other jobs; this process's only, so with ``--workers`` other than 1 it leaves
out the worker processes' share), ``measured`` when asked. Progress goes to stderr.

The scale runs plan with ``--workers`` processes (default: every core; planner/parallel.py): the searches and
the simulator's checks run side by side, the plans are the serial ones.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import PlanResult, PlanSettings, plan  # noqa: E402
from planner.cost import CostModel, model_flops_per_token  # noqa: E402
from planner.gap import gap_breakdown  # noqa: E402
from planner.parallel import worker_count  # noqa: E402
from planner.schedule_choice import AUTO  # noqa: E402
from planner.search import schedule_label  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.torchfree.errors import InfeasibleError  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES  # noqa: E402
from runtime.torchfree.spec import load_cluster, load_model, load_plan  # noqa: E402
from runtime.torchfree.spec.cluster import Cluster, DeviceType, Node  # noqa: E402

# (case name, cluster, model): the issue's case, H2's example cluster, HexiScale's cluster with a model
# that fits comfortably (llama-7b) and with the paper's case-study model (Llama-2 13B, memory-bound there).
CASES = [("h800-h20-48", "h800-h20-48", "llama-32b"),
         ("h2-example", "h2-example", "llama-13b"),
         ("hexiscale-mixed", "hexiscale-mixed", "llama-7b"),
         ("hexiscale-mixed-13b", "hexiscale-mixed", "llama-13b")]
SEQ_LEN = 4096
BATCHES = (64, 256)
SCALE_TYPES = {"H800": DeviceType(80, 989, 3350, 200), "H20": DeviceType(96, 148, 4000, 450),
               "A100-80G": DeviceType(80, 312, 2039, 300), "L40S": DeviceType(48, 362, 864, 32)}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def homogeneous_twin(cluster: Cluster) -> Cluster:
    """The strongest device type of ``cluster``, as many as give the same total peak FLOPS (rounded),
    in nodes of 8, same inter-node bandwidth."""
    name, dt = max(cluster.device_types.items(), key=lambda kv: (kv[1].peak_bf16_tflops, kv[0]))
    n = max(1, round(cluster.total_peak_tflops() / dt.peak_bf16_tflops))
    nodes = tuple(Node(f"{name.lower()}-{i}", name, min(8, n - 8 * i)) for i in range(math.ceil(n / 8)))
    return Cluster(f"{cluster.name}-homogeneous-{n}x{name}", {name: dt}, nodes, cluster.inter_node_bandwidth_gbs)


def cluster_mfu(result: PlanResult, seq_len: int, global_batch: int) -> float:
    """Model FLOPs per second over the peak of every device of the cluster (idle ones count)."""
    flops = model_flops_per_token(result.model, seq_len) * global_batch * seq_len
    return flops / result.best.step_time_s / (result.cluster.total_peak_tflops() * 1e12)


CHECK_TOP = 8   # as ``hspmd plan`` (--check-top): the best plans re-checked with the step simulator


def run_plan(model, cluster, batch: int, time_limit: float = 600.0, schedule: str = AUTO,
             workers: int | None = 1) -> PlanResult:
    profiles = resolve_profiles(cluster.device_types)
    # top_k: keep every checked candidate listed (the estimate's favourite among them).
    return plan(model, cluster, profiles, PlanSettings(global_batch=batch, seq_len=SEQ_LEN, time_limit_s=time_limit,
                                                       simulate_top=CHECK_TOP, top_k=CHECK_TOP + 4,
                                                       schedule=schedule), workers=workers)


def schedules_used(result: PlanResult) -> dict[str, int]:
    """Pipelines of the best plan per schedule label ('zb-h1', 'interleaved v=2', ...)."""
    out: dict[str, int] = {}
    for p in result.best.strategy.pipelines:
        label = schedule_label(p, result.settings.default_schedule)
        out[label] = out.get(label, 0) + 1
    return out


def per_schedule(model, cluster, batch: int) -> dict:
    """The best plan with each schedule fixed: step time by the estimate and the simulator, efficiency."""
    out = {}
    for name in SCHEDULE_NAMES:
        t0 = time.perf_counter()
        try:
            r = run_plan(model, cluster, batch, schedule=name)
        except InfeasibleError as err:
            out[name] = {"infeasible": str(err)}
            continue
        out[name] = {"plan": r.best.summary, "step_time_s": r.best.step_time_s,
                     "simulated_step_time_s": r.best.simulated_s, "efficiency": r.efficiency,
                     "efficiency_simulated": r.lower_bound.step_time_s / r.best.simulated_s,
                     "planner_seconds": time.perf_counter() - t0}
        log(f"    {name}: {r.best.step_time_s:.3f} s (simulated {r.best.simulated_s:.3f}), efficiency "
            f"{r.efficiency:.3f} / {out[name]['efficiency_simulated']:.3f}")
    return out


def simulated(result: PlanResult, strategy, micro_batch: int | None) -> float | None:
    """The step simulator's time of a strategy (the symmetric baseline's, say) on the result's cost model."""
    if strategy is None or micro_batch is None:
        return None
    cm = CostModel(result.model, result.cluster, resolve_profiles(result.cluster.device_types),
                   micro_batch=micro_batch, seq_len=result.settings.seq_len,
                   sequence_parallel=result.settings.sequence_parallel)
    return simulate(cm, strategy, result.settings.global_batch, result.settings.default_schedule,
                    result.settings.zero).step_time_s


def quality_case(name: str, cluster_ref: str, model_ref: str, batch: int, schedules: bool = True) -> dict:
    model, cluster = load_model(model_ref), load_cluster(cluster_ref)
    t0 = time.perf_counter()
    het = run_plan(model, cluster, batch)
    wall = time.perf_counter() - t0
    twin = homogeneous_twin(cluster)
    try:
        hom = run_plan(model, twin, batch)
        hom_mfu = cluster_mfu(hom, SEQ_LEN, batch)
        hom_step = hom.best.step_time_s
        hom_sim = hom.best.simulated_s
        hom_plan = hom.best.summary
    except InfeasibleError as err:
        hom_mfu, hom_step, hom_sim, hom_plan = None, None, None, f"infeasible: {err}"
    mfu = cluster_mfu(het, SEQ_LEN, batch)
    sym, sub = het.symmetric, het.symmetric_subset
    out = {
        "model": model.name, "global_batch": batch, "seq_len": SEQ_LEN, "devices": cluster.num_devices,
        "plan": het.best.summary, "step_time_s": het.best.step_time_s,
        "lower_bound_s": het.lower_bound.step_time_s, "efficiency": het.efficiency,
        "simulated_step_time_s": het.best.simulated_s,
        "efficiency_simulated": het.lower_bound.step_time_s / het.best.simulated_s,
        "symmetric_s": sym.step_time_s, "symmetric_plan": sym.description,
        "symmetric_simulated_s": simulated(het, sym.strategy, sym.micro_batch),
        "speedup_over_symmetric": het.speedup(sym),
        "symmetric_subset_s": sub.step_time_s, "symmetric_subset_plan": sub.description,
        "speedup_over_symmetric_subset": het.speedup(sub),
        "mfu": mfu, "mfu_used_devices": het.best.estimate.mfu,
        # The MFU a plan running at the lower bound would reach: what the profiles allow at best.
        "mfu_at_lower_bound": mfu / het.efficiency,
        "homogeneous": twin.name, "homogeneous_plan": hom_plan, "homogeneous_step_time_s": hom_step,
        "homogeneous_simulated_s": hom_sim,
        "homogeneous_mfu": hom_mfu,
        "mfu_gap_vs_homogeneous": None if hom_mfu is None else 1.0 - mfu / hom_mfu,
        "mfu_gap_points": None if hom_mfu is None else hom_mfu - mfu,
        "idle_devices": len(het.best.idle_devices), "planner_seconds": wall,
        "schedules": schedules_used(het),
    }
    # What ranking by the closed-form estimate alone (--check-top 0) would have chosen: the candidate with the
    # least estimate (every candidate the check simulated is among the result's, that one included).
    fav = min(het.candidates, key=lambda c: c.step_time_s)
    out["estimate_only"] = {"plan": fav.summary, "step_time_s": fav.step_time_s,
                            "simulated_step_time_s": fav.simulated_s,
                            "efficiency": het.lower_bound.step_time_s / fav.step_time_s}
    # Where the plan's step goes against the lower bound (planner/gap.py): shares of the devices' capacity.
    cm = CostModel(model, cluster, resolve_profiles(cluster.device_types), micro_batch=het.best.micro_batch,
                   seq_len=SEQ_LEN, sequence_parallel=het.settings.sequence_parallel)
    out["gap"] = gap_breakdown(cm, het.best.strategy, het.best.estimate, het.lower_bound.step_time_s, het.devices,
                               het.settings.default_schedule).as_dict()
    out["activation_limits"] = [list(p.activation_limits) if p.activation_limits is not None else None
                                for p in het.best.strategy.pipelines]
    sym_sim = out["symmetric_simulated_s"]
    out["speedup_over_symmetric_simulated"] = None if sym_sim is None else sym_sim / het.best.simulated_s
    if schedules:
        out["per_schedule"] = per_schedule(model, cluster, batch)
    speedup = out["speedup_over_symmetric"]
    log(f"  {name} B={batch}: {het.best.step_time_s:.3f} s (simulated {het.best.simulated_s:.3f}), "
        f"efficiency {het.efficiency:.3f}, "
        + (f"x{speedup:.2f} over symmetric" if speedup is not None else "no symmetric plan fits")
        + f", MFU {mfu:.3f} vs homogeneous " + (f"{hom_mfu:.3f}" if hom_mfu is not None else "(none fits)"))
    return out


def synthetic(n: int) -> Cluster:
    per = n // len(SCALE_TYPES)
    nodes = tuple(Node(f"{t.lower()}-{i}", t, 8) for t in SCALE_TYPES for i in range(per // 8))
    return Cluster(f"synthetic-4type-{n}", SCALE_TYPES, nodes, 50.0)


def scale_case(n: int, workers: int | None = 1) -> dict:
    model, cluster = load_model("llama-32b"), synthetic(n)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_plan(model, cluster, batch=n, workers=workers)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    log(f"  {n} GPUs: {wall:.1f} s, {cpu:.1f} s CPU ({res.best.summary[:100]})")
    # CPU seconds besides wall time: on a shared machine the wall time grows with the other jobs' load.
    return {"seconds": wall, "cpu_seconds": cpu, "workers": worker_count(workers, 1 << 30),
            "search_seconds": res.solver_time_s, "truncated": res.stats.truncated,
            "step_time_s": res.best.step_time_s, "simulated_step_time_s": res.best.simulated_s,
            "efficiency": res.efficiency,
            "efficiency_simulated": res.lower_bound.step_time_s / res.best.simulated_s,
            "speedup_over_symmetric": res.speedup(res.symmetric), "plan": res.best.summary,
            "schedules": schedules_used(res)}


def _mean_step(metrics: Path, skip: int) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows][skip:]
    return statistics.mean(times)


def measured_case(profile_dir: Path, steps: int) -> dict:
    """Plan llama-tiny on cpu-hetero4 with a measured profile; train the plan and the best symmetric
    plan; compare measured step times."""
    hspmd = [sys.executable, "-m", "hetu_cli"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        planned, sym = d / "plan.yaml", d / "symmetric.yaml"
        # ZeRO-1 as `hspmd plan` defaults (the symmetric baseline plan gets the same setting).
        cmd = hspmd + ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--profile", str(profile_dir),
                       "--global-batch", "8", "--seq-len", "64", "-o", str(planned),
                       "--symmetric-out", str(sym), "--format", "json"]
        report = json.loads(subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout)
        out = {"plan": report["summary"], "predicted_s": report["step_time_s"],
               "symmetric_plan": report["baselines"]["symmetric"]["description"],
               "predicted_symmetric_s": report["baselines"]["symmetric"]["step_time_s"]}
        for key, path in (("measured_s", planned), ("measured_symmetric_s", sym)):
            metrics = d / f"{path.stem}.jsonl"
            subprocess.run(hspmd + ["train", "--plan", str(path), "--steps", str(steps), "--metrics", str(metrics)],
                           cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
            out[key] = _mean_step(metrics, skip=2)
            log(f"  {path.name}: {out[key]:.4f} s/step measured")
        out["measured_speedup"] = out["measured_symmetric_s"] / out["measured_s"]
        out["predicted_speedup"] = out["predicted_symmetric_s"] / out["predicted_s"]
        out["plan_yaml"] = load_plan(planned).strategies[0].estimates
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--scale", default="64,256,1024", help="GPU counts for the scale runs ('' to skip)")
    ap.add_argument("--workers", type=int, default=0,
                    help="planner processes for the scale runs (0: every core; 1: serial, CPU time = the planner's)")
    ap.add_argument("--no-quality", action="store_true", help="skip the quality cases")
    ap.add_argument("--measured", type=Path, help="measured profile directory of cpu-hetero4: also train both plans")
    ap.add_argument("--steps", type=int, default=12, help="training steps per plan with --measured")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="global batches of the quality cases")
    ap.add_argument("--cases", default="", help="quality cases to run (default: all)")
    ap.add_argument("--no-per-schedule", action="store_true", help="skip the plans with each schedule fixed")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    out: dict = {"note": "simulated with planner/cost.py; timings on a shared 2-core machine unless noted"}
    if not args.no_quality:
        for batch in batches:
            log(f"quality, global batch {batch} x {SEQ_LEN}:")
            key = "quality" if batch == BATCHES[0] else f"quality_batch_{batch}"
            # The per-schedule plans at the issue's batch only (they multiply the runs by five).
            out[key] = {name: quality_case(name, c, m, batch, not args.no_per_schedule and batch == BATCHES[0])
                        for name, c, m in cases}
    if args.scale:
        log("scale (llama-32b, 4 GPU types, global batch = GPUs):")
        runs = {int(n): scale_case(int(n), args.workers or None) for n in args.scale.split(",") if n.strip()}
        out["scale_seconds"] = {n: r["seconds"] for n, r in runs.items()}
        out["scale_cpu_seconds"] = {n: r["cpu_seconds"] for n, r in runs.items()}
        out["scale"] = runs
    if args.measured is not None:
        log("measured on cpu-hetero4 (llama-tiny, global batch 8 x 64):")
        out["measured"] = measured_case(args.measured, args.steps)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for key in [k for k in out if k.startswith("quality")]:
        print(f"\n{key}:")
        print(f"{'cluster':18} {'model':10} {'step s':>9} {'LB s':>9} {'eff':>6} {'x sym':>6} {'x subset':>8} "
              f"{'MFU':>6} {'homog MFU':>9} {'gap':>6}")
        for name, q in out[key].items():
            def f(v, fmt):
                return "-" if v is None else format(v, fmt)
            print(f"{name:18} {q['model']:10} {q['step_time_s']:9.3f} {q['lower_bound_s']:9.3f} "
                  f"{q['efficiency']:6.3f} {f(q['speedup_over_symmetric'], '6.2f')} "
                  f"{f(q['speedup_over_symmetric_subset'], '8.2f')} {q['mfu']:6.3f} "
                  f"{f(q['homogeneous_mfu'], '9.3f')} {f(q['mfu_gap_vs_homogeneous'], '6.1%')}")
            print(f"    plan: {q['plan']}")
            print("    gap: " + ", ".join(f"{k} {v:.1%}" for k, v in q["gap"]["losses"].items() if v > 5e-4))
            for sched, r in q.get("per_schedule", {}).items():
                if "infeasible" in r:
                    print(f"    {sched:12} infeasible")
                else:
                    print(f"    {sched:12} step {r['step_time_s']:.3f} s (sim {r['simulated_step_time_s']:.3f}) "
                          f"efficiency {r['efficiency']:.3f} / {r['efficiency_simulated']:.3f}")
    if "scale" in out:
        print("\nscale:")
        for n, r in out["scale"].items():
            print(f"  {n:5d} GPUs: {r['seconds']:7.1f} s, {r['cpu_seconds']:7.1f} s CPU"
                  f"  (step {r['step_time_s']:.3f} s, "
                  f"efficiency {r['efficiency']:.3f}, truncated {r['truncated']})")
    if "measured" in out:
        m = out["measured"]
        print(f"\nmeasured: planned {m['measured_s']:.4f} s/step vs symmetric {m['measured_symmetric_s']:.4f} "
              f"s/step: x{m['measured_speedup']:.2f} (predicted x{m['predicted_speedup']:.2f})")


if __name__ == "__main__":
    main()
