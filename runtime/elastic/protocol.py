"""What the launcher and the workers of an elastic (or switching) run tell each other.

The launcher is the coordinator: it owns the store, sees every death and silence, and decides. Workers
only act on its word, so every survivor takes the same path through a failure.

Launcher -> worker (control pipe):

* ``Commit(gen, step, then)``: every device of the plan reached the end of ``step`` (gradients synced,
  statistics reduced): apply the optimizer update. ``then`` is "next" (run the next step) or "hold"
  (wait for the next word: a switch or the end).
* ``Abort(gen)``: generation ``gen`` is over (a device failed). Abandon the step in progress without
  updating anything, drop the process groups, answer ``Left``.
* ``Transition``: form ``world`` (if any), specialize the target plan, move the state with the fused
  BSR, answer ``Switched``; keep the old state until ``Resume``.
* ``Resume(epoch)``: every device switched: adopt the new program and train from ``step + 1``.
* ``Finish()``: the last step is done: save, write traces, leave the world, exit.

Worker -> launcher (report pipe): ``Ready(gen, step)``, ``Left(gen)``, ``Switched(epoch, times)``,
``Interrupted(gen, report)`` (a committed step whose ZeRO-1 parameter all-gather failed: its statistics, in
place of its ``StepDone``), plus the plain run's words (runtime/launch/messages.py; ``FaultFiring`` times a
failure).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from runtime.launch.options import rank_map

if TYPE_CHECKING:  # annotations only: this module stays importable without torch
    from runtime.torchfree.comm.bsr import BsrPlan
    from runtime.torchfree.spec.handle import StrategyHandle

Then = Literal["next", "hold"]


@dataclass(frozen=True)
class World:
    """A torch.distributed world: its store prefix (fresh per generation) and the ranks of its devices."""

    generation: int
    prefix: str
    ranks: Mapping[int, int]  # device id -> rank

    @staticmethod
    def of(generation: int, devices: tuple[int, ...] | list[int]) -> World:
        return World(generation, f"hspmd/gen{generation}/", rank_map(devices))


@dataclass(frozen=True)
class Transition:
    """Move the run from ``source`` (what the devices hold now) to ``target``."""

    epoch: int  # tags this transition's answers
    source: StrategyHandle
    target: StrategyHandle
    steps_done: int  # optimizer steps in the state; training continues with steps_done + 1
    bsr: BsrPlan  # the fused BSR of every parameter and AdamW moment (computed once, by the launcher)
    world: World | None  # form this world first (after a failure); None keeps the current one
    # ZeRO-1: the committed step's parameter all-gather did not finish, so a sharded slice's parameters are
    # final only on its chunks' holders: the first round rebuilds them from there, with the moments.
    ungathered: bool = False


@dataclass(frozen=True)
class Commit:
    generation: int
    step: int
    then: Then

    def __post_init__(self) -> None:
        if self.then not in get_args(Then):
            raise ValueError(f"commit: unknown continuation {self.then!r}")


@dataclass(frozen=True)
class Abort:
    generation: int


@dataclass(frozen=True)
class Resume:
    epoch: int


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Ready:
    generation: int
    step: int


@dataclass(frozen=True)
class Left:
    generation: int


@dataclass(frozen=True)
class Interrupted:
    """Committed step ``report.step`` failed after its update, in ZeRO-1's parameter all-gather: what the step
    measured (the loss and norm were final before the commit), and that this device's parameters are final only
    on its own chunks."""

    generation: int
    report: object  # runtime.launch.options.StepReport


@dataclass(frozen=True)
class Switched:
    epoch: int  # the transition; then this device's share of it, in seconds
    regroup_s: float  # new world and process groups
    specialize_s: float  # building the target program
    transfer_s: float  # the fused BSR and loading the state into the program


# -- node agents <-> coordinator (runtime/elastic/agents.py), each pickled into a TCPStore queue ---------


@dataclass(frozen=True)
class Hello:
    """Agent -> coordinator: node ``node`` offers its devices to job ``token``; answers go to the queue
    named by ``nonce`` (two agents claiming one node must not read each other's answers)."""

    node: str
    token: str
    nonce: str
    pid: int


@dataclass(frozen=True)
class Accepted:
    heartbeat_s: float  # how often the agent says it is alive


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Spawn:
    """Coordinator -> agent: start a worker (``spec``, running ``loop``) and tell it where the store is."""

    spec: object  # runtime.launch.options.WorkerSpec
    loop: object  # runtime.launch.worker.WorkerLoop


@dataclass(frozen=True)
class ToWorker:
    device: int
    msg: object


@dataclass(frozen=True)
class KillWorker:
    device: int


@dataclass(frozen=True)
class KillNode:
    """Fault injection: the agent SIGKILLs itself; its workers exit as their control pipes close."""


@dataclass(frozen=True)
class StopAgent:
    """The job is over: stop the workers still running and exit."""


@dataclass(frozen=True)
class FromWorker:
    """Agent -> coordinator: what worker ``device`` said (or, for an ``Exited``, what became of it)."""

    node: str
    nonce: str
    device: int
    msg: object


@dataclass(frozen=True)
class AgentBeat:
    node: str
    nonce: str


@dataclass(frozen=True)
class AgentDone:
    node: str
    nonce: str
