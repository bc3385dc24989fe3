"""HSPMD annotations: DeviceGroup, DistributedStates, DS/DG unions and the ``Annotation`` pairing them.

Everything is named by cluster device ids, never by ranks: ranks change when survivors of a failure
form a new world, device ids do not. All classes are frozen and validated on construction; the
constructors normalise what has a single meaning (degree-1 dims are dropped, a union of one subgroup
has no top tier, split weights are reduced by their gcd) so that ``==`` is layout equality.

Semantics (docs/design.md §2):

* ``DistributedStates`` over a ``DeviceGroup`` of n devices: ``{dim: degree}`` where dim >= 0 splits
  that tensor dim evenly, -1 duplicates (replicas) and -2 is partial (each holds a summand); the
  product of degrees is n. ``order`` lists the dims slowest first: device i of the group has the
  row-major coordinates of i over the degrees in that order (the last dim varies fastest).
* ``Annotation`` = ``DSUnion`` x ``DGUnion``: subgroup i lays out its part with ``states[i]`` on
  ``groups[i]``; ``hdim`` relates the subgroups: >= 0 splits that dim by the explicit weights of
  ``split`` (member i gets ``[N*W_i // W, N*W_{i+1} // W)``, W_i the prefix sums), -1 duplicates the
  whole tensor in every member, -2 makes the tensor the sum of the members' values. A member's value
  is its own layout's value, so a member's internal replicas count once in a -2 sum.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from runtime.torchfree.errors import HspmdError

DUPLICATE = -1
PARTIAL = -2

Region = tuple[tuple[int, int], ...]
"""Global index ranges ``((start, stop), ...)``, one per tensor dim."""


class LayoutError(HspmdError, ValueError):
    """An annotation that is malformed, or that cannot lay out a tensor of the given shape."""


@dataclass(frozen=True)
class DeviceGroup:
    """An ordered list of distinct device ids."""

    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        devs = tuple(int(d) for d in self.devices)
        object.__setattr__(self, "devices", devs)
        if not devs:
            raise LayoutError("a device group must list at least one device")
        if len(set(devs)) != len(devs):
            raise LayoutError(f"device group {list(devs)} lists a device more than once")
        if any(d < 0 for d in devs):
            raise LayoutError(f"device group {list(devs)} has a negative device id")

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.devices)

    def __contains__(self, device: object) -> bool:
        return device in self.devices

    def index(self, device: int) -> int:
        return self.devices.index(device)

    def __str__(self) -> str:
        return span(self.devices)


def span(devices: Sequence[int]) -> str:
    """'0-3' for a contiguous ascending run of more than two devices, else '0,2,5'."""
    d = list(devices)
    if len(d) > 2 and d == list(range(d[0], d[-1] + 1)):
        return f"{d[0]}-{d[-1]}"
    return ",".join(str(x) for x in d)


@dataclass(frozen=True)
class DistributedStates:
    """The bottom tier: an ordinary SPMD layout over one device group.

    ``states`` may be given as a mapping ``{dim: degree}``; it is stored as sorted ``(dim, degree)``
    pairs without degree-1 entries. ``order`` is required once two or more dims have degree > 1.
    """

    states: tuple[tuple[int, int], ...]
    order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        raw = list(self.states.items() if isinstance(self.states, Mapping) else self.states)
        pairs: dict[int, int] = {}
        for item in raw:
            try:
                dim, deg = item
            except (TypeError, ValueError):
                raise LayoutError(f"distributed states entries must be (dim, degree) pairs, got {item!r}") from None
            if not isinstance(dim, int) or not isinstance(deg, int) or isinstance(dim, bool):
                raise LayoutError(f"distributed states need integer dims and degrees, got {dim!r}: {deg!r}")
            if dim < PARTIAL:
                raise LayoutError(f"dim {dim} is not a tensor dim (>= 0), -1 (duplicate) or -2 (partial)")
            if deg < 1:
                raise LayoutError(f"dim {dim} has degree {deg}; degrees must be at least 1")
            if dim in pairs:
                raise LayoutError(f"dim {dim} is given twice")
            if deg > 1:
                pairs[dim] = deg
        order = tuple(int(d) for d in (self.order or ()))
        if len(set(order)) != len(order):
            raise LayoutError(f"order {list(order)} lists a dim twice")
        extra = [d for d in order if d not in pairs and d not in {p for p, _ in raw}]
        if extra:
            raise LayoutError(f"order {list(order)} names dims {extra} that have no degree")
        order = tuple(d for d in order if d in pairs)
        if not order:
            if len(pairs) > 1:
                raise LayoutError(f"distributed states {dict(sorted(pairs.items()))} split several dims: "
                                  "give an explicit order (slowest dim first)")
            order = tuple(pairs)
        elif set(order) != set(pairs):
            missing = sorted(set(pairs) - set(order))
            raise LayoutError(f"order {list(order)} does not list dims {missing}")
        object.__setattr__(self, "states", tuple(sorted(pairs.items())))
        object.__setattr__(self, "order", order)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def of(cls, states: Mapping[int, int] | None = None, order: Sequence[int] = ()) -> DistributedStates:
        return cls(tuple((states or {}).items()), tuple(order))

    @classmethod
    def split(cls, dim: int, degree: int) -> DistributedStates:
        if dim < 0:
            raise LayoutError(f"split needs a tensor dim >= 0, got {dim}")
        return cls(((dim, degree),))

    @classmethod
    def duplicate(cls, degree: int) -> DistributedStates:
        return cls(((DUPLICATE, degree),))

    @classmethod
    def partial(cls, degree: int) -> DistributedStates:
        return cls(((PARTIAL, degree),))

    # -- queries --------------------------------------------------------------------------------
    @property
    def degrees(self) -> dict[int, int]:
        return dict(self.states)

    def degree(self, dim: int) -> int:
        return self.degrees.get(dim, 1)

    @property
    def device_num(self) -> int:
        return math.prod(d for _, d in self.states)

    @property
    def split_dims(self) -> dict[int, int]:
        return {d: n for d, n in self.states if d >= 0}

    @property
    def is_partial(self) -> bool:
        return self.degree(PARTIAL) > 1

    def coordinates(self, index: int) -> dict[int, int]:
        """Coordinates of the device at ``index`` of the group, by dim (missing dims: 0)."""
        if not 0 <= index < self.device_num:
            raise LayoutError(f"device index {index} out of range for {self.device_num} devices")
        coords: dict[int, int] = {}
        for dim in reversed(self.order):
            n = self.degree(dim)
            coords[dim] = index % n
            index //= n
        return coords

    def reduced(self) -> DistributedStates:
        """The same device positions with partial replaced by duplicate (the layout of a gradient).

        Partial and duplicate merge into one duplicate dim only when they are adjacent in ``order``;
        otherwise the result is not a DistributedStates (``Layout.reduced`` still describes it).
        """
        if not self.is_partial:
            return self
        degs = self.degrees
        if DUPLICATE not in degs:
            return DistributedStates(tuple((DUPLICATE if d == PARTIAL else d, n) for d, n in self.states),
                                     tuple(DUPLICATE if d == PARTIAL else d for d in self.order))
        i, j = sorted((self.order.index(PARTIAL), self.order.index(DUPLICATE)))
        if j != i + 1:
            raise LayoutError(f"{self}: partial and duplicate are not adjacent in the order, so the reduced "
                              "layout is not a DistributedStates; use Layout.reduced()")
        merged = {d: n for d, n in self.states if d not in (PARTIAL, DUPLICATE)}
        merged[DUPLICATE] = degs[PARTIAL] * degs[DUPLICATE]
        order = self.order[:i] + (DUPLICATE,) + self.order[j + 1:]
        return DistributedStates(tuple(merged.items()), order)

    def __str__(self) -> str:
        if not self.states:
            return "full"
        names = {DUPLICATE: "D", PARTIAL: "P"}
        return "·".join(f"{names.get(d, f'S{d}')}×{self.degree(d)}" for d in self.order)

    def to_data(self) -> dict[str, Any]:
        return {"states": {str(d): n for d, n in self.states}, "order": list(self.order)}


@dataclass(frozen=True)
class DSUnion:
    """The DS of every subgroup plus the top tier: ``hdim`` and, for hdim >= 0, the split weights."""

    hdim: int
    states: tuple[DistributedStates, ...]
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        states = tuple(self.states)
        object.__setattr__(self, "states", states)
        if not states:
            raise LayoutError("a DS union needs at least one DistributedStates")
        if not all(isinstance(s, DistributedStates) for s in states):
            raise LayoutError("DS union members must be DistributedStates")
        hdim = int(self.hdim)
        if hdim < PARTIAL:
            raise LayoutError(f"hdim {hdim} is not a tensor dim (>= 0), -1 (duplicate) or -2 (partial)")
        split = None if self.split is None else tuple(int(w) for w in self.split)
        if len(states) == 1:
            hdim, split = DUPLICATE, None  # one subgroup: plain SPMD, no top tier
        elif hdim >= 0:
            if split is None:
                raise LayoutError(f"hdim {hdim} splits a tensor dim: give the split weights explicitly "
                                  f"(one per subgroup, e.g. {[1] * len(states)} for even)")
            if len(split) != len(states):
                raise LayoutError(f"split weights {list(split)} must have one entry per subgroup "
                                  f"({len(states)})")
            if any(w < 1 for w in split):
                raise LayoutError(f"split weights {list(split)} must be positive integers")
            g = math.gcd(*split)
            split = tuple(w // g for w in split)
        elif split is not None:
            raise LayoutError(f"split weights only apply to hdim >= 0 (hdim is {hdim})")
        object.__setattr__(self, "hdim", hdim)
        object.__setattr__(self, "split", split)

    @property
    def hsize(self) -> int:
        return len(self.states)

    def bounds(self, size: int) -> list[tuple[int, int]]:
        """[start, stop) of each member along ``hdim`` for a dim of ``size`` (hdim >= 0 only)."""
        assert self.split is not None
        cum = [0, *itertools.accumulate(self.split)]
        return [(size * a // cum[-1], size * b // cum[-1]) for a, b in zip(cum, cum[1:])]


@dataclass(frozen=True)
class DGUnion:
    """The device group of every subgroup; groups are disjoint."""

    groups: tuple[DeviceGroup, ...]

    def __post_init__(self) -> None:
        groups = tuple(g if isinstance(g, DeviceGroup) else DeviceGroup(tuple(g)) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups:
            raise LayoutError("a DG union needs at least one device group")
        seen: set[int] = set()
        for g in groups:
            both = seen & set(g.devices)
            if both:
                raise LayoutError(f"device(s) {sorted(both)} appear in more than one subgroup of a DG union")
            seen |= set(g.devices)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for g in self.groups for d in g.devices)


@dataclass(frozen=True)
class Holding:
    """What one device holds of a tensor under a layout."""

    member: int  # subgroup index in the union
    index: int  # position in the subgroup's device group
    region: Region  # global [start, stop) per dim
    summand: tuple[int, int]  # (top, bottom) partial coordinates; (0, 0) when the value is not partial
    replica: int  # duplicate coordinate inside the subgroup; 0 = the one that contributes to sums
    cls: int  # reduction class: members reduce separately when the top tier duplicates (hdim -1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Annotation:
    """The HSPMD annotation of one tensor: a DS union over a DG union."""

    ds: DSUnion
    dg: DGUnion

    def __post_init__(self) -> None:
        if self.ds.hsize != len(self.dg.groups):
            raise LayoutError(f"DS union has {self.ds.hsize} subgroups but DG union has {len(self.dg.groups)}")
        for i, (s, g) in enumerate(zip(self.ds.states, self.dg.groups)):
            if s.device_num != len(g):
                raise LayoutError(f"subgroup {i}: distributed states {s} need {s.device_num} devices, "
                                  f"device group {list(g.devices)} has {len(g)}")

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def spmd(cls, devices: Iterable[int], states: DistributedStates | None = None) -> Annotation:
        """Plain SPMD (HSize 1); ``states`` defaults to duplicate over all devices."""
        devs = tuple(devices)
        st = states if states is not None else DistributedStates.duplicate(len(devs))
        return cls(DSUnion(DUPLICATE, (st,)), DGUnion((DeviceGroup(devs),)))

    @classmethod
    def union(cls, hdim: int, members: Iterable[tuple[Iterable[int], DistributedStates]],
              split: Sequence[int] | None = None) -> Annotation:
        ms = [(tuple(d), s) for d, s in members]
        return cls(DSUnion(hdim, tuple(s for _, s in ms), None if split is None else tuple(split)),
                   DGUnion(tuple(DeviceGroup(d) for d, _ in ms)))

    # -- queries --------------------------------------------------------------------------------
    @property
    def hdim(self) -> int:
        return self.ds.hdim

    @property
    def hsize(self) -> int:
        return self.ds.hsize

    @property
    def members(self) -> tuple[tuple[DeviceGroup, DistributedStates], ...]:
        return tuple(zip(self.dg.groups, self.ds.states))

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device holding the tensor, member by member, in group order."""
        return self.dg.devices

    @property
    def is_partial(self) -> bool:
        return self.hdim == PARTIAL or any(s.is_partial for s in self.ds.states)

    def check(self, shape: Sequence[int]) -> None:
        """Raise LayoutError unless this annotation can lay out a tensor of ``shape``."""
        self.layout(shape)

    def layout(self, shape: Sequence[int]) -> Layout:
        return _layout(self, tuple(int(s) for s in shape))

    def grad(self) -> Annotation:
        """Layout of this tensor's gradient: partial becomes duplicate (top and bottom tier)."""
        hdim = DUPLICATE if self.hdim == PARTIAL else self.hdim
        return Annotation(DSUnion(hdim, tuple(s.reduced() for s in self.ds.states), self.ds.split), self.dg)

    def with_hdim(self, hdim: int, split: Sequence[int] | None = None) -> Annotation:
        return Annotation(DSUnion(hdim, self.ds.states, None if split is None else tuple(split)), self.dg)

    def __str__(self) -> str:
        if self.hsize == 1:
            g, s = self.members[0]
            return f"[{g}] {s}"
        top = {DUPLICATE: "dup", PARTIAL: "partial"}.get(self.hdim)
        if top is None:
            top = f"split{self.hdim}({':'.join(str(w) for w in self.ds.split or ())})"
        return f"{top}[ " + " | ".join(f"{g}: {s}" for g, s in self.members) + " ]"

    def to_data(self) -> dict[str, Any]:
        return {"hdim": self.hdim, "split": list(self.ds.split) if self.ds.split else None,
                "members": [{"devices": list(g.devices), **s.to_data()} for g, s in self.members]}


@dataclass(frozen=True)
class Layout:
    """An annotation applied to one shape: what each device holds. Hashable, comparable."""

    shape: tuple[int, ...]
    holdings: tuple[tuple[int, Holding], ...]  # (device, holding), annotation order

    @cached_property
    def by_device(self) -> dict[int, Holding]:
        return dict(self.holdings)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.holdings)

    def __contains__(self, device: object) -> bool:
        return device in self.by_device

    def region(self, device: int) -> Region:
        return self.by_device[device].region

    def local_shape(self, device: int) -> tuple[int, ...]:
        return self.by_device[device].shape

    def same_data(self, other: Layout) -> bool:
        """Both non-partial and every device holds the same region: nothing to move."""
        return (not self.is_partial and not other.is_partial and self.shape == other.shape
                and {d: h.region for d, h in self.holdings} == {d: h.region for d, h in other.holdings})

    @cached_property
    def is_partial(self) -> bool:
        return len({h.summand for _, h in self.holdings}) > 1

    def reduced(self) -> Layout:
        """Every device holds the full sum over its own region (what an in-place all-reduce leaves)."""
        if not self.is_partial:
            return self
        return Layout(self.shape, tuple((d, Holding(h.member, h.index, h.region, (0, 0), 0, h.cls))
                                        for d, h in self.holdings))


def region_index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def relative(inner: Region, outer: Region) -> tuple[slice, ...]:
    """Index of ``inner`` (global ranges) inside a local tensor that holds ``outer``."""
    return tuple(slice(a - oa, b - oa) for (a, b), (oa, _) in zip(inner, outer))


def contains(outer: Region, inner: Region) -> bool:
    return all(oa <= a and b <= ob for (oa, ob), (a, b) in zip(outer, inner))


def intersect(a: Region, b: Region) -> Region | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def volume(region: Region) -> int:
    return math.prod(b - a for a, b in region)


@lru_cache(maxsize=4096)
def _layout(ann: Annotation, shape: tuple[int, ...]) -> Layout:
    rank = len(shape)
    if any(s < 1 for s in shape):
        raise LayoutError(f"shape {list(shape)} has an empty dim")
    if ann.hdim >= rank:
        raise LayoutError(f"hdim {ann.hdim} is out of range for a {rank}-d tensor of shape {list(shape)}")
    bounds = ann.ds.bounds(shape[ann.hdim]) if ann.hdim >= 0 else []
    for i, (a, b) in enumerate(bounds):
        if a >= b:
            raise LayoutError(f"split weights {list(ann.ds.split or ())} leave subgroup {i} an empty part "
                              f"of dim {ann.hdim} (size {shape[ann.hdim]})")
    holdings: list[tuple[int, Holding]] = []
    for m, (group, states) in enumerate(ann.members):
        top = [(0, s) for s in shape]
        if bounds:
            top[ann.hdim] = bounds[m]
        for dim, deg in states.split_dims.items():
            if dim >= rank:
                raise LayoutError(f"subgroup {m}: split dim {dim} is out of range for shape {list(shape)}")
            extent = top[dim][1] - top[dim][0]
            if extent % deg:
                raise LayoutError(f"subgroup {m}: dim {dim} of extent {extent} is not divisible by its split "
                                  f"degree {deg} (shape {list(shape)})")
        for idx, dev in enumerate(group.devices):
            coords = states.coordinates(idx)
            region = []
            for dim, (a, b) in enumerate(top):
                deg = states.degree(dim)
                step = (b - a) // deg
                c = coords.get(dim, 0)
                region.append((a + c * step, a + (c + 1) * step))
            summand = (m if ann.hdim == PARTIAL else 0, coords.get(PARTIAL, 0))
            holdings.append((dev, Holding(m, idx, tuple(region), summand, coords.get(DUPLICATE, 0),
                                          m if ann.hdim == DUPLICATE else 0)))
    return Layout(shape, tuple(holdings))


def lcm_degrees(annotations: Iterable[Annotation], dim: int) -> int:
    """The finest common split of ``dim``: LCM of every bottom-tier degree on it (not the max)."""
    return math.lcm(*[s.degree(dim) for a in annotations for s in a.ds.states] or [1])
