"""Batched Send-Receive (BSR): planning point-to-point moves of tensor slices between two layouts.

A plan cuts every tensor into its finest common slices (per dim the grid of all source and
destination boundaries; for even splits that is the LCM of the degrees, not the max). Every slice a
destination device needs and does not hold itself gets one sender among its owners: the owner with
the highest bandwidth to the receiver, then the one with the fewest bytes assigned so far (docs/design.md
§3; O(p·q), the exact problem is a generalized assignment). Planning many tensors together (fused)
lets that balance span them, and the executor packs everything one device sends to one peer into
one buffer: one ``batch_isend_irecv`` round for a whole state switch.

Cost model (bandwidths in GB/s = 1e9 bytes/s): a device's egress time is the sum over its peers of
bytes sent / link bandwidth, its ingress time likewise; the plan's modelled time is the max over
devices of both. ``lower_bound`` is the max of (a) every receiver's bytes over the best bandwidth
from any surviving owner of each slice and (b) every sole owner's forced sends; no assignment beats it.
Reductions (partial values) never go through BSR: reduce first (see resolve.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

from runtime.torchfree.annotations.states import Annotation, Layout, LayoutError, Region, contains, intersect, volume
from runtime.torchfree.errors import HspmdError

Bandwidth = Callable[[int, int], float]
"""GB/s between two devices (the cluster's ``bandwidth_gbs``)."""

Policy = Literal["balanced", "first_owner"]

class DType(Protocol):
    """What planning needs of an element type: its size. ``torch.dtype`` has it, so does ``ElementType``."""

    @property
    def itemsize(self) -> int: ...


@dataclass(frozen=True)
class ElementType:
    """An element type named as torch names it, for plans made without torch (priced, checked, or
    executed later: the executor maps it to the torch dtype of that name)."""

    name: str
    itemsize: int


FLOAT32 = ElementType("float32", 4)

GRID_LIMIT = 64  # max cells per dim of the LCM grid before falling back to the union of boundaries


def uniform_bandwidth(_a: int, _b: int) -> float:
    return 1.0


def as_bandwidth(bandwidth: Bandwidth | object | None) -> Bandwidth:
    """A bandwidth function from a callable, a Cluster (``bandwidth_gbs``) or None (uniform)."""
    if bandwidth is None:
        return uniform_bandwidth
    fn = getattr(bandwidth, "bandwidth_gbs", None)
    if fn is not None:
        return fn  # type: ignore[return-value]
    if callable(bandwidth):
        return bandwidth  # type: ignore[return-value]
    raise TypeError(f"bandwidth must be a callable or a Cluster, got {type(bandwidth).__name__}")


@dataclass(frozen=True)
class TensorMove:
    """One tensor of a (fused) BSR: its global shape and dtype, and its layouts before and after."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    src: Annotation
    dst: Annotation

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor as the planner sees it: layouts applied to its shape."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    src: Layout
    dst: Layout

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """A slice of one tensor of a plan, by global index ranges."""

    tensor: int
    region: Region


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    tensor: int
    region: Region
    nbytes: int


@dataclass(frozen=True)
class Need:
    """One slice a receiver lacks, with every surviving device that could send it (for the bound)."""

    dst: int
    nbytes: int
    owners: tuple[int, ...]


@dataclass(frozen=True)
class LocalCopy:
    """A region the destination device already holds in its source tensor."""

    device: int
    tensor: int
    region: Region


@dataclass(frozen=True)
class Message:
    """Everything one device sends to (or receives from) one peer, packed in this order."""

    peer: int
    pieces: tuple[Piece, ...]
    nbytes: int


def grid(size: int, boundaries: Iterable[int]) -> list[int]:
    """Cut points of one dim: the LCM grid (gcd of all boundaries) unless it is too fine."""
    bs = sorted(set(boundaries) | {0, size})
    g = math.gcd(*bs)
    return list(range(0, size + 1, g)) if g and size // g <= max(GRID_LIMIT, len(bs) - 1) else bs


def cells(region: Region, cuts: Sequence[Sequence[int]]) -> list[Region]:
    """The grid cells inside ``region`` (whose bounds lie on the grid)."""
    per_dim = [itertools.pairwise([c for c in cs if a <= c <= b]) for (a, b), cs in zip(region, cuts)]
    return list(itertools.product(*per_dim))


def tensor_grid(layouts: Iterable[Layout], shape: Sequence[int]) -> list[list[int]]:
    bounds: list[set[int]] = [set() for _ in shape]
    for lay in layouts:
        for _, h in lay.holdings:
            for d, (a, b) in enumerate(h.region):
                bounds[d].update((a, b))
    return [grid(n, bs) for n, bs in zip(shape, bounds)]


@dataclass(frozen=True, eq=False)
class BsrPlan:
    """Who sends which slice of which tensor to whom. Pure data: build with ``plan_bsr``."""

    tensors: tuple[PlannedTensor, ...]
    local: tuple[LocalCopy, ...]
    transfers: tuple[Transfer, ...]
    needs: tuple[Need, ...] = ()
    excluded: frozenset[int] = field(default_factory=frozenset)

    @cached_property
    def index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    @cached_property
    def _by_pair(self) -> dict[tuple[int, int], list[Transfer]]:
        out: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            out[(t.src, t.dst)].append(t)
        return out

    def sends(self, device: int) -> list[Message]:
        """This device's outgoing messages, one per peer, by peer id (packing order is fixed)."""
        return [Message(d, tuple(Piece(t.tensor, t.region) for t in ts), sum(t.nbytes for t in ts))
                for (s, d), ts in sorted(self._by_pair.items()) if s == device]

    def recvs(self, device: int) -> list[Message]:
        return [Message(s, tuple(Piece(t.tensor, t.region) for t in ts), sum(t.nbytes for t in ts))
                for (s, d), ts in sorted(self._by_pair.items()) if d == device]

    def local_copies(self, device: int) -> list[LocalCopy]:
        return [c for c in self.local if c.device == device]

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device that takes part: holds a source or a destination of some tensor, or sends."""
        devs: set[int] = set()
        for t in self.tensors:
            devs.update(t.dst.devices)
            devs.update(d for d in t.src.devices if d not in self.excluded)
        return tuple(sorted(devs))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def link_bytes(self) -> dict[tuple[int, int], int]:
        return {k: sum(t.nbytes for t in ts) for k, ts in sorted(self._by_pair.items())}

    def device_times(self, bandwidth: Bandwidth | object | None = None) -> dict[int, tuple[float, float]]:
        """(egress seconds, ingress seconds) per device under the serial-port model."""
        bw = as_bandwidth(bandwidth)
        out: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for (s, d), nbytes in self.link_bytes().items():
            secs = nbytes / (bw(s, d) * 1e9)
            out[s][0] += secs
            out[d][1] += secs
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def modelled_time(self, bandwidth: Bandwidth | object | None = None) -> float:
        """Max over devices of egress and ingress time (seconds)."""
        times = self.device_times(bandwidth)
        return max((max(e, i) for e, i in times.values()), default=0.0)

    def lower_bound(self, bandwidth: Bandwidth | object | None = None) -> float:
        """No choice of senders finishes faster than this under the same cost model (seconds)."""
        bw = as_bandwidth(bandwidth)
        ingress: dict[int, float] = defaultdict(float)
        forced: dict[int, float] = defaultdict(float)
        for t in self.needs:
            best = max(bw(o, t.dst) for o in t.owners)
            ingress[t.dst] += t.nbytes / (best * 1e9)
            if len(t.owners) == 1:
                forced[t.owners[0]] += t.nbytes / (bw(t.owners[0], t.dst) * 1e9)
        return max([*ingress.values(), *forced.values(), 0.0])


def plan_bsr(moves: Sequence[TensorMove], *, bandwidth: Bandwidth | object | None = None,
             excluded: Collection[int] = (), policy: Policy = "balanced") -> BsrPlan:
    """Plan moving every tensor of ``moves`` from its ``src`` to its ``dst`` layout, fused.

    ``excluded`` devices (failed) never send and must not be destinations. A slice that some
    destination needs and no surviving device holds raises HspmdError naming the tensor and slice.
    ``policy="first_owner"`` is the naive baseline: every slice from its first owner in the source
    annotation's device order.
    """
    tensors = []
    for m in moves:
        try:
            src, dst = m.src.layout(m.shape), m.dst.layout(m.shape)
        except LayoutError as err:
            raise LayoutError(f"tensor {m.name}: {err}") from None
        tensors.append(PlannedTensor(m.name, m.shape, m.dtype, src, dst))
    return plan_layouts(tensors, bandwidth=bandwidth, excluded=excluded, policy=policy)


def plan_layouts(tensors: Sequence[PlannedTensor], *, bandwidth: Bandwidth | object | None = None,
                 excluded: Collection[int] = (), policy: Policy = "balanced",
                 forced: Mapping[tuple[int, int], int] | None = None) -> BsrPlan:
    """``plan_bsr`` on layouts. ``forced`` maps (tensor index, receiver) to the one device that sends."""
    bw = as_bandwidth(bandwidth)
    excl = frozenset(excluded)
    names = [t.name for t in tensors]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HspmdError(f"BSR: tensor name(s) {dup} given more than once")
    local: list[LocalCopy] = []
    demands: list[tuple[int, int, int, Region, tuple[int, ...]]] = []  # (nbytes, tensor, dst, region, owners)
    # Layers with the same placement repeat the same pair of layouts: work out each pair once.
    pattern: dict[tuple[Layout, Layout], tuple[list[tuple[int, Region]], list[tuple[int, Region, tuple[int, ...]]]]]
    pattern = {}
    for ti, t in enumerate(tensors):
        if t.src.is_partial:
            raise HspmdError(f"tensor {t.name}: a partial source must be reduced before a BSR")
        if t.dst.is_partial:
            raise HspmdError(f"tensor {t.name}: a BSR cannot produce a partial destination")
        bad = sorted(excl & set(t.dst.devices))
        if bad:
            raise HspmdError(f"tensor {t.name}: destination layout uses excluded device(s) {bad}")
        key = (t.src, t.dst)
        if key not in pattern:
            pattern[key] = _pattern(t, excl)
        copies, needs = pattern[key]
        local.extend(LocalCopy(dev, ti, region) for dev, region in copies)
        for dev, cell, owners in needs:
            if forced is not None and (ti, dev) in forced:
                sender = forced[(ti, dev)]
                if sender not in owners:
                    raise HspmdError(f"tensor {t.name}: forced sender {sender} does not hold {_fmt(cell)}")
                owners = (sender,)
            demands.append((volume(cell) * t.itemsize, ti, dev, cell, owners))
    transfers = _assign(demands, bw, policy)
    needs = tuple(Need(dev, nbytes, owners) for nbytes, _, dev, _, owners in demands)
    return BsrPlan(tuple(tensors), tuple(local), tuple(transfers), needs, excl)


def _pattern(t: PlannedTensor, excl: frozenset[int]) -> tuple[list[tuple[int, Region]],
                                                                list[tuple[int, Region, tuple[int, ...]]]]:
    """Local copies and (receiver, cell, surviving owners) of one pair of layouts."""
    cuts = tensor_grid((t.src, t.dst), t.shape)
    src_order = [d for d in t.src.devices if d not in excl]
    src_regions = t.src.by_device
    copies: list[tuple[int, Region]] = []
    needs: list[tuple[int, Region, tuple[int, ...]]] = []
    owners_of: dict[Region, tuple[int, ...]] = {}
    for dev, h in t.dst.holdings:
        mine = src_regions.get(dev)
        have = intersect(mine.region, h.region) if mine is not None else None
        if have is not None:
            copies.append((dev, have))
            if have == h.region:
                continue
        for cell in cells(h.region, cuts):
            if have is not None and contains(have, cell):
                continue
            owners = owners_of.get(cell)
            if owners is None:
                owners = owners_of[cell] = tuple(o for o in src_order if contains(src_regions[o].region, cell))
            if not owners:
                held = [o for o in t.src.devices if contains(src_regions[o].region, cell)]
                raise HspmdError(f"tensor {t.name}: slice {_fmt(cell)} needed by device {dev} has no "
                                 f"surviving owner (held only by excluded device(s) {held})")
            needs.append((dev, cell, owners))
    return copies, needs


def _assign(demands: list[tuple[int, int, int, Region, tuple[int, ...]]], bw: Bandwidth,
            policy: Policy) -> list[Transfer]:
    load: dict[int, int] = defaultdict(int)
    out: list[Transfer] = []
    if policy == "first_owner":
        out = [Transfer(owners[0], dev, ti, cell, nbytes) for nbytes, ti, dev, cell, owners in demands]
    elif policy == "balanced":
        # Largest first (LPT), ties in a fixed order, so every rank computes the same plan.
        link = functools.cache(bw)
        for nbytes, ti, dev, cell, owners in sorted(demands, key=lambda x: (-x[0], x[1], x[2], x[3])):
            rank = {o: i for i, o in enumerate(owners)}
            sender = min(owners, key=lambda o: (-link(o, dev), load[o], rank[o]))
            load[sender] += nbytes
            out.append(Transfer(sender, dev, ti, cell, nbytes))
    else:
        raise ValueError(f"unknown BSR policy {policy!r}")
    out.sort(key=lambda t: (t.src, t.dst, t.tensor, t.region))
    return _merge(out)


def _merge(transfers: list[Transfer]) -> list[Transfer]:
    """Join neighbouring cells of one tensor sent over one link into larger boxes (fewer copies)."""
    out: list[Transfer] = []
    for t in transfers:
        if out:
            p = out[-1]
            if (p.src, p.dst, p.tensor) == (t.src, t.dst, t.tensor):
                joined = _join(p.region, t.region)
                if joined is not None:
                    out[-1] = Transfer(p.src, p.dst, p.tensor, joined, p.nbytes + t.nbytes)
                    continue
        out.append(t)
    return out


def _join(a: Region, b: Region) -> Region | None:
    """The box a ∪ b when the two boxes touch along exactly one dim and agree on the others."""
    diff = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(diff) != 1 or a[diff[0]][1] != b[diff[0]][0]:
        return None
    d = diff[0]
    return a[:d] + ((a[d][0], b[d][1]),) + a[d + 1:]


def _fmt(region: Region) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"
