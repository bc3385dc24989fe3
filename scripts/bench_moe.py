"""Expert placement on a heterogeneous cluster, modelled: Mixtral-8x7B on h800-h20-48 (16 H800 + 32 H20) at global
batch 64, 4K tokens per sequence, planned as ``hspmd plan`` plans it, side by side with the same layout under
even expert placement, with experts TP-split, and with the best symmetric plan.

Per case (``shipped``: the model file as it is, even router; ``skewed``: the same model with a router skew
given as ``moe.expert_load``, ``SKEW``), every figure from one cost model (planner/cost.py), the estimate's step
time with the simulator's beside it:

* ``planned``: the plan ``hspmd plan`` writes (each multi-device stage's experts TP-split, or expert-parallel
  placed by device speed, memory and expected load, whichever prices faster);
* ``even``: the same layout with every multi-device MoE stage expert-parallel, experts dealt round-robin
  (``even_placement``: expert parallelism blind to speed and load);
* ``tp_split``: the same layout with every stage's experts split over its TP group;
* ``symmetric``: the best symmetric (Megatron-style) plan over all devices, its experts laid out as the planner
  lays out its own.

``moe_placed_over_even`` = even / planned step time, ``moe_placed_over_symmetric`` = symmetric / planned (> 1:
the planned plan is faster), both from the shipped model. ``mixed_stage``: one expert-parallel stage of 4 H800
and 4 H20 (two nodes), one MoE layer and micro-batch, the routed part (router, experts, all-to-alls) under even
against speed-aware placement: ``placed_over_even`` = even / placed.

``moe_measured_placed_over_even``: measured on the sleep-mode emulated cluster
(configs/clusters/cpu-hetero4-sleep-moe.yaml: 4 worker processes standing for 2 A800 + 2 H20 at Mixtral-8x7B's
layer shapes, each block sleeping to its target, a MoE layer's priced by the rows the device's own experts
receive). The model is moe-tiny with Mixtral's 8 experts (top-2), trained as one expert-parallel stage over the 4
devices (TP-4 attention, 8 micro-batches of 64 tokens): the planner's placement for that stage
(``choose_experts``: by device speed, memory and expected load) against even placement, each trained by
``hspmd train`` for ``--steps`` steps after ``--warmup`` (median step time), ``--rounds`` times in alternating
order; ``moe_measured_placed_over_even`` = even / placed, the simulator's ratio beside it
(``moe_simulated_placed_over_even``), both from the profile ``hspmd profile`` measures of this host first (or
``--profile DIR``). ``--no-measured`` leaves it out (null).

    python scripts/bench_moe.py [--json] [--time-limit 60] [--steps 6] [--warmup 2] [--rounds 2]
                                [--profile DIR] [--no-measured]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import PlanSettings, plan  # noqa: E402
from planner.cost import CostModel  # noqa: E402
from planner.moe_placement import choose_experts, even_placement, speed_placement  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.spec import load_cluster, load_model, load_plan, save_plan  # noqa: E402
from runtime.torchfree.spec.io import atomic_write_text, dump_yaml  # noqa: E402
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy  # noqa: E402
from runtime.torchfree.spec.schema import to_data  # noqa: E402

MODEL, CLUSTER, BATCH, SEQ_LEN = "mixtral-8x7b", "h800-h20-48", 64, 4096
# A router skewed as routers drift without a balancing loss: the hottest expert takes 4x the coldest's tokens.
SKEW = (0.24, 0.18, 0.14, 0.12, 0.10, 0.08, 0.08, 0.06)
CHECK_TOP = 4
# The mixed stage's placement is chosen for a step of this many micro-batches (the planned plans' count): what
# replicas' gradient all-reduce is weighed against.
MIXED_MICRO_BATCHES = 64
MEASURED_CLUSTER = "cpu-hetero4-sleep-moe"
MEASURED_EXPERTS = 8           # moe-tiny's shapes with Mixtral-8x7B's expert count
MEASURED_MICRO_BATCHES = 8


def with_experts(cm: CostModel, strategy: Strategy, place) -> Strategy:
    """``strategy`` with every multi-device stage holding a MoE layer placed by ``place(stage)`` (None:
    TP-split)."""
    def one(st: Stage) -> Stage:
        if st.tp == 1 or cm.moe_layers_in(st.layers) == 0:
            return st
        return dataclasses.replace(st, experts=place(st), op_costs=None)
    out = dataclasses.replace(strategy, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(one(st) for st in p.stages)) for p in strategy.pipelines))
    return cm.with_op_costs(out, "1f1b")


def priced(cm: CostModel, strategy: Strategy, settings: PlanSettings) -> dict:
    est = cm.estimate(strategy, settings.global_batch, settings.default_schedule, settings.zero)
    sim = simulate(cm, strategy, settings.global_batch, settings.default_schedule, settings.zero)
    return {"step_s": est.step_time_s, "simulated_s": sim.step_time_s, "oom_devices": list(est.oom_devices),
            "expert_parallel_stages": sum(st.expert_parallel for p in strategy.pipelines for st in p.stages)}


def case(model, cluster, time_limit: float) -> dict:
    profiles = resolve_profiles(cluster.device_types)
    # As hspmd plan plans by default (sequence parallelism on its TP stages).
    settings = PlanSettings(global_batch=BATCH, seq_len=SEQ_LEN, time_limit_s=time_limit, simulate_top=CHECK_TOP)
    t0 = time.perf_counter()
    res = plan(model, cluster, profiles, settings)
    wall = time.perf_counter() - t0
    best = res.best
    cm = CostModel(model, cluster, profiles, micro_batch=best.micro_batch, seq_len=SEQ_LEN,
                   sequence_parallel=settings.sequence_parallel)
    num = model.moe.num_experts
    planned = priced(cm, best.strategy, settings)
    even = priced(cm, with_experts(cm, best.strategy, lambda st: even_placement(st.devices, num)), settings)
    split = priced(cm, with_experts(cm, best.strategy, lambda st: None), settings)
    sym = res.symmetric
    sym_cm = CostModel(model, cluster, profiles, micro_batch=sym.micro_batch, seq_len=SEQ_LEN,
                       sequence_parallel=settings.sequence_parallel)
    # The symmetric (Megatron-style) plan with its experts laid out as the planner lays out its own.
    sym_strategy = choose_experts(sym_cm, sym.strategy, BATCH, settings.default_schedule, settings.zero)[0]
    symmetric = priced(sym_cm, sym_cm.with_op_costs(sym_strategy, "1f1b"), settings)
    return {
        "plan": best.summary, "micro_batch": best.micro_batch, "planner_wall_s": round(wall, 2),
        "planned": planned, "even": even, "tp_split": split,
        "symmetric": {**symmetric, "plan": sym.description},
        "moe_placed_over_even": even["step_s"] / planned["step_s"],
        "moe_placed_over_even_simulated": even["simulated_s"] / planned["simulated_s"],
        "moe_placed_over_symmetric": symmetric["step_s"] / planned["step_s"],
        "moe_placed_over_symmetric_simulated": symmetric["simulated_s"] / planned["simulated_s"],
        "stage_choices": [c.to_json() for c in res.moe_stages],
    }


def mixed_stage(model, cluster) -> dict:
    """One expert-parallel stage of 4 H800 (node 0) and 4 H20 (node 2): the routed part of one MoE layer."""
    profiles = resolve_profiles(cluster.device_types)
    cm = CostModel(model, cluster, profiles, micro_batch=1, seq_len=SEQ_LEN)
    devices = (0, 1, 2, 3, 16, 17, 18, 19)
    st = Stage(devices, ((0, model.num_layers),))
    caps = dict.fromkeys(devices, model.moe.num_experts)
    out = {}
    for name, place in (("even", even_placement(devices, model.moe.num_experts)),
                        ("placed", speed_placement(cm, st, caps, MIXED_MICRO_BATCHES))):
        ep_st = dataclasses.replace(st, experts=place)
        summary = cm.ep_summary(ep_st)
        ep = cm.ep_of(ep_st)
        out[name] = {"routed_ms": 1e3 * (max(ep.expert_s.values()) + ep.comm_forward_s + ep.comm_backward_s),
                     "slowest_device_expert_ms": 1e3 * max(ep.expert_s.values()),
                     "all_to_all_ms": summary["all_to_all_ms"], "devices": summary["devices"]}
    out["placed_over_even"] = out["even"]["routed_ms"] / out["placed"]["routed_ms"]
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hspmd(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"hspmd {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")


def train_median(plan: Path, steps: int, warmup: int, metrics: Path) -> tuple[float, float]:
    """(median step time after ``warmup`` steps, the most a step's blocks overran their targets) of one run."""
    hspmd("train", "--plan", str(plan), "--steps", str(steps + warmup), "--metrics", str(metrics))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][warmup:]
    return (statistics.median(r["step_time_s"] for r in rows),
            max(r.get("emulation_overrun_s", 0.0) for r in rows))


def measured(steps: int, warmup: int, rounds: int, profile: Path | None) -> dict:
    """The planner's placement against even placement on the sleep-mode cluster, trained and simulated."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        base = load_model("moe-tiny")
        model = dataclasses.replace(base, name=f"moe-tiny-{MEASURED_EXPERTS}x",
                                    moe=dataclasses.replace(base.moe, num_experts=MEASURED_EXPERTS))
        model_path = out / "model.yaml"
        atomic_write_text(model_path, dump_yaml(to_data(model)))
        if profile is None:
            log(f"profiling {MEASURED_CLUSTER} ...")
            profile = out / "profiles"
            hspmd("profile", "--cluster", MEASURED_CLUSTER, "--out", str(profile), "--format", "json")
        cluster = load_cluster(MEASURED_CLUSTER)
        template = load_plan(REPO / "configs" / "plans" / "cpu-hetero4-moe-ep.yaml")
        t = dataclasses.replace(template.training, global_batch=MEASURED_MICRO_BATCHES, micro_batch=1)
        cm = CostModel(model, cluster, resolve_profiles(cluster.device_types, [profile]), micro_batch=1,
                       seq_len=t.seq_len)
        devices = tuple(range(cluster.num_devices))
        layout = Strategy("ep", (Pipeline(MEASURED_MICRO_BATCHES, (Stage(devices, ((0, model.num_layers),)),)),))
        placed, choices = choose_experts(cm, layout, t.global_batch, t.schedule, t.zero)
        even = with_experts(cm, layout, lambda st: even_placement(st.devices, MEASURED_EXPERTS))
        arms = {"placed": placed, "even": even}
        paths, sims = {}, {}
        for name, strategy in arms.items():
            strategy = cm.with_op_costs(strategy, t.schedule)
            sims[name] = simulate(cm, strategy, t.global_batch, t.schedule, t.zero).step_time_s
            paths[name] = out / f"{name}.yaml"
            save_plan(dataclasses.replace(template, model=str(model_path), cluster=MEASURED_CLUSTER, training=t,
                                          strategies=(strategy,)), paths[name])
        runs: dict[str, list[float]] = {n: [] for n in arms}
        overrun: dict[str, float] = dict.fromkeys(arms, 0.0)
        for r in range(rounds):
            for name in (("even", "placed") if r % 2 == 0 else ("placed", "even")):
                log(f"training {name} (round {r + 1}/{rounds}) ...")
                step, over = train_median(paths[name], steps, warmup, out / f"{name}-{r}.jsonl")
                runs[name].append(step)
                overrun[name] = max(overrun[name], over)
        step_s = {n: statistics.median(v) for n, v in runs.items()}
    return {
        "cluster": MEASURED_CLUSTER, "model": model.name, "layout": "one expert-parallel stage over devices 0-3",
        "global_batch": t.global_batch, "seq_len": t.seq_len, "steps": steps, "warmup": warmup, "rounds": rounds,
        "placements": {n: {str(d): list(es) for d, es in s.pipelines[0].stages[0].experts} for n, s in arms.items()},
        "why": [c.why for c in choices],
        "measured_step_s": step_s, "runs_s": runs, "max_block_overrun_s": overrun, "simulated_step_s": sims,
        "moe_measured_placed_over_even": step_s["even"] / step_s["placed"],
        "moe_simulated_placed_over_even": sims["even"] / sims["placed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--time-limit", type=float, default=60.0, help="planner time limit per case (s)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run, after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each placement, in alternating order")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile directory of the emulated cluster (default: measure one first)")
    ap.add_argument("--no-measured", dest="measured", action="store_false",
                    help="leave out the measured comparison (the modelled figures only)")
    args = ap.parse_args()
    model, cluster = load_model(MODEL), load_cluster(CLUSTER)
    skewed = dataclasses.replace(model, moe=dataclasses.replace(model.moe, expert_load=SKEW))
    out: dict = {"model": MODEL, "cluster": CLUSTER, "global_batch": BATCH, "seq_len": SEQ_LEN, "skew": list(SKEW)}
    for name, m in (("shipped", model), ("skewed", skewed)):
        print(f"planning {name} ...", file=sys.stderr)
        out[name] = case(m, cluster, args.time_limit)
    out["mixed_stage"] = {"shipped": mixed_stage(model, cluster), "skewed": mixed_stage(skewed, cluster)}
    out["moe_placed_over_even"] = out["shipped"]["moe_placed_over_even"]
    out["moe_placed_over_symmetric"] = out["shipped"]["moe_placed_over_symmetric"]
    out["measured"] = measured(args.steps, args.warmup, args.rounds, args.profile) if args.measured else None
    out["moe_measured_placed_over_even"] = out["measured"] and out["measured"]["moe_measured_placed_over_even"]
    out["moe_simulated_placed_over_even"] = out["measured"] and out["measured"]["moe_simulated_placed_over_even"]
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name in ("shipped", "skewed"):
        c = out[name]
        print(f"{name}: {c['plan']}")
        for k in ("planned", "even", "tp_split", "symmetric"):
            print(f"  {k:10s} step {c[k]['step_s']:.4f} s  simulated {c[k]['simulated_s']:.4f} s  "
                  f"EP stages {c[k]['expert_parallel_stages']}  OOM {c[k]['oom_devices']}")
        print(f"  placed/even {c['moe_placed_over_even']:.3f}  placed/symmetric {c['moe_placed_over_symmetric']:.3f}")
    for name, c in out["mixed_stage"].items():
        print(f"mixed stage ({name}): even {c['even']['routed_ms']:.2f} ms, placed {c['placed']['routed_ms']:.2f} ms "
              f"per MoE layer: x{c['placed_over_even']:.2f}")
    m = out["measured"]
    if m is not None:
        print(f"measured on {m['cluster']} ({m['model']}, {m['layout']}):")
        for name in ("placed", "even"):
            print(f"  {name:6s} experts {m['placements'][name]}  step {m['measured_step_s'][name]:.3f} s  "
                  f"simulated {m['simulated_step_s'][name]:.3f} s")
        print(f"  placed/even measured {m['moe_measured_placed_over_even']:.3f}  "
              f"simulated {m['moe_simulated_placed_over_even']:.3f}")


if __name__ == "__main__":
    main()
