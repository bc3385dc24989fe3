"""Non-uniform layer split of one pipeline: how many decoder layers each stage holds, and where to recompute.

Under 1F1B a pipeline with stage times ``t_s`` and ``m`` micro-batches takes ``(m-1)*max_s t_s + sum_s t_s``
plus its boundary transfers (``planner.cost.pipeline_time``). A stage's time is linear in its layer count
(``per_layer * n + const``; ``const`` is the embedding on the first stage, norm + head on the last), and its
memory must fit: stage k of S holds ``S-k`` micro-batches of activations. Where it does not, a stage
recomputes all its layers or, cheaper, only as many as it lacks room for (``SlotCost.partial``). Both
coefficients and the largest layer count that fits come from the cost model (``slot_costs``), so the split
is optimal for the very model that scores the plan.

* ``split_ilp``: the exact ILP (PuLP): minimize ``(m-1)*Z + sum_s t_s`` with ``t_s <= Z``, each stage
  with or without recompute, ``n_s <= most layers that fit``, ``sum n_s = L``.
* ``split_fast``: the min-max split (``min_max_stage``: layers handed out one at a time to the stage
  that is fastest with one more, exact for a bottleneck objective since stage times grow with their
  layer count), then the remaining freedom spent on the cheapest stages. Used inside the outer search, where
  thousands of candidate pipelines are compared; the finalists are re-split by the ILP.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import pulp

from planner.cost import GIB, CostModel
from planner.schedule_choice import ScheduleChoice, chunk_sizes, stage_shapes
from planner.tp_groups import GroupKind
from runtime.torchfree.solver import solve, var


@dataclass(frozen=True)
class SlotCost:
    """One stage position of a pipeline template. Index 0: without recompute, 1: with recompute."""

    kind: GroupKind
    first: bool
    last: bool
    in_flight: int                     # chunk activations alive at most (``live_activation_limit``)
    per_layer_s: tuple[float, float]   # stage seconds per layer, one micro-batch (forward + backward)
    const_s: float                     # seconds added by the embedding / head, one micro-batch
    max_layers: tuple[int, int]        # most layers that fit in memory; -1: not even the extras fit
    # Partial recompute (``Stage.recompute_layers``): at index n <= ``max_layers[1]`` the fewest recomputed
    # layers with which n layers fit (0 up to ``max_layers[0]``; n: all, whole-stage recompute); each costs
    # ``per_layer_s[1] - per_layer_s[0]``. Empty: whole-stage recompute only.
    partial: tuple[int, ...] = ()

    @cached_property
    def least_times(self) -> tuple[float, ...]:
        """``_least_time`` for 0 .. the most layers that fit, once per slot (the splits ask for them by the
        million; slots are cached and shared)."""
        return tuple(_least_time(self, n) for n in range(max(self.max_layers) + 1))


@dataclass(frozen=True)
class LayerSplit:
    layers: tuple[int, ...]
    recompute: tuple[bool, ...]
    stage_s: tuple[float, ...]         # per stage, one micro-batch
    recompute_layers: tuple[int, ...] = ()   # per stage, its partial recompute (0: none); empty: none

    @property
    def max_s(self) -> float:
        return max(self.stage_s)

    @property
    def sum_s(self) -> float:
        return sum(self.stage_s)

    def pipeline_s(self, micro_batches: int, boundary_s: float = 0.0, fill: float = 1.0) -> float:
        """``m * max + fill * (sum - max) + boundaries``: 1F1B's closed form at ``fill = 1``; the schedule's
        ``fill_factor`` otherwise (planner/schedule_choice.py)."""
        return micro_batches * self.max_s + fill * (self.sum_s - self.max_s) + boundary_s

    def ranges(self) -> list[tuple[int, int]]:
        return consecutive_ranges(self.layers)


def consecutive_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layer ranges of stages holding ``counts`` layers each, in order from layer 0."""
    return [(end - n, end) for n, end in zip(counts, itertools.accumulate(counts))]


def _max_layers(cm: CostModel, kind: GroupKind, first: bool, last: bool, recompute: bool, in_flight: int,
                zero_degree: int, capacity: float, limit: int, chunks: int = 1) -> int:
    """Largest n in [0, limit] whose stage memory fits ``capacity`` bytes (-1 if none does), the n layers
    cut into ``chunks`` chunks (``chunk_sizes``) of which ``in_flight`` chunk activations live at most."""

    def fits(n: int) -> bool:
        sizes = chunk_sizes(n, chunks)
        parts = tuple((k, first and c == 0, last and c == chunks - 1) for c, k in enumerate(sizes))
        return cm.device_memory_total(kind.device_type, kind.tp, parts, recompute, in_flight, zero_degree) <= capacity

    # memory grows with n: the first n that does not fit, less one
    return bisect.bisect_left(range(limit + 1), True, key=lambda n: not fits(n)) - 1


def _partial_table(cm: CostModel, kind: GroupKind, first: bool, last: bool, fit_plain: int, fit_all: int,
                   in_flight: int, zero_degree: int, capacity: float, chunks: int) -> tuple[int, ...]:
    """``SlotCost.partial``: for n up to ``fit_all`` layers, the fewest to recompute (the lowest, chunk by
    chunk) for the stage to fit ``capacity`` bytes by ``device_memory``. n layers fit with all recomputed
    (n <= ``fit_all``), and memory grows with n and falls with each recomputed layer past the first, so the
    count never falls as n grows: one upward scan finds every entry."""
    out = [0] * (max(0, fit_plain) + 1)
    k = 1
    for n in range(len(out), fit_all + 1):
        sizes = chunk_sizes(n, chunks)
        parts = tuple((size, first and c == 0, last and c == chunks - 1) for c, size in enumerate(sizes))

        def fits(k: int, sizes: tuple[int, ...] = sizes, parts: tuple = parts) -> bool:
            per, left = [], k
            for size in sizes:
                per.append(min(size, left))
                left -= per[-1]
            return cm.device_memory_total(kind.device_type, kind.tp, parts, False, in_flight, zero_degree,
                                          tuple(per)) <= capacity

        while k < n and not fits(k):
            k += 1
        out.append(k)
    return tuple(out)


def slot_costs(cm: CostModel, kinds: Sequence[GroupKind], *, zero_degree: int = 1, recompute: bool = True,
               memory_margin: float = 0.0, schedule: ScheduleChoice = ScheduleChoice("1f1b")) -> tuple[SlotCost, ...]:
    """Cost coefficients and memory limits of each stage of a pipeline whose stages are ``kinds`` in order,
    run under ``schedule``: its activation bound (at a micro-batch count where it saturates), where its
    placement puts the embedding and the head, and a stage's fixed time per micro-batch paid once per
    chunk.

    ``recompute=False`` forbids recompute (its limit is set to -1). ``memory_margin``: fraction of each
    device's memory kept free.
    """
    cache = cm.__dict__.setdefault("_planner_slot_cache", {})
    # ZeRO degrees whose slots are known, per slot but for the degree (sorted): see ``_between``.
    degrees = cm.__dict__.setdefault("_planner_slot_degrees", {})
    top = cm.cluster.num_devices   # no plan has a larger degree (one per pipeline at most)
    out = []
    for kind, (first, last, in_flight) in zip(kinds, stage_shapes(schedule, len(kinds))):
        key = (kind, first, last, in_flight, zero_degree, recompute, memory_margin, schedule.chunks)
        hit = cache.get(key)
        if hit is None:
            hit = _between(cache, degrees, key)
        if hit is None:
            others = key[:4] + key[5:]
            if others not in degrees and zero_degree < top:
                # ... the largest degree first, so that the degrees between reuse the slot where it is the same
                _slot(cm, cache, degrees, key[:4] + (top,) + key[5:], schedule)
            hit = _slot(cm, cache, degrees, key, schedule)
        cache[key] = hit
        out.append(hit)
    return tuple(out)


def _slot(cm: CostModel, cache: dict, degrees: dict, key: tuple, schedule: ScheduleChoice) -> SlotCost:
    """``slot_costs``' entry for one stage position (``key``: kind, first, last, in flight, ZeRO degree,
    recompute, margin, chunks), computed and cached."""
    kind, first, last, in_flight, zero_degree, recompute, memory_margin, v = key
    limit = cm.model.num_layers
    cap = cm.cluster.device_types[kind.device_type].memory_gib * GIB * (1.0 - memory_margin)
    per, const = [], 0.0
    for rc in (False, True):
        one = cm.stage(kind.device_type, kind.tp, 1, first, last, rc)
        two = cm.stage(kind.device_type, kind.tp, 2, first, last, rc)
        per.append(two.time_s - one.time_s)
        if not rc:
            const = one.time_s - per[0]
    if v > 1:   # every further chunk is a stage-module call of its own
        mid = cm.stage(kind.device_type, kind.tp, 1, False, False)
        const += (v - 1) * max(0.0, mid.time_s - per[0])
    nmax = tuple(_max_layers(cm, kind, first, last, rc, in_flight, zero_degree, cap, limit, v)
                 if (rc is False or recompute) else -1 for rc in (False, True))
    # Partial recompute only where memory binds: between what fits without and with recompute. Not
    # under GPipe, whose stages hold every micro-batch: the bound above is at m = 2S, a plan's m is
    # the allocation's, and a stage recomputing just enough at 2S runs out of memory at more.
    partial = _partial_table(cm, kind, first, last, nmax[0], nmax[1], in_flight, zero_degree, cap, v) \
        if recompute and nmax[1] > max(0, nmax[0]) and schedule.name != "gpipe" else ()
    hit = cache[key] = SlotCost(kind, first, last, in_flight, (per[0], per[1]), max(0.0, const), nmax, partial)
    bisect.insort(degrees.setdefault(key[:4] + key[5:], []), zero_degree)
    return hit


def _between(cache: dict, degrees: dict, key: tuple) -> SlotCost | None:
    """The slot at ZeRO degree ``key[4]`` when the known slots at the nearest degrees below and above it are
    equal (else None): a larger degree only shrinks the optimizer state (``stage_memory``), so every table
    entry (the most layers that fit, the fewest recomputed) moves one way with the degree, and one equal at
    both ends is equal between. Large clusters try many pipeline counts, hence degrees, on one template."""
    known = degrees.get(key[:4] + key[5:])
    if not known:
        return None
    zd = key[4]
    i = bisect.bisect_left(known, zd)
    if i == 0 or i == len(known):
        return None
    lo, hi = cache[key[:4] + (known[i - 1],) + key[5:]], cache[key[:4] + (known[i],) + key[5:]]
    return lo if lo == hi else None


def stage_time(slot: SlotCost, n: int, recompute: bool, recompute_layers: int = 0) -> float:
    """One micro-batch through the stage with ``n`` layers: all recomputed, or ``recompute_layers`` of them."""
    if recompute:
        return slot.per_layer_s[1] * n + slot.const_s
    return slot.per_layer_s[0] * n + (slot.per_layer_s[1] - slot.per_layer_s[0]) * recompute_layers + slot.const_s


def recompute_choice(slot: SlotCost, n: int) -> tuple[bool, int]:
    """How the stage holds ``n`` layers at least time: (whole-stage recompute, partial recompute layers);
    recompute only past what fits without it, partial where the slot has it and it recomputes fewer."""
    if n <= slot.max_layers[0]:
        return False, 0
    k = slot.partial[n] if n < len(slot.partial) else -1
    if 0 <= k < n:
        return False, k
    return True, 0


def _split(slots: Sequence[SlotCost], layers: Sequence[int]) -> LayerSplit:
    """The split holding ``layers`` with each stage's least-time recompute (``recompute_choice``)."""
    choice = [recompute_choice(s, n) for s, n in zip(slots, layers)]
    return LayerSplit(tuple(layers), tuple(rc for rc, _ in choice),
                      tuple(stage_time(s, n, rc, k) for s, n, (rc, k) in zip(slots, layers, choice)),
                      tuple(k for _, k in choice))


def _usable(slot: SlotCost) -> int:
    return max(slot.max_layers)


def feasible(slots: Sequence[SlotCost], num_layers: int) -> bool:
    """Whether some split fits memory: every stage takes at least one layer, all layers placed."""
    return len(slots) <= num_layers and all(_usable(s) >= 1 for s in slots) and \
        sum(_usable(s) for s in slots) >= num_layers


def _cap(slot: SlotCost, z: float) -> tuple[int, bool]:
    """Most layers the stage can take with time <= z, and whether that needs recompute."""
    if slot.partial:   # partial recompute: the time per layer count is no longer one line per option
        n = next((n for n in range(_usable(slot), 0, -1) if _next_cost(slot, n) <= z + 1e-9), -1)
        return n, n > slot.max_layers[0]
    best, rc_best = -1, False
    for rc in (False, True):
        nmax = slot.max_layers[rc]
        if nmax < 1:
            continue
        per = slot.per_layer_s[rc]
        n = nmax if per <= 0 else min(nmax, math.floor((z - slot.const_s) / per + 1e-9))
        if n > best:
            best, rc_best = n, rc
    return best, rc_best


def _next_cost(slot: SlotCost, n: int) -> float:
    """Least time of the stage with ``n >= 0`` layers (recompute only past what fits without it); inf if
    ``n`` layers do not fit: ``_least_time``, from the slot's table."""
    table = slot.least_times
    return table[n] if n < len(table) else math.inf


def _least_time(slot: SlotCost, n: int) -> float:
    if n <= slot.max_layers[0]:
        return stage_time(slot, n, False)
    if n <= slot.max_layers[1]:
        return stage_time(slot, n, *recompute_choice(slot, n))
    return math.inf


def min_max_stage(slots: Sequence[SlotCost], num_layers: int) -> float:
    """The smallest possible slowest stage, exactly: every stage starts with one layer and each further
    layer goes to the stage that is fastest with it (stage times grow with their layer count, so this
    greedy is optimal for the bottleneck; O(L log S))."""
    counts = [1] * len(slots)
    z = max(_next_cost(s, 1) for s in slots)
    heap = [(_next_cost(s, 2), i) for i, s in enumerate(slots)]
    heapq.heapify(heap)
    for _ in range(num_layers - len(slots)):
        cost, i = heapq.heappop(heap)
        if cost == math.inf:
            return math.inf
        counts[i] += 1
        z = max(z, cost)
        heapq.heappush(heap, (_next_cost(slots[i], counts[i] + 1), i))
    return z


def split_fast(slots: Sequence[SlotCost], num_layers: int) -> LayerSplit | None:
    """The split with the smallest slowest stage (exactly), then layers moved to cheap stages."""
    if not feasible(slots, num_layers):
        return None
    z = min_max_stage(slots, num_layers)
    if not math.isfinite(z):
        return None
    caps = [_cap(s, z) for s in slots]
    layers = [1] * len(slots)
    left = num_layers - len(slots)
    # Fill the cheapest stages first (per-layer time of the option the cap needs), up to their caps.
    order = sorted(range(len(slots)), key=lambda i: (slots[i].per_layer_s[caps[i][1]], i))
    for i in order:
        take = min(left, caps[i][0] - 1)
        layers[i] += take
        left -= take
    if left > 0:
        return None
    return _split(slots, layers)


def split_ilp(slots: Sequence[SlotCost], num_layers: int, micro_batches: int,
              time_limit: float | None = 10.0, incumbent: LayerSplit | None = None,
              fill: float = 1.0) -> LayerSplit | None:
    """The split minimizing ``LayerSplit.pipeline_s``, ``m*max_s t_s + fill*(sum_s t_s - max_s t_s)``, under
    each stage's memory limit (PuLP ILP); ``fill = 1`` is 1F1B's ``(m-1)*max + sum``.

    ``incumbent``: a known feasible split (e.g. ``split_fast``); its objective bounds the search, and it is
    returned if the solver finds nothing better in time.
    """
    if not feasible(slots, num_layers):
        return None
    m = max(1, micro_batches)
    bound = None if incumbent is None else incumbent.pipeline_s(m, fill=fill) * (1 + 1e-9) + 1e-12
    prob = pulp.LpProblem("layer_split", pulp.LpMinimize)
    z = var(prob, "z", 0)
    n0, n1, r = [], [], []
    times = []
    for i, s in enumerate(slots):
        cap0, cap1 = max(0, s.max_layers[0]), max(0, s.max_layers[1])
        a = var(prob, f"n0_{i}", 0, cap0, cat="Integer")
        b = var(prob, f"n1_{i}", 0, cap1, cat="Integer")
        x = var(prob, f"r_{i}", cat="Binary")
        prob += a <= cap0 * (1 - x)
        prob += b <= cap1 * x
        prob += a + b >= 1
        t = s.per_layer_s[0] * a + s.per_layer_s[1] * b + s.const_s
        prob += t <= z
        n0.append(a)
        n1.append(b)
        r.append(x)
        times.append(t)
    prob += pulp.lpSum(n0) + pulp.lpSum(n1) == num_layers
    prob += (m - fill) * z + fill * pulp.lpSum(times)
    res = solve(prob, time_limit, objective_bound=bound)
    if not res.ok:
        return incumbent
    layers, rec = [], []
    for a, b, x in zip(n0, n1, r):
        rc = round(x.value() or 0) == 1
        n = round(b.value() or 0) if rc else round(a.value() or 0)
        layers.append(n)
        rec.append(rc)
    if sum(layers) != num_layers or min(layers) < 1:
        return incumbent
    # The ILP knows whole-stage recompute only: each stage then takes its least-time choice, partial included.
    out = _split(slots, layers)
    if incumbent is not None and incumbent.pipeline_s(m, fill=fill) < out.pipeline_s(m, fill=fill):
        return incumbent
    return out


def refine_split(slots: Sequence[SlotCost], split: LayerSplit, price: Callable[[LayerSplit], float],
                 min_layers: int = 1, max_evaluations: int = 16,
                 bound: Callable[[LayerSplit], float] | None = None) -> LayerSplit:
    """``split`` improved by moving one layer at a time to a neighbouring stage while ``price`` (the exact
    pipeline time: the runtime's lists played on the op costs) goes down, within each stage's memory
    limit and keeping ``min_layers`` per stage. The ILP's objective is 1F1B's closed form, which knows
    neither the transfers on the steady state's path nor another schedule's fill, so the exact price gets
    the last word: steepest descent over the moves off the slowest stages first, at most
    ``max_evaluations`` prices. ``bound``: a cheap lower bound of ``price``; a move it shows cannot improve
    is not priced (it still counts as an evaluation, so the result is the same as without it)."""
    best, best_t = split, price(split)
    evaluations = 1
    while evaluations < max_evaluations:
        order = sorted(range(len(slots)), key=lambda k: -best.stage_s[k])
        moves = [(src, dst) for src in order for dst in (src - 1, src + 1) if 0 <= dst < len(slots)]
        improved = None
        for src, dst in moves:
            if evaluations >= max_evaluations:
                break
            layers = list(best.layers)
            layers[src] -= 1
            layers[dst] += 1
            if layers[src] < min_layers or layers[dst] > _usable(slots[dst]):
                continue
            cand = _split(slots, layers)
            evaluations += 1
            if bound is not None and bound(cand) >= best_t - 1e-12:
                continue   # its price is at least the bound: no improvement
            t = price(cand)
            if t < best_t - 1e-12 and (improved is None or t < improved[0]):
                improved = (t, cand)
        if improved is None:
            break
        best_t, best = improved
    return best
