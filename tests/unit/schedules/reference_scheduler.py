"""A plain restatement of the list scheduler's rules (runtime/torchfree/list_scheduler.py), for comparing the
fast scheduler against: every op kept in one ready list, scanned and sorted whenever a device is free
(quadratic in the micro-batches, fine for the small shapes the property tests draw). It shares no code
with the scheduler beyond the public policies and data types, so a shortcut there that changes a single
choice shows up as a different timeline here."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from runtime.torchfree.pipeline_schedules import Compute, Costs, TimedOp
from runtime.torchfree.schedule_policies import POLICIES, Layout


def _safe_forward(live: int, owed: dict[int, int], held: dict[int, int], mb: int, limit: int, chunks: int) -> bool:
    """The banker's rule on a copy of the device's state after one more forward of ``mb``."""
    owed, held = dict(owed), dict(held)
    owed[mb] = owed.get(mb, chunks) - 1
    held[mb] = held.get(mb, 0) + 1
    free = limit - live - 1
    if free < 0:
        return False
    for k in sorted(owed):
        if owed[k] > free:
            return False
        free += held[k]
    return True


def reference_timeline(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]) -> list[list[TimedOp]]:
    """Per device its ops with start and end times, by the documented rules read literally."""
    pol = POLICIES[name]
    n, stages, chunks = layout.num_devices, layout.num_stages, layout.chunks
    kinds = ("F", "B", "W") if pol.split_backward else ("F", "BW")
    frees = kinds[-1]
    rank = {k: i for i, k in enumerate(pol.priority)}
    ops = [(k, mb, j) for mb in range(m) for j in range(stages) for k in kinds]

    def deps(op: tuple[str, int, int]) -> list[tuple[tuple[str, int, int], float]]:
        k, mb, j = op
        hop = (lambda a: costs.transfer(a) if layout.device(a) != layout.device(a + 1) else 0.0)
        if k == "F":
            return [(("F", mb, j - 1), hop(j - 1))] if j > 0 else []
        if k == "W":
            return [(("B", mb, j), 0.0)]
        back = [(("F", mb, j), 0.0)]
        if j < stages - 1:
            back.append(((kinds[1], mb, j + 1), hop(j)))
        return back

    def key(op: tuple[str, int, int], after_backward: bool) -> tuple:
        k, mb, j = op
        c = layout.chunk(j)
        rest = (mb // n, c if k == "F" else -c, mb) if pol.order == "groups" else (mb, -j)
        r = -1 if after_backward and pol.alternate and k == "F" else rank[k]
        return (r, *rest)

    def duration(op: tuple[str, int, int]) -> float:
        k, _, j = op
        return costs.chunk(layout.device(j), layout.chunk(j)).of(k)  # type: ignore[arg-type]

    tol = 1e-9 * max(costs.chunk(d, c).of(k) for d in range(n) for c in range(chunks) for k in kinds)  # type: ignore[arg-type]
    end: dict[tuple[str, int, int], float] = {}
    ready_at: dict[tuple[str, int, int], float] = {}
    ready: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]
    for op in ops:
        if not deps(op):
            ready_at[op] = 0.0
            ready[layout.device(op[2])].append(op)
    live, forwards_left = [0] * n, [m * chunks] * n
    free_at, after_backward = [0.0] * n, [False] * n
    owed: list[dict[int, int]] = [{} for _ in range(n)]
    held: list[dict[int, int]] = [{} for _ in range(n)]
    timeline: list[list[TimedOp]] = [[] for _ in range(n)]
    events = [0.0]
    while len(end) < len(ops):
        now = heapq.heappop(events)
        while events and events[0] <= now + tol:
            heapq.heappop(events)
        for d in range(n):
            if free_at[d] > now + tol:
                continue
            eligible = [op for op in ready[d] if ready_at[op] <= now + tol]
            best = None
            for op in sorted(eligible, key=lambda o: key(o, after_backward[d])):
                if op[0] == "F":
                    if _safe_forward(live[d], owed[d], held[d], op[1], limit[d], chunks):
                        best = op
                        break
                elif not (pol.forwards_first and op[0] == kinds[1] and forwards_left[d]):
                    best = op
                    break
            if best is None:
                continue
            k, mb, j = best
            ready[d].remove(best)
            after_backward[d] = k == kinds[1]
            start = max(now, free_at[d], ready_at[best])
            end[best] = free_at[d] = start + duration(best)
            heapq.heappush(events, free_at[d])
            timeline[d].append(TimedOp(Compute(k, mb, j, layout.chunk(j)), start, end[best]))  # type: ignore[arg-type]
            if k == "F":
                live[d] += 1
                forwards_left[d] -= 1
                held[d][mb] = held[d].get(mb, 0) + 1
                owed[d][mb] = owed[d].get(mb, chunks) - 1
            elif k == frees:
                live[d] -= 1
                held[d][mb] -= 1
                if not held[d][mb]:
                    del held[d][mb], owed[d][mb]
            for nxt in ops_after(best, kinds, stages):
                if nxt in end or nxt in ready_at:
                    continue
                ds = deps(nxt)
                if all(dep in end for dep, _ in ds):
                    ready_at[nxt] = max(end[dep] + h for dep, h in ds)
                    ready[layout.device(nxt[2])].append(nxt)
                    heapq.heappush(events, ready_at[nxt])
    return timeline


def ops_after(op: tuple[str, int, int], kinds: tuple[str, ...], stages: int) -> list[tuple[str, int, int]]:
    """The ops that read what ``op`` produced."""
    k, mb, j = op
    if k == "F":
        out = [(kinds[1], mb, j)]
        if j + 1 < stages:
            out.append(("F", mb, j + 1))
        return out
    if k == "W":
        return []
    out = [("W", mb, j)] if k == "B" else []
    if j > 0:
        out.append((kinds[1], mb, j - 1))
    return out
