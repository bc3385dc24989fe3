"""Tensor-parallel groups: same device type, same node, a power-of-two size that shards the model.

A device type gets one TP degree per plan; the devices of a node that do not fill a last group of that
degree form smaller power-of-two groups (``remainder=True``) or stay idle. Groups are listed in device
order, so consecutive groups of a kind sit on the same node where they can.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec


@dataclass(frozen=True, order=True)
class GroupKind:
    """What a stage's cost depends on: the device type and the TP degree."""

    device_type: str
    tp: int

    def __str__(self) -> str:
        return f"{self.device_type}/tp{self.tp}"


@dataclass(frozen=True)
class TPGroup:
    kind: GroupKind
    node: str
    devices: tuple[int, ...]


def available(cluster: Cluster, devices: Iterable[int] | None = None) -> dict[tuple[str, str], list[int]]:
    """Usable device ids per (node, device type), in cluster order."""
    allowed = None if devices is None else set(devices)
    out: dict[tuple[str, str], list[int]] = {}
    for d in cluster.devices:
        if allowed is None or d.id in allowed:
            out.setdefault((d.node, d.type), []).append(d.id)
    return out


def tp_degrees(model: ModelSpec, limit: int) -> list[int]:
    """Powers of two up to ``limit`` that divide heads, kv heads and the MLP width."""
    return [t for t in model.valid_tp_degrees(max(1, limit)) if t & (t - 1) == 0]  # t >= 1


def tp_choices(cluster: Cluster, model: ModelSpec, devices: Iterable[int] | None = None) -> dict[str, list[int]]:
    """Per device type present: the TP degrees it can form on at least one of its nodes."""
    per_type: dict[str, int] = {}
    for (_, dtype), ids in available(cluster, devices).items():
        per_type[dtype] = max(per_type.get(dtype, 0), len(ids))
    return {t: tp_degrees(model, n) for t, n in sorted(per_type.items())}


def form_groups(cluster: Cluster, model: ModelSpec, tp_by_type: Mapping[str, int],
                devices: Iterable[int] | None = None, remainder: bool = True) -> list[TPGroup]:
    """TP groups of the listed types (types not in ``tp_by_type`` are left out).

    Each node's devices of a type are cut into groups of that type's degree, in device order; what is
    left (fewer than the degree) becomes the largest valid power-of-two groups when ``remainder``.
    """
    out: list[TPGroup] = []
    for (node, dtype), ids in available(cluster, devices).items():
        t = tp_by_type.get(dtype)
        if t is None:
            continue
        smaller = sorted((s for s in tp_degrees(model, t) if s < t), reverse=True) if remainder else []
        i = 0
        for s in [t, *smaller]:
            while len(ids) - i >= s:
                out.append(TPGroup(GroupKind(dtype, s), node, tuple(ids[i:i + s])))
                i += s
    return out


def groups_by_kind(groups: Sequence[TPGroup]) -> dict[GroupKind, list[TPGroup]]:
    out: dict[GroupKind, list[TPGroup]] = {}
    for g in groups:
        out.setdefault(g.kind, []).append(g)
    return dict(sorted(out.items()))
