"""Which pipeline schedules the search tries, and how it ranks them before the exact estimate.

The runtime's schedules (runtime/torchfree/pipeline_schedules.py) differ, for the planner, in three things: how
many activations a stage keeps (``live_activation_limit``: the memory that decides how many layers a
device can hold), where the embedding and the head sit (ZB-V's V puts both on the first stage), and
how much of one micro-batch's pass through the pipeline the schedule fails to overlap (fill and
drain). The search compares thousands of pipelines, where running the list scheduler for each would
dominate, so it ranks them by ``m * slowest stage + fill * (sum - slowest) + hops * boundaries``, and
takes ``fill`` and ``hops`` from the list scheduler itself, run once per (schedule, stage count, op
shares) on equal stages (``fill_factor``). Realized plans and finalists are then priced exactly
(``CostModel.estimate``: ``step_time`` on their real op costs). docs/design.md §10.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from planner.cost import GIB, CostModel, stage_recompute
from runtime.torchfree.pipeline_schedules import ChunkCost, Costs, step_time
from runtime.torchfree.schedule_policies import SCHEDULE_NAMES, device_limits, live_activation_limit, schedule_layout
from runtime.torchfree.spec.plan import Strategy

AUTO = "auto"
# Interleaved 1F1B's chunk counts the search tries with the schedule fixed: each halves the fill again
# and costs activation memory, v times the messages and a stage's fixed time per chunk. "auto" tries the
# first only: more chunks rarely pay on these stage counts (measured: v = 4 lost to v = 2 and ZB-H1 on
# every pipeline of the 64-GPU scale case) and each choice costs search time.
INTERLEAVED_CHUNKS = (2, 4)
AUTO_INTERLEAVED_CHUNKS = (2,)


@dataclass(frozen=True)
class ScheduleChoice:
    """A schedule and its chunk count per stage (v)."""

    name: str
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEDULE_NAMES:
            raise ValueError(f"schedule: unknown schedule {self.name!r} (have: {', '.join(SCHEDULE_NAMES)})")
        schedule_layout(self.name, 1, self.chunks)   # raises for a chunk count the schedule does not have

    @property
    def label(self) -> str:
        return self.name if self.name != "interleaved" else f"interleaved v={self.chunks}"

    def ends(self, stage: int, num_stages: int) -> tuple[bool, bool]:
        """Whether stage ``stage`` holds the embedding and the head under this schedule's placement."""
        return stage_shapes(self, num_stages)[stage][:2]


@cache
def stage_shapes(choice: ScheduleChoice, num_stages: int) -> tuple[tuple[bool, bool, int], ...]:
    """Per stage of ``num_stages`` under ``choice``: whether it holds the embedding, the head, and its
    ``live_activation_limit`` where the bound saturates (``m = 2 S v``). Cached: the search asks for every
    stage of every pipeline it tries."""
    layout = schedule_layout(choice.name, num_stages, choice.chunks)
    first, last = layout.device(0), layout.device(layout.num_stages - 1)
    v = choice.chunks
    return tuple((k == first, k == last, live_activation_limit(choice.name, num_stages, k, 2 * num_stages * v, v))
                 for k in range(num_stages))


def schedule_choices(setting: str) -> tuple[ScheduleChoice, ...]:
    """What the search tries for ``PlanSettings.schedule``: one named schedule (interleaved: every chunk
    count of ``INTERLEAVED_CHUNKS``), or for ``"auto"`` every schedule but GPipe, which runs 1F1B's step
    time with more activations, so it never wins on the cost model."""
    if setting == AUTO:
        names: Sequence[str] = tuple(n for n in SCHEDULE_NAMES if n != "gpipe")
    elif setting in SCHEDULE_NAMES:
        names = (setting,)
    else:
        raise ValueError(f"schedule: unknown schedule {setting!r} (have: {AUTO}, {', '.join(SCHEDULE_NAMES)})")
    out: list[ScheduleChoice] = []
    for n in names:
        if n == "interleaved":
            chunks = AUTO_INTERLEAVED_CHUNKS if setting == AUTO else INTERLEAVED_CHUNKS
            out.extend(ScheduleChoice(n, v) for v in chunks)
        else:
            out.append(ScheduleChoice(n, schedule_layout(n, 1).chunks))
    return tuple(out)


def chunk_sizes(layers: int, chunks: int) -> tuple[int, ...]:
    """A stage's layers cut into ``chunks`` chunks as evenly as possible, the larger ones first."""
    q, r = divmod(layers, chunks)
    return tuple(q + (1 if c < r else 0) for c in range(chunks))


def stage_layer_ranges(layers: Sequence[int], choice: ScheduleChoice) -> list[tuple[tuple[int, int], ...]]:
    """Per stage its chunks' ``[start, stop)`` layer ranges, from each stage's layer count: chunk ``c`` of
    stage ``s`` takes ``chunk_sizes`` of its layers, and the ranges follow the placement's virtual-stage
    order (the model runs through virtual stage 0, 1, ...)."""
    n = len(layers)
    layout = schedule_layout(choice.name, n, choice.chunks)
    sizes = [chunk_sizes(k, choice.chunks) for k in layers]
    ranges: list[list[tuple[int, int]]] = [[(0, 0)] * choice.chunks for _ in range(n)]
    start = 0
    for j in range(layout.num_stages):
        d, c = layout.device(j), layout.chunk(j)
        ranges[d][c] = (start, start + sizes[d][c])
        start += sizes[d][c]
    return [tuple(r) for r in ranges]


# Stages the fill factor is measured on at most: it barely moves with depth (equal stages, F = B = W: 1F1B
# 1, ZB-H1 2/3, interleaved 1/v at every depth; ZB-V 0.17-0.20 from 4 to 20 stages), and the list
# scheduler's time grows with stages x micro-batches.
FILL_STAGES = 6


@cache
def fill_factor(choice: ScheduleChoice, num_stages: int, shares: tuple[float, float, float]) -> tuple[float, float]:
    """(fill, hops) of ``choice`` on ``S = num_stages`` equal stages whose F, B, W take ``shares`` of a
    stage's time: the list scheduler's step time at ``m = 2 S'`` micro-batches on ``S' = min(S,
    FILL_STAGES)`` stages, minus ``m`` stage times, over 1F1B's ``(S' - 1)`` stage times; and how many
    times the pipeline's stage boundaries a micro-batch's pass crosses (``S v - 1`` boundaries instead
    of ``S - 1``; ZB-V's turn at the last stage is no transfer)."""
    if num_stages <= 1:
        return 1.0, 1.0
    v = choice.chunks
    layout = schedule_layout(choice.name, num_stages, v)
    crossings = sum(layout.device(j) != layout.device(j + 1) for j in range(layout.num_stages - 1))
    s = min(num_stages, FILL_STAGES)
    f, b, w = shares
    layout = schedule_layout(choice.name, s, v)
    cost = ChunkCost(f / v, b / v, w / v)
    m = 2 * s
    t = step_time(choice.name, s, m, v, Costs.uniform(layout, cost))
    fill = max(0.0, (t - m * (f + b + w)) / ((s - 1) * (f + b + w)))
    return fill, crossings / (num_stages - 1)


def rounded_shares(cost: ChunkCost) -> tuple[float, float, float]:
    """F, B, W as shares of their sum, rounded to 0.1 (``fill_factor`` is cached on them)."""
    total = cost.forward + cost.input_grad + cost.weight_grad
    f = max(0.1, round(cost.forward / total * 10) / 10)
    b = max(0.1, round(cost.input_grad / total * 10) / 10)
    return f, b, max(0.1, round(1.0 - f - b, 1))


def spare_activation_limits(cm: CostModel, strategy: Strategy, pi: int, schedule: str, zero_degree: int = 1,
                            memory_margin: float = 0.0) -> tuple[int, ...] | None:
    """Per stage of pipeline ``pi`` the most chunk activations its free memory holds (each at its largest
    chunk's size, as ``CostModel.device_memory`` charges them), never below the schedule's own bound nor
    above the step's ``v*m``: the ``Pipeline.activation_limits`` that let a stage with memory to spare run
    more forwards ahead, and under a split backward defer more W into the fill and drain (a fast stage
    ahead of slower ones, the first stage whose whole backward is W). None when no stage can raise its
    bound (or the schedule already holds every activation, GPipe)."""
    pipe = strategy.pipelines[pi]
    n, m, v = len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks
    own = device_limits(schedule, n, m, v)
    n_layers = cm.model.num_layers
    out = []
    for k, st in enumerate(pipe.stages):
        dtype = cm.cluster.device(st.devices[0]).type
        chunks = tuple((b - a, a == 0, b == n_layers) for a, b in st.layers)
        static = cm.device_memory(dtype, st.tp, chunks, st.recompute, 0, zero_degree, stage_recompute(st)).total
        per = max(cm.chunk_activation_bytes(dtype, st.tp, b - a, a == 0, st.recompute, st.chunk_recompute(c))
                  for c, (a, b) in enumerate(st.layers))
        cap = cm.cluster.device_types[dtype].memory_gib * GIB * (1.0 - memory_margin)
        fits = int((cap - static) // per) if per > 0 else v * m
        out.append(min(v * m, max(own[k], fits)))
    return None if tuple(out) == own else tuple(out)


# Prices ``refine_limits`` spends per pipeline: lowering single stages' raised limits one at a time.
LIMIT_REFINE_EVALUATIONS = 8


def refine_limits(price: Callable[[tuple[int, ...]], float], own: Sequence[int], limits: Sequence[int],
                  max_evaluations: int = LIMIT_REFINE_EVALUATIONS) -> tuple[tuple[int, ...], float]:
    """``limits`` (raised per stage above ``own``) lowered one stage and one step at a time while ``price``
    (the pipeline's exact time under those limits) goes down: holding every activation memory allows is
    not always best, since a stage that runs far ahead can delay the backward work others wait for.
    Nearest first: each stage is lowered until a step no longer pays; at most ``max_evaluations`` prices.
    Returns the limits and their price."""
    best = tuple(limits)
    best_t = price(best)
    n = 1
    improved = True
    while improved and n < max_evaluations:
        improved = False
        for k in range(len(best)):
            lim = best[k] - 1
            while lim >= own[k] and n < max_evaluations:
                cand = best[:k] + (lim,) + best[k + 1:]
                t = price(cand)
                n += 1
                if t >= best_t - 1e-12:
                    break
                best, best_t, improved = cand, t, True
                lim -= 1
    return best, best_t
