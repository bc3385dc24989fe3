"""A new plan after a failure, chosen with the cost of switching to it in view.

``replan(ctx, strategy, failed, profiles)``:

1. Every parameter must still have a surviving replica (``runtime.elastic.lost_tensors``); if one has
   none, ``LostStateError`` names them (the run cannot continue in memory).
2. Candidates: the planner's near-best plans on the survivors (``planner.api.plan`` with
   ``devices=survivors``, elastic when the survivors allow it, ZeRO off), plus a *repair* of the current
   plan: its pipelines that lost no device, with the micro-batches of the broken ones spread over them
   (nothing moves at all: every survivor keeps what it holds).
3. Each candidate is priced twice: its step time (the cost model) and its switch (the fused BSR of
   every parameter and AdamW moment from the current layout, failed devices excluded: bytes, bytes per
   link, modelled time). Among the candidates whose step time is within ``tolerance`` of the fastest,
   the one that moves the fewest bytes wins (then the faster).
4. For comparison, the modelled cost of checkpoint-restart (``RestartModel``: every assumption is a
   field, printed by ``RestartCost.assumptions``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from planner.api import PlanSettings, plan
from planner.cost import CostModel, zero_copies
from runtime.comm.bsr import BsrPlan
from runtime.elastic.events import TraceEvent
from runtime.elastic.state import STATE_SUFFIXES, LostTensor, describe_lost, lost_tensors, plan_switch
from runtime.errors import HspmdError, InfeasibleError
from runtime.profiling.profile import DeviceProfile, ProfileSet
from runtime.spec import Plan, PlanContext, Strategy, validate_plan
from runtime.spec.handle import StrategyHandle
from runtime.spec.model import ModelSpec

DEFAULT_TOLERANCE = 0.05
STATE_BYTES_PER_PARAM = 4 * len(STATE_SUFFIXES)  # fp32 parameter + two fp32 AdamW moments (a checkpoint)


class LostStateError(HspmdError):
    """Some parameter has no surviving replica: no plan on the survivors can start from memory."""

    def __init__(self, failed: Collection[int], lost: list[LostTensor]) -> None:
        self.failed = tuple(sorted(failed))
        self.lost = lost
        super().__init__("; ".join(self.lines()))

    def lines(self) -> list[str]:
        devs = ", ".join(map(str, self.failed))
        out = [f"device(s) {devs}: {len(self.lost)} parameter(s) lose every replica, so no plan can continue "
               "from memory (restart from a checkpoint, or plan with --elastic to keep >= 2 pipelines):"]
        return out + [f"  {line}" for line in describe_lost(self.lost)]


@dataclass(frozen=True)
class RestartModel:
    """Checkpoint-restart, modelled. A job that restarts from a checkpoint pays: writing the checkpoint
    (periodically; charged once here), reading it back, starting new processes and process groups, and
    redoing the steps since the last checkpoint (on average half an interval, at the old step time)."""

    storage_gbs: float = 10.0  # aggregate checkpoint storage bandwidth, GB/s, the same for write and read
    restart_s: float = 60.0  # new processes, imports, CUDA context, NCCL/gloo groups, program build
    checkpoint_interval_steps: int = 100

    def __post_init__(self) -> None:
        if self.storage_gbs <= 0 or self.restart_s < 0 or self.checkpoint_interval_steps < 1:
            raise ValueError("storage_gbs must be positive, restart_s non-negative, checkpoint interval >= 1")


@dataclass(frozen=True)
class RestartCost:
    model: RestartModel
    checkpoint_bytes: int
    write_s: float
    read_s: float
    restart_s: float
    lost_work_s: float

    @property
    def total_s(self) -> float:
        return self.write_s + self.read_s + self.restart_s + self.lost_work_s

    def assumptions(self) -> list[str]:
        m = self.model
        return [
            f"checkpoint = every parameter and both AdamW moments in fp32 ({STATE_BYTES_PER_PARAM} bytes per "
            f"parameter): {self.checkpoint_bytes / 1e9:.3g} GB",
            f"written once and read back once at {m.storage_gbs:g} GB/s aggregate storage bandwidth",
            f"process restart and process-group initialization: {m.restart_s:g} s",
            f"a checkpoint every {m.checkpoint_interval_steps} steps: a failure loses half an interval on "
            "average, redone at the pre-failure step time",
        ]

    def to_json(self) -> dict[str, object]:
        return {"total_s": self.total_s, "checkpoint_bytes": self.checkpoint_bytes, "write_s": self.write_s,
                "read_s": self.read_s, "restart_s": self.restart_s, "lost_work_s": self.lost_work_s,
                "storage_gbs": self.model.storage_gbs,
                "checkpoint_interval_steps": self.model.checkpoint_interval_steps,
                "assumptions": self.assumptions()}


def restart_cost(model: ModelSpec, step_time_s: float, restart: RestartModel) -> RestartCost:
    nbytes = model.total_params() * STATE_BYTES_PER_PARAM
    io = nbytes / (restart.storage_gbs * 1e9)
    return RestartCost(restart, nbytes, io, io, restart.restart_s,
                       restart.checkpoint_interval_steps / 2 * step_time_s)


@dataclass(frozen=True)
class Option:
    """A candidate plan for the survivors and what switching to it costs."""

    origin: Literal["planner", "repair"]
    rank: int  # the planner's rank (0: its best), or 0 for the repair
    plan: Plan
    step_time_s: float
    summary: str
    bsr: BsrPlan
    modelled_switch_s: float
    lower_bound_s: float

    @property
    def strategy(self) -> Strategy:
        return self.plan.strategies[0]

    @property
    def switch_bytes(self) -> int:
        return self.bsr.total_bytes

    @property
    def label(self) -> str:
        return "repair" if self.origin == "repair" else f"planner #{self.rank + 1}"


@dataclass(frozen=True)
class ReplanResult:
    failed: tuple[int, ...]
    survivors: tuple[int, ...]
    current_step_time_s: float
    options: tuple[Option, ...]  # every candidate considered, fastest first
    chosen: Option
    tolerance: float
    restart: RestartCost
    context: PlanContext  # the chosen plan, ready for the runtime
    notes: tuple[str, ...] = ()

    @property
    def plan(self) -> Plan:
        return self.chosen.plan


def replan(current: StrategyHandle, failed: Collection[int],
           profiles: Mapping[str, DeviceProfile] | ProfileSet, *, tolerance: float = DEFAULT_TOLERANCE,
           time_limit_s: float = 60.0, top_k: int = 5, restart: RestartModel | None = None,
           model_ref: str | None = None, cluster_ref: str | None = None) -> ReplanResult:
    """The plan to switch to when ``failed`` devices of ``current`` are lost (see the module docstring).

    The survivors are the strategy's other devices (a running job has processes only there). Raises
    LostStateError when a parameter lost every replica, InfeasibleError when no plan fits the survivors.
    """
    if tolerance < 0:
        raise ValueError("tolerance must not be negative")
    ctx = current.ctx
    failed = frozenset(failed)
    unknown = sorted(failed - set(range(ctx.cluster.num_devices)))
    if unknown:
        raise HspmdError(f"--failed: device(s) {unknown} are not in cluster {ctx.cluster.name!r} "
                         f"(devices 0-{ctx.cluster.num_devices - 1})")
    idle = sorted(failed - set(current.devices))
    notes = [f"device(s) {idle} are idle in strategy {current.name!r}: losing them changes nothing"] if idle else []
    lost = lost_tensors(current, failed)
    if lost:
        raise LostStateError(failed, lost)
    survivors = tuple(d for d in current.devices if d not in failed)
    t = ctx.plan.training
    model_ref = model_ref or ctx.plan.model
    cluster_ref = cluster_ref or ctx.plan.cluster
    cur = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
    current_time = cur.estimate(current.strategy, t.global_batch, t.schedule, zero_copies(t)).step_time_s

    plans: list[tuple[Literal["planner", "repair"], int, Plan, float, str]] = []
    # The survivors keep the run's ZeRO choice (an elastic ZeRO-1 plan keeps 2 copies of every chunk).
    settings = PlanSettings(global_batch=t.global_batch, seq_len=t.seq_len, micro_batch=None, elastic=True,
                            use_zero=t.zero, time_limit_s=time_limit_s, top_k=top_k, seed=t.seed, optimizer=t.optimizer,
                            schedule=t.schedule)
    try:
        result = plan(ctx.model, ctx.cluster, profiles, settings, devices=survivors, baselines=False)
    except InfeasibleError as err:
        notes.append(f"no elastic plan (>= 2 pipelines) fits the survivors ({err}); planning without that")
        result = plan(ctx.model, ctx.cluster, profiles, dataclasses.replace(settings, elastic=False, use_zero=False),
                      devices=survivors, baselines=False)
    for i, cand in enumerate(result.candidates):
        p = result.to_plan(model_ref, cluster_ref, i)
        plans.append(("planner", i, p, cand.step_time_s, cand.summary))
    repaired = repair(current, failed, profiles)
    if not failed & set(current.devices):
        repaired = (dataclasses.replace(ctx.plan, strategies=(current.strategy,)), current_time)
    if repaired is not None:
        p, step_time = repaired
        plans.append(("repair", 0, p, step_time, "the current plan without its broken pipeline(s)"))

    options = []
    seen: set[tuple[int, tuple]] = set()
    for origin, rank, p, step_time, summary in plans:
        key = (p.training.micro_batch, p.strategies[0].pipelines)
        if key in seen:
            continue  # the planner found the repair too
        seen.add(key)
        problems = validate_plan(p, ctx.model, ctx.cluster, str(ctx.path))
        if problems:
            raise RuntimeError(f"replan produced an invalid plan ({origin}): {problems[0]}")
        target = StrategyHandle.of(PlanContext(p, ctx.model, ctx.cluster, ctx.path))
        bsr = plan_switch(current, target, failed)
        options.append(Option(origin, rank, p, step_time, summary, bsr, bsr.modelled_time(ctx.cluster),
                              bsr.lower_bound(ctx.cluster)))
    options.sort(key=lambda o: (o.step_time_s, o.switch_bytes))
    chosen = choose(options, tolerance)
    return ReplanResult(tuple(sorted(failed)), survivors, current_time, tuple(options), chosen, tolerance,
                        restart_cost(ctx.model, current_time, restart or RestartModel()),
                        PlanContext(chosen.plan, ctx.model, ctx.cluster, ctx.path), tuple(notes))


def choose(options: list[Option], tolerance: float) -> Option:
    """Among the options within ``tolerance`` of the fastest step time, the one that moves the fewest
    bytes (then the faster, then the planner's order)."""
    if not options:
        raise InfeasibleError("no candidate plan for the survivors")
    best = min(o.step_time_s for o in options)
    near = [o for o in options if o.step_time_s <= best * (1 + tolerance)]
    return min(near, key=lambda o: (o.switch_bytes, o.step_time_s, o.origin != "planner", o.rank))


def repair(current: StrategyHandle, failed: Collection[int],
           profiles: Mapping[str, DeviceProfile] | ProfileSet) -> tuple[Plan, float] | None:
    """The current plan without the pipelines that lost a device, their micro-batches spread over the
    others to even out the pipelines' times (cost model); None when no pipeline is intact, when there are
    too few micro-batches, or when it does not fit in memory."""
    ctx, strat = current.ctx, current.strategy
    t = ctx.plan.training
    keep = [p for p in strat.pipelines if not set(p.devices) & set(failed)]
    if not keep or len(keep) == len(strat.pipelines):
        return None
    total = t.global_batch // t.micro_batch
    need = [len(p.stages) if t.schedule == "1f1b" else 1 for p in keep]
    if sum(need) > total:
        return None
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)

    def with_counts(counts: list[int]) -> Strategy:   # op costs as the planner writes them (and prices)
        return cm.with_op_costs(Strategy(f"{strat.name}-repaired", tuple(dataclasses.replace(p, micro_batches=m)
                                                                         for p, m in zip(keep, counts))), t.schedule)

    # Each pipeline's time is linear in its micro-batches (1F1B: (m-1)·max + sum): two estimates give
    # slope and intercept; then water-filling puts each next micro-batch where it finishes soonest.
    base = cm.estimate(with_counts(need), t.global_batch, t.schedule, False)
    more = cm.estimate(with_counts([m + 1 for m in need]), t.global_batch, t.schedule, False)
    lines = [(b.time_s, m.time_s - b.time_s) for b, m in zip(base.pipelines, more.pipelines)]
    counts = list(need)
    for _ in range(total - sum(need)):
        i = min(range(len(keep)), key=lambda j: (lines[j][0] + (counts[j] - need[j] + 1) * lines[j][1], j))
        counts[i] += 1
    repaired = with_counts(counts)
    # ZeRO-1's copies need as many pipelines: fewer left, and the moments are kept whole.
    training = t if len(keep) >= t.zero_redundancy else dataclasses.replace(t, zero=False, zero_redundancy=1)
    est = cm.estimate(repaired, t.global_batch, t.schedule, zero_copies(training))
    if not est.fits or not math.isfinite(est.step_time_s):
        return None
    repaired = dataclasses.replace(repaired, estimates={"step_time_s": round(est.step_time_s, 6)})
    return dataclasses.replace(ctx.plan, training=training, strategies=(repaired,)), est.step_time_s


@dataclass(frozen=True)
class SwitchModel:
    """What an in-memory switch costs besides moving the state (the fused BSR, priced from its bytes):
    every member forms a new world and its process groups, and builds its program."""

    regroup_s: float = 2.0  # new world, process groups, program build (measured ~0.3-1 s on cpu-hetero4)

    def __post_init__(self) -> None:
        if self.regroup_s < 0:
            raise ValueError("regroup_s must not be negative")


@dataclass(frozen=True)
class GrowResult:
    """Whether to adopt returning devices now: the best plan with them, and gain against cost."""

    joining: tuple[int, ...]
    current_step_time_s: float
    step_time_s: float  # the best plan with the joining devices (inf when none fits)
    steps_left: int
    gain_s: float  # (current - new step time) x steps left
    switch_s: float  # modelled: the fused BSR plus SwitchModel.regroup_s
    adopt: bool
    context: PlanContext | None
    reason: str


def grow(current: StrategyHandle, joining: Collection[int], profiles: Mapping[str, DeviceProfile] | ProfileSet, *,
         steps_left: int, time_limit_s: float = 60.0, switch: SwitchModel | None = None,
         model_ref: str | None = None, cluster_ref: str | None = None) -> GrowResult:
    """The plan on ``current``'s devices plus ``joining`` (elastic when they allow it, ZeRO off), adopted
    only when the step time it saves over ``steps_left`` steps beats the modelled cost of switching to it
    (the state's fused BSR from its holders, plus regrouping)."""
    ctx = current.ctx
    joining = tuple(sorted(set(joining) - set(current.devices)))
    unknown = [d for d in joining if not 0 <= d < ctx.cluster.num_devices]
    if unknown:
        raise HspmdError(f"--rejoin-device: device(s) {unknown} are not in cluster {ctx.cluster.name!r} "
                         f"(devices 0-{ctx.cluster.num_devices - 1})")
    switch = switch or SwitchModel()
    t = ctx.plan.training
    cur = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
    current_time = cur.estimate(current.strategy, t.global_batch, t.schedule, zero_copies(t)).step_time_s
    devices = tuple(sorted(set(current.devices) | set(joining)))
    settings = PlanSettings(global_batch=t.global_batch, seq_len=t.seq_len, micro_batch=None, elastic=True,
                            use_zero=t.zero, time_limit_s=time_limit_s, top_k=1, seed=t.seed, optimizer=t.optimizer,
                            schedule=t.schedule)
    try:
        result = plan(ctx.model, ctx.cluster, profiles, settings, devices=devices, baselines=False)
    except InfeasibleError:
        result = plan(ctx.model, ctx.cluster, profiles, dataclasses.replace(settings, elastic=False, use_zero=False),
                      devices=devices, baselines=False)
    best = result.candidates[0]
    p = result.to_plan(model_ref or ctx.plan.model, cluster_ref or ctx.plan.cluster, 0)
    target_ctx = PlanContext(p, ctx.model, ctx.cluster, ctx.path)
    target = StrategyHandle.of(target_ctx)
    bsr = plan_switch(current, target, ())
    switch_s = bsr.modelled_time(ctx.cluster) + switch.regroup_s
    gain = (current_time - best.step_time_s) * steps_left
    uses = sorted(set(target.devices) & set(joining))
    adopt = bool(uses) and gain > switch_s
    what = (f"with device(s) {', '.join(map(str, joining))}: {best.step_time_s:.4g} s/step predicted vs "
            f"{current_time:.4g} s now; over {steps_left} step(s) left that saves {gain:.3g} s against a modelled "
            f"switch of {switch_s:.3g} s ({bsr.total_bytes / 1e6:.3g} MB)")
    reason = (f"adopt {what}" if adopt else
              f"stay: the best plan leaves device(s) {', '.join(map(str, joining))} idle" if not uses else
              f"stay: {what}")
    return GrowResult(joining, current_time, best.step_time_s, steps_left, gain, switch_s, adopt,
                      target_ctx if adopt else None, reason)


# -- a failure trace, modelled (hspmd simulate --events, scripts/bench_elastic.py) ---------------------------


@dataclass(frozen=True)
class TraceModel:
    """How the three ways of surviving failures are priced over a trace (every assumption a field).

    * **hspmd**: a failure costs detection, the replan (the planner's own wall time, measured here), the
      fused BSR of the chosen plan (modelled) plus regrouping, and half a step (the step in flight is
      redone); a return costs the grow decision and its switch, adopted only when it pays.
    * **restart** (Megatron / DeepSpeed with torchrun): the node of a failed device is dropped whole (only
      the failed devices when no whole node would be left) and the job restarts from its last checkpoint
      on the remaining whole nodes (``RestartCost``: write, read,
      process restart, half a checkpoint interval lost); a node that is whole again is taken back with a
      planned restart (checkpoint written and read, no work lost).
    * **oobleck-like**: fixed pipeline templates: a failure drops the pipelines it broke and spreads their
      micro-batches over the others (``repair``: nothing is re-planned, no TP or layer split changes);
      when every pipeline is whole again the original plan is re-instantiated and the returning
      pipelines' state is broadcast from one replica over one inter-node link (no balancing over holders).
      No intact pipeline left: a restart.
    """

    detect_s: float = 1.0  # a death is seen at once, a lost node within its agent's heartbeat timeout
    restart: RestartModel = RestartModel()
    switch: SwitchModel = SwitchModel()
    time_limit_s: float = 30.0  # the planner's limit per replan


@dataclass
class _Line:
    """One approach's run through the trace."""

    name: str
    handle: StrategyHandle
    step_time_s: float
    time_s: float = 0.0
    recovery: list[dict[str, object]] = dataclasses.field(default_factory=list)

    def to_json(self, steps: int) -> dict[str, object]:
        return {"total_s": self.time_s, "goodput_steps_per_s": steps / self.time_s if self.time_s else 0.0,
                "events": self.recovery}


def model_trace(current: StrategyHandle, trace: Sequence[TraceEvent], steps: int,
                profiles: Mapping[str, DeviceProfile] | ProfileSet, model: TraceModel | None = None,
                log: Callable[[str], None] = lambda _m: None) -> dict[str, object]:
    """Goodput (steps per second over the whole trace) of hspmd, checkpoint-restart and an Oobleck-like
    baseline on ``steps`` steps of ``current`` with the failures and returns of ``trace``."""
    model = model or TraceModel()
    ctx = current.ctx
    t = ctx.plan.training
    cluster = ctx.cluster
    cm = CostModel.for_plan(ctx.plan, ctx.model, cluster, profiles)
    t0_time = cm.estimate(current.strategy, t.global_batch, t.schedule, False).step_time_s
    lines = {name: _Line(name, current, t0_time) for name in ("hspmd", "restart", "oobleck_like")}
    node_of = {d.id: d.node for d in cluster.devices}
    nodes = {n.name: {d.id for d in cluster.devices if d.node == n.name} for n in cluster.nodes}
    original = current
    plans: dict[tuple[int, ...], tuple[StrategyHandle, float]] = {}

    def best_on(devices: Collection[int]) -> tuple[StrategyHandle, float]:
        key = tuple(sorted(devices))
        if key not in plans:
            settings = PlanSettings(global_batch=t.global_batch, seq_len=t.seq_len, micro_batch=None, elastic=False,
                                    use_zero=False, time_limit_s=model.time_limit_s, top_k=1, seed=t.seed,
                                    optimizer=t.optimizer, schedule=t.schedule)
            result = plan(ctx.model, cluster, profiles, settings, devices=key, baselines=False)
            p = result.to_plan(ctx.plan.model, ctx.plan.cluster, 0)
            plans[key] = (StrategyHandle.of(PlanContext(p, ctx.model, cluster, ctx.path)),
                          result.candidates[0].step_time_s)
        return plans[key]

    def restart_cost_s(step_time: float, lose_work: bool) -> float:
        c = restart_cost(ctx.model, step_time, model.restart)
        return c.write_s + c.read_s + c.restart_s + (c.lost_work_s if lose_work else 0.0)

    down: set[int] = set()
    events = sorted(trace, key=lambda e: e.step)
    prev = 1
    for e in events:
        for line in lines.values():
            line.time_s += (e.step - prev) * line.step_time_s
        prev = e.step
        if e.action == "rejoin":
            down -= set(e.devices)
        else:
            down |= set(e.devices)
        alive = [d for d in range(cluster.num_devices) if d not in down and d in set(original.devices) | set(e.devices)]
        log(f"step {e.step}: {e.action} {list(e.devices)}")
        # hspmd
        h = lines["hspmd"]
        t0 = time.perf_counter()
        if e.action == "rejoin":
            g = grow(h.handle, e.devices, profiles, steps_left=steps - e.step + 1, time_limit_s=model.time_limit_s,
                     switch=model.switch)
            cost = time.perf_counter() - t0 + (g.switch_s if g.adopt else 0.0)
            if g.adopt and g.context is not None:
                h.handle, h.step_time_s = StrategyHandle.of(g.context), g.step_time_s
            h.recovery.append({"step": e.step, "event": "rejoin", "adopted": g.adopt, "cost_s": cost})
        else:
            try:
                r = replan(h.handle, set(e.devices), profiles, time_limit_s=model.time_limit_s)
                cost = (model.detect_s + time.perf_counter() - t0 + r.chosen.modelled_switch_s + model.switch.regroup_s
                        + h.step_time_s / 2)
                h.handle, h.step_time_s = StrategyHandle.of(r.context), r.chosen.step_time_s
            except LostStateError:
                survivors = [d for d in h.handle.devices if d not in e.devices]
                h.handle, h.step_time_s = best_on(survivors)
                cost = model.detect_s + restart_cost_s(h.step_time_s, True)
            h.recovery.append({"step": e.step, "event": e.action, "cost_s": cost})
        h.time_s += cost
        # restart: whole nodes only
        rs = lines["restart"]
        usable = set(original.devices) | {x for ev in events for x in ev.devices}
        whole = sorted(d for n, devs in nodes.items() if not devs & down for d in devs if d in usable)
        if not whole:  # one node (or every node hit): it restarts without the failed devices only
            whole = sorted(usable - down)
        if set(whole) != set(rs.handle.devices):
            lose = e.action != "rejoin"
            rs.handle, rs.step_time_s = best_on(whole)
            cost = (model.detect_s if lose else 0.0) + restart_cost_s(rs.step_time_s, lose)
            rs.time_s += cost
            rs.recovery.append({"step": e.step, "event": e.action, "cost_s": cost,
                                "nodes_dropped": sorted({node_of[d] for d in down})})
        # oobleck-like: fixed templates
        ob = lines["oobleck_like"]
        if e.action == "rejoin":
            if not down & set(original.devices) and ob.handle is not original:
                bsr = plan_switch(ob.handle, original, ())
                cost = model.switch.regroup_s + bsr.total_bytes / (cluster.inter_node_bandwidth_gbs * 1e9)
                ob.handle, ob.step_time_s = original, t0_time
                ob.time_s += cost
                ob.recovery.append({"step": e.step, "event": "rejoin", "cost_s": cost})
        elif set(e.devices) & set(ob.handle.devices):
            fixed = repair(ob.handle, set(e.devices), profiles)
            if fixed is None:
                ob.handle, ob.step_time_s = best_on([d for d in alive if d in set(ob.handle.devices)])
                cost = model.detect_s + restart_cost_s(ob.step_time_s, True)
            else:
                p, ob.step_time_s = fixed
                ob.handle = StrategyHandle.of(PlanContext(p, ctx.model, cluster, ctx.path))
                cost = model.detect_s + model.switch.regroup_s + ob.step_time_s / 2
            ob.time_s += cost
            ob.recovery.append({"step": e.step, "event": e.action, "cost_s": cost})
    for line in lines.values():
        line.time_s += (steps - prev + 1) * line.step_time_s
    out = {name: line.to_json(steps) for name, line in lines.items()}
    gp = {name: steps / line.time_s for name, line in lines.items()}
    return {"steps": steps, "events": len(events), "initial_step_time_s": t0_time, **out,
            "modelled_goodput_over_restart": gp["hspmd"] / gp["restart"],
            "modelled_goodput_over_oobleck_like": gp["hspmd"] / gp["oobleck_like"],
            "assumptions": [TraceModel.__doc__.split("\n\n")[0].strip(),
                            *restart_cost(ctx.model, t0_time, model.restart).assumptions(),
                            f"detection {model.detect_s:g} s; regroup and program build {model.switch.regroup_s:g} s "
                            "per switch"]}


__all__ = ["DEFAULT_TOLERANCE", "GrowResult", "LostStateError", "Option", "ReplanResult", "RestartCost",
           "RestartModel", "SwitchModel", "TraceModel", "choose", "grow", "model_trace", "repair", "replan",
           "restart_cost"]
