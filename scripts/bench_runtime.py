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

(3) Pipeline schedules on cpu-hetero4-sleep (2 A800 + 2 H20 emulated by sleeping each block to its
    target's price): one 4-stage pipeline over the four devices, the same layers (an 8-layer llama-tiny,
    two per stage; interleaved: two chunks of one layer per stage) and 8 micro-batches, under 1F1B,
    interleaved 1F1B (v = 2) and ZB-H1, side by side; ``schedule_step_ratio`` = each schedule's step
    time / 1F1B's. In sleep mode a block lasts its target, so the ratios measure the schedules (and the
    real message passing between the worker processes), not this host's compute.

Step times are medians over the steps after ``--warmup``. ``--json`` prints one JSON object (nothing
else on stdout). ``--parts`` picks which of (1), (2), (3) to run (default: all).
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

from hetu_cli.emulation import emulated  # noqa: E402
from runtime.launch import TrainOptions, launch  # noqa: E402
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan  # noqa: E402
from runtime.torchfree.spec.io import atomic_write_text, dump_yaml  # noqa: E402
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy  # noqa: E402
from runtime.torchfree.spec.schema import to_data  # noqa: E402

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
    summary = launch(emulated(TrainOptions(plan=plan, strategy=strategy, steps=steps + warmup)))
    times = [r.step_time_s for r in summary.records[warmup:]]
    return statistics.median(times), summary.startup_s


def plain_steps(plan: Path, steps: int, warmup: int) -> float:
    from hetu_cli.emulation import cpu_shares
    from runtime.profiling.host import host_cpus, pinned

    ctx = load_plan_context(plan)
    # The CPU share the launcher gives this device's worker (threads and pinned cores: an emulated device
    # gets the same share whichever plan runs it), so both sides compute on the same cores.
    (device,) = ctx.plan.strategies[0].devices
    share = cpu_shares([device], ctx.cluster.num_devices, host_cpus())
    with pinned(share.cpus[device], share.threads):
        return _plain_loop(ctx, steps, warmup)


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


SCHEDULE_CLUSTER = "cpu-hetero4-sleep"
SCHEDULE_LAYERS = 8  # 4 stages x 2 chunks of interleaved 1F1B need at least 8 layers
SCHEDULE_MICRO_BATCHES = 8
SCHEDULES = ("1f1b", "interleaved", "zb-h1")


def schedule_plan(out: Path, name: str, seq_len: int) -> Path:
    """One 4-stage pipeline over devices 0-3 (A800, A800, H20, H20) of an 8-layer llama-tiny under
    schedule ``name``: two layers per stage, as two one-layer chunks (s, 4 + s) under interleaved."""
    model = out / "llama-tiny-8.yaml"
    if not model.exists():
        data = to_data(load_plan_context(PLANS / "cpu-hetero4-tiny.yaml").model)
        atomic_write_text(model, dump_yaml({**data, "name": "llama-tiny-8", "num_layers": SCHEDULE_LAYERS}))
    per = SCHEDULE_LAYERS // 4
    if name == "interleaved":
        stages = tuple(Stage((s,), ((s, s + 1), (4 + s, 5 + s))) for s in range(4))
    else:
        stages = tuple(Stage((s,), (per * s, per * (s + 1))) for s in range(4))
    base = load_plan(PLANS / "cpu-hetero4-tiny.yaml")
    t = replace(base.training, global_batch=SCHEDULE_MICRO_BATCHES, micro_batch=1, seq_len=seq_len, schedule=name)
    path = out / f"schedule-{name}.yaml"
    save_plan(replace(base, model=str(model), cluster=SCHEDULE_CLUSTER, training=t,
                      strategies=(Strategy(name, (Pipeline(SCHEDULE_MICRO_BATCHES, stages),)),)), path)
    return path


def schedules(out: Path, steps: int, warmup: int, seq_len: int) -> dict:
    rows = {}
    for name in SCHEDULES:
        step_s, startup = hspmd_steps(schedule_plan(out, name, seq_len), steps, warmup)
        rows[name] = {"step_s": step_s, "startup_s": startup}
        log(f"  {name:12s} {step_s:.4f} s/step")
    return {"cluster": SCHEDULE_CLUSTER, "layers": SCHEDULE_LAYERS, "stages": 4, "seq_len": seq_len,
            "micro_batches": SCHEDULE_MICRO_BATCHES, "schedules": rows,
            "schedule_step_ratio": {n: r["step_s"] / rows["1f1b"]["step_s"] for n, r in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per run (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                    help="(2): the plans' sequence length (0: as shipped, 64)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 3 or 1,2 (default: all)")
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    if not parts <= {"1", "2", "3"}:
        ap.error(f"--parts: unknown part(s) {sorted(parts - {'1', '2', '3'})} (have: 1, 2, 3)")
    one = two = three = None
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        if "1" in parts:
            log("(1) single device: hspmd vs a plain PyTorch loop")
            one = overhead(Path(tmp), args.steps, args.warmup)
        if "2" in parts:
            log("(2) cpu-hetero4: heterogeneity-aware vs symmetric plans")
            two = hetero_vs_symmetric(Path(tmp), args.steps, args.warmup, args.seq_len or None)
        if "3" in parts:
            log("(3) cpu-hetero4-sleep: one 4-stage pipeline under 1F1B, interleaved (v = 2), ZB-H1")
            three = schedules(Path(tmp), args.steps, args.warmup, args.seq_len or 64)
    result: dict = {"steps": args.steps, "warmup": args.warmup, "load_average_1m": os.getloadavg()[0],
                    "cpus": os.cpu_count()}
    if one is not None:
        result.update(overhead_ratio=one["overhead_ratio"], overhead=one)
    if two is not None:
        result.update(symmetric_over_hetero=two["symmetric_over_hetero"], cpu_hetero4=two)
    if three is not None:
        result.update(schedule_step_ratio=three["schedule_step_ratio"], schedules=three)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if one is not None:
        print_overhead(one)
    if two is not None:
        print_hetero(two)
    if three is not None:
        print(f"(3) {three['cluster']}, one 4-stage pipeline, {three['layers']}-layer llama-tiny, "
              f"{three['micro_batches']} micro-batches, seq_len {three['seq_len']}, median step time:")
        for n, r in three["schedules"].items():
            print(f"    {n:12s} {r['step_s'] * 1e3:8.1f} ms  ({three['schedule_step_ratio'][n]:.3f} x 1F1B)")
    print(f"load average during the run: {result['load_average_1m']:.1f} on {result['cpus']} CPUs")


def print_overhead(one: dict) -> None:
    print(f"(1) single device, llama-tiny: plain PyTorch {one['plain_step_s'] * 1e3:.2f} ms/step "
          f"(runs {', '.join(f'{x * 1e3:.2f}' for x in one['plain_step_s_runs'])}), hspmd "
          f"{one['hspmd_step_s'] * 1e3:.2f} ms/step: overhead ratio {one['overhead_ratio']:.3f} (target <= 1.10)")


def print_hetero(two: dict) -> None:
    print(f"(2) cpu-hetero4, llama-tiny, global batch 8, seq_len {two['seq_len']}, median step time:")
    for r in two["plans"]:
        print(f"    {r['kind']:9s} {r['plan'] + ':' + r['strategy']:45s} {r['step_s'] * 1e3:8.1f} ms")
    print(f"    best symmetric {two['best_symmetric']} / demo plan {two['demo_hetero']}: "
          f"{two['symmetric_over_hetero']:.2f}x; / best hetero {two['best_hetero']}: "
          f"{two['symmetric_over_best_hetero']:.2f}x")


if __name__ == "__main__":
    main()
