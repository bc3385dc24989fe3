"""Which GPU a worker runs on, and the check every worker makes before it builds anything.

A device of the cluster file is (node, index on its node, type). A worker runs device d on
``cuda:<d's index on its node>``: the index counts the GPUs the process can see (an existing
``CUDA_VISIBLE_DEVICES`` is kept, so an allocation's GPUs are indices 0..n-1) in PCI bus order, which
the workers pin (``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA's default order puts the fastest GPU first, which on
a node of mixed GPUs is not the order ``nvidia-smi`` and the cluster file use).

Before it allocates anything, each worker checks that it runs on the device's node (the machine's name
in the cluster file: ``--node NAME``, else its host name), that the GPU index exists, and that the GPU is
of the device's type: its name must name the type and its memory match the type's ``memory_gib``. A
type's name names a GPU when every part of it (split at spaces, dashes and underscores) is a part of the
GPU's name without the vendor prefix: ``H100`` and ``H100-80GB-HBM3`` name "NVIDIA H100 80GB HBM3",
``A100-80GB`` names "NVIDIA A100-SXM4-80GB", ``H20`` does not name "NVIDIA H200". A type whose name is
not a GPU's (``fast``, ``gpu-a``) lists the names torch reports in its ``gpu_names``.

GPUs are read through a ``GpuProbe``: ``CudaGpus`` asks torch; tests hand the launchers a
``FixedGpus`` that describes a machine.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Protocol

from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.cluster import Cluster, DeviceType

GIB = 1024**3
# A GPU's reported memory is below its nominal size (an 80 GB H100 reports 79.2 GiB, ECC and the driver's
# reservation taken off); a different model of the same name differs by far more (40 vs 80 GB, 94 vs 80).
MEMORY_TOLERANCE = 0.08
VENDOR_PREFIXES = ("NVIDIA", "TESLA")


@dataclass(frozen=True)
class GpuInfo:
    name: str
    memory_bytes: int
    native_bf16: bool = True  # compute capability 8.0 or later (V100 and T4 only emulate bf16, slowly)


class GpuProbe(Protocol):
    def host(self) -> str: ...

    def count(self) -> int: ...

    def info(self, index: int) -> GpuInfo: ...


@dataclass(frozen=True)
class CudaGpus:
    """This machine's GPUs as torch sees them (CUDA is initialised only by ``info``)."""

    def host(self) -> str:
        return socket.gethostname()

    def count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def info(self, index: int) -> GpuInfo:
        import torch

        props = torch.cuda.get_device_properties(index)
        return GpuInfo(props.name, int(props.total_memory), native_bf16=props.major >= 8)


@dataclass(frozen=True)
class FixedGpus:
    """A described machine (tests): its host name and its visible GPUs in order."""

    host_name: str
    gpus: tuple[GpuInfo, ...]

    def host(self) -> str:
        return self.host_name

    def count(self) -> int:
        return len(self.gpus)

    def info(self, index: int) -> GpuInfo:
        return self.gpus[index]


def pin_gpu_order() -> None:
    """Number GPUs in PCI bus order in this process and the ones it starts (before CUDA initialises)."""
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


def _parts(name: str) -> list[str]:
    return [p for p in re.split(r"[\s_\-]+", name.upper()) if p]


def names_gpu(type_name: str, dtype: DeviceType, gpu_name: str) -> bool:
    """Whether ``gpu_name`` (as torch reports it) is a GPU of the type ``type_name`` (the module docstring)."""
    if dtype.gpu_names:
        return gpu_name.strip().upper() in {n.strip().upper() for n in dtype.gpu_names}
    found = [p for p in _parts(gpu_name) if p not in VENDOR_PREFIXES]
    return all(p in found for p in _parts(type_name))


def this_node(cluster: Cluster, declared: str | None, host: str) -> str | None:
    """This machine's node in the cluster file: the declared name, else the host name (or its first label);
    None when neither names a node."""
    nodes = {n.name for n in cluster.nodes}
    if declared is not None:
        return declared if declared in nodes else None
    for name in (host, host.split(".")[0]):
        if name in nodes:
            return name
    return None


def placement_problem(cluster: Cluster, device: int, rank: int, node: str | None, host: str,
                      gpu_index: int, probe: GpuProbe, bf16: bool = False) -> str | None:
    """Why device ``device`` (rank ``rank``) cannot run on this machine's GPU ``gpu_index``, in one line;
    None when it can. ``node``: the machine's declared node name (None: its host name ``host``); ``bf16``:
    the run computes in bf16 (which a GPU before compute capability 8.0 only emulates)."""
    d = cluster.device(device)
    dtype = cluster.device_types[d.type]
    where = f"rank {rank} (device {device})"
    want = f"{d.type} ({dtype.memory_gib:g} GiB) as GPU {d.local_index} of node {d.node!r}"
    mine = this_node(cluster, node, host)
    if mine != d.node:
        found = f"node {node!r}" if node is not None else f"host {host!r}"
        return (f"{where}: expected {want}, found {found} (give this machine's node name in the cluster file "
                "with --node NAME)")
    have = probe.count()
    if gpu_index >= have:
        return f"{where}: expected {want}, found {have} visible GPU(s) on node {d.node!r}"
    gpu = probe.info(gpu_index)
    found = f"{gpu.name!r} with {gpu.memory_bytes / GIB:.1f} GiB as GPU {gpu_index}"
    if not names_gpu(d.type, dtype, gpu.name):
        return (f"{where}: expected {want}, found {found} (a type whose name is not the GPU's lists it in "
                f"device_types.{d.type}.gpu_names)")
    if abs(gpu.memory_bytes / GIB - dtype.memory_gib) > MEMORY_TOLERANCE * dtype.memory_gib:
        return f"{where}: expected {want}, found {found} (memory_gib differs by more than {MEMORY_TOLERANCE:.0%})"
    if bf16 and not gpu.native_bf16:
        return (f"{where}: {gpu.name!r} has no native bf16 (compute capability below 8.0), which the run's "
                "precision computes in: run with --precision fp32")
    return None


def check_placement(cluster: Cluster, device: int, rank: int, node: str | None, gpu_index: int,
                    probe: GpuProbe, bf16: bool = False) -> None:
    """Raise (one line, exit 2) unless device ``device`` may run on this machine's GPU ``gpu_index``."""
    problem = placement_problem(cluster, device, rank, node, probe.host(), gpu_index, probe, bf16)
    if problem is not None:
        raise HspmdError(problem)


def torchrun_device(cluster: Cluster, devices: tuple[int, ...] | list[int], node: str, local_rank: int,
                    local_world_size: int) -> int:
    """The device torchrun's worker ``local_rank`` of node ``node`` runs: the node's devices of the run in id
    order, one per local rank (so a node may run any number of them, and idle GPUs stay idle)."""
    mine = sorted(d for d in devices if cluster.device(d).node == node)
    if local_world_size != len(mine):
        raise HspmdError(f"node {node!r}: torchrun started {local_world_size} process(es) here, but the plan runs "
                         f"{len(mine)} device(s) on it ({', '.join(map(str, mine)) or 'none'}): start it with "
                         f"--nproc-per-node {len(mine)}")
    return mine[local_rank]


def torchrun_commands(cluster: Cluster, devices: tuple[int, ...] | list[int], plan: str, endpoint: str,
                      run_id: str = "hspmd") -> list[tuple[str, str]]:
    """(node, command) for every node that runs some of ``devices``, in the order of their first device: the
    torchrun line to start there. Each node starts one process per device of the run on it (nodes may differ),
    and names itself (``--node``) so that its processes take the node's devices and GPUs from the cluster
    file; torchrun's c10d rendezvous at ``endpoint`` (HOST:PORT) forms the world."""
    per_node: dict[str, int] = {}
    for d in sorted(set(devices)):
        node = cluster.device(d).node
        per_node[node] = per_node.get(node, 0) + 1
    return [(node, f"torchrun --nnodes {len(per_node)} --nproc-per-node {n} --rdzv-backend c10d "
                   f"--rdzv-endpoint {endpoint} --rdzv-id {run_id} -m hetu_cli train --plan {plan} --node {node}")
            for node, n in per_node.items()]
