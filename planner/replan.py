"""A new plan after a failure, chosen with the cost of switching to it in view.

``replan(ctx, strategy, failed, profiles)``:

1. Every parameter must still have a surviving replica, and under ZeRO-1 every moment chunk a surviving
   copy (``runtime.torchfree.elastic.state.lost_state``, the coordinator's check); if not, ``LostStateError`` names
   what is lost (the run cannot continue in memory).
2. Candidates: the planner's near-best plans on the survivors (``planner.api.plan`` with
   ``devices=survivors``, elastic when the survivors allow it, ZeRO off), plus a *repair* of the current
   plan: its pipelines that lost no device, with the micro-batches of the broken ones spread over them
   (nothing moves at all: every survivor keeps what it holds).
3. Each candidate is priced twice: its step time (the cost model) and its switch (the fused BSR of
   every parameter and AdamW moment from the current layout, failed devices excluded: bytes, bytes per
   link, modelled time). Only candidates within ``tolerance`` of the fastest step time are considered.
   With ``steps_left`` known (a running job), the one with the least modelled time over the rest of the
   run wins: its switch plus its step time x the steps left (a plan a few percent slower to save a second
   of transfer costs minutes over hundreds of steps). Without it, the one that moves the fewest bytes
   wins (then the faster).
4. For comparison, the modelled cost of checkpoint-restart (``RestartModel``: every assumption is a
   field, printed by ``RestartCost.assumptions``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from planner.api import PlanResult, PlanSettings, plan
from planner.cost import CostModel, has_tp_stage, zero_copies
from runtime.torchfree.comm.bsr import BsrPlan
from runtime.torchfree.elastic.state import STATE_SUFFIXES, LostState, lost_state, plan_switch
from runtime.torchfree.errors import HspmdError, InfeasibleError
from runtime.torchfree.profiling.profile import DeviceProfile, ProfileSet
from runtime.torchfree.schedule_policies import schedule_problems
from runtime.torchfree.spec import Plan, PlanContext, Strategy, validate_plan
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Pipeline, TrainingSettings

T = TypeVar("T")

DEFAULT_TOLERANCE = 0.05
STATE_BYTES_PER_PARAM = 4 * len(STATE_SUFFIXES)  # fp32 parameter + two fp32 AdamW moments (a checkpoint)


class LostStateError(HspmdError):
    """Some piece of the state (a slice of a parameter, or under ZeRO-1 a chunk of its moments) has no
    surviving copy: no plan on the survivors can start from memory. ``lost``: the coordinator's own verdict
    (``runtime.torchfree.elastic.state.lost_state``), so ``hspmd replan`` answers as a running job would."""

    def __init__(self, lost: LostState, replicated: bool = False) -> None:
        self.lost = lost
        self.failed = lost.failed
        self.replicated = replicated   # the plan had >= 2 pipelines: every copy sat on the failed devices
        super().__init__("; ".join(self.lines()))

    def lines(self) -> list[str]:
        if self.lost.tensors and self.replicated:
            keep = ("every replica of these sat on the failed devices: a layout whose replicas span nodes survives "
                    "that (hspmd plan --elastic --node-loss-tolerance, docs/planning.md)")
        elif self.lost.tensors:
            keep = "plan with --elastic to keep >= 2 pipelines"
        else:
            keep = "keep more copies of each chunk: a higher training.zero_redundancy, or zero: false"
        return [f"device(s) {', '.join(map(str, self.failed))}: {self.lost.what()}, so no plan can continue from "
                f"memory (the last checkpoint is what is left: restart from it with --load; {keep}):",
                *self.lost.details()]


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
           model_ref: str | None = None, cluster_ref: str | None = None, steps_left: int | None = None,
           memo: PlanMemo | None = None) -> ReplanResult:
    """The plan to switch to when ``failed`` devices of ``current`` are lost (see the module docstring).

    The survivors are the strategy's other devices (a running job has processes only there). Raises
    LostStateError when a parameter lost every replica or a ZeRO-1 moment chunk every copy, InfeasibleError
    when no plan fits the survivors.
    """
    if tolerance < 0:
        raise ValueError("tolerance must not be negative")
    if steps_left is not None and steps_left < 0:
        raise ValueError("steps_left must not be negative")
    ctx = current.ctx
    failed = frozenset(failed)
    unknown = sorted(failed - set(range(ctx.cluster.num_devices)))
    if unknown:
        raise HspmdError(f"--failed: device(s) {unknown} are not in cluster {ctx.cluster.name!r} "
                         f"(devices 0-{ctx.cluster.num_devices - 1})")
    idle = sorted(failed - set(current.devices))
    notes = [f"device(s) {idle} are idle in strategy {current.name!r}: losing them changes nothing"] if idle else []
    lost = lost_state(current, failed)
    if lost:
        raise LostStateError(lost, replicated=len(current.strategy.pipelines) >= 2)
    survivors = tuple(d for d in current.devices if d not in failed)
    model_ref = model_ref or ctx.plan.model
    cluster_ref = cluster_ref or ctx.plan.cluster
    current_time = modelled_step_time(current, profiles)

    plans: list[tuple[Literal["planner", "repair"], int, Plan, float, str]] = []
    result, refused = _plan_elastic(current, survivors, profiles, time_limit_s, top_k, memo)
    if refused is not None:
        notes.append(f"no elastic plan (>= 2 pipelines) fits the survivors ({refused}); planning without that")
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
        target = StrategyHandle.of(dataclasses.replace(ctx, plan=p))
        bsr = plan_switch(current, target, failed)
        options.append(Option(origin, rank, p, step_time, summary, bsr, bsr.modelled_time(ctx.cluster),
                              bsr.lower_bound(ctx.cluster)))
    options.sort(key=lambda o: (o.step_time_s, o.switch_bytes))
    chosen = choose(options, tolerance, steps_left)
    return ReplanResult(tuple(sorted(failed)), survivors, current_time, tuple(options), chosen, tolerance,
                        restart_cost(ctx.model, current_time, restart or RestartModel()),
                        dataclasses.replace(ctx, plan=chosen.plan), tuple(notes))


def modelled_step_time(handle: StrategyHandle, profiles: Mapping[str, DeviceProfile] | ProfileSet) -> float:
    """The cost model's step time of a running strategy (its plan's batch, schedule and ZeRO copies)."""
    ctx, t = handle.ctx, handle.ctx.plan.training
    cm = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles)
    return cm.estimate(handle.strategy, t.global_batch, t.schedule, zero_copies(t)).step_time_s


def settings_for(t: TrainingSettings, model: ModelSpec | None = None, **choices: object) -> PlanSettings:
    """The planner's request for a running plan's batch, sequence length, seed, optimizer and schedule. A
    mixture-of-experts ``model`` keeps its micro-batch size: its balance loss and expert capacity are per
    forward, so another size would train other numbers than the run so far."""
    if model is not None and model.moe is not None:
        choices.setdefault("micro_batch", t.micro_batch)
    choices.setdefault("schedule", t.schedule)
    return PlanSettings(global_batch=t.global_batch, seq_len=t.seq_len, seed=t.seed, optimizer=t.optimizer,
                        **choices)  # type: ignore[arg-type]


class SearchBudgetSpent(InfeasibleError):
    """A modelled trace (planner/trace_model.py) asked for more planner searches than its
    ``TraceModel.max_searches``; ``field``: the event that asked (``events[i]``), or "" for the run's start."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class PlanMemo:
    """The planner's results by (settings, devices) within one modelled trace (its model, cluster and profiles
    fixed): a trace repeats device sets (a device lost and back, again and again), and each search is ~0.4 s on
    the tiny model (200 such events took 50 s). A repeat is charged the wall time its search took once
    (``saved_s``), so the modelled figures stay those of a coordinator that plans every event.

    It also counts the searches the trace runs (``charge``: every planner search of the modelled lines, not
    the repeats), and stops at ``max_searches``: a trace of 1000 distinct device sets on a paper-scale cluster
    was 1000+ searches of 8-10 s each, hours of work for one command."""

    def __init__(self, max_searches: int | None = None) -> None:
        self.found: dict[tuple[PlanSettings, tuple[int, ...]], tuple[tuple[PlanResult, str | None], float]] = {}
        self.saved_s = 0.0
        self.max_searches = max_searches
        self.searches = 0
        self.search_s = 0.0  # wall time of the searches run
        self.at = "events"  # the trace's event being modelled (its field), for SearchBudgetSpent

    def charge(self) -> None:
        """Count one planner search about to run; SearchBudgetSpent when it is one beyond the budget."""
        if self.max_searches is not None and self.searches >= self.max_searches:
            raise SearchBudgetSpent(self.at, f"needs a planner search beyond the {self.searches} run so far "
                                    f"({self.search_s:.0f} s): at most {self.max_searches} are modelled per run "
                                    "(simulate --max-searches)")
        self.searches += 1

    def timed(self, search: Callable[[], T]) -> T:
        """Run one planner search, charged and timed."""
        self.charge()
        t0 = time.perf_counter()
        try:
            return search()
        finally:
            self.search_s += time.perf_counter() - t0


def _plan_elastic(current: StrategyHandle, devices: Sequence[int], profiles: Mapping[str, DeviceProfile] | ProfileSet,
                  time_limit_s: float, top_k: int, memo: PlanMemo | None = None) -> tuple[PlanResult, str | None]:
    """The planner on ``devices``: elastic (>= 2 pipelines) keeping the run's ZeRO choice (an elastic ZeRO-1
    plan keeps 2 copies of every chunk) where that fits, else neither; with why the elastic one did not."""
    ctx, t = current.ctx, current.ctx.plan.training
    settings = settings_for(t, ctx.model, elastic=True, use_zero=t.zero, time_limit_s=time_limit_s, top_k=top_k)
    key = (settings, tuple(devices))
    if memo is not None and key in memo.found:
        found, wall = memo.found[key]
        memo.saved_s += wall
        return found
    t0 = time.perf_counter()
    search = memo.timed if memo is not None else lambda f: f()
    try:
        found = search(lambda: plan(ctx.model, ctx.cluster, profiles, settings, devices=devices,
                                    baselines=False)), None
    except SearchBudgetSpent:
        raise
    except InfeasibleError as err:
        found = search(lambda: plan(ctx.model, ctx.cluster, profiles,
                                    dataclasses.replace(settings, elastic=False, use_zero=False), devices=devices,
                                    baselines=False)), str(err)
    if memo is not None:
        memo.found[key] = (found, time.perf_counter() - t0)
    return found


def choose(options: list[Option], tolerance: float, steps_left: int | None = None) -> Option:
    """Among the options within ``tolerance`` of the fastest step time: with ``steps_left``, the one with the
    least modelled switch + step time x steps left (then the fewer bytes, the planner's order); without, the
    one that moves the fewest bytes (then the faster, then the planner's order)."""
    if not options:
        raise InfeasibleError("no candidate plan for the survivors")
    best = min(o.step_time_s for o in options)
    near = [o for o in options if o.step_time_s <= best * (1 + tolerance)]
    if steps_left is not None:
        return min(near, key=lambda o: (o.modelled_switch_s + o.step_time_s * steps_left, o.switch_bytes,
                                        o.origin != "planner", o.rank))
    return min(near, key=lambda o: (o.switch_bytes, o.step_time_s, o.origin != "planner", o.rank))


def repair(current: StrategyHandle, failed: Collection[int],
           profiles: Mapping[str, DeviceProfile] | ProfileSet,
           extra: Sequence[Pipeline] = ()) -> tuple[Plan, float] | None:
    """The current plan without the pipelines that lost a device (plus ``extra`` pipelines, e.g. templates
    instantiated on the broken pipelines' other devices), the micro-batches spread over them to even out
    the pipelines' times (cost model); None when no pipeline is left, when there are too few micro-batches,
    or when it does not fit in memory."""
    ctx, strat = current.ctx, current.strategy
    t = ctx.plan.training
    keep = [p for p in strat.pipelines if not set(p.devices) & set(failed)]
    if len(keep) == len(strat.pipelines):
        return None
    keep += list(extra)
    if not keep:
        return None
    total = t.global_batch // t.micro_batch
    # At least a micro-batch per stage for 1F1B (its time is linear in them from there) and wherever the
    # schedule needs them (interleaved: schedule_problems), else one.
    need = [len(p.stages) if t.schedule == "1f1b" or schedule_problems(
        p.schedule or t.schedule, len(p.stages), 1, p.stages[0].chunks) else 1 for p in keep]
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
    # ZeRO-1's copies need as many pipelines: fewer left, and the moments are kept whole. Sequence
    # parallelism acts on TP stages: a repair that dropped the last of them must not keep it on.
    training = t if len(keep) >= t.zero_redundancy else dataclasses.replace(t, zero=False, zero_redundancy=1)
    training = dataclasses.replace(training, sequence_parallel=t.sequence_parallel and has_tp_stage(repaired))
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
         model_ref: str | None = None, cluster_ref: str | None = None, memo: PlanMemo | None = None) -> GrowResult:
    """The plan on ``current``'s devices plus ``joining`` (elastic when they allow it, ZeRO off), adopted
    only when the step time it saves over ``steps_left`` steps beats the modelled cost of switching to it
    (the state's fused BSR from its holders, plus regrouping)."""
    ctx = current.ctx
    # Device ids were checked where they came in (hspmd train's launcher, the --events trace).
    joining = tuple(sorted(set(joining) - set(current.devices)))
    switch = switch or SwitchModel()
    current_time = modelled_step_time(current, profiles)
    devices = tuple(sorted(set(current.devices) | set(joining)))
    result, _ = _plan_elastic(current, devices, profiles, time_limit_s, 1, memo)
    best = result.candidates[0]
    p = result.to_plan(model_ref or ctx.plan.model, cluster_ref or ctx.plan.cluster, 0)
    target_ctx = dataclasses.replace(ctx, plan=p)
    target = StrategyHandle.of(target_ctx)
    bsr = plan_switch(current, target, ())
    switch_s = bsr.modelled_time(ctx.cluster) + switch.regroup_s
    gain = (current_time - best.step_time_s) * steps_left
    uses = sorted(set(target.devices) & set(joining))
    adopt = bool(uses) and pays(current_time, best.step_time_s, steps_left, switch_s)
    what = (f"with device(s) {', '.join(map(str, joining))}: {best.step_time_s:.4g} s/step predicted vs "
            f"{current_time:.4g} s now; over {steps_left} step(s) left that saves {gain:.3g} s against a modelled "
            f"switch of {switch_s:.3g} s ({bsr.total_bytes / 1e6:.3g} MB)")
    reason = (f"adopt {what}" if adopt else
              f"stay: the best plan leaves device(s) {', '.join(map(str, joining))} idle" if not uses else
              f"stay: {what}")
    return GrowResult(joining, current_time, best.step_time_s, steps_left, gain, switch_s, adopt,
                      target_ctx if adopt else None, reason)


def pays(current_s: float, new_s: float, steps_left: int, cost_s: float) -> bool:
    """Whether switching to a plan of ``new_s`` per step pays for its ``cost_s`` over ``steps_left`` steps (the
    rule for adopting a return, for hspmd's grow and for a restart-based job's planned restart alike)."""
    return (current_s - new_s) * steps_left > cost_s


__all__ = ["DEFAULT_TOLERANCE", "GrowResult", "LostStateError", "Option", "PlanMemo", "ReplanResult", "RestartCost",
           "RestartModel", "SearchBudgetSpent", "SwitchModel", "choose", "grow", "modelled_step_time", "pays", "repair",
           "replan", "restart_cost", "settings_for"]
