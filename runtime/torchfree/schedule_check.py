"""Checking per-device action lists by playing them on a simulated machine (torch-free).

``check_schedule`` is how the tests hold every generated schedule, and any list a caller builds, to the
claims of docs/schedules.md: matched messages, no deadlock, every op once, in dependency order, on its
device, within the activations it may hold.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from runtime.torchfree.schedule_actions import needed_message
from runtime.torchfree.schedule_policies import Layout
from runtime.torchfree.schedule_sync import with_host_syncs
from runtime.torchfree.schedule_types import (
    Action,
    Compute,
    Message,
    PostRecv,
    PostSend,
    WaitRecv,
    WaitSends,
    action_text,
)


@dataclass(frozen=True)
class ScheduleCheck:
    """What playing the action lists showed (``problems`` empty: every claim holds)."""

    problems: tuple[str, ...]
    transfers: int  # messages matched
    deadlock: bool
    peak_live: tuple[int, ...]  # [device] most live activations at once

    @property
    def ok(self) -> bool:
        return not self.problems


def check_schedule(actions: Sequence[Sequence[Action]], layout: Layout, micro_batches: int, *,
                   split_backward: bool, host_syncs: Sequence[Collection[int]] | None = None) -> ScheduleCheck:
    """Play per-device action lists on a simulated machine and report every violation.

    The machine: a device runs its actions in order; posts never block; ``WaitRecv`` blocks until the
    message's receive completes, ``WaitSends`` until all the device's sends have. Each pair of devices
    has one FIFO queue of posted operations per side (NCCL runs a pair's operations on one stream, in
    post order): an operation completes when it is at the head of its side's queue and the peer's
    head is its counterpart, the k-th send from a to b meeting the k-th receive at b from a (in-order
    matching, no tags). Checked: every message matched with the content its receiver expects; no
    deadlock; each micro-batch's F and B/W (or BW) exactly once per virtual stage, on the stage's device,
    after what it reads; sends after their producer; the peak of live activations per device.
    ``host_syncs``: per device, the actions after which its host waits for the device, each waiting for
    every earlier action of the device (runtime/torchfree/schedule_sync.py: the NCCL rule).
    """
    if host_syncs is not None:
        actions = with_host_syncs(actions, host_syncs)
    machine = _Machine(actions, layout, micro_batches, split_backward)
    deadlock = machine.play()
    if not deadlock:
        machine.finish()
    return ScheduleCheck(tuple(dict.fromkeys(machine.problems)), machine.matched, deadlock, tuple(machine.peak))


@dataclass
class _Machine:
    """``check_schedule``'s simulated machine: per device its place in its action list and what it has run,
    received and posted; per pair of devices the two queues of posted operations."""

    actions: Sequence[Sequence[Action]]
    layout: Layout
    micro_batches: int
    split_backward: bool
    problems: list[str] = field(default_factory=list)
    pc: list[int] = field(init=False)   # [device] index of its next action
    done: list[set[tuple[str, int, int]]] = field(init=False)   # [device] (kind, micro-batch, stage) run
    arrived: list[set[Message]] = field(init=False)   # [device] messages whose receive completed here
    queues: dict[tuple[int, int], list[tuple[str, Message]]] = field(default_factory=dict)  # (me, peer) -> posted
    heads: dict[tuple[int, int], int] = field(default_factory=dict)   # (me, peer) -> first not completed
    recv_done: list[dict[Message, bool]] = field(init=False)   # [device] receives posted -> completed
    pending_sends: list[int] = field(init=False)
    live: list[int] = field(init=False)
    peak: list[int] = field(init=False)
    matched: int = 0

    def __post_init__(self) -> None:
        n = self.layout.num_devices
        self.pc = [0] * n
        self.done = [set() for _ in range(n)]
        self.arrived = [set() for _ in range(n)]
        self.recv_done = [{} for _ in range(n)]
        self.pending_sends = [0] * n
        self.live = [0] * n
        self.peak = [0] * n

    @property
    def backward(self) -> str:
        """The backward op a gradient message leaves from (and the next stage's backward waits for)."""
        return "B" if self.split_backward else "BW"

    def play(self) -> bool:
        """Run every device until all lists end (False) or no device and no pair can move (True, a deadlock,
        with the blocked actions among the problems)."""
        n, actions, pc = self.layout.num_devices, self.actions, self.pc
        while any(pc[d] < len(actions[d]) for d in range(n)):
            before = (sum(pc), self.matched)
            for d in range(n):
                self.step(d)
            self.progress_all()
            if (sum(pc), self.matched) == before:
                blocked = [f"device {d} at action {pc[d]}: {action_text(actions[d][pc[d]])}"
                           for d in range(n) if pc[d] < len(actions[d])]
                self.problems.append("deadlock: " + "; ".join(blocked))
                return True
        return False

    def finish(self) -> None:
        """After the lists ran to their ends: what was posted and never matched, what never ran, and lists
        that do not end by waiting for their sends."""
        layout, n = self.layout, self.layout.num_devices
        self.progress_all()
        self.problems += [f"device {a}: its {kind} of {msg} is never matched"
                          for (a, b), q in sorted(self.queues.items()) for kind, msg in q[self.heads.get((a, b), 0):]]
        kinds = ("F", "B", "W") if self.split_backward else ("F", "BW")
        self.problems += [f"device {layout.device(j)}: {k}(mb {mb}, stage {j}) never runs"
                          for j in range(layout.num_stages) for mb in range(self.micro_batches) for k in kinds
                          if (k, mb, j) not in self.done[layout.device(j)]]
        self.problems += [f"device {d}: the action list does not end by waiting for its sends"
                          for d in range(n) if not self.actions[d] or not isinstance(self.actions[d][-1], WaitSends)]

    def step(self, d: int) -> None:
        """Run device d's actions until it blocks."""
        acts, pc = self.actions[d], self.pc
        while pc[d] < len(acts):
            a = acts[pc[d]]
            if isinstance(a, Compute):
                self.run_compute(d, a)
            elif isinstance(a, PostSend):
                self.post_send(d, a.message)
            elif isinstance(a, PostRecv):
                self.post_recv(d, a.message)
            elif isinstance(a, WaitRecv):
                if not self.wait_recv(d, a.message):
                    return
            elif isinstance(a, WaitSends):
                if not self.wait_sends(d):
                    return
            else:
                self.problems.append(f"device {d}: unknown action {a!r}")
            pc[d] += 1

    def run_compute(self, d: int, op: Compute) -> None:
        k, mb, j = op.kind, op.micro_batch, op.stage
        layout, last, done = self.layout, self.layout.num_stages - 1, self.done[d]
        problems, bk = self.problems, self.backward
        name = f"device {d}: {op}"
        backward_kinds = {"B", "W"} if self.split_backward else {"BW"}
        if not (0 <= j <= last and 0 <= mb < self.micro_batches) or (k != "F" and k not in backward_kinds):
            problems.append(f"{name}: not an op of this schedule")
            return
        if layout.device(j) != d or layout.chunk(j) != op.chunk:
            problems.append(f"{name}: virtual stage {j} is chunk {layout.chunk(j)} of device {layout.device(j)}")
        if (k, mb, j) in done:
            problems.append(f"{name}: runs twice")
        need = needed_message(op, layout)
        if k == "F":
            if j > 0 and need is None and ("F", mb, j - 1) not in done:
                problems.append(f"{name}: before F of stage {j - 1}")
        elif k == "W":
            if ("B", mb, j) not in done:
                problems.append(f"{name}: before its B")
        else:
            if ("F", mb, j) not in done:
                problems.append(f"{name}: before its F")
            if j < last and need is None and (bk, mb, j + 1) not in done:
                problems.append(f"{name}: before the backward of stage {j + 1}")
        if need is not None and need not in self.arrived[d]:
            problems.append(f"{name}: reads {need} before waiting for it")
        done.add((k, mb, j))
        if k == "F":
            self.live[d] += 1
            self.peak[d] = max(self.peak[d], self.live[d])
        elif k == ("W" if self.split_backward else "BW"):
            self.live[d] -= 1

    def post_send(self, d: int, msg: Message) -> None:
        if msg.src != d or not _valid_message(msg, self.layout):
            self.problems.append(f"device {d}: posts a send of {msg}, which is not its to send")
            return
        src_kind = "F" if msg.kind == "activation" else self.backward
        if (src_kind, msg.micro_batch, msg.src_stage) not in self.done[d]:
            self.problems.append(f"device {d}: sends {msg} before computing it")
        self.queue(d, msg.dst).append(("send", msg))
        self.pending_sends[d] += 1

    def post_recv(self, d: int, msg: Message) -> None:
        if msg.dst != d or not _valid_message(msg, self.layout):
            self.problems.append(f"device {d}: posts a receive of {msg}, which is not its to receive")
            return
        if msg in self.recv_done[d]:
            self.problems.append(f"device {d}: posts a second receive of {msg}")
        self.queue(d, msg.src).append(("recv", msg))
        self.recv_done[d][msg] = False

    def wait_recv(self, d: int, msg: Message) -> bool:
        """Whether device d may go past its wait for ``msg`` (a wait without its receive is a problem, and
        passes)."""
        if msg not in self.recv_done[d]:
            self.problems.append(f"device {d}: waits for {msg} without posting its receive")
        elif not self.recv_done[d][msg]:
            self.progress_pair(d, msg.src)
            if not self.recv_done[d][msg]:
                return False
        return True

    def wait_sends(self, d: int) -> bool:
        """Whether every send device d posted has completed."""
        for peer in range(self.layout.num_devices):
            if peer != d:
                self.progress_pair(d, peer)
        return not self.pending_sends[d]

    def queue(self, me: int, peer: int) -> list[tuple[str, Message]]:
        return self.queues.setdefault((me, peer), [])

    def progress_all(self) -> None:
        n = self.layout.num_devices
        for a in range(n):
            for b in range(a + 1, n):
                self.progress_pair(a, b)

    def progress_pair(self, a: int, b: int) -> None:
        """Complete the matching heads of the (a, b) pair's two queues."""
        qa, qb, heads = self.queue(a, b), self.queue(b, a), self.heads
        while heads.get((a, b), 0) < len(qa) and heads.get((b, a), 0) < len(qb):
            ha, hb = qa[heads.get((a, b), 0)], qb[heads.get((b, a), 0)]
            if ha[0] == "send" and hb[0] == "recv":
                src, dst, sent, want = a, b, ha[1], hb[1]
            elif ha[0] == "recv" and hb[0] == "send":
                src, dst, sent, want = b, a, hb[1], ha[1]
            else:
                return  # both sides wait to send (or to receive) first: this pair is stuck
            if sent != want:
                self.problems.append(f"device {dst}: its receive for {want} matches the send of {sent} "
                                     "(the pair posts its messages in different orders)")
            heads[(a, b)] = heads.get((a, b), 0) + 1
            heads[(b, a)] = heads.get((b, a), 0) + 1
            self.pending_sends[src] -= 1
            self.recv_done[dst][want] = True
            self.arrived[dst].add(sent)
            self.matched += 1


def _valid_message(msg: Message, layout: Layout) -> bool:
    """Whether ``msg`` is a real boundary crossing of ``layout`` (its stages exist, on its devices)."""
    a, b = msg.src_stage, msg.dst_stage
    if max(a, b) >= layout.num_stages:
        return False
    return msg.src == layout.device(a) and msg.dst == layout.device(b)
