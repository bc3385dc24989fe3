"""Network prices, as the cost model and the simulator both read them: one set of rules, used by both.

Links, stage boundaries, collectives, the gradient sync and ZeRO-1's all-gathers (``NetworkCosts``), on
these rules:

* A transfer between two devices takes its link's time: measured curves by message size and direction
  where the profiles have them (runtime/torchfree/profiling/tables.py ``LinkCurves``; the slower of the sender's
  and the receiver's curve), else ``latency + bytes / bandwidth`` (``CostModel.link``).
* Transfers posted together share what they pass through (``concurrent_seconds``): each device's port
  as a sender and as a receiver, and across nodes the NICs they leave and enter by (a cluster's
  ``inter_node_bandwidth_gbs`` is one NIC's; ``nics_per_node`` NICs per node, used by its devices in
  turn: ``Cluster.nic_of``). Each shared resource carries
  the bytes of all its flows as one message over the slowest of their links (so one latency, as
  transfers posted at once pay it together); the group takes as long as its busiest resource.
* Collective rings that run at the same time over one NIC share it (``ring_sharers``): the gradient
  rings of the TP ranks of a stage (same stages, same buckets, disjoint devices) each send their bytes
  across it. Rings of other stages are not counted: their stages finish their backward at other times.
* A stage's sends and receives posted at one schedule tick (``tick_seconds``) overlap on full-duplex
  links (the longest of them) and serialise where the profile says its links do (their sum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from planner.costmodel.base import BOUNDARY_BYTES, memo
from runtime.torchfree.annotations.from_plan import Boundary, held_by, holding_stages, placements
from runtime.torchfree.annotations.states import Annotation
from runtime.torchfree.comm.gradsync import SliceGroups, SyncGroup, cut_buckets, reduce_slices, sync_groups
from runtime.torchfree.engine.specialize import resolve_boundary
from runtime.torchfree.models.params import ParamInfo, router_bias_names
from runtime.torchfree.profiling.profile import (
    DeviceProfile,
    LinkCurve,
    LinkFit,
)
from runtime.torchfree.profiling.tables import LinkCurves
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.plan import Stage, Strategy

# Bytes of one expert-load count (fp64: exact token counts).
LOAD_BYTES = 8


@dataclass(frozen=True)
class Flow:
    """``nbytes`` from device ``src`` to device ``dst``, posted together with the other flows of its group."""

    src: int
    dst: int
    nbytes: float


def curve_seconds(sender: LinkCurves | None, receiver: LinkCurves | None, nbytes: float) -> float | None:
    """One message over measured curves: the slower of the sender's send curve and the receiver's recv
    curve (either may be absent); None when neither side has one."""
    times = [c.seconds(nbytes) for c in ((sender.send if sender else None), (receiver.recv if receiver else None))
             if c is not None]
    return max(times) if times else None


def flow_resources(flow: Flow, node_of: Sequence[Hashable], nic_of: Sequence[Hashable]) -> list[tuple[str, Hashable]]:
    """What a flow passes through: its sender's and receiver's ports and, across nodes, both NICs."""
    out: list[tuple[str, Hashable]] = [("send", flow.src), ("recv", flow.dst)]
    if node_of[flow.src] != node_of[flow.dst]:
        out += [("nic-out", nic_of[flow.src]), ("nic-in", nic_of[flow.dst])]
    return out


def concurrent_seconds(flows: Sequence[Flow], seconds: Callable[[int, int, float], float],
                       node_of: Sequence[Hashable], nic_of: Sequence[Hashable] | None = None) -> float:
    """Time of a group of flows posted together: the busiest shared resource, which carries the summed
    bytes of its flows over the slowest of their links (``seconds(src, dst, nbytes)``). One flow alone:
    ``seconds`` of it. ``nic_of``: each device's NIC (default: one per node)."""
    nics = node_of if nic_of is None else nic_of
    by_resource: dict[tuple[str, Hashable], list[Flow]] = {}
    for f in flows:
        if f.nbytes <= 0 or f.src == f.dst:
            continue
        for r in flow_resources(f, node_of, nics):
            by_resource.setdefault(r, []).append(f)
    out = 0.0
    for group in by_resource.values():
        total = sum(f.nbytes for f in group)
        out = max(out, max(seconds(f.src, f.dst, total) for f in group))
    return out


def ring_sharers(groups: Sequence[tuple[tuple[int, ...], Hashable]], node_of: Sequence[Hashable],
                 nic_of: Sequence[Hashable] | None = None) -> list[int]:
    """For each collective group (its devices and a signature, equal for groups that run at the same
    time: the cost model's is the buckets and the stages the devices are in), how many rings cross the
    busiest NIC it uses at once: the cross-node groups of its signature whose devices are disjoint from
    its own (the TP ranks of one stage, each with its shard), itself included, counted at each NIC its
    members use (``nic_of``; default: one per node). 1 within a node."""
    nics = node_of if nic_of is None else nic_of
    spans = [len({node_of[d] for d in devs}) > 1 for devs, _ in groups]
    used = [frozenset(nics[d] for d in devs) for devs, _ in groups]
    # Cross-node groups by signature, in order: a group's peers are among its own signature's (a large
    # strategy has a thousand groups; comparing every pair of them dominated its pricing).
    alike: dict[Hashable, list[int]] = {}
    for j, (_, sig) in enumerate(groups):
        if spans[j]:
            alike.setdefault(sig, []).append(j)
    out = []
    for i, (devs, sig) in enumerate(groups):
        if not spans[i]:
            out.append(1)
            continue
        mine = set(devs)
        peers = [j for j in alike[sig] if j == i or mine.isdisjoint(groups[j][0])]
        out.append(max(sum(1 for j in peers if n in used[j]) for n in used[i]))
    return out


def _renumbered(experts: tuple[tuple[int, tuple[int, ...]], ...] | None, number: Mapping[int, int]
                ) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """A stage's expert placement with its devices renumbered (None: no placement)."""
    return None if experts is None else tuple((number[d], es) for d, es in experts)


def tick_seconds(seconds: Sequence[float], serialise: bool) -> float:
    """A schedule tick's transfers (each priced alone), posted together: the longest where the links are
    full duplex, their sum where sends and receives serialise."""
    if not seconds:
        return 0.0
    return sum(seconds) if serialise else max(seconds)


def allreduce_seconds(nbytes: float, n: int, latency_s: float, bandwidth_gbs: float) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` devices: ``latency + 2(n-1)/n * bytes / bandwidth``."""
    if n <= 1:
        return 0.0
    return latency_s + 2.0 * (n - 1) / n * nbytes / (bandwidth_gbs * 1e9)


def _collective_time(lines: Sequence[tuple[float, float]], sizes: Sequence[float]) -> float:
    """Seconds of one collective call per entry of ``sizes`` (bytes): each call takes the slowest of the
    (seconds, seconds per byte) ``lines`` (one per device type's fit)."""
    if len(lines) == 1:
        fixed, per_byte = lines[0]
        return fixed * len(sizes) + per_byte * sum(sizes)
    return sum(max(fixed + per_byte * x for fixed, per_byte in lines) for x in sizes)


def nearest_fit(fits: Mapping[int, LinkFit], n: int) -> tuple[float, float]:
    """(latency s, bandwidth GB/s) for a ring of ``n`` from the fit of the nearest measured group size
    (the smaller on a tie), its latency scaled by ring steps."""
    size = min(fits, key=lambda k: (abs(k - n), k))
    fit = fits[size]
    return fit.latency_s * (n - 1) / (size - 1), fit.bandwidth_gbs


class NetworkCosts:
    """Network prices of a ``CostModel`` (planner/cost.py)."""

    # -- communication -------------------------------------------------------------------------------

    @memo
    def link(self, a: int, b: int) -> LinkFit:
        """Latency and bandwidth between two devices: measured if both types measured this host's
        links, else the cluster's link bandwidth times the profiles' efficiency."""
        pa, pb = self.profiles[self._type_of[a]], self.profiles[self._type_of[b]]
        if self._node_of[a] == self._node_of[b] and pa.comm.p2p is not None and pb.comm.p2p is not None:
            return LinkFit(max(pa.comm.p2p.latency_s, pb.comm.p2p.latency_s),
                           min(pa.comm.p2p.bandwidth_gbs, pb.comm.p2p.bandwidth_gbs))
        eff = min(pa.comm.bandwidth_efficiency, pb.comm.bandwidth_efficiency)
        return LinkFit(max(pa.comm.p2p_latency_s, pb.comm.p2p_latency_s), self.cluster.bandwidth_gbs(a, b) * eff)

    def boundary_bytes(self) -> float:
        """Bytes of one micro-batch's hidden states [B, s, h] at a stage boundary (fp32)."""
        return float(self.micro_batch * self.seq_len * self.model.hidden_size * BOUNDARY_BYTES)

    @memo
    def transfer_time(self, a: int, b: int, nbytes: float) -> float:
        """One message of ``nbytes`` from device ``a`` to ``b`` on a link of its own: the profiles' measured
        curves by size and direction where they have them (``curve_seconds``), else ``link``'s latency +
        bytes / bandwidth."""
        cls = "intra" if self._node_of[a] == self._node_of[b] else "inter"
        curves = curve_seconds(self.profiles[self._type_of[a]].comm.links.get(cls),
                               self.profiles[self._type_of[b]].comm.links.get(cls), nbytes)
        if curves is not None:
            return curves
        lk = self.link(a, b)
        return lk.latency_s + nbytes / (lk.bandwidth_gbs * 1e9)

    @memo
    def boundary_flows(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[Flow, ...]:
        """What the runtime sends from stage ``src`` to stage ``dst`` for one micro-batch: the messages of
        the stage boundary's reshard as runtime/torchfree/engine/specialize.py ``resolve_boundary`` lays it out
        (equal TP degrees: every rank's full copy to its counterpart; otherwise the BSR's pieces)."""
        if len(src) == len(dst):
            # Equal TP degrees: the layout does not depend on the devices or links (rank i to rank i), so
            # it is resolved once per degree on stand-in devices and mapped back (the planner prices many).
            ids = (*src, *dst)
            return tuple(Flow(ids[f.src], ids[f.dst], f.nbytes) for f in self._boundary_pattern(len(src)))
        return self._resolved_flows(src, dst, self.cluster)

    @memo
    def _boundary_pattern(self, tp: int) -> tuple[Flow, ...]:
        return self._resolved_flows(tuple(range(tp)), tuple(range(tp, 2 * tp)), None)

    def _resolved_flows(self, src: tuple[int, ...], dst: tuple[int, ...], cluster: Cluster | None) -> tuple[Flow, ...]:
        shape = (self.micro_batch, self.seq_len, self.model.hidden_size)
        op = resolve_boundary(Boundary(0, 0, shape, Annotation.spmd(src), Annotation.spmd(dst), 0, 1),
                              cluster).forward  # type: ignore[arg-type]  # None: no links steer the layout
        return tuple(Flow(d, m.peer, float(m.nbytes)) for d in src for m in op.sends(d))

    def p2p_time(self, src: Sequence[int], dst: Sequence[int]) -> float:
        """One activation ([B, s, h] fp32) from stage ``src`` to ``dst``, one direction: the boundary's
        messages posted together, sharing their devices' ports and nodes' NICs (``concurrent_seconds``)."""
        return self._p2p_time(tuple(src), tuple(dst))

    @memo
    def _p2p_time(self, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        return concurrent_seconds(self.boundary_flows(src, dst), self.transfer_time, self._node_of, self._nic_of)

    def serialises(self, devices: Sequence[int]) -> bool:
        """Whether a transfer's send and receive directions share the link one after the other (the
        profile's ``comm.serialised_send_recv`` of any of ``devices``), else full duplex."""
        return any(self.profiles[self._type_of[d]].comm.serialised_send_recv for d in devices)

    def iteration_time(self, strategy: Strategy) -> float:
        """The measured fixed cost per iteration (launches, synchronisation, logging) of the step: the
        largest among the device types it uses (they wait for each other at the step's end)."""
        return max((self.profiles[self._type_of[d]].iteration_s for d in strategy.devices), default=0.0)

    def allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """One ring all-reduce among ``devices``: measured curves by size where the profiles have them for
        the group's link class (one node, or across nodes), else the measured fit for a same-type group on
        one node for this group size (or the nearest measured size), else per-step latency and the
        slowest link of the ring."""
        return self.allreduce_calls(tuple(devices), (nbytes,))

    def allreduce_calls(self, devices: tuple[int, ...], sizes: Sequence[float], sharers: int = 1) -> float:
        """One all-reduce per entry of ``sizes`` (bytes) among ``devices``, ``sharers`` rings crossing the
        busiest NIC at once (``ring_sharers``: each carries its bytes over it)."""
        curves = self._allreduce_curves(devices)
        if curves is None:
            return _collective_time(self._allreduce_lines(devices, sharers), sizes)
        n = len(devices)
        return sum(max(2.0 * (n - 1) / n * c.seconds(x * sharers) for c in curves) for x in sizes)

    @memo
    def _allreduce_curves(self, devices: tuple[int, ...]) -> tuple[LinkCurve, ...] | None:
        """The measured all-reduce curve of every type of the group for its link class (nearest measured
        group size); None unless every type has one."""
        if len(devices) <= 1:
            return None
        cls = "intra" if len({self._node_of[d] for d in devices}) == 1 else "inter"
        out = []
        for t in sorted({self._type_of[d] for d in devices}):
            by_size = self.profiles[t].comm.allreduce_curves.get(cls)
            if not by_size:
                return None
            out.append(by_size[min(by_size, key=lambda k: (abs(k - len(devices)), k))])
        return tuple(out)

    @memo
    def _allreduce_lines(self, devices: tuple[int, ...], sharers: int = 1) -> tuple[tuple[float, float], ...]:
        """``allreduce_time`` as lines (seconds, seconds per byte), the time being the slowest of them; a
        ring across nodes shares the NIC with ``sharers - 1`` others."""
        n = len(devices)
        if n <= 1:
            return ((0.0, 0.0),)
        measured = self._measured_fits(devices, lambda prof: prof.comm.allreduce)
        if measured is None:
            types = {self._type_of[d] for d in devices}
            bw = min(self.link(devices[i], devices[(i + 1) % n]).bandwidth_gbs for i in range(n))
            bw /= sharers if len({self._node_of[d] for d in devices}) > 1 else 1
            measured = [(max(self.profiles[t].comm.allreduce_latency_s for t in types) * 2 * (n - 1), bw)]
        return tuple((lat, 2.0 * (n - 1) / n / (bw * 1e9)) for lat, bw in measured)

    @memo
    def _tp_allreduce(self, device_type: str, tp: int, nbytes: float) -> float:
        """An all-reduce inside a TP group of one type on one node (same-node intra bandwidth)."""
        if tp <= 1:
            return 0.0
        prof = self.profiles[device_type]
        curves = prof.comm.allreduce_curves.get("intra")
        if curves:
            curve = curves[min(curves, key=lambda k: (abs(k - tp), k))]
            return 2.0 * (tp - 1) / tp * curve.seconds(nbytes)
        measured = prof.comm.allreduce
        if measured:
            return allreduce_seconds(nbytes, tp, *nearest_fit(measured, tp))
        dt = self.cluster.device_types[device_type]
        bw = dt.intra_node_bandwidth_gbs * prof.comm.bandwidth_efficiency
        return allreduce_seconds(nbytes, tp, prof.comm.allreduce_latency_s * 2 * (tp - 1), bw)

    @memo
    def _tp_allgather(self, device_type: str, tp: int, nbytes: float) -> float:
        """An all-gather of ``nbytes`` (the gathered size) inside a TP group: half an all-reduce's
        traffic, same per-step latency."""
        if tp <= 1:
            return 0.0
        full = self._tp_allreduce(device_type, tp, nbytes)
        base = self._tp_allreduce(device_type, tp, 0.0)
        return base / 2 + (full - base) / 2

    def tensors_per_stage(self, num_layers: int, first: bool, last: bool) -> int:
        """Parameter tensors a stage holds (one gradient all-reduce call each, per LCM slice)."""
        return (num_layers * len(self._layer_tensors) + (len(self._embed_tensors) if first else 0)
                + (len(self._head_tensors) if last else 0))

    def sync_plan(self, strategy: Strategy) -> list[SyncGroup]:
        """The cross-pipeline gradient sync exactly as the runtime lays it out (runtime/torchfree/comm/gradsync.py
        ``sync_groups``): its device groups in the order it issues them, each with its buckets.

        Every pipeline holds every layer (and the embedding and head), each at its own TP degree; where
        the degrees differ, the SplitAllReduce cuts each gradient into the LCM grid of their shards and
        every slice is all-reduced by the devices that hold it (one per pipeline), norms duplicated inside
        a TP group by the whole group (each replica counted once).
        """
        ids, groups = self._sync_shape(strategy)

        def back(devices: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(ids[i] for i in devices)

        return [SyncGroup(back(g.devices), tuple(dataclasses.replace(b, devices=back(b.devices)) for b in g.buckets))
                for g in groups]

    def _sync_shape(self, strategy: Strategy) -> tuple[tuple[int, ...], tuple[SyncGroup, ...]]:
        """``sync_plan`` before its devices are mapped back: the strategy's device ids in id order and the
        layout of the renumbered plan (devices 0, 1, ...).

        The layout only compares and sorts device ids, so plans of one shape on other devices share it:
        computed once per pattern and mapped back. The search prices many placements of few shapes, and
        pricing needs only each group's devices mapped back (``_group_times``), not every bucket's."""
        ids = tuple(sorted(strategy.devices))
        if len(strategy.pipelines) <= 1 and not any(st.expert_parallel for p in strategy.pipelines for st in p.stages):
            return ids, ()  # nothing to sync (an expert-parallel stage sums its routers' and replicas' gradients)
        number = {d: i for i, d in enumerate(ids)}
        pattern = tuple(tuple((tuple(number[d] for d in st.devices), st.layers, _renumbered(st.experts, number))
                              for st in p.stages) for p in strategy.pipelines)
        cache = self.__dict__.setdefault("_sync_plans", {})
        if pattern not in cache:
            renumbered = dataclasses.replace(strategy, pipelines=tuple(
                dataclasses.replace(p, stages=tuple(dataclasses.replace(st, devices=devices, experts=experts)
                                                    for st, (devices, _, experts) in zip(p.stages, shape)))
                for p, shape in zip(strategy.pipelines, pattern)))
            cache[pattern] = tuple(sync_groups(cut_buckets([self._grad_slices(info, stages)
                                                            for info, stages in placements(renumbered, self.model)])))
        return ids, cache[pattern]

    def _grad_slices(self, info: ParamInfo, stages: tuple[Stage, ...]) -> SliceGroups:
        """One gradient's all-reduce slices where ``stages`` hold it: the same for every tensor of its shape
        and split placed on the same devices, in any plan (so computed once per cost model).

        The runtime's layout only compares and sorts device ids, so it is computed once per pattern (the
        devices renumbered 0, 1, ... in their order) and mapped back: plans that place a tensor on other
        devices the same way share it."""
        memo = self.__dict__.setdefault("_slices", {})
        # Where a stage places whole experts, a routed expert's and the router's gradients follow the placement.
        routed = info.expert is not None or info.router
        experts = tuple(s.experts if routed else None for s in stages)
        key = (info.shape, info.tp_dim, info.expert, info.router, tuple(s.devices for s in stages), experts)
        if key not in memo:
            ids = sorted({d for s in stages for d in s.devices})
            number = {d: i for i, d in enumerate(ids)}
            placed = tuple(tuple(number[d] for d in s.devices) for s in stages)
            held = tuple(_renumbered(e, number) for e in experts)
            pattern_key = (info.shape, info.tp_dim, info.expert, info.router, placed, held)
            by_pattern = self.__dict__.setdefault("_slice_patterns", {})
            if pattern_key not in by_pattern:
                renumbered = [Stage(devices, s.layers, experts=e) for devices, s, e in zip(placed, stages, held)]
                by_pattern[pattern_key] = reduce_slices(held_by(renumbered, info).grad.layout(info.shape))
            memo[key] = tuple(((tuple(ids[i] for i in group), cls), regions)
                              for (group, cls), regions in by_pattern[pattern_key])
        return memo[key]

    def sync_group_time(self, group: SyncGroup, sharers: int = 1) -> float:
        """One fused all-reduce of a sync group (a call per bucket, as the runtime cuts them), plus packing
        its gradient slices into the buckets and back (measured profiles; the slowest device's);
        ``sharers`` rings crossing its busiest NIC at once (``sync_times``)."""
        return self._sync_seconds(group.devices, group, sharers)

    def _sync_seconds(self, devices: tuple[int, ...], group: SyncGroup, sharers: int = 1) -> float:
        """``sync_group_time`` of ``group``'s buckets all-reduced among ``devices`` (the bucket sizes do not
        depend on which devices hold them: ``_group_times`` prices a renumbered layout so)."""
        grad_bytes = max(self.profiles[self._type_of[d]].memory.grad_bytes for d in devices)
        calls = self.allreduce_calls(devices, [n * grad_bytes for n in group.bucket_numel], sharers)
        pack = 0.0
        for d in devices:
            fit = self.profiles[self._type_of[d]].sync_pack
            pack = max(pack, fit.seconds_per_param * group.numel + fit.seconds_per_tensor * group.slices
                       + fit.fixed_s * len(group.buckets))
        return calls + pack

    def sync_times(self, strategy: Strategy) -> list[float]:
        """Each group of ``sync_plan``'s time, the rings that cross one NIC at the same time sharing it
        (``ring_sharers``: the TP ranks' rings of a stage)."""
        return self._priced_groups(strategy, self.sync_plan(strategy))

    def _priced_groups(self, strategy: Strategy, plan: Sequence[SyncGroup]) -> list[float]:
        return [self.sync_group_time(g, k)
                for g, k in zip(plan, self._ring_sharers(strategy, [g.devices for g in plan], plan))]

    def _ring_sharers(self, strategy: Strategy, devices: Sequence[tuple[int, ...]],
                      plan: Sequence[SyncGroup]) -> list[int]:
        """Rings run at once where they are the TP ranks' of the same stages (their stages finish their
        backward together) with the same buckets: the signature ``ring_sharers`` compares."""
        stage_of = {d: (pi, k) for pi, p in enumerate(strategy.pipelines) for k, st in enumerate(p.stages)
                    for d in st.devices}
        return ring_sharers([(devs, (tuple(g.bucket_numel), tuple(sorted({stage_of[d] for d in devs}))))
                             for devs, g in zip(devices, plan)], self._node_of, self._nic_of)

    def grad_sync_times(self, strategy: Strategy) -> dict[int, float]:
        """Seconds each device spends in the cross-pipeline gradient sync (its groups one after the
        other, ignoring waits for slower peers; the simulator plays those out)."""
        return self._group_times(strategy, self._sync_seconds)

    def grad_sync_time(self, strategy: Strategy) -> float:
        """The gradient sync's span as the runtime runs it: its groups in one global order, each device joining
        them one after the other and a group's all-reduce starting once its last member has joined (a
        rendezvous, as the simulator plays it), every device ready at once (the estimate adds the span after
        the slowest pipeline). Where the pipelines split the layers alike this is the busiest device's sum
        (``grad_sync_times``); where they do not, a group waits on peers held up by groups of their own, and
        the span can be several times that sum (a 1024-GPU mix of four layouts: 4.3 s against 0.45 s)."""
        return self._group_span(strategy, self._sync_seconds)

    def allgather_time(self, devices: Sequence[int], nbytes: float) -> float:
        """One all-gather of ``nbytes`` (the gathered size) among ``devices``: the measured fit for a
        same-type group on one node when the profiles have one (nearest measured group size, latency scaled
        by ring steps; on gloo an all-gather costs about as much as an all-reduce of the same bytes, not
        half), else a ring's ``n-1`` steps where an all-reduce takes ``2(n-1)``: half its latency and
        traffic."""
        return _collective_time(self._allgather_lines(tuple(devices)), (nbytes,))

    @memo
    def _allgather_lines(self, devices: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        n = len(devices)
        if n <= 1:
            return ((0.0, 0.0),)
        measured = self._measured_fits(devices, lambda prof: prof.comm.allgather)
        if measured is None:
            return tuple((fixed / 2.0, per_byte / 2.0) for fixed, per_byte in self._allreduce_lines(devices))
        return tuple((lat, (n - 1) / n / (bw * 1e9)) for lat, bw in measured)

    def _measured_fits(self, devices: Sequence[int],
                       fits_of: Callable[[DeviceProfile], Mapping[int, LinkFit] | None]
                       ) -> list[tuple[float, float]] | None:
        """(latency s, bandwidth GB/s) of a collective among ``devices`` from measured fits (measured among
        one node's processes): for each type involved the nearest measured group size (``nearest_fit``);
        None when the group spans nodes or some type has no fits."""
        if len({self._node_of[d] for d in devices}) != 1:
            return None
        measured = [fits_of(self.profiles[t]) for t in sorted({self._type_of[d] for d in devices})]
        if not all(measured):
            return None
        return [nearest_fit(fits, len(devices)) for fits in measured]  # type: ignore[arg-type]

    def zero_gather_time(self, group: SyncGroup) -> float:
        """ZeRO-1's parameter all-gather of one sync group after the optimizer step (runtime/torchfree/engine/zero.py):
        each device sends its updated chunk of every slice the group holds, one all-gather per gradient-sync
        bucket (the parameters, ``param_bytes`` each)."""
        return self._gather_seconds(group.devices, group)

    def _gather_seconds(self, devices: tuple[int, ...], group: SyncGroup, sharers: int = 1) -> float:
        """``zero_gather_time`` of ``group``'s buckets among ``devices`` (as ``_sync_seconds``; NIC sharing is
        not priced for the gathers: ``sharers`` is ignored)."""
        if len(devices) <= 1:
            return 0.0
        param_bytes = max(self.profiles[self._type_of[d]].memory.param_bytes for d in devices)
        return _collective_time(self._allgather_lines(devices), [n * param_bytes for n in group.bucket_numel])

    def zero_gather_times(self, strategy: Strategy, zero: bool = True) -> dict[int, float]:
        """Seconds each device spends in ZeRO-1's all-gathers (its groups one after the other); all zero
        without ZeRO or with one pipeline (nothing is sharded then)."""
        if not zero:
            return {d: 0.0 for d in strategy.devices}
        return self._group_times(strategy, self._gather_seconds)

    def _group_times(self, strategy: Strategy, price: Callable[[tuple[int, ...], SyncGroup, int], float]
                     ) -> dict[int, float]:
        """Each device's sum of ``price(devices, group, sharers)`` over the sync groups it is in (every device of the
        strategy), priced on the renumbered layout with only the groups' devices mapped back. Cached per
        strategy (the estimate asks for the sync and the ZeRO-1 gathers of one plan)."""
        cache = self.__dict__.setdefault("_group_time_cache", {})
        key = (strategy.pipelines, price.__name__)
        hit = cache.get(key)
        if hit is not None:
            return dict(hit)
        ids, groups = self._sync_shape(strategy)
        mapped = [tuple(ids[i] for i in g.devices) for g in groups]
        out = {d: 0.0 for d in strategy.devices}
        for devices, g, k in zip(mapped, groups, self._ring_sharers(strategy, mapped, groups)):
            t = price(devices, g, k)
            for d in devices:
                out[d] += t
        if len(cache) > 4096:   # bounded: the search prices many plans once each
            cache.clear()
        cache[key] = dict(out)
        return out

    def _group_span(self, strategy: Strategy, price: Callable[[tuple[int, ...], SyncGroup, int], float]) -> float:
        """The makespan of the sync groups in their global order under ``price``, each a rendezvous of its
        members (``grad_sync_time``); cached per strategy as ``_group_times``."""
        cache = self.__dict__.setdefault("_group_span_cache", {})
        key = (strategy.pipelines, price.__name__)
        hit = cache.get(key)
        if hit is not None:
            return hit
        ids, groups = self._sync_shape(strategy)
        mapped = [tuple(ids[i] for i in g.devices) for g in groups]
        ready: dict[int, float] = {}
        for devices, g, k in zip(mapped, groups, self._ring_sharers(strategy, mapped, groups)):
            end = max(ready.get(d, 0.0) for d in devices) + price(devices, g, k)
            ready.update(dict.fromkeys(devices, end))
        if len(cache) > 4096:   # bounded: the search prices many plans once each
            cache.clear()
        span = cache[key] = max(ready.values(), default=0.0)
        return span

    def load_sync_plan(self, strategy: Strategy) -> list[SyncGroup]:
        """A MoE model's per-step all-reduce of its routers' expert loads (runtime/engine/balancing.py): each
        router's gradient layout at [num_experts], laid out as the gradient sync lays out gradients, issued
        after it. Empty for a dense model."""
        moe = self.model.moe
        if moe is None:
            return []
        cache = self.__dict__.setdefault("_load_plans", {})
        if strategy.pipelines not in cache:
            if len(cache) > 4096:   # bounded: the search prices many plans once each
                cache.clear()
            slices = [self._grad_slices(dataclasses.replace(info, shape=(moe.num_experts,)),
                                        tuple(holding_stages(strategy, info)))
                      for info in router_bias_names(self.model).values()]
            cache[strategy.pipelines] = list(sync_groups(cut_buckets(slices)))
        return cache[strategy.pipelines]

    def load_group_time(self, group: SyncGroup) -> float:
        """One group of ``load_sync_plan``: its buckets of fp64 counts all-reduced among its devices."""
        return self.allreduce_calls(group.devices, [n * LOAD_BYTES for n in group.bucket_numel])

    def load_sync_time(self, strategy: Strategy) -> float:
        """The span of ``load_sync_plan``'s groups in their order, each a rendezvous of its members."""
        ready: dict[int, float] = {}
        for g in self.load_sync_plan(strategy):
            end = max(ready.get(d, 0.0) for d in g.devices) + self.load_group_time(g)
            ready.update(dict.fromkeys(g.devices, end))
        return max(ready.values(), default=0.0)

    def clip_time(self, devices: Sequence[int]) -> float:
        """The per-step all-reduce of loss and gradient norm (for clipping) over every device."""
        if not self.step_allreduce or len(devices) <= 1:
            return 0.0
        return self.allreduce_time(list(devices), 8.0)
