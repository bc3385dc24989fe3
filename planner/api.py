"""The planner's entry point: ``plan(model, cluster, profiles, settings)`` -> ranked candidate plans.

``hspmd plan`` calls it; so does failure recovery, with ``devices=`` the survivors, to get several
near-best plans (``PlanResult.candidates``, best first, each a distinct strategy with its cost-model
estimate) and pick the one that moves the least state::

    from planner.api import PlanSettings, plan
    result = plan(model, cluster, profiles, PlanSettings(global_batch=64, seq_len=4096),
                  devices=survivors)
    for cand in result.candidates:            # best first
        cand.strategy, cand.estimate.step_time_s, cand.micro_batch, cand.idle_devices
    result.to_plan(model_ref, cluster_ref)    # a runtime.torchfree.spec Plan (the best candidate)

Candidates are ranked by ``CostModel.estimate``; with ``PlanSettings(simulate_top=N)`` (``hspmd plan``:
``--check-top``, default 8) the best N, the best plans of identical pipelines and the baselines are also
simulated (planner/simulate.py), ``cand.simulated_s`` set, and those come first, ranked by the worse of
the two predictions (``cand.checked_s``).

Raises ``InfeasibleError`` (exit 2 in the CLI) with a sentence saying why and what would fit.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from planner.baselines import Baseline, LowerBound, best_symmetric, best_symmetric_subset, lower_bound
from planner.cost import GIB, CostModel, has_tp_stage, zero_degree, zero_fields
from planner.layer_split import feasible, slot_costs
from planner.moe_placement import StageChoice, choose_experts
from planner.parallel import Tasks, worker_count
from planner.schedule_choice import schedule_choices, stage_layer_ranges
from planner.search import MICRO_BATCHES, Candidate, PlanSettings, Progress, SearchStats, describe, rank, search
from planner.simulate import simulated_step_time
from planner.tp_groups import GroupKind, available, form_groups, tp_choices
from runtime.torchfree.errors import InfeasibleError
from runtime.torchfree.profiling.profile import DeviceProfile, ProfileSet
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, schedule_problems
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import MAX_GLOBAL_BATCH, PLAN_VERSION, Plan, Schedule, Strategy, TrainingSettings

MICRO_BATCH_GAIN = 0.03
ALIGNED_CHECKED = 3   # plans of alike pipelines the simulator check adds to the estimate's best

__all__ = ["PlanSettings", "PlanResult", "Candidate", "plan", "strategy_estimates"]


@dataclass(frozen=True)
class IdleGroup:
    device_type: str
    devices: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class PlanResult:
    model: ModelSpec
    cluster: Cluster
    settings: PlanSettings
    devices: tuple[int, ...]                 # the devices the planner could use
    candidates: tuple[Candidate, ...]        # best first, distinct strategies
    symmetric: Baseline
    symmetric_subset: Baseline
    lower_bound: LowerBound
    idle: tuple[IdleGroup, ...]              # the best plan's idle devices, by type, with why
    solver_time_s: float
    stats: SearchStats = field(default_factory=SearchStats)
    # Per pipeline of the best plan: every schedule's time and memory on its stages (why it runs its own).
    schedule_options: tuple[tuple[ScheduleOption, ...], ...] = ()
    # Elastic plans without --zero/--no-zero: both were searched; why this one (empty otherwise).
    zero_choice: str = ""
    # A MoE model: per stage of the best plan holding MoE layers on several devices, TP-split or
    # expert-parallel experts, and why (planner/moe_placement.py).
    moe_stages: tuple[StageChoice, ...] = ()

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def efficiency(self) -> float:
        """Lower bound / predicted step time (1.0 would be perfect)."""
        return self.lower_bound.step_time_s / self.best.step_time_s

    def speedup(self, baseline: Baseline) -> float | None:
        t = baseline.step_time_s
        return None if t is None else t / self.best.step_time_s

    def to_plan(self, model_ref: str, cluster_ref: str, index: int = 0) -> Plan:
        """A plan file's content: candidate ``index`` (0: the best) as strategy 'planned', estimates filled."""
        cand = self.candidates[index]
        strategy = dataclasses.replace(cand.strategy, name="planned", estimates=strategy_estimates(cand.estimate))
        return self._plan(model_ref, cluster_ref, cand.micro_batch, strategy)

    def baseline_plan(self, baseline: Baseline, model_ref: str, cluster_ref: str) -> Plan | None:
        """A baseline as a plan file of its own (its micro-batch size may differ from the planned one), to
        measure it with ``hspmd train``; None when the baseline has no feasible layout."""
        if baseline.strategy is None or baseline.estimate is None or baseline.micro_batch is None:
            return None
        strategy = dataclasses.replace(baseline.strategy, estimates=strategy_estimates(baseline.estimate))
        return self._plan(model_ref, cluster_ref, baseline.micro_batch, strategy)

    def _plan(self, model_ref: str, cluster_ref: str, micro_batch: int, strategy: Strategy) -> Plan:
        s = self.settings
        training = TrainingSettings(global_batch=s.global_batch, micro_batch=micro_batch, seq_len=s.seq_len,
                                    schedule=s.default_schedule, seed=s.seed, optimizer=s.optimizer,
                                    sequence_parallel=s.sequence_parallel and has_tp_stage(strategy),
                                    **zero_fields(s.zero))
        return Plan(version=PLAN_VERSION, model=model_ref, cluster=cluster_ref, training=training,
                    strategies=(strategy,))


def strategy_estimates(est) -> dict[str, float]:
    peak = max((m.gib for m in est.memory.values()), default=0.0)
    return {"step_time_s": round(est.step_time_s, 6), "tokens_per_s": round(est.tokens_per_s, 3),
            "mfu": round(est.mfu, 6), "grad_sync_s": round(est.grad_sync_s, 6),
            "optimizer_s": round(est.optimizer_s, 6), "peak_memory_gib": round(peak, 4)}


def micro_batch_sizes(settings: PlanSettings) -> list[int]:
    if settings.micro_batch is not None:
        return [settings.micro_batch]
    return [b for b in MICRO_BATCHES if settings.global_batch % b == 0] or [1]


def cost_models(model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
                settings: PlanSettings, devices: tuple[int, ...]) -> dict[int, CostModel]:
    """One cost model per micro-batch size worth searching. A larger micro-batch means fewer micro-batches
    (more pipeline bubble) and more activation memory; it only pays where it makes a sequence cheaper
    (per-op overheads amortized), so a size is kept when some device type runs a layer at least
    ``MICRO_BATCH_GAIN`` cheaper per sequence than at the smallest size."""
    sizes = micro_batch_sizes(settings)
    cms = {b: CostModel(model, cluster, profiles, micro_batch=b, seq_len=settings.seq_len,
                   sequence_parallel=settings.sequence_parallel) for b in sizes}
    if len(sizes) == 1:
        return cms
    base = cms[sizes[0]]
    types = sorted({cluster.device(d).type for d in devices})
    keep = {sizes[0]: base}
    for b in sizes[1:]:
        gain = min(cms[b].layer(t, 1).forward_s / b / (base.layer(t, 1).forward_s / sizes[0]) for t in types)
        if gain < 1.0 - MICRO_BATCH_GAIN:
            keep[b] = cms[b]
    return keep


def plan(model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
         settings: PlanSettings, *, devices: Iterable[int] | None = None, baselines: bool = True,
         progress: Progress | None = None, workers: int | None = 1) -> PlanResult:
    """Search for the fastest plans that fit; rank them; score the baselines on the same cost model.

    ``devices``: the usable device ids (default: all; failure recovery passes the survivors). Plans keep
    the cluster's device ids. ``baselines=False`` skips the symmetric baselines (their fields then say
    "not computed"); the lower bound is always computed (it is cheap). ``progress(phase, done, total)``
    is called as the search advances. ``workers`` > 1 (None: every core) runs the independent searches and
    the simulator's checks in that many processes (planner/parallel.py): the same result, less wall time.

    Elastic without a ZeRO choice: searched twice, half the time limit each -- ZeRO-1 with 2 copies of every
    moment chunk (less memory, hence other layouts; the parameter all-gather on top) and without ZeRO --
    and the faster best plan is the answer (``zero_choice`` says why).
    """
    if not (settings.elastic and settings.use_zero is None):
        return _plan(model, cluster, profiles, settings, devices, baselines, progress, workers)
    half = settings.time_limit_s / 2
    results: dict[bool, PlanResult] = {}
    errors: dict[bool, InfeasibleError] = {}
    for z in (False, True):
        try:
            results[z] = _plan(model, cluster, profiles, dataclasses.replace(settings, use_zero=z, time_limit_s=half),
                               devices, baselines, progress, workers)
        except InfeasibleError as err:
            errors[z] = err
    if not results:
        raise errors[False]
    name = {False: "without ZeRO", True: "ZeRO-1 with 2 copies of each moment chunk"}
    pick = min(results, key=lambda z: results[z].best.step_time_s)
    other = not pick
    if other in results:
        why = (f"elastic: {name[pick]} ({results[pick].best.step_time_s:.3f} s per step) beats {name[other]} "
               f"({results[other].best.step_time_s:.3f} s)")
    else:
        why = f"elastic: {name[pick]}; no plan {name[other]} fits ({errors[other]})"
    return dataclasses.replace(results[pick], zero_choice=why)


def _plan(model: ModelSpec, cluster: Cluster, profiles: Mapping[str, DeviceProfile] | ProfileSet,
          settings: PlanSettings, devices: Iterable[int] | None, baselines: bool,
          progress: Progress | None, workers: int | None = 1) -> PlanResult:
    t0 = time.perf_counter()
    deadline = t0 + settings.time_limit_s
    devs = tuple(sorted(set(range(cluster.num_devices) if devices is None else devices)))
    _check_request(model, cluster, settings, devs)
    cms = cost_models(model, cluster, profiles, settings, devs)
    # Baselines and bound over every micro-batch size, not only those the search kept: generous to them.
    every = {b: cms.get(b) or CostModel(model, cluster, profiles, micro_batch=b, seq_len=settings.seq_len,
                   sequence_parallel=settings.sequence_parallel)
             for b in micro_batch_sizes(settings)}
    report = progress if progress is not None else (lambda _phase, _done, _total: None)
    kinds = (("symmetric", best_symmetric), ("symmetric-subset", best_symmetric_subset))
    # With workers, the baselines (which need nothing of the search) run beside it.
    with Tasks(workers, len(kinds) if baselines else 0) as early:
        pending = [early.submit(functools.partial(best, min_pipelines=settings.min_pipelines,
                                                  schedule=settings.default_schedule),
                                every, devs, settings.global_batch, settings.zero) if baselines else None
                   for _, best in kinds]
        candidates, stats = search(cms, settings, devs, progress, workers)
        if not candidates:
            if stats.truncated:
                raise InfeasibleError(f"no plan found within the time limit of {settings.time_limit_s:g} s "
                                      f"({len(devs)} devices); allow more time (--time-limit)")
            raise InfeasibleError(diagnose(model, cluster, cms, settings, devs))
        solver_time = time.perf_counter() - t0
        found = []
        serial = worker_count(workers, len(kinds)) == 1
        for i, ((name, _), collect) in enumerate(zip(kinds, pending)):
            report("baselines", i, 3)
            why = "not computed"
            if collect is not None and serial and time.perf_counter() > deadline:
                stats.cut(f"{name} baseline")   # not started in one process past the limit
                collect, why = None, "not computed (time limit)"
            found.append(collect() if collect is not None else Baseline(name, None, None, None, why))
    sym, sub = found
    report("baselines", 2, 3)
    lb = lower_bound(every, devs, settings.global_batch)
    report("baselines", 3, 3)
    # A symmetric plan is a plan too: should one beat the search, it is the answer.
    base_cands = []
    for b in (sym, sub):
        if b.strategy is not None and b.estimate is not None and b.micro_batch is not None:
            used = set(b.strategy.devices)
            base_cands.append(Candidate(dataclasses.replace(b.strategy, name="planned"), b.estimate, b.micro_batch,
                                        tuple(d for d in devs if d not in used),
                                        f"{describe(b.strategy, cluster, settings.default_schedule)} "
                                        f"(the {b.name} baseline)"))
    ranked, moe_choices = place_experts(rank(candidates + base_cands), every, settings)
    if settings.simulate_top > 0:
        report("checking the best plans with the simulator", 0, 1)
        ranked = simulator_check(ranked, every, settings, base_cands, workers, deadline, stats)
    idle = explain_idle(ranked[0], ranked, cluster)
    top = tuple(ranked[:max(1, settings.top_k)])
    best = top[0]
    options: tuple[tuple[ScheduleOption, ...], ...] = ()
    if time.perf_counter() > deadline:
        stats.cut("schedule options of the best plan")   # the plan stands; the table of alternatives is left out
    else:
        options = tuple(tuple(schedule_options(every[best.micro_batch], best.strategy, pi, settings.default_schedule,
                                               settings.zero)) for pi in range(len(best.strategy.pipelines)))
    return PlanResult(model, cluster, settings, devs, top, sym, sub, lb, idle, solver_time, stats, options,
                      moe_stages=moe_choices.get(id(best.strategy), ()))


# Plans (best first) whose multi-device MoE stages get their experts' layout (planner/moe_placement.py) and are
# priced again; the others are dropped.
MOE_PLACED = 8


def place_experts(ranked: list[Candidate], cms: Mapping[int, CostModel], settings: PlanSettings
                  ) -> tuple[list[Candidate], dict[int, tuple[StageChoice, ...]]]:
    """A MoE model's best plans with each multi-device stage's experts TP-split or placed expert-parallel
    (``choose_experts``), priced again and ranked, those that fit first; per plan (by ``id`` of its strategy)
    why. The rest are left out (priced as the search priced them, not as they would run). A dense model:
    ``ranked`` as it is."""
    if not ranked or ranked[0].strategy is None or cms[ranked[0].micro_batch].model.moe is None:
        return ranked, {}
    out, why = [], {}
    for c in ranked[:MOE_PLACED]:
        cm = cms[c.micro_batch]
        strategy, choices = choose_experts(cm, c.strategy, settings.global_batch, settings.default_schedule,
                                           settings.zero)
        if choices:
            strategy = cm.with_op_costs(strategy, settings.default_schedule)
            c = dataclasses.replace(c, strategy=strategy, proxy=False, simulated_s=None,
                                    estimate=cm.estimate(strategy, settings.global_batch, settings.default_schedule,
                                                         settings.zero))
        why[id(c.strategy)] = choices
        out.append(c)
    fits = [c for c in out if c.estimate.fits]   # a placement may not fit where TP-split experts did
    return rank(fits or out), why


def aligned(strategy: Strategy) -> bool:
    """Whether every pipeline has the same stage layout (TP degrees and layer ranges): then each gradient
    slice is all-reduced by one group of stage peers, with no chains of waits between groups."""
    first = [(s.tp, s.layers) for s in strategy.pipelines[0].stages]
    return all([(s.tp, s.layers) for s in p.stages] == first for p in strategy.pipelines[1:])


def simulator_check(ranked: list[Candidate], cms: Mapping[int, CostModel], settings: PlanSettings,
                    also: Iterable[Candidate] = (), workers: int | None = 1, deadline: float = math.inf,
                    stats: SearchStats | None = None) -> list[Candidate]:
    """Simulate the best ``settings.simulate_top`` candidates, the best ``ALIGNED_CHECKED`` aligned ones
    (``aligned``) and those of ``also`` (the baselines) still among the ranked; rank those by the worse of
    estimate and simulation, ahead of the rest.

    The closed-form estimate prices the gradient sync's groups as the runtime runs them (one global order,
    each a rendezvous of its members: ``CostModel.grad_sync_time``) but starts them all after the slowest
    pipeline; the simulator starts each device's groups when its own stage is done, plays the pipelines'
    transfers op by op and its shared cores, so the two still differ. Ranking by the worse of the two keeps
    the planner from choosing a plan for a gap in the closed form.

    Only what can still win is played out: the picks go in order of their estimates against the best
    checked time so far, and one whose estimate is above it (its checked time is at least its estimate)
    or whose simulation passes it (``simulated_step_time``'s ``cutoff``: the simulator stops there) cannot
    be the best, so it stays unchecked among the rest. The best plan is the one checking them all would
    pick (tested); the unchecked lose their simulated time in the listing. ``workers``: processes for the
    simulations (planner/parallel.py), played in waves of one pick per worker, the same ones kept (playing
    every pick to the end would run, at 1024 GPUs, a dozen simulations where one decides).

    ``deadline`` (``time.perf_counter``): no wave starts after it (those left keep the estimate alone;
    ``stats`` records the cut)."""
    n = settings.simulate_top
    pick = list(ranked[:n])
    extra = [c for c in ranked if aligned(c.strategy)][:ALIGNED_CHECKED]
    extra += [c for c in also if any(c is r for r in ranked)]
    for c in extra:
        if all(c is not p for p in pick):
            pick.append(c)
    calls = [(cms[c.micro_batch], c.strategy, settings.default_schedule, settings.zero) for c in pick]
    order = sorted(range(len(pick)), key=lambda i: pick[i].step_time_s)   # stable: ties keep the pick order
    sims: dict[int, float] = {}
    best = math.inf
    with Tasks(workers, len(calls)) as tasks:
        j = 0
        while j < len(order) and pick[order[j]].step_time_s <= best:
            if time.perf_counter() > deadline:
                if stats is not None:
                    stats.cut("simulator check")
                break
            # A wave: the next picks, one per worker, played side by side with the best checked time so far as
            # their cutoff (one at a time in one process: the serial check). Each is judged as the serial
            # check judges it after the ones before it: its cutoff is at or above the best it meets there, so
            # a time under that best is exact in both, and one over it is over it in both.
            wave = order[j:j + tasks.workers]
            j += len(wave)
            played = [tasks.submit(simulated_step_time, *calls[i], best) for i in wave]
            for i, collect in zip(wave, played):
                if pick[i].step_time_s > best:
                    j = len(order)   # this estimate and every later one: above the best checked time
                    break
                sim = collect()
                if sim > best:
                    continue   # its checked time passes the best one's
                sims[i] = sim
                best = min(best, max(pick[i].step_time_s, sim))
    checked = [dataclasses.replace(c, simulated_s=sims[i]) for i, c in enumerate(pick) if i in sims]
    checked.sort(key=lambda c: (c.checked_s, c.step_time_s))   # stable: ties keep the estimate's order
    kept = [c for i, c in enumerate(pick) if i in sims]
    rest = [c for c in ranked if all(c is not p for p in kept)]
    return checked + rest


# ---------------------------------------------------------------------------------------------------
# Which schedule each pipeline runs, and why.


@dataclass(frozen=True)
class ScheduleOption:
    """One schedule for one pipeline of a plan, its stages' layer counts kept (re-cut into its chunks)."""

    label: str                       # 'zb-h1', 'interleaved v=2', ...
    pipeline_s: float | None         # the pipeline's time under it (None: it cannot run these stages)
    oom_devices: tuple[int, ...]     # devices whose memory it would overflow
    chosen: bool
    note: str = ""                   # why it cannot run, if it cannot


def schedule_options(cm: CostModel, strategy: Strategy, pi: int, default: Schedule, zero: bool
                     ) -> list[ScheduleOption]:
    """Pipeline ``pi`` of ``strategy`` under every schedule the search knows (``schedule_choices`` of each
    name), each stage keeping its layer count: the pipeline time by the list scheduler and the memory by the
    schedule's activation bound, as ``CostModel.estimate`` prices them. What ``hspmd plan`` shows as the
    reason for the pick: the search chose the schedule with the best time that fits (its own layer split
    for each, which may differ from the kept counts here)."""
    pipe = strategy.pipelines[pi]
    own = pipe.schedule if pipe.schedule is not None else default
    counts = [st.num_layers for st in pipe.stages]
    zd = zero_degree(len(strategy.pipelines), zero)
    out = []
    for choice in [c for name in SCHEDULE_NAMES for c in schedule_choices(name)]:
        chosen = choice.name == own and choice.chunks == pipe.stages[0].chunks
        problems = schedule_problems(choice.name, len(pipe.stages), pipe.micro_batches, choice.chunks)
        if min(counts) < choice.chunks:
            problems.append(f"a stage holds fewer than {choice.chunks} layers")
        if problems:
            out.append(ScheduleOption(choice.label, None, (), chosen, "; ".join(problems)))
            continue
        ranges = stage_layer_ranges(counts, choice)
        stages = tuple(dataclasses.replace(st, layers=r, op_costs=None) for st, r in zip(pipe.stages, ranges))
        # The plan's raised activation limits belong to its own schedule; the others run under their own bounds.
        limits = pipe.activation_limits if chosen else None
        costed = cm.costed_pipeline(dataclasses.replace(pipe, stages=stages, schedule=choice.name, transfer_costs=None,
                                                        activation_limits=limits), choice.name)
        alt = dataclasses.replace(strategy, pipelines=tuple(costed if i == pi else p
                                                            for i, p in enumerate(strategy.pipelines)))
        stages = costed.stages
        mem = cm.pipeline_memory(alt, pi, choice.name, zd)
        oom = tuple(d for st, m in zip(stages, mem) for d in st.devices if m.total > cm.capacity_bytes(d))
        out.append(ScheduleOption(choice.label, cm.pipeline_step_time(alt, pi, choice.name), oom, chosen))
    return out


def schedule_reason(options: list[ScheduleOption]) -> str:
    """One sentence: the chosen schedule's time against the best other that fits, and what the rest lack."""
    chosen = next((o for o in options if o.chosen), None)
    if chosen is None or chosen.pipeline_s is None:
        return "the plan's schedule"
    fitting = [o for o in options if not o.chosen and o.pipeline_s is not None and not o.oom_devices]
    parts = [f"{chosen.label}: {chosen.pipeline_s:.4g} s"]
    if fitting:
        alt = min(fitting, key=lambda o: o.pipeline_s or 0.0)
        parts.append(f"best other that fits: {alt.label} {alt.pipeline_s:.4g} s")
    ooms = [o.label for o in options if o.oom_devices and not o.chosen]
    if ooms:
        parts.append(f"out of memory with these layers: {', '.join(ooms)}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------
# Infeasible requests: say why and what would fit.


def _check_request(model: ModelSpec, cluster: Cluster, settings: PlanSettings, devs: tuple[int, ...]) -> None:
    if not devs:
        raise InfeasibleError("no devices to plan on")
    bad = [d for d in devs if not 0 <= d < cluster.num_devices]
    if bad:
        raise InfeasibleError(f"device(s) {bad} are not in cluster {cluster.name!r} "
                              f"(devices 0-{cluster.num_devices - 1})")
    if settings.seq_len > model.max_seq_len:
        raise InfeasibleError(f"sequence length {settings.seq_len} exceeds {model.name}'s max_seq_len "
                              f"{model.max_seq_len}")
    if settings.global_batch > MAX_GLOBAL_BATCH:
        raise InfeasibleError(f"a global batch of {settings.global_batch:,} sequences: hspmd plans for at most "
                              f"{MAX_GLOBAL_BATCH:,} per step (every schedule lists each micro-batch); give at most "
                              f"{MAX_GLOBAL_BATCH:,}, or longer sequences for more tokens per step")
    b = settings.micro_batch
    if b is not None and (b < 1 or settings.global_batch % b):
        raise InfeasibleError(f"micro-batch {b} does not divide the global batch {settings.global_batch}")
    if settings.elastic and settings.global_batch < 2 * (b or 1):
        raise InfeasibleError(f"--elastic needs at least 2 pipelines, hence a global batch of at least "
                              f"{2 * (b or 1)} sequences (got {settings.global_batch})")
    if settings.elastic and len(devs) < 2:
        raise InfeasibleError("--elastic needs at least 2 devices (every parameter on >= 2 pipelines)")


def _min_stages(cm: CostModel, kinds_by_speed: list, model: ModelSpec, settings: PlanSettings, zero_degree: int,
                max_groups: int) -> int | None:
    """Fewest stages of one kind that hold the model (None if even ``max_groups`` do not)."""
    for s in range(1, max_groups + 1):
        slots = slot_costs(cm, tuple(kinds_by_speed[:1] * s), zero_degree=zero_degree,
                           recompute=settings.allow_recompute, memory_margin=settings.memory_margin)
        if feasible(slots, model.num_layers):
            return s
    return None


def diagnose(model: ModelSpec, cluster: Cluster, cms: Mapping[int, CostModel], settings: PlanSettings,
             devs: tuple[int, ...]) -> str:
    """Why no plan was found, and what would fit."""
    cm = cms[min(cms)]
    b = cm.micro_batch
    m_total = settings.global_batch // b
    zd = zero_degree(min(m_total, len(devs)), settings.zero)
    # 1. Can the model fit at all? One pipeline through every device, biggest TP groups, most memory first.
    choices = tp_choices(cluster, model, devs)
    tp_max = {t: max(v) for t, v in choices.items() if v}
    groups = form_groups(cluster, model, tp_max, devs)
    kinds = sorted((g.kind for g in groups), key=lambda k: -cluster.device_types[k.device_type].memory_gib)
    if not kinds:
        return (f"no TP group can be formed from devices {list(devs)} for {model.name} "
                f"(TP degrees must divide {model.num_heads} heads and {model.num_kv_heads} kv heads)")

    def fits(n_layers: int) -> bool:
        """The search's own memory test (``slot_costs``, with its ``memory_margin``) on ``n_layers``."""
        small = cm if len(kinds) > n_layers else CostModel(dataclasses.replace(model, num_layers=n_layers), cluster,
                                                           cm.profiles, micro_batch=b, seq_len=settings.seq_len,
                                                           sequence_parallel=settings.sequence_parallel)
        slots = slot_costs(small, tuple(kinds[:n_layers]), zero_degree=1, recompute=settings.allow_recompute,
                           memory_margin=settings.memory_margin)
        return feasible(slots, n_layers)

    mem = sum(cluster.type_of(d).memory_gib for d in devs)
    if not fits(model.num_layers):
        lo = bisect.bisect_left(range(1, model.num_layers), True, key=lambda n: not fits(n))  # most layers that fit
        need = _model_state_gib(model, cm, 1)
        per = model.layer_params()
        head = (f"{model.name} ({model.total_params() / 1e9:.1f}B parameters, ~{need:.0f} GiB of weights, "
                f"gradients and optimizer states before activations) does not fit in the {mem:.0f} GiB of "
                f"{len(devs)} device(s) even as one pipeline with recompute: ")
        if lo == 0:
            big = kinds[0]
            one = cm.stage_memory(big.device_type, big.tp, 1, True, True, settings.allow_recompute, 1, 1).gib
            cap = cluster.device_types[big.device_type].memory_gib
            return (head + f"one layer with the embedding and head needs {one:.1f} GiB per device even at TP "
                    f"{big.tp} on {big.device_type} ({cap:g} GiB); use a smaller model or devices with more memory")
        grow = math.ceil(len(devs) * model.num_layers / lo)
        return (head + f"at most {lo} of its {model.num_layers} layers (~{lo * per / 1e9:.1f}B parameters) would fit; "
                f"a cluster of about {grow} such devices, or a model of at most {lo} layers, would fit")
    # 2. The model fits; the batch is too small for the pipelines that hold it.
    type_best = {}
    for t, tps in choices.items():
        for tp in sorted(tps, reverse=True):
            n_groups = sum(len(ids) // tp for (_, tt), ids in available(cluster, devs).items() if tt == t)
            s = _min_stages(cm, [GroupKind(t, tp)], model, settings, 1, n_groups) if n_groups else None
            if s is not None:
                type_best[t] = min(type_best.get(t, s), s)
    min_stages = min(type_best.values()) if type_best else len(kinds)
    need_mb = settings.min_pipelines * min_stages
    if m_total < need_mb:
        return (f"global batch {settings.global_batch} (micro-batch {b}) gives {m_total} micro-batch(es), but the "
                f"shortest pipeline that holds {model.name} has {min_stages} stage(s) and 1F1B needs a micro-batch "
                f"per stage{' on each of 2 pipelines (--elastic)' if settings.elastic else ''}: use a global "
                f"batch of at least {need_mb * b}")
    return (f"no plan for {model.name} on {len(devs)} device(s) of {cluster.name} fits memory with global batch "
            f"{settings.global_batch} and sequence length {settings.seq_len} (ZeRO-1 {'on' if settings.zero else 'off'}"
            f", zero degree up to {zd}); try a shorter sequence, a smaller micro-batch or more devices")


def _model_state_gib(model: ModelSpec, cm: CostModel, zero_degree: int) -> float:
    prof = next(iter(cm.profiles.values()))
    mem = prof.memory
    per = mem.param_bytes + mem.grad_bytes + mem.optimizer_bytes / zero_degree
    return model.total_params() * per / GIB


# ---------------------------------------------------------------------------------------------------
# Idle devices: which, and why (with the numbers of the best plan that does use them).


def explain_idle(best: Candidate, ranked: Iterable[Candidate], cluster: Cluster) -> tuple[IdleGroup, ...]:
    idle = best.idle_devices
    if not idle:
        return ()
    by_type: dict[str, list[int]] = {}
    for d in idle:
        by_type.setdefault(cluster.device(d).type, []).append(d)
    used_types = {cluster.device(d).type for d in best.strategy.devices}
    out = []
    for t, ids in sorted(by_type.items()):
        users = [c for c in ranked if any(d in set(c.strategy.devices) for d in ids)]
        if users:
            alt = min(users, key=lambda c: c.step_time_s)
            a, b = alt.estimate, best.estimate
            pa, pb = max(p.time_s for p in a.pipelines), max(p.time_s for p in b.pipelines)
            why = (f"the best plan found that uses them takes {alt.step_time_s:.4g} s/step vs "
                   f"{best.step_time_s:.4g} s/step without them (slowest pipeline {pa:.4g} vs {pb:.4g} s, "
                   f"gradient sync {a.grad_sync_s:.3g} vs {b.grad_sync_s:.3g} s): the compute they would take "
                   f"over is worth less than the pipeline stage, transfers and sync they add")
        elif t in used_types:
            why = ("left over after forming this type's TP groups, or more pipelines/stages than the batch's "
                   "micro-batches can feed; no plan using them scored better")
        else:
            why = "no plan that includes them was faster (or fits in memory) in the search"
        out.append(IdleGroup(t, tuple(ids), why))
    return tuple(out)
