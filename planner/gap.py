"""Where a plan's step time goes, against the lower bound (planner/baselines.py ``lower_bound``).

The lower bound is every device at its best compute rate for the whole step. So a plan's distance from it
is device time spent on something other than that: this module accounts for every second of every device
over the plan's step, weighted by how much work that device could do per second (its best rate for a
decoder layer, the bound's rate), and names each loss:

* ``idle_devices``: devices the plan leaves out, the whole step;
* ``sync_optimizer``: the step past the slowest pipeline (gradient sync, clip, optimizer, ZeRO all-gathers);
* ``pipeline_imbalance``: a pipeline that finishes before the slowest one waits for it;
* ``fill_drain``: inside its pipeline's time, the pipeline's busiest stage not computing (fill, drain,
  waits for transfers), charged to every device of the pipeline: the schedule's loss;
* ``stage_imbalance``: a stage busy for less than the pipeline's busiest one (the layer split's loss:
  whole layers, memory limits);
* ``recompute``, ``tp_comm``: device time in recomputed forwards and in TP collectives;
* ``slow_compute``: the rest of the compute beyond the bound's rate: a TP degree that runs a layer less
  efficiently than the type's best, embedding and head where they are dear, a stage's fixed time.

The shares add up to ``1 - useful`` with ``useful`` the work done at the bound's rates; ``useful`` is the
bound's efficiency but for what the bound's LP gains by moving embedding and head work to where it is
cheapest (``residual``). Purely descriptive: the planner does not optimize it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.baselines import work_seconds
from planner.cost import CostModel, StrategyEstimate
from planner.tp_groups import available
from runtime.torchfree.spec.plan import Schedule, Strategy

CATEGORIES = ("idle_devices", "sync_optimizer", "pipeline_imbalance", "fill_drain", "stage_imbalance", "recompute",
              "tp_comm", "slow_compute")


@dataclass(frozen=True)
class GapBreakdown:
    step_time_s: float
    lower_bound_s: float
    useful: float                     # work at the bound's rates over the devices' capacity in the step
    losses: Mapping[str, float]       # category -> share of the capacity (sums to 1 - useful)
    per_pipeline: tuple[Mapping[str, float], ...]   # per pipeline: time_s, bubble share of its devices, ...

    @property
    def efficiency(self) -> float:
        return self.lower_bound_s / self.step_time_s

    @property
    def residual(self) -> float:
        """``useful - efficiency``: what the bound gains over whole-model work at the layer rate."""
        return self.useful - self.efficiency

    def as_dict(self) -> dict:
        return {"efficiency": self.efficiency, "useful": self.useful, "residual": self.residual,
                "losses": dict(self.losses), "per_pipeline": [dict(p) for p in self.per_pipeline]}


def gap_breakdown(cm: CostModel, strategy: Strategy, estimate: StrategyEstimate, lower_bound_s: float,
                  devices: tuple[int, ...], schedule: Schedule = "1f1b") -> GapBreakdown:
    """Every device's seconds over ``estimate``'s step, by category, weighted by the device's best layer
    rate (``work_seconds``): shares of the devices' capacity in the step (docstring above)."""
    cluster = cm.cluster
    per_node = available(cluster, devices)
    max_tp: dict[str, int] = {}
    for (_, t), ids in per_node.items():
        max_tp[t] = max(max_tp.get(t, 0), len(ids))
    secs = {t: work_seconds(cm, t, tp)[0] for t, tp in max_tp.items()}
    rate = {d: 1.0 / secs[cluster.device(d).type]["layer"] for d in devices}
    step = estimate.step_time_s
    capacity = step * sum(rate.values())
    loss = dict.fromkeys(CATEGORIES, 0.0)
    useful = 0.0
    used = set(strategy.devices)
    for d in devices:
        if d not in used:
            loss["idle_devices"] += step * rate[d]
    slowest = max(p.time_s for p in estimate.pipelines)
    n_layers = cm.model.num_layers
    per_pipe = []
    for pipe, pest in zip(strategy.pipelines, estimate.pipelines):
        m = pipe.micro_batches
        bubble_p = cap_p = 0.0
        busiest = m * max(sc.time_s for sc in pest.stages)
        for st, sc in zip(pipe.stages, pest.stages):
            dtype = cluster.device(st.devices[0]).type
            s = secs[dtype]
            busy = m * sc.time_s
            ideal = m * sum((b - a) * s["layer"] + (s["embedding"] if a == 0 else 0.0)
                            + (s["head"] if b == n_layers else 0.0) for a, b in st.layers) / st.tp
            recompute = m * st.recomputed_layers * cm.layer(dtype, st.tp, True).recompute_s
            tp_comm = m * sc.tp_comm_s
            for d in st.devices:
                r = rate[d]
                loss["sync_optimizer"] += (step - slowest) * r
                loss["pipeline_imbalance"] += (slowest - pest.time_s) * r
                loss["fill_drain"] += (pest.time_s - busiest) * r
                loss["stage_imbalance"] += (busiest - busy) * r
                loss["recompute"] += recompute * r
                loss["tp_comm"] += tp_comm * r
                loss["slow_compute"] += (busy - recompute - tp_comm - ideal) * r
                useful += ideal * r
                bubble_p += (pest.time_s - busy) * r
                cap_p += pest.time_s * r
        per_pipe.append({"time_s": pest.time_s, "micro_batches": m, "stages": len(pipe.stages),
                         "bubble_share": bubble_p / cap_p if cap_p > 0 else 0.0})
    return GapBreakdown(step, lower_bound_s, useful / capacity, {k: v / capacity for k, v in loss.items()},
                        tuple(per_pipe))
