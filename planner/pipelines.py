"""Chaining TP groups into pipelines.

A *block* is a set of group kinds shared out over ``P`` pipelines as evenly as possible: pipeline i gets
``floor`` or ``ceil`` of ``g_k / P`` groups of each kind k (the extras of successive kinds are dealt out
round-robin from where the previous kind stopped, so no pipeline collects all of them). A block of one
kind gives pure pipelines (HSPMD's H800 and H20 pipelines); a block of several kinds gives mixed
pipelines (H2's chip-A stages followed by chip-B stages). Most pipelines of a big block are identical:
``template`` (the kinds in stage order) is what their costs depend on.

Stage order (H2): devices with more memory first, because under 1F1B stage k of S keeps ``S-k``
micro-batches of activations; ``order="speed"`` (fastest first) is tried as the alternative.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from planner.tp_groups import GroupKind, TPGroup

Template = tuple[GroupKind, ...]
ORDERS = ("memory", "speed")


@dataclass(frozen=True)
class PipelineLayout:
    """One pipeline: its TP groups in stage order."""

    groups: tuple[TPGroup, ...]

    @property
    def template(self) -> Template:
        return tuple(g.kind for g in self.groups)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for g in self.groups for d in g.devices)


def share_out(counts: Mapping[GroupKind, int], pipelines: int) -> list[dict[GroupKind, int]] | None:
    """How many groups of each kind each pipeline gets; None if some pipeline would get none."""
    if pipelines < 1:
        return None
    out: list[dict[GroupKind, int]] = [{} for _ in range(pipelines)]
    offset = 0
    for kind in sorted(counts):
        q, r = divmod(counts[kind], pipelines)
        for i in range(pipelines):
            extra = 1 if (i - offset) % pipelines < r else 0
            if q + extra:
                out[i][kind] = q + extra
        offset = (offset + r) % pipelines
    if any(not p for p in out):
        return None
    return out


def kind_order(kinds: Sequence[GroupKind], memory_gib: Callable[[GroupKind], float],
               layer_s: Callable[[GroupKind], float], order: str) -> list[GroupKind]:
    """Stage order of the kinds in a pipeline: ``memory`` (most memory per device first, then fastest)
    or ``speed`` (fastest first)."""
    if order == "memory":
        return sorted(kinds, key=lambda k: (-memory_gib(k), layer_s(k), k))
    if order == "speed":
        return sorted(kinds, key=lambda k: (layer_s(k), -memory_gib(k), k))
    raise ValueError(f"unknown stage order {order!r}")


def build_pipelines(groups: Mapping[GroupKind, Sequence[TPGroup]], pipelines: int,
                    ranked: Sequence[GroupKind]) -> list[PipelineLayout] | None:
    """Deal the groups out to ``pipelines`` pipelines; each pipeline's stages follow ``ranked``.

    Groups of a kind are taken in device order, so a pipeline's consecutive stages of one kind tend to
    share a node (cheap boundary transfers).
    """
    counts = {k: len(v) for k, v in groups.items() if v}
    shares = share_out(counts, pipelines)
    if shares is None:
        return None
    cursor = dict.fromkeys(counts, 0)
    out = []
    for share in shares:
        chain: list[TPGroup] = []
        for kind in ranked:
            n = share.get(kind, 0)
            chain.extend(groups[kind][cursor[kind]:cursor[kind] + n])
            cursor[kind] = cursor.get(kind, 0) + n
        out.append(PipelineLayout(tuple(chain)))
    return out
