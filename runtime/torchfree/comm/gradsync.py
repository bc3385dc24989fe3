"""The layout of the fused, bucketed SplitAllReduce of many gradients: which device groups all-reduce
which slices, in which order, cut into which buckets. Pure (no torch): the engine runs exactly these
buckets (runtime/engine/data_parallel.py), ZeRO-1 all-gathers through them (runtime/torchfree/engine/zero.py)
and the planner's cost model prices them, so all three see one layout.

Each gradient is annotated like its parameter but with HDim -2 (the pipelines holding a layer each
computed a summand) and possibly partial inside a subgroup. Its reduce phase (resolve.plan_reduce)
cuts it into slices held by fixed device groups; here the slices of *all* gradients that share a
device group are packed into flat buffers (at most ``BUCKET_BYTES`` each), one all-reduce per buffer,
issued in one global order. A device contributes a slice only as the first replica of its summand in
its subgroup, so a norm weight duplicated in a TP-2 group (devices 0 and 1 hold g_A) and held by a
TP-1 pipeline (device 2 holds g_B) becomes g_A + g_B everywhere, not 2 g_A + g_B: the norm's group is
all three devices, next to the two groups (0, 2) and (1, 2) of the sharded weights' halves.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

from runtime.torchfree.annotations.states import Layout, Region, volume
from runtime.torchfree.comm.resolve import plan_reduce

BUCKET_BYTES = 32 << 20  # one bucket size for the gradient sync and ZeRO-1's all-gathers
GRAD_ITEMSIZE = 4  # gradients are synced in the parameters' dtype, fp32
T = TypeVar("T")


@dataclass(frozen=True)
class SyncBucket:
    """One all-reduce: the slices of some gradients that one device group holds."""

    devices: tuple[int, ...]
    entries: tuple[tuple[int, Region], ...]  # (gradient index, global region), packing order
    numel: int  # elements of all its regions (the packer counts them as it cuts)


@dataclass(frozen=True)
class SyncGroup:
    """A device group of the gradient sync and its buckets, in the order the runtime issues them."""

    devices: tuple[int, ...]
    buckets: tuple[SyncBucket, ...]

    @cached_property
    def bucket_numel(self) -> tuple[int, ...]:
        return tuple(b.numel for b in self.buckets)

    @cached_property
    def numel(self) -> int:
        return sum(self.bucket_numel)

    @cached_property
    def slices(self) -> int:
        """Gradient slices packed into the buckets (and unpacked after)."""
        return sum(len(b.entries) for b in self.buckets)


SliceGroups = tuple[tuple[tuple[tuple[int, ...], int], tuple[tuple[Region, int], ...]], ...]
"""A gradient's all-reduce slices: per (device group, replica class) its regions with their sizes."""


def reduce_slices(layout: Layout) -> SliceGroups:
    """The slices of one gradient the sync all-reduces (none unless its layout is partial)."""
    if not layout.is_partial:
        return ()
    return tuple(((b.devices, b.cls), tuple((r, volume(r)) for r in b.regions))
                 for b in plan_reduce(layout, None) if len(b.devices) > 1)


def plan_sync(layouts: Sequence[Layout], *, bucket_bytes: int = BUCKET_BYTES) -> list[SyncBucket]:
    """Buckets of all gradients, grouped by device group, in one global order."""
    # Layers placed alike share one layout object (Annotation.layout is cached): reduce each once, keyed by
    # identity (hashing a layout is as costly as reducing it).
    reduced: dict[int, SliceGroups] = {}
    for lay in layouts:
        if id(lay) not in reduced:
            reduced[id(lay)] = reduce_slices(lay)
    return cut_buckets([reduced[id(lay)] for lay in layouts], bucket_bytes=bucket_bytes)


def cut_buckets(slices: Sequence[SliceGroups], *, bucket_bytes: int = BUCKET_BYTES) -> list[SyncBucket]:
    """Gradient ``i``'s slices ``slices[i]`` packed into buckets of at most ``bucket_bytes`` (a slice is never
    cut; a bigger one goes alone), device group by device group in one global order."""
    bucket_numel = max(1, bucket_bytes // GRAD_ITEMSIZE)
    by_group: dict[tuple[tuple[int, ...], int], list[tuple[int, tuple[tuple[Region, int], ...]]]] = defaultdict(list)
    for i, groups in enumerate(slices):
        for key, regions in groups:
            by_group[key].append((i, regions))
    out: list[SyncBucket] = []
    for (devices, _cls), items in sorted(by_group.items(), key=lambda kv: (len(kv[0][0]), kv[0])):
        flat = [(i, r, n) for i, regions in items for r, n in regions]
        out += [SyncBucket(devices, tuple((i, r) for i, r, _ in run), sum(n for _, _, n in run))
                for run in runs(flat, lambda s: s[2], bucket_numel)]
    return out


def runs(items: Sequence[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive runs of ``items`` of at most ``limit`` in all (a larger item alone; none when there are no
    items): the sync's buckets, and a checkpoint save's BSR rounds and weight files."""
    out: list[list[T]] = []
    total = 0
    for item in items:
        n = size(item)
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def sync_groups(buckets: Sequence[SyncBucket]) -> list[SyncGroup]:
    """``plan_sync``'s buckets by device group, groups in the order of their first bucket."""
    groups: dict[tuple[int, ...], list[SyncBucket]] = {}
    for b in buckets:
        groups.setdefault(b.devices, []).append(b)
    return [SyncGroup(devices, tuple(bs)) for devices, bs in groups.items()]
