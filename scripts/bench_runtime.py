#!/usr/bin/env python
"""Runtime benchmark: what hspmd's per-device programs cost, and what heterogeneity-aware plans gain.

(1) Overhead: llama-tiny on one device through ``hspmd train`` (launcher, worker process, specialized
    program, hooks, statistics) against a plain PyTorch loop (runtime.engine.ReferenceTrainer: the same
    model, AdamW and clipping) on the same batches, in this process. Both get all CPU cores and run the
    global batch as one micro-batch. Ratio of median step times; target <= 1.10.
(2) cpu-hetero4 (2 fast devices + 2 emulated 3x slower ones): the measured step time of every strategy
    of the heterogeneity-aware plans against every strategy of the symmetric ones (equal work per
    device), all through ``hspmd train``, side by side; ``symmetric_over_hetero`` = best symmetric /
    the heterogeneous plan the demo trains (cpu-hetero4-dp-pp.yaml, strategy dp-pp). By default at
    sequence length 256: at the shipped 64, fixed per-step costs (gradient all-reduce, optimizer,
    Python) dominate llama-tiny's step on this box and every plan ties.

Step times are medians over the steps after ``--warmup``. ``--json`` prints one JSON object (nothing
else on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.launch import TrainOptions, launch  # noqa: E402
from runtime.spec import load_plan, load_plan_context, save_plan  # noqa: E402
from runtime.spec.plan import Pipeline, Stage, Strategy  # noqa: E402

PLANS = REPO / "configs" / "plans"
DEMO_PLAN = PLANS / "cpu-hetero4-dp-pp.yaml"  # the heterogeneous plan `make demo` trains first (dp-pp)
HETERO_PLANS = [DEMO_PLAN, PLANS / "cpu-hetero4-tiny.yaml"]
DEFAULT_SEQ_LEN = 256  # (2): long enough that compute, not fixed per-step costs, sets the step time
SYMMETRIC_PLANS = [PLANS / "cpu-hetero4-symmetric.yaml", PLANS / "cpu-hetero4-symmetric-tp-pp.yaml"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def single_device_plan(out: Path) -> Path:
    """The shipped plans' model and batch on device 0 alone, the global batch as one micro-batch."""
    plan = load_plan(PLANS / "cpu-hetero4-tiny.yaml")
    t = plan.training
    strategy = Strategy("single", (Pipeline(1, (Stage((0,), (0, 6)),)),))
    path = out / "single-device.yaml"
    save_plan(replace(plan, model="llama-tiny", cluster="cpu-hetero4", strategies=(strategy,),
                      training=replace(t, micro_batch=t.global_batch)), path)
    return path


def hspmd_steps(plan: Path, steps: int, warmup: int, strategy: str | None = None) -> tuple[float, float]:
    """(median step time after warm-up, start-up seconds) of one ``hspmd train`` run."""
    summary = launch(TrainOptions(plan=plan, strategy=strategy, steps=steps + warmup))
    times = [r.step_time_s for r in summary.records[warmup:]]
    return statistics.median(times), summary.startup_s


def plain_steps(plan: Path, steps: int, warmup: int) -> float:
    import torch

    from runtime.profiling.host import emulated_cpu_shares, host_cpus

    ctx = load_plan_context(plan)
    # The CPU share the launcher gives this device's worker (threads and pinned cores: an emulated device
    # gets the same share whichever plan runs it), so both sides compute on the same cores.
    (device,) = ctx.plan.strategies[0].devices
    threads, cpus = emulated_cpu_shares([device], ctx.cluster.num_devices, host_cpus())
    torch.set_num_threads(threads)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if before is not None:
        os.sched_setaffinity(0, cpus[device])
    try:
        return _plain_loop(ctx, steps, warmup)
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def _plain_loop(ctx, steps: int, warmup: int) -> float:
    from runtime.data import SyntheticTokens
    from runtime.engine.reference import ReferenceTrainer

    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t)
    source = SyntheticTokens(ctx.model.vocab_size, t.global_batch, t.seq_len, t.seed)
    times = []
    for step in range(1, steps + warmup + 1):
        batch = source.batch(step)
        t0 = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def overhead(out: Path, steps: int, warmup: int) -> dict:
    plan = single_device_plan(out)
    # Plain, hspmd, plain: the plain figure is the mean of the two, so a load change during the run
    # shows up as a spread between them rather than silently favouring one side.
    plain_a = plain_steps(plan, steps, warmup)
    hspmd, startup = hspmd_steps(plan, steps, warmup)
    plain_b = plain_steps(plan, steps, warmup)
    plain = (plain_a + plain_b) / 2
    return {"plain_step_s": plain, "plain_step_s_runs": [plain_a, plain_b], "hspmd_step_s": hspmd,
            "hspmd_startup_s": startup, "overhead_ratio": hspmd / plain}


def with_seq_len(src: Path, out: Path, seq_len: int | None) -> Path:
    """A shipped plan as is, or a copy with another sequence length (more compute per micro-batch)."""
    if seq_len is None:
        return src
    plan = load_plan(src)
    dst = out / src.name
    save_plan(replace(plan, model="llama-tiny", cluster="cpu-hetero4",
                      training=replace(plan.training, seq_len=seq_len)), dst)
    return dst


def hetero_vs_symmetric(out: Path, steps: int, warmup: int, seq_len: int | None) -> dict:
    rows = []
    for kind, paths in (("hetero", HETERO_PLANS), ("symmetric", SYMMETRIC_PLANS)):
        for src in paths:
            path = with_seq_len(src, out, seq_len)
            for s in load_plan(path).strategies:
                step_s, startup = hspmd_steps(path, steps, warmup, s.name)
                rows.append({"kind": kind, "plan": path.name, "strategy": s.name, "step_s": step_s,
                             "startup_s": startup})
                log(f"  {kind:9s} {path.name}:{s.name}: {step_s:.4f} s/step")
    demo = next(r for r in rows if r["plan"] == DEMO_PLAN.name)
    best_sym = min((r for r in rows if r["kind"] == "symmetric"), key=lambda r: r["step_s"])
    best_het = min((r for r in rows if r["kind"] == "hetero"), key=lambda r: r["step_s"])
    return {"seq_len": load_plan_context(with_seq_len(DEMO_PLAN, out, seq_len)).plan.training.seq_len,
            "plans": rows, "demo_hetero": f"{demo['plan']}:{demo['strategy']}",
            "best_symmetric": f"{best_sym['plan']}:{best_sym['strategy']}",
            "best_hetero": f"{best_het['plan']}:{best_het['strategy']}",
            "symmetric_over_hetero": best_sym["step_s"] / demo["step_s"],
            "symmetric_over_best_hetero": best_sym["step_s"] / best_het["step_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per run (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                    help="(2): the plans' sequence length (0: as shipped, 64)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        log("(1) single device: hspmd vs a plain PyTorch loop")
        one = overhead(Path(tmp), args.steps, args.warmup)
        log("(2) cpu-hetero4: heterogeneity-aware vs symmetric plans")
        two = hetero_vs_symmetric(Path(tmp), args.steps, args.warmup, args.seq_len or None)
    result = {"overhead_ratio": one["overhead_ratio"], "symmetric_over_hetero": two["symmetric_over_hetero"],
              "overhead": one, "cpu_hetero4": two, "steps": args.steps, "warmup": args.warmup,
              "load_average_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"(1) single device, llama-tiny: plain PyTorch {one['plain_step_s'] * 1e3:.2f} ms/step "
          f"(runs {', '.join(f'{x * 1e3:.2f}' for x in one['plain_step_s_runs'])}), hspmd "
          f"{one['hspmd_step_s'] * 1e3:.2f} ms/step: overhead ratio {one['overhead_ratio']:.3f} (target <= 1.10)")
    print(f"(2) cpu-hetero4, llama-tiny, global batch 8, seq_len {two['seq_len']}, median step time:")
    for r in two["plans"]:
        print(f"    {r['kind']:9s} {r['plan'] + ':' + r['strategy']:45s} {r['step_s'] * 1e3:8.1f} ms")
    print(f"    best symmetric {two['best_symmetric']} / demo plan {two['demo_hetero']}: "
          f"{two['symmetric_over_hetero']:.2f}x; / best hetero {two['best_hetero']}: "
          f"{two['symmetric_over_best_hetero']:.2f}x")
    print(f"load average during the run: {result['load_average_1m']:.1f} on {result['cpus']} CPUs")


if __name__ == "__main__":
    main()
