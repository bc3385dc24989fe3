#!/usr/bin/env python
"""Elastic training over a failure trace: goodput of hspmd (node agents, in-memory recovery, grow back)
against checkpoint-restart, measured on this machine and modelled at paper scale.

(1) Measured: llama-tiny on cpu-hetero4-sleep split into two emulated nodes (a800: devices 0-1, h20:
    devices 2-3), the demo's dp-pp plan, ``--steps`` steps with the trace ``TRACE`` (>= 3 failures, among
    them the h20 node's agent, and >= 2 returns):
    * hspmd: ``hspmd train --elastic --agents 2 --events`` with two ``hspmd agent`` processes on loopback;
      an agent that dies is started again by this script a second later (as a node's service manager would),
      and says hello when the trace has it return. Goodput = steps / wall time of the whole run.
    * checkpoint-restart (what torchrun's agent does): the same steps as plain ``hspmd train`` runs of
      ``--checkpoint-every`` steps each, chained with ``--save`` / ``--load``; a failure kills the run, and
      the job restarts from the last checkpoint on a plan for the survivors (the planner's); a return is
      taken at the next checkpoint with a planned restart. Goodput = steps / the sum of every run's wall time
      (planning included).
    ``goodput_over_restart`` = hspmd / restart; per event: hspmd's recovery and rejoin times (from the
    metrics file's events).
(2) Modelled, paper scale: llama-32b on h800-h20-48, the planner's elastic plan, a trace of single H20 and
    H800 failures, a whole H20 node lost and every device returning (``PAPER_TRACE``) over
    ``--paper-steps`` steps: planner/trace_model.py ``model_trace`` (hspmd vs restart vs Oobleck-like; each
    line's time broken down, each event's parts, every assumption a named field of the output's
    ``assumptions``). Keys ``modelled_goodput_over_restart`` (target >= 1.5) and
    ``modelled_goodput_over_oobleck_like``: each line checkpoints at Young's optimum for the failures it must
    checkpoint against (restart: every failure; hspmd and Oobleck-like: the losses memory cannot survive, whose
    expected cost they are charged); ``..._same_checkpoints``: every line charged restart's writes instead.
    Restart is priced twice: ``restart`` on the planner's best non-elastic plan (the headline: hspmd's fault
    handling alone) and ``megatron_restart`` on the best symmetric plan over the whole nodes left, as Megatron
    itself runs (key ``modelled_goodput_over_megatron_restart``); ``modelled_<line>_step_time_s``: each
    line's failure-free step time.
(3) Elastic ZeRO-1 (``training.zero_redundancy: 2``) vs elastic without ZeRO vs plain ZeRO-1 (``zero_part``):
    * modelled, paper scale (llama-32b on h800-h20-48, the batch of configs/plans/h800-h20-llama32b.yaml):
      the planner's best plan of each (elastic: >= 2 pipelines), step time and peak memory per device
      (cost model), what ``hspmd plan --elastic`` chooses between the first two, and plain ZeRO-1's strategy
      priced all three ways. ``elastic_zero_over_zero`` = elastic ZeRO-1's step time / plain ZeRO-1's
      (target <= 1.05).
    * measured (short): llama-tiny on cpu-hetero4-sleep, four whole-model pipelines, ``--zero-steps`` steps of
      each setting with ``hspmd train``: median step time (after the first two steps) and the AdamW moment
      elements each device keeps (the plan's ZeRO-1 layout: an exact count, not a memory measurement).
    ``--zero-only`` runs part 3 alone, ``--skip-zero`` skips it.

``--json`` prints one JSON object (nothing else on stdout). ``--skip-measured`` / ``--skip-modelled`` run one
half only. When the measured part fails (a run fails or passes ``--run-timeout``), the object still carries
the modelled figures, with ``measured: {available: false, reason}`` and ``goodput_over_restart: null``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import plan  # noqa: E402
from planner.replan import settings_for  # noqa: E402
from planner.trace_model import model_trace  # noqa: E402
from runtime.elastic.events import parse_trace  # noqa: E402
from runtime.torchfree.profiling.profile import resolve_profiles  # noqa: E402
from runtime.torchfree.spec import PlanContext, load_cluster, load_model, load_plan, load_plan_context, save_plan  # noqa: E402
from runtime.torchfree.spec.handle import StrategyHandle  # noqa: E402

SLEEP_CLUSTER = REPO / "configs" / "clusters" / "cpu-hetero4-sleep.yaml"
SLEEP_PLAN = REPO / "configs" / "plans" / "cpu-hetero4-sleep-dp-pp.yaml"
NODES = [("a800", "emu-a800", 2), ("h20", "emu-h20", 2)]
TOKEN = "bench-elastic"


def trace_for(steps: int) -> dict:
    """>= 3 failures (one a whole node) and >= 2 returns, spread over ``steps``."""
    at = [max(2, round(steps * f)) for f in (0.15, 0.3, 0.45, 0.65, 0.8)]
    return {"events": [{"step": at[0], "action": "kill", "devices": [1]},
                       {"step": at[1], "action": "rejoin", "devices": [1]},
                       {"step": at[2], "action": "kill", "node": "h20"},
                       {"step": at[3], "action": "rejoin", "node": "h20"},
                       {"step": at[4], "action": "kill", "devices": [0]}]}


PAPER_TRACE = {"steps": 1200, "events": [
    {"step": 150, "action": "kill", "devices": [40]},
    {"step": 400, "action": "rejoin", "devices": [40]},
    {"step": 550, "action": "kill", "node": "h20-2"},
    {"step": 800, "action": "kill", "devices": [3]},
    {"step": 950, "action": "rejoin", "node": "h20-2"},
    {"step": 1100, "action": "rejoin", "devices": [3]},
]}


class MeasureFailed(Exception):
    """A measured run did not do what the benchmark needs (its reason goes into the JSON)."""


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetu_cli", *args]


def setup(out: Path) -> tuple[Path, Path]:
    """The two-node sleep cluster and the dp-pp plan on it."""
    text = SLEEP_CLUSTER.read_text()
    head = text[:text.index("\nnodes:")].replace("name: cpu-hetero4-sleep", "name: cpu-hetero4-sleep-2node")
    cluster = out / "cpu-hetero4-sleep-2node.yaml"
    cluster.write_text(head + "\nnodes:\n" + "".join(f"  - {{name: {n}, device_type: {t}, count: {c}}}\n"
                                                     for n, t, c in NODES))
    p = load_plan(SLEEP_PLAN)
    path = out / "plan.yaml"
    save_plan(replace(p, cluster=str(cluster), strategies=(p.strategy("dp-pp"),)), path)
    load_plan_context(path)
    return cluster, path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keep_agent(port: int, node: str, stop: threading.Event, out: Path) -> None:
    """One node's agent, started again a second after it dies, until ``stop``."""
    n = 0
    while not stop.is_set():
        with open(out / f"agent-{node}-{n}.log", "w") as f:
            proc = subprocess.Popen(cli("agent", "--coordinator", f"127.0.0.1:{port}", "--node", node,
                                        "--token", TOKEN, "--timeout", "600"), cwd=REPO, env=env(), stdout=f,
                                    stderr=subprocess.STDOUT)
            while proc.poll() is None and not stop.is_set():
                time.sleep(0.2)
            if proc.poll() is None:  # the job is over: an agent still waiting for its hello's answer
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.returncode == 0:
                return
        n += 1
        time.sleep(1.0)


def measured_hspmd(plan_path: Path, trace_path: Path, steps: int, out: Path, timeout_s: float) -> dict:
    port = free_port()
    stop = threading.Event()
    agents = [threading.Thread(target=keep_agent, args=(port, node, stop, out), daemon=True) for node, _, _ in NODES]
    metrics = out / "hspmd.jsonl"
    t0 = time.perf_counter()
    for a in agents:
        a.start()
    try:
        proc = subprocess.run(cli("train", "--plan", str(plan_path), "--steps", str(steps), "--elastic", "--agents",
                                  "2", "--bind", f"127.0.0.1:{port}", "--token", TOKEN, "--events", str(trace_path),
                                  "--metrics", str(metrics)), cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=timeout_s)
    finally:  # no agent is started again once the job is over, however it ended
        wall = time.perf_counter() - t0
        stop.set()
        for a in agents:
            a.join(60)
    (out / "hspmd.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise MeasureFailed(f"hspmd run failed ({proc.returncode}): {last_line(proc.stderr)}")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    records = [x for x in lines if "event" not in x]
    events = [x for x in lines if "event" in x]
    return {"wall_s": wall, "steps": len(records), "goodput_steps_per_s": len(records) / wall,
            "events": [{"event": e["event"], "step": e["step"],
                        "devices": e.get("failed", e.get("joined")),
                        "time_s": e.get("recovery_s", e.get("total_s")),
                        **({"detect_s": e["detect_s"]} if "detect_s" in e else {})} for e in events]}


def plan_for(ctx: PlanContext, devices: list[int], out: Path, name: str) -> Path:
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    t = ctx.plan.training
    settings = settings_for(t, use_zero=False, time_limit_s=30.0, top_k=1)
    result = plan(ctx.model, ctx.cluster, profiles, settings, devices=devices, baselines=False)
    p = result.to_plan(ctx.plan.model, ctx.plan.cluster, 0)
    path = out / f"{name}.yaml"
    save_plan(replace(p, training=replace(p.training, optimizer=t.optimizer)), path)
    return path


def measured_restart(plan_path: Path, trace: dict, steps: int, every: int, out: Path, timeout_s: float) -> dict:
    """Chained plain runs with a checkpoint every ``every`` steps (see the module docstring)."""
    ctx = load_plan_context(plan_path)
    nodes = {n: [d.id for d in ctx.cluster.devices if d.node == n] for n, _, _ in NODES}
    pending = [dict(e, devices=e.get("devices") or nodes[e["node"]]) for e in trace["events"]]
    running = set(StrategyHandle.of(ctx).devices)
    current = plan_path
    done = 0  # steps in the last checkpoint
    total = 0.0
    ck_n = 0
    runs: list[dict] = []
    planned = set(running)
    while done < steps:
        end = min(done + every, steps)
        used = set(StrategyHandle.of(load_plan_context(current)).devices)
        fail = next((e for e in pending if e["action"] == "kill" and done < e["step"] <= end), None)
        if fail is not None and not set(fail["devices"]) & used:
            pending.remove(fail)  # a device the plan leaves idle: its loss stops nothing
            running -= set(fail["devices"])
            continue
        args = ["train", "--plan", str(current), "--steps", str(end - done), "--save", str(out / f"ck{ck_n + 1}")]
        if done:
            args += ["--load", str(out / f"ck{ck_n}")]
        if fail is not None:
            args += [x for d in sorted(set(fail["devices"]) & used) for x in ("--kill-device", str(d))]
            args += ["--at-step", str(fail["step"])]
        t0 = time.perf_counter()
        proc = subprocess.run(cli(*args), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
        total += wall
        runs.append({"from_step": done + 1, "to_step": end, "wall_s": wall, "failed": fail is not None})
        if fail is not None:
            if proc.returncode == 0:
                raise MeasureFailed("restart baseline: the injected failure did not stop the run")
            pending.remove(fail)
            running -= set(fail["devices"])
        else:
            if proc.returncode != 0:
                raise MeasureFailed(f"restart baseline run failed ({proc.returncode}): {last_line(proc.stderr)}")
            done, ck_n = end, ck_n + 1
            for e in [e for e in pending if e["action"] == "rejoin" and e["step"] <= done + 1]:
                pending.remove(e)
                running |= set(e["devices"])
        if running != planned:
            t0 = time.perf_counter()
            current = plan_for(ctx, sorted(running), out, f"restart-plan-{len(runs)}")
            planned = set(running)
            total += time.perf_counter() - t0
    return {"wall_s": total, "steps": steps, "goodput_steps_per_s": steps / total, "checkpoint_every": every,
            "runs": runs}


def modelled(steps: int) -> dict:
    ctx0 = load_plan_context(REPO / "configs" / "plans" / "h800-h20-llama32b.yaml")
    profiles = resolve_profiles(ctx0.cluster.device_types, [])
    t = ctx0.plan.training
    settings = settings_for(t, elastic=True, use_zero=False, time_limit_s=60.0, top_k=1)
    result = plan(ctx0.model, ctx0.cluster, profiles, settings, baselines=False)
    p = result.to_plan(ctx0.plan.model, ctx0.plan.cluster, 0)
    ctx = PlanContext(p, load_model("llama-32b"), load_cluster("h800-h20-48"), ctx0.path)
    handle = StrategyHandle.of(ctx)
    trace = parse_trace(dict(PAPER_TRACE, steps=steps), ctx.cluster, handle.devices, "PAPER_TRACE")
    return {"plan": handle.describe(), **model_trace(handle, trace.events, steps, profiles, log=log)}


ZERO_SETTINGS = {  # name -> (elastic, use_zero)
    "elastic_zero_r2": (True, True),
    "elastic_no_zero": (True, False),
    "zero": (False, True),
}


def zero_modelled() -> dict:
    """Part 3 at paper scale: each setting's best plan by the planner, and plain ZeRO-1's strategy priced
    three ways (copies 0, 1, 2) to isolate what the copies cost."""
    from planner.cost import CostModel

    ctx = load_plan_context(REPO / "configs" / "plans" / "h800-h20-llama32b.yaml")
    profiles = resolve_profiles(ctx.cluster.device_types, [])
    t = ctx.plan.training
    base = settings_for(t, time_limit_s=60.0, top_k=1)
    out: dict = {"model": ctx.model.name, "cluster": ctx.cluster.name, "global_batch": t.global_batch,
                 "seq_len": t.seq_len}
    best = {}
    for name, (elastic, use_zero) in ZERO_SETTINGS.items():
        t0 = time.perf_counter()
        r = plan(ctx.model, ctx.cluster, profiles, replace(base, elastic=elastic, use_zero=use_zero), baselines=False)
        b = best[name] = r.best
        mem = b.estimate.memory
        out[name] = {"plan": b.summary, "pipelines": len(b.strategy.pipelines), "micro_batch": b.micro_batch,
                     "step_time_s": b.step_time_s, "peak_memory_gib": max(m.gib for m in mem.values()),
                     "optimizer_state_gib": max(m.optimizer for m in mem.values()) / 2**30,
                     "zero_gather_s": b.estimate.extra.get("zero_gather_s", 0.0),
                     "plan_s": time.perf_counter() - t0}
        log(f"  {name}: {b.step_time_s:.3f} s, peak {out[name]['peak_memory_gib']:.1f} GiB ({b.summary})")
    auto = plan(ctx.model, ctx.cluster, profiles, replace(base, elastic=True), baselines=False)
    out["hspmd_plan_elastic_chooses"] = auto.zero_choice
    z = best["zero"]
    cm = CostModel(ctx.model, ctx.cluster, profiles, micro_batch=z.micro_batch, seq_len=t.seq_len)
    same = {}
    for copies, label in ((0, "no_zero"), (1, "zero"), (2, "zero_r2")):
        if copies > len(z.strategy.pipelines):
            continue
        est = cm.estimate(z.strategy, t.global_batch, t.schedule, copies)
        same[label] = {"step_time_s": est.step_time_s, "peak_memory_gib": max(m.gib for m in est.memory.values()),
                       "oom_devices": list(est.oom_devices)}
    out["zero_plan_priced_three_ways"] = {"plan": z.summary, **same}
    out["elastic_zero_over_zero"] = best["elastic_zero_r2"].step_time_s / best["zero"].step_time_s
    out["elastic_no_zero_over_zero"] = best["elastic_no_zero"].step_time_s / best["zero"].step_time_s
    return out


def zero_measured(steps: int, out_dir: Path) -> dict:
    """Part 3 measured: the same four-pipeline plan on cpu-hetero4-sleep under each setting, ``steps`` steps."""
    from runtime.torchfree.annotations.from_plan import strategy_annotations
    from runtime.torchfree.engine.zero import moment_pieces, strategy_zero_slices

    plan0 = load_plan(SLEEP_PLAN)
    whole = plan0.strategies[0].pipelines[0]  # one device, every layer
    four = replace(plan0.strategies[0], name="dp4", pipelines=tuple(
        replace(whole, micro_batches=2, stages=(replace(whole.stages[0], devices=(d,)),)) for d in range(4)))
    res: dict = {"cluster": "cpu-hetero4-sleep", "plan": "4 whole-model pipelines (llama-tiny), devices 0-3",
                 "steps": steps}
    for name, zero, r in (("elastic_zero_r2", True, 2), ("elastic_no_zero", False, 1), ("zero", True, 1)):
        path = out_dir / f"zero-{name}.yaml"
        training = replace(plan0.training, zero=zero, zero_redundancy=r)
        save_plan(replace(plan0, training=training, strategies=(four,)), path)
        ctx = load_plan_context(path)
        handle = StrategyHandle.of(ctx)
        ann = strategy_annotations(handle)
        slices = strategy_zero_slices(ann, ctx.plan.training, ctx.cluster)
        kept = {}
        for d in handle.devices:
            pieces = moment_pieces(slices, d)
            kept[d] = sum(p.numel for ps in pieces.values() for p in ps) + sum(
                p.param.layout(p.shape).by_device[d].numel for p in ann.params
                if p.name not in pieces and d in p.param.devices)
        metrics = out_dir / f"zero-{name}.jsonl"
        args = ["train", "--plan", str(path), "--steps", str(steps), "--metrics", str(metrics)]
        if name.startswith("elastic"):
            args.append("--elastic")
        proc = subprocess.run(cli(*args), cwd=REPO, env=env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} run failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        times = sorted(x["step_time_s"] for x in map(json.loads, metrics.read_text().splitlines())
                       if "event" not in x and x["step"] > 2)
        res[name] = {"median_step_time_s": times[len(times) // 2], "moment_elements_per_device": kept,
                     "max_moment_elements": max(kept.values())}
        log(f"  {name}: median step {res[name]['median_step_time_s']:.3f} s, moments per device {kept}")
    res["elastic_zero_over_zero"] = res["elastic_zero_r2"]["median_step_time_s"] / res["zero"]["median_step_time_s"]
    return res


def zero_part(measured: bool, modelled: bool, steps: int, out_dir: Path) -> dict:
    """Part 3: elastic ZeRO-1 (r = 2) vs elastic without ZeRO vs plain ZeRO-1."""
    out: dict = {}
    if modelled:
        log("part 3 modelled: llama-32b on h800-h20-48, elastic ZeRO-1 (r = 2) / elastic no ZeRO / ZeRO-1")
        out["modelled"] = zero_modelled()
        out["elastic_zero_over_zero"] = out["modelled"]["elastic_zero_over_zero"]
    if measured:
        log(f"part 3 measured: cpu-hetero4-sleep, {steps} steps per setting")
        out["measured"] = zero_measured(steps, out_dir)
    return out


def measured_part(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        d = args.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        _, plan_path = setup(d)
        trace = trace_for(args.steps)
        trace_path = d / "trace.yaml"
        trace_path.write_text(json.dumps(trace))  # JSON is YAML
        log(f"measured: hspmd with 2 agents, {args.steps} steps, trace {trace['events']}")
        h = measured_hspmd(plan_path, trace_path, args.steps, d, args.run_timeout)
        log(f"measured: checkpoint-restart every {args.checkpoint_every} steps")
        r = measured_restart(plan_path, trace, args.steps, args.checkpoint_every, d, args.run_timeout)
        return {"available": True, "cluster": "cpu-hetero4-sleep (2 emulated nodes)", "trace": trace["events"],
                "hspmd": h, "restart": r}


# The modelled part's headline figures, repeated at the top level of the JSON.
MODELLED_KEYS = ("modelled_goodput_over_restart", "modelled_goodput_over_megatron_restart",
                 "modelled_goodput_over_oobleck_like", "modelled_goodput_over_restart_same_checkpoints",
                 "modelled_goodput_over_oobleck_like_same_checkpoints")
MODELLED_LINES = ("hspmd", "restart", "megatron_restart", "oobleck_like")  # each line's step time, at the top too


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--paper-steps", type=int, default=1200)
    ap.add_argument("--skip-measured", action="store_true")
    ap.add_argument("--skip-modelled", action="store_true")
    ap.add_argument("--run-timeout", type=float, default=1800.0,
                    help="Seconds one measured training run may take before the measured part counts as failed.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", type=Path, help="Keep the measured runs' files (logs, metrics, plans) here.")
    ap.add_argument("--zero-steps", type=int, default=8, help="Part 3, measured: steps per setting.")
    ap.add_argument("--zero-only", action="store_true", help="Run part 3 (elastic ZeRO-1) alone.")
    ap.add_argument("--skip-zero", action="store_true", help="Skip part 3 (elastic ZeRO-1).")
    args = ap.parse_args()
    out: dict = {"elastic_zero_over_zero": None}
    if not args.skip_zero:
        with tempfile.TemporaryDirectory(prefix="bench-elastic-zero-") as tmp:
            d = args.keep or Path(tmp)
            d.mkdir(parents=True, exist_ok=True)
            z = zero_part(not args.skip_measured, not args.skip_modelled, args.zero_steps, d)
        out["elastic_zero_over_zero"] = z.pop("elastic_zero_over_zero", None)
        out["elastic_zero"] = z
    if not args.skip_measured and not args.zero_only:
        try:
            out["measured"] = measured_part(args)
            out["goodput_over_restart"] = (out["measured"]["hspmd"]["goodput_steps_per_s"]
                                           / out["measured"]["restart"]["goodput_steps_per_s"])
        except (MeasureFailed, OSError, subprocess.SubprocessError, ValueError, KeyError) as err:
            # The modelled figures still stand: report them, with the measured part marked and why.
            log(f"measured part unavailable: {err}")
            out["measured"] = {"available": False, "reason": str(err)}
            out["goodput_over_restart"] = None
    if not args.skip_modelled and not args.zero_only:
        log(f"modelled: llama-32b on h800-h20-48, {args.paper_steps} steps")
        m = modelled(args.paper_steps)
        out["modelled"] = m
        out.update({k: m[k] for k in MODELLED_KEYS})
        out.update({f"modelled_{name}_step_time_s": m[name]["initial_step_time_s"] for name in MODELLED_LINES})
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            if not isinstance(v, dict):
                print(f"{k}: {v}")


if __name__ == "__main__":
    main()
