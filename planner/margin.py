"""Memory headroom: the share of each device's memory a plan leaves free (``--memory-margin``).

The cost model counts weights, gradients, optimizer states, activations and a fixed framework overhead; a
real GPU also loses memory to the caching allocator's fragmentation, communication buffers and kernels'
workspaces, which vary by library version and are not modelled. A plan packed to 99.8% of a device is then
likely to run out of memory, so the planner keeps a margin: every stage must fit the device's capacity less
the margin. The margin is a fraction of each device's memory (``0.1``) or GiB per device (``4GiB``).

How it is applied: the planner plans on the cluster with each device type's ``memory_gib`` reduced by the
margin (``MemoryMargin.apply``), so the search, the baselines and the simulator's check all see the same
smaller capacity; the report then shows each stage's peak against the real capacity and the margin.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.cost import GIB, CostModel, zero_copies
from runtime.torchfree.errors import InfeasibleError, Problem, SpecError
from runtime.torchfree.profiling.profile import DeviceProfile
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Plan, Strategy

# Default: 5% of each device's memory. Enough for the allocator's typical fragmentation on top of the modelled
# framework overhead (docs/planning.md, "Memory headroom"); --memory-margin 0 packs to the modelled capacity.
DEFAULT_FRACTION = 0.05

_GIB = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*gib\s*$", re.IGNORECASE)
_FRACTION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*$")


@dataclass(frozen=True)
class MemoryMargin:
    """Memory kept free on every device: ``fraction`` of its capacity, or ``gib`` GiB (one of the two)."""

    fraction: float = 0.0
    gib: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0.0 <= self.fraction < 1.0):
            raise ValueError(f"fraction must be in [0, 1), got {self.fraction}")
        if not (math.isfinite(self.gib) and self.gib >= 0.0):
            raise ValueError(f"gib must be a non-negative number, got {self.gib}")
        if self.fraction and self.gib:
            raise ValueError("a margin is a fraction or GiB per device, not both")

    def reserved_gib(self, capacity_gib: float) -> float:
        """GiB kept free on a device of ``capacity_gib``."""
        return capacity_gib * self.fraction + self.gib

    def usable_gib(self, capacity_gib: float) -> float:
        return capacity_gib - self.reserved_gib(capacity_gib)

    @property
    def text(self) -> str:
        return f"{self.gib:g} GiB per device" if self.gib else f"{self.fraction:.0%} of each device"

    def to_json(self) -> dict[str, float]:
        return {"fraction": self.fraction, "gib": self.gib}

    def apply(self, cluster: Cluster, option: str = "--memory-margin") -> Cluster:
        """``cluster`` with each device type's ``memory_gib`` reduced to what the margin leaves usable; a margin
        that leaves a type nothing is a user error naming it."""
        if not (self.fraction or self.gib):
            return cluster
        types = {}
        problems = []
        for name, dt in cluster.device_types.items():
            usable = self.usable_gib(dt.memory_gib)
            if usable <= 0:
                problems.append(Problem(option, "", f"{self.text} leaves nothing of {name}'s {dt.memory_gib:g} GiB"))
                continue
            types[name] = dataclasses.replace(dt, memory_gib=usable)
        if problems:
            raise SpecError(problems)
        return dataclasses.replace(cluster, device_types=types)


DEFAULT_MEMORY_MARGIN = MemoryMargin(fraction=DEFAULT_FRACTION)


def parse_margin(text: str) -> MemoryMargin:
    """``0.1`` (a fraction of each device's memory, below 1) or ``4GiB`` (GiB per device); ValueError with
    the reason otherwise."""
    m = _GIB.match(text)
    if m is not None:
        return MemoryMargin(gib=float(m.group(1)))
    m = _FRACTION.match(text)
    if m is None:
        raise ValueError(f"expected a fraction such as 0.1 or GiB per device such as 4GiB, got {text!r}")
    value = float(m.group(1))
    if value >= 1.0:
        raise ValueError(f"a fraction must be below 1 (GiB per device are written 4GiB), got {text!r}")
    return MemoryMargin(fraction=value)


def headroom_rows(strategy: Strategy, peak_bytes: Mapping[int, float], cluster: Cluster,
                  margin: MemoryMargin) -> list[dict[str, Any]]:
    """Per stage of ``strategy`` (``peak_bytes``: each device's modelled peak): its peak against the device's
    real capacity in ``cluster`` and against what the margin leaves usable."""
    rows = []
    for pi, pipe in enumerate(strategy.pipelines):
        for si, st in enumerate(pipe.stages):
            d = max(st.devices, key=lambda x: peak_bytes[x])
            used = peak_bytes[d] / GIB
            cap = cluster.type_of(d).memory_gib
            usable = margin.usable_gib(cap)
            rows.append({"pipeline": pi, "stage": si, "devices": list(st.devices),
                         "device_type": cluster.device(d).type, "peak_gib": round(used, 3),
                         "capacity_gib": cap, "margin_gib": round(cap - usable, 3),
                         "headroom_gib": round(cap - used, 3), "headroom_frac": round((cap - used) / cap, 4),
                         "within_margin": used <= usable + 1e-9})
    return rows


def plan_headroom(plan: Plan, model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile],
                  margin: MemoryMargin) -> list[dict[str, Any]]:
    """``headroom_rows`` of a plan's first strategy, its peaks by the cost model (``hspmd replan``'s new plan)."""
    t = plan.training
    strategy = plan.strategies[0]
    est = CostModel.for_plan(plan, model, cluster, profiles).estimate(strategy, t.global_batch, t.schedule,
                                                                       zero_copies(t))
    return headroom_rows(strategy, {d: m.total for d, m in est.memory.items()}, cluster, margin)


def margin_said(err: InfeasibleError, margin: MemoryMargin) -> InfeasibleError:
    """``err`` (which quotes the capacities the planner saw) saying that they are the devices' memory less the
    margin, so that a figure below a datasheet's does not puzzle."""
    if not (margin.fraction or margin.gib):
        return err
    return InfeasibleError(f"{err} (memory figures less the margin of {margin.text}: --memory-margin 0 plans on "
                           "the whole memory)")
