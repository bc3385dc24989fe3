"""A failure trace, modelled (``hspmd simulate --events``, scripts/bench_elastic.py): the goodput of hspmd's
in-memory recovery against checkpoint-restart (on the planner's layouts and on Megatron's) and an
Oobleck-like baseline over the same failures and returns, every assumption a field of ``TraceModel``.
Each line's checkpoints follow Young's rule for the failures it must checkpoint against
(``young_interval_steps``, ``FailureRates``, ``unrecoverable_rate``)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from planner.api import micro_batch_sizes, plan
from planner.baselines import best_symmetric, best_symmetric_subset
from planner.cost import CostModel, planner_handle
from planner.replan import (
    LostStateError,
    PlanMemo,
    RestartModel,
    SearchBudgetSpent,
    SwitchModel,
    grow,
    modelled_step_time,
    pays,
    repair,
    replan,
    restart_cost,
    settings_for,
)
from runtime.elastic.events import MAX_TRACE_SEARCHES, TraceEvent
from runtime.launch.options import node_loss_detect_s
from runtime.torchfree.elastic.preplan import candidates, grown, returns, survivors
from runtime.torchfree.elastic.state import holder_sets, lost_tensors, plan_switch
from runtime.torchfree.errors import HspmdError, InfeasibleError, Problem, SpecError
from runtime.torchfree.profiling.profile import DeviceProfile, ProfileSet
from runtime.torchfree.spec import Cluster
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.plan import Pipeline

# Megatron-LM's ``--distributed-timeout-minutes`` default (torch.distributed's NCCL timeout): when a whole node
# vanishes, the survivors' collectives with it block until this timeout, because torchrun's agents watch only
# their own node's processes (a crashed process, by contrast, is seen within the agent's monitor interval).
MEGATRON_NCCL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TraceModel:
    """How the three ways of surviving failures are priced over a trace (every assumption a field).

    * **hspmd**: a failure costs detection (a process death at once, a node's loss after the agent timeout),
      the replan (the planner's own wall time, measured here; a device set searched before is
      charged what its search took then: ``PlanMemo``), the fused BSR of the chosen plan (modelled)
      plus regrouping, and half a step (the step in flight is redone); a return costs the grow decision and
      its switch, adopted only when it pays. With ``preplan`` (the coordinator's default) the loss of one
      device or one whole node of the running layout was planned ahead in the background
      (runtime/torchfree/elastic/preplan.py) when the layout had run long enough for that: one replan per candidate
      loss, each priced at this event's replan wall time; such a failure costs a lookup plus the planning of
      the chosen plan's fused BSR (measured), not the replan. After the losses, the grow decision for each
      device (then each node's devices) out of every world was made ahead too: a return whose resulting
      device set was among them, once the layout ran long enough for all its losses and returns at this
      event's grow wall time, costs a lookup (plus, adopted, the planning of the fused BSR) and the modelled
      switch, not the decision.
    * **restart** (Megatron / DeepSpeed under torchrun): the job runs the planner's best plan without the
      elastic constraint and with ZeRO-1 (the distributed optimizer: a restart needs no replica in memory);
      the node of a failed device is dropped whole (only the failed devices when no whole node would be
      left), and the job restarts from its last checkpoint on the remaining whole nodes: detection (a crashed
      process at once; a lost node only at the NCCL timeout), checkpoint read, process restart, and the
      steps since the last checkpoint redone (half an interval on average). A node that is whole again is
      taken back with a planned restart (checkpoint written and read, no work lost) when that pays. This line
      isolates hspmd's fault handling (same planner, same heterogeneous layouts).
    * **megatron restart** (``megatron_restart``): the same restarts, on the layout Megatron itself runs: the
      best symmetric plan (planner/baselines.py: every pipeline alike, uniform stages, one micro-batch size)
      over the surviving whole nodes at each phase, or over one device type's devices of them when that is
      faster or nothing symmetric spans them all (``symmetric-subset``); ZeRO-1 as for restart.
    * **oobleck-like** (Oobleck, SOSP'23: pipeline templates planned ahead for every node count, node
      granularity): after every event the layout is re-instantiated from the available whole nodes: the
      original plan's pipelines with no device on a node that lost one, plus a template (the planner's
      plan at the run's micro-batch size, planned ahead: no planning time charged) on the other whole-node
      devices of the broken pipelines; the micro-batches are spread over them (``repair``). The state the
      new pipelines need is broadcast from one replica over one inter-node link (no balancing over
      holders); the surviving pipelines keep their layout (no TP or layer split changes across them).
      No pipeline left, or a parameter without a replica: a restart.
    * **checkpoints**: synchronous writes (Megatron's default save blocks training). Each line writes at
      Young's optimum interval sqrt(2 x write time x mean time between the failures it must checkpoint
      against): the restart lines against every failure of the trace; hspmd and the Oobleck-like line only against
      the losses memory cannot survive (``unrecoverable_rate``: the coordinator's node, or every holder of
      some piece of state lost within one recovery window, on the layout each runs at the time, with the
      trace's per-device and per-node failure rates), and each is charged the expected cost of those
      losses (rate x time x (detection + read + restart + half an interval redone)). A given
      ``checkpoint_interval_steps`` is used by every line instead (no expected-loss charge). The output
      also has every line charged restart's writes (the earlier accounting, ``..._same_checkpoints``).
    """

    detect_s: float = 1.0  # a process death: its pipe (or torchrun's monitor, every 0.1 s) sees it at once
    node_loss_detect_s: float = node_loss_detect_s()  # hspmd: the agent timeout at the default heartbeats
    restart_node_loss_detect_s: float = MEGATRON_NCCL_TIMEOUT_S
    restart: RestartModel = RestartModel()
    checkpoint_interval_steps: int | None = None  # None: Young's optimum for the trace
    restart_zero: bool = True
    megatron_restart: bool = True  # also price restart on Megatron's symmetric layouts (line megatron_restart)
    preplan: bool = True  # hspmd plans single-device and node losses ahead (hspmd train --elastic's default)
    switch: SwitchModel = SwitchModel()
    time_limit_s: float = 30.0  # the planner's limit per replan
    # The planner searches one modelled trace may run (every line's, repeats of a device set free: ``PlanMemo``;
    # why 100: MAX_TRACE_SEARCHES); a trace through more distinct device sets is refused before any.
    max_searches: int = MAX_TRACE_SEARCHES
    # Where hspmd's coordinator (and the Oobleck-like master) runs: its node's loss ends the job whatever the
    # replicas (None: the cluster's first node; every node fails at the same rate, so only a trace that names
    # it depends on the choice).
    coordinator_node: str | None = None
    # How long a failure leaves the state with fewer replicas (detection until the switch is done); None: the
    # line's longest in-memory recovery in the trace (the conservative choice), or, with none, its detection of
    # a lost node plus the regrouping.
    recovery_window_s: float | None = None

    def __post_init__(self) -> None:
        if min(self.detect_s, self.node_loss_detect_s, self.restart_node_loss_detect_s, self.time_limit_s) < 0:
            raise ValueError("detection times and the planner's time limit must not be negative")
        if self.checkpoint_interval_steps is not None and self.checkpoint_interval_steps < 1:
            raise ValueError("checkpoint_interval_steps must be >= 1 (or None: Young's optimum)")
        if self.recovery_window_s is not None and self.recovery_window_s < 0:
            raise ValueError("recovery_window_s must not be negative")
        if self.max_searches < 1:
            raise ValueError("max_searches must be >= 1")


def young_interval_steps(write_s: float, step_time_s: float, run_s: float, failures: float) -> int | None:
    """Young's first-order optimum checkpoint interval (CACM 1974), sqrt(2 x checkpoint cost x MTBF), in steps,
    for ``failures`` (an expected number: it may be fractional) over ``run_s``; None when nothing fails (no
    interval is better than any other: no periodic checkpoint is charged)."""
    if failures <= 0:
        return None
    mtbf = run_s / failures
    return max(1, round(math.sqrt(2 * write_s * mtbf) / step_time_s))


@dataclass(frozen=True)
class FailureRates:
    """Failures per second of one device and of one whole node (power, network, its agent), each an
    independent Poisson process."""

    device_per_s: float
    node_per_s: float

    def __post_init__(self) -> None:
        if self.device_per_s < 0 or self.node_per_s < 0:
            raise ValueError("failure rates must not be negative")

    @classmethod
    def of_trace(cls, events: Sequence[TraceEvent], cluster: Cluster, duration_s: float) -> FailureRates:
        """The trace's rates over ``duration_s``: the devices its device failures name over every device of
        the cluster, its node losses over every node (a return is no failure)."""
        failed = [e for e in events if e.action != "rejoin"]
        devices = sum(len(e.devices) for e in failed if e.node is None)
        nodes = sum(1 for e in failed if e.node is not None)
        return cls(devices / (cluster.num_devices * duration_s), nodes / (len(cluster.nodes) * duration_s))


def unrecoverable_rate(holders: Collection[Collection[int]], node_of: Mapping[int, str], rates: FailureRates,
                       window_s: float, coordinator_node: str | None = None) -> float:
    """Losses per second that in-memory recovery cannot survive, for a layout whose pieces of state are each
    held by one of the device sets ``holders`` (``runtime.torchfree.elastic.state.holder_sets``): the coordinator's node
    failing; a single failure (a device, or a node) that takes every holder of some piece; or a first failure
    followed, within ``window_s`` (until the recovery has replicated the state again), by a second that takes
    the rest of some piece's holders. Losses that need three or more failures within one window are left out
    (each further failure is another factor of about rate x window)."""
    if window_s < 0:
        raise ValueError("window_s must not be negative")
    sets = [frozenset(g) for g in holders]
    held = sorted({d for g in sets for d in g})
    nodes = sorted({node_of[d] for d in held})
    coordinator = ("node", coordinator_node) if coordinator_node is not None else None

    def covered(unit: tuple[str, object]) -> frozenset[int]:
        kind, x = unit
        return frozenset([x]) if kind == "device" else frozenset(d for d in held if node_of[d] == x)  # type: ignore

    def rate(unit: tuple[str, object]) -> float:
        return rates.device_per_s if unit[0] == "device" else rates.node_per_s

    total = rates.node_per_s if coordinator is not None else 0.0
    for unit in [("device", d) for d in held] + [("node", n) for n in nodes]:
        if unit == coordinator:
            continue  # counted above: its loss ends the job by itself
        hit = covered(unit)
        seconds: set[tuple[str, object]] = set()  # failures that would complete a loss after this one
        alone = False
        for g in sets:
            if not g & hit:
                continue
            rest = g - hit
            if not rest:
                alone = True
                break
            if len(rest) == 1:
                seconds.add(("device", next(iter(rest))))
            if len({node_of[d] for d in rest}) == 1:
                seconds.add(("node", node_of[next(iter(rest))]))
        if coordinator is not None:
            seconds.discard(coordinator)  # its loss is counted on its own
        p = 1.0 if alone else 1.0 - math.exp(-window_s * sum(rate(u) for u in seconds))
        total += rate(unit) * p
    return total


@dataclass
class TraceLine:
    """One approach's run through the trace."""

    name: str
    handle: StrategyHandle
    step_time_s: float
    base_step_time_s: float
    steps_s: float = 0.0  # time in steps (at whatever step time the line ran)
    recovery: list[dict[str, object]] = dataclasses.field(default_factory=list)
    # (seconds, step time, layout) of each run of steps: what an unrecoverable loss is priced on
    segments: list[tuple[float, float, StrategyHandle]] = dataclasses.field(default_factory=list)
    # events restarted from a checkpoint, with the step time their lost work is redone at (the lost work
    # depends on the line's checkpoint interval, known once the whole trace is run)
    redo: list[tuple[dict[str, object], float]] = dataclasses.field(default_factory=list)
    windows: list[float] = dataclasses.field(default_factory=list)  # its in-memory failure recoveries, s
    checkpoint_s: float = 0.0
    unrecoverable_s: float = 0.0  # the expected cost of the losses memory cannot survive

    @property
    def recovery_s(self) -> float:
        return sum(float(r["cost_s"]) for r in self.recovery)  # type: ignore[arg-type]

    @property
    def time_s(self) -> float:
        return self.steps_s + self.recovery_s + self.checkpoint_s + self.unrecoverable_s

    def run(self, steps: int) -> None:
        if steps > 0:
            self.steps_s += steps * self.step_time_s
            self.segments.append((steps * self.step_time_s, self.step_time_s, self.handle))

    def event(self, e: TraceEvent, parts: dict[str, float], before_s: float, **extra: object) -> None:
        self.recovery.append({"step": e.step, "event": e.action, "devices": list(e.devices), "node": e.node,
                              "cost_s": sum(parts.values()), "parts_s": parts, "step_time_before_s": before_s,
                              "step_time_after_s": self.step_time_s, "devices_after": len(self.handle.devices),
                              **extra})

    def restarted(self, e: TraceEvent, parts: dict[str, float], before_s: float, **extra: object) -> None:
        """A restart from the last checkpoint; its lost work (half an interval) is set by ``settle``."""
        self.event(e, {**parts, "lost_work": 0.0}, before_s, **extra)
        self.redo.append((self.recovery[-1], self.step_time_s))

    def lost_work_s(self, interval: int) -> float:
        return sum(interval / 2 * st for _, st in self.redo)

    def time_at(self, interval: int, checkpoint_s: float) -> float:
        """The line's time had it checkpointed every ``interval`` steps, ``checkpoint_s`` in writes, and been
        charged no expected unrecoverable loss (the accounting every line shared before)."""
        fixed = self.recovery_s - sum(float(r["parts_s"]["lost_work"]) for r, _ in self.redo)  # type: ignore
        return self.steps_s + fixed + self.lost_work_s(interval) + checkpoint_s

    def settle(self, interval: int) -> None:
        for record, st in self.redo:
            parts = record["parts_s"]
            parts["lost_work"] = interval / 2 * st  # type: ignore[index]
            record["cost_s"] = sum(parts.values())  # type: ignore[union-attr]

    def to_json(self, steps: int) -> dict[str, object]:
        return {"total_s": self.time_s, "goodput_steps_per_s": steps / self.time_s if self.time_s else 0.0,
                "initial_step_time_s": self.base_step_time_s,
                "breakdown_s": {"failure_free_steps": steps * self.base_step_time_s,
                                "slower_steps": self.steps_s - steps * self.base_step_time_s,
                                "recoveries_and_switches": self.recovery_s, "checkpoint_writes": self.checkpoint_s,
                                "unrecoverable_losses_expected": self.unrecoverable_s},
                "events": self.recovery}


def device_sets_visited(start: Collection[int], events: Sequence[TraceEvent]) -> int:
    """How many distinct sets of running devices a trace passes through from ``start`` (itself included):
    each new one is at least one planner search of the modelled lines (``TraceModel.max_searches``)."""
    up = set(start)
    seen = {frozenset(up)}
    for e in events:
        up = up | set(e.devices) if e.action == "rejoin" else up - set(e.devices)
        seen.add(frozenset(up))
    return len(seen)


def model_trace(current: StrategyHandle, trace: Sequence[TraceEvent], steps: int,
                profiles: Mapping[str, DeviceProfile] | ProfileSet, model: TraceModel | None = None,
                log: Callable[[str], None] = lambda _m: None, source: str = "") -> dict[str, object]:
    """Goodput (steps per second over the whole trace) of hspmd, checkpoint-restart and an Oobleck-like
    baseline on ``steps`` steps of ``current`` with the failures and returns of ``trace``; each line's time
    broken down (failure-free steps, the extra time of slower steps, recoveries and switches, checkpoint
    writes, the expected cost of losses memory cannot survive) and every event's parts; each line's checkpoint
    interval and the rate it is chosen for (see ``TraceModel``). ``source``: the trace's file, named when the
    trace needs more planner searches than ``model.max_searches`` (refused before any where its distinct
    device sets alone are more; else, as one line naming the event, at the event that would run one more)."""
    model = model or TraceModel()
    events = sorted(trace, key=lambda e: e.step)
    check_trace(current, events, model, source)
    try:
        run = TraceRun(current, events, profiles, model)
        run.play(steps, log)
    except SearchBudgetSpent as err:
        raise SpecError([Problem(source, err.field, str(err))]) from None
    return trace_report(run, steps, settle_checkpoints(run, steps))


def check_trace(current: StrategyHandle, events: Sequence[TraceEvent], model: TraceModel, source: str) -> None:
    """Refuse, before any search, a trace through more device sets than ``model.max_searches`` or a
    coordinator node the cluster lacks."""
    visited = device_sets_visited(current.devices, events)
    if visited > model.max_searches:
        raise SpecError([Problem(source, "events", f"the trace passes through {visited} distinct sets of running "
                                 f"devices, each at least one planner search (seconds each at paper scale): at most "
                                 f"{model.max_searches} searches are modelled per run (simulate --max-searches)")])
    cluster = current.ctx.cluster
    coordinator = model.coordinator_node or cluster.nodes[0].name
    if coordinator not in {n.name for n in cluster.nodes}:
        raise HspmdError(f"coordinator_node: {coordinator!r} is not a node of cluster {cluster.name!r}")


class Layouts:
    """The layouts the modelled lines run, each planned once per device set (``PlanMemo`` charges the
    searches and times them)."""

    def __init__(self, current: StrategyHandle, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                 model: TraceModel, memo: PlanMemo, t0_time: float) -> None:
        self.original = current
        self.ctx = current.ctx
        self.profiles = profiles
        self.model = model
        self.memo = memo
        self.t0_time = t0_time
        self.node_of = {d.id: d.node for d in self.ctx.cluster.devices}
        self.plans: dict[tuple[tuple[int, ...], bool], tuple[StrategyHandle, float]] = {}
        self.symmetric: dict[tuple[int, ...], tuple[StrategyHandle, float]] = {}
        self.templates: dict[tuple[int, ...], tuple[Pipeline, ...]] = {}

    def best_on(self, devices: Collection[int], zero: bool = False) -> tuple[StrategyHandle, float]:
        """The planner's best plan on ``devices`` (ZeRO-1 as ``zero`` says) and its step time."""
        ctx, t, model = self.ctx, self.ctx.plan.training, self.model
        key = (tuple(sorted(devices)), zero)
        if key not in self.plans:
            settings = settings_for(t, use_zero=zero, time_limit_s=model.time_limit_s, top_k=1)
            result = self.memo.timed(lambda: plan(ctx.model, ctx.cluster, self.profiles, settings, devices=key[0],
                                                  baselines=False))
            p = result.to_plan(ctx.plan.model, ctx.plan.cluster, 0)
            self.plans[key] = (StrategyHandle.of(dataclasses.replace(ctx, plan=p)), result.candidates[0].step_time_s)
        return self.plans[key]

    def symmetric_on(self, devices: Collection[int]) -> tuple[StrategyHandle, float]:
        """Megatron's layout on these devices (ZeRO-1 as restart's, ``model.restart_zero``): the best symmetric
        plan over all of them or over one type's."""
        ctx, t, model = self.ctx, self.ctx.plan.training, self.model
        key = tuple(sorted(devices))
        if key not in self.symmetric:
            settings = settings_for(t, use_zero=model.restart_zero, time_limit_s=model.time_limit_s, top_k=1)
            every = {b: CostModel(ctx.model, ctx.cluster, self.profiles, micro_batch=b, seq_len=t.seq_len)
                     for b in micro_batch_sizes(settings)}
            found = [self.memo.timed(lambda f=f: f(every, key, t.global_batch, settings.zero,
                                                   schedule=settings.default_schedule))
                     for f in (best_symmetric, best_symmetric_subset)]
            ok = [b for b in found if b.strategy is not None and b.estimate is not None and b.micro_batch is not None]
            if not ok:
                raise InfeasibleError(f"megatron restart: no symmetric layout on devices {list(key)}: "
                                      + "; ".join(b.description for b in found))
            best = min(ok, key=lambda b: b.estimate.step_time_s)  # type: ignore[union-attr]
            assert best.strategy is not None and best.estimate is not None and best.micro_batch is not None
            self.symmetric[key] = (planner_handle(every[best.micro_batch], best.strategy, t.global_batch,
                                                  settings.default_schedule, settings.zero),
                                   best.estimate.step_time_s)
        return self.symmetric[key]

    def template_on(self, devices: Collection[int]) -> tuple[Pipeline, ...]:
        """Oobleck's template for these devices, planned ahead: the planner's plan at the run's micro-batch
        (none when nothing fits on them)."""
        ctx, t, model = self.ctx, self.ctx.plan.training, self.model
        key = tuple(sorted(devices))
        if key not in self.templates:
            settings = settings_for(t, micro_batch=t.micro_batch, use_zero=False, time_limit_s=model.time_limit_s,
                                    top_k=1)
            try:
                result = self.memo.timed(lambda: plan(ctx.model, ctx.cluster, self.profiles, settings, devices=key,
                                                      baselines=False))
                self.templates[key] = result.to_plan(ctx.plan.model, ctx.plan.cluster, 0).strategies[0].pipelines
            except SearchBudgetSpent:
                raise
            except InfeasibleError:
                self.templates[key] = ()
        return self.templates[key]

    def oobleck_on(self, down: set[int]) -> tuple[StrategyHandle, float] | None:
        """The original pipelines on whole nodes plus a template on the broken ones' other whole-node
        devices (None: nothing left that fits)."""
        original, node_of = self.original, self.node_of
        lost_nodes = {node_of[d] for d in down}
        off = {d for d in original.devices if node_of[d] in lost_nodes}
        if not off:
            return original, self.t0_time
        broken = [p for p in original.strategy.pipelines if set(p.devices) & off]
        if not broken:
            return original, self.t0_time
        free = sorted({d for p in broken for d in p.devices} - off)
        fixed = repair(original, off, self.profiles, self.template_on(free) if free else ())
        if fixed is None:
            return None
        p, step_time = fixed
        return StrategyHandle.of(dataclasses.replace(self.ctx, plan=p)), step_time


class TraceRun:
    """The lines' run through a trace's events (``play``): each line's layout, step time and every event's
    parts as it meets them."""

    def __init__(self, current: StrategyHandle, events: Sequence[TraceEvent],
                 profiles: Mapping[str, DeviceProfile] | ProfileSet, model: TraceModel) -> None:
        ctx = current.ctx
        cluster = ctx.cluster
        self.events = events
        self.model = model
        self.profiles = profiles
        self.cluster = cluster
        self.coordinator = model.coordinator_node or cluster.nodes[0].name
        self.t0_time = modelled_step_time(current, profiles)
        self.node_of = {d.id: d.node for d in cluster.devices}
        self.nodes = {n.name: {d.id for d in cluster.devices if d.node == n.name} for n in cluster.nodes}
        self.original = current
        self.memo = PlanMemo(model.max_searches)
        self.layouts = Layouts(current, profiles, model, self.memo, self.t0_time)
        self.usable = set(current.devices) | {x for ev in events for x in ev.devices}
        # The restart lines: each its layout on the surviving whole nodes.
        self.restarts: dict[str, Callable[[Collection[int]], tuple[StrategyHandle, float]]] = {
            "restart": lambda devs: self.layouts.best_on(devs, model.restart_zero)}
        if model.megatron_restart:
            self.restarts["megatron_restart"] = self.layouts.symmetric_on
        start = sorted(self.usable & set(current.devices))
        self.lines = {"hspmd": TraceLine("hspmd", current, self.t0_time, self.t0_time)}
        for name, pick in self.restarts.items():
            first, first_s = pick(start)
            self.lines[name] = TraceLine(name, first, first_s, first_s)
        self.lines["oobleck_like"] = TraceLine("oobleck_like", current, self.t0_time, self.t0_time)
        self.r0_time = self.lines["restart"].base_step_time_s
        self.ck = restart_cost(ctx.model, self.t0_time, model.restart)
        self.failures = sum(1 for e in events if e.action != "rejoin")
        # A restart from a checkpoint reads it and restarts the processes (then half an interval is redone).
        self.from_checkpoint = {"read": self.ck.read_s, "restart": model.restart.restart_s}
        self.down: set[int] = set()
        self.h_since = 1  # the step from which hspmd's current layout runs (its losses are planned ahead from there)
        self.world = set(current.devices)  # the devices in hspmd's world (the coordinator's ``alive``)

    def detect(self, e: TraceEvent, restart: bool) -> float:
        """How long ``e`` takes to be seen: a process death at once, a node's loss at the agent timeout (hspmd)
        or the NCCL timeout (``restart``)."""
        if e.node is None:
            return self.model.detect_s
        return self.model.restart_node_loss_detect_s if restart else self.model.node_loss_detect_s

    def preplanned(self, handle: StrategyHandle, alive: Collection[int], out: Collection[int], ran_s: float,
                   plan_s: float, *, lost: Collection[int] = (), joining: Collection[int] = ()) -> bool:
        """Whether hspmd's coordinator had this loss (or return) planned ahead: a candidate of the layout (the
        rules of runtime/torchfree/elastic/preplan.py: its losses, then the returns of the devices ``out`` of every
        world) once the layout ran long enough to plan every candidate up to its own at ``plan_s`` each."""
        if not self.model.preplan:
            return False
        losses, back = candidates(handle, alive), returns(handle, out)
        if lost:
            return any(survivors(handle, c) == survivors(handle, lost) for c in losses) and \
                ran_s >= len(losses) * plan_s
        return any(grown(handle, c) == grown(handle, joining) for c in back) and \
            ran_s >= (len(losses) + len(back)) * plan_s

    def play(self, steps: int, log: Callable[[str], None]) -> None:
        """Every event in turn, on every line; then the steps after the last."""
        prev = 1
        for i, e in enumerate(self.events):
            self.memo.at = f"events[{i}]"
            for line in self.lines.values():
                line.run(e.step - prev)
            prev = e.step
            steps_left = steps - e.step + 1
            alive_before = self.usable - self.down
            if e.action == "rejoin":
                self.down -= set(e.devices)
            else:
                self.down |= set(e.devices)
            log(f"step {e.step}: {e.action} {list(e.devices)}")
            self.hspmd_event(e, steps_left, alive_before)
            self.restart_events(e, steps_left)
            self.oobleck_event(e)
        for line in self.lines.values():
            line.run(steps - prev + 1)

    def hspmd_event(self, e: TraceEvent, steps_left: int, alive_before: set[int]) -> None:
        """hspmd meets ``e``: a return is decided by ``grow``; a loss of its devices is replanned in memory,
        or restarted from the checkpoint when state is lost or the coordinator's node is gone."""
        h = self.lines["hspmd"]
        before = h.step_time_s
        if e.action != "rejoin":
            self.world -= set(e.devices)
        t0, saved = time.perf_counter(), self.memo.saved_s
        if e.action == "rejoin":
            self.hspmd_return(e, steps_left, alive_before, before, t0, saved)
        elif set(e.devices) & set(h.handle.devices) or e.node == self.coordinator:
            self.hspmd_loss(e, steps_left, alive_before, before, t0, saved)

    def hspmd_return(self, e: TraceEvent, steps_left: int, alive_before: set[int], before: float, t0: float,
                     saved: float) -> None:
        h, memo, model = self.lines["hspmd"], self.memo, self.model
        g = grow(h.handle, e.devices, self.profiles, steps_left=steps_left, time_limit_s=model.time_limit_s,
                 switch=model.switch, memo=memo)
        wall = time.perf_counter() - t0 + memo.saved_s - saved
        out = set(range(self.cluster.num_devices)) - self.world
        ahead = self.preplanned(h.handle, alive_before, out, (e.step - self.h_since) * before, wall,
                                joining=e.devices)
        # decided ahead: a lookup, then (adopted) the coordinator plans the fused BSR of the plan found
        parts = {"decide": wall if not ahead else 0.0}
        if g.adopt and g.context is not None:
            target = StrategyHandle.of(g.context)
            if ahead:
                t1 = time.perf_counter()
                plan_switch(h.handle, target, ())
                parts["decide"] = time.perf_counter() - t1
            self.world |= set(target.devices) & set(e.devices)
            h.handle, h.step_time_s = target, g.step_time_s
            parts["switch"] = g.switch_s
            self.h_since = e.step
        h.event(e, parts, before, adopted=g.adopt, preplanned=ahead, planner_wall_s=wall)

    def hspmd_loss(self, e: TraceEvent, steps_left: int, alive_before: set[int], before: float, t0: float,
                   saved: float) -> None:
        h, memo, model = self.lines["hspmd"], self.memo, self.model
        r, cause = None, "the coordinator's node lost"  # the job itself is gone: nothing to replan
        if e.node != self.coordinator:
            try:
                r = replan(h.handle, set(e.devices), self.profiles, time_limit_s=model.time_limit_s,
                           steps_left=steps_left, memo=memo)
            except LostStateError:
                cause = "state lost"
        if r is None:
            h.handle, h.step_time_s = self.layouts.best_on([d for d in h.handle.devices if d not in e.devices])
            self.world = set(h.handle.devices)
            h.restarted(e, {"detect": self.detect(e, False), **self.from_checkpoint}, before, restarted=cause)
        else:
            wall = time.perf_counter() - t0 + memo.saved_s - saved
            ahead = self.preplanned(h.handle, alive_before, (), (e.step - self.h_since) * before, wall,
                                    lost=e.devices)
            if ahead:  # the coordinator looks the plan up and plans its fused BSR
                t1 = time.perf_counter()
                plan_switch(h.handle, StrategyHandle.of(r.context), set(e.devices))
                replan_s = time.perf_counter() - t1
            else:
                replan_s = wall
            parts = {"detect": self.detect(e, False), "replan": replan_s,
                     "transfer": r.chosen.modelled_switch_s, "regroup": model.switch.regroup_s,
                     "step_redone": before / 2}
            h.handle, h.step_time_s = StrategyHandle.of(r.context), r.chosen.step_time_s
            h.event(e, parts, before, chosen=r.chosen.label, fastest_option_s=r.options[0].step_time_s,
                    preplanned=ahead, planner_wall_s=wall)
            h.windows.append(sum(parts.values()))
        self.h_since = e.step

    def restart_events(self, e: TraceEvent, steps_left: int) -> None:
        """The restart lines meet ``e``: whole nodes only; a loss of their devices restarts from the checkpoint,
        a node whole again is taken back with a planned restart when that pays."""
        down, ck = self.down, self.ck
        whole = sorted(d for n, devs in self.nodes.items() if not devs & down for d in devs if d in self.usable)
        if not whole:  # one node (or every node hit): it restarts without the failed devices only
            whole = sorted(self.usable - down)
        for name, pick in self.restarts.items():
            rs = self.lines[name]
            before = rs.step_time_s
            if e.action != "rejoin" and set(e.devices) & set(rs.handle.devices):
                rs.handle, rs.step_time_s = pick(whole)
                rs.restarted(e, {"detect": self.detect(e, True), **self.from_checkpoint}, before,
                             nodes_dropped=sorted({self.node_of[d] for d in down}))
            elif e.action == "rejoin" and set(whole) != set(rs.handle.devices):
                cand, cand_s = pick(whole)
                planned = {"write": ck.write_s, "read": ck.read_s, "restart": self.model.restart.restart_s}
                if pays(rs.step_time_s, cand_s, steps_left, sum(planned.values())):
                    rs.handle, rs.step_time_s = cand, cand_s
                    rs.event(e, planned, before, adopted=True)
                else:
                    rs.event(e, {}, before, adopted=False)

    def oobleck_event(self, e: TraceEvent) -> None:
        """The Oobleck-like line meets ``e``: templates re-instantiated on the whole nodes, or a restart."""
        ob = self.lines["oobleck_like"]
        before = ob.step_time_s
        layout = self.layouts.oobleck_on(self.down)
        if layout is not None and layout[0].describe() == ob.handle.describe():
            return  # the event changes nothing it runs
        if e.action != "rejoin" and (layout is None or e.node == self.coordinator
                                     or lost_tensors(ob.handle, set(e.devices))):
            alive = [d for d in ob.handle.devices if d not in self.down]
            ob.handle, ob.step_time_s = self.layouts.best_on(alive)
            ob.restarted(e, {"detect": self.detect(e, False), **self.from_checkpoint}, before, restarted=True)
        elif layout is not None:
            bsr = plan_switch(ob.handle, layout[0], set(e.devices) if e.action != "rejoin" else ())
            parts = {"regroup": self.model.switch.regroup_s,
                     "broadcast": bsr.total_bytes / (self.cluster.inter_node_bandwidth_gbs * 1e9)}
            if e.action != "rejoin":
                parts = {"detect": self.detect(e, False), **parts, "step_redone": before / 2}
            ob.handle, ob.step_time_s = layout
            ob.event(e, parts, before)
            if e.action != "rejoin":
                ob.windows.append(sum(parts.values()))


@dataclass(frozen=True)
class Checkpoints:
    """Each line's checkpoint interval and what it was chosen against (``settle_checkpoints``)."""

    rates: FailureRates
    given: int | None
    restart_interval: int | None
    per_line: Mapping[str, Mapping[str, object]]


def settle_checkpoints(run: TraceRun, steps: int) -> Checkpoints:
    """Checkpoints: each line at Young's optimum for the failures it must checkpoint against (the restart
    lines: every failure of the trace; hspmd and the Oobleck-like line: the losses memory cannot survive,
    whose expected cost each is charged), or every line at the given interval; each line's lost work and
    writes settled."""
    model, ck, failures = run.model, run.ck, run.failures
    rates = FailureRates.of_trace(run.events, run.cluster, steps * run.t0_time)
    holders: dict[str, frozenset[frozenset[int]]] = {}

    def layout_rate(handle: StrategyHandle, window_s: float) -> float:
        key = handle.describe()
        if key not in holders:
            holders[key] = holder_sets(handle)
        return unrecoverable_rate(holders[key], run.node_of, rates, window_s, run.coordinator)

    given = model.checkpoint_interval_steps
    restart_interval = given or young_interval_steps(ck.write_s, run.r0_time, steps * run.r0_time, failures)
    checkpointing: dict[str, dict[str, object]] = {}
    for name, line in run.lines.items():
        info: dict[str, object]
        if given is not None or name in run.restarts:
            base = line.base_step_time_s
            interval = given or young_interval_steps(ck.write_s, base, steps * base, failures)
            expected, per = 0.0, []
            info = {"against": "given interval" if given is not None else "every failure of the trace",
                    "failures_per_s": failures / (steps * base)}
        else:
            window = (model.recovery_window_s if model.recovery_window_s is not None else
                      max(line.windows, default=model.node_loss_detect_s + model.switch.regroup_s))
            per = [(sec, st, hd, layout_rate(hd, window)) for sec, st, hd in line.segments]
            expected = sum(sec * r for sec, _, _, r in per)
            interval = young_interval_steps(ck.write_s, line.base_step_time_s, line.steps_s, expected)
            info = {"against": "losses memory cannot survive", "failures_per_s": expected / line.steps_s,
                    "recovery_window_s": window, "expected_losses": expected,
                    "layouts": [{"plan": hd.describe(), "seconds": sec, "step_time_s": st, "losses_per_s": r}
                                for sec, st, hd, r in per]}
        interval = None if interval is None else min(interval, steps)
        every = interval or steps  # no periodic checkpoint: a loss redoes half the run on average
        line.settle(every)
        line.checkpoint_s = (steps // interval if interval else 0) * ck.write_s
        if expected:
            per_loss = {"detect": model.node_loss_detect_s, **run.from_checkpoint}
            line.unrecoverable_s = sum(sec * r * (sum(per_loss.values()) + every / 2 * st) for sec, st, _, r in per)
            info["cost_per_loss_s"] = {**per_loss, "lost_work": "half an interval at the step time then"}
        checkpointing[name] = {**info, "interval_steps": interval, "writes": steps // interval if interval else 0,
                               "write_s": line.checkpoint_s, "unrecoverable_losses_expected_s": line.unrecoverable_s}
    return Checkpoints(rates, given, restart_interval, checkpointing)


def trace_report(run: TraceRun, steps: int, cp: Checkpoints) -> dict[str, object]:
    """``model_trace``'s result: every line's time, breakdown, events and checkpoints, the goodput ratios (also
    with every line charged restart's writes, ``same_checkpoints``), and the assumptions."""
    lines, ck = run.lines, run.ck
    restart_interval = cp.restart_interval
    restart_writes = (steps // restart_interval if restart_interval else 0) * ck.write_s
    same = {name: line.time_at(min(restart_interval or steps, steps), restart_writes) for name, line in lines.items()}
    out = {name: {**line.to_json(steps), "checkpoint": cp.per_line[name]} for name, line in lines.items()}
    gp = {name: steps / line.time_s for name, line in lines.items()}
    return {"steps": steps, "events": len(run.events), "initial_step_time_s": run.t0_time,
            "checkpoint": {"write_s": ck.write_s, "read_s": ck.read_s, "bytes": ck.checkpoint_bytes,
                           "interval_rule": "given" if cp.given else "Young's optimum for the failures each line "
                           "must checkpoint against",
                           "failure_rates": {"device_per_s": cp.rates.device_per_s, "node_per_s": cp.rates.node_per_s},
                           "coordinator_node": run.coordinator},
            **out,
            "modelled_goodput_over_restart": gp["hspmd"] / gp["restart"],
            "modelled_goodput_over_oobleck_like": gp["hspmd"] / gp["oobleck_like"],
            **({"modelled_goodput_over_megatron_restart": gp["hspmd"] / gp["megatron_restart"]}
               if "megatron_restart" in gp else {}),
            "same_checkpoints": {"interval_steps": restart_interval, "write_s": restart_writes,
                                 **{f"{name}_total_s": v for name, v in same.items()}},
            "modelled_goodput_over_restart_same_checkpoints": same["restart"] / same["hspmd"],
            "modelled_goodput_over_oobleck_like_same_checkpoints": same["oobleck_like"] / same["hspmd"],
            "assumptions": assumptions(run, steps, cp)}


def assumptions(run: TraceRun, steps: int, cp: Checkpoints) -> dict[str, object]:
    """What ``model_trace`` assumed, in words (with the figures it used)."""
    model, ck, cluster, lines = run.model, run.ck, run.cluster, run.lines
    given, restart_interval, rates, checkpointing = cp.given, cp.restart_interval, cp.rates, cp.per_line
    failures, t0_time, r0_time, coordinator = run.failures, run.t0_time, run.r0_time, run.coordinator
    return {
                "lines": TraceModel.__doc__.split("\n\n")[0].strip(),
                **dict(zip(("checkpoint_bytes", "checkpoint_io", "restart_s"), ck.assumptions()[:3])),
                "checkpoint_interval": (f"every line every {given} steps (given)" if given else
                                        "Young's optimum sqrt(2 x write time x MTBF), at most the run: restart "
                                        f"against the trace's {failures} failure(s) ({restart_interval} steps); hspmd "
                                        f"and Oobleck-like against the losses memory cannot survive "
                                        f"({checkpointing['hspmd']['interval_steps']} and "
                                        f"{checkpointing['oobleck_like']['interval_steps']} steps); a restart "
                                        "redoes half an interval on average"),
                "failure_rates": (f"the trace's: {rates.device_per_s:.3g} failures/s per device (devices failed "
                                  f"alone / {cluster.num_devices} devices / {steps * t0_time:.0f} s), "
                                  f"{rates.node_per_s:.3g}/s per node (node losses / {len(cluster.nodes)} nodes); "
                                  "independent Poisson processes"),
                "unrecoverable_losses": ("the coordinator's node lost, or every holder of some piece of state "
                                         "(a parameter cell, a ZeRO-1 moment chunk) lost by one failure or by two "
                                         "within one recovery window, on the layout running at the time; losses "
                                         "needing three or more failures in one window left out; each costs "
                                         "detection (a lost node's), a checkpoint read, a restart and half an "
                                         "interval redone, charged at its expected rate x time"),
                "coordinator_node": f"{coordinator} (hspmd's coordinator and the Oobleck-like master)",
                "recovery_window_s": ("given: " + f"{model.recovery_window_s:g} s" if model.recovery_window_s
                                      is not None else "each line's longest in-memory recovery in the trace: "
                                      + ", ".join(f"{n} {checkpointing[n].get('recovery_window_s', 0):.3g} s"
                                                  for n in ("hspmd", "oobleck_like"))),
                "detection": (f"a process death {model.detect_s:g} s; a lost node {model.node_loss_detect_s:g} s "
                              f"for hspmd (agent timeout), {model.restart_node_loss_detect_s:g} s for restart "
                              "(NCCL timeout)"),
                "regroup_s": f"regroup and program build {model.switch.regroup_s:g} s per switch",
                "restart_plan": ("restart runs the planner's best non-elastic plan"
                                 f"{' with ZeRO-1' if model.restart_zero else ''} ({r0_time:.4g} s/step against "
                                 f"hspmd's elastic {t0_time:.4g} s/step): hspmd's fault handling alone"
                                 + (f"; megatron_restart runs the best symmetric plan, as Megatron itself would "
                                    f"({lines['megatron_restart'].base_step_time_s:.4g} s/step)"
                                    if "megatron_restart" in lines else "")),
                "planner_wall_time": ("hspmd's replan and grow-decision parts are the planner's wall time measured "
                                      "on the machine that runs this model (inflated when it is loaded)"
                                      + ("; a failure planned ahead (a single device or node of the running layout, "
                                         "the layout run for as long as one replan per candidate takes) costs the "
                                         "planning of its fused BSR instead; a return planned ahead (a device or "
                                         "node out of every world, decided after the layout's losses) costs a "
                                         "lookup, plus that planning when adopted" if model.preplan else "")),
    }
