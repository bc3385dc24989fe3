"""Pipeline schedules: the one front every consumer builds them through (torch-free).

Why one mechanism: 1F1B, GPipe, interleaved 1F1B, ZB-H1 and ZB-V differ only in where the model chunks
sit (placement), whether the backward is split into its input-gradient half B and weight-gradient half
W, how many activations a device may hold, and which ready op a device prefers. Expressing each of
them as a policy for one event-driven list scheduler (``runtime.torchfree.list_scheduler``) means the executor,
``hspmd show``, the simulator and the cost model all read the same data (``runtime.torchfree.schedule_types``), and
a heterogeneous pipeline (stages of different speeds, uneven chunks) is scheduled with its real op
durations instead of a unit-time template. The policies, layouts and memory bounds are in
``runtime.torchfree.schedule_policies``. Each schedule's published order (``runtime.torchfree.canonical_schedules``) is
played beside the list scheduler's with the same durations, and the faster of the two is the order every
consumer gets (``_list_run``), so no schedule is slower than its textbook order. The action lists come
from that order (``runtime.torchfree.schedule_actions``), and ``check_schedule`` (``runtime.torchfree.schedule_check``)
plays them to prove them matched and deadlock-free.

The schedules' data types, ``derive_actions`` and ``check_schedule`` are importable from here too: callers
name one module.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

from runtime.torchfree.canonical_schedules import canonical_labels, canonical_orders, play_static
from runtime.torchfree.list_scheduler import Run, greedy_run
from runtime.torchfree.schedule_actions import derive_actions
from runtime.torchfree.schedule_check import ScheduleCheck, check_schedule
from runtime.torchfree.schedule_policies import POLICIES, Layout, device_limits, schedule_layout, schedule_problems
from runtime.torchfree.schedule_types import (
    ORDER_LIST,
    UNIT_COST,
    Action,
    ChunkCost,
    Compute,
    Costs,
    Message,
    MessageKind,
    PostRecv,
    PostSend,
    Schedule,
    TimedOp,
    WaitRecv,
    WaitSends,
    action_text,
    op_kinds,
)

__all__ = ["ORDER_LIST", "UNIT_COST", "Action", "ChunkCost", "Compute", "Costs", "Message", "MessageKind", "PostRecv",
           "PostSend", "Schedule", "ScheduleCheck", "Source", "TimedOp", "WaitRecv", "WaitSends", "action_text",
           "build_schedule", "check_schedule", "derive_actions", "op_kinds", "schedule_order", "schedule_timeline",
           "step_time", "step_time_bound"]

# Which order ``schedule_timeline`` gives: the one every consumer runs, or one of its two candidates.
Source = Literal["best", "list", "textbook"]


def build_schedule(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                   costs: Costs | None = None, limits: Sequence[int] | None = None) -> Schedule:
    """Generate schedule ``name``: simulate the list scheduler, then derive the action lists.

    ``limits``: per device an activation bound raised above the schedule's own (``device_limits``).
    Raises ValueError (one line, ``FIELD: problem``) for shapes ``schedule_problems`` rejects, and for
    ``limits`` of another length than the devices."""
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    run, origin = _chosen(name, layout, micro_batches, costs, bounds)
    timeline = _timed(name, layout, *run)
    actions = derive_actions(timeline, layout)
    raised = None if limits is None else bounds
    return Schedule(name, layout, micro_batches, costs,  # type: ignore[arg-type]
                    tuple(tuple(t) for t in timeline), actions, raised, origin)


def schedule_timeline(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                      costs: Costs | None = None, limits: Sequence[int] | None = None, *,
                      source: Source = "best") -> tuple[tuple[TimedOp, ...], ...]:
    """``build_schedule(...).timeline`` without deriving the action lists: the compute order is all a
    caller that only times the order needs (the planner prices thousands of pipelines).

    ``source``: ``"best"``, the order every consumer runs (``_list_run``); ``"list"``, the list scheduler's
    alone; ``"textbook"``, the schedule's published static order (``canonical_orders``, its first) played
    with ``costs``: the two candidates, for tests and benchmarks that compare them."""
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    return tuple(tuple(t) for t in _list_schedule(name, layout, micro_batches, costs, bounds, source))


def schedule_order(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                   costs: Costs | None = None, limits: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """``schedule_timeline``'s op order alone: per device its ops in order, each numbered
    ``(micro_batch * virtual_stages + stage) * len(op_kinds(name)) + kind`` (``kind`` indexing ``op_kinds``).
    A caller that replays the order with other costs needs no ``TimedOp`` per op (building those was a fifth
    of the list scheduler's time in the planner, which prices thousands of orders)."""
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    order, _ = _list_run(name, layout, micro_batches, costs, bounds)
    return tuple(tuple(o for o, _ in ops) for ops in order)


def step_time(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
              costs: Costs | None = None, limits: Sequence[int] | None = None) -> float:
    """The pipeline's step time under ``name`` with ``costs``: the scheduler's simulated makespan.

    The one definition for the cost model and the simulator. Closed forms it reproduces with equal
    stages, per-op costs ``F, B, W`` (``BW = B + W``) and no transfer time (tested):

    * 1F1B and GPipe: ``(m + S - 1) * (F + BW)``;
    * ZB-H1: ``m * (F + B + W) + (S - 1) * (F + B)``: 1F1B's fill and drain without its ``W``s.
      (The zero-bubble paper's ZB-H1 reaches ``(S - 1) * (F + B - W)`` by letting later stages keep
      more W-pending micro-batches, whose memory it assumes smaller; here an activation counts in
      full until its W, and under that bound the last stage must run F, B, W per micro-batch in turn,
      which makes this the best any order can do);
    * interleaved with ``F = B = W`` per chunk, ``m`` a multiple of ``S``: ``(v*m + S - 1) * (F + BW)``,
      the fill and drain ``v`` times shorter than 1F1B's on chunks ``v`` times larger. For ``m`` not
      a multiple of ``S``, the last, partial group of micro-batches costs extra fill;
    * ZB-V with ``F = B = W``: less than ZB-H1 on the same model (its fill runs on half-size chunks).

    With uneven stages there is no closed form worth trusting: this simulation is exact for the
    given costs, which is why the planner should call it rather than a formula. ``limits``: as for
    ``build_schedule``.
    """
    layout, costs = _checked(name, num_devices, micro_batches, chunks, costs, limits)
    bounds = device_limits(name, num_devices, micro_batches, layout.chunks, limits)
    order, end = _list_run(name, layout, micro_batches, costs, bounds)
    return max((end[ops[-1][0]] for ops in order if ops), default=0.0)


def step_time_bound(name: str, num_stages: int, micro_batches: int, chunks: int, costs: Costs) -> float:
    """A lower bound on the pipeline's time under ``name`` with op durations and transfer times ``costs``,
    for any op order that respects the dependencies: what the runtime's action lists take when played
    (``CostModel.pipeline_step_time``) and what the list scheduler takes (``step_time``). Cheap (no lists
    built), so that the search skips pricing exactly what cannot beat a plan it has (docs/design.md §10).

    Per device ``d``: nothing runs before the first micro-batch's forward reaches its first virtual stage
    (``head``), it runs its ops one at a time, its last backward (B) is followed by the input-gradient
    chain down to stage 0 (``tail``), and no backward starts before the first micro-batch has gone
    through the pipeline and its gradient has come back to ``d`` (``back``). Exact for 1F1B on equal
    stages without transfers (``(m + S - 1) * (F + BW)``)."""
    layout = schedule_layout(name, num_stages, chunks)
    split = POLICIES[name].split_backward
    n, m = layout.num_stages, micro_batches
    dev = [layout.device(j) for j in range(n)]
    cost = [costs.chunk(dev[j], layout.chunk(j)) for j in range(n)]
    f = [c.forward for c in cost]
    b = [c.input_grad if split else c.of("BW") for c in cost]
    w = [c.weight_grad if split else 0.0 for c in cost]
    hop = [costs.transfer(j) if dev[j] != dev[j + 1] else 0.0 for j in range(n - 1)]
    head = [0.0] * n       # earliest start of F at virtual stage j
    tail = [w[0]] * n      # least time from the end of B at stage j to the end of the step
    for j in range(1, n):
        head[j] = head[j - 1] + f[j - 1] + hop[j - 1]
        tail[j] = tail[j - 1] + hop[j - 1] + b[j - 1]
    back = [0.0] * n       # earliest start of B at stage j
    back[n - 1] = head[n - 1] + f[n - 1]
    for j in range(n - 2, -1, -1):
        back[j] = max(head[j] + f[j], back[j + 1] + b[j + 1] + hop[j])
    best = 0.0
    for d in range(layout.num_devices):
        js = [j for j in range(n) if dev[j] == d]
        fs, bs, ws = (m * sum(x[j] for j in js) for x in (f, b, w))
        start, first_back, least_tail = min(head[j] for j in js), min(back[j] for j in js), min(tail[j] for j in js)
        best = max(best, start + fs + bs + ws, start + fs + bs + least_tail,
                   first_back + bs + ws, first_back + bs + least_tail)
    return best


def _checked(name: str, num_devices: int, micro_batches: int, chunks: int | None,
             costs: Costs | None, limits: Sequence[int] | None = None) -> tuple[Layout, Costs]:
    problems = schedule_problems(name, num_devices, micro_batches, chunks)
    if not problems and limits is not None and len(limits) != num_devices:
        # Only the shape: a limit below the schedule's own bound is raised to it (``device_limits``), so
        # that a plan's limits also build the lists of a step with fewer micro-batches (packed documents).
        problems = [f"activation_limits: lists {len(limits)} limit(s) for {num_devices} stage(s)"]
    if problems:
        raise ValueError("; ".join(problems))
    layout = schedule_layout(name, num_devices, chunks)
    costs = costs if costs is not None else Costs()
    problems = costs.problems(layout)
    if problems:
        raise ValueError("; ".join(problems))
    return layout, costs


# ---------------------------------------------------------------------------------------------------
# The order every consumer gets: the list scheduler's or a published one, whichever is faster


def _list_run(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]) -> Run:
    """The order every consumer gets (engine, simulator, cost model): ``_chosen``'s."""
    return _chosen(name, layout, m, costs, limit)[0]


def _chosen(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]) -> tuple[Run, str]:
    """The list scheduler's order (``greedy_run``) or the schedule's published static order
    (``canonical_orders``), whichever ends first when played with ``costs``, and which one it is (``ORDER_LIST``
    or a ``canonical_labels`` line); a tie keeps the list scheduler's. Both keep every device within
    ``limit`` (the published orders within the schedule's own bound, which ``limit`` only raises). Under
    1F1B with room for every micro-batch's activation on every device (GPipe's memory), GPipe's orders are
    candidates too, so 1F1B is never slower than GPipe where it may hold what GPipe holds. docs/schedules.md,
    "Never slower than the textbook", has why both are needed: each wins on some uneven pipeline."""
    best = greedy_run(name, layout, m, costs, limit)
    best_t, origin = _makespan(best), ORDER_LIST
    names = [name]
    if name == "1f1b" and all(x >= m for x in limit):
        names.append("gpipe")
    for other in names:
        if other != name:
            run = greedy_run(other, layout, m, costs, device_limits(other, layout.num_devices, m, layout.chunks))
            if _makespan(run) < best_t * (1 - 1e-12):
                best, best_t, origin = run, _makespan(run), f"{ORDER_LIST} under GPipe's policy"
        for played, label in zip(_played(other, layout, m, costs), canonical_labels(other)):
            if played is not None and _makespan(played) < best_t * (1 - 1e-12):
                best, best_t, origin = played, _makespan(played), label
    return best, origin


def _played(name: str, layout: Layout, m: int, costs: Costs) -> list[Run | None]:
    """Schedule ``name``'s published orders (``canonical_orders``) played with ``costs`` (None: one that
    deadlocks, which the tests rule out)."""
    kinds = op_kinds(name)
    stages = layout.num_stages
    dev = [layout.device(j) for j in range(stages)]
    dur = [[costs.chunk(dev[j], layout.chunk(j)).of(k) for k in kinds] for j in range(stages)]
    hop = [costs.transfer(j) if dev[j] != dev[j + 1] else 0.0 for j in range(stages - 1)]
    return [play_static(layout, dur, hop, order) for order in _canonical(name, layout, m)]


@functools.lru_cache(maxsize=1 << 8)
def _canonical(name: str, layout: Layout, m: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``canonical_orders``, cached: the planner prices one shape at many costs."""
    return canonical_orders(name, layout, m)


def _makespan(run: Run) -> float:
    order, end = run
    return max((end[ops[-1][0]] for ops in order if ops), default=0.0)


def _list_schedule(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int],
                   source: Source = "best") -> list[list[TimedOp]]:
    """Per device its ops with their start and end times, in the order ``_list_run`` gives them (``source``:
    as for ``schedule_timeline``)."""
    if source == "best":
        order, end = _list_run(name, layout, m, costs, limit)
    elif source == "list":
        order, end = greedy_run(name, layout, m, costs, limit)
    else:
        played = _played(name, layout, m, costs)[0]
        if played is None:
            raise RuntimeError(f"{name}: the published order deadlocks on {layout} with {m} micro-batches")
        order, end = played
    return _timed(name, layout, order, end)


def _timed(name: str, layout: Layout, order: list[list[tuple[int, float]]], end: list[float]) -> list[list[TimedOp]]:
    """``TimedOp``s of a run (per device its ops as ``(op number, start)``, per op its end)."""
    kinds, stages = op_kinds(name), layout.num_stages
    nk = len(kinds)
    return [[TimedOp(_compute(kinds[o % nk], o // (stages * nk), (o // nk) % stages, layout.chunk((o // nk) % stages)),
                     start, end[o]) for o, start in ops] for ops in order]


# One ``Compute`` per op, shared by the timelines that run it (they are immutable): the planner builds
# thousands of timelines of the same ops, and validating each op anew was a tenth of the list scheduler's time.
_compute = functools.lru_cache(maxsize=1 << 18)(Compute)
