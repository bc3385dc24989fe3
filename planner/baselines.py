"""What a heterogeneity-aware plan is measured against, all scored by the same ``CostModel.estimate``.

* ``best_symmetric``: Megatron-style over the given devices: one TP degree, one pipeline depth and one
  data-parallel degree for all (``tp x pp x dp`` = every device), layers split evenly (when ``pp`` does
  not divide the layer count, the first stages take one more), equal micro-batches per pipeline,
  recompute everywhere or nowhere. Both Megatron rank orders are tried (TP fastest, then DP or then PP).
  TP groups must still be one device type on one node, so on a mixed cluster the symmetric plan can only
  use TP degrees that divide every node's count of each type.
* ``best_symmetric_subset``: the best symmetric plan over all devices of one type, the best type.
* ``lower_bound``: total work / total throughput: every device at its best TP degree's compute rate,
  no communication, no pipeline bubbles, no optimizer step (an LP, so that a type that is relatively
  better at the embedding or head may take all of it). No plan the cost model scores can beat it: a
  pipeline's time is at least ``m x`` its slowest stage, and a stage's time at least its compute.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulp

from planner.block_ranking import lazily_sorted
from planner.cost import CostModel, StrategyEstimate, zero_degree
from planner.layer_split import consecutive_ranges
from planner.schedule_choice import chunk_sizes
from planner.tp_groups import available, tp_degrees
from runtime.torchfree.solver import solve, var
from runtime.torchfree.spec.plan import Pipeline, Schedule, Stage, Strategy

EXACTLY_PRICED = 8   # symmetric plans priced by the list scheduler, the best by 1F1B's closed form


@dataclass(frozen=True)
class Baseline:
    name: str
    strategy: Strategy | None
    estimate: StrategyEstimate | None
    micro_batch: int | None
    description: str      # the configuration, or why there is none

    @property
    def step_time_s(self) -> float | None:
        return None if self.estimate is None else self.estimate.step_time_s


@dataclass(frozen=True)
class LowerBound:
    step_time_s: float
    micro_batch: int
    best_tp: Mapping[str, int]            # per type: the best TP degree for a decoder layer


def symmetric_strategies(cm: CostModel, devices: Sequence[int], global_batch: int, name: str = "symmetric",
                         ) -> list[tuple[str, Strategy]]:
    """Every symmetric strategy over exactly ``devices`` (description, strategy)."""
    cluster, model = cm.cluster, cm.model
    per_node = available(cluster, devices)
    blocks = list(per_node.values())
    n = len(devices)
    m_total = global_batch // cm.micro_batch
    out: list[tuple[str, Strategy]] = []
    for tp in tp_degrees(model, n):
        if any(len(b) % tp for b in blocks):
            continue
        groups = [tuple(b[i:i + tp]) for b in blocks for i in range(0, len(b), tp)]
        g = len(groups)
        for pp in range(1, min(g, model.num_layers) + 1):
            if g % pp:
                continue
            dp = g // pp
            if m_total % dp or m_total // dp < pp:
                continue
            mb = m_total // dp
            layers = consecutive_ranges(chunk_sizes(model.num_layers, pp))  # the first stages take the extras
            for order in ("tp-dp-pp", "tp-pp-dp"):
                if order == "tp-dp-pp" and (dp == 1 or pp == 1):
                    continue   # same layout as tp-pp-dp
                for rc in (False, True):
                    pipes = []
                    for j in range(dp):
                        idx = [k * dp + j if order == "tp-dp-pp" else j * pp + k for k in range(pp)]
                        pipes.append(Pipeline(mb, tuple(Stage(groups[i], layers[k], rc) for k, i in enumerate(idx))))
                    desc = f"tp{tp} pp{pp} dp{dp} ({order}{', recompute' if rc else ''})"
                    out.append((desc, Strategy(name=name, pipelines=tuple(pipes))))
    return out


def best_symmetric(cms: Mapping[int, CostModel], devices: Sequence[int], global_batch: int, zero: bool,
                   name: str = "symmetric", min_pipelines: int = 1, schedule: Schedule = "1f1b") -> Baseline:
    """The fastest symmetric strategy that fits memory, over every micro-batch size in ``cms``: every one
    ranked with 1F1B's closed form for its pipelines (``pipeline_proxy_time``), the best
    ``EXACTLY_PRICED`` of them priced exactly (the list scheduler's time)."""
    found: list[tuple[int, str, Strategy, list[float]]] = []
    tried = 0
    for b, cm in sorted(cms.items()):
        for desc, strategy in symmetric_strategies(cm, devices, global_batch, name):
            if len(strategy.pipelines) < min_pipelines:
                continue
            tried += 1
            if not _fits_quick(cm, strategy, zero):
                continue
            proxy = [cm.pipeline_proxy_time(strategy, 0)] * len(strategy.pipelines)   # the pipelines are alike
            found.append((b, desc, strategy, proxy))

    def proxy_estimate(i: int) -> float:
        b, _, strategy, proxy = found[i]
        est = cms[b].estimate(strategy, global_batch, schedule, zero, pipeline_s=proxy)
        return est.step_time_s if est.fits else math.inf

    # The best EXACTLY_PRICED by that estimate (ties in the order found), each estimated only when a lower
    # bound of it comes up: the pipelines, the clip and the fixed cost per iteration (the gradient sync,
    # the optimizer and the ZeRO-1 gathers only add to them, and their exact layout is the costly part).
    lower = [max(proxy) + cms[b].clip_time(strategy.devices) + cms[b].iteration_time(strategy)
             for b, _, strategy, proxy in found]
    ranked = [found[i] for _, i in itertools.islice(lazily_sorted(lower, proxy_estimate, range(len(found))),
                                                    EXACTLY_PRICED)]
    best: Baseline | None = None
    for b, desc, strategy, _ in ranked:
        strategy = cms[b].with_op_costs(strategy, schedule)   # as its plan will carry them (the runtime's op order)
        if best is not None:   # not worth its action lists if even its pipelines' lower bounds lose
            bounds = [cms[b].pipeline_step_bound(strategy, i, schedule) for i in range(len(strategy.pipelines))]
            if cms[b].estimate(strategy, global_batch, schedule, zero, pipeline_s=bounds).step_time_s \
                    >= best.estimate.step_time_s - 1e-12:  # type: ignore[union-attr]
                continue
        est = cms[b].estimate(strategy, global_batch, schedule, zero)
        if best is None or est.step_time_s < best.estimate.step_time_s - 1e-12:  # type: ignore[union-attr]
            best = Baseline(name, strategy, est, b, f"{desc}, micro-batch {b}")
    if best is None:
        why = "no symmetric layout fits memory" if tried else \
            "no symmetric layout exists (TP / pipeline / data-parallel degrees do not divide the devices and batch)"
        return Baseline(name, None, None, None, why)
    return best


def _fits_quick(cm: CostModel, strategy: Strategy, zero: int) -> bool:
    """Memory of the first pipeline only (all pipelines of a symmetric plan look alike)."""
    pipe = strategy.pipelines[0]
    zd = zero_degree(len(strategy.pipelines), zero)
    n = len(pipe.stages)
    for k, s in enumerate(pipe.stages):
        dtype = cm.cluster.device(s.devices[0]).type
        in_flight = min(n - k, pipe.micro_batches)
        mem = cm.stage_memory(dtype, s.tp, s.num_layers, k == 0, k == n - 1, s.recompute, in_flight, zd)
        if mem.total > cm.capacity_bytes(s.devices[0]):
            return False
    return True


def best_symmetric_subset(cms: Mapping[int, CostModel], devices: Sequence[int], global_batch: int, zero: bool,
                          min_pipelines: int = 1, schedule: Schedule = "1f1b") -> Baseline:
    """The best symmetric plan over all devices of one type (the best type)."""
    cluster = next(iter(cms.values())).cluster
    by_type: dict[str, list[int]] = {}
    for d in sorted(devices):
        by_type.setdefault(cluster.device(d).type, []).append(d)
    best: Baseline | None = None
    reasons = []
    for t, ids in sorted(by_type.items()):
        b = best_symmetric(cms, ids, global_batch, zero, "symmetric-subset", min_pipelines, schedule)
        if b.estimate is None:
            reasons.append(f"{t}: {b.description}")
            continue
        b = Baseline(b.name, b.strategy, b.estimate, b.micro_batch, f"{len(ids)} x {t}: {b.description}")
        if best is None or b.estimate.step_time_s < best.estimate.step_time_s - 1e-12:  # type: ignore[union-attr]
            best = b
    if best is None:
        return Baseline("symmetric-subset", None, None, None, "; ".join(reasons) or "no devices")
    return best


def work_seconds(cm: CostModel, device_type: str, max_tp: int) -> tuple[dict[str, float], dict[str, int]]:
    """Least device-seconds one micro-batch needs on this type, per unit of work (one decoder layer, the
    embedding, the final norm + head + loss), each at its best TP degree: ``tp x`` compute time, no
    communication, no recompute."""
    secs = {"layer": math.inf, "embedding": math.inf, "head": math.inf}
    tps = {"layer": 1, "embedding": 1, "head": 1}
    for tp in tp_degrees(cm.model, max_tp):
        parts = {"layer": cm.stage(device_type, tp, 1, False, False).compute_s,
                 "embedding": cm.stage(device_type, tp, 0, True, False).compute_s,
                 "head": cm.stage(device_type, tp, 0, False, True).compute_s}
        for k, v in parts.items():
            if tp * v < secs[k]:
                secs[k], tps[k] = tp * v, tp
    return secs, tps


def lower_bound(cms: Mapping[int, CostModel], devices: Sequence[int], global_batch: int) -> LowerBound:
    """Least time in which the devices could do a step's work at their best compute rates: an LP over how
    much of each unit of work (layers, embedding, head) each device type does, every device busy the whole
    time, no communication, no bubbles, no optimizer step. Minimized over the micro-batch sizes."""
    best: LowerBound | None = None
    for b, cm in sorted(cms.items()):
        per_node = available(cm.cluster, devices)
        max_tp: dict[str, int] = {}
        count: dict[str, int] = {}
        for (_, t), ids in per_node.items():
            max_tp[t] = max(max_tp.get(t, 0), len(ids))
            count[t] = count.get(t, 0) + len(ids)
        m = global_batch // b
        need = {"layer": m * cm.model.num_layers, "embedding": m, "head": m}
        secs, tps = {}, {}
        for t in sorted(count):
            secs[t], tps[t] = work_seconds(cm, t, max_tp[t])
        prob = pulp.LpProblem("lower_bound", pulp.LpMinimize)
        horizon = var(prob, "T", 0)
        x = {(t, k): var(prob, f"x_{i}_{k}", 0) for i, t in enumerate(sorted(count)) for k in need}
        for k, n in need.items():
            prob += pulp.lpSum(x[t, k] for t in count) == n
        for t in count:
            prob += pulp.lpSum(x[t, k] * secs[t][k] for k in need) <= count[t] * horizon
        prob += horizon
        res = solve(prob, 30.0)
        if not res.ok:
            raise RuntimeError(f"lower-bound LP failed: {res.status}")
        lb = LowerBound(float(horizon.value()), b, {t: tps[t]["layer"] for t in count})
        if best is None or lb.step_time_s < best.step_time_s:
            best = lb
    assert best is not None
    return best
