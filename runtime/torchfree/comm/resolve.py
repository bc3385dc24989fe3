"""Hierarchical communication resolution: (src annotation, dst annotation, global shape) -> CommOp.

``resolve`` is a pure function (docs/design.md §3). It names the op by the annotations and builds the
plan that executes it, in at most two phases:

1. **reduce** (only when the source is partial): slices are cut on the common grid; the devices that
   hold a slice (per reduction class) form a group; one collective per group over a flat buffer of
   all its slices. A device contributes its value only if it is the first replica of its summand in
   its subgroup (``Holding.replica == 0``), zeros otherwise, so a member duplicated inside its
   subgroup counts once in a top-tier (-2) sum. When every destination device already holds its
   destination region in the source and each slice is needed by one device of its group, the
   collective is a reduce-scatter, otherwise an all-reduce.
2. **transfer** (non-partial to non-partial): local copies; all-gathers over groups of devices that
   share a destination region and whose source regions tile it; a BSR (batched P2P) for the rest.

Names (``CommOp.kind``): identity, local_slice, all_reduce, reduce_scatter, all_gather, scatter,
send_recv, split_all_reduce, split_reduce_scatter, split_all_gather, bsr, composed (``parts`` gives
the reduction and the transfer, e.g. ("split_all_reduce", "bsr")).

The backward of every op is the op resolved from the destination's gradient layout to the source's
(``CommOp.adjoint``): gradients of duplicate layouts are kept duplicate (DTensor's convention), so
all-reduce <-> identity, reduce-scatter -> all-gather, local slice -> all-gather, send/recv and BSR
-> the reverse BSR.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

from runtime.torchfree.annotations.states import (
    PARTIAL,
    Annotation,
    Layout,
    LayoutError,
    Region,
    contains,
    intersect,
    volume,
)
from runtime.torchfree.comm.bsr import (
    FLOAT32,
    Bandwidth,
    BsrPlan,
    DType,
    LocalCopy,
    Message,
    Need,
    PlannedTensor,
    Transfer,
    cells,
    plan_layouts,
    tensor_grid,
)
from runtime.torchfree.errors import HspmdError

KINDS = ("identity", "local_slice", "all_reduce", "reduce_scatter", "all_gather", "scatter", "send_recv",
         "split_all_reduce", "split_reduce_scatter", "split_all_gather", "bsr", "composed")


@dataclass(frozen=True)
class ReduceBucket:
    """One collective of the reduce phase: its devices, slices, and who needs each slice."""

    devices: tuple[int, ...]  # sorted device ids of the group
    cls: int
    regions: tuple[Region, ...]  # slices of the tensor, in packing order
    needers: tuple[int, ...] | None  # reduce-scatter: the device that keeps each slice; None = all-reduce

    @property
    def numel(self) -> int:
        return sum(volume(r) for r in self.regions)

    @property
    def key(self) -> tuple:
        return (len(self.devices), self.devices, self.cls)


@dataclass(frozen=True)
class GatherGroup:
    """An all-gather: ``devices`` share the destination ``region``; their source regions tile it."""

    devices: tuple[int, ...]  # sorted device ids
    region: Region
    parts: tuple[Region, ...]  # source region of each device, in ``devices`` order


@dataclass(frozen=True, eq=False)
class CommOp:
    """A resolved reshard of one tensor. Pure data; run it with ``runtime.comm.execute``."""

    kind: str
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    reduce: tuple[ReduceBucket, ...]  # phase 1 (empty unless the source is partial)
    gathers: tuple[GatherGroup, ...]  # phase 2 collectives
    p2p: BsrPlan  # phase 2 local copies and point-to-point transfers (element counts x itemsize)
    src_annotation: Annotation | None = None
    dst_annotation: Annotation | None = None
    bandwidth: Bandwidth | object | None = None  # what steered sender choice; the adjoint reuses it

    @property
    def mid(self) -> Layout:
        """The layout after the reduce phase (the source itself when it is not partial)."""
        return self.src.reduced()

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device that takes part (holds the source or the destination)."""
        return tuple(sorted(set(self.src.devices) | set(self.dst.devices)))

    @property
    def p2p_only(self) -> bool:
        """True when the op is local copies plus point-to-point messages only (fusable by a schedule)."""
        return not self.reduce and not self.gathers

    def groups(self) -> list[tuple[int, ...]]:
        """Device groups (sorted ids, size >= 2) whose process groups the collectives need."""
        keys = {b.devices for b in self.reduce if len(b.devices) > 1} | {g.devices for g in self.gathers}
        return sorted(keys, key=lambda k: (len(k), k))

    def sends(self, device: int) -> list[Message]:
        """Phase-2 messages this device sends, one per peer (byte counts for the planning dtype)."""
        return self.p2p.sends(device)

    def recvs(self, device: int) -> list[Message]:
        return self.p2p.recvs(device)

    def local_copies(self, device: int) -> list[LocalCopy]:
        return self.p2p.local_copies(device)

    @cached_property
    def adjoint(self) -> CommOp:
        """The op of the backward pass: dst gradient layout -> src gradient layout."""
        dtype = self.p2p.tensors[0].dtype
        if self.src_annotation is not None and self.dst_annotation is not None:
            try:
                src, dst = self.dst_annotation.grad(), self.src_annotation.grad()
            except LayoutError:
                pass  # a gradient layout DistributedStates cannot express: resolve on layouts
            else:
                return resolve(src, dst, self.shape, dtype=dtype, bandwidth=self.bandwidth)
        if self.kind == "send_recv":
            return _send_recv(self.dst.reduced(), self.src.reduced(), dtype, None, None)
        return resolve_layouts(self.dst.reduced(), self.src.reduced(), dtype=dtype, bandwidth=self.bandwidth)

    def describe(self) -> str:
        kind = self.kind if self.kind != "composed" else " + ".join(self.parts)
        n = self.p2p.total_bytes
        extra = f", {len(self.p2p.transfers)} transfers / {n} bytes" if self.p2p.transfers else ""
        if self.reduce:
            extra += f", {len([b for b in self.reduce if len(b.devices) > 1])} reduce collectives"
        if self.gathers:
            extra += f", {len(self.gathers)} all-gathers"
        return f"{kind}{extra}"


def resolve(src: Annotation, dst: Annotation, shape: Sequence[int], *, dtype: DType = FLOAT32,
            bandwidth: Bandwidth | object | None = None, excluded: Collection[int] = ()) -> CommOp:
    """The cheapest op that turns a tensor of global ``shape`` laid out as ``src`` into ``dst``.

    ``dtype`` only sets byte counts; ``bandwidth`` (a Cluster or callable) and ``excluded`` steer BSR
    sender choice. Raises LayoutError for annotations that cannot lay out ``shape`` and HspmdError for
    reshards the runtime does not support (a partial destination other than identity or send/recv).
    """
    shape = tuple(int(s) for s in shape)
    s_lay, d_lay = src.layout(shape), dst.layout(shape)
    kind, parts = _classify(src, dst, s_lay, d_lay)
    return _build(kind, parts, s_lay, d_lay, dtype=dtype, bandwidth=bandwidth, excluded=excluded,
                  src_annotation=src, dst_annotation=dst)


def resolve_layouts(src: Layout, dst: Layout, *, dtype: DType = FLOAT32,
                    bandwidth: Bandwidth | object | None = None, excluded: Collection[int] = ()) -> CommOp:
    """``resolve`` on layouts (no annotations): kinds are named from the plan's structure only."""
    if src.shape != dst.shape:
        raise LayoutError(f"source shape {list(src.shape)} differs from destination shape {list(dst.shape)}")
    if dst.is_partial and src != dst:
        raise HspmdError("a partial destination layout is only reachable by identity or send/recv")
    return _build(None, (), src, dst, dtype=dtype, bandwidth=bandwidth, excluded=excluded)


# ---------------------------------------------------------------------------------------------------
# Classification by annotations


def _positions_equal(s: Layout, d: Layout) -> bool:
    """Every device holds the same region in both (partial/replica aside)."""
    return set(s.devices) == set(d.devices) and all(
        s.by_device[x].region == h.region for x, h in d.holdings)


def _in_place(s: Layout, d: Layout) -> bool:
    """Every destination device holds its destination region in the source already."""
    sb = s.by_device
    return all(x in sb and contains(sb[x].region, h.region) for x, h in d.holdings)


def _classify(src: Annotation, dst: Annotation, s: Layout, d: Layout) -> tuple[str | None, tuple[str, ...]]:
    if src == dst or s == d or s.same_data(d):
        return "identity", ()
    same_ds = (src.hdim == dst.hdim and src.ds.split == dst.ds.split and src.ds.states == dst.ds.states
               and [len(g) for g in src.dg.groups] == [len(g) for g in dst.dg.groups])
    if same_ds and src.dg != dst.dg:
        return "send_recv", ()  # a pipeline boundary: position i of member m -> position i of member m
    if dst.is_partial:
        raise HspmdError(f"cannot reshard {src} -> {dst}: a partial destination is only reachable by "
                         "identity or send/recv")
    if src.is_partial:
        top = src.hdim == PARTIAL
        if _in_place(s, d) and set(d.devices) <= set(s.devices):
            if _positions_equal(s, d):
                return ("split_all_reduce" if top else "all_reduce"), ()
            return ("split_reduce_scatter" if top else "reduce_scatter"), ()
        red = "split_all_reduce" if top else "all_reduce"
        return "composed", (red, "")  # transfer part named after planning
    if src.hsize == 1 and len(src.devices) == 1 and dst.hsize == 1 and src.devices[0] in dst.devices \
            and all(k >= 0 for k, _ in dst.ds.states[0].states) and len(dst.devices) > 1:
        return "scatter", ()
    return None, ()  # named from the plan: local_slice / all_gather / split_all_gather / bsr


def _transfer_kind(s: Layout, d: Layout, gathers: Sequence[GatherGroup], p2p: BsrPlan,
                   src: Annotation | None, dst: Annotation | None) -> str:
    if s == d or s.same_data(d):
        return "identity"
    if not p2p.transfers and not gathers:
        return "local_slice"
    if not p2p.transfers:
        if src is not None and dst is not None and src.hdim != dst.hdim and src.hsize > 1:
            return "split_all_gather"
        return "all_gather"
    return "bsr"


# ---------------------------------------------------------------------------------------------------
# Planning


def _build(kind: str | None, parts: tuple[str, ...], s: Layout, d: Layout, *, dtype: DType,
           bandwidth: Bandwidth | object | None, excluded: Collection[int],
           src_annotation: Annotation | None = None, dst_annotation: Annotation | None = None) -> CommOp:
    shape = s.shape
    if kind == "identity" or s == d or s.same_data(d):
        p2p = plan_layouts([PlannedTensor("t", shape, dtype, s, d)], bandwidth=bandwidth) if not s.is_partial \
            else BsrPlan((PlannedTensor("t", shape, dtype, s, d),), tuple(
                LocalCopy(x, 0, h.region) for x, h in d.holdings), ())
        return CommOp("identity", (), shape, s, d, (), (), p2p, src_annotation, dst_annotation, bandwidth)
    if kind == "send_recv":
        return _send_recv(s, d, dtype, src_annotation, dst_annotation)
    reduce: tuple[ReduceBucket, ...] = ()
    mid = s
    if s.is_partial:
        in_place = _in_place(s, d) and set(d.devices) <= set(s.devices)
        reduce = plan_reduce(s, d if in_place else None)
        mid = s.reduced()
        if kind is None:
            top = any(h.summand[0] for _, h in s.holdings)
            red = "split_all_reduce" if top else "all_reduce"
            if in_place:
                rs = any(b.needers is not None for b in reduce) or not _positions_equal(s, d)
                kind = red.replace("all_reduce", "reduce_scatter") if rs else red
            else:
                kind, parts = "composed", (red, "")
    gathers: tuple[GatherGroup, ...] = ()
    if kind not in ("scatter",) and not excluded:
        gathers = find_gathers(mid, d)
    covered = {x for g in gathers for x in g.devices}
    rest = Layout(shape, tuple((x, h) for x, h in d.holdings if x not in covered))
    p2p = plan_layouts([PlannedTensor("t", shape, dtype, mid, rest)], bandwidth=bandwidth, excluded=excluded)
    if kind == "composed":
        parts = (parts[0], _transfer_kind(mid, d, gathers, p2p, None, None))
    elif kind is None:
        kind = _transfer_kind(mid, d, gathers, p2p, src_annotation, dst_annotation)
    return CommOp(kind, parts, shape, s, d, reduce, gathers, p2p, src_annotation, dst_annotation, bandwidth)


def _send_recv(s: Layout, d: Layout, dtype: DType, src_annotation: Annotation | None,
               dst_annotation: Annotation | None) -> CommOp:
    """Position-wise copy: device at (member m, index i) of the source sends to (m, i) of the dest."""
    pos = {(h.member, h.index): x for x, h in s.holdings}
    forced = {}
    for x, h in d.holdings:
        sender = pos.get((h.member, h.index))
        if sender is None or s.by_device[sender].region != h.region or s.by_device[sender].summand != h.summand:
            raise HspmdError("send/recv needs the same layout on both sides")
        forced[(0, x)] = sender
    if s.is_partial:
        # Partial values move whole and unreduced: one transfer per position.
        shape = s.shape
        itemsize = dtype.itemsize
        local, transfers, needs = [], [], []
        for x, h in d.holdings:
            snd = forced[(0, x)]
            if snd == x:
                local.append(LocalCopy(x, 0, h.region))
            else:
                transfers.append(Transfer(snd, x, 0, h.region, volume(h.region) * itemsize))
                needs.append(Need(x, volume(h.region) * itemsize, (snd,)))
        p2p = BsrPlan((PlannedTensor("t", shape, dtype, s, d),), tuple(local),
                      tuple(sorted(transfers, key=lambda t: (t.src, t.dst))), tuple(needs))
    else:
        p2p = plan_layouts([PlannedTensor("t", s.shape, dtype, s, d)], forced=forced)
    return CommOp("send_recv", (), s.shape, s, d, (), (), p2p, src_annotation, dst_annotation)


def plan_reduce(s: Layout, d: Layout | None) -> tuple[ReduceBucket, ...]:
    """The reduce phase of a partial layout ``s``, in one global order.

    With ``d`` (in-place: every destination region is held by the same device in ``s``) only slices
    some destination device needs are reduced, and a group where each slice has one needer reduces
    by reduce-scatter. Without ``d`` every slice is all-reduced among its holders.
    """
    cuts = tensor_grid((s,) if d is None else (s, d), s.shape)
    by_cell: dict[Region, list[tuple[int, int]]] = defaultdict(list)  # cell -> [(cls, device)]
    for x, h in s.holdings:
        for cell in cells(h.region, cuts):
            by_cell[cell].append((h.cls, x))
    buckets: dict[tuple[int, tuple[int, ...]], list[tuple[Region, tuple[int, ...]]]] = defaultdict(list)
    dst_regions = d.by_device if d is not None else None
    for cell in sorted(by_cell):
        per_cls: dict[int, list[int]] = defaultdict(list)
        for c, x in by_cell[cell]:
            per_cls[c].append(x)
        for c, devs in per_cls.items():
            group = tuple(sorted(devs))
            if dst_regions is None:
                needers: tuple[int, ...] = group
            else:
                needers = tuple(x for x in group if x in dst_regions and contains(dst_regions[x].region, cell))
                if not needers:
                    continue
            buckets[(c, group)].append((cell, needers))
    out = []
    for (c, group), entries in buckets.items():
        regions = tuple(r for r, _ in entries)
        scatter = d is not None and len(group) > 1 and all(len(n) == 1 for _, n in entries)
        out.append(ReduceBucket(group, c, regions, tuple(n[0] for _, n in entries) if scatter else None))
    out.sort(key=lambda b: b.key)
    return tuple(out)


def find_gathers(s: Layout, d: Layout) -> tuple[GatherGroup, ...]:
    """Groups of destination devices with one common region whose source regions tile it exactly."""
    if s.is_partial:
        return ()
    by_region: dict[Region, list[int]] = defaultdict(list)
    for x, h in d.holdings:
        by_region[h.region].append(x)
    sb = s.by_device
    out: list[GatherGroup] = []
    for region, devs in by_region.items():
        found = _gather(region, devs, sb)
        if found is None:  # try each destination subgroup on its own
            found = []
            for m in sorted({d.by_device[x].member for x in devs}):
                found.extend(_gather(region, [x for x in devs if d.by_device[x].member == m], sb) or [])
        out.extend(found)
    out.sort(key=lambda g: (len(g.devices), g.devices))
    return tuple(out)


def _gather(region: Region, devs: list[int], sb: dict) -> list[GatherGroup] | None:
    if len(devs) < 2 or not all(x in sb for x in devs):
        return None
    out = []
    # Devices holding the same source part are replicas: with k replicas of every part, k
    # disjoint all-gathers (the j-th replica of each part) fill all of them.
    classes: dict[Region, list[int]] = defaultdict(list)
    for x in sorted(devs):
        classes[sb[x].region].append(x)
    parts = list(classes)
    k = len(classes[parts[0]])
    # Someone already holds it all (cheaper as local copies + P2P), or the parts do not tile it k times over.
    if (any(contains(p, region) for p in parts) or not all(contains(region, p) for p in parts)
            or sum(volume(p) for p in parts) != volume(region) or any(len(v) != k for v in classes.values())
            or any(intersect(parts[i], parts[j]) is not None for i in range(len(parts)) for j in range(i))):
        return None
    for j in range(k):
        members = sorted((classes[p][j], p) for p in parts)
        out.append(GatherGroup(tuple(x for x, _ in members), region, tuple(p for _, p in members)))
    return out

