"""Expert placement for mixture-of-experts models: per multi-device stage of a planned strategy, its routed
experts split over its TP group like the dense MLP, or expert parallelism (``Stage.experts``) with whole
experts placed by device speed, memory and expected load, whichever prices faster (planner/costmodel/moe.py
prices both; docs/planning.md, "Mixture of experts"; docs/moe.md).

The placement (``speed_placement``): longest-processing-time first (the heaviest expert to the device that
would finish it first, each device's per-row expert cost its own type's), every device holding at least one
expert (a replica of the expert whose holders take longest where there are fewer experts than devices), or
even placement where that prices lower; then a local search on the bottleneck device: move one of its
experts, or replicate one onto another device, while that lowers the stage's priced step share (the slowest
device's router and experts over the step's micro-batches, and the gradient all-reduce a replica adds). A
device takes no more experts than its memory holds beside the rest of its stage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.cost import GIB, CostModel, zero_degree
from planner.costmodel.moe import lpt_placement
from planner.costmodel.moe_gemms import expert_rows, holder_rows
from runtime.torchfree.spec.plan import Schedule, Stage, Strategy

Placement = dict[int, list[int]]
# Local-search moves per stage: a bound on the planner's time (each move prices E x n neighbours).
MAX_MOVES = 64


def even_placement(devices: Sequence[int], num_experts: int) -> Placement:
    """Experts dealt round-robin over the devices in order (expert e on device e mod n); with fewer experts
    than devices, device i holds expert i mod E: the placement blind to speed and load."""
    n = len(devices)
    out: Placement = {d: [] for d in devices}
    for e in range(max(n, num_experts)):
        out[devices[e % n]].append(e % num_experts)
    return {d: sorted(set(es)) for d, es in out.items()}


@dataclass(frozen=True)
class StageChoice:
    """Why a stage of a MoE model runs its experts as it does."""

    pipeline: int
    stage: int
    devices: tuple[int, ...]
    expert_parallel: bool
    why: str
    devices_detail: Mapping[int, Mapping[str, Any]]   # per device: experts, type, rows, load, expert_ms

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "stage": self.stage, "devices": list(self.devices),
                "experts": "expert-parallel" if self.expert_parallel else "tp-split", "why": self.why,
                "per_device": {str(d): dict(v) for d, v in self.devices_detail.items()}}


def _objective(cm: CostModel, st: Stage, placement: Placement, micro_batches: int) -> float:
    """A stage's step share under ``placement``: its MoE layers' price against the TP-split ones over the
    micro-batches, plus the replicas' gradient all-reduce (``stage_expert_sync``)."""
    ep_st = dataclasses.replace(st, experts=placement, op_costs=None)
    return micro_batches * cm.moe_layers_in(st.layers) * cm.ep_of(ep_st).time_s + cm.stage_expert_sync(ep_st)


def expert_caps(cm: CostModel, st: Stage, free_bytes: Mapping[int, float], zero: int, pipelines: int) -> dict[int, int]:
    """Per device of ``st``, the most experts it can hold: its TP-split share plus what its free memory
    (``free_bytes``, priced TP-split) holds of whole experts (``expert_bytes``); at least one."""
    moe = cm.model.moe
    n_moe = cm.moe_layers_in(st.layers)
    out = {}
    for d in st.devices:
        per_expert = cm.expert_bytes(d, n_moe, zero_degree(pipelines, zero))
        extra = math.floor(max(0.0, free_bytes.get(d, 0.0)) / per_expert) if per_expert > 0 else moe.num_experts
        out[d] = max(1, min(moe.num_experts, moe.num_experts // len(st.devices) + extra))
    return out


def speed_placement(cm: CostModel, st: Stage, caps: Mapping[int, int], micro_batches: int = 1) -> Placement:
    """Experts of ``st`` placed by device speed, memory (``caps``: most experts per device) and expected load
    (the module's rule): longest processing time first (``lpt_placement``), or even placement where that
    prices lower and fits ``caps``, then improved (``_improved``)."""
    devices = list(st.devices)
    rows = expert_rows(cm.model.moe, cm.micro_batch * cm.seq_len)
    place = lpt_placement(devices, rows, {d: cm.expert_row_s(d) for d in devices}, caps)
    return _improved(cm, st, place, caps, rows, micro_batches)


def _improved(cm: CostModel, st: Stage, place: Placement, caps: Mapping[int, int], rows: Sequence[float],
              micro_batches: int) -> Placement:
    """``place`` (or even placement, where that prices lower and fits ``caps``) after moving or replicating
    experts off the slowest device while that lowers the stage's step share: its slowest device's router and
    experts over the step's MoE layers and micro-batches, plus the replicas' gradient all-reduce
    (``device_expert_s``, ``replica_sync_s``: what ``ep_layer`` and the sync layout price; the all-to-alls,
    which a placement changes little, left out of the search). Where alike devices tie at the slowest, no one
    move helps: one move per tied device together (``_untied``)."""
    devices, n = list(st.devices), len(st.devices)
    layers = cm.moe_layers_in(st.layers)
    scale = micro_batches * layers

    def busy(p: Placement) -> dict[int, float]:
        got = holder_rows(devices, p, rows)
        return {d: sum(cm.device_expert_s(d, n, sum(got[d].values()), sum(1 for x in got[d].values() if x > 0)))
                for d in devices}

    def cost(p: Placement) -> float:
        holders: dict[int, list[int]] = {}
        for d in devices:
            for e in p[d]:
                holders.setdefault(e, []).append(d)
        return scale * max(busy(p).values()) + sum(cm.replica_sync_s(tuple(h), layers) for h in holders.values())

    best = cost(place)
    even = even_placement(devices, len(rows))
    if all(len(even[d]) <= caps[d] for d in devices) and cost(even) < best:
        best, place = cost(even), even
    for _ in range(MAX_MOVES):
        times = busy(place)
        slow = max(devices, key=lambda d: (times[d], -devices.index(d)))
        found = None
        for cand in _moves(place, slow, devices, caps):
            v = cost(cand)
            if v < best - 1e-9 * abs(best) and (found is None or v < found[0]):
                found = (v, cand)
        if found is None:   # devices tied at the slowest: no one move lowers the stage's time
            cand = _untied(place, times, devices, caps, busy)
            if cand is not None and cost(cand) < best - 1e-9 * abs(best):
                found = (cost(cand), cand)
        if found is None:
            break
        best, place = found
    return {d: sorted(es) for d, es in place.items()}


def _moves(place: Placement, slow: int, devices: Sequence[int], caps: Mapping[int, int]) -> list[Placement]:
    """Every placement one move from ``place`` off device ``slow``: one of its experts replicated onto, or
    moved to, another device with room for it."""
    out = []
    for e in place[slow]:
        for d in devices:
            if d == slow or e in place[d] or len(place[d]) >= caps[d]:
                continue
            out.append({**place, d: sorted(place[d] + [e])})   # replicate e onto d
            if len(place[slow]) > 1:   # move e to d
                out.append({**place, slow: [x for x in place[slow] if x != e], d: sorted(place[d] + [e])})
    return out


def _untied(place: Placement, times: Mapping[int, float], devices: Sequence[int], caps: Mapping[int, int],
            busy) -> Placement | None:
    """Where several devices tie at the slowest time (alike devices with alike experts), one move each: for
    every tied device in turn the move that most shortens it without making any other device as slow as the
    tie; None where some tied device has no such move."""
    top = max(times.values())
    tied = [d for d in devices if times[d] >= top * (1 - 1e-9)]
    if len(tied) < 2:
        return None
    cand = place
    for i, t in enumerate(tied):
        pending = set(tied[i + 1:])   # (still at the tie: shortened by their own moves next)
        best = None
        for m in _moves(cand, t, devices, caps):
            after = busy(m)
            if all(after[d] < top * (1 - 1e-9) for d in devices if d not in pending) and \
                    (best is None or after[t] < best[0]):
                best = (after[t], m)
        if best is None:
            return None
        cand = best[1]
    return cand


def choose_experts(cm: CostModel, strategy: Strategy, global_batch: int, schedule: Schedule, zero: int
                   ) -> tuple[Strategy, tuple[StageChoice, ...]]:
    """``strategy`` with each multi-device stage of a MoE model that holds a MoE layer run TP-split or expert
    parallel, its experts placed by device speed, memory and expected load (``speed_placement``), whichever
    the cost model prices faster over the step (its micro-batches' MoE layers and the replicas' gradient
    sync) with every device within its memory; and why, per stage. A dense model: unchanged."""
    if cm.model.moe is None:
        return strategy, ()
    num = cm.model.moe.num_experts
    base = dataclasses.replace(strategy, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(st, experts=None) for st in p.stages))
        for p in strategy.pipelines))
    est = cm.estimate(base, global_batch, schedule, zero)
    free = {d: cm.cluster.type_of(d).memory_gib * GIB - m.total for d, m in est.memory.items()}
    pipes, choices = [], []
    for pi, pipe in enumerate(base.pipelines):
        stages = []
        for k, st in enumerate(pipe.stages):
            if st.tp == 1 or cm.moe_layers_in(st.layers) == 0:
                stages.append(st)
                continue
            caps = expert_caps(cm, st, free, zero, len(strategy.pipelines))
            place = speed_placement(cm, st, caps, pipe.micro_batches)
            ep_st = dataclasses.replace(st, experts=place, op_costs=None)
            gain = -_objective(cm, st, place, pipe.micro_batches)   # seconds per step EP saves
            even = _objective(cm, st, even_placement(st.devices, num), pipe.micro_batches)
            a2a = ("the exchanges run inside the emulated blocks" if cm.sleeps(st.devices) else
                   f"all-to-alls {cm.ep_summary(ep_st)['all_to_all_ms']:.2f} ms per MoE layer and micro-batch")
            if gain > 0:
                why = (f"expert-parallel: {1e3 * gain:.1f} ms per step faster than TP-split experts, placed by "
                       f"device speed, memory and expected load ({1e3 * (even + gain):.1f} ms per step faster "
                       f"than even placement); {a2a}")
                stages.append(ep_st)
                choices.append(StageChoice(pi, k, st.devices, True, why, cm.ep_summary(ep_st)["devices"]))
                continue
            why = (f"TP-split: expert parallelism with the best placement found would cost {-1e3 * gain:.1f} ms "
                   f"more per step ({a2a})")
            stages.append(st)
            choices.append(StageChoice(pi, k, st.devices, False, why, {}))
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    out = dataclasses.replace(base, pipelines=tuple(pipes))
    if any(c.expert_parallel for c in choices):
        oom = set(cm.estimate(out, global_batch, schedule, zero).oom_devices)
        if oom - set(est.oom_devices):   # the caps are per device; a stage over them goes back TP-split
            back = {(c.pipeline, c.stage) for c in choices if c.expert_parallel and oom & set(c.devices)}
            out = dataclasses.replace(out, pipelines=tuple(
                dataclasses.replace(p, stages=tuple(dataclasses.replace(st, experts=None) if (pi, k) in back else st
                                                    for k, st in enumerate(p.stages)))
                for pi, p in enumerate(out.pipelines)))
            choices = [dataclasses.replace(c, expert_parallel=False, devices_detail={},
                                           why="TP-split: expert parallelism would run a device out of memory")
                       if (c.pipeline, c.stage) in back else c for c in choices]
    return out, tuple(choices)
