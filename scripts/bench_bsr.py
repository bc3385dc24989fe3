#!/usr/bin/env python
"""BSR benchmark: fused vs per-tensor vs naive state moves between two heterogeneous plans.

(1) Modelled, paper scale: every parameter of llama-32b (bf16) moves from the shipped plan
    ``h800-h20-llama32b`` (3 pipelines of TP 8) to another heterogeneous plan on 16x H800 + 32x H20
    (one TP-8 H800 pipeline, four TP-4 H20 pipelines, other layer splits), and again to a plan for the
    survivors when one H20 (device 47) has failed. Times come from the cost model of runtime/torchfree/comm/bsr.py
    (max over devices of egress and ingress time over the cluster's bandwidth matrix) and are compared
    with its lower bound.
(2) Measured on gloo: the same three ways of moving every parameter of a ~35M-parameter Llama (fp32,
    >= 100 MB on the wire) between two plans on 4 local worker processes, wall time side by side.

``--json`` prints one JSON object (nothing else on stdout).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.torchfree.annotations.from_plan import annotate_strategy  # noqa: E402
from runtime.torchfree.comm.bsr import BsrPlan, TensorMove, plan_bsr  # noqa: E402
from runtime.torchfree.spec import ModelSpec, Pipeline, Stage, Strategy, TrainingSettings, load_plan_context  # noqa: E402
from runtime.torchfree.spec.validate import validate_strategy  # noqa: E402

FAILED_H20 = 47


def _tp_pipeline(micro_batches: int, *stages: tuple[tuple[int, ...], tuple[int, int]]) -> Pipeline:
    return Pipeline(micro_batches, tuple(Stage(tuple(d), layers) for d, layers in stages))


def paper_targets() -> dict[str, Strategy]:
    """Two heterogeneous plans for llama-32b on h800-h20-48: all 48 devices, and 47 survivors."""
    h800 = _tp_pipeline(32, (range(0, 8), (0, 34)), (range(8, 16), (34, 60)))
    h20 = [_tp_pipeline(8, (range(b, b + 4), (0, 28)), (range(b + 4, b + 8), (28, 60))) for b in (16, 24, 32, 40)]
    survivors = [*h20[:3], _tp_pipeline(8, ((40, 41, 42, 43), (0, 28)), ((44, 45), (28, 44)), ((46,), (44, 60)))]
    return {"rebalanced": Strategy("rebalanced", (h800, *h20)),
            "one_h20_failed": Strategy("one_h20_failed", (h800, *survivors))}


def moves_between(a: Strategy, b: Strategy, model: ModelSpec, training: TrainingSettings,
                  dtype: torch.dtype) -> list[TensorMove]:
    old, new = annotate_strategy(a, model, training), annotate_strategy(b, model, training)
    return [TensorMove(p.name, p.shape, dtype, p.param, new.param(p.name).param) for p in old.params]


def modelled() -> dict:
    ctx = load_plan_context(REPO / "configs" / "plans" / "h800-h20-llama32b.yaml")
    source = ctx.plan.strategies[0]
    out = {}
    for name, target in paper_targets().items():
        problems = validate_strategy(target, ctx.plan, ctx.model, ctx.cluster, "bench", name)
        if problems:
            raise SystemExit(f"bench plan {name} is invalid: {problems[0]}")
        excluded = (FAILED_H20,) if name == "one_h20_failed" else ()
        moves = moves_between(source, target, ctx.model, ctx.plan.training, torch.bfloat16)
        t0 = time.perf_counter()
        fused = plan_bsr(moves, bandwidth=ctx.cluster, excluded=excluded)
        plan_s = time.perf_counter() - t0
        naive = plan_bsr(moves, bandwidth=ctx.cluster, excluded=excluded, policy="first_owner")
        per_tensor = sum(plan_bsr([m], bandwidth=ctx.cluster, excluded=excluded).modelled_time(ctx.cluster)
                         for m in moves)
        f, lb, n = fused.modelled_time(ctx.cluster), fused.lower_bound(ctx.cluster), naive.modelled_time(ctx.cluster)
        out[name] = {
            "tensors": len(moves), "bytes_moved": fused.total_bytes, "excluded": list(excluded),
            "fused_s": f, "per_tensor_s": per_tensor, "naive_s": n, "lower_bound_s": lb,
            "fused_over_lower_bound": f / lb, "naive_over_fused": n / f, "per_tensor_over_fused": per_tensor / f,
            "planning_s": plan_s,
        }
    return out


# --- measured --------------------------------------------------------------------------------------

BENCH_MODEL = ModelSpec("llama-bench", num_layers=8, hidden_size=512, ffn_hidden_size=1536, num_heads=8,
                        num_kv_heads=8, vocab_size=8192, max_seq_len=512)
BENCH_TRAINING = TrainingSettings(global_batch=8, micro_batch=1, seq_len=64)


def measured_plans() -> tuple[Strategy, Strategy]:
    """4 devices: a TP-2 pipeline plus a 2-stage pipeline -> a TP-2 pipeline with other layer split
    next to a 2-stage pipeline with the stages swapped (every device needs new state)."""
    a = Strategy("a", (_tp_pipeline(6, ((0, 1), (0, 8))), _tp_pipeline(2, ((2,), (0, 4)), ((3,), (4, 8)))))
    b = Strategy("b", (_tp_pipeline(2, ((3,), (0, 5)), ((2,), (5, 8))), _tp_pipeline(6, ((0, 1), (0, 8)))))
    return a, b


def _fill(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    base = sum(map(ord, name)) % 1000
    return (torch.arange(math.prod(shape), dtype=torch.float32) + base).view(shape)


def _measure_job(ctx, reps: int) -> dict:
    a, b = measured_plans()
    moves = moves_between(a, b, BENCH_MODEL, BENCH_TRAINING, torch.float32)
    plans: dict[str, list[BsrPlan]] = {
        "fused": [plan_bsr(moves)],
        "per_tensor": [plan_bsr([m]) for m in moves],
        "naive": [plan_bsr(moves, policy="first_owner")],
    }
    from runtime.comm.execute import run_bsr

    me = ctx.device
    local = {}
    for m in moves:
        lay = m.src.layout(m.shape)
        if me in lay:
            local[m.name] = _fill(m.name, m.shape)[tuple(slice(x, y) for x, y in lay.region(me))].clone()
    times: dict[str, list[float]] = {k: [] for k in plans}
    for rep in range(reps):
        for mode, ps in plans.items():
            dist.barrier()
            t0 = time.perf_counter()
            out = {}
            for p in ps:
                out.update(run_bsr(p, local, ctx.groups))
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
            if rep == 0:  # the moved state is right, whichever way it moved
                for m in moves:
                    lay = m.dst.layout(m.shape)
                    if me in lay:
                        want = _fill(m.name, m.shape)[tuple(slice(x, y) for x, y in lay.region(me))]
                        assert torch.equal(out[m.name], want), (mode, m.name)
            del out
    return {"times": times, "bytes": plans["fused"][0].total_bytes}


def measured(reps: int, procs: int = 4) -> dict:
    from runtime.comm.world import LocalWorld

    with LocalWorld(procs, timeout_s=300) as world:
        results = world.run(_measure_job, reps, timeout_s=600)
    per_mode = {}
    for mode in results[0]["times"]:
        # wall time of a repetition = the slowest rank (all start after one barrier, end at another)
        walls = [max(r["times"][mode][i] for r in results) for i in range(reps)]
        per_mode[mode] = statistics.median(walls)
    return {"processes": procs, "bytes_moved": results[0]["bytes"], "reps": reps,
            "fused_s": per_mode["fused"], "per_tensor_s": per_mode["per_tensor"], "naive_s": per_mode["naive"],
            "measured_naive_over_fused": per_mode["naive"] / per_mode["fused"],
            "measured_per_tensor_over_fused": per_mode["per_tensor"] / per_mode["fused"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions (median reported)")
    ap.add_argument("--skip-measured", action="store_true", help="only the modelled paper-scale part")
    args = ap.parse_args()
    model = modelled()
    meas = None if args.skip_measured else measured(args.reps)
    base = model["rebalanced"]
    figures = {
        "fused_over_lower_bound": base["fused_over_lower_bound"],
        "naive_over_fused": base["naive_over_fused"],
        "per_tensor_over_fused": base["per_tensor_over_fused"],
        "failed_fused_over_lower_bound": model["one_h20_failed"]["fused_over_lower_bound"],
        "failed_naive_over_fused": model["one_h20_failed"]["naive_over_fused"],
        "measured_naive_over_fused": meas["measured_naive_over_fused"] if meas else None,
        "measured_per_tensor_over_fused": meas["measured_per_tensor_over_fused"] if meas else None,
        "modelled": model,
        "measured": meas,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    from hetu_cli.output import console, table

    out = console()
    t = table("modelled: llama-32b parameters (bf16), h800-h20-llama32b -> other plan, h800-h20-48",
              ("scenario", "GB moved", "lower bound s", "fused s", "per-tensor s", "naive s", "fused/LB",
               "naive/fused"), left=("scenario",))
    for name, r in model.items():
        t.add_row(name, f"{r['bytes_moved'] / 1e9:.1f}", f"{r['lower_bound_s']:.4f}", f"{r['fused_s']:.4f}",
                  f"{r['per_tensor_s']:.4f}", f"{r['naive_s']:.4f}", f"{r['fused_over_lower_bound']:.3f}",
                  f"{r['naive_over_fused']:.2f}")
    out.print(t)
    if meas:
        m = table(f"measured: gloo, {meas['processes']} processes, {meas['bytes_moved'] / 1e6:.0f} MB moved, median "
                  f"of {meas['reps']}", ("fused s", "per-tensor s", "naive s", "naive/fused", "per-tensor/fused"))
        m.add_row(f"{meas['fused_s']:.3f}", f"{meas['per_tensor_s']:.3f}", f"{meas['naive_s']:.3f}",
                  f"{meas['measured_naive_over_fused']:.2f}", f"{meas['measured_per_tensor_over_fused']:.2f}")
        out.print(m)


if __name__ == "__main__":
    main()
