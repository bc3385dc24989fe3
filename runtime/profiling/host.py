"""The emulated host: how an emulated cluster's devices share this machine's CPU, and what that costs.

Each worker is a process on one host; the launcher gives each its share of the cores
(``emulated_cpu_shares``, ``pin_process``) and ``hspmd profile`` measures under the same share. The probes
measure what planner/host.py models: the cost of a block after idling, of waking from a blocking
receive, of two processes on one core, of a core-mate computing. Importing this loads no torch (the
policy has torch-free callers); the probes load it when they run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from runtime.profiling.fit import fit_saturating, rounded, trimmed_mean
from runtime.profiling.profile import CoreHandoff, P2pActions, ResumePenalty, SharingCurve
from runtime.spec.model import ModelSpec

if TYPE_CHECKING:
    import torch

    from runtime.profiling.compute import StageRun


def emulated_cpu_shares(devices: Sequence[int], cluster_devices: int,
                        cpus: Sequence[int]) -> tuple[int, dict[int, tuple[int, ...]]]:
    """The CPU share of each worker of an emulated cluster on this host: (intra-op threads, device ->
    cores to pin it to).

    Every worker gets the same thread count, ``max(1, cores // cluster devices)``, whichever devices the
    plan uses: an emulated device's speed must not depend on the plan (and one profile, measured at that
    count, fits every plan). The i-th device of the plan (in id order) is pinned to cores ``i*t ..
    i*t+t-1`` (mod the core count): left alone, the scheduler at times puts two communicating workers on
    one core while another core idles (wake-affine placement), and the same plan's step time varied by
    +-20% from run to run.
    """
    cores = list(cpus) or [0]
    t = max(1, len(cores) // max(1, cluster_devices))
    return t, {d: tuple(sorted({cores[(i * t + j) % len(cores)] for j in range(t)}))
               for i, d in enumerate(sorted(devices))}


def host_cpus() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_process(cpus: Sequence[int]) -> None:
    """Pin this process to ``cpus`` (where the OS allows it; none: left as it is)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def pinned(cpus: Sequence[int], threads: int | None = None) -> Iterator[None]:
    """The body runs on ``cpus`` (none: as it is) with ``threads`` intra-op threads (None: as they are), as
    the launcher runs a worker; this process's cores and threads are restored after."""
    import torch

    old_cpus, old_threads = host_cpus(), torch.get_num_threads()
    try:
        pin_process(cpus)
        if threads:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(old_threads)
        pin_process(old_cpus)


def _stage_run(model: ModelSpec, layers: int, seq_len: int, device: torch.device | str, micro_batch: int = 1,
               warmup: int = 2, *, embed: bool = False, head: bool = False) -> StageRun:
    """A stage of ``layers`` decoder layers at TP 1 (a middle one unless it holds the ``embed``-ding or the
    ``head``) run by the engine's step, warmed up."""
    from runtime.profiling.compute import StageRun

    run = StageRun(model, 1, layers, embed, head, micro_batch, seq_len, device)
    for _ in range(warmup):
        run.prepare_backward()()
    return run


def measure_resume_penalty(model: ModelSpec, seq_len: int, *, device: torch.device | str = "cpu",
                           idles_s: Sequence[float] = (0.0005, 0.002, 0.008, 0.032), reps: int = 8,
                           burst: int = 6, settle: int = 2, micro_batch: int = 1,
                           large: tuple[int, int] | None = None) -> ResumePenalty:
    """How much longer a stage block (as the engine runs it, TP 1) takes when the process idled (slept)
    for ``t`` before it than back to back: for each ``t`` of ``idles_s`` (and none, the back-to-back
    base), a burst of ``burst`` blocks (forward and backward), each phase after ``t`` of sleep; the first
    ``settle`` of a burst are not timed. The mean differences are fitted with ``peak * (1 - exp(-t /
    tau))`` (tau from a log grid shared by every block and phase, peaks by least squares, none below
    zero). Timed on a one-decoder-layer block at ``seq_len`` and, with ``large`` = (layers, seq_len), on a
    bigger block too: the peak's growth between them (per CPU second of the block, back to back) is the
    penalty's rate, the rest its fixed part. The bursts of every idle and both blocks take turns within
    each repeat, so a change of the host's speed meanwhile hits them alike.

    Bursts, because a device that idles before each block (a stretched device sleeps twice its block's
    CPU after each one; a stage waits for its peers) runs slower than one idle once among blocks back to
    back: timing the two alternately, block by block, gave a one-layer forward 0.0-0.02 ms more after
    8 ms idle, where this device in bursts, as in a 1F1B replay with micro-batches in flight, takes
    0.20-0.24 ms (18-22%) more, and an op of a stretched device in training 15-40% more than its back-to-back
    price (stop 34, docs/benchmarks.md "Simulator fidelity"). The untimed head of a burst absorbs the
    change from the previous burst's regime and shape (its data had left the caches).
    On a CPU the time is this thread's CPU time, so that a preemption meanwhile is no penalty."""
    from runtime.profiling.compute import time_once

    def timed(block: Callable[[], None], dev: torch.device) -> float:
        if dev.type != "cpu":
            return time_once(block, dev)[0]   # a GPU's kernels: wall time, synchronised
        c0 = time.thread_time()
        block()
        return time.thread_time() - c0

    shapes = [(1, seq_len)] + ([large] if large is not None else [])
    runs = [_stage_run(model, layers, s, device, micro_batch, warmup=3) for layers, s in shapes]
    # (shape, idle) -> (forward, backward) CPU seconds of the timed blocks of its bursts
    times: dict[tuple[int, float], tuple[list[float], list[float]]] = {
        (i, t): ([], []) for i in range(len(shapes)) for t in (0.0, *idles_s)}
    for _ in range(reps):
        for idle in (0.0, *idles_s):
            for i, run in enumerate(runs):
                for j in range(burst):
                    fwd = run.prepare_forward()
                    if idle:
                        time.sleep(idle)
                    forward_s = timed(fwd, run.device)
                    if idle:
                        time.sleep(idle)
                    backward_s = timed(run.backward, run.device)
                    if j >= settle:
                        times[i, idle][0].append(forward_s)
                        times[i, idle][1].append(backward_s)
    means = {k: (statistics.mean(f), statistics.mean(b)) for k, (f, b) in times.items()}
    hot = [means[i, 0.0] for i in range(len(shapes))]   # per shape: (forward, backward) back to back
    extra = [[means[i, idle][j] - hot[i][j] for i in range(len(shapes)) for j in (0, 1)] for idle in idles_s]
    peaks, tau = fit_saturating(idles_s, extra)
    fixed, rates = list(peaks[:2]), [0.0, 0.0]
    if large is not None:
        for i in (0, 1):
            span = hot[1][i] - hot[0][i]
            rates[i] = max(0.0, (peaks[2 + i] - peaks[i]) / span) if span > 0 else 0.0
            fixed[i] = max(0.0, peaks[i] - rates[i] * hot[0][i])
    return ResumePenalty(forward_s=fixed[0], backward_s=fixed[1], tau_s=tau, forward_rate=rates[0],
                         backward_rate=rates[1], forward_block_s=hot[0][0], backward_block_s=hot[0][1])


def p2p_wake(rank: int, device: torch.device, reps: int = 15,
             idles_s: Sequence[float] = (0.0, 0.0005, 0.002, 0.008)) -> ResumePenalty | None:
    """How much later a process blocked in a receive gets going when it has waited ``t`` (its core idle
    meanwhile): rank 0 sleeps ``t``, then sends to rank 1 (blocked in its receive since it last replied)
    and waits for the reply; the round trip beyond the one at ``t = 0`` is rank 1's extra wake-up time.
    Fitted as ``peak * (1 - exp(-t / tau))`` (``ResumePenalty`` with forward_s = backward_s = peak)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(1024, device=device)
    rtts: list[float] = []
    for idle in idles_s:
        dist.barrier()
        times = []
        for _ in range(reps + 2):
            if rank == 0:
                if idle:
                    time.sleep(idle)
                t0 = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(buf, 1)
                times.append(time.perf_counter() - t0)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        if rank == 0:
            rtts.append(trimmed_mean(times[2:]))
    if rank != 0:
        return None
    (peak,), tau = fit_saturating(idles_s, [(max(0.0, r - rtts[0]),) for r in rtts])
    return ResumePenalty(forward_s=peak, backward_s=peak, tau_s=tau)


def p2p_actions(rank: int, device: torch.device, shape: Sequence[int], reps: int = 30,
                settle_s: float = 0.002, idles_s: Sequence[float] = (0.0, 0.004, 0.016, 0.048),
                cold_reps: int = 10) -> P2pActions:
    """The executor's CPU per boundary-message action (inside an initialised process group of at least
    two ranks): rank 0 sends rank 1 a boundary tensor of ``shape`` through the engine's own
    ``BoundaryChannel`` and op (runtime/engine/pipeline.py, as ``hspmd train`` posts it), ``reps`` times
    back to back and ``cold_reps`` times after each of ``idles_s`` idle before every action (a stage posts
    its messages after a block's sleep). Timed on the thread that posts (CPU time, so that a preemption
    is no cost): rank 0's post of the send, rank 1's post of the receive and, once the message has had
    ``settle_s`` to arrive, its wait (what is left is unpacking it; the time spent blocked waiting is the
    transfer's, priced apart). Medians; the extra after idling fitted as ``peak * (1 - exp(-t / tau))``,
    one tau for the three actions. Returned on every rank."""
    import torch
    import torch.distributed as dist

    from runtime.annotations import Annotation
    from runtime.comm.resolve import resolve
    from runtime.engine.pipeline import BoundaryChannel

    op = resolve(Annotation.spmd([0]), Annotation.spmd([1]), tuple(shape))
    x = torch.randn(*shape, device=device)
    ranks = {0: 0, 1: 1}
    medians = []
    for idle in idles_s:
        n = reps if idle == 0 else cold_reps
        times: tuple[list[float], list[float], list[float]] = ([], [], [])
        for i in range(n + 2):   # the first two warm up
            channel = BoundaryChannel(rank, ranks) if rank in ranks else None
            if rank == 1:
                assert channel is not None
                time.sleep(idle)
                c0 = time.thread_time()
                channel.post_recv(i, op, dtype=x.dtype, device=device)
                times[1].append(time.thread_time() - c0)
            dist.barrier()
            if rank == 0:
                assert channel is not None
                time.sleep(idle)
                c0 = time.thread_time()
                channel.post_send(op, x)
                times[0].append(time.thread_time() - c0)
            time.sleep(max(settle_s, idle))
            if rank == 1:
                assert channel is not None
                c0 = time.thread_time()
                channel.wait_recv(i)
                times[2].append(time.thread_time() - c0)
            if channel is not None:
                channel.wait_sends()
            dist.barrier()
        res = torch.tensor([statistics.median(t[2:]) if t else 0.0 for t in times], dtype=torch.float64)
        dist.all_reduce(res)
        medians.append(res.tolist())
    hot = medians[0]
    cold: tuple[float, ...] = (0.0, 0.0, 0.0)
    tau = 0.0
    if len(idles_s) > 1:
        cold, tau = fit_saturating(idles_s, [[max(0.0, m[k] - hot[k]) for k in range(3)] for m in medians])
    return P2pActions(post_send_s=rounded(hot[0]), post_recv_s=rounded(hot[1]), wait_recv_s=rounded(hot[2]),
                      cold_post_send_s=rounded(cold[0]), cold_post_recv_s=rounded(cold[1]),
                      cold_wait_recv_s=rounded(cold[2]), cold_tau_s=rounded(tau) if any(cold) else 0.0)


def shared_core_p2p(rank: int, pair: tuple[int, int], device: torch.device, shape: Sequence[int], reps: int = 30,
                    busy_s: float = 0.002, settle_s: float = 0.005) -> float:
    """How much later a boundary message between the two ranks of ``pair`` (pinned to one core) arrives when
    its sender computes right after posting it, as a pipeline stage posts its output and goes on to its
    next block, than when the sender waits (inside an initialised process group; every rank takes part).
    The first rank of ``pair`` sends a boundary tensor of ``shape`` through the engine's
    ``BoundaryChannel`` ``reps`` times per case, alternating the cases; the receiver blocks in its wait and
    notes when the message has arrived; the sender's post time comes after it (one host's clock). The
    sender's compute is ``busy_s`` of matrix products: on this host the delay does not depend on its length
    (1.9 ms after 1, 2, 4 and 8 ms). Returns the difference of the cases' means, on every rank."""
    import torch
    import torch.distributed as dist

    from runtime.annotations import Annotation
    from runtime.comm.resolve import resolve
    from runtime.engine.pipeline import BoundaryChannel

    src, dst = pair
    op = resolve(Annotation.spmd([0]), Annotation.spmd([1]), tuple(shape))
    x = torch.randn(*shape, device=device)
    a = torch.randn(128, 128, device=device)
    stamp = torch.zeros(1, dtype=torch.float64)
    ranks = {0: src, 1: dst}
    arrivals: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * (reps + 1)):   # the first of each case warms up
        busy = bool(i % 2)
        channel = BoundaryChannel(0 if rank == src else 1, ranks) if rank in pair else None
        if rank == dst:
            assert channel is not None
            channel.post_recv(i, op, dtype=x.dtype, device=device)
        dist.barrier()
        if rank == src:   # the receiver is blocked in its wait by now, as a stage waiting for its input is
            assert channel is not None
            time.sleep(settle_s)
            t0 = time.perf_counter()
            channel.post_send(op, x)
            end = t0 + busy_s
            while busy and time.perf_counter() < end:
                a @ a
            channel.wait_sends()
            dist.send(stamp.fill_(t0), dst)
        elif rank == dst:
            assert channel is not None
            channel.wait_recv(i)
            arrived = time.perf_counter()
            dist.recv(stamp, src)
            if i >= 2:
                arrivals[busy].append(arrived - stamp.item())
        dist.barrier()
    res = torch.zeros(1, dtype=torch.float64)
    if rank == dst:
        # Means: the delay comes or not (0.35 or ~2.2 ms, about half the time each here), and a step pays
        # the sum over its boundaries, their mean.
        res[0] = max(0.0, statistics.fmean(arrivals[True]) - statistics.fmean(arrivals[False]))
    dist.all_reduce(res)
    return rounded(res[0].item())


def core_sharing(rank: int, pair: tuple[int, int], model: ModelSpec, seq_lens: Sequence[int], *,
                 device: torch.device | str = "cpu", duration_s: float = 0.25, pairs: int = 5
                 ) -> dict[int, SharingCurve]:
    """How well two processes pinned to one core share it (inside an initialised process group; ranks
    ``pair`` share a core, as the launcher pins two emulated devices when cores are fewer than devices),
    for two blocks: a one-layer stage and the whole model as one stage (forward and backward, as the engine
    runs them). Each is run for ``duration_s`` by the first rank alone, then by both at once, ``pairs``
    times in turn. Process CPU time per block, not wall time: the simulator charges sharing as the CPU a
    block then consumes, and the two ranks' phases never start at one instant (the first alone for a
    moment made wall times look 3-4% better shared). Returns ``{seq_len: SharingCurve}`` on every rank
    (``sharing_efficiency``: 1 when time-slicing costs nothing, less when each switch leaves the other
    process cold caches; less for the larger block, whose working set is evicted more)."""
    import torch
    import torch.distributed as dist

    out: dict[int, SharingCurve] = {}
    for s in seq_lens:
        points: list[tuple[float, float]] = []
        for run in (_stage_run(model, 1, s, device),
                    _stage_run(model, model.num_layers, s, device, embed=True, head=True)):
            alone: list[float] = []
            shared: list[float] = []
            for _ in range(pairs):
                per_block = []
                for both in (False, True):
                    dist.barrier()
                    if rank == pair[0] or (both and rank == pair[1]):
                        n, t0, c0 = 0, time.perf_counter(), time.process_time()
                        while time.perf_counter() - t0 < duration_s:
                            run.prepare_backward()()
                            n += 1
                        per_block.append((time.process_time() - c0) / n)
                    else:
                        time.sleep(duration_s)
                        per_block.append(0.0)
                res = torch.tensor([per_block[0], per_block[1], 1.0 if rank in pair else 0.0], dtype=torch.float64)
                dist.all_reduce(res)
                alone.append(res[0].item())                        # only the pair's first rank ran alone
                shared.append(res[1].item() / max(1.0, res[2].item()))
            points.append((statistics.median(alone), sharing_efficiency(alone, shared)))
        points.sort()
        out[s] = SharingCurve(block_s=tuple(rounded(b) for b, _ in points),
                              efficiency=tuple(rounded(e) for _, e in points))
    return out


def sharing_efficiency(alone_s: Sequence[float], shared_s: Sequence[float]) -> float:
    """(CPU seconds per block alone) / (CPU seconds per block shared), the median over neighbouring phases
    (``alone_s[i]``, ``shared_s[i]``), at most 1. Neighbours, because the host's speed drifts over
    seconds (a single alone-then-shared pair compares two moments); the median, because a phase can fall
    into one of the host's slow spells, and the first runs a freshly built block (in standalone runs of
    8 pairs, stop 32, the first pair's ratio was the highest: 1.016 against a median of 0.934)."""
    ratios = [a / sh for a, sh in zip(alone_s, shared_s) if a > 0 and sh > 0]
    return min(1.0, statistics.median(ratios)) if ratios else 1.0


def busy_core_handoff(rank: int, pair: tuple[int, int], model: ModelSpec, seq_lens: Sequence[int], *,
                      peer: int | None = None, sleep_ratio: float = 2.0, device: torch.device | str = "cpu",
                      duration_s: float = 0.6, peer_wait_s: float = 0.001) -> dict[int, dict[str, dict[str, float]]]:
    """How long an emulated device's process waits for its core around its compute blocks when the other
    process pinned to that core computes meanwhile (inside an initialised process group; ranks ``pair``
    share a core, ``peer`` runs on another one). The pair's first rank runs the runtime's duty cycle of an
    emulated device (one-layer stage block forward, then backward, each wrapped in ``EmulatedSlowdown``: a
    sleep of ``sleep_ratio`` times its CPU time after it; after each sleep, with a ``peer``, a blocking
    receive that the peer answers ``peer_wait_s`` later), first with the second rank idle, then with it
    computing stage blocks nonstop. Per sequence length and case ("idle", "busy"), the means over the
    blocks of: ``wall`` of a block, its CPU time (``cpu_forward``, ``cpu_backward``: more with the core-mate
    computing, whose work meanwhile took over the caches); ``gap`` from a block's end to the start of its sleep (the
    process runnable, the core taken: a time-slicing scheduler switches when a process that used up its
    slice makes a system call, here the CPU-time read that sizes the sleep); ``late``: how much later than
    asked it runs after its sleep; ``recv``: from the peer's send to the receive's return. Returned on
    every rank (the first rank's figures)."""
    import torch
    import torch.distributed as dist

    from runtime.trace import EmulatedSlowdown

    out: dict[int, dict[str, dict[str, float]]] = {}
    keys = ("wall", "cpu_forward", "cpu_backward", "gap", "late", "recv")
    flag = torch.zeros(1, dtype=torch.float64)
    for s in seq_lens:
        run = _stage_run(model, 1, s, device)
        out[s] = {}
        for case in ("idle", "busy"):
            dist.barrier()
            sums = torch.zeros(len(keys), dtype=torch.float64)
            if rank == pair[0]:
                rec = _DutyRecorder(sleep_ratio)
                slow = EmulatedSlowdown(1.0 + sleep_ratio, rec, sleep=rec.sleep)
                recv: list[float] = []
                t_end = time.perf_counter() + duration_s
                while time.perf_counter() < t_end:
                    fwd = run.prepare_forward()
                    for name, block in (("forward", fwd), ("backward", run.backward)):
                        with slow.span("compute", name):
                            block()
                        if peer is not None:
                            dist.send(flag.fill_(1.0), peer)
                            dist.recv(flag, peer)
                            recv.append(time.perf_counter() - flag.item())
                if peer is not None:
                    dist.send(flag.fill_(0.0), peer)
                rows = rec.rows[2:] or rec.rows   # the first blocks of a phase start from a cold core
                series = {"wall": [r[0] for r in rows], "cpu_forward": [r[1] for r in rows if r[4] == "forward"],
                          "cpu_backward": [r[1] for r in rows if r[4] == "backward"], "gap": [r[2] for r in rows],
                          "late": [r[3] for r in rows], "recv": recv[2:] or recv}
                for i, k in enumerate(keys):
                    sums[i] = statistics.fmean(series[k]) if series[k] else 0.0
            elif rank == peer:
                while True:
                    dist.recv(flag, pair[0])
                    if flag.item() == 0.0:
                        break
                    time.sleep(peer_wait_s)
                    dist.send(flag.fill_(time.perf_counter()), pair[0])
            elif rank == pair[1] and case == "busy":
                t_end = time.perf_counter() + duration_s + 0.05
                while time.perf_counter() < t_end:
                    run.prepare_backward()()
            else:
                time.sleep(duration_s)
            dist.all_reduce(sums)
            out[s][case] = {k: sums[i].item() for i, k in enumerate(keys)}
    return out


class _DutyRecorder:
    """Hooks for ``EmulatedSlowdown`` that time each compute block, its hand-off gap and its sleep."""

    def __init__(self, sleep_ratio: float) -> None:
        self.sleep_ratio = sleep_ratio
        self.start = self.end = 0.0
        self.name = ""
        self.rows: list[tuple[float, float, float, float, str]] = []   # (wall, cpu, gap, late, name) per block

    @contextlib.contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        if kind == "compute":
            self.start, self.name = time.perf_counter(), name
        yield
        if kind == "compute":
            self.end = time.perf_counter()

    def sleep(self, secs: float) -> None:
        t0 = time.perf_counter()
        time.sleep(secs)
        late = max(0.0, time.perf_counter() - t0 - secs)
        self.rows.append((self.end - self.start, secs / self.sleep_ratio, t0 - self.end, late, self.name))


def handoff_figures(raw: dict[str, dict[str, float]]) -> CoreHandoff:
    """The delays with the core's other process computing, beyond the same with it idle; and how late a
    sleep ends with it idle (``sleep_late_s``: every sleep pays that)."""
    busy, idle = raw["busy"], raw["idle"]
    extra = {k: rounded(max(0.0, busy[k] - idle[k])) for k in ("gap", "late", "recv", "cpu_forward", "cpu_backward")}
    return CoreHandoff(handoff_s=extra["gap"], wake_s=extra["late"], recv_wake_s=extra["recv"],
                       cold_forward_s=extra["cpu_forward"], cold_backward_s=extra["cpu_backward"],
                       block_forward_s=rounded(idle["cpu_forward"]), block_backward_s=rounded(idle["cpu_backward"]),
                       sleep_late_s=rounded(max(0.0, idle["late"])))
