"""The network as the cost model and the simulator both price it: one set of rules, used by both.

* A transfer between two devices takes its link's time: measured curves by message size and direction
  where the profiles have them (runtime/profiling/tables.py ``LinkCurves``; the slower of the sender's
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

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from runtime.profiling.tables import LinkCurves


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


def tick_seconds(seconds: Sequence[float], serialise: bool) -> float:
    """A schedule tick's transfers (each priced alone), posted together: the longest where the links are
    full duplex, their sum where sends and receives serialise."""
    if not seconds:
        return 0.0
    return sum(seconds) if serialise else max(seconds)

