"""Fused, bucketed SplitAllReduce of the gradients of many parameters.

Each gradient is annotated like its parameter but with HDim -2 (the pipelines holding a layer each
computed a summand) and possibly partial inside a subgroup. Its reduce phase (resolve.plan_reduce)
cuts it into slices held by fixed device groups; here the slices of *all* gradients that share a
device group are packed into flat buffers (at most ``bucket_bytes`` each), one all-reduce per buffer,
issued in one global order. A device contributes a slice only as the first replica of its summand in
its subgroup, so a norm weight duplicated in a TP-2 group (devices 0 and 1 hold g_A) and held by a
TP-1 pipeline (device 2 holds g_B) becomes g_A + g_B everywhere, not 2 g_A + g_B.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.annotations.states import Annotation, Layout, Region, relative, volume
from runtime.comm.groups import ProcessGroups
from runtime.comm.resolve import plan_reduce


@dataclass(frozen=True)
class SyncBucket:
    devices: tuple[int, ...]
    entries: tuple[tuple[int, Region], ...]  # (gradient index, global region), packing order

    @property
    def numel(self) -> int:
        return sum(volume(r) for _, r in self.entries)


def plan_sync(layouts: Sequence[Layout], *, bucket_numel: int) -> list[SyncBucket]:
    """Buckets of all gradients, grouped by device group, in one global order."""
    by_group: dict[tuple[tuple[int, ...], int], list[tuple[int, Region]]] = defaultdict(list)
    for i, lay in enumerate(layouts):
        if not lay.is_partial:
            continue
        for b in plan_reduce(lay, None):
            if len(b.devices) > 1:
                by_group[(b.devices, b.cls)].extend((i, r) for r in b.regions)
    out: list[SyncBucket] = []
    for (devices, _cls), entries in sorted(by_group.items(), key=lambda kv: (len(kv[0][0]), kv[0])):
        cur: list[tuple[int, Region]] = []
        size = 0
        for e in entries:
            n = volume(e[1])
            if cur and size + n > bucket_numel:
                out.append(SyncBucket(devices, tuple(cur)))
                cur, size = [], 0
            cur.append(e)
            size += n
        if cur:
            out.append(SyncBucket(devices, tuple(cur)))
    return out


class GradientSync:
    """SplitAllReduce of many gradients at once; build once per strategy, call ``sync`` every step.

    ``entries``: ``(name, global shape, grad annotation)``; the result on every holder is the sum
    over the annotation's summands (HDim -2 members, bottom-tier partials), in place.
    """

    def __init__(self, entries: Sequence[tuple[str, Sequence[int], Annotation]], groups: ProcessGroups, *,
                 bucket_bytes: int = 64 << 20, itemsize: int = 4) -> None:
        self.names = [n for n, _, _ in entries]
        self.layouts = [a.layout(tuple(s)) for _, s, a in entries]
        self.groups = groups
        me = groups.my_device
        self.mine = [i for i, lay in enumerate(self.layouts) if me in lay]
        self.buckets = [b for b in plan_sync(self.layouts, bucket_numel=max(1, bucket_bytes // itemsize))
                        if me in b.devices]

    def group_keys(self) -> list[tuple[int, ...]]:
        """Device groups this device's buckets use (all must exist in ``groups``)."""
        return sorted({b.devices for b in self.buckets}, key=lambda k: (len(k), k))

    def sync(self, grads: Mapping[str, torch.Tensor], *, scale: float | None = None) -> None:
        """All-reduce this device's local gradients (by name) in place; then multiply by ``scale``."""
        me = self.groups.my_device
        holding = {i: self.layouts[i].by_device[me] for i in self.mine}
        for i in self.mine:
            g = grads[self.names[i]]
            if tuple(g.shape) != holding[i].shape:
                raise ValueError(f"gradient {self.names[i]!r}: local shape {list(g.shape)}, layout says "
                                 f"{list(holding[i].shape)}")
        pending = []
        for b in self.buckets:
            parts = []
            for i, region in b.entries:
                h = holding[i]
                g = grads[self.names[i]]
                if h.replica == 0:
                    parts.append(g[relative(region, h.region)].reshape(-1))
                else:
                    parts.append(g.new_zeros(volume(region)))
            flat = torch.cat(parts)
            work = dist.all_reduce(flat, group=self.groups.get(b.devices), async_op=True)
            pending.append((work, flat, b))
        for work, flat, b in pending:
            work.wait()
            off = 0
            for i, region in b.entries:
                h = holding[i]
                n = volume(region)
                grads[self.names[i]][relative(region, h.region)] = flat[off:off + n].view(
                    tuple(e - s for s, e in region))
                off += n
        if scale is not None:
            for i in self.mine:
                grads[self.names[i]].mul_(scale)
