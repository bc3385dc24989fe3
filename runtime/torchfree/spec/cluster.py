"""Cluster spec: nodes, device types and the links between devices.

Device ids are global and dense: node entries are enumerated in file order, each contributing
``count`` consecutive ids. A physical node with several device kinds is listed once per kind
under the same name (the CPU emulation cluster does this).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from runtime.torchfree.errors import Checker, FieldErrors
from runtime.torchfree.spec.schema import text_problem

MAX_DEVICES = 65_536  # a bound on what a (hostile) file makes every verb enumerate
MAX_SLOWDOWN = 1000.0  # beyond this the planner's ILP coefficients span too many orders of magnitude
MAX_SEQ_SCALE = 4096  # target tokens per real one: a 1M-token target on a 256-token model


@dataclass(frozen=True)
class EmulationTarget:
    """The device an emulated type stands for in sleep mode: a device profile (a file name in the shipped
    ``profiles/`` without ``.yaml``, or a path) running the layer shapes of a model (a catalog name in
    ``configs/models``, or a path). Names, resolved and checked when the cluster file is loaded
    (``runtime.torchfree.spec.catalog.load_cluster``), so a typo is one line naming the cluster file."""

    profile: str
    model: str

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(bool(self.profile), "profile", "must name a device profile (e.g. H20) or a profile file")
            c.check(bool(self.model), "model", "must name a model (e.g. llama-32b) or a model file")


@dataclass(frozen=True)
class Emulation:
    """CPU emulation of a device type, in one of two modes.

    * Stretch mode (``slowdown``): each compute block is followed by a sleep of ``slowdown - 1`` times its
      measured compute time. The device's speed is the host CPU's, so emulated devices sharing cores
      contend for them and the planner must model the host.
    * Sleep mode (``target`` + ``time_scale``): each forward / backward block runs the real (tiny) model,
      then sleeps until it has lasted its target: what ``target.profile`` prices the same block of
      ``target.model``'s layer shapes at (``runtime.torchfree.profiling.profile.block_seconds``), times
      ``time_scale`` wall seconds per target second. Targets are chosen far above the real compute, so
      the devices mostly sleep, barely load the host's cores, and a step's time is set by the plan, the
      schedule and the communication. A block whose real compute exceeds its target is not hidden: the
      overrun is traced and reported per step (``emulation_overrun_s``).

      ``seq_scale``: each real token stands for that many tokens of the target, so a tiny model's short
      sequences are priced as the target's long ones (attention's s^2 included): the paper-scale lengths
      at a CPU's. ``memory: target``: the plan's memory is checked as the target's (its model's shapes at
      the scaled lengths, its profile's bytes per parameter, against this type's ``memory_gib``, which
      should then be the target's), so the memory limits of long sequences bind as on the target; nothing
      is allocated for it (the real model's memory is tiny). ``memory: real`` (default): the real model's.
    """

    slowdown: float = 1.0
    target: EmulationTarget | None = None
    # Wall seconds one target second lasts: scales the target's (GPU-sized, sub-millisecond) block
    # prices up to where they dwarf the tiny model's real CPU compute.
    time_scale: float | None = None
    seq_scale: int = 1
    memory: str = "real"   # real | target

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.slowdown >= 1.0, "slowdown", f"must be at least 1.0, got {self.slowdown}")
            c.check(self.slowdown <= MAX_SLOWDOWN, "slowdown",
                    f"must be at most {MAX_SLOWDOWN:g}, got {self.slowdown:g}")
            if self.target is not None:
                c.check(self.slowdown == 1.0, "slowdown",
                        "give either 'slowdown' (stretch mode) or 'target' (sleep mode), not both")
                c.check(self.time_scale is not None, "time_scale",
                        "sleep mode needs 'time_scale' (wall seconds per target second, e.g. 20)")
            else:
                c.check(self.time_scale is None, "time_scale", "only meaningful with 'target' (sleep mode)")
                c.check(self.seq_scale == 1, "seq_scale", "only meaningful with 'target' (sleep mode)")
                c.check(self.memory == "real", "memory", "only meaningful with 'target' (sleep mode)")
            # Bounded like slowdown: seq_scale 2**50 priced a step at 5.5e26 s, time_scale 1e29 slept a block for ever.
            c.check(isinstance(self.seq_scale, int) and not isinstance(self.seq_scale, bool) and
                    1 <= self.seq_scale <= MAX_SEQ_SCALE, "seq_scale", "must be a whole number of target tokens per "
                    f"real token in [1, {MAX_SEQ_SCALE}], got {self.seq_scale!r}")
            c.check(self.memory in ("real", "target"), "memory", f"must be 'real' or 'target', got {self.memory!r}")
            if self.time_scale is not None:
                c.check(0 < self.time_scale <= MAX_SLOWDOWN, "time_scale", "must be a positive number of wall "
                        f"seconds per target second, at most {MAX_SLOWDOWN:g}, got {self.time_scale}")

    @property
    def sleeps(self) -> bool:
        """Sleep mode: compute blocks last their target's time; the host's cores are not contended."""
        return self.target is not None


@dataclass(frozen=True)
class DeviceType:
    """Datasheet figures of one accelerator kind (bandwidths in GB/s = 1e9 bytes/s)."""

    memory_gib: float
    peak_bf16_tflops: float
    hbm_bandwidth_gbs: float
    intra_node_bandwidth_gbs: float
    emulate: Emulation | None = None
    # The names torch reports for GPUs of this type, where the type's name does not name them
    # (runtime/launch/placement.py: "H100" needs none for "NVIDIA H100 80GB HBM3").
    gpu_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        with Checker() as c:
            for name in ("memory_gib", "peak_bf16_tflops", "hbm_bandwidth_gbs", "intra_node_bandwidth_gbs"):
                c.check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")

    @property
    def emulated(self) -> bool:
        """True for device types that run as CPU processes (the emulated test/demo clusters)."""
        return self.emulate is not None

    @property
    def sleep_emulated(self) -> bool:
        """A CPU-emulated type in sleep mode (its blocks last their target's time, see ``Emulation``)."""
        return self.emulate is not None and self.emulate.sleeps


@dataclass(frozen=True)
class Node:
    name: str
    device_type: str
    count: int

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(bool(self.name), "name", "must not be empty")
            c.check(self.count >= 1, "count", f"must be at least 1, got {self.count}")


def type_name_problem(name: str) -> str | None:
    """What is wrong with a device type name, or None. A type names files (``profiles/<type>.yaml`` is looked
    up, ``hspmd profile`` writes ``<type>.measured.yaml`` into --out, ``profile import`` ``<type>.imported.yaml``):
    an empty name crashed every verb that prices (a traceback), and one with a path separator would write
    outside the profile directory."""
    if not name.strip():
        return "a device type name must not be empty"
    if name in (".", "..") or any(ch in "/\\" for ch in name):
        return f"device type name {name!r} is not a file name (no path separators)"
    return text_problem(name)  # from a file the reader said it first; --type NAME on the command line comes here


@dataclass(frozen=True)
class BandwidthOverride:
    """Measured or known bandwidth between two devices, or between every device of two nodes."""

    bandwidth_gbs: float
    devices: tuple[int, int] | None = None
    nodes: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.bandwidth_gbs > 0, "bandwidth_gbs", f"must be positive, got {self.bandwidth_gbs}")
            c.check((self.devices is None) != (self.nodes is None), "",
                    "give exactly one of 'devices' or 'nodes'")


@dataclass(frozen=True)
class Device:
    """One device of a cluster, with where it lives."""

    id: int
    type: str
    node: str
    local_index: int


@dataclass(frozen=True)
class Cluster:
    name: str
    device_types: Mapping[str, DeviceType]
    nodes: tuple[Node, ...]
    inter_node_bandwidth_gbs: float
    bandwidth_overrides: tuple[BandwidthOverride, ...] = ()
    description: str | None = None
    # NICs per node; ``inter_node_bandwidth_gbs`` is one NIC's. A node's devices use them in turn (device i
    # of a node: NIC i mod nics_per_node, as a rail-optimised node wires one NIC per GPU), and cross-node
    # transfers through one NIC share it (planner/costmodel/network.py).
    nics_per_node: int = 1

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(bool(self.name), "name", "must not be empty")
            c.check(self.nics_per_node >= 1, "nics_per_node", f"must be at least 1, got {self.nics_per_node}")
            c.check(len(self.device_types) > 0, "device_types", "must define at least one device type")
            for type_name in self.device_types:
                bad = type_name_problem(type_name)
                if bad is not None:
                    c.add(f"device_types.{type_name}" if type_name.strip() else "device_types", bad)
            c.check(len(self.nodes) > 0, "nodes", "must list at least one node")
            c.check(self.inter_node_bandwidth_gbs > 0, "inter_node_bandwidth_gbs", "must be positive")
            seen_pair: set[tuple[str, str]] = set()
            for i, node in enumerate(self.nodes):
                if node.device_type not in self.device_types:
                    c.add(f"nodes[{i}].device_type",
                          f"unknown device type {node.device_type!r} (defined: {', '.join(self.device_types)})")
                if (node.name, node.device_type) in seen_pair:
                    c.add(f"nodes[{i}]", f"node {node.name!r} lists device type {node.device_type!r} twice")
                seen_pair.add((node.name, node.device_type))
            n = sum(node.count for node in self.nodes)
            c.check(n <= MAX_DEVICES, "nodes", f"{n:,} devices in all: hspmd plans for at most {MAX_DEVICES:,}")
            names = {node.name for node in self.nodes}
            for i, o in enumerate(self.bandwidth_overrides):
                if o.devices is not None:
                    for j, d in enumerate(o.devices):
                        c.check(0 <= d < n, f"bandwidth_overrides[{i}].devices[{j}]",
                                f"unknown device id {d} (cluster has devices 0-{n - 1})")
                    c.check(o.devices[0] != o.devices[1], f"bandwidth_overrides[{i}].devices",
                            f"names device {o.devices[0]} twice: a link joins two devices")
                if o.nodes is not None:
                    for j, name in enumerate(o.nodes):
                        c.check(name in names, f"bandwidth_overrides[{i}].nodes[{j}]", f"unknown node {name!r}")

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        out: list[Device] = []
        per_node: dict[str, int] = {}
        for node in self.nodes:
            for _ in range(node.count):
                idx = per_node.get(node.name, 0)
                per_node[node.name] = idx + 1
                out.append(Device(len(out), node.device_type, node.name, idx))
        return tuple(out)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def nic_of(self, device_id: int) -> tuple[str, int]:
        """(node, NIC index) of the NIC a device's cross-node traffic leaves by."""
        d = self.devices[device_id]
        return (d.node, d.local_index % self.nics_per_node)

    def device(self, device_id: int) -> Device:
        if not 0 <= device_id < self.num_devices:
            raise FieldErrors([("", f"unknown device id {device_id} (cluster {self.name!r} has devices "
                                    f"0-{self.num_devices - 1})")])
        return self.devices[device_id]

    def type_of(self, device_id: int) -> DeviceType:
        return self.device_types[self.device(device_id).type]

    def devices_of_type(self, type_name: str) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices if d.type == type_name)

    def bandwidth_gbs(self, a: int, b: int) -> float:
        """Point-to-point bandwidth between two devices (GB/s); overrides win, last one first."""
        da, db = self.device(a), self.device(b)
        for o in reversed(self.bandwidth_overrides):
            if o.devices is not None and {a, b} == set(o.devices):
                return o.bandwidth_gbs
            if o.nodes is not None and {da.node, db.node} == set(o.nodes) and (
                    da.node != db.node or o.nodes[0] == o.nodes[1]):
                return o.bandwidth_gbs
        if a == b:
            return self.device_types[da.type].hbm_bandwidth_gbs
        if da.node == db.node:
            return min(self.device_types[da.type].intra_node_bandwidth_gbs,
                       self.device_types[db.type].intra_node_bandwidth_gbs)
        return self.inter_node_bandwidth_gbs

    @property
    def emulated(self) -> bool:
        """True when every device type is CPU-emulated (the cluster runs on this machine)."""
        return all(t.emulated for t in self.device_types.values())

    def total_peak_tflops(self) -> float:
        return sum(self.type_of(d.id).peak_bf16_tflops for d in self.devices)
