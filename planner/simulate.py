"""Discrete-event simulation of one training step of a strategy, on the costs of ``planner.cost``.

Where the cost model's ``estimate`` uses the closed-form 1F1B/GPipe formula, the simulator plays the
schedule out as the runtime runs it (runtime/engine/schedules.py): every stage is a resource running its
actions in order — forward and backward of a micro-batch (TP collectives included), and communication
actions that post a group of sends/receives together and wait for all of them (Megatron's
send_forward_recv_backward grouping); each pipeline has its own micro-batch count. A transfer takes
``latency + bytes / bandwidth`` once both sides have posted (a rendezvous: measured so on gloo, where a
batched send waits for its receive; NCCL's send/recv behave so too). After its stage's last action each
device joins its gradient-sync groups (a group's all-reduce starts when its last member joins), then
the per-step all-reduce of loss and gradient norm, then its optimizer step, then (ZeRO-1) the all-gathers
of the updated parameter chunks, group by group in the gradient sync's order.

On a CPU-emulated cluster the devices are processes on one host, each pinned to its share of the cores
as the launcher pins them (runtime/launch/options.py ``emulated_cpu_shares``): compute blocks running on
the same core at the same time share it (processor sharing; a TP group's block runs at the pace of its
slowest member), and an emulated slower device sleeps ``slowdown - 1`` times each compute block's CPU
time, as the runtime does. The kernel's scheduler hands a core over in time slices, not as a fluid: where
a process finishes a block, wakes from its sleep or from a blocking receive while the other process on
its core computes, it waits that much longer for the core as ``hspmd profile`` measured
(``CoreHandoff``; nothing on an idle core). A sleep-mode emulated device (runtime/spec/cluster.py
``Emulation``) is outside this host model (``CostModel.host_contended``): its forward and backward blocks
last their target's price (``CostModel.stage``), however the host runs the real work inside them.

The result has the step time, per-stage compute / comm / bubble, the peak number of in-flight
micro-batches each stage reached (hence its peak memory), and a timeline for Chrome-trace / Perfetto.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.cost import CostModel, Schedule, SyncGroup
from runtime.launch.options import emulated_cpu_shares
from runtime.profiling.profile import CoreHandoff, ResumePenalty
from runtime.spec.plan import Strategy


@dataclass(frozen=True)
class Event:
    """One interval of the timeline."""

    name: str
    category: str        # forward | backward | p2p | grad_sync | clip | optimizer | zero_gather
    pipeline: int
    stage: int
    lane: str            # 'stage' or 'link k->k+1' / 'link k+1->k'
    start_s: float
    end_s: float
    micro_batch: int | None = None
    comm_s: float = 0.0  # part of the interval spent in TP collectives


@dataclass(frozen=True)
class StageReport:
    pipeline: int
    stage: int
    devices: tuple[int, ...]
    device_type: str
    tp: int
    layers: tuple[int, int]
    micro_batches: int
    compute_s: float
    comm_s: float        # TP collectives + gradient sync + loss/norm all-reduce + ZeRO-1 all-gathers
    p2p_s: float         # pipeline sends/receives (the transfers themselves; waiting is bubble)
    optimizer_s: float
    bubble_s: float      # step time minus everything the stage did: waiting
    peak_in_flight: int
    peak_memory_gib: float
    capacity_gib: float

    @property
    def oom(self) -> bool:
        return self.peak_memory_gib > self.capacity_gib

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "stage": self.stage, "devices": list(self.devices),
                "device_type": self.device_type, "tp": self.tp, "layers": list(self.layers),
                "micro_batches": self.micro_batches, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "p2p_s": self.p2p_s, "optimizer_s": self.optimizer_s, "bubble_s": self.bubble_s,
                "peak_in_flight": self.peak_in_flight, "peak_memory_gib": self.peak_memory_gib,
                "capacity_gib": self.capacity_gib, "oom": self.oom}


@dataclass(frozen=True)
class SimulationResult:
    strategy: str
    schedule: Schedule
    step_time_s: float
    tokens_per_s: float
    mfu: float
    formula_step_time_s: float      # the cost model's closed form, for comparison
    pipeline_end_s: tuple[float, ...]
    stages: tuple[StageReport, ...]
    peak_memory_gib: dict[int, float]
    oom_devices: tuple[int, ...]
    events: tuple[Event, ...]
    cpu_hosts: dict[str, float] = field(default_factory=dict)   # emulated hosts (cores) shared: their cores

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "schedule": self.schedule, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "formula_step_time_s": self.formula_step_time_s, "pipeline_end_s": list(self.pipeline_end_s),
                "stages": [s.to_json() for s in self.stages],
                "peak_memory_gib": {str(d): g for d, g in sorted(self.peak_memory_gib.items())},
                "oom_devices": list(self.oom_devices), "cpu_hosts": self.cpu_hosts}


def schedule_order(stage: int, num_stages: int, micro_batches: int, schedule: Schedule) -> list[tuple[str, int]]:
    """The (op, micro-batch) compute sequence of a stage: 1F1B warms up with S-k-1 forwards, then
    alternates one forward and one backward, then drains; GPipe runs every forward, then every backward."""
    return [(a[0], a[1]) for a in schedule_actions(stage, num_stages, micro_batches, schedule) if a[0] in "FB"]


# An action: ("F", mb) / ("B", mb) compute, or ("C", ((transfer kind, mb), ...)) one communication group.
Action = tuple[str, Any]


def schedule_actions(stage: int, num_stages: int, micro_batches: int, schedule: Schedule) -> list[Action]:
    """The stage's action list, grouped as the runtime groups it (runtime/engine/schedules.py)."""
    first, last = stage == 0, stage == num_stages - 1
    out: list[Action] = []

    def comm(*ts: tuple[str, int] | None) -> None:
        group = tuple(t for t in ts if t is not None)
        if group:
            out.append(("C", group))

    def rf(mb: int) -> tuple[str, int] | None:
        return None if first else ("recv_forward", mb)

    def sf(mb: int) -> tuple[str, int] | None:
        return None if last else ("send_forward", mb)

    def rb(mb: int) -> tuple[str, int] | None:
        return None if last else ("recv_backward", mb)

    def sb(mb: int) -> tuple[str, int] | None:
        return None if first else ("send_backward", mb)

    m = micro_batches
    if schedule == "gpipe":
        for j in range(m):
            comm(rf(j))
            out.append(("F", j))
            comm(sf(j))
        for j in range(m):
            comm(rb(j))
            out.append(("B", j))
            comm(sb(j))
        return out
    warm = min(num_stages - stage - 1, m)
    steady = m - warm
    fwd = bwd = 0
    for _ in range(warm):
        comm(rf(fwd))
        out.append(("F", fwd))
        comm(sf(fwd))
        fwd += 1
    if steady > 0:
        comm(rf(fwd))
    for i in range(steady):
        out.append(("F", fwd))
        comm(sf(fwd), rb(bwd))
        fwd += 1
        out.append(("B", bwd))
        if i == steady - 1:
            comm(sb(bwd))
        else:
            comm(sb(bwd), rf(fwd))
        bwd += 1
    for _ in range(warm):
        comm(rb(bwd))
        out.append(("B", bwd))
        comm(sb(bwd))
        bwd += 1
    return out


class _Sim:
    """The event loop. Resources run their ops in a fixed order; an op starts when its resource is free
    and its dependencies have completed (time advances event by event).

    * A communication op's end is known once every op it ``waits`` on has started: a transfer of
      ``secs`` completes at ``max(own start, peer start) + secs`` (a rendezvous).
    * A compute op on shared CPU hosts (``hosts``: (host, demand) pairs) first needs ``cpu`` seconds of
      work: the ops active on a host share its cores (each at ``min(1, cores / total demand)``, processor
      sharing) times its measured sharing efficiency while the core is oversubscribed (time-slicing
      leaves caches cold: the CPU time it consumes grows accordingly), and an op on several hosts runs
      at the slowest of their rates.
      Then come ``comm`` seconds of blocking collectives, then an emulated device's sleep of
      ``(stretch - 1)`` times the block's CPU time (``cpu`` plus the collectives' own ``comm_cpu``), as
      the runtime emulates a slower device (runtime/trace.py: CPU time, so neither waiting for a core nor
      waiting in a collective is stretched). Without a host, the same with the cores never shared.
    * A compute op with a ``resume`` penalty needs that much more CPU time the longer its resource idled
      since its previous compute op's CPU work ended (cold caches; measured by ``hspmd profile``); a
      communication op with a ``wake`` penalty ends that much later the longer it waited for its peers.
    * ``handoff`` (an op's ``CoreHandoff``): the core is not shared as a fluid. A process that used up its
      time slice is switched out at its next system call, and one that wakes up runs only once the
      scheduler hands it the core. So where another compute op is active on a core of the op's ``hosts``
      at that moment: a compute op's CPU work is followed by ``handoff_s`` before its tail; an op that
      starts right after its resource's emulation sleep starts ``wake_s`` later; a communication op that
      waited for its peers ends ``recv_wake_s`` later. And a forward / backward op needs ``cold_forward_s``
      / ``cold_backward_s`` more CPU time when another resource's compute ran on its cores since its
      resource's previous op started (that work took over the caches). On an idle core none applies.
    """

    def __init__(self, cores: dict[str, float] | None = None) -> None:
        self.queue: dict[str, list[str]] = {}
        self.ops: dict[str, dict[str, Any]] = {}
        self.cores = cores or {}

    def add(self, op: str, resource: str, duration: float = 0.0, deps: Sequence[str] = (),
            waits: Sequence[tuple[str, float]] = (), *, cpu: float = 0.0, comm: float = 0.0, stretch: float = 1.0,
            comm_cpu: float = 0.0, hosts: Sequence[tuple[str, float]] = (), resume: ResumePenalty | None = None,
            wake: ResumePenalty | None = None, sharing: float = 1.0, handoff: CoreHandoff | None = None,
            **info: Any) -> None:
        """``duration``: a fixed-length op (communication); ``cpu``/``comm``/``stretch``: a compute block;
        ``resume``: its extra CPU time after its resource idled (from the end of its last compute op);
        ``wake``: a communication op's extra time when it waited for its peers (blocked, core idle);
        ``sharing``: a compute op's efficiency while a core it runs on is time-shared; ``handoff``: the
        scheduler's delays when a core of ``hosts`` is busy with another op (communication ops take
        ``hosts`` for this only)."""
        hosts = [(h, d) for h, d in hosts if h in self.cores]
        self.ops[op] = {"resource": resource, "duration": duration, "deps": list(deps), "waits": list(waits),
                        "cpu": cpu, "comm": comm, "stretch": stretch, "comm_cpu": comm_cpu, "hosts": hosts,
                        "resume": resume, "wake": wake, "sharing": sharing, "handoff": handoff, **info}
        self.queue.setdefault(resource, []).append(op)

    def run(self) -> dict[str, tuple[float, float]]:
        head = {r: 0 for r in self.queue}
        busy: dict[str, str | None] = {r: None for r in self.queue}
        starts: dict[str, float] = {}
        done: dict[str, float] = {}
        times: dict[str, tuple[float, float]] = {}
        heap: list[tuple[float, int, str]] = []
        active: dict[str, float] = {}   # compute op -> CPU seconds of work left
        work: dict[str, float] = {}     # compute op -> its CPU seconds (with any resume penalty)
        used: dict[str, float] = {}     # compute op -> CPU time it consumed (more than work when sharing)
        cpu_end: dict[str, float] = {}  # resource -> when its last compute op's CPU work ended
        pending: dict[str, float] = {}  # compute op -> when it gets its core (a wake-up on a busy core)
        slept: dict[str, bool] = {}     # resource -> its last op ended in an emulated device's sleep
        users: dict[str, set[str]] = {}  # host -> the resources with ops on it
        for info in self.ops.values():
            for h, _ in info["hosts"]:
                users.setdefault(h, set()).add(info["resource"])
        foreign: set[tuple[str, str]] = set()   # (host, resource): another resource computed there since
        watchers: dict[str, set[str]] = {}     # op -> resources to wake when it starts or completes
        for info in self.ops.values():
            for d in info["deps"]:
                watchers.setdefault(d, set()).add(info["resource"])
            for w, _ in info["waits"]:
                watchers.setdefault(w, set()).add(info["resource"])
        now = 0.0
        seq = 0

        def finish_at(op: str, end: float) -> None:
            nonlocal seq
            times[op] = (starts[op], end)
            seq += 1
            heapq.heappush(heap, (end, seq, op))

        def core_busy(op: str) -> bool:
            """Another compute op is running on a core of ``op``'s hosts now (one ending this instant is not)."""
            mine = {h for h, _ in self.ops[op]["hosts"]}
            return bool(mine) and any(o != op and left > 1e-9 and any(h in mine for h, _ in self.ops[o]["hosts"])
                                      for o, left in active.items())

        def try_end(op: str) -> bool:
            """End a started communication / fixed op once the ops it waits on have started."""
            info = self.ops[op]
            if any(w not in starts for w, _ in info["waits"]):
                return False
            start = starts[op]
            end = start + info["duration"]
            for w, secs in info["waits"]:
                end = max(end, max(start, starts[w]) + secs)
            latest = max((starts[w] for w, _ in info["waits"]), default=start)
            if latest > start:   # blocked meanwhile: resumes later
                if info["wake"] is not None:
                    end += info["wake"].extra_s(latest - start, False)
                if info["handoff"] is not None and core_busy(op):
                    end += info["handoff"].recv_wake_s
            finish_at(op, end)
            return True

        def compute_tail(op: str, cpu_done: float) -> float:
            info = self.ops[op]
            cpu_end[info["resource"]] = cpu_done
            cpu = used.get(op, work[op])
            handoff = info["handoff"].handoff_s if info["handoff"] is not None and core_busy(op) else 0.0
            return cpu_done + handoff + info["comm"] + (info["stretch"] - 1.0) * (cpu + info["comm_cpu"])

        def advance(r: str) -> None:
            op = busy[r]
            if op is not None:
                if op not in times and self.ops[op]["cpu"] == 0 and self.ops[op]["comm"] == 0:
                    try_end(op)
                return
            if head[r] >= len(self.queue[r]):
                return
            op = self.queue[r][head[r]]
            info = self.ops[op]
            if any(d not in done for d in info["deps"]):
                return
            head[r] += 1
            busy[r] = op
            delay = info["handoff"].wake_s if slept.get(r) and info["handoff"] is not None and core_busy(op) else 0.0
            slept[r] = False
            starts[op] = now + delay
            if info["cpu"] > 0 or info["comm"] > 0:
                work[op] = info["cpu"]
                if info["resume"] is not None:   # caches gone cold while the device idled
                    work[op] += info["resume"].extra_s(now - cpu_end.get(r, 0.0), info.get("kind") == "backward")
                kind = info.get("kind")
                mine = [(h, r) for h, _ in info["hosts"]]
                if info["handoff"] is not None and kind in ("forward", "backward") and foreign.intersection(mine):
                    h = info["handoff"]   # ... or another process worked on its core meanwhile
                    work[op] += h.cold_forward_s if kind == "forward" else h.cold_backward_s
                foreign.difference_update(mine)
                if info["hosts"] and work[op] > 0:
                    used[op] = 0.0
                    if delay > 0:
                        pending[op] = now + delay
                    else:
                        active[op] = work[op]
                else:
                    finish_at(op, compute_tail(op, starts[op] + work[op]))
            else:
                try_end(op)
            for wr in watchers.get(op, ()):
                if wr != r:
                    advance(wr)

        def rates() -> tuple[dict[str, float], dict[str, float]]:
            """(CPU share, progress rate) of each active op: progress is the share times the op's sharing
            efficiency while a core it runs on is oversubscribed."""
            demand: dict[str, float] = {}
            for o in active:
                for h, d in self.ops[o]["hosts"]:
                    demand[h] = demand.get(h, 0.0) + d
            share, progress = {}, {}
            for o in active:
                hosts = self.ops[o]["hosts"]
                share[o] = min(min(1.0, self.cores[h] / demand[h]) for h, _ in hosts)
                crowded = any(demand[h] > self.cores[h] + 1e-9 for h, _ in hosts)
                progress[o] = share[o] * (self.ops[o]["sharing"] if crowded else 1.0)
            return share, progress

        for r in self.queue:
            advance(r)
        while True:
            share, rate = rates()
            t_cpu, cpu_op = math.inf, None
            for o, left in active.items():
                t = now + left / rate[o]
                if t < t_cpu:
                    t_cpu, cpu_op = t, o
            t_heap = heap[0][0] if heap else math.inf
            woken = min(pending, key=lambda o: pending[o]) if pending else None
            t_pend = pending[woken] if woken is not None else math.inf
            if cpu_op is None and not heap and woken is None:
                break
            t_next = min(t_cpu, t_heap, t_pend)
            for o in active:
                active[o] -= (t_next - now) * rate[o]
                used[o] += (t_next - now) * share[o]
                if t_next > now:
                    mine = self.ops[o]["resource"]
                    foreign.update((h, r) for h, _ in self.ops[o]["hosts"] for r in users[h] if r != mine)
            now = t_next
            if cpu_op is not None and t_cpu <= min(t_heap, t_pend):
                del active[cpu_op]
                finish_at(cpu_op, compute_tail(cpu_op, now))
                continue
            if woken is not None and t_pend <= t_heap:
                del pending[woken]
                active[woken] = work[woken]
                continue
            _, _, op = heapq.heappop(heap)
            done[op] = times[op][1]
            r = self.ops[op]["resource"]
            slept[r] = self.ops[op]["stretch"] > 1.0 and (self.ops[op]["cpu"] > 0 or self.ops[op]["comm"] > 0)
            busy[r] = None
            advance(r)
            for wr in watchers.get(op, ()):
                advance(wr)
        missing = [op for op in self.ops if op not in times]
        if missing:  # a cycle: a bug in the schedule construction, not a user error
            raise RuntimeError(f"simulation deadlocked; unscheduled ops: {missing[:5]}")
        return times


def simulate(cm: CostModel, strategy: Strategy, global_batch: int, schedule: Schedule = "1f1b",
             zero: bool = False) -> SimulationResult:
    """Simulate one step of ``strategy`` with the costs of ``cm``."""
    type_of = {d.id: d.type for d in cm.cluster.devices}
    pipes = strategy.pipelines
    cores, hosts_of = cpu_layout(cm, strategy)
    sim = _Sim(cores)
    stage_costs = {}
    for pi, pipe in enumerate(pipes):
        n = len(pipe.stages)
        for k, st in enumerate(pipe.stages):
            stage_costs[pi, k] = cm.stage(type_of[st.devices[0]], st.tp, st.num_layers, k == 0, k == n - 1,
                                          st.recompute)

    def block(devices: Sequence[int], total: float, tp: float = 0.0, tp_cpu: float = 0.0) -> dict[str, Any]:
        """A compute block: its CPU work (the device's stretch taken out), the TP collectives' wall time
        and CPU time, the stretch, the cores it runs on. ``total``/``tp`` as the cost model gives them."""
        k = cm.emulated_slowdown(type_of[devices[0]])
        return {"cpu": (total - tp) / k, "comm": tp - (k - 1.0) * tp_cpu, "comm_cpu": tp_cpu, "stretch": k,
                **waiting(devices), "sharing": cm.core_sharing(type_of[devices[0]])}

    def waiting(devices: Sequence[int]) -> dict[str, Any]:
        """The cores an op's devices run on and the scheduler's delays there (``_Sim``'s handoff)."""
        return {"hosts": [h for d in devices for h in hosts_of.get(d, ())],
                "handoff": cm.core_handoff(type_of[devices[0]])}

    # The stages' action lists: compute, and communication groups (a rendezvous with the matching side).
    where: dict[tuple[int, int, str, int], str] = {}   # (pipeline, stage, transfer kind, mb) -> comm op id
    actions = {}
    for pi, pipe in enumerate(pipes):
        n = len(pipe.stages)
        for k in range(n):
            actions[pi, k] = schedule_actions(k, n, pipe.micro_batches, schedule)
            for ai, (kind, what) in enumerate(actions[pi, k]):
                if kind == "C":
                    for tkind, j in what:
                        where[pi, k, tkind, j] = f"p{pi}s{k}C{ai}"
    match = {"recv_forward": (-1, "send_forward"), "send_forward": (+1, "recv_forward"),
             "recv_backward": (+1, "send_backward"), "send_backward": (-1, "recv_backward")}
    for pi, pipe in enumerate(pipes):
        for k, st in enumerate(pipe.stages):
            sc = stage_costs[pi, k]
            res = f"p{pi}s{k}"
            for ai, (kind, what) in enumerate(actions[pi, k]):
                dtype = type_of[st.devices[0]]
                resume = cm.resume_penalty(dtype) if cm.host_contended(dtype) else None
                if kind == "F":
                    sim.add(f"{res}F{what}", res, kind="forward", pipeline=pi, stage=k, mb=what, resume=resume,
                            **block(st.devices, sc.forward_s, sc.tp_forward_s, sc.tp_cpu_forward_s))
                elif kind == "B":
                    sim.add(f"{res}B{what}", res, kind="backward", pipeline=pi, stage=k, mb=what, resume=resume,
                            **block(st.devices, sc.backward_s, sc.tp_backward_s, sc.tp_cpu_backward_s))
                else:
                    own = 0.0
                    waits = []
                    for tkind, j in what:
                        off, peer_kind = match[tkind]
                        peer = pipe.stages[k + off]
                        src, dst = (st, peer) if tkind.startswith("send") else (peer, st)
                        secs = cm.p2p_time(src.devices, dst.devices)
                        waits.append((where[pi, k + off, peer_kind, j], secs))
                        own = max(own, secs)
                    sim.add(f"{res}C{ai}", res, own, waits=waits, kind="p2p", pipeline=pi, stage=k, mb=what[0][1],
                            transfers=what, transfer_s=own, wake=cm.comm_wake(type_of[st.devices[0]]),
                            **waiting(st.devices))
    # After its stage's last action each device runs the step's own code (gradients collected, norm
    # summed: CPU work, never stretched), joins its gradient-sync groups in the global order (a group's
    # all-reduce completes when its last member has joined), then the step's loss / grad-norm all-reduce
    # over every device, then its optimizer step.
    last_action = {}
    for (pi, k), acts in actions.items():
        kind, what = acts[-1]
        last_action[pi, k] = f"p{pi}s{k}C{len(acts) - 1}" if kind == "C" else f"p{pi}s{k}{kind}{what}"
    stage_of = {d: (pi, k) for pi, p in enumerate(pipes) for k, st in enumerate(p.stages) for d in st.devices}
    plan = cm.sync_plan(strategy)
    last_of = {d: last_action[stage_of[d]] for d in strategy.devices}
    overhead = cm.step_overhead_times(strategy)
    for d in strategy.devices:
        if overhead[d] > 0:
            sim.add(f"over{d}", f"dev{d}", deps=[last_of[d]], kind="step", pipeline=stage_of[d][0],
                    stage=stage_of[d][1], mb=None, cpu=overhead[d], sharing=cm.core_sharing(type_of[d]),
                    **waiting((d,)))
            last_of[d] = f"over{d}"
    def collectives(prefix: str, kind: str, seconds: Callable[[SyncGroup], float]) -> None:
        """One collective per sync group, in the runtime's global group order: each member joins after
        its previous op, and the group's op ends once its last member has joined (a rendezvous)."""
        for gi, g in enumerate(plan):
            secs = seconds(g)
            for d in g.devices:
                sim.add(f"{prefix}{gi}d{d}", f"dev{d}", secs, [last_of[d]],
                        waits=[(f"{prefix}{gi}d{e}", secs) for e in g.devices if e != d],
                        kind=kind, pipeline=stage_of[d][0], stage=stage_of[d][1], mb=None,
                        wake=cm.comm_wake(type_of[d]), **waiting((d,)))
                last_of[d] = f"{prefix}{gi}d{d}"

    collectives("g", "grad_sync", cm.sync_group_time)
    sim.add("stats", "world", cm.clip_time(strategy.devices), sorted(set(last_of.values())), kind="clip",
            pipeline=-1, stage=-1, mb=None)
    opt_times = cm.optimizer_times(strategy, zero)
    for d in strategy.devices:
        opt_block = block((d,), opt_times[d])
        sim.add(f"opt{d}", f"dev{d}", deps=["stats"], kind="optimizer", pipeline=stage_of[d][0],
                stage=stage_of[d][1], mb=None, **opt_block)
        last_of[d] = f"opt{d}"
    # ZeRO-1: after its update each device all-gathers the updated parameter chunks in every sync group
    # it belongs to, in the same global order as the gradient sync (runtime/engine/zero.py).
    gathers = list(enumerate(plan)) if zero else []
    if zero:
        collectives("z", "zero_gather", cm.zero_gather_time)
    times = sim.run()
    step = max(end for _, end in times.values())

    # Reports.
    events: list[Event] = []
    p2p_busy: dict[tuple[int, int], float] = {}
    fb_wall: dict[tuple[int, int], float] = {}
    for op, (start, end) in times.items():
        info = sim.ops[op]
        key = (info["pipeline"], info["stage"])
        if info["kind"] == "p2p":
            name = ", ".join(f"{t.replace('_', ' ')} {j}" for t, j in info["transfers"])
            busy = min(end - start, info["transfer_s"])
            p2p_busy[key] = p2p_busy.get(key, 0.0) + busy
            events.append(Event(name, "p2p", info["pipeline"], info["stage"], "stage", start, end, info["mb"], busy))
        elif info["kind"] in ("forward", "backward"):
            fwd = info["kind"] == "forward"
            sc = stage_costs[key]
            fb_wall[key] = fb_wall.get(key, 0.0) + end - start
            events.append(Event(f"{'F' if fwd else 'B'}{info['mb']}", info["kind"], info["pipeline"], info["stage"],
                                "stage", start, end, info["mb"], sc.tp_forward_s if fwd else sc.tp_backward_s))
    stats0, stats1 = times["stats"]
    memory = {}
    reports = []
    pipe_end = []
    for pi, pipe in enumerate(pipes):
        n = len(pipe.stages)
        pipe_end.append(max(times[last_action[pi, k]][1] for k in range(n)))
        for k, st in enumerate(pipe.stages):
            sc = stage_costs[pi, k]
            d0 = st.devices[0]
            syncs = [times[f"g{gi}d{d0}"] for gi, g in enumerate(plan) if d0 in g.devices]
            sync_busy = sum(sim.ops[f"g{gi}d{d0}"]["duration"] for gi, g in enumerate(plan) if d0 in g.devices)
            if syncs:
                events.append(Event("grad sync", "grad_sync", pi, k, "stage", syncs[0][0], syncs[-1][1], None,
                                    sync_busy))
            if stats1 > stats0:
                events.append(Event("loss/norm all-reduce", "clip", pi, k, "stage", stats0, stats1, None,
                                    stats1 - stats0))
            o0, o1 = max((times[f"opt{d}"] for d in st.devices), key=lambda x: x[1])
            events.append(Event("optimizer", "optimizer", pi, k, "stage", o0, o1))
            zs = [times[f"z{gi}d{d0}"] for gi, g in gathers if d0 in g.devices]
            gather_busy = sum(sim.ops[f"z{gi}d{d0}"]["duration"] for gi, g in gathers if d0 in g.devices)
            if zs:
                events.append(Event("ZeRO-1 param all-gather", "zero_gather", pi, k, "stage", zs[0][0], zs[-1][1],
                                    None, gather_busy))
            peak = _peak_in_flight([times[f"p{pi}s{k}F{j}"][1] for j in range(pipe.micro_batches)],
                                   [times[f"p{pi}s{k}B{j}"][1] for j in range(pipe.micro_batches)])
            dtype = type_of[d0]
            mem = cm.stage_memory(dtype, st.tp, st.num_layers, k == 0, k == n - 1, st.recompute, peak,
                                  len(pipes) if zero else 1)
            for d in st.devices:
                memory[d] = mem.gib
            m = pipe.micro_batches
            compute = fb_wall.get((pi, k), 0.0) - m * sc.tp_comm_s
            comm = m * sc.tp_comm_s + sync_busy + (stats1 - stats0) + gather_busy
            p2p = p2p_busy.get((pi, k), 0.0)
            reports.append(StageReport(
                pipeline=pi, stage=k, devices=st.devices, device_type=dtype, tp=st.tp, layers=st.layers,
                micro_batches=m, compute_s=compute, comm_s=comm, p2p_s=p2p, optimizer_s=o1 - o0,
                bubble_s=max(0.0, step - compute - comm - p2p - (o1 - o0)), peak_in_flight=peak,
                peak_memory_gib=mem.gib, capacity_gib=cm.cluster.type_of(d0).memory_gib))
    est = cm.estimate(strategy, global_batch, schedule, zero)
    events.sort(key=lambda e: (e.start_s, e.pipeline, e.stage))
    return SimulationResult(
        strategy=strategy.name, schedule=schedule, step_time_s=step,
        tokens_per_s=global_batch * cm.seq_len / step if step > 0 else 0.0,
        mfu=cm.mfu(step, global_batch, strategy.devices), formula_step_time_s=est.step_time_s,
        pipeline_end_s=tuple(pipe_end), stages=tuple(reports), peak_memory_gib=memory,
        oom_devices=tuple(sorted(d for d, g in memory.items() if g > cm.cluster.type_of(d).memory_gib)),
        events=tuple(events), cpu_hosts=dict(cores))


def cpu_layout(cm: CostModel, strategy: Strategy) -> tuple[dict[str, float], dict[int, list[tuple[str, float]]]]:
    """Which cores each device of an emulated cluster runs on, as the launcher pins its workers: (cores
    per host, device -> [(host, demand)]). One host per core; empty when the devices do not share CPUs
    (real accelerators, or no measured core count)."""
    if not cm.cluster.emulated:
        return {}, {}
    known = [c for n in {d.node for d in cm.cluster.devices} if (c := cm.host_cores(n))]
    if not known:
        return {}, {}
    _, pinned = emulated_cpu_shares(strategy.devices, cm.cluster.num_devices, range(min(known)))
    # Sleep-mode devices are pinned too, but their blocks last their targets: they take no part in it.
    shares = {d: cs for d, cs in pinned.items() if cm.host_contended(cm.cluster.device(d).type)}
    cores = {f"core {c}": 1.0 for cs in shares.values() for c in cs}
    return cores, {d: [(f"core {c}", 1.0) for c in cs] for d, cs in shares.items()}


def _peak_in_flight(fwd_end: Sequence[float], bwd_end: Sequence[float]) -> int:
    """Most micro-batches whose forward is done and backward is not, over the step."""
    marks = sorted([(t, 1) for t in fwd_end] + [(t, -1) for t in bwd_end], key=lambda x: (x[0], x[1]))
    cur = peak = 0
    for _, delta in marks:
        cur += delta
        peak = max(peak, cur)
    return peak


def chrome_trace(result: SimulationResult, strategy: Strategy) -> dict[str, Any]:
    """Chrome trace-event JSON (open in Perfetto / chrome://tracing): a process per pipeline, a thread
    per stage and per link direction; times in microseconds."""
    out: list[dict[str, Any]] = []
    tids: dict[tuple[int, str, int], int] = {}
    for pi, pipe in enumerate(strategy.pipelines):
        out.append({"ph": "M", "name": "process_name", "pid": pi,
                    "args": {"name": f"pipeline {pi} ({pipe.micro_batches} micro-batches)"}})
    for e in result.events:
        key = (e.pipeline, e.lane, e.stage)
        if key not in tids:
            tid = len(tids)
            tids[key] = tid
            st = strategy.pipelines[e.pipeline].stages[e.stage]
            label = (f"stage {e.stage}: devices {','.join(map(str, st.devices))} layers {st.layers[0]}-"
                     f"{st.layers[1] - 1}" if e.lane == "stage" else f"stage {e.stage} {e.lane}")
            out.append({"ph": "M", "name": "thread_name", "pid": e.pipeline, "tid": tid, "args": {"name": label}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": e.pipeline, "tid": tid,
                        "args": {"sort_index": e.stage * 3 + (0 if e.lane == "stage" else 1)}})
        args: dict[str, Any] = {"comm_ms": round(e.comm_s * 1e3, 4)}
        if e.micro_batch is not None:
            args["micro_batch"] = e.micro_batch
        out.append({"ph": "X", "name": e.name, "cat": e.category, "pid": e.pipeline, "tid": tids[key],
                    "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"strategy": result.strategy, "schedule": result.schedule,
                          "step_time_s": result.step_time_s}}
