"""A new plan after a failure, chosen with the cost of switching to it in view.

``replan(ctx, strategy, failed, profiles)``:

1. Every parameter must still have a surviving replica, and under ZeRO-1 every moment chunk a surviving
   copy (``runtime.elastic.state.lost_state``, the coordinator's check); if not, ``LostStateError`` names
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

from planner.api import PlanResult, PlanSettings, micro_batch_sizes, plan
from planner.baselines import best_symmetric, best_symmetric_subset
from planner.cost import CostModel, has_tp_stage, planner_handle, zero_copies
from runtime.checkpoint import STATE_SUFFIXES
from runtime.comm.bsr import BsrPlan
from runtime.elastic.events import MAX_TRACE_SEARCHES, TraceEvent
from runtime.elastic.preplan import candidates, grown, returns, survivors
from runtime.elastic.state import LostState, holder_sets, lost_state, lost_tensors, plan_switch
from runtime.errors import HspmdError, InfeasibleError, Problem, SpecError
from runtime.launch.options import node_loss_detect_s
from runtime.profiling.profile import DeviceProfile, ProfileSet
from runtime.schedule_policies import schedule_problems
from runtime.spec import Cluster, Plan, PlanContext, Strategy, validate_plan
from runtime.spec.handle import StrategyHandle
from runtime.spec.model import ModelSpec
from runtime.spec.plan import Pipeline, TrainingSettings

T = TypeVar("T")

DEFAULT_TOLERANCE = 0.05
STATE_BYTES_PER_PARAM = 4 * len(STATE_SUFFIXES)  # fp32 parameter + two fp32 AdamW moments (a checkpoint)


class LostStateError(HspmdError):
    """Some piece of the state (a slice of a parameter, or under ZeRO-1 a chunk of its moments) has no
    surviving copy: no plan on the survivors can start from memory. ``lost``: the coordinator's own verdict
    (``runtime.elastic.state.lost_state``), so ``hspmd replan`` answers as a running job would."""

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


def settings_for(t: TrainingSettings, **choices: object) -> PlanSettings:
    """The planner's request for a running plan's batch, sequence length, seed, optimizer and schedule."""
    return PlanSettings(global_batch=t.global_batch, seq_len=t.seq_len, seed=t.seed, optimizer=t.optimizer,
                        schedule=t.schedule, **choices)  # type: ignore[arg-type]


class SearchBudgetSpent(InfeasibleError):
    """A modelled trace asked for more planner searches than its ``TraceModel.max_searches``; ``field``: the
    event that asked (``events[i]``), or "" for the run's start."""

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
    settings = settings_for(t, elastic=True, use_zero=t.zero, time_limit_s=time_limit_s, top_k=top_k)
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


# -- a failure trace, modelled (hspmd simulate --events, scripts/bench_elastic.py) ---------------------------

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
      (runtime/elastic/preplan.py) when the layout had run long enough for that: one replan per candidate
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
    held by one of the device sets ``holders`` (``runtime.elastic.state.holder_sets``): the coordinator's node
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


def pays(current_s: float, new_s: float, steps_left: int, cost_s: float) -> bool:
    """Whether switching to a plan of ``new_s`` per step pays for its ``cost_s`` over ``steps_left`` steps (the
    rule for adopting a return, for hspmd's grow and for a restart-based job's planned restart alike)."""
    return (current_s - new_s) * steps_left > cost_s


@dataclass
class _Line:
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
    """``_model_trace``; a search budget spent mid-trace is one line naming ``source`` and the event."""
    try:
        return _model_trace(current, trace, steps, profiles, model, log, source)
    except SearchBudgetSpent as err:
        raise SpecError([Problem(source, err.field, str(err))]) from None


def _model_trace(current: StrategyHandle, trace: Sequence[TraceEvent], steps: int,
                 profiles: Mapping[str, DeviceProfile] | ProfileSet, model: TraceModel | None,
                 log: Callable[[str], None], source: str) -> dict[str, object]:
    """Goodput (steps per second over the whole trace) of hspmd, checkpoint-restart and an Oobleck-like
    baseline on ``steps`` steps of ``current`` with the failures and returns of ``trace``; each line's time
    broken down (failure-free steps, the extra time of slower steps, recoveries and switches, checkpoint
    writes, the expected cost of losses memory cannot survive) and every event's parts; each line's checkpoint
    interval and the rate it is chosen for (see ``TraceModel``). ``source``: the trace's file, named when the
    trace needs more planner searches than ``model.max_searches`` (refused before any where its distinct
    device sets alone are more; else at the event that would run one more)."""
    model = model or TraceModel()
    events = sorted(trace, key=lambda e: e.step)
    visited = device_sets_visited(current.devices, events)
    if visited > model.max_searches:
        raise SpecError([Problem(source, "events", f"the trace passes through {visited} distinct sets of running "
                                 f"devices, each at least one planner search (seconds each at paper scale): at most "
                                 f"{model.max_searches} searches are modelled per run (simulate --max-searches)")])
    ctx = current.ctx
    t = ctx.plan.training
    cluster = ctx.cluster
    coordinator = model.coordinator_node or cluster.nodes[0].name
    if coordinator not in {n.name for n in cluster.nodes}:
        raise HspmdError(f"coordinator_node: {coordinator!r} is not a node of cluster {cluster.name!r}")
    t0_time = modelled_step_time(current, profiles)
    node_of = {d.id: d.node for d in cluster.devices}
    nodes = {n.name: {d.id for d in cluster.devices if d.node == n.name} for n in cluster.nodes}
    original = current
    plans: dict[tuple[tuple[int, ...], bool], tuple[StrategyHandle, float]] = {}
    memo = PlanMemo(model.max_searches)

    def best_on(devices: Collection[int], zero: bool = False) -> tuple[StrategyHandle, float]:
        key = (tuple(sorted(devices)), zero)
        if key not in plans:
            settings = settings_for(t, use_zero=zero, time_limit_s=model.time_limit_s, top_k=1)
            result = memo.timed(lambda: plan(ctx.model, cluster, profiles, settings, devices=key[0], baselines=False))
            p = result.to_plan(ctx.plan.model, ctx.plan.cluster, 0)
            plans[key] = (StrategyHandle.of(dataclasses.replace(ctx, plan=p)), result.candidates[0].step_time_s)
        return plans[key]

    symmetric: dict[tuple[int, ...], tuple[StrategyHandle, float]] = {}

    def symmetric_on(devices: Collection[int]) -> tuple[StrategyHandle, float]:
        """Megatron's layout on these devices (ZeRO-1 as restart's, ``model.restart_zero``): the best symmetric
        plan over all of them or over one type's."""
        key = tuple(sorted(devices))
        if key not in symmetric:
            settings = settings_for(t, use_zero=model.restart_zero, time_limit_s=model.time_limit_s, top_k=1)
            every = {b: CostModel(ctx.model, cluster, profiles, micro_batch=b, seq_len=t.seq_len)
                     for b in micro_batch_sizes(settings)}
            found = [memo.timed(lambda f=f: f(every, key, t.global_batch, settings.zero,
                                              schedule=settings.default_schedule))
                     for f in (best_symmetric, best_symmetric_subset)]
            ok = [b for b in found if b.strategy is not None and b.estimate is not None and b.micro_batch is not None]
            if not ok:
                raise InfeasibleError(f"megatron restart: no symmetric layout on devices {list(key)}: "
                                      + "; ".join(b.description for b in found))
            best = min(ok, key=lambda b: b.estimate.step_time_s)  # type: ignore[union-attr]
            assert best.strategy is not None and best.estimate is not None and best.micro_batch is not None
            symmetric[key] = (planner_handle(every[best.micro_batch], best.strategy, t.global_batch,
                                             settings.default_schedule, settings.zero), best.estimate.step_time_s)
        return symmetric[key]

    templates: dict[tuple[int, ...], tuple[Pipeline, ...]] = {}

    def template_on(devices: Collection[int]) -> tuple[Pipeline, ...]:
        """Oobleck's template for these devices, planned ahead: the planner's plan at the run's micro-batch
        (none when nothing fits on them)."""
        key = tuple(sorted(devices))
        if key not in templates:
            settings = settings_for(t, micro_batch=t.micro_batch, use_zero=False, time_limit_s=model.time_limit_s,
                                 top_k=1)
            try:
                result = memo.timed(lambda: plan(ctx.model, cluster, profiles, settings, devices=key, baselines=False))
                templates[key] = result.to_plan(ctx.plan.model, ctx.plan.cluster, 0).strategies[0].pipelines
            except SearchBudgetSpent:
                raise
            except InfeasibleError:
                templates[key] = ()
        return templates[key]

    def oobleck_on(down: set[int]) -> tuple[StrategyHandle, float] | None:
        """The original pipelines on whole nodes plus a template on the broken ones' other whole-node
        devices (None: nothing left that fits)."""
        lost_nodes = {node_of[d] for d in down}
        off = {d for d in original.devices if node_of[d] in lost_nodes}
        if not off:
            return original, t0_time
        broken = [p for p in original.strategy.pipelines if set(p.devices) & off]
        if not broken:
            return original, t0_time
        free = sorted({d for p in broken for d in p.devices} - off)
        fixed = repair(original, off, profiles, template_on(free) if free else ())
        if fixed is None:
            return None
        p, step_time = fixed
        return StrategyHandle.of(dataclasses.replace(ctx, plan=p)), step_time

    def preplanned(handle: StrategyHandle, alive: Collection[int], out: Collection[int], ran_s: float,
                   plan_s: float, *, lost: Collection[int] = (), joining: Collection[int] = ()) -> bool:
        """Whether hspmd's coordinator had this loss (or return) planned ahead: a candidate of the layout (the
        rules of runtime/elastic/preplan.py: its losses, then the returns of the devices ``out`` of every
        world) once the layout ran long enough to plan every candidate up to its own at ``plan_s`` each."""
        if not model.preplan:
            return False
        losses, back = candidates(handle, alive), returns(handle, out)
        if lost:
            return any(survivors(handle, c) == survivors(handle, lost) for c in losses) and \
                ran_s >= len(losses) * plan_s
        return any(grown(handle, c) == grown(handle, joining) for c in back) and \
            ran_s >= (len(losses) + len(back)) * plan_s

    usable = set(original.devices) | {x for ev in events for x in ev.devices}
    # The restart lines: each its layout on the surviving whole nodes.
    restarts: dict[str, Callable[[Collection[int]], tuple[StrategyHandle, float]]] = {
        "restart": lambda devs: best_on(devs, model.restart_zero)}
    if model.megatron_restart:
        restarts["megatron_restart"] = symmetric_on
    start = sorted(usable & set(original.devices))
    lines = {"hspmd": _Line("hspmd", current, t0_time, t0_time)}
    for name, pick in restarts.items():
        first, first_s = pick(start)
        lines[name] = _Line(name, first, first_s, first_s)
    lines["oobleck_like"] = _Line("oobleck_like", current, t0_time, t0_time)
    r0_time = lines["restart"].base_step_time_s
    ck = restart_cost(ctx.model, t0_time, model.restart)
    failures = sum(1 for e in events if e.action != "rejoin")
    from_checkpoint = {"read": ck.read_s, "restart": model.restart.restart_s}  # then half an interval redone

    def detect(e: TraceEvent, restart: bool) -> float:
        if e.node is None:
            return model.detect_s
        return model.restart_node_loss_detect_s if restart else model.node_loss_detect_s

    down: set[int] = set()
    prev = 1
    h_since = 1  # the step from which hspmd's current layout runs (its losses are planned ahead from there)
    world = set(original.devices)  # the devices in hspmd's world (the coordinator's ``alive``)
    for i, e in enumerate(events):
        memo.at = f"events[{i}]"
        for line in lines.values():
            line.run(e.step - prev)
        prev = e.step
        steps_left = steps - e.step + 1
        alive_before = usable - down
        if e.action == "rejoin":
            down -= set(e.devices)
        else:
            down |= set(e.devices)
        log(f"step {e.step}: {e.action} {list(e.devices)}")
        # hspmd
        h = lines["hspmd"]
        before = h.step_time_s
        if e.action != "rejoin":
            world -= set(e.devices)
        t0, saved = time.perf_counter(), memo.saved_s
        if e.action == "rejoin":
            g = grow(h.handle, e.devices, profiles, steps_left=steps_left, time_limit_s=model.time_limit_s,
                     switch=model.switch, memo=memo)
            wall = time.perf_counter() - t0 + memo.saved_s - saved
            out = set(range(cluster.num_devices)) - world
            ahead = preplanned(h.handle, alive_before, out, (e.step - h_since) * before, wall, joining=e.devices)
            # decided ahead: a lookup, then (adopted) the coordinator plans the fused BSR of the plan found
            parts = {"decide": wall if not ahead else 0.0}
            if g.adopt and g.context is not None:
                target = StrategyHandle.of(g.context)
                if ahead:
                    t1 = time.perf_counter()
                    plan_switch(h.handle, target, ())
                    parts["decide"] = time.perf_counter() - t1
                world |= set(target.devices) & set(e.devices)
                h.handle, h.step_time_s = target, g.step_time_s
                parts["switch"] = g.switch_s
                h_since = e.step
            h.event(e, parts, before, adopted=g.adopt, preplanned=ahead, planner_wall_s=wall)
        elif set(e.devices) & set(h.handle.devices) or e.node == coordinator:
            r, cause = None, "the coordinator's node lost"  # the job itself is gone: nothing to replan
            if e.node != coordinator:
                try:
                    r = replan(h.handle, set(e.devices), profiles, time_limit_s=model.time_limit_s,
                               steps_left=steps_left, memo=memo)
                except LostStateError:
                    cause = "state lost"
            if r is None:
                h.handle, h.step_time_s = best_on([d for d in h.handle.devices if d not in e.devices])
                world = set(h.handle.devices)
                h.restarted(e, {"detect": detect(e, False), **from_checkpoint}, before, restarted=cause)
            else:
                wall = time.perf_counter() - t0 + memo.saved_s - saved
                ahead = preplanned(h.handle, alive_before, (), (e.step - h_since) * before, wall, lost=e.devices)
                if ahead:  # the coordinator looks the plan up and plans its fused BSR
                    t1 = time.perf_counter()
                    plan_switch(h.handle, StrategyHandle.of(r.context), set(e.devices))
                    replan_s = time.perf_counter() - t1
                else:
                    replan_s = wall
                parts = {"detect": detect(e, False), "replan": replan_s,
                         "transfer": r.chosen.modelled_switch_s, "regroup": model.switch.regroup_s,
                         "step_redone": before / 2}
                h.handle, h.step_time_s = StrategyHandle.of(r.context), r.chosen.step_time_s
                h.event(e, parts, before, chosen=r.chosen.label, fastest_option_s=r.options[0].step_time_s,
                        preplanned=ahead, planner_wall_s=wall)
                h.windows.append(sum(parts.values()))
            h_since = e.step
        # restart: whole nodes only
        whole = sorted(d for n, devs in nodes.items() if not devs & down for d in devs if d in usable)
        if not whole:  # one node (or every node hit): it restarts without the failed devices only
            whole = sorted(usable - down)
        for name, pick in restarts.items():
            rs = lines[name]
            before = rs.step_time_s
            if e.action != "rejoin" and set(e.devices) & set(rs.handle.devices):
                rs.handle, rs.step_time_s = pick(whole)
                rs.restarted(e, {"detect": detect(e, True), **from_checkpoint}, before,
                             nodes_dropped=sorted({node_of[d] for d in down}))
            elif e.action == "rejoin" and set(whole) != set(rs.handle.devices):
                cand, cand_s = pick(whole)
                planned = {"write": ck.write_s, "read": ck.read_s, "restart": model.restart.restart_s}
                if pays(rs.step_time_s, cand_s, steps_left, sum(planned.values())):
                    rs.handle, rs.step_time_s = cand, cand_s
                    rs.event(e, planned, before, adopted=True)
                else:
                    rs.event(e, {}, before, adopted=False)
        # oobleck-like: templates re-instantiated on the whole nodes
        ob = lines["oobleck_like"]
        before = ob.step_time_s
        layout = oobleck_on(down)
        if layout is not None and layout[0].describe() == ob.handle.describe():
            pass  # the event changes nothing it runs
        elif e.action != "rejoin" and (layout is None or e.node == coordinator
                                       or lost_tensors(ob.handle, set(e.devices))):
            alive = [d for d in ob.handle.devices if d not in down]
            ob.handle, ob.step_time_s = best_on(alive)
            ob.restarted(e, {"detect": detect(e, False), **from_checkpoint}, before, restarted=True)
        elif layout is not None:
            bsr = plan_switch(ob.handle, layout[0], set(e.devices) if e.action != "rejoin" else ())
            parts = {"regroup": model.switch.regroup_s,
                     "broadcast": bsr.total_bytes / (cluster.inter_node_bandwidth_gbs * 1e9)}
            if e.action != "rejoin":
                parts = {"detect": detect(e, False), **parts, "step_redone": before / 2}
            ob.handle, ob.step_time_s = layout
            ob.event(e, parts, before)
            if e.action != "rejoin":
                ob.windows.append(sum(parts.values()))
    for line in lines.values():
        line.run(steps - prev + 1)

    # Checkpoints: each line at Young's optimum for the failures it must checkpoint against.
    rates = FailureRates.of_trace(events, cluster, steps * t0_time)
    holders: dict[str, frozenset[frozenset[int]]] = {}

    def layout_rate(handle: StrategyHandle, window_s: float) -> float:
        key = handle.describe()
        if key not in holders:
            holders[key] = holder_sets(handle)
        return unrecoverable_rate(holders[key], node_of, rates, window_s, coordinator)

    given = model.checkpoint_interval_steps
    restart_interval = given or young_interval_steps(ck.write_s, r0_time, steps * r0_time, failures)
    checkpointing: dict[str, dict[str, object]] = {}
    for name, line in lines.items():
        info: dict[str, object]
        if given is not None or name in restarts:
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
            per_loss = {"detect": model.node_loss_detect_s, **from_checkpoint}
            line.unrecoverable_s = sum(sec * r * (sum(per_loss.values()) + every / 2 * st) for sec, st, _, r in per)
            info["cost_per_loss_s"] = {**per_loss, "lost_work": "half an interval at the step time then"}
        checkpointing[name] = {**info, "interval_steps": interval, "writes": steps // interval if interval else 0,
                               "write_s": line.checkpoint_s, "unrecoverable_losses_expected_s": line.unrecoverable_s}
    restart_writes = (steps // restart_interval if restart_interval else 0) * ck.write_s
    same = {name: line.time_at(min(restart_interval or steps, steps), restart_writes) for name, line in lines.items()}

    out = {name: {**line.to_json(steps), "checkpoint": checkpointing[name]} for name, line in lines.items()}
    gp = {name: steps / line.time_s for name, line in lines.items()}
    return {"steps": steps, "events": len(events), "initial_step_time_s": t0_time,
            "checkpoint": {"write_s": ck.write_s, "read_s": ck.read_s, "bytes": ck.checkpoint_bytes,
                           "interval_rule": "given" if given else "Young's optimum for the failures each line "
                           "must checkpoint against",
                           "failure_rates": {"device_per_s": rates.device_per_s, "node_per_s": rates.node_per_s},
                           "coordinator_node": coordinator},
            **out,
            "modelled_goodput_over_restart": gp["hspmd"] / gp["restart"],
            "modelled_goodput_over_oobleck_like": gp["hspmd"] / gp["oobleck_like"],
            **({"modelled_goodput_over_megatron_restart": gp["hspmd"] / gp["megatron_restart"]}
               if "megatron_restart" in gp else {}),
            "same_checkpoints": {"interval_steps": restart_interval, "write_s": restart_writes,
                                 **{f"{name}_total_s": v for name, v in same.items()}},
            "modelled_goodput_over_restart_same_checkpoints": same["restart"] / same["hspmd"],
            "modelled_goodput_over_oobleck_like_same_checkpoints": same["oobleck_like"] / same["hspmd"],
            "assumptions": {
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
            }}


__all__ = ["DEFAULT_TOLERANCE", "FailureRates", "GrowResult", "LostStateError", "MEGATRON_NCCL_TIMEOUT_S", "Option",
           "ReplanResult", "RestartCost", "RestartModel", "SwitchModel", "TraceModel", "choose", "grow", "model_trace",
           "pays", "repair", "replan", "restart_cost", "settings_for", "unrecoverable_rate", "young_interval_steps"]
