"""Micro-batches per pipeline: split the global batch so that the slowest pipeline is as fast as possible.

Pipelines come in classes of identical copies. A class may offer several layer splits (``options``), each
making its pipeline time linear in its micro-batch count: ``T(m) = per_mb_s * m + fixed_s`` with
``per_mb_s`` the slowest stage and ``fixed_s = sum - max + boundaries``. Under 1F1B each pipeline needs at
least as many micro-batches as it has stages.

* ``allocate_ilp`` (PuLP): per class a base count ``q`` for every copy plus one extra micro-batch for ``r``
  of its copies, and one option per class; minimize ``Z >= T_o(q + [r > 0])`` with ``sum_j c_j*q_j + r_j``
  equal to the number of micro-batches.
* ``allocate_greedy``: the same optimum for one option per class without a solver (bisection on the
  makespan: each pipeline takes as many micro-batches as finish by it). The outer search uses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from runtime.torchfree.solver import solve, var


@dataclass(frozen=True)
class TimeOption:
    per_mb_s: float
    fixed_s: float

    def time(self, m: int) -> float:
        return self.per_mb_s * m + self.fixed_s


@dataclass(frozen=True)
class PipelineClass:
    options: tuple[TimeOption, ...]
    min_micro_batches: int    # 1F1B: at least one per stage
    count: int = 1            # identical copies


@dataclass(frozen=True)
class Allocation:
    per_class: tuple[tuple[int, ...], ...]   # micro-batches of each copy, per class
    option: tuple[int, ...]                   # chosen option per class
    makespan_s: float                         # slowest pipeline


def min_total(classes: Sequence[PipelineClass]) -> int:
    return sum(c.min_micro_batches * c.count for c in classes)


def _makespan(classes: Sequence[PipelineClass], per_class: Sequence[Sequence[int]], option: Sequence[int]) -> float:
    return max(c.options[o].time(max(ms)) for c, ms, o in zip(classes, per_class, option))


def allocate_greedy(classes: Sequence[PipelineClass], total: int) -> Allocation | None:
    """Optimal allocation for the first option of each class (None if ``total`` is too small)."""
    if total < min_total(classes):
        return None
    opts = [c.options[0] for c in classes]
    if any(o.per_mb_s <= 0 for o in opts):
        raise ValueError("pipeline time per micro-batch must be positive")
    rows = [(o.per_mb_s, o.fixed_s, c.min_micro_batches, c.count) for o, c in zip(opts, classes)]
    floor = math.floor

    def take(z: float) -> list[int]:
        return [floor((z - b) / a + 1e-9) for a, b, _, _ in rows]

    def ok(z: float) -> bool:
        got = 0
        for a, b, lo_m, n in rows:
            k = floor((z - b) / a + 1e-9)
            if k < lo_m:
                return False
            got += k * n
        return got >= total

    # The optimum lies between the fluid solution (every pipeline busy to the same instant, counts
    # fractional) and that plus one micro-batch of the slowest pipeline; pinned minimums only raise it.
    lo = max(max(a * lo_m + b for a, b, lo_m, _ in rows),
             (total + sum(n * b / a for a, b, _, n in rows)) / sum(n / a for a, _, _, n in rows))
    lo = max(0.0, lo - 1e-9 * max(1.0, abs(lo)))
    step = max(a for a, _, _, _ in rows)
    hi = lo + step
    tries = 0
    while not ok(hi):
        tries += 1
        if tries > 64:
            # lo's rounding slack (1e-9 of it) dwarfs a micro-batch where the fixed times dwarf the per-micro-
            # batch ones (1e-20 GB/s links: 1e15 s against 0.01 s, 1e8 steps): catch up geometrically. The
            # bisection below finds the same point; ordinary inputs never get here.
            step *= 2
        hi = max(hi + step, math.nextafter(hi, math.inf))   # at least one representable step
    if ok(lo):
        hi = lo
    for _ in range(60):
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    caps = take(hi)
    # Give each pipeline its minimum, then the rest to whoever finishes first with one more.
    alloc = [[c.min_micro_batches] * c.count for c in classes]
    left = total - min_total(classes)
    for j, c in enumerate(classes):
        for i in range(c.count):
            extra = min(left, caps[j] - alloc[j][i])
            alloc[j][i] += extra
            left -= extra
    if left:
        return None
    first = [0] * len(classes)
    return Allocation(tuple(tuple(a) for a in alloc), tuple(first), _makespan(classes, alloc, first))


def allocate_ilp(classes: Sequence[PipelineClass], total: int, time_limit: float | None = 10.0) -> Allocation | None:
    """Optimal allocation and option choice (PuLP ILP); None if ``total`` is too small or no solution."""
    if total < min_total(classes):
        return None
    prob = pulp.LpProblem("micro_batches", pulp.LpMinimize)
    z = var(prob, "z", 0)
    big = max(o.time(total + 1) for c in classes for o in c.options)
    qs, rs, ys = [], [], []
    for j, c in enumerate(classes):
        q = var(prob, f"q_{j}", c.min_micro_batches, total, cat="Integer")
        r = var(prob, f"r_{j}", 0, c.count - 1, cat="Integer")
        extra = var(prob, f"e_{j}", cat="Binary")   # 1 if some copy gets q + 1
        prob += r <= (c.count - 1) * extra
        y = [var(prob, f"y_{j}_{o}", cat="Binary") for o in range(len(c.options))]
        prob += pulp.lpSum(y) == 1
        for o, opt in enumerate(c.options):
            prob += opt.per_mb_s * (q + extra) + opt.fixed_s <= z + big * (1 - y[o])
        qs.append(q)
        rs.append(r)
        ys.append(y)
    prob += pulp.lpSum(c.count * q + r for c, q, r in zip(classes, qs, rs)) == total
    prob += z
    res = solve(prob, time_limit)
    if not res.ok:
        return None
    per_class, option = [], []
    for c, q, r, y in zip(classes, qs, rs, ys):
        qv, rv = round(q.value()), round(r.value())
        per_class.append(tuple(qv + 1 if i < rv else qv for i in range(c.count)))
        option.append(max(range(len(y)), key=lambda o: y[o].value() or 0))
    if sum(sum(p) for p in per_class) != total:
        return None
    return Allocation(tuple(per_class), tuple(option), _makespan(classes, per_class, option))
