"""The pipeline behind scripts/gpu_check.sh: the first run of hspmd's CUDA/NCCL path on a GPU machine.

Phases: environment (GPUs, CUDA, NCCL) -> cluster file generated from the GPU's name and memory (this
machine as its node) -> model -> the plans this machine can run -> the CPU fp32 reference -> each plan
trained in bf16 (one process per GPU) and compared with the reference; the one-device plan and the
3-stage interleaved plan traced -> checkpoint round trip -> a documents run (packed rows, GQA) against
the planner's memory -> the meta-device build's memory -> check-numerics -> the GPU's profile against
its spec figures -> elastic recovery (2+ GPUs) -> MFU -> simulated vs measured.

Each phase records ok / failed / skipped with its reason in one JSON summary instead of stopping the
run (with what was and was not exercised); a phase that needs an earlier one that did not succeed is
skipped and says which, as is every phase once the budget is spent. ``--dry-run`` runs the same pipeline
on the CPU (gloo, bf16 autocast on the CPU, tiny sizes, 4 emulated devices) so CI exercises it.
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
TOTAL_BUDGET_S = 400.0  # the phases: with at most 50 s of installing, the check ends within 8 minutes

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


GPU_SIZES = Sizes(layers=12, hidden=512, ffn=1408, heads=8, kv_heads=4, vocab=8192, max_seq=512, seq_len=256,
                  global_batch=8, micro_batch=2, steps=6)
DRY_SIZES = Sizes(layers=12, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256, max_seq=64, seq_len=32,
                  global_batch=4, micro_batch=1, steps=3)
# The documents run: packed rows of up to DOC_SEQ tokens through a GQA model (FlexAttention on CUDA), checked
# against the memory the planner predicts for the plan (``hspmd simulate``), within DOC_MEMORY_TOL.
DOC_SEQ = {"gpu": 16384, "dry-run": 256}
DOC_TOKENS = {"gpu": 32768, "dry-run": 512}
DOC_MEMORY_TOL = 0.10
DRY_DEVICES = 4  # the dry run's emulated devices: enough for every plan of the multi-GPU section
# What an --elastic run on NCCL is started with (the watchdog aborts communicators without ending the process).
NCCL_ELASTIC_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "NCCL_DEBUG": "WARN"}


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

    def left(self, want: float) -> float:
        """A phase's timeout: ``want`` seconds, or what is left of the budget if that is less (at least 10)."""
        return max(10.0, min(want, self.budget_s - (time.monotonic() - self.t0)))

    def requires(self, *names: str) -> None:
        """The first line of every phase: skip it when the budget is spent or a phase it needs failed."""
        if time.monotonic() - self.t0 > self.budget_s:
            raise Skip(f"out of time (the {self.budget_s:.0f} s budget is spent)")
        missing = [n for n in names if not self.ok(n)]
        if missing:
            raise Skip(f"needs phase(s) {', '.join(missing)}, which did not succeed")

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        """Run one phase; whatever happens, record it (and keep going)."""
        rec: dict[str, Any] = {}
        start = time.monotonic()
        try:
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
        from runtime.torchfree.spec.io import atomic_write_text

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


def query_gpus(visible: str | None) -> tuple[list[dict[str, Any]], str]:
    """[{index, name, memory_mib}] of the GPUs this process may use, in PCI bus order, and where they came
    from: nvidia-smi's list narrowed to ``visible`` (an existing CUDA_VISIBLE_DEVICES: indices or UUIDs, as a
    scheduler's allocation sets it), indices renumbered as CUDA will number them; else torch's (run in a child
    process, so that this one never holds GPU memory)."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            rows = [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()]
            by_key = {k: r for r in rows for k in (r[0], r[1])}
            chosen = rows if visible is None else [by_key[k.strip()] for k in visible.split(",")
                                                   if k.strip() in by_key]
            gpus = [{"index": i, "name": r[2], "memory_mib": float(r[3])} for i, r in enumerate(chosen)]
            if gpus:
                return gpus, "nvidia-smi" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            note = "nvidia-smi lists no usable GPU; "
        except (subprocess.SubprocessError, ValueError, OSError, IndexError) as exc:
            note = f"nvidia-smi failed ({exc}); "
    else:
        note = "no nvidia-smi on PATH; "
    probe = ("import json, torch; print(json.dumps([{'index': i, 'name': torch.cuda.get_device_name(i), "
             "'memory_mib': torch.cuda.get_device_properties(i).total_memory / 2**20} "
             "for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []))")
    try:
        gpus = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                         timeout=60, check=True).stdout)
    except (subprocess.SubprocessError, ValueError, OSError) as exc:
        return [], note + f"torch.cuda failed ({exc})"
    return gpus, note + ("torch.cuda" if gpus else "and torch sees no CUDA device")


def datasheet(type_: str) -> tuple[float, float, str] | None:
    """(bf16 TFLOPS, HBM GB/s, source) from a shipped spec profile or the table above, if one matches."""
    from runtime.torchfree.profiling.profile import PROFILES_DIR, read_profile_dir

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
    from runtime.torchfree.spec.io import atomic_write_text, dump_yaml

    atomic_write_text(path, dump_yaml(data))
    return path


@dataclass(frozen=True)
class Layout:
    """A plan the check trains: its pipelines, schedule, ZeRO, the GPUs it needs, and what it exercises."""

    pipelines: tuple[Any, ...]
    gpus: int
    exercises: str
    schedule: str = "1f1b"
    zero: bool = False
    model: str = "model"  # which model file it trains: "model" (dense) or "model_moe" (mixture of experts)
    sequence_parallel: bool = False


def layouts(s: Sizes) -> dict[str, Layout]:
    """Every plan of the check, one process per device: the one-device plan, and for 2+ GPUs the multi-GPU
    section (pipeline schedules, TP x PP, DP with ZeRO-1). ``s.layers`` is a multiple of 6."""
    from runtime.torchfree.spec import Pipeline, Stage

    L, mbs = s.layers, s.global_batch // s.micro_batch
    half, q, six = L // 2, L // 4, L // 6

    def chunks(*ranges: tuple[int, int]) -> tuple[tuple[int, int], ...]:
        return tuple(ranges)

    return {
        "one-device": Layout((Pipeline(mbs, (Stage((0,), ((0, L),)),)),), 1, "one GPU: embedding to loss, AdamW"),
        "two-stage-1f1b": Layout((Pipeline(mbs, (Stage((0,), ((0, half),)), Stage((1,), ((half, L),)))),), 2,
                                 "1F1B over NCCL p2p"),
        "interleaved-2x2": Layout((Pipeline(mbs, (Stage((0,), chunks((0, q), (half, half + q))),
                                                  Stage((1,), chunks((q, half), (half + q, L))))),), 2,
                                  "interleaved 1F1B, 2 stages x 2 chunks", schedule="interleaved"),
        "zb-v": Layout((Pipeline(mbs, (Stage((0,), chunks((0, q), (L - q, L))),
                                       Stage((1,), chunks((q, half), (half, L - q))))),), 2,
                       "ZB-V (split backward, V placement)", schedule="zb-v"),
        "dp2-zero1": Layout(tuple(Pipeline(mbs // 2, (Stage((d,), ((0, L),)),)) for d in (0, 1)), 2,
                            "data parallel 2 with ZeRO-1 (reduce-scatter, all-gather)", zero=True),
        "interleaved-3x2": Layout((Pipeline(mbs, tuple(Stage((k,), chunks((k * six, (k + 1) * six),
                                                                          ((k + 3) * six, (k + 4) * six)))
                                                       for k in range(3))),), 3,
                                  "interleaved 1F1B, 3 stages x 2 chunks (traced)", schedule="interleaved"),
        "tp2-pp2": Layout((Pipeline(mbs, (Stage((0, 1), ((0, half),)), Stage((2, 3), ((half, L),)))),), 4,
                          "TP 2 (DTensor over NCCL) x PP 2"),
        "moe-one-device": Layout((Pipeline(mbs, (Stage((0,), ((0, L),)),)),), 1,
                                 "a Mixtral-style MoE model on one GPU (router, experts, balance loss)",
                                 model="model_moe"),
        "moe-ep2": Layout((Pipeline(mbs, (Stage((0, 1), ((0, L),), experts=((0, (0, 1, 2)), (1, (3,)))),)),), 2,
                          "expert parallelism: experts 3 + 1 on two GPUs, all_to_all_single over NCCL",
                          model="model_moe"),
        "moe-ep2-sp": Layout((Pipeline(mbs, (Stage((0, 1), ((0, L),), experts=((0, (0, 1)), (1, (2, 3)))),)),), 2,
                             "expert parallelism with sequence parallelism (each MoE block gathers the sequence)",
                             model="model_moe", sequence_parallel=True),
    }


def write_plan(path: Path, layout: Layout, s: Sizes, cluster_file: Path, model_file: Path,
               **training: Any) -> Path:
    from runtime.torchfree.spec import Plan, Strategy, TrainingSettings, load_plan_context, save_plan
    from runtime.torchfree.spec.plan import PLAN_VERSION

    settings = TrainingSettings(global_batch=s.global_batch, micro_batch=s.micro_batch, seq_len=s.seq_len,
                                schedule=layout.schedule, zero=layout.zero,  # type: ignore[arg-type]
                                sequence_parallel=layout.sequence_parallel, **training)
    plan = Plan(version=PLAN_VERSION, model=str(model_file), cluster=str(cluster_file), training=settings,
                strategies=(Strategy(path.stem.removeprefix("plan-"), layout.pipelines),))
    save_plan(plan, path)
    load_plan_context(path)  # every generated plan is valid, or its phase fails here
    return path


def make_plans(out: Path, n: int, s: Sizes, cluster_file: Path, models: dict[str, Path]) -> tuple[dict[str, Path],
                                                                                                 dict[str, str]]:
    """The plans this machine can run, and for the others why not (``models``: file by ``Layout.model``)."""
    plans, left_out = {}, {}
    for name, layout in layouts(s).items():
        if layout.gpus > n:
            left_out[name] = f"not run: needs {layout.gpus} GPUs ({layout.exercises}), this machine has {n}"
            continue
        plans[name] = write_plan(out / f"plan-{name}.yaml", layout, s, cluster_file, models[layout.model])
    return plans, left_out


def reference_losses(plan: Path, steps: int) -> list[float]:
    """The single-process CPU fp32 reference on the launcher's data stream: what every plan must match (a
    MoE model's by the plan's micro-batches: its balance loss and capacity are per forward)."""
    import torch

    from runtime.data import token_source
    from runtime.engine.reference import ReferenceTrainer
    from runtime.torchfree.spec import load_plan_context

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    ctx = load_plan_context(plan)
    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t, device="cpu", precision="fp32",
                               micro_batch=t.micro_batch if ctx.model.moe is not None else None)
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
    from runtime.torchfree.profiling.profile import resolve_profiles
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan)
    t = ctx.plan.training
    strategy = ctx.plan.strategy()
    flops = model_flops_per_token(ctx.model, t.seq_len) * t.global_batch * t.seq_len
    peak = sum(ctx.cluster.device_types[ctx.cluster.device(d).type].peak_bf16_tflops for d in strategy.devices)
    out = {"mfu_datasheet": flops / step_time_s / (peak * 1e12), "model_tflops_per_step": flops / 1e12}
    profiles = resolve_profiles(ctx.cluster.device_types, profile_dirs)
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
    return {**out, "mfu_profile_peak": cm.mfu(step_time_s, t.global_batch, strategy.devices)}


def peak_gib(steps: list[dict[str, Any]]) -> float | None:
    """The highest peak memory of any device in a run's metrics (GiB): the CUDA allocator's on GPUs."""
    peaks = [b for r in steps for b in (r.get("peak_memory_bytes") or {}).values()]
    return max(peaks) / 2**30 if peaks else None


def trace_events(trace_dir: Path) -> dict[str, int]:
    """Events per trace file a traced run wrote (each must be a Chrome trace with events)."""
    counts = {}
    for f in sorted(trace_dir.glob("*.json")):
        data = json.loads(f.read_text())
        events = data.get("traceEvents", data) if isinstance(data, dict) else data
        counts[f.name] = len(events)
    if not counts or not all(counts.values()):
        raise Failed(f"the traced run left no trace with events in {trace_dir}: {counts}")
    return counts


BUILD_MEMORY = """
import json, sys, torch
from runtime.engine.build import build_chunk
from runtime.torchfree.engine.specialize import specialize
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle
h = StrategyHandle.of(load_plan_context(sys.argv[1]))
plan = specialize(h, 0)
dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
shards = {s.name: s for s in plan.shards}
module = build_chunk(h.model, plan.role.chunks[0], shards, seed=0, device=dev, mesh=None)
params = sum(p.numel() * p.element_size() for p in module.parameters())
print(json.dumps({"param_bytes": params, "peak_allocated": torch.cuda.max_memory_allocated(dev)}))
"""


ATTENTION_KERNELS = """
import json, sys, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from runtime.models.attention import flex_document_attention
from runtime.models.llama import LlamaForCausalLM
from runtime.torchfree.spec import load_model
spec = load_model(sys.argv[1])
seq = int(sys.argv[2])
dev = torch.device("cuda:0")
model = LlamaForCausalLM(spec).to(dev)
model.init_weights(0)
rows = torch.randint(0, spec.vocab_size, (2, 256), device=dev)
# Windows (is_causal, GQA): flash or memory-efficient attention only; a fall back to the math kernel raises.
with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(rows).float().sum().backward()
# Packed documents at seq tokens (FlexAttention, compiled): no [heads, seq, seq] tensor at any point.
heads, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_size
segments = (torch.arange(seq, device=dev) // (seq // 7)).unsqueeze(0)
q = torch.randn(1, heads, seq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, kv, seq, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(dev)
base = torch.cuda.memory_allocated(dev)
flex_document_attention(segments)(q, k, v).float().sum().backward()
torch.cuda.synchronize()
scores = heads * seq * seq * 4
print(json.dumps({"seq": seq, "peak_above_inputs": torch.cuda.max_memory_allocated(dev) - base,
                  "fp32_scores_bytes": scores}))
"""


def main(argv: list[str] | None = None) -> int:
    import importlib.util
    import socket

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same pipeline on the CPU (gloo), tiny sizes")
    ap.add_argument("--out", type=Path, default=REPO / "gpu-check-out")
    ap.add_argument("--python", default=sys.executable, help="interpreter with hspmd's dependencies")
    ap.add_argument("--install-status", default="ok", help="what gpu_check.sh's install phase reported")
    ap.add_argument("--install-reason", default="")
    ap.add_argument("--install-s", type=float, default=0.0, help="seconds installing took (not in the budget)")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="seconds the phases may take in all")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    mode = "dry-run" if dry else "gpu"
    sizes = DRY_SIZES if dry else GPU_SIZES
    summary = Summary(out / "summary.json", mode, args.budget_s)
    summary.data["sizes"] = sizes.__dict__
    summary.data["loss_tolerance"] = {"step_1": LOSS_TOL_FIRST, "later_steps": LOSS_TOL_LATER}
    summary.phases["install"] = {"status": args.install_status, "seconds": args.install_s,
                                 **({"reason": args.install_reason} if args.install_reason else {})}
    not_exercised: dict[str, str] = summary.data.setdefault("not_exercised", {})
    # Workers number GPUs in PCI bus order (the cluster file's order; hspmd pins it in its workers too).
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    state: dict[str, Any] = {}
    profiles_dir = out / "profiles"
    planner = [m for m in ("pulp", "highspy") if importlib.util.find_spec(m) is None]
    no_planner = (f"{' and '.join(planner)} cannot be imported by {args.python} (the planner's ILP: bring the "
                  "wheels of `make wheels` along)") if planner else ""

    def hspmd_(cmd: list[str], want_s: float, extra_env: dict[str, str] | None = None,
               ok_codes: tuple[int, ...] = (0,)) -> str:
        return hspmd(args.python, cmd, timeout=summary.left(want_s), env={**env, **(extra_env or {})},
                     ok_codes=ok_codes)

    def train(plan: Path, metrics: Path, *extra: str, want_s: float = 150,
              extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        hspmd_(["train", "--plan", str(plan), "--metrics", str(metrics), "--precision", "bf16", "--timeout", "60",
                *extra], want_s, extra_env)  # bf16: on CUDA what 'auto' means; on the CPU it has to be asked for
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return [r for r in records if "event" not in r]   # steps only (an elastic run also logs its failures)

    with summary.phase("environment") as rec:
        summary.requires()
        import torch
        import torch.distributed as dist

        rec.update(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
                   gloo=dist.is_gloo_available(), nccl=dist.is_nccl_available(),
                   planner="ok" if not planner else f"missing {', '.join(planner)}")
        if dry:
            rec.update(device="cpu (dry run)", backend="gloo", count=DRY_DEVICES)
            state.update(count=DRY_DEVICES, type="cpu-dryrun", memory_gib=4.0, node="node0")
        else:
            gpus, source = query_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
            rec.update(gpus=gpus, gpu_source=source)
            if not gpus:
                raise Failed(f"no NVIDIA GPU found ({source})")
            if not dist.is_nccl_available():
                raise Failed("this torch build has no NCCL backend: multi-process GPU training cannot run")
            first = gpus[0]["name"]
            same = [g for g in gpus if g["name"] == first]
            if len(same) < len(gpus):
                # One device type per check: the GPUs like the first (the others hidden from every child).
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                keys = visible.split(",") if visible is not None else [str(g["index"]) for g in gpus]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(keys[g["index"]] for g in same)
                rec["note"] = f"mixed GPU types: checking the {len(same)} x {first} only"
            state.update(count=len(same), type=type_name(first), gpu_name=first, node=socket.gethostname(),
                         memory_gib=min(g["memory_mib"] for g in same) / 1024)
            rec.update(device_type=state["type"], count=state["count"], backend="nccl")
            # Data parallelism needs a micro-batch count divisible by 2 (and every plan a multiple of 6 layers).
            sizes = replace(sizes, global_batch=sizes.micro_batch * math.lcm(4, state["count"]))
            summary.data["sizes"] = sizes.__dict__
            if state["count"] < 2:
                not_exercised["nccl-collectives"] = ("one GPU: p2p, TP, DP, ZeRO-1 and BSR over NCCL need 2+ GPUs "
                                                     "(NCCL refuses two ranks on one GPU)")

    with summary.phase("cluster") as rec:
        summary.requires("environment")
        from runtime.torchfree.spec import load_cluster

        t = state["type"]
        sheet = None if dry else datasheet(t)
        if sheet is None:
            # In a child process: this one must hold no GPU memory (a CUDA context) through the runs below.
            probe = ("import json, sys; from runtime.profiling.compute import measure_throughput; "
                     "print(json.dumps(measure_throughput(sys.argv[1])))")
            p = subprocess.run([args.python, "-c", probe, "cpu" if dry else "cuda:0"], cwd=REPO, capture_output=True,
                               text=True, timeout=summary.left(120), env=env)
            if p.returncode != 0:
                raise Failed("measuring the GEMM rate failed: " + " | ".join(p.stderr.strip().splitlines()[-3:]))
            figs = json.loads(p.stdout.strip().splitlines()[-1])
            sheet = (figs["tflops"], figs["bandwidth_gbs"], "measured here (GEMM rate and copy bandwidth: no "
                                                            "datasheet entry for this GPU)")
        tflops, hbm, source = sheet
        sxm = not dry and any(k in state.get("gpu_name", "") for k in ("SXM", "H100 80GB HBM3", "H200", "H800", "B200"))
        dt: dict[str, Any] = {"memory_gib": round(state["memory_gib"], 1), "peak_bf16_tflops": round(tflops, 4),
                              "hbm_bandwidth_gbs": round(hbm, 2),
                              "intra_node_bandwidth_gbs": NVLINK_GBS if sxm else PCIE_GBS}
        if dry:
            dt["emulate"] = {"slowdown": 1.0}
        # The node is this machine (its host name): every worker checks it runs where the cluster file says.
        cluster = {"name": f"gpu-check-{t.lower()}", "description": f"generated by gpu_check for {t}",
                   "device_types": {t: dt}, "nodes": [{"name": state["node"], "device_type": t,
                                                       "count": state["count"]}],
                   "inter_node_bandwidth_gbs": 25.0}
        path = write_yaml(out / "cluster.yaml", cluster)
        load_cluster(str(path))
        state["cluster"] = path
        rec.update(path=str(path), device_type=t, figures_source=source, **{k: v for k, v in dt.items()
                                                                           if k != "emulate"})

    with summary.phase("model") as rec:
        summary.requires()
        from runtime.torchfree.spec import load_model

        s = sizes
        model = {"name": "gpu-check-llama", "num_layers": s.layers, "hidden_size": s.hidden,
                 "ffn_hidden_size": s.ffn, "num_heads": s.heads, "num_kv_heads": s.kv_heads, "vocab_size": s.vocab,
                 "max_seq_len": s.max_seq}
        path = write_yaml(out / "model.yaml", model)
        spec = load_model(str(path))
        state["model"] = path
        long = dict(model, name="gpu-check-llama-long", max_seq_len=2 * DOC_SEQ[mode])
        state["model_long"] = write_yaml(out / "model-long.yaml", long)
        moe = dict(model, name="gpu-check-mixtral", family="mixtral",
                   moe={"num_experts": 4, "top_k": 2, "expert_ffn_size": s.ffn, "aux_loss_coef": 0.01})
        state["model_moe"] = write_yaml(out / "model-moe.yaml", moe)
        load_model(str(state["model_moe"]))
        rec.update(path=str(path), params=spec.total_params(), gqa=f"{s.heads} query heads, {s.kv_heads} KV heads")

    with summary.phase("plans") as rec:
        summary.requires("cluster", "model")
        plans, left_out = make_plans(out, state["count"], sizes, state["cluster"],
                                     {"model": state["model"], "model_moe": state["model_moe"]})
        state["plans"] = plans
        not_exercised.update(left_out)
        rec.update(plans={k: str(v) for k, v in plans.items()}, left_out=left_out)

    with summary.phase("reference") as rec:
        summary.requires("plans")
        state["reference"] = reference_losses(state["plans"]["one-device"], sizes.steps)
        state["reference_moe"] = reference_losses(state["plans"]["moe-one-device"], sizes.steps)
        rec.update(device="cpu", precision="fp32", losses=state["reference"], losses_moe=state["reference_moe"])

    # The training phases first: the CUDA/NCCL path is what this check is for.
    traced = {"one-device", "interleaved-3x2"}
    for name, plan in state.get("plans", {}).items():
        with summary.phase(f"train:{name}") as rec:
            summary.requires("plans")
            extra = ["--steps", str(sizes.steps)]
            if name in traced:
                extra += ["--trace", str(out / f"trace-{name}")]
            steps = train(plan, out / f"metrics-{name}.jsonl", *extra)
            steady = steps[1:] or steps  # step 1 pays for warm-up (NCCL communicators, kernels)
            step_time = sum(r["step_time_s"] for r in steady) / len(steady)
            state[f"step_time:{name}"] = step_time
            rec.update(exercises=layouts(sizes)[name].exercises, backend="gloo" if dry else "nccl",
                       losses=[r["loss"] for r in steps], step_time_s=step_time,
                       tokens_per_s=sum(r["tokens_per_s"] for r in steady) / len(steady),
                       peak_memory_gib=peak_gib(steps))
            if name in traced:
                rec["trace_events"] = trace_events(out / f"trace-{name}")
        with summary.phase(f"losses:{name}") as rec:
            summary.requires(f"train:{name}", "reference")
            want = state["reference_moe" if layouts(sizes)[name].model == "model_moe" else "reference"]
            cmp = compare_losses(summary.phases[f"train:{name}"]["losses"], want)
            rec.update(cmp)
            if not cmp["ok"]:
                worst = max(cmp["steps"], key=lambda r: r["rel_diff"] / r["tolerance"]) if cmp["steps"] else None
                raise Failed("bf16 losses differ from the CPU fp32 reference beyond tolerance" +
                             (f" (step {worst['step']}: {worst['rel_diff']:.3g} > {worst['tolerance']:g})"
                              if worst else " (no steps)"))

    with summary.phase("checkpoint") as rec:
        summary.requires("train:one-device")
        # Two steps, save, load, one more: step 3 as the uninterrupted run's step 3.
        plan, ck = state["plans"]["one-device"], out / "checkpoint"
        shutil.rmtree(ck, ignore_errors=True)
        train(plan, out / "metrics-save.jsonl", "--steps", "2", "--save", str(ck))
        resumed = train(plan, out / "metrics-load.jsonl", "--steps", "1", "--load", str(ck))
        straight = summary.phases["train:one-device"]["losses"][2]
        rel = abs(resumed[0]["loss"] - straight) / abs(straight)
        rec.update(step=resumed[0]["step"], loss_resumed=resumed[0]["loss"], loss_straight=straight, rel_diff=rel)
        if resumed[0]["step"] != 3 or rel > 1e-3:
            raise Failed(f"resumed step {resumed[0]['step']} loss {resumed[0]['loss']:.6g} vs {straight:.6g} "
                         "uninterrupted (rel 1e-3 allowed)")

    with summary.phase("documents") as rec:
        summary.requires("cluster", "model")
        if planner:
            raise Skip(f"the documents dispatch and the memory prediction need the planner: {no_planner}")
        doc_sizes = replace(sizes, seq_len=DOC_SEQ[mode], global_batch=2, micro_batch=1)
        layout = layouts(sizes)["one-device"]
        from runtime.torchfree.spec import Pipeline

        layout = replace(layout, pipelines=(Pipeline(2, layout.pipelines[0].stages),))
        plan = write_plan(out / "plan-documents.yaml", layout, doc_sizes, state["cluster"], state["model_long"],
                          tokens_per_step=DOC_TOKENS[mode])
        steps = train(plan, out / "metrics-documents.jsonl", "--steps", "2", "--lengths", "longtail")
        peaks = json.loads(hspmd_(["simulate", "--plan", str(plan), "--format", "json"], 60))["peak_memory_gib"]
        predicted = max(peaks.values()) if isinstance(peaks, dict) else peaks   # per device: one device here
        measured = None if dry else peak_gib(steps)   # (on the CPU the metrics' peak is the process' RSS)
        rec.update(seq_len=DOC_SEQ[mode], tokens_per_step=DOC_TOKENS[mode], losses=[r["loss"] for r in steps],
                   documents=[r.get("documents") for r in steps], predicted_peak_gib=predicted,
                   measured_peak_gib=measured, attention="FlexAttention, document block mask" if not dry
                   else "SDPA with the boolean mask (CPU)")
        if not all(math.isfinite(r["loss"]) for r in steps):
            raise Failed("non-finite loss in the documents run")
        if measured is None:
            rec["memory"] = "not measured: the CPU has no allocator peaks"
        elif measured > predicted * (1 + DOC_MEMORY_TOL):
            raise Failed(f"peak {measured:.2f} GiB allocated, the planner predicted {predicted:.2f} GiB "
                         f"(+{DOC_MEMORY_TOL:.0%} allowed)")

    with summary.phase("build-memory") as rec:
        summary.requires("plans")
        if dry:
            raise Skip("CUDA allocator peaks only (the meta-device build's numbers are unit-tested on the CPU)")
        p = subprocess.run([args.python, "-c", BUILD_MEMORY, str(state["plans"]["one-device"])], cwd=REPO,
                           capture_output=True, text=True, timeout=summary.left(120), env=env)
        if p.returncode != 0:
            raise Failed(" | ".join(p.stderr.strip().splitlines()[-3:]))
        got = json.loads(p.stdout.strip().splitlines()[-1])
        rec.update(got, ratio=got["peak_allocated"] / got["param_bytes"])
        if got["peak_allocated"] > 1.05 * got["param_bytes"]:
            raise Failed(f"building the stage peaked at {got['peak_allocated']:,} bytes for {got['param_bytes']:,} "
                         "bytes of parameters: something beyond the shards was allocated on the GPU")

    with summary.phase("attention-kernels") as rec:
        summary.requires("model")
        if dry:
            raise Skip("CUDA kernels (the CPU runs SDPA with the boolean mask; FlexAttention's numbers are "
                       "unit-tested against it)")
        p = subprocess.run([args.python, "-c", ATTENTION_KERNELS, str(state["model_long"]), str(DOC_SEQ[mode])],
                           cwd=REPO, capture_output=True, text=True, timeout=summary.left(180), env=env)
        if p.returncode != 0:
            raise Failed(" | ".join(p.stderr.strip().splitlines()[-3:]))
        got = json.loads(p.stdout.strip().splitlines()[-1])
        rec.update(got, windows="flash / memory-efficient SDPA only (sdpa_kernel)")
        if got["peak_above_inputs"] > got["fp32_scores_bytes"] / 8:
            raise Failed(f"packed-document attention at {got['seq']} tokens peaked at {got['peak_above_inputs']:,} "
                         f"bytes: an s x s tensor ({got['fp32_scores_bytes']:,} bytes in fp32) was likely formed")

    with summary.phase("numerics") as rec:
        summary.requires("environment", "model")
        types = "cpu" if dry else "cpu,cuda"
        # Exit 3: some component was flagged; the JSON report is on stdout all the same.
        cmd = ["check-numerics", "--types", types, "--dtypes", "fp32,bf16", "--model", str(state["model"]),
               "--seq-len", str(min(sizes.seq_len, 64)), "--format", "json"]
        report = json.loads(hspmd_(cmd, 120, ok_codes=(0, 3)))
        worst: dict[str, float] = {}
        for r in report["results"]:
            key = f"{r['device']} {r['dtype']}"
            worst[key] = max(worst.get(key, 0.0), r["forward_rel_error"], r["backward_rel_error"])
        rec.update(flagged=report["flagged"], tolerances=report["tolerances"], worst_rel_error=worst)
        summary.data["results"]["numerics"] = report["results"]
        if report["flagged"]:
            raise Failed(f"components outside tolerance: {', '.join(report['flagged'])}")

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
        rec.update(json.loads(hspmd_(cmd, 150)))
        rec["against_spec"] = against_spec(profiles_dir, state["type"])

    if state.get("count", 0) >= 2 and "two-stage-1f1b" in state.get("plans", {}):
        with summary.phase("elastic") as rec:
            summary.requires("train:dp2-zero1")
            if planner:
                raise Skip(f"replanning after the loss needs the planner: {no_planner}")
            # Two data-parallel replicas; device 1 is killed at step 3, device 0 (a whole replica) goes on
            # alone with a new plan and redoes the step.
            plan = write_plan(out / "plan-elastic.yaml", replace(layouts(sizes)["dp2-zero1"], zero=False), sizes,
                              state["cluster"], state["model"])
            steps = train(plan, out / "metrics-elastic.jsonl", "--steps", "5",
                          "--elastic", "--kill-device", "1", "--at-step", "3",
                          *(["--profile", str(profiles_dir)] if summary.ok("profile") else []),
                          extra_env={} if dry else NCCL_ELASTIC_ENV)
            rec.update(steps=[r["step"] for r in steps], strategies=[r["strategy"] for r in steps],
                       environment=NCCL_ELASTIC_ENV if not dry else "gloo")
            if [r["step"] for r in steps] != [1, 2, 3, 4, 5]:
                raise Failed(f"steps {[r['step'] for r in steps]} after losing device 1, expected 1-5")
    else:
        not_exercised["elastic"] = "--elastic --kill-device needs 2+ GPUs"

    for name, plan in state.get("plans", {}).items():
        with summary.phase(f"mfu:{name}") as rec:
            summary.requires(f"train:{name}")
            rec.update(mfu(plan, [profiles_dir] if summary.ok("profile") else [], state[f"step_time:{name}"]))
        with summary.phase(f"simulate:{name}") as rec:
            summary.requires(f"train:{name}", "profile")
            if planner:
                raise Skip(f"hspmd simulate imports the planner: {no_planner}")
            sim = json.loads(hspmd_(["simulate", "--plan", str(plan), "--profile", str(profiles_dir),
                                     "--format", "json"], 60))
            measured = state[f"step_time:{name}"]
            rec.update(simulated_step_time_s=sim["step_time_s"], measured_step_time_s=measured,
                       rel_error=sim["step_time_s"] / measured - 1.0, profiles=sim.get("profiles"),
                       simulated_peak_gib=sim.get("peak_memory_gib"),
                       measured_peak_gib=summary.phases[f"train:{name}"].get("peak_memory_gib"))

    phases = summary.phases
    for name, p in phases.items():
        if p["status"] == "skipped":
            not_exercised[name] = p["reason"]
    summary.data["exercised"] = sorted(n for n, p in phases.items() if p["status"] == "ok")
    trained = [p for n, p in phases.items() if n.startswith(("train:", "losses:"))]
    summary.data["ok"] = all(p["status"] in ("ok", "skipped") for p in phases.values()) and \
        bool(trained) and all(p["status"] == "ok" for p in trained)
    summary.data["results"]["simulated_vs_measured"] = {n.split(":", 1)[1]: p.get("rel_error")
                                                        for n, p in phases.items() if n.startswith("simulate:")}
    summary.write()
    print(f"[gpu_check] summary: {summary.path} ({'ok' if summary.data['ok'] else 'some phases failed'}, "
          f"{summary.data['seconds']:.0f} s of phases + {args.install_s:.0f} s installing)", file=sys.stderr)
    return 0 if summary.data["ok"] else 1


def against_spec(profiles_dir: Path, device_type: str) -> dict[str, Any]:
    """The measured profile of ``device_type`` beside its datasheet figures (a shipped spec profile or the
    table above): measured / spec for the GEMM rate and the memory bandwidth."""
    from runtime.torchfree.profiling.profile import read_profile_dir

    sheet = datasheet(device_type)
    measured = [p for _, p in read_profile_dir(profiles_dir) if p.device_type == device_type]
    if sheet is None or not measured:
        return {"compared": False, "why": "no spec figures for this type" if sheet is None else "no profile written"}
    c = measured[0].compute
    return {"compared": True, "spec_source": sheet[2], "peak_tflops_ratio": c.peak_tflops / sheet[0],
            "bandwidth_ratio": c.memory_bandwidth_gbs / sheet[1]}


if __name__ == "__main__":
    sys.exit(main())
