"""ZeRO-1: AdamW moments sharded over the data-parallel replicas of every parameter slice.

With several pipelines every parameter is held by each of them. After the gradient sync
(data_parallel.py) each finest slice of a parameter -- one entry of the SplitAllReduce planned by
runtime/comm/gradsync.py -- is held, with the full summed gradient, by a fixed group of devices: its
replicas. ZeRO-1 gives each of them one contiguous chunk of the slice's elements (row-major, near-equal:
the j-th device of the sorted group takes ``[n*j//k, n*(j+1)//k)``); a device keeps AdamW moments only
for its chunks and updates only them, then the group all-gathers the updated chunks so that every
holder has the whole new slice again. The all-gathers use the gradient sync's groups and bucket packing
(one collective per group per bucket); each device's part is padded to the group's longest, since gloo
has no uneven all-gather. A plan with one pipeline has no replicas: nothing is sharded there.

This module is the layout (pure, no torch); optim.py ``ShardedAdamW`` runs it.

Choices:

* Chunks are cut per slice, not per bucket, so the moment layout is a function of the plan alone (not
  of the bucket size): checkpoints (runtime/checkpoint.py) and ``hspmd show --device`` derive it
  without a running program (``zero_slices``).
* A member that duplicates a slice inside its TP group (a norm weight at TP 2) is *one* summand of the
  gradient sync but *each* of its devices is a holder of the synced gradient, so here each of them
  takes a chunk like any other holder: nothing is updated twice, no moment is kept twice, and the
  all-gather leaves both TP ranks with the same values.
* Exactness: AdamW is element-wise and runs through the same functional torch code as
  ``torch.optim.AdamW`` (``torch.optim.adamw.adamw``, default foreach/fused choice); clipping uses
  the global norm of the full synced gradients, computed before the update (program.py).
* Traffic: the gradient is still all-reduced, then the parameters are all-gathered (about 1.5x the
  all-reduce bytes of ``zero: false``); a reduce-scatter of the gradient would save a third, but gloo
  emulates reduce-scatter at twice its cost and the global norm would then need the chunks.
* The step is no longer all-or-nothing at the commit point (the all-gather follows the update), and
  no moment has a second copy: elastic recovery and planned switches refuse ``zero: true`` plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from runtime.annotations.from_plan import StrategyAnnotations
from runtime.annotations.states import Region, volume
from runtime.comm.gradsync import BUCKET_BYTES, plan_sync, reduce_slices


@dataclass(frozen=True)
class ZeroSlice:
    """One finest slice of a parameter and the devices that hold it after the gradient sync."""

    name: str
    region: Region  # global (start, stop) per dim
    devices: tuple[int, ...]  # sorted device ids; the j-th updates chunk j

    @property
    def numel(self) -> int:
        return volume(self.region)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    def chunk(self, device: int) -> tuple[int, int]:
        """[start, stop) of the slice's row-major elements that ``device`` updates."""
        k, j, n = len(self.devices), self.devices.index(device), self.numel
        return n * j // k, n * (j + 1) // k


class MomentPiece(NamedTuple):
    """Elements [start, stop) of the row-major flattening of the slice ``region`` of a parameter."""

    region: Region
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def zero_slices(annotations: StrategyAnnotations) -> dict[str, tuple[ZeroSlice, ...]]:
    """Every parameter with data-parallel replicas -> its slices, in the gradient sync's order.

    Parameters absent from the result (one pipeline) keep their moments in the parameter's layout.
    """
    out: dict[str, tuple[ZeroSlice, ...]] = {}
    memo: dict[tuple[object, tuple[int, ...]], tuple[tuple[Region, tuple[int, ...]], ...]] = {}
    for p in annotations.params:
        key = (p.grad, p.shape)
        if key not in memo:  # the slices the gradient sync all-reduces
            memo[key] = tuple((r, devs) for (devs, _), regions in reduce_slices(p.grad.layout(p.shape))
                              for r, _ in regions)
        if memo[key]:
            out[p.name] = tuple(ZeroSlice(p.name, r, devs) for r, devs in memo[key])
    return out


def moment_pieces(slices: Mapping[str, Sequence[ZeroSlice]], device: int) -> dict[str, tuple[MomentPiece, ...]]:
    """What ``device`` keeps of each sharded parameter's moments, in the order of ``local_state()``."""
    out: dict[str, tuple[MomentPiece, ...]] = {}
    for name, sl in slices.items():
        mine = tuple(MomentPiece(s.region, *s.chunk(device)) for s in sl if device in s.devices)
        if mine:
            out[name] = mine
    return out


@dataclass(frozen=True)
class ZeroBucket:
    """The slices one all-gather carries: the gradient sync's bucket of the same group."""

    devices: tuple[int, ...]
    slices: tuple[ZeroSlice, ...]

    def length(self, device: int) -> int:
        """Elements ``device`` updates (and sends) in this bucket."""
        return sum(b - a for a, b in (s.chunk(device) for s in self.slices))

    @property
    def width(self) -> int:
        """Each device's part of the all-gather, padded to the longest."""
        return max(self.length(d) for d in self.devices)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slices)


def zero_buckets(annotations: StrategyAnnotations, slices: Mapping[str, Sequence[ZeroSlice]], *,
                 bucket_bytes: int = BUCKET_BYTES) -> list[ZeroBucket]:
    """Every all-gather of the strategy in one global order: the gradient sync's buckets, reused."""
    names = [p.name for p in annotations.params]
    by_key = {(s.name, s.region): s for sl in slices.values() for s in sl}
    layouts = [p.grad.layout(p.shape) for p in annotations.params]
    return [ZeroBucket(b.devices, tuple(by_key[(names[i], r)] for i, r in b.entries))
            for b in plan_sync(layouts, bucket_bytes=bucket_bytes)]

