"""``hspmd profile``: measure the device types present on this machine and write their profiles.

CPU-emulated clusters (every type has ``emulate:``): the CPU is measured once, with the intra-op thread
count and the pinning the launcher gives each worker (the CLI's ``cpus``, hetu_cli/emulation.py ``cpu_shares``:
cores // cluster devices threads, pinned), and every emulated type is derived from it by its
``emulate.slowdown`` (compute stretched, links not: that is how the runtime emulates). A CUDA GPU is
measured as the one cluster device type named by ``device_type``. Links are measured among local
processes (gloo on CPU, NCCL on GPUs): ping-pong for p2p, all-reduce per group size.
"""

from __future__ import annotations

import dataclasses
import platform
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.profiling import compute, host
from runtime.profiling.fit import Sample, fit_component, measured_model, rounded
from runtime.profiling.host import WorkerCpus
from runtime.profiling.links import p2p_and_allreduce
from runtime.torchfree.errors import HspmdError, InfeasibleError
from runtime.torchfree.profiling.profile import (
    COMPONENTS,
    PROFILE_VERSION,
    CommFigures,
    ComputeFigures,
    DeviceProfile,
    LinkFit,
    MeasuredModel,
    MemoryFigures,
    OptimizerFit,
    Source,
    save_profile,
)
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec

Progress = Callable[[str, int], None]  # (what is being measured now, steps done since last call)


@dataclass(frozen=True)
class ProfileSettings:
    seq_lens: tuple[int, ...] = (16, 32, 64, 128, 256)
    micro_batch: int = 1
    comm_sizes: tuple[int, ...] = (4, 16384, 65536, 262144, 1 << 20)   # bytes per message
    comm_processes: int = 4                                    # most local processes for the link test
    component_budget_s: float = 0.1                            # timing budget per (component, length)
    measure_comm: bool = True


@dataclass(frozen=True)
class Target:
    """One measurement run: a local torch device, and the cluster types it stands for."""

    device: str                                 # 'cpu' or 'cuda:0'
    types: dict[str, float] = field(default_factory=dict)   # device type -> slowdown
    tp_degrees: tuple[int, ...] = (1,)
    local_devices: int = 1                      # processes / GPUs available for the link test
    threads: int | None = None
    cpus: tuple[tuple[int, ...], ...] = ()      # emulated: the cores worker i is pinned to (launcher's rule)


def plan_targets(cluster: Cluster, models: Sequence[ModelSpec], device_type: str | None,
                 cuda_available: bool | None = None, cpus: WorkerCpus | None = None) -> list[Target]:
    """What to measure here, or an InfeasibleError saying why nothing can be. ``cpus``: an emulated
    cluster's workers' CPU share, measured under as its workers run (None: as this process runs)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    per_node: dict[str, int] = {}
    for node in cluster.nodes:
        per_node[node.device_type] = max(per_node.get(node.device_type, 0), node.count)

    def degrees(types: Sequence[str]) -> tuple[int, ...]:
        limit = min(per_node[t] for t in types)
        return tuple(t for t in range(1, limit + 1) if all(m.tp_problem(t) is None for m in models))

    if cluster.emulated:
        types = {name: (dt.emulate.slowdown if dt.emulate else 1.0) for name, dt in cluster.device_types.items()}
        n = cluster.num_devices
        share = cpus or WorkerCpus()
        return [Target("cpu", types, degrees(list(types)), local_devices=n, threads=share.threads,
                       cpus=tuple(share.cpus.get(i, ()) for i in range(n)))]
    if device_type is None:
        real = [n for n, dt in cluster.device_types.items() if not dt.emulated]
        if len(real) == 1 and cuda:
            device_type = real[0]
        else:
            raise InfeasibleError(
                f"cluster {cluster.name!r} is not CPU-emulated: say which of its device types this machine's "
                f"GPU is with --device-type ({', '.join(cluster.device_types)})"
                + ("" if cuda else "; and this machine has no CUDA GPU"))
    if device_type not in cluster.device_types:
        raise InfeasibleError(f"--device-type {device_type!r} is not a device type of cluster {cluster.name!r} "
                              f"({', '.join(cluster.device_types)})")
    if not cuda:
        raise InfeasibleError(f"cannot measure {device_type!r} here: no CUDA GPU is available (its spec profile "
                              "in profiles/ is used instead)")
    gpus = torch.cuda.device_count()
    return [Target("cuda:0", {device_type: 1.0}, degrees([device_type]), local_devices=gpus)]


def count_steps(targets: Sequence[Target], models: Sequence[ModelSpec], settings: ProfileSettings) -> int:
    steps = 0
    for t in targets:
        steps += len(models) * (len(t.tp_degrees) * (len(COMPONENTS) + 1) + 1) + 1   # + blocks; opt, GEMM
        steps += 1 if settings.measure_comm and t.local_devices >= 2 else 0
    return steps


def profile_cluster(cluster: Cluster, models: Sequence[ModelSpec], out_dir: str | Path, *,
                    device_type: str | None = None, settings: ProfileSettings = ProfileSettings(),
                    progress: Progress | None = None,
                    cpus: WorkerCpus | None = None) -> list[tuple[Path, DeviceProfile]]:
    """Measure, fit and write one ``<type>.measured.yaml`` per device type; return what was written."""
    report = progress or (lambda _what, _n: None)
    targets = plan_targets(cluster, models, device_type, cpus=cpus)
    written: list[tuple[Path, DeviceProfile]] = []
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for target in targets:
        dev = torch.device(target.device)
        # as the launcher pins device 0's worker
        with host.pinned(target.cpus[0] if target.cpus else (), target.threads):
            raw: dict[str, dict[int, dict[str, tuple[list[Sample], int]]]] = {}
            blocks: dict[str, dict[int, dict[str, list[Sample]]]] = {}
            split: dict[str, dict[int, dict[str, list[Sample]]]] = {}   # the split backward's blocks
            kw = {"micro_batch": settings.micro_batch, "device": dev, "budget_s": settings.component_budget_s}
            for model in models:
                raw[model.name], blocks[model.name], split[model.name] = {}, {}, {}
                lens = tuple(s for s in settings.seq_lens if s <= model.max_seq_len)
                for tp in target.tp_degrees:
                    raw[model.name][tp] = {}
                    for comp in COMPONENTS:
                        report(f"{target.device}: {model.name} {comp} (TP {tp})", 0)
                        raw[model.name][tp][comp] = compute.measure_component(comp, model, tp, lens, **kw)
                        report("", 1)
                    report(f"{target.device}: {model.name} stage blocks (TP {tp})", 0)
                    blocks[model.name][tp] = compute.measure_stage_blocks(model, tp, lens, **kw)
                    split[model.name][tp] = compute.measure_split_blocks(model, tp, lens, **kw)
                    report("", 1)
            report(f"{target.device}: optimizer step", 0)
            # After a backward at the longest length profiled, the length training runs at most: the
            # backward's activations leave the caches as a training step's do (on a 2 MB-L2 CPU, a 6-layer
            # stage's AdamW step took 2.01 ms after a backward of 64 tokens, 2.36 ms after one of 256).
            opt, step_over, opt_resid = compute.measure_step_epilogue(
                models, target.tp_degrees, device=dev, micro_batch=settings.micro_batch,
                seq_len=max(settings.seq_lens))
            sync_pack = compute.measure_sync_pack(models, target.tp_degrees, device=dev)
            report("", 1)
            report(f"{target.device}: GEMM rate, memory bandwidth", 0)
            thr = compute.measure_throughput(dev)
            report("", 1)
        links: dict[str, object] = {}
        if settings.measure_comm and target.local_devices >= 2:
            report(f"{target.device}: links among {min(target.local_devices, settings.comm_processes)} processes", 0)
            links = measure_links(target, models, settings)
            report("", 1)
        for type_name, slowdown in target.types.items():
            prof = _build_profile(cluster, type_name, slowdown, target, models, raw, settings, opt, opt_resid, thr,
                                  links, date, blocks=blocks, step_overhead=step_over, sync_pack=sync_pack,
                                  split=split)
            path = Path(out_dir) / f"{type_name}.measured.yaml"
            save_profile(prof, path)
            written.append((path, prof))
    return written


def _build_profile(cluster: Cluster, type_name: str, slowdown: float, target: Target, models: Sequence[ModelSpec],
                   raw: dict, settings: ProfileSettings, opt: OptimizerFit, opt_resid: float,
                   thr: dict[str, float], links: dict, date: str, *, blocks: dict, step_overhead: OptimizerFit,
                   sync_pack: OptimizerFit, split: dict | None = None) -> DeviceProfile:
    cuda = target.device.startswith("cuda")
    fitted: dict[str, MeasuredModel] = {}
    mb = settings.micro_batch

    def block_fits(by_tp: dict, stretch: float = slowdown) -> dict:
        return {t: {k: fit_component(x, 0, mb, stretch) for k, x in per.items()} for t, per in sorted(by_tp.items())}

    for model in models:
        lens = tuple(s for s in settings.seq_lens if s <= model.max_seq_len)
        mm = measured_model(model, raw[model.name], mb, lens, slowdown)
        if blocks.get(model.name):
            mm = dataclasses.replace(mm, blocks=block_fits(blocks[model.name]))
        if split and split.get(model.name):
            mm = dataclasses.replace(mm, split_blocks=block_fits(split[model.name]))
        over = links.get("tp_overhead", {}).get(model.name, {})
        if over:  # as measured, not stretched: an emulated device stretches its compute blocks only
            fits = {kind: block_fits({t: per[kind] for t, per in over.items() if per.get(kind)}, 1.0)
                    for kind in ("wall", "sp_wall")}
            mm = dataclasses.replace(mm, tp_overhead={t: b["layer"] for t, b in fits["wall"].items()},
                                     tp_blocks=fits["wall"], tp_blocks_sp=fits["sp_wall"])
        fitted[model.name] = mm
    peak = thr["tflops"] / slowdown
    # Attention efficiency: the measured s^2 coefficient against its FLOPs (4*h*s^2 per sequence).
    first = models[0]
    a = fitted[first.name].tp[1]["attention"].forward_s[0] if 1 in fitted[first.name].tp else 0.0
    att_eff = min(1.0, max(0.01, 4 * first.hidden_size / a / (peak * 1e12))) if a > 0 else 0.5
    flash = all(m.tp[t]["attention"].activation_bytes[0] == 0 for m in fitted.values() for t in m.tp)
    figures = ComputeFigures(peak_tflops=rounded(peak), matmul_efficiency=1.0, attention_efficiency=rounded(att_eff),
                             memory_bandwidth_gbs=rounded(thr["bandwidth_gbs"] / slowdown), memory_efficiency=1.0,
                             kernel_overhead_s=rounded(thr["op_s"] * slowdown), flash_attention=flash,
                             activation_bytes=2 if cuda else 4)
    p2p: LinkFit | None = links.get("p2p")  # type: ignore[assignment]
    allreduce: dict[int, LinkFit] = links.get("allreduce", {})  # type: ignore[assignment]
    n_ar = min(allreduce) if allreduce else 2
    comm = CommFigures(
        p2p_latency_s=rounded(p2p.latency_s) if p2p else (20e-6 if cuda else 1e-3),
        allreduce_latency_s=rounded(allreduce[n_ar].latency_s / (2 * (n_ar - 1))) if allreduce else (15e-6 if cuda
                                                                                                else 1e-3),
        bandwidth_efficiency=0.75, p2p=p2p, allreduce=allreduce, allgather=links.get("allgather", {}))
    framework, framework_note = _framework_gib(links, cuda, target.device)
    memory = MemoryFigures(framework_overhead_gib=rounded(framework),
                           cast_bytes=2.0 if cuda else 0.0)   # the profiles' compute: bf16 autocast on CUDA only
    optimizer = OptimizerFit(*(rounded(x * slowdown) for x in (opt.seconds_per_param, opt.fixed_s,
                                                               opt.seconds_per_tensor)))
    what = torch.cuda.get_device_name(torch.device(target.device)) if cuda else (platform.processor() or "cpu")
    note = (f"measured on {what} ({target.threads or torch.get_num_threads()} threads); optimizer fit residual "
            f"{opt_resid:.3f}")
    note += f"; framework memory {framework_note}"
    if slowdown != 1.0:
        note += f"; emulated device: compute x{slowdown:g}, links as measured"
    dt = cluster.device_types[type_name]
    return DeviceProfile(
        version=PROFILE_VERSION, device_type=type_name, provenance="measured", memory_gib=dt.memory_gib,
        compute=figures, comm=comm, memory=memory, optimizer=optimizer,
        source=Source(note=note, host=socket.gethostname(), torch_version=str(torch.__version__), date=date,
                      derived_from=f"{target.device} ({what})" if slowdown != 1.0 else None, slowdown=slowdown),
        models=fitted, step_overhead=step_overhead, sync_pack=sync_pack)


# -- links -----------------------------------------------------------------------------------------


def measure_links(target: Target, models: Sequence[ModelSpec], settings: ProfileSettings,
                  timeout_s: float = 120.0) -> dict:
    """Spawn local processes (one per GPU on CUDA): measure p2p and all-reduce, and what the runtime's
    TP layer adds per TP degree; return the fits and the samples."""
    cuda = target.device.startswith("cuda")
    world = min(target.local_devices, settings.comm_processes)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hspmd-profile-") as tmp:
        init = f"file://{Path(tmp) / 'store'}"
        jobs = [(m, t) for m in models for t in target.tp_degrees if 2 <= t <= world]
        procs = [ctx.Process(target=_link_worker, args=(r, world, init, cuda, settings, jobs, queue, timeout_s,
                                                        target.threads or 1, target.cpus[r] if target.cpus else ()),
                                 daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            result = queue.get(timeout=timeout_s)
        except Exception:
            result = {"error": f"link measurement timed out after {timeout_s:g} s"}
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if "error" in result:
        raise HspmdError(f"link measurement failed: {result['error']}")
    return result


def _link_worker(rank: int, world: int, init: str, cuda: bool, settings: ProfileSettings,
                 jobs: Sequence[tuple[ModelSpec, int]], queue, timeout_s: float, threads: int = 1,
                 cpus: tuple[int, ...] = ()) -> None:
    try:
        host.pin_process(cpus)
        torch.set_num_threads(threads)
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
        out = p2p_and_allreduce(rank, world, settings.comm_sizes, device=dev)
        tp_groups = {t: dist.new_group(list(range(t))) for t in sorted({t for _, t in jobs})}
        overhead: dict[str, dict[int, list]] = {}
        for model, t in jobs:
            if rank < t:
                lens = [s for s in settings.seq_lens if s <= model.max_seq_len]
                samples = compute.measure_tp_overhead(model, t, tp_groups[t], lens, device=dev,
                                                      micro_batch=settings.micro_batch,
                                                      **({} if settings.component_budget_s > 0 else
                                                         {"micro_batches": 2, "rounds": 1}))
                if samples is not None:
                    overhead.setdefault(model.name, {})[t] = samples
            dist.barrier()
        if rank == 0:
            out.update(tp_overhead=overhead, rss_gib=_rss_gib() if not cuda else 0.0,
                       cuda_framework_gib=compute.cuda_framework_gib(dev) if cuda else 0.0)
            queue.put(out)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which raises it as one line
        if rank == 0:
            queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _framework_gib(links: dict, cuda: bool, device: str) -> tuple[float, str]:
    """The memory a device loses to the framework, measured, and how it was measured."""
    if not cuda:
        if links.get("rss_gib"):
            return links["rss_gib"], "the resident memory of a gloo link worker"
        return 0.3, "0.3 GiB assumed (no link workers ran: --no-comm)"
    if links.get("cuda_framework_gib"):
        return links["cuda_framework_gib"], ("GPU memory outside torch's allocator in a link worker with its NCCL "
                                             "communicators (CUDA context, cuBLAS, NCCL buffers)")
    return compute.cuda_framework_gib(torch.device(device)), ("GPU memory outside torch's allocator in this "
                                                              "process (CUDA context, cuBLAS); NCCL communicators "
                                                              "not included (no link workers: --no-comm or one GPU)")


def _rss_gib() -> float:
    """This process's resident memory (a bare torch + gloo worker): the framework overhead."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return 0.0
