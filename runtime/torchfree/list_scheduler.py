"""The list scheduler: one event-driven simulation that orders every schedule's ops (torch-free).

1F1B, GPipe, interleaved 1F1B, ZB-H1 and ZB-V differ only in where the model chunks sit (placement),
whether the backward is split into its input-gradient half B and weight-gradient half W, how many
activations a device may hold, and which ready op a device prefers (``runtime.torchfree.schedule_policies``). Here
each is a policy for one scheduler that starts, on each idle device, the best ready op the policy allows,
with the real op durations: a heterogeneous pipeline (stages of different speeds, uneven chunks) is
scheduled as it runs, not from a unit-time template. ``runtime.torchfree.pipeline_schedules`` plays this order beside
the schedule's published ones and keeps the faster.

Memory. "Live activations" counts (micro-batch, chunk) activations a device holds: one is born at its
``F`` and dies at its ``BW``, or at its ``W`` when the backward is split (W still reads the saved
inputs). ``live_activation_limit`` is the documented bound, and the scheduler enforces exactly that
bound, so the memory the cost model charges and the memory the schedule uses cannot drift apart.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush

from runtime.torchfree.schedule_policies import POLICIES, Layout, Policy
from runtime.torchfree.schedule_types import Costs, op_kinds

# A run: per device its ops started, in order, as (op number, start); per op number its end. Ops are numbered
# ``(micro_batch * virtual_stages + stage) * len(op_kinds(name)) + kind`` (``kind`` indexing ``op_kinds``).
Run = tuple[list[list[tuple[int, float]]], list[float]]


def greedy_run(name: str, layout: Layout, m: int, costs: Costs, limit: Sequence[int]) -> Run:
    """Event-driven simulation: each idle device starts the best ready op its policy allows, holding at
    most ``limit[d]`` activations on device ``d``.

    Ops are numbered ``(mb * stages + j) * kinds + k`` (``k`` indexes ``kinds``: F, then B and W or the fused
    BW); an op's dependencies follow from its number: F after the previous stage's F (across the transfer
    time between them); B (BW) after its own F and the next stage's B (BW); W after its own B. A choice
    costs a few heap operations, not a scan of the ready ops, so a step of many micro-batches is scheduled
    in time linear in its ops (up to a logarithm); tests/unit/schedules/reference_scheduler.py states the
    rules plainly, and the tests hold this loop to its choices. The planner prices thousands of pipelines
    by this loop: it keeps ints in flat lists, not a tuple or list per op."""
    ops = _OpTable.of(name, layout, costs)
    n, per_mb, chunks = layout.num_devices, ops.per_mb, layout.chunks
    total = m * per_mb
    kind_of, lasting, frees = ops.kind_of, ops.lasting, ops.frees
    waiting = list(ops.waits) * m   # per op: how many of its inputs have not ended
    keys, after = _run_keys(name, layout, m)
    picker = _Picker(keys, after, total, per_mb, chunks, POLICIES[name].forwards_first, kind_of, ops.first_chunk)
    devs = [_DeviceState(forwards_left=m * chunks) for _ in range(n)]
    for o in range(total):
        if waiting[o] == 0:
            devs[ops.dev_num[o % per_mb]].pending.append((0.0, o))
    for st in devs:
        heapify(st.pending)
    ready_at = [0.0] * total
    end = [0.0] * total
    order: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    # Event times, each as (time, device): the device whose op ends then or to which an op comes due then
    # (every device at 0).
    events = [(0.0, d) for d in range(n)]
    started = 0
    now = 0.0
    inf = math.inf
    # Per device: when its op ends (``free``), and ``wake``: the earliest time it is worth looking at, the
    # later of ``free`` and, when it last found no op it may run, when the next of its ready ops comes due
    # (until an op is started or readied there it would find none again). An event looks only at the
    # devices it names (``looks``), in device order, those with ``wake`` due: a device finds an op to
    # start, or one of its ready ops comes due, only at an event that names it (its op's end, that op's
    # ready time), so every other device would find none. (Scanning every device per event took 18 device
    # tests per op started at 64 GPUs, of which 1.3 found the device due.)
    free = [0.0] * n
    wake = [0.0] * n
    pend = [st.pending for st in devs]
    admit, take, readied = picker.admit, picker.take, ops.readied

    while started < total:
        if not events:
            raise _stalled(name, now, devs, ops, total)
        now, d = heappop(events)
        due_by = now + ops.tol
        # The devices this event names: ``d``, and those of the further events due now (if any).
        looks = [d] if not events or events[0][0] > due_by else _named(events, d, due_by)
        i = 0
        while i < len(looks):
            d = looks[i]
            i += 1
            if wake[d] > due_by:   # busy, or it found nothing and nothing came due since
                continue
            st = devs[d]
            pending = pend[d]
            if pending and pending[0][0] <= due_by:
                admit(st, due_by)
            op = take(st, limit[d])
            if op is None:
                wake[d] = pending[0][0] if pending else inf
                continue
            r = op % per_mb
            k = kind_of[r]
            st.begin(op // per_mb, k, frees, chunks)
            start = now   # (``max(now, free[d], ready_at[op])`` written out)
            if free[d] > start:
                start = free[d]
            if ready_at[op] > start:   # never before its inputs, even by a rounding error
                start = ready_at[op]
            end[op] = free[d] = wake[d] = t = start + lasting[r]
            heappush(events, (t, d))
            order[d].append((op, start))
            started += 1
            # Each op this end readies joins its device's pending ops and wakes the device (``wake`` back to
            # ``free``), and its ready time is an event naming the device. A device woken by an op due after
            # ``due_by`` would find nothing new in this event; one later in device order that an op due now
            # woke (a zero duration or transfer) is looked at in this event, as a scan of every device in
            # turn would (``_woke``).
            for nxt, ready_t, td in readied(op, r, k, t, waiting, end):
                ready_at[nxt] = ready_t
                heappush(pend[td], (ready_t, nxt))
                heappush(events, (ready_t, td))
                if ready_t <= due_by and td > d and free[td] <= due_by:
                    _woke(looks, i, td)
                wake[td] = free[td]
    return order, end


@dataclass(frozen=True, slots=True)
class _OpTable:
    """``greedy_run``'s tables per op of one micro-batch (index ``r = op % per_mb``): its kind's index, virtual
    stage, device, whether it is on the device's first chunk, its duration, the transfer time to the next stage
    and from the previous one, and how many ops it waits for."""

    nk: int          # op kinds per (micro-batch, stage)
    per_mb: int      # ops per micro-batch
    last: int        # the last virtual stage
    split: bool      # the backward is split into B and W
    frees: int       # the kind index of the op that frees its activation: W under a split backward, else BW
    tol: float       # times that differ by less are one moment
    kind_of: list[int]
    stage_of: list[int]
    dev_num: list[int]
    first_chunk: list[bool]
    lasting: list[float]
    hop_of: list[float]
    hop_in: list[float]
    waits: list[int]

    @staticmethod
    def of(name: str, layout: Layout, costs: Costs) -> _OpTable:
        stages = layout.num_stages
        last = stages - 1
        split = POLICIES[name].split_backward
        kinds = ("F", "B", "W") if split else ("F", "BW")
        nk = len(kinds)
        dev = [layout.device(j) for j in range(stages)]
        chunk = [layout.chunk(j) for j in range(stages)]
        dur = [[costs.chunk(dev[j], chunk[j]).of(k) for k in kinds] for j in range(stages)]  # type: ignore[arg-type]
        # A message between virtual stages j and j + 1 (either way) takes costs.transfer(j) across devices.
        hop = [costs.transfer(j) if dev[j] != dev[j + 1] else 0.0 for j in range(last)]
        # Times that differ only by rounding are one moment: the order must not hinge on float noise
        # (a schedule on costs x * (1, 1, 1) is the schedule on (1, 1, 1), for any x).
        tol = 1e-9 * max(costs.chunk(d, c).of(k) for d in range(layout.num_devices)  # type: ignore[arg-type]
                         for c in range(layout.chunks) for k in kinds)
        stage_of = [j for j in range(stages) for _ in range(nk)]
        kind_of = [k for _ in range(stages) for k in range(nk)]
        return _OpTable(
            nk=nk, per_mb=stages * nk, last=last, split=split, frees=nk - 1, tol=tol, kind_of=kind_of,
            stage_of=stage_of, dev_num=[dev[j] for j in stage_of], first_chunk=[chunk[j] == 0 for j in stage_of],
            lasting=[dur[j][k] for j, k in zip(stage_of, kind_of)],
            hop_of=[hop[j] if j < last else 0.0 for j in stage_of],
            hop_in=[hop[j - 1] if j > 0 else 0.0 for j in stage_of],
            waits=[(1 if j > 0 else 0) if k == 0 else (2 if j < last else 1) if k == 1 else 1
                   for j in range(stages) for k in range(nk)])

    def readied(self, op: int, r: int, k: int, t: float, waiting: list[int], end: list[float]
                ) -> list[tuple[int, float, int]]:
        """The ops that op ``op`` (``r = op % per_mb``, kind index ``k``), ending at ``t``, readies: its
        dependents whose last input it was, as (op, ready time, device), its own next op first. Counts them
        off in ``waiting``."""
        nk, stage = self.nk, self.stage_of[r]
        out = []
        if k == 0:
            nxt = op + 1   # its own backward (B or BW)
            waiting[nxt] -= 1
            if not waiting[nxt]:
                if stage < self.last:
                    u = end[nxt + nk] + self.hop_of[r]
                    ready_t = t if t >= u else u
                else:
                    ready_t = t
                out.append((nxt, ready_t, self.dev_num[r + 1]))
            if stage < self.last:   # the next stage's forward
                nxt = op + nk
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    out.append((nxt, t + self.hop_of[r], self.dev_num[r + nk]))
        elif k == 1:
            if self.split:   # its W
                nxt = op + 1
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    out.append((nxt, t, self.dev_num[r + 1]))
            if stage > 0:   # the previous stage's backward
                nxt = op - nk
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    u = end[op] + self.hop_in[r]
                    w = end[nxt - 1]
                    out.append((nxt, w if w >= u else u, self.dev_num[r - nk]))
        return out


@dataclass(frozen=True, slots=True)
class _Picker:
    """How ``greedy_run`` picks a device's next op: its due ops queued by rank (``_run_keys``), and the policy's
    rules over the heads of those queues."""

    keys: tuple[int, ...]
    after: tuple[int, ...]
    total: int
    per_mb: int
    chunks: int
    forwards_first: bool
    kind_of: list[int]
    first_chunk: list[bool]

    def admit(self, st: _DeviceState, due_by: float) -> None:
        """Move the device's pending ops due by ``due_by`` to its queues of due ops."""
        pending, keys, total = st.pending, self.keys, self.total
        while pending and pending[0][0] <= due_by:
            o = heappop(pending)[1]
            r = o % self.per_mb
            k = self.kind_of[r]
            if k == 0:
                if self.first_chunk[r]:
                    heappush(st.first_forwards, keys[o] * total + o)
                else:
                    st.later_forwards.append(o)
            else:
                heappush(st.backwards if k == 1 else st.weights, keys[o] * total + o)

    def take(self, st: _DeviceState, lim: int) -> int | None:
        """Remove and return the best-ranked due op the policy allows (None: none): the best B / BW or W
        (GPipe: no B before the device's last forward), unless a forward that the banker's rule allows ranks
        before it (forwards are checked in rank order: the banker's check is the expensive part, and only
        the best allowed forward matters)."""
        keys = self.keys
        total = self.total
        chunks = self.chunks
        ranks = self.after if st.after_backward else keys
        best_heap: list[int] | None = None
        if st.backwards and not (self.forwards_first and st.forwards_left):
            best_heap = st.backwards
        if st.weights and (best_heap is None or st.weights[0] < best_heap[0]):
            best_heap = st.weights
        beats = None if best_heap is None else best_heap[0] // total   # (a backward ranks the same after either)
        if st.live < lim:   # else no forward fits (safe_forward)
            if chunks == 1:
                # One chunk: every forward is a first one, and the banker's rule allows any with a free slot
                # (``first_safe`` reduced to its first test).
                heap = st.first_forwards
                if heap and (beats is None or ranks[heap[0] % total] <= beats):
                    return heappop(heap) % total
                return None if best_heap is None else heappop(best_heap) % total
            later = None
            # A forward must leave the device in a state where the oldest micro-batch here can still reach
            # its backward (a banker's rule): a bounded device must not fill up with chunk-0 forwards of new
            # micro-batches while an older one still needs a slot for its later chunks.
            if st.later_forwards:
                for o in sorted(st.later_forwards, key=keys.__getitem__):
                    if beats is not None and ranks[o] > beats:
                        break
                    if st.safe_forward(o // self.per_mb, lim, chunks):
                        later = o
                        break
            if st.first_forwards:
                first = self.first_safe(st, lim, beats, None if later is None else keys[later])
                if first is not None:
                    return first
            if later is not None:
                st.later_forwards.remove(later)
                return later
        return None if best_heap is None else heappop(best_heap) % total

    def first_safe(self, st: _DeviceState, lim: int, beats: int | None, within: int | None) -> int | None:
        """Remove and return the best-ranked due first forward of a micro-batch here that the banker's rule
        allows and that ranks before ``beats`` (a backward's rank) and ``within`` (a forward's rank); None if
        none. Those forwards are of micro-batches holding nothing here, and the rule's answer for such a
        micro-batch depends only on how many of those that do hold activations here are older. Their ranks
        order them by micro-batch (a device's chunk-0 forwards all sit on one virtual stage, and either
        order compares the micro-batch first among them), so once one younger than every held micro-batch
        fails, every later one fails too."""
        keys = self.keys
        total = self.total
        chunks = self.chunks
        heap = st.first_forwards
        ranks = self.after if st.after_backward else keys
        order: list[int] | None = None
        answers: dict[int, bool] = {}
        skipped: list[int] = []
        found = None
        while heap:
            o = heap[0] % total
            if (beats is not None and ranks[o] > beats) or (within is not None and keys[o] > within):
                break
            if chunks == 1:   # (safe_forward: any forward is, with a free slot)
                found = heappop(heap) % total
                break
            if order is None:
                order = sorted(st.owed)
            mb = o // self.per_mb
            p = bisect.bisect_left(order, mb)
            ok = answers.get(p)
            if ok is None:
                ok = answers[p] = st.safe_forward(mb, lim, chunks)
            if ok:
                found = heappop(heap) % total
                break
            if p == len(order):
                break
            skipped.append(heappop(heap))
        for x in skipped:
            heappush(heap, x)
        return found


@dataclass(slots=True)
class _DeviceState:
    """One device of the list scheduler. Its ready ops are kept by how the policy picks them, so that a
    choice reads the heads of a few queues instead of every ready op (with thousands of micro-batches a
    device has thousands ready: every first-stage forward is ready at the start)."""

    live: int = 0
    forwards_left: int = 0
    after_backward: bool = False  # the op run last was a backward (B or BW): 1F1B's alternation
    # (When it is free and when it is next worth looking at are ``greedy_run``'s lists ``free`` and ``wake``.)
    # Ready ops (numbers, ``Run``): not yet due, as (ready time, op); due ones by kind, as
    # ``rank * ops + op`` (``_priority_keys``: least first): a micro-batch's first forward here, B or BW, W;
    # and its later chunks' forwards as op numbers (few: of micro-batches held here).
    pending: list[tuple[float, int]] = field(default_factory=list)
    first_forwards: list[int] = field(default_factory=list)
    later_forwards: list[int] = field(default_factory=list)
    backwards: list[int] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)
    # micro-batch -> forwards it still has to run here / activations it holds here (while it holds any)
    owed: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)

    def safe_forward(self, mb: int, limit: int, chunks: int) -> bool:
        """Banker's rule: after one more forward of ``mb`` here, can every micro-batch holding
        activations here, the oldest first, still run its remaining forwards within ``limit`` (and
        then, its backwards done, free every slot it holds)?"""
        free = limit - self.live - 1
        if free < 0:
            return False
        if chunks == 1:   # a micro-batch here owes no forward once it holds its one activation
            return True
        owed, held = self.owed, self.held
        # The state after that forward, read without copying it (this runs for every candidate forward).
        for k in sorted(owed) if mb in owed else sorted([*owed, mb]):
            if k == mb:
                if owed.get(k, chunks) - 1 > free:
                    return False
                free += held.get(k, 0) + 1
            else:
                if owed[k] > free:
                    return False
                free += held[k]
        return True

    def begin(self, mb: int, k: int, frees: int, chunks: int) -> None:
        """Count in an op of micro-batch ``mb`` started here, of kind index ``k`` (``frees``: the kind that frees
        its activation)."""
        self.after_backward = k == 1
        if k == 0:
            self.live += 1
            self.forwards_left -= 1
            if chunks > 1:   # (the banker's rule reads them only with more than one chunk)
                self.held[mb] = self.held.get(mb, 0) + 1
                self.owed[mb] = self.owed.get(mb, chunks) - 1
        elif k == frees:
            self.live -= 1
            if chunks > 1:
                self.held[mb] -= 1
                if not self.held[mb]:
                    del self.held[mb], self.owed[mb]

    def ready_ops(self, total: int) -> list[int]:
        return ([o for _, o in self.pending] + [x % total for x in self.first_forwards] + self.later_forwards
                + [x % total for x in self.backwards] + [x % total for x in self.weights])


def _priority_keys(pol: Policy, layout: Layout, kinds: tuple[str, ...], m: int) -> tuple[list[int], list[int]]:
    """Per op number (``Run``) its rank among a device's ready ops (least first), and the rank it
    has right after a backward (1F1B's alternation: one forward after each backward, the steady state).

    A rank is the tuple ``(kind's priority, then by order: micro-batch, later virtual stage first; or group of
    S micro-batches, chunk (forwards up, backwards down), micro-batch)`` numbered as one integer in the same
    order (ints: no tuple per op to build, compare or keep)."""
    rank = {k: i + 1 for i, k in enumerate(pol.priority)}   # 0: a forward right after a backward
    s, stages, v = layout.num_devices, layout.num_stages, layout.chunks
    groups = -(-m // s)
    # key = r * scale + rest: the kind's rank r first, then ``rest`` (below ``scale``) in the order's terms.
    scale = groups * (2 * v - 1) * m if pol.order == "groups" else m * stages
    keys, after = [], []
    for mb in range(m):
        for j in range(stages):
            c = layout.chunk(j)
            for kind in kinds:
                if pol.order == "groups":
                    rest = ((mb // s) * (2 * v - 1) + (c if kind == "F" else -c) + v - 1) * m + mb
                else:
                    # Oldest micro-batch first; between chunks of one micro-batch, the later virtual stage
                    # (it is closer to freeing memory: depth-first).
                    rest = mb * stages + stages - 1 - j
                keys.append(rank[kind] * scale + rest)
                after.append(rest if pol.alternate and kind == "F" else keys[-1])
    return keys, after


@functools.lru_cache(maxsize=1 << 10)
def _run_keys(name: str, layout: Layout, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``_priority_keys`` per (schedule, layout, micro-batch count), read-only: they do not read the costs or
    limits, and the planner lists the same shape at many costs (2 284 lists of 153 shapes at 64 GPUs)."""
    keys, after = _priority_keys(POLICIES[name], layout, op_kinds(name), m)
    return tuple(keys), tuple(after)



def _named(events: list[tuple[float, int]], d: int, due_by: float) -> list[int]:
    """The devices an event names, in device order: ``d``, whose event was just taken, and those of every further
    event due by ``due_by`` (taken off ``events``)."""
    looks = [d]
    while events and events[0][0] <= due_by:
        looks.append(heappop(events)[1])
    return sorted(set(looks))


def _woke(looks: list[int], i: int, d: int) -> None:
    """``greedy_run``: device ``d``, woken in an event by an op due then, joins the devices that event still
    looks at (``looks[i:]``, in device order) unless it is there already."""
    p = bisect.bisect_left(looks, d, i)
    if p == len(looks) or looks[p] != d:
        looks.insert(p, d)


def _stalled(name: str, now: float, devs: list[_DeviceState], ops: _OpTable, total: int) -> RuntimeError:
    """The error of a run in which no op is left to start or end (an activation bound too small to go on)."""
    kinds = op_kinds(name)
    stages = ops.per_mb // ops.nk
    stuck = [(d, sorted((kinds[o % ops.nk], o // ops.per_mb, (o // ops.nk) % stages) for o in st.ready_ops(total)))
             for d, st in enumerate(devs)]
    return RuntimeError(f"{name}: the list scheduler stalled at t={now} (ready per device: {stuck}); "
                        "the activation bound is too small for this shape")
