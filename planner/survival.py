"""The failure story of a plan: which single-device and which whole-node losses its state survives in memory.

A loss is survivable in memory when every piece of the training state (each parameter slice, and under
ZeRO-1 each chunk of the AdamW moments) still has a copy on a surviving device: the coordinator's own check
(``runtime.torchfree.elastic.state.lost_state``), asked ahead for each device and each node the plan uses. Then
``hspmd train --elastic`` (or ``hspmd replan``) switches to a plan for the survivors without a checkpoint;
otherwise the job restarts from its last checkpoint (``hspmd replan --restart`` writes the plan to restart
with). Whether the survivors' memory holds a new plan is the planner's answer at that point, not this one's.

``prefer_node_survivable``: ``hspmd plan --elastic`` takes, among the near-best candidates within a tolerance of
the fastest, the one that survives the most whole-node losses (a layout whose replicas span nodes), since
a node is what usually fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.api import PlanResult, explain_idle
from planner.cost import CostModel
from planner.search import Candidate
from runtime.torchfree.elastic.state import lost_state
from runtime.torchfree.profiling.profile import DeviceProfile
from runtime.torchfree.spec.catalog import PlanContext
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Plan, Stage, Strategy

NODE_PREFERENCE_TOLERANCE = 0.10   # --elastic: a layout surviving more node losses may be this much slower


@dataclass(frozen=True)
class Survival:
    """Per device and per node the strategy uses: does its state survive that loss in memory."""

    devices_ok: tuple[int, ...]
    devices_lost: tuple[int, ...]
    nodes_ok: tuple[str, ...]
    nodes_lost: tuple[str, ...]

    @property
    def nodes_survived(self) -> int:
        return len(self.nodes_ok)

    def to_json(self) -> dict[str, Any]:
        return {"single_device": {"survives": list(self.devices_ok), "restart": list(self.devices_lost)},
                "whole_node": {"survives": list(self.nodes_ok), "restart": list(self.nodes_lost)}}

    def lines(self) -> list[str]:
        """The report's sentences: what it survives in memory and what needs a restart from a checkpoint."""
        n_dev = len(self.devices_ok) + len(self.devices_lost)
        if not self.devices_lost:
            dev = f"survives in memory the loss of any one of its {n_dev} devices"
        elif not self.devices_ok:
            dev = (f"survives no single device's loss in memory (each of its {n_dev} devices holds state with no "
                   "other copy): a failure restarts from the last checkpoint; hspmd plan --elastic keeps copies")
        else:
            dev = (f"survives in memory the loss of {len(self.devices_ok)} of its {n_dev} devices; not of "
                   f"{span(self.devices_lost)} (restart from the last checkpoint)")
        if not self.nodes_lost:
            node = f"survives the loss of any one of its nodes ({', '.join(self.nodes_ok)})"
        elif not self.nodes_ok:
            node = f"survives no whole node's loss ({', '.join(self.nodes_lost)}): restart from the last checkpoint"
        else:
            node = (f"survives the loss of node(s) {', '.join(self.nodes_ok)}; not of {', '.join(self.nodes_lost)} "
                    "(restart from the last checkpoint)")
        return [f"failures: {dev}", f"failures: whole nodes: {node}"]


def span(ids: Sequence[int]) -> str:
    """'0-3, 8' for device lists."""
    out, run = [], [ids[0]] if ids else []
    for d in ids[1:]:
        if d == run[-1] + 1:
            run.append(d)
        else:
            out.append(run)
            run = [d]
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def node_devices(cluster: Cluster, used: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Node name -> the used devices on it (nodes the strategy does not use are left out)."""
    out: dict[str, list[int]] = {}
    for d in sorted(used):
        out.setdefault(cluster.device(d).node, []).append(d)
    return {k: tuple(v) for k, v in out.items()}


def survival(handle: StrategyHandle, single_devices: bool = True) -> Survival:
    """``single_devices=False``: the node losses only (the single-device fields then empty)."""
    devices = tuple(sorted(handle.devices))
    ok = tuple(d for d in devices if single_devices and not lost_state(handle, [d]))
    nodes = node_devices(handle.ctx.cluster, devices)
    nodes_ok = tuple(n for n, ds in nodes.items() if not lost_state(handle, ds))
    lost = tuple(d for d in devices if d not in ok) if single_devices else ()
    return Survival(ok, lost, nodes_ok, tuple(n for n in nodes if n not in nodes_ok))


def plan_survival(plan: Plan, model: ModelSpec, cluster: Cluster, path: Path = Path("plan"),
                  single_devices: bool = True) -> Survival:
    """``survival`` of a plan's first strategy (a plan the planner just made: not yet on disk)."""
    return survival(StrategyHandle.of(PlanContext(plan, model, cluster, path)), single_devices)


def spread_over_nodes(strategy: Strategy, cluster: Cluster) -> Strategy:
    """``strategy`` with its TP groups of each (device type, TP degree) reassigned among its stages of that
    kind so that, stage position by stage position, the pipelines' groups sit on as many different nodes as
    there are: every stage keeps its type, degree and layers (its compute and memory), only which devices run
    it changes (its transfers and gradient-sync groups with it). The op and transfer costs are left for the
    caller to price again."""
    slots: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for pi, pipe in enumerate(strategy.pipelines):
        for si, st in enumerate(pipe.stages):
            slots.setdefault((cluster.device(st.devices[0]).type, st.tp), []).append((si, pi))
    placed: dict[tuple[int, int], tuple[int, ...]] = {}
    for kind_slots in slots.values():
        kind_slots.sort()   # stage position first, then pipeline
        queues: dict[str, list[tuple[int, ...]]] = {}
        for si, pi in kind_slots:
            group = strategy.pipelines[pi].stages[si].devices
            queues.setdefault(cluster.device(group[0]).node, []).append(group)
        position, used = None, set()
        for si, pi in kind_slots:
            if si != position:
                position, used = si, set()
            fresh = [n for n, q in queues.items() if q and n not in used] or [n for n, q in queues.items() if q]
            node = max(fresh, key=lambda n: len(queues[n]))   # the fullest unused node: keeps later choices open
            used.add(node)
            placed[pi, si] = queues[node].pop(0)
    pipes = tuple(dataclasses.replace(pipe, stages=tuple(_moved(st, placed[pi, si])
                                                         for si, st in enumerate(pipe.stages)), transfer_costs=None)
                  for pi, pipe in enumerate(strategy.pipelines))
    return dataclasses.replace(strategy, pipelines=pipes)


def _moved(st: Stage, devices: tuple[int, ...]) -> Stage:
    """``st`` on ``devices`` (its group's ranks in order), a MoE stage's experts following their ranks."""
    experts = None if st.experts is None else {new: list(st.experts_of(old)) for old, new in zip(st.devices, devices)}
    return dataclasses.replace(st, devices=devices, experts=experts, op_costs=None)


def prefer_node_survivable(result: PlanResult, profiles: Mapping[str, DeviceProfile], model_ref: str,
                           cluster_ref: str, tolerance: float = NODE_PREFERENCE_TOLERANCE
                           ) -> tuple[PlanResult, str | None]:
    """``result`` with, first, the layout within ``tolerance`` of the fastest that survives the most whole
    node losses (the fastest among equals), and a sentence when that is not the fastest one, or when a layout
    surviving more was found beyond the tolerance. The layouts: the near-best candidates, and each with its
    groups spread over the nodes (``spread_over_nodes``)."""
    best_t = result.best.step_time_s
    settings = result.settings

    def nodes_survived(c: Candidate) -> int:
        plan = dataclasses.replace(result, candidates=(c,)).to_plan(model_ref, cluster_ref)
        return plan_survival(plan, result.model, result.cluster, single_devices=False).nodes_survived

    options, beyond = [], []
    for c in result.candidates:
        if c.step_time_s > best_t * (1.0 + tolerance):
            beyond.append(c)
            continue
        options.append(c)
        cm = CostModel(result.model, result.cluster, profiles, micro_batch=c.micro_batch, seq_len=settings.seq_len,
                       sequence_parallel=settings.sequence_parallel)
        spread = cm.with_op_costs(spread_over_nodes(c.strategy, result.cluster), settings.default_schedule)
        if spread.pipelines != c.strategy.pipelines:
            est = cm.estimate(spread, settings.global_batch, settings.default_schedule, settings.zero)
            if not est.oom_devices:
                moved = dataclasses.replace(c, strategy=spread, estimate=est, simulated_s=None,
                                            summary=c.summary + " (groups spread over nodes)")
                (options if est.step_time_s <= best_t * (1.0 + tolerance) else beyond).append(moved)
    scored = sorted((-nodes_survived(c), c.step_time_s, i) for i, c in enumerate(options))
    fastest = -nodes_survived(result.best)
    nodes, _, pick = scored[0]   # the most nodes survived; among equals the fastest
    more = [c for c in beyond if nodes_survived(c) > -nodes]
    later = ""
    if more:
        alt = min(more, key=lambda c: c.step_time_s)
        later = (f"; a layout surviving {nodes_survived(alt)} node loss(es) takes {alt.step_time_s:.4g} s/step "
                 f"({alt.step_time_s / best_t - 1.0:+.0%}): --node-loss-tolerance "
                 f"{alt.step_time_s / best_t - 1.0 + 0.005:.2f} takes it")
    if nodes == fastest:   # the fastest survives as many as any within the tolerance: it stays
        return result, (f"elastic: no layout within {tolerance:.0%} of the fastest survives more whole-node losses "
                        f"than it ({-fastest}){later}") if more else None
    first = options[pick]
    ranked = (first, *(c for c in result.candidates if c is not first))
    why = (f"elastic: this layout survives the loss of {-nodes} whole node(s) in memory, the fastest found "
           f"({best_t:.4g} s/step) {-fastest}: its {first.step_time_s / best_t - 1.0:+.1%} step time is "
           f"within --node-loss-tolerance {tolerance:g}{later}")
    return dataclasses.replace(result, candidates=ranked, idle=explain_idle(first, ranked, result.cluster),
                               schedule_options=()), why
