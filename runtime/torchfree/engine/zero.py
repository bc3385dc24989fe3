"""ZeRO-1: AdamW moments sharded over the data-parallel replicas of every parameter slice.

With several pipelines every parameter is held by each of them. After the gradient sync
(data_parallel.py) each finest slice of a parameter -- one entry of the SplitAllReduce planned by
runtime/torchfree/comm/gradsync.py -- is held, with the full summed gradient, by a fixed group of devices: its
replicas. ZeRO-1 cuts the slice's elements (row-major) into ``m = k // r`` near-equal contiguous chunks,
``r`` = ``training.zero_redundancy`` (default 1), and gives each chunk to ``r`` of the ``k`` replicas
(``place``); a device keeps AdamW moments only for its chunk and updates all of it (every holder has
the full gradient, so the ``r`` copies stay equal with no traffic of their own), then the group
all-gathers the updated elements so that every holder has the whole new slice again. Each element is
sent once: the ``r`` holders of a chunk send one ``r``-th of it each (``ZeroSlice.part``). The
all-gathers use the gradient sync's groups and bucket packing (one collective per group per bucket);
each device's part is padded to the group's longest, since gloo has no uneven all-gather. A plan with
one pipeline has no replicas: nothing is sharded there.

This module is the layout (pure, no torch); optim.py ``ShardedAdamW`` runs it.

Choices:

* Chunks are cut per slice, not per bucket, so the moment layout is a function of the plan alone (not
  of the bucket size): checkpoints (runtime/checkpoint.py), elastic recovery (runtime/torchfree/elastic/state.py)
  and ``hspmd show --device`` derive it without a running program (``zero_slices``).
* ``r = 1`` is plain ZeRO-1 (chunk j to the j-th device of the sorted group). ``r >= 2`` survives the
  loss of any ``r - 1`` holders of a chunk: ``place`` puts a chunk's holders on different nodes (the
  cluster's failure domains) whenever the node sizes allow it, and the ``k - r*m`` replicas left over
  keep no moments of the slice (they are taken from the largest nodes, which is what lets the rest
  spread). Equal-sized groups of holders keep the chunks aligned, so each element has exactly ``r``
  holders and each holder one contiguous run -- the layout is an HSPMD annotation (a union of
  duplicated parts, ``moment_annotation``) that the BSR moves like any other.
* A member that duplicates a slice inside its TP group (a norm weight at TP 2) is *one* summand of the
  gradient sync but *each* of its devices is a holder of the synced gradient, so here each of them
  is a replica like any other: nothing is updated more often than ``r`` times, and the all-gather
  leaves both TP ranks with the same values.
* Exactness: AdamW is element-wise and runs through the same functional torch code as
  ``torch.optim.AdamW`` (``torch.optim.adamw.adamw``, default foreach/fused choice); clipping uses
  the global norm of the full synced gradients, computed before the update (program.py).
* Traffic: the gradient is still all-reduced, then the parameters are all-gathered (about 1.5x the
  all-reduce bytes of ``zero: false``, whatever ``r``); a reduce-scatter of the gradient would save a
  third, but gloo emulates reduce-scatter at twice its cost and the global norm would then need the chunks.
* The step is no longer all-or-nothing at the commit point (the all-gather follows the update). With
  ``r = 1`` no moment has a second copy, so elastic recovery and planned switches refuse such plans; with
  ``r >= 2`` they rebuild the moments from the surviving copies (runtime/torchfree/elastic/state.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from runtime.torchfree.annotations.from_plan import StrategyAnnotations
from runtime.torchfree.annotations.states import Annotation, DistributedStates, Region, volume
from runtime.torchfree.comm.gradsync import BUCKET_BYTES, plan_sync, reduce_slices
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.plan import TrainingSettings

Domains = Mapping[int, Hashable]
"""device -> its failure domain (its node): devices of one domain may fail together."""


def node_domains(cluster: Cluster) -> dict[int, str]:
    """Every device's failure domain: its node (an agent, a power feed, a NIC)."""
    return {d.id: d.node for d in cluster.devices}


def place(devices: Sequence[int], redundancy: int, domains: Domains | None = None) -> tuple[tuple[int, ...], ...]:
    """The holders of each of the ``len(devices) // redundancy`` chunks of a slice, in chunk order.

    ``redundancy`` 1: chunk j to the j-th sorted device. Otherwise the ``k - r*m`` devices left over come
    off the largest domains, the rest are listed domain by domain (largest first) and dealt column-wise
    into ``m`` rows, so a domain's run of at most ``m`` devices lands in ``m`` different chunks: the holders
    of every chunk are in distinct domains whenever some choice of leftovers leaves no domain with more
    than ``m`` devices (otherwise two copies of some chunk necessarily share one)."""
    devs = sorted(devices)
    k, r = len(devs), redundancy
    if not 1 <= r <= k:
        raise ValueError(f"redundancy {r} needs 1 to {k} holders (the slice has {k})")
    if r == 1:
        return tuple((d,) for d in devs)
    m = k // r
    dom = {d: (domains[d] if domains is not None else d) for d in devs}
    by: dict[Hashable, list[int]] = {}
    for d in devs:
        by.setdefault(dom[d], []).append(d)
    keys = sorted(by, key=str)  # a fixed order of domains, whatever their type
    for _ in range(k - r * m):  # the leftovers: one off the largest domain at a time
        big = max(keys, key=lambda x: (len(by[x]), -keys.index(x)))
        by[big].pop()
    order = [d for x in sorted(keys, key=lambda x: (-len(by[x]), keys.index(x))) for d in by[x]]
    return tuple(tuple(order[i + c * m] for c in range(r)) for i in range(m))


@dataclass(frozen=True)
class ZeroSlice:
    """One finest slice of a parameter, the devices that hold it after the gradient sync, and the holders
    of each of its moment chunks (``place``)."""

    name: str
    region: Region  # global (start, stop) per dim
    devices: tuple[int, ...]  # sorted device ids: every replica of the slice
    holders: tuple[tuple[int, ...], ...] = ()  # chunk i -> its holders; () -> one chunk per device (r = 1)

    def __post_init__(self) -> None:
        if not self.holders:
            object.__setattr__(self, "holders", tuple((d,) for d in self.devices))
        flat = [d for h in self.holders for d in h]
        if len(set(flat)) != len(flat) or not set(flat) <= set(self.devices):
            raise ValueError(f"{self.name}: chunk holders {self.holders} must be distinct replicas of {self.devices}")
        if len({len(h) for h in self.holders}) != 1:
            raise ValueError(f"{self.name}: every chunk needs the same number of holders, got {self.holders}")

    @property
    def numel(self) -> int:
        return volume(self.region)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    @property
    def redundancy(self) -> int:
        return len(self.holders[0])

    def chunk_bounds(self, i: int) -> tuple[int, int]:
        m, n = len(self.holders), self.numel
        return n * i // m, n * (i + 1) // m

    def chunk(self, device: int) -> tuple[int, int]:
        """[start, stop) of the slice's row-major elements that ``device`` keeps moments of and updates
        (empty for a replica left over by ``place``)."""
        for i, h in enumerate(self.holders):
            if device in h:
                return self.chunk_bounds(i)
        if device not in self.devices:
            raise ValueError(f"{self.name}: device {device} holds no replica of this slice")
        return 0, 0

    def part(self, device: int) -> tuple[int, int]:
        """[start, stop) of the elements ``device`` sends in the all-gather: its share of its chunk (the
        holders of a chunk split it in their order, so every element is sent once)."""
        for i, h in enumerate(self.holders):
            if device in h:
                a, b = self.chunk_bounds(i)
                c, r = h.index(device), len(h)
                return a + (b - a) * c // r, a + (b - a) * (c + 1) // r
        return 0, 0

    def senders(self) -> list[tuple[int, tuple[int, int]]]:
        """(device, part) of every device with a non-empty part, in element order."""
        out = []
        for h in self.holders:
            for d in h:
                a, b = self.part(d)
                if b > a:
                    out.append((d, (a, b)))
        return out

    def moment_annotation(self, excluded: frozenset[int] = frozenset()) -> Annotation | None:
        """The moments as a 1-D tensor of ``numel`` elements under HSPMD: a union of the chunks, each
        duplicated over its holders not in ``excluded``. None when some chunk has no such holder."""
        members, sizes = [], []
        for i, h in enumerate(self.holders):
            a, b = self.chunk_bounds(i)
            if b == a:
                continue
            alive = tuple(d for d in h if d not in excluded)
            if not alive:
                return None
            members.append((alive, DistributedStates.duplicate(len(alive))))
            sizes.append(b - a)
        return Annotation.union(0, members, sizes)

    def lost_chunks(self, failed: frozenset[int]) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
        """((start, stop), holders) of every non-empty chunk all of whose holders are in ``failed``."""
        out = []
        for i, h in enumerate(self.holders):
            a, b = self.chunk_bounds(i)
            if b > a and set(h) <= failed:
                out.append(((a, b), h))
        return out


class MomentPiece(NamedTuple):
    """Elements [start, stop) of the row-major flattening of the slice ``region`` of a parameter."""

    region: Region
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def zero_slices(annotations: StrategyAnnotations, redundancy: int = 1,
                domains: Domains | None = None) -> dict[str, tuple[ZeroSlice, ...]]:
    """Every parameter with data-parallel replicas -> its slices, in the gradient sync's order, each chunk
    held by ``redundancy`` devices (``place``, over ``domains``; None: every device its own domain).

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
            out[p.name] = tuple(ZeroSlice(p.name, r, devs, place(devs, redundancy, domains) if redundancy > 1 else ())
                                for r, devs in memo[key])
    return out


def strategy_zero_slices(annotations: StrategyAnnotations, training: TrainingSettings,
                         cluster: Cluster) -> dict[str, tuple[ZeroSlice, ...]]:
    """The plan's ZeRO-1 layout (empty without ``training.zero``): every caller derives it the same way."""
    if not training.zero:
        return {}
    return zero_slices(annotations, training.zero_redundancy, node_domains(cluster))


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
        """Elements ``device`` updates (and keeps moments of) in this bucket."""
        return sum(b - a for a, b in (s.chunk(device) for s in self.slices))

    def sent(self, device: int) -> int:
        """Elements ``device`` sends in this bucket's all-gather (``length`` when r = 1)."""
        return sum(b - a for a, b in (s.part(device) for s in self.slices))

    @property
    def width(self) -> int:
        """Each device's part of the all-gather, padded to the longest."""
        return max(self.sent(d) for d in self.devices)

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

