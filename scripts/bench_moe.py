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

``moe_measured_placed_over_even`` (the sleep-mode emulated cluster, configs/clusters/cpu-hetero4-sleep.yaml) is
null, and ``measured_note`` says why: there every block lasts its target's price whatever experts a device
holds.

    python scripts/bench_moe.py [--json] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import PlanSettings, plan  # noqa: E402
from planner.cost import CostModel  # noqa: E402
from planner.moe_placement import choose_experts, even_placement, speed_placement  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.spec import load_cluster, load_model  # noqa: E402
from runtime.torchfree.spec.plan import Stage, Strategy  # noqa: E402

MODEL, CLUSTER, BATCH, SEQ_LEN = "mixtral-8x7b", "h800-h20-48", 64, 4096
# A router skewed as routers drift without a balancing loss: the hottest expert takes 4x the coldest's tokens.
SKEW = (0.24, 0.18, 0.14, 0.12, 0.10, 0.08, 0.08, 0.06)
CHECK_TOP = 4
# The mixed stage's placement is chosen for a step of this many micro-batches (the planned plans' count): what
# replicas' gradient all-reduce is weighed against.
MIXED_MICRO_BATCHES = 64
MEASURED_NOTE = ("not measured: on the sleep-mode cluster each forward / backward block lasts its target's price "
                 "(hetu_cli/emulation.py), which does not depend on which experts a device holds, so a placed "
                 "against even run there would time the same sleeps; it needs block targets per device priced by "
                 "their experts' rows")


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
    # As hspmd plan plans a MoE model by default: without sequence parallelism (expert parallelism does not run
    # with it).
    settings = PlanSettings(global_batch=BATCH, seq_len=SEQ_LEN, time_limit_s=time_limit, simulate_top=CHECK_TOP,
                            sequence_parallel=False)
    t0 = time.perf_counter()
    res = plan(model, cluster, profiles, settings)
    wall = time.perf_counter() - t0
    best = res.best
    cm = CostModel(model, cluster, profiles, micro_batch=best.micro_batch, seq_len=SEQ_LEN)
    num = model.moe.num_experts
    planned = priced(cm, best.strategy, settings)
    even = priced(cm, with_experts(cm, best.strategy, lambda st: even_placement(st.devices, num)), settings)
    split = priced(cm, with_experts(cm, best.strategy, lambda st: None), settings)
    sym = res.symmetric
    sym_cm = CostModel(model, cluster, profiles, micro_batch=sym.micro_batch, seq_len=SEQ_LEN)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--time-limit", type=float, default=60.0, help="planner time limit per case (s)")
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
    out["moe_measured_placed_over_even"] = None
    out["measured_note"] = MEASURED_NOTE
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
    print(out["measured_note"])


if __name__ == "__main__":
    main()
