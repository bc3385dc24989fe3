"""The pipeline behind scripts/gpu_check.sh: the first run of hspmd's CUDA/NCCL path on a GPU machine.

Phases: environment (GPUs, CUDA, NCCL) -> cluster file generated from the GPU's name and memory ->
check-numerics (every component on the GPU in fp32 and bf16 against fp64) -> profile of the GPU type ->
a small Llama trained for a few steps in bf16 on NCCL (one process per GPU) for each plan that fits the
machine -> the same steps of the single-process CPU fp32 reference -> loss comparison within bf16
tolerances -> MFU -> the same plans simulated with the new profile, simulated vs measured step time.

Each phase records ok / failed / skipped with its reason in one JSON summary instead of stopping the
run; a phase that needs an earlier one that did not succeed is skipped and says which. ``--dry-run``
runs the same pipeline on the CPU (gloo, bf16 autocast on the CPU, tiny sizes) so CI exercises it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Relative |loss(bf16 run) - loss(CPU fp32 reference)| / loss(reference) accepted per step. Step 1 differs by
# the forward pass's bf16 rounding only (~0.1-0.5% measured on the CPU); AdamW then lets the runs drift
# apart a little every step, so later steps get a wider bound.
LOSS_TOL_FIRST = 1e-2
LOSS_TOL_LATER = 3e-2
TOTAL_BUDGET_S = 285.0  # the whole check stays under 5 minutes; phases past it are skipped (--budget-s)

# bf16 dense peak (TFLOPS) and HBM bandwidth (GB/s) of GPUs that profiles/ has no spec profile for.
DATASHEET = {"H200": (989.0, 4800.0), "GH200": (989.0, 4000.0), "B200": (2250.0, 8000.0), "A10": (125.0, 600.0),
             "A40": (150.0, 696.0), "RTX-A6000": (155.0, 768.0), "L20": (119.0, 864.0)}
NVLINK_GBS = 450.0   # per-GPU NVLink bandwidth assumed for SXM parts (the profile's link measurement wins)
PCIE_GBS = 25.0      # otherwise: PCIe


@dataclass(frozen=True)
class Sizes:
    """The model and batch a mode trains: small enough for a CPU fp32 reference in seconds."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    max_seq: int
    seq_len: int
    global_batch: int
    micro_batch: int
    steps: int


GPU_SIZES = Sizes(layers=4, hidden=512, ffn=1408, heads=8, kv_heads=4, vocab=8192, max_seq=512, seq_len=256,
                  global_batch=8, micro_batch=2, steps=6)
DRY_SIZES = Sizes(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256, max_seq=64, seq_len=32,
                  global_batch=4, micro_batch=1, steps=3)


class Skip(Exception):
    """The phase cannot run here (and that is not a failure of hspmd)."""


class Failed(Exception):
    """The phase ran and did not succeed; the message says why."""


class Summary:
    def __init__(self, path: Path, mode: str, budget_s: float) -> None:
        self.path = path
        self.budget_s = budget_s
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {"mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "phases": {}, "results": {}}

    @property
    def phases(self) -> dict[str, dict[str, Any]]:
        return self.data["phases"]

    def ok(self, name: str) -> bool:
        return self.phases.get(name, {}).get("status") == "ok"

    def requires(self, *names: str) -> None:
        missing = [n for n in names if not self.ok(n)]
        if missing:
            raise Skip(f"needs phase(s) {', '.join(missing)}, which did not succeed")

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        """Run one phase; whatever happens, record it (and keep going)."""
        rec: dict[str, Any] = {}
        start = time.monotonic()
        try:
            if start - self.t0 > self.budget_s:
                raise Skip(f"out of time (the {self.budget_s:.0f} s budget is spent)")
            yield rec
            rec.setdefault("status", "ok")
        except Skip as why:
            rec.update(status="skipped", reason=str(why))
        except Failed as why:
            rec.update(status="failed", reason=str(why))
        except Exception as exc:  # a bug or an unexpected environment: record it, go on
            rec.update(status="failed", reason=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc(limit=4).splitlines()[-6:])
        rec["seconds"] = round(time.monotonic() - start, 2)
        self.phases[name] = rec
        print(f"[gpu_check] {name}: {rec['status']}" + (f" ({rec['reason']})" if "reason" in rec else ""),
              file=sys.stderr, flush=True)
        self.write()

    def write(self) -> None:
        from runtime.spec.io import atomic_write_text

        self.data["seconds"] = round(time.monotonic() - self.t0, 2)
        atomic_write_text(self.path, json.dumps(self.data, indent=2) + "\n")


def hspmd(python: str, args: list[str], timeout: float, env: dict[str, str] | None = None,
          ok_codes: tuple[int, ...] = (0,)) -> str:
    """Run one hspmd verb; its stdout, or Failed with the exit code and the last lines it printed."""
    try:
        p = subprocess.run([python, "-m", "hetu_cli", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise Failed(f"hspmd {args[0]} ran past {timeout:.0f} s") from None
    if p.returncode not in ok_codes:
        tail = " | ".join((p.stderr.strip() or p.stdout.strip()).splitlines()[-4:])
        raise Failed(f"hspmd {args[0]} exited {p.returncode}: {tail}")
    return p.stdout


def type_name(gpu_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100-80GB-HBM3': a device type name usable in files and plans."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", gpu_name.strip())
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "gpu"


def query_gpus() -> tuple[list[dict[str, Any]], str]:
    """[{index, name, memory_mib}] from nvidia-smi, else from torch; and where they came from."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            gpus = []
            for line in out.strip().splitlines():
                idx, name, mem = (x.strip() for x in line.split(","))
                gpus.append({"index": int(idx), "name": name, "memory_mib": float(mem)})
            if gpus:
                return gpus, "nvidia-smi"
        except (subprocess.SubprocessError, ValueError, OSError) as exc:
            note = f"nvidia-smi failed ({exc}); "
        else:
            note = "nvidia-smi lists no GPU; "
    else:
        note = "no nvidia-smi on PATH; "
    import torch

    if torch.cuda.is_available():
        return [{"index": i, "name": torch.cuda.get_device_name(i),
                 "memory_mib": torch.cuda.get_device_properties(i).total_memory / 2**20}
                for i in range(torch.cuda.device_count())], note + "torch.cuda"
    return [], note + "and torch sees no CUDA device"


def datasheet(type_: str) -> tuple[float, float, str] | None:
    """(bf16 TFLOPS, HBM GB/s, source) from a shipped spec profile or the table above, if one matches."""
    from runtime.profiling.profile import PROFILES_DIR, read_profile_dir

    # Whole tokens only ('H20' must not match an H200), single or two joined ('RTX' '4090' -> 'RTX4090').
    tokens = [t for t in re.split(r"[^A-Z0-9]+", type_.upper()) if t]
    names = set(tokens) | {a + b for a, b in zip(tokens, tokens[1:])}

    def head(name: str) -> str:
        return re.split(r"[^A-Z0-9]+", name.upper())[0]

    for path, prof in read_profile_dir(PROFILES_DIR):
        if prof.provenance == "spec" and prof.compute.activation_bytes == 2 and head(prof.device_type) in names:
            return prof.compute.peak_tflops, prof.compute.memory_bandwidth_gbs, f"profiles/{path.name} (spec)"
    for name, (tf, bw) in DATASHEET.items():
        if head(name) in names or name.upper().replace("-", "") in names:
            return tf, bw, "gpu_check.py datasheet table"
    return None


def write_yaml(path: Path, data: Any) -> Path:
    from runtime.spec.io import atomic_write_text, dump_yaml

    atomic_write_text(path, dump_yaml(data))
    return path


def make_plans(out: Path, n: int, s: Sizes, cluster_file: Path, model_file: Path, *,
               data_parallel: bool = True) -> dict[str, Path]:
    """The plans this machine can run, one process per device: one device; two pipeline stages on
    devices 0 and 1; data parallel over every device."""
    from runtime.spec import Pipeline, Plan, Stage, Strategy, TrainingSettings, load_plan_context, save_plan
    from runtime.spec.plan import PLAN_VERSION

    mbs = s.global_batch // s.micro_batch
    half = s.layers // 2
    layouts: dict[str, tuple[Pipeline, ...]] = {"one-device": (Pipeline(mbs, (Stage((0,), (0, s.layers)),)),)}
    if n >= 2:
        layouts["two-stage"] = (Pipeline(mbs, (Stage((0,), (0, half)), Stage((1,), (half, s.layers)))),)
        if data_parallel and mbs % n == 0:
            layouts[f"data-parallel-{n}"] = tuple(Pipeline(mbs // n, (Stage((d,), (0, s.layers)),))
                                                  for d in range(n))
    training = TrainingSettings(global_batch=s.global_batch, micro_batch=s.micro_batch, seq_len=s.seq_len)
    plans = {}
    for name, pipes in layouts.items():
        plan = Plan(version=PLAN_VERSION, model=str(model_file), cluster=str(cluster_file), training=training,
                    strategies=(Strategy(name, pipes),))
        path = out / f"plan-{name}.yaml"
        save_plan(plan, path)
        load_plan_context(path)  # every generated plan is valid, or this phase fails here
        plans[name] = path
    return plans


def reference_losses(plan: Path, steps: int) -> list[float]:
    """The single-process CPU fp32 reference on the launcher's data stream: what every plan must match."""
    import torch

    from runtime.data import token_source
    from runtime.engine.reference import ReferenceTrainer
    from runtime.spec import load_plan_context

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    ctx = load_plan_context(plan)
    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t, device="cpu", precision="fp32")
    source = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len,
                          seed=t.seed)
    return [trainer.train_step(source.batch(k)).loss for k in range(1, steps + 1)]


def compare_losses(measured: list[float], reference: list[float]) -> dict[str, Any]:
    rows = []
    ok = len(measured) == len(reference) and len(measured) > 0
    for k, (a, b) in enumerate(zip(measured, reference), start=1):
        rel = abs(a - b) / abs(b) if b else math.inf
        tol = LOSS_TOL_FIRST if k == 1 else LOSS_TOL_LATER
        ok = ok and rel <= tol and math.isfinite(a)
        rows.append({"step": k, "loss": a, "reference": b, "rel_diff": rel, "tolerance": tol})
    return {"ok": ok, "steps": rows}


def mfu(plan: Path, profile_dirs: list[Path], step_time_s: float) -> dict[str, float]:
    """Model FLOPs utilisation of a measured step: against the cluster file's peak (datasheet) and
    against the profile's peak (its measured GEMM rate when the profile is measured)."""
    from planner.cost import CostModel, model_flops_per_token
    from runtime.profiling.profile import resolve_profiles
    from runtime.spec import load_plan_context

    ctx = load_plan_context(plan)
    t = ctx.plan.training
    strategy = ctx.plan.strategy()
    flops = model_flops_per_token(ctx.model, t.seq_len) * t.global_batch * t.seq_len
    peak = sum(ctx.cluster.device_types[ctx.cluster.device(d).type].peak_bf16_tflops for d in strategy.devices)
    profiles = resolve_profiles(ctx.cluster.device_types, profile_dirs)
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
    return {"mfu_datasheet": flops / step_time_s / (peak * 1e12),
            "mfu_profile_peak": cm.mfu(step_time_s, t.global_batch, strategy.devices),
            "model_tflops_per_step": flops / 1e12}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same pipeline on the CPU (gloo), tiny sizes")
    ap.add_argument("--out", type=Path, default=REPO / "gpu-check-out")
    ap.add_argument("--python", default=sys.executable, help="interpreter with hspmd installed")
    ap.add_argument("--install-status", default="ok", help="what gpu_check.sh's install phase reported")
    ap.add_argument("--install-reason", default="")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                    help="seconds the phases may take in all (gpu_check.sh passes what installing left)")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    sizes = DRY_SIZES if dry else GPU_SIZES
    summary = Summary(out / "summary.json", "dry-run" if dry else "gpu", args.budget_s)
    summary.data["sizes"] = sizes.__dict__
    summary.data["loss_tolerance"] = {"step_1": LOSS_TOL_FIRST, "later_steps": LOSS_TOL_LATER}
    summary.phases["install"] = {"status": args.install_status, **({"reason": args.install_reason}
                                                                   if args.install_reason else {})}
    env = dict(os.environ)
    state: dict[str, Any] = {}
    profiles_dir = out / "profiles"

    with summary.phase("environment") as rec:
        import torch
        import torch.distributed as dist

        rec.update(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available(), gloo=dist.is_gloo_available(),
                   nccl=dist.is_nccl_available())
        if dry:
            rec.update(device="cpu (dry run)", backend="gloo", count=2)
            state.update(count=2, type="cpu-dryrun", memory_gib=4.0)
        else:
            gpus, source = query_gpus()
            rec.update(gpus=gpus, gpu_source=source)
            if not gpus:
                raise Failed(f"no NVIDIA GPU found ({source})")
            if not torch.cuda.is_available():
                raise Failed(f"{len(gpus)} GPU(s) listed by {source}, but this torch ({torch.__version__}, CUDA "
                             f"{torch.version.cuda}) cannot use them: install a CUDA build of torch")
            if not dist.is_nccl_available():
                raise Failed("this torch build has no NCCL backend: multi-process GPU training cannot run")
            rec["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
            first = gpus[0]["name"]
            same = [g for g in gpus if g["name"] == first]
            if len(same) < len(gpus):
                # One device type per check: the GPUs like GPU 0 (others hidden from every child process).
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g["index"]) for g in same)
                rec["note"] = f"mixed GPU types: checking the {len(same)} x {first} only"
            state.update(count=len(same), type=type_name(first), gpu_name=first,
                         memory_gib=min(g["memory_mib"] for g in same) / 1024)
            rec.update(device_type=state["type"], count=state["count"], backend="nccl")
            # Data parallelism over every GPU needs a micro-batch count divisible by the GPU count.
            sizes = replace(sizes, global_batch=sizes.micro_batch * math.lcm(4, state["count"]))
            summary.data["sizes"] = sizes.__dict__

    with summary.phase("cluster") as rec:
        summary.requires("environment")
        from runtime.spec import load_cluster

        t = state["type"]
        sheet = None if dry else datasheet(t)
        if sheet is None:
            from runtime.profiling.compute import measure_throughput

            figs = measure_throughput("cpu" if dry else "cuda:0")
            sheet = (figs["tflops"], figs["bandwidth_gbs"], "measured here (GEMM rate and copy bandwidth: no "
                                                            "datasheet entry for this GPU)")
        tflops, hbm, source = sheet
        sxm = not dry and any(k in state.get("gpu_name", "") for k in ("SXM", "H100 80GB HBM3", "H200", "H800", "B200"))
        dt: dict[str, Any] = {"memory_gib": round(state["memory_gib"], 1), "peak_bf16_tflops": round(tflops, 4),
                              "hbm_bandwidth_gbs": round(hbm, 2),
                              "intra_node_bandwidth_gbs": NVLINK_GBS if sxm else PCIE_GBS}
        if dry:
            dt["emulate"] = {"slowdown": 1.0}
        cluster = {"name": f"gpu-check-{t.lower()}", "description": f"generated by gpu_check for {t}",
                   "device_types": {t: dt}, "nodes": [{"name": "node0", "device_type": t, "count": state["count"]}],
                   "inter_node_bandwidth_gbs": 25.0}
        path = write_yaml(out / "cluster.yaml", cluster)
        load_cluster(str(path))
        state["cluster"] = path
        rec.update(path=str(path), device_type=t, figures_source=source, **{k: v for k, v in dt.items()
                                                                           if k != "emulate"})

    with summary.phase("model") as rec:
        from runtime.spec import load_model

        s = sizes
        model = {"name": "gpu-check-llama", "num_layers": s.layers, "hidden_size": s.hidden,
                 "ffn_hidden_size": s.ffn, "num_heads": s.heads, "num_kv_heads": s.kv_heads, "vocab_size": s.vocab,
                 "max_seq_len": s.max_seq}
        path = write_yaml(out / "model.yaml", model)
        spec = load_model(str(path))
        state["model"] = path
        rec.update(path=str(path), params=spec.total_params())

    with summary.phase("numerics") as rec:
        summary.requires("environment", "model")
        types = "cpu" if dry else "cpu,cuda"
        # Exit 3: some component was flagged; the JSON report is on stdout all the same.
        cmd = ["check-numerics", "--types", types, "--dtypes", "fp32,bf16", "--model", str(state["model"]),
               "--seq-len", str(min(sizes.seq_len, 64)), "--format", "json"]
        report = json.loads(hspmd(args.python, cmd, timeout=120, env=env, ok_codes=(0, 3)))
        worst: dict[str, float] = {}
        for r in report["results"]:
            key = f"{r['device']} {r['dtype']}"
            worst[key] = max(worst.get(key, 0.0), r["forward_rel_error"], r["backward_rel_error"])
        rec.update(flagged=report["flagged"], tolerances=report["tolerances"], worst_rel_error=worst)
        summary.data["results"]["numerics"] = report["results"]
        if report["flagged"]:
            raise Failed(f"components outside tolerance: {', '.join(report['flagged'])}")

    with summary.phase("plans") as rec:
        summary.requires("cluster", "model")
        # The dry run leaves out data parallelism: the same code path as the others, and CI time is short.
        plans = make_plans(out, state["count"], sizes, state["cluster"], state["model"], data_parallel=not dry)
        state["plans"] = plans
        rec["plans"] = {k: str(v) for k, v in plans.items()}
        if dry:
            rec["data-parallel"] = "not run in the dry run (the same code path as the plans above)"
        if state["count"] < 2:
            rec["two-stage"] = ("not run: one GPU. hspmd's launcher gives every device its own GPU "
                                "(cuda:<local index>) and NCCL refuses two ranks on one GPU ('Duplicate GPU "
                                "detected'), so a two-process plan needs two GPUs")

    with summary.phase("reference") as rec:
        summary.requires("plans")
        first = next(iter(state["plans"].values()))
        state["reference"] = reference_losses(first, sizes.steps)
        rec.update(device="cpu", precision="fp32", losses=state["reference"])

    precision = "bf16"  # on CUDA this is also what 'auto' means; on the CPU it has to be asked for
    for name, plan in state.get("plans", {}).items():
        metrics = out / f"metrics-{name}.jsonl"
        with summary.phase(f"train:{name}") as rec:
            hspmd(args.python, ["train", "--plan", str(plan), "--steps", str(sizes.steps), "--metrics", str(metrics),
                                "--precision", precision, "--timeout", "60"], timeout=120, env=env)
            steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            losses = [r["loss"] for r in steps]
            steady = steps[1:] or steps  # step 1 pays for warm-up (NCCL communicators, kernels)
            step_time = sum(r["step_time_s"] for r in steady) / len(steady)
            state[f"step_time:{name}"] = step_time
            rec.update(precision=precision, backend="gloo" if dry else "nccl", losses=losses,
                       step_time_s=step_time, tokens_per_s=sum(r["tokens_per_s"] for r in steady) / len(steady))
        with summary.phase(f"losses:{name}") as rec:
            summary.requires(f"train:{name}", "reference")
            cmp = compare_losses(summary.phases[f"train:{name}"]["losses"], state["reference"])
            rec.update(cmp)
            if not cmp["ok"]:
                worst = max(cmp["steps"], key=lambda r: r["rel_diff"] / r["tolerance"]) if cmp["steps"] else None
                raise Failed("bf16 losses differ from the CPU fp32 reference beyond tolerance" +
                             (f" (step {worst['step']}: {worst['rel_diff']:.3g} > {worst['tolerance']:g})"
                              if worst else " (no steps)"))

    # Profiling comes after training: the NCCL/bf16 path is what this check is for, so it runs first.
    with summary.phase("profile") as rec:
        summary.requires("cluster", "model")
        cmd = ["profile", "--cluster", str(state["cluster"]), "--model", str(state["model"]), "--out",
               str(profiles_dir), "--format", "json"]
        if dry:
            cmd += ["--seq-lens", "8,16,32", "--budget", "0.005", "--no-comm"]
        else:
            cmd += ["--device-type", state["type"], "--seq-lens", "32,64,128,256", "--budget", "0.02"]
            if state["count"] < 2:
                cmd.append("--no-comm")  # links need two GPUs
            else:
                cmd += ["--link-processes", str(min(state["count"], 8))]
        report = json.loads(hspmd(args.python, cmd, timeout=150, env=env))
        rec.update(report)

    for name, plan in state.get("plans", {}).items():
        with summary.phase(f"mfu:{name}") as rec:
            summary.requires(f"train:{name}")
            rec.update(mfu(plan, [profiles_dir] if summary.ok("profile") else [], state[f"step_time:{name}"]))
        with summary.phase(f"simulate:{name}") as rec:
            summary.requires(f"train:{name}", "profile")
            sim = json.loads(hspmd(args.python, ["simulate", "--plan", str(plan), "--profile", str(profiles_dir),
                                                 "--format", "json"], timeout=60, env=env))
            measured = state[f"step_time:{name}"]
            rec.update(simulated_step_time_s=sim["step_time_s"], measured_step_time_s=measured,
                       rel_error=sim["step_time_s"] / measured - 1.0, profiles=sim.get("profiles"))

    phases = summary.phases
    trained = [p for n, p in phases.items() if n.startswith(("train:", "losses:"))]
    summary.data["ok"] = all(p["status"] in ("ok", "skipped") for p in phases.values()) and \
        bool(trained) and all(p["status"] == "ok" for p in trained)
    summary.data["results"]["simulated_vs_measured"] = {n.split(":", 1)[1]: p.get("rel_error")
                                                        for n, p in phases.items() if n.startswith("simulate:")}
    summary.write()
    print(f"[gpu_check] summary: {summary.path} ({'ok' if summary.data['ok'] else 'some phases failed'})",
          file=sys.stderr)
    return 0 if summary.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
