"""The static op orders the schedules are published with, as data, and how long an order takes (torch-free).

Each schedule family has a textbook order: 1F1B and interleaved 1F1B as Megatron-LM runs them, GPipe's two
phases, ZB-H1 and ZB-V as Qi et al. define them. They are designed for equal stages; the list scheduler
(``runtime.torchfree.list_scheduler``) builds an order from the real op durations instead, and on uneven
pipelines either can be the faster one. ``runtime.torchfree.pipeline_schedules`` plays both with the same durations
and keeps the faster (docs/schedules.md, "Never slower than the textbook"), so these orders are
candidates, never the only answer.

Orders are per device tuples of op numbers, numbered as the list scheduler numbers them:
``(micro_batch * virtual_stages + stage) * len(kinds) + kind`` with ``kinds`` ``("F", "BW")``, or
``("F", "B", "W")`` under a split backward. Every order here keeps each device within its schedule's
activation bound (``runtime.torchfree.schedule_policies.live_activation_limit``) and is deadlock-free for every
``S`` and ``m`` (tests/unit/schedules/test_canonical_schedules.py plays them all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.torchfree.schedule_policies import POLICIES, Layout

Order = tuple[tuple[int, ...], ...]
# One op as (micro-batch, virtual stage, kind index): what the generators below list.
_Op = tuple[int, int, int]


def canonical_labels(name: str) -> tuple[str, ...]:
    """What ``canonical_orders(name, ...)`` are, one line each, in the same order (for ``hspmd show``)."""
    return tuple(label for label, _ in _GENERATORS[name])


def canonical_orders(name: str, layout: Layout, micro_batches: int) -> tuple[Order, ...]:
    """Schedule ``name``'s published static orders on ``layout`` for ``micro_batches`` (one, or a few that
    differ only where the publication leaves a choice to the implementation)."""
    split = POLICIES[name].split_backward
    nk = 3 if split else 2
    out = []
    for _, gen in _GENERATORS[name]:
        per_device = [gen(layout, micro_batches, d) for d in range(layout.num_devices)]
        out.append(tuple(tuple((mb * layout.num_stages + j) * nk + k for mb, j, k in ops) for ops in per_device))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------
# The orders, per device


def _one_f_one_b(layout: Layout, m: int, d: int, w_last: bool = False, split: bool = False) -> list[_Op]:
    """Megatron's 1F1B on device ``d`` of ``S``: ``min(S - d - 1, m)`` warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards (the cool-down). Under a split backward each
    B is followed by its W (``w_last``: the cool-down's W wait until its B have all run)."""
    s = layout.num_devices
    warm = min(s - d - 1, m)
    ops: list[_Op] = [(mb, d, 0) for mb in range(warm)]
    deferred: list[_Op] = []

    def backward(mb: int, cooling: bool) -> None:
        if not split:
            ops.append((mb, d, 1))
            return
        ops.append((mb, d, 1))
        (deferred if cooling and w_last else ops).append((mb, d, 2))

    for i in range(m - warm):
        ops.append((warm + i, d, 0))
        backward(i, False)
    for mb in range(m - warm, m):
        backward(mb, True)
    return ops + deferred


def _gpipe(layout: Layout, m: int, d: int) -> list[_Op]:
    """Every forward, then every backward, oldest micro-batch first."""
    return [(mb, d, 0) for mb in range(m)] + [(mb, d, 1) for mb in range(m)]


def _interleaved(layout: Layout, m: int, d: int) -> list[_Op]:
    """Megatron's interleaved 1F1B on device ``d``: forwards in groups of ``S`` micro-batches, a group through
    chunk 0, then chunk 1, ...; backwards in the same groups from the last chunk down. Warm-up:
    ``2 (S - d - 1) + (v - 1) S`` forwards (at most all of them), then one forward and one backward in turn,
    then the remaining backwards. With one chunk it is 1F1B. The order is laid out on whole groups (``m``
    rounded up to a multiple of ``S``) and the ops of the micro-batches past ``m`` are left out: laid out on
    a partial last group the warm-up no longer covers what the later devices need and the order can
    deadlock (``S = 5``, ``v = 2``, ``m = 7``)."""
    s, v = layout.num_devices, layout.chunks
    if v == 1:
        return _one_f_one_b(layout, m, d)
    n = -(-m // s) * s
    table = [(mb, c) for g in range(0, n, s) for c in range(v) for mb in range(g, g + s)]
    fwd = [(mb, layout.stage(d, c), 0) for mb, c in table]
    bwd = [(mb, layout.stage(d, v - 1 - c), 1) for mb, c in table]
    total = len(table)
    warm = min(total, 2 * (s - d - 1) + (v - 1) * s)
    ops = fwd[:warm]
    for i in range(total - warm):
        ops += [fwd[warm + i], bwd[i]]
    return [op for op in ops + bwd[total - warm:] if op[0] < m]


def _zb_h1(layout: Layout, m: int, d: int) -> list[_Op]:
    """Qi et al.'s ZB-H1 with 1F1B's in-flight micro-batches per stage (the bound here counts an activation
    until its W): 1F1B's forward and input-gradient order, each W right after its B."""
    return _one_f_one_b(layout, m, d, split=True)


def _zb_h1_late_w(layout: Layout, m: int, d: int) -> list[_Op]:
    """ZB-H1 with the cool-down's W after its B: the gradients travel down without waiting for a W."""
    return _one_f_one_b(layout, m, d, w_last=True, split=True)


def _zb_v(layout: Layout, m: int, d: int, w_last: bool = False) -> list[_Op]:
    """Qi et al.'s ZB-V on device ``d`` (chunk 0 on virtual stage ``d``, chunk 1 on ``2S - 1 - d``).

    Warm-up: ``2 (S - d) - 1`` chunk-0 forwards, then ``d`` pairs (chunk-1 forward, chunk-0 forward), then
    ``S - d`` chunk-1 triples (F, B, W). Steady: chunk 0's F (while any is left), B, W, then chunk 1's F,
    B, W. Cool-down: the remaining B, chunk 1's and chunk 0's in turn, each with its W (``w_last``: the W
    after every B). The phases are laid out for ``max(m, 2S - 1)`` micro-batches, the fewest that fill the
    V; with fewer, the ops of the micro-batches past ``m`` are left out (an order that plays keeps playing
    with ops removed, and holds no more)."""
    s = layout.num_devices
    n = max(m, 2 * s - 1)
    j0, j1 = layout.stage(d, 0), layout.stage(d, 1)
    ops: list[_Op] = []
    deferred: list[_Op] = []
    stage = (j0, j1)
    fwd, bwd = [0, 0], [0, 0]   # per chunk: the next micro-batch whose F / whose B it runs

    def f(c: int) -> None:
        ops.append((fwd[c], stage[c], 0))
        fwd[c] += 1

    def bw(c: int, late: bool = False) -> None:
        ops.append((bwd[c], stage[c], 1))
        (deferred if late else ops).append((bwd[c], stage[c], 2))
        bwd[c] += 1

    for _ in range(2 * (s - d) - 1):
        f(0)
    for _ in range(d):
        f(1)
        f(0)
    for _ in range(s - d):
        f(1)
        bw(1)
    while fwd[1] < fwd[0] or fwd[0] < n:
        if fwd[0] < n:
            f(0)
        bw(0)
        f(1)
        bw(1)
    while bwd[0] < n or bwd[1] < n:
        if bwd[1] < n:
            bw(1, w_last)
        if bwd[0] < n:
            bw(0, w_last)
    return [op for op in ops + deferred if op[0] < m]


_GENERATORS: dict[str, tuple[tuple[str, Callable[[Layout, int, int], list[_Op]]], ...]] = {
    "1f1b": (("Megatron's 1F1B order", _one_f_one_b),),
    "gpipe": (("GPipe's order", _gpipe),),
    "interleaved": (("Megatron's interleaved 1F1B order", _interleaved),),
    "zb-h1": (("Qi et al.'s ZB-H1 order", _zb_h1),
              ("Qi et al.'s ZB-H1 order, the cool-down's W last", _zb_h1_late_w)),
    "zb-v": (("Qi et al.'s ZB-V order", _zb_v),
             ("Qi et al.'s ZB-V order, the cool-down's W last", lambda layout, m, d: _zb_v(layout, m, d, w_last=True))),
}


# ---------------------------------------------------------------------------------------------------
# Playing an order


def play_static(layout: Layout, durations: Sequence[Sequence[float]], hops: Sequence[float], order: Order
                ) -> tuple[list[list[tuple[int, float]]], list[float]] | None:
    """Play ``order``: each device runs its ops in its order, each as soon as the device is free and its
    inputs are there (``durations[j][k]``: op kind ``k`` of virtual stage ``j``; ``hops[j]``: a message
    between stages ``j`` and ``j + 1``, 0 on one device). Returns per device its ops as ``(op, start)`` and
    per op its end (the list scheduler's shapes), or None if the order deadlocks. Time linear in the ops."""
    stages = layout.num_stages
    nk = len(durations[0]) if durations else 2
    per_mb = stages * nk
    total = sum(len(ops) for ops in order)
    end: list[float | None] = [None] * total
    out: list[list[tuple[int, float]]] = [[] for _ in order]
    clock = [0.0] * len(order)
    pos = [0] * len(order)
    last = stages - 1
    moved = True
    while moved:
        moved = False
        for d, ops in enumerate(order):
            t, p = clock[d], pos[d]
            while p < len(ops):
                o = ops[p]
                r = o % per_mb
                j, k = r // nk, r % nk
                ready = 0.0
                if k == 0:
                    if j > 0:
                        e = end[o - nk]
                        if e is None:
                            break
                        ready = e + hops[j - 1]
                else:
                    e = end[o - 1]   # B or BW after its F, W after its B
                    if e is None:
                        break
                    ready = e
                    if k == 1 and j < last:
                        e2 = end[o + nk]
                        if e2 is None:
                            break
                        ready = max(ready, e2 + hops[j])
                start = max(t, ready)
                t = start + durations[j][k]
                end[o] = t
                out[d].append((o, start))
                p += 1
                moved = True
            clock[d], pos[d] = t, p
    if any(p < len(ops) for p, ops in zip(pos, order)):
        return None
    return out, end   # type: ignore[return-value]
