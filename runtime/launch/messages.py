"""The words on the pipes between the launcher and a worker, one frozen dataclass each (an elastic run's
own are in runtime/elastic/protocol.py). None names its sender: the supervisor knows it by the pipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from runtime.launch.options import FaultKind, StepReport

ErrorKind = Literal["user", "error", "comm"]


@dataclass(frozen=True)
class Start:
    """Launcher -> worker: where the store listens (sent once the workers are importing torch). The
    launcher closing the control pipe says: exit now."""

    host: str
    port: int


@dataclass(frozen=True)
class Up:
    """Start-up is over: from now on a heartbeat is due every ``heartbeat_s``."""


@dataclass(frozen=True)
class Heartbeat:
    """The worker process lives; ``stalled_s``: how long its device has held unfinished work without
    finishing any (runtime/device_clock.py ``Progress``; always 0 on a CPU), ``stalled_at``: the kind of
    the oldest such work ("compute": stuck in its own work; "comm": waiting for a peer)."""

    stalled_s: float = 0.0
    stalled_at: str = ""


@dataclass(frozen=True)
class StepDone:
    report: StepReport


@dataclass(frozen=True)
class Log:
    text: str


@dataclass(frozen=True)
class WorkerError:
    """How a worker failed: "user" (HspmdError), "comm" (a collective or the store failed, usually because
    a peer died first) or "error" (anything else: a bug)."""

    kind: ErrorKind
    lines: tuple[str, ...]
    traceback: str

    def __post_init__(self) -> None:
        if self.kind not in get_args(ErrorKind):
            raise ValueError(f"unknown error kind {self.kind!r}")


@dataclass(frozen=True)
class FaultFiring:
    """An injected fault is about to fire (its wall time is when the failure really happened)."""

    kind: FaultKind
    wall_time: float


@dataclass(frozen=True)
class Exited:
    """Said on a worker's behalf by whoever watches its process: it ended with status ``code`` (0: its work
    is done and written; negative: killed by that signal)."""

    code: int | None


@dataclass(frozen=True)
class Lost:
    """Said on a worker's behalf by its node's agent relay when the agent itself went silent (the node's
    power or network): the worker may still run, but nothing it does can reach the run any more."""

    how: str
