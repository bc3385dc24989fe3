"""What the search chooses among, on one cost model: TP groups per type choice, the pipeline counts, shares
and placements a block may take, each pipeline template's fast layer split under each schedule, and the
transfer and ring prices of the devices (cached by node where links depend on nodes only). Everything here
is a pure function of the cost model, the settings and the devices; ``SHARED_CACHES`` are shared between
the searches of one micro-batch size (planner/search.py ``search``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from planner.cost import CostModel, memo, zero_degree
from planner.layer_split import LayerSplit, SlotCost, slot_costs, split_fast
from planner.pipelines import (
    PLACEMENTS,
    PipelineLayout,
    Template,
    distributions,
    share_out,
)
from planner.schedule_choice import (
    AUTO,
    ScheduleChoice,
    fill_factor,
    rounded_shares,
    schedule_choices,
)
from planner.search_types import (
    PlanSettings,
    Shares,
    TypeChoice,
)
from planner.tp_groups import GroupKind, TPGroup, form_groups, groups_by_kind
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec

SMALL_BLOCK_GROUPS = 12  # blocks of at most this many TP groups also try uneven shares (every distribution)
DISTRIBUTIONS_LIMIT = 150  # ... unless there are more ways than this (then: even shares only)
UNEVEN_PIPELINES = 3       # ... over at most this many pipelines


class SearchSpace:
    """The search's view of one cost model, its settings and devices (one micro-batch size), and the schedules
    it searches."""

    # The caches whose values depend only on the cost model, the settings and the devices (not on the schedules
    # searched): the searches ``search`` runs per micro-batch size share them. (``memo`` keeps a method's cache
    # under ``_memo_<name>``.)
    SHARED_CACHES = ("_memo_layer_s", "_memo_groups", "_memo_fast_split", "_memo_split_of", "_memo_fill",
                     "_memo_segment_grad_bytes", "sync_cache", "p2p_cache")

    def __init__(self, cm: CostModel, settings: PlanSettings, devices: Sequence[int],
                 choices: tuple[ScheduleChoice, ...] | None = None) -> None:
        """``choices``: under "auto", search as if these schedules were fixed (planner/search.py
        ``auto_families``), every pipeline naming its own."""
        self.cm = cm
        self.model: ModelSpec = cm.model
        self.cluster: Cluster = cm.cluster
        self.settings = settings
        self.devices = tuple(sorted(devices))
        self.micro_batches = settings.global_batch // cm.micro_batch
        # Under "auto" the search ranks pipelines as ZB-H1 runs them (1F1B's memory bound and splits, its
        # fill), and the best plans try every schedule per pipeline class by its exact price
        # (``Finalizer.best_schedules``); a fixed schedule is searched as such.
        auto = settings.schedule == AUTO
        self.choices = (ScheduleChoice("zb-h1"),) if auto else schedule_choices(settings.schedule)
        self.variant_choices = schedule_choices(AUTO) if auto else ()
        if auto and choices is not None:
            self.choices = choices
        self.sync_cache: dict[tuple, float] = {}
        self.p2p_cache: dict[tuple[int, int], tuple[float, float]] = {}
        names = {n.name: i for i, n in enumerate(self.cluster.nodes)}
        self.node_idx = [names[d.node] for d in self.cluster.devices]
        self.device_links = any(o.devices is not None for o in self.cluster.bandwidth_overrides)
        self.clip_s = cm.clip_time(self.devices)

    def share_caches(self, shared: dict[str, dict]) -> None:
        """Use (and fill) the caches in ``shared`` (``SHARED_CACHES``: another search's on the same cost model,
        settings and devices)."""
        for name in self.SHARED_CACHES:
            self.__dict__[name] = shared.setdefault(name, {})

    @memo
    def layer_s(self, kind: GroupKind) -> float:
        return self.cm.stage(kind.device_type, kind.tp, 1, False, False).time_s

    def memory_gib(self, kind: GroupKind) -> float:
        return self.cluster.device_types[kind.device_type].memory_gib

    @memo
    def groups(self, choice: tuple[TypeChoice, ...]) -> dict[GroupKind, list[TPGroup]]:
        out: dict[GroupKind, list[TPGroup]] = {}
        for c in choice:
            gs = form_groups(self.cluster, self.model, {c.device_type: c.tp}, self.devices, c.remainder)
            for k, v in groups_by_kind(gs).items():
                out.setdefault(k, []).extend(v)
        return out

    def zero_degree(self, pipelines: int) -> int:
        return zero_degree(pipelines, self.settings.zero)

    def slots(self, template: Template, zero_degree: int, choice: ScheduleChoice, partial: bool = True
              ) -> tuple[SlotCost, ...]:
        """``partial=False``: without partial recompute (whole-stage recompute only)."""
        slots = slot_costs(self.cm, template, zero_degree=zero_degree, recompute=self.settings.allow_recompute,
                           memory_margin=self.settings.memory_margin, schedule=choice)
        if partial and self.settings.partial_recompute:
            return slots
        return tuple(dataclasses.replace(s, partial=()) for s in slots)

    @memo
    def fast_split(self, template: Template, zero_degree: int, choice: ScheduleChoice, partial: bool = True
                   ) -> LayerSplit | None:
        """The min-max split under ``choice``'s memory (None if none fits, or a stage gets fewer layers
        than chunks)."""
        sp = self.split_of(self.slots(template, zero_degree, choice, partial))
        return None if sp is None or min(sp.layers) < choice.chunks else sp

    @memo
    def split_of(self, slots: tuple[SlotCost, ...]) -> LayerSplit | None:
        """``split_fast`` per distinct slots: schedules of one memory bound and placement (1F1B and ZB-H1)
        share their splits."""
        return split_fast(slots, self.model.num_layers)

    @memo
    def fill(self, template: Template, choice: ScheduleChoice) -> tuple[float, float]:
        """``fill_factor`` of ``choice`` on this template (its first kind's op shares)."""
        kind = template[0]
        shares = rounded_shares(self.cm.chunk_cost(kind.device_type, kind.tp, 1, False, False))
        return fill_factor(choice, len(template), shares)

    def class_schedule(self, template: Template, boundary: float, zero_degree: int, micro_batches: int,
                       choices: Sequence[ScheduleChoice] | None = None
                       ) -> tuple[ScheduleChoice, LayerSplit, float, float] | None:
        """The schedule (of ``choices``, default those the settings allow) whose fast split runs
        ``micro_batches`` fastest by ``LayerSplit.pipeline_s`` with its fill factor; None if none fits."""
        best = None
        for choice in self.choices if choices is None else choices:
            sp = self.fast_split(template, zero_degree, choice)
            if sp is None:
                continue
            fill, hops = self.fill(template, choice)
            t = sp.pipeline_s(micro_batches, hops * boundary, fill)
            if best is None or t < best[0] - 1e-12:
                best = (t, choice, sp, fill, hops)
        return None if best is None else best[1:]

    def hop_s(self, a: int, b: int) -> tuple[float, float]:
        """One boundary each way between stages led by devices ``a`` and ``b`` (``p2p_time`` prices a
        transfer by the link between the stages' first devices), cached by their nodes (or devices, where
        the cluster overrides single devices' links)."""
        key = (a, b) if self.device_links else (self.node_idx[a], self.node_idx[b])
        hit = self.p2p_cache.get(key)
        if hit is None:
            hit = self.p2p_cache[key] = (self.cm.p2p_time((a,), (b,)), self.cm.p2p_time((b,), (a,)))
        return hit

    def pair_s(self, a: int, b: int) -> float:
        """One boundary both ways (``hop_s``' sum)."""
        there, back = self.hop_s(a, b)
        return there + back

    def boundary_s(self, layout: PipelineLayout) -> float:
        gs = layout.groups
        return sum(self.pair_s(a.devices[0], b.devices[0]) for a, b in zip(gs, gs[1:]))

    def hops(self, layout: PipelineLayout) -> tuple[tuple[float, float], ...]:
        """Per stage boundary of ``layout`` its transfer time each way: what its exact time and bounds read
        of its devices besides their types (``CostModel.pipeline_costs``), so the key under which pipelines
        on other devices of alike nodes share those prices. (Not the boundaries' sum: two layouts whose
        hops differ but sum alike run differently.)"""
        gs = layout.groups
        return tuple(self.hop_s(a.devices[0], b.devices[0]) for a, b in zip(gs, gs[1:]))

    @memo
    def segment_grad_bytes(self, kind: GroupKind, layers: int, first: bool, last: bool) -> float:
        """Gradient bytes of ``layers`` decoder layers on ``kind`` (with the embedding where the segment
        starts at layer 0, the head where it ends at the last layer: the stage holding them holds those)."""
        params = layers * self.cm.layer(kind.device_type, kind.tp).params
        if first:
            params += self.cm.extras(kind.device_type, kind.tp, True, False).params
        if last:
            params += self.cm.extras(kind.device_type, kind.tp, False, True).params
        return params * self.cm.profiles[kind.device_type].memory.grad_bytes

    def ring_key(self, ring: tuple[int, ...]) -> tuple[int, ...]:
        return ring if self.device_links else tuple(self.node_idx[d] for d in ring)

    def ring_time(self, ring: tuple[int, ...], nbytes: float) -> float:
        """``allreduce_time`` of a ring, cached by the ring's nodes (a node holds one device type, and
        links depend on nodes only, unless the cluster overrides single devices' bandwidth)."""
        return self.keyed_ring_time(self.ring_key(ring), ring, nbytes)

    def keyed_ring_time(self, key: tuple[int, ...], ring: tuple[int, ...], nbytes: float) -> float:
        hit = self.sync_cache.get((key, nbytes))
        if hit is None:
            hit = self.sync_cache[(key, nbytes)] = self.cm.allreduce_time(list(ring), nbytes)
        return hit

    @staticmethod
    def share_options(groups: Mapping[GroupKind, Sequence[TPGroup]], pipelines: int) -> list[Shares | None]:
        """How a block's groups may be shared out to its pipelines: as evenly as possible (None), and for a
        small block of several kinds over 2-3 pipelines every other way (``distributions``), so that
        pipelines may differ as much as the devices do."""
        counts = {k: len(v) for k, v in groups.items() if v}
        out: list[Shares | None] = [None]
        if len(counts) < 2 or sum(counts.values()) > SMALL_BLOCK_GROUPS or not 2 <= pipelines <= UNEVEN_PIPELINES:
            return out
        even = share_out(counts, pipelines)
        canon = None if even is None else sorted(tuple(sorted(sh.items())) for sh in even)
        for way in distributions(counts, pipelines, DISTRIBUTIONS_LIMIT) or []:
            if sorted(tuple(sorted(sh.items())) for sh in way) != canon:
                out.append(tuple(way))
        return out

    @staticmethod
    def placements(pipelines: int) -> tuple[str, ...]:
        """One pipeline has no gradient-sync peers to place next to each other."""
        return PLACEMENTS if pipelines > 1 else PLACEMENTS[:1]

    def pipeline_counts(self, groups: int) -> list[int]:
        """Pipeline counts worth trying for a block of ``groups`` TP groups: every stage count's nearest
        pipeline counts, and the divisors of ``groups`` (even pipelines)."""
        n_layers = self.model.num_layers
        top = min(groups, self.micro_batches)
        out = set()
        for s in range(1, n_layers + 1):
            for p in (groups // s, -(-groups // s)):
                if 1 <= p <= top:
                    out.add(p)
        out.update(p for p in range(1, top + 1) if groups % p == 0)
        return sorted(out)
