"""What a training run is asked to do, and what each worker process is told (all picklable)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from runtime.precision import PRECISIONS, Precision

FaultKind = Literal["error", "user-error", "exit", "kill", "hang"]


@dataclass(frozen=True)
class Fault:
    """An injected failure (tests, demos): at the start of ``step`` the worker of ``device`` ...

    error: raises RuntimeError (a bug); user-error: raises HspmdError; exit: exits with status 3
    without a word; kill: SIGKILLs itself; hang: SIGSTOPs itself (only the heartbeat can tell).
    """

    device: int
    step: int
    kind: FaultKind

    def __post_init__(self) -> None:
        if self.kind not in get_args(FaultKind):
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.step < 1:
            raise ValueError(f"fault step must be at least 1, got {self.step}")


@dataclass(frozen=True)
class PlannedSwitch:
    """Switch to ``strategy`` of ``plan`` (None: its first) in memory before step ``step`` runs."""

    step: int
    plan: Path
    strategy: str | None = None

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"switch step must be at least 1, got {self.step}")


@dataclass(frozen=True)
class Rejoin:
    """Device ``device`` returns (its agent starts a worker for it) at the start of ``step``."""

    device: int
    step: int

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"rejoin step must be at least 1, got {self.step}")


@dataclass(frozen=True)
class NodeKill:
    """The agent of node ``node`` (and with it every worker it runs) is SIGKILLed at the start of ``step``:
    a node lost to power or network."""

    node: str
    step: int

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"node kill step must be at least 1, got {self.step}")


@dataclass(frozen=True)
class TrainOptions:
    """One ``hspmd train`` run. Steps are numbered from 1; a run loaded from a checkpoint of step k
    continues with step k + 1 (and its data)."""

    plan: Path
    strategy: str | None = None  # None: the plan's first strategy
    steps: int = 10
    trace_dir: Path | None = None
    data_file: Path | None = None
    save_dir: Path | None = None
    load_dir: Path | None = None
    timeout_s: float = 120.0  # every store operation, process group and collective
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 30.0  # a worker silent this long counts as hung
    faults: tuple[Fault, ...] = ()
    # Elastic: on a device's death or hang the survivors replan (the launcher's ``replan`` callback),
    # move the state from surviving replicas and redo the step (runtime/elastic/).
    elastic: bool = False
    switches: tuple[PlannedSwitch, ...] = ()  # planned in-memory switches, by step
    # Elastic: devices returning to the running job (a worker started for each at the start of its step;
    # the coordinator adopts it when the predicted gain beats the switch cost), and whole nodes lost.
    rejoins: tuple[Rejoin, ...] = ()
    node_kills: tuple[NodeKill, ...] = ()
    precision: Precision = "auto"  # autocast policy (runtime/precision.py)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must not be negative, got {self.steps}")
        if self.timeout_s <= 0 or self.heartbeat_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError("timeouts must be positive and heartbeat_timeout_s > heartbeat_s")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r} (have: {', '.join(PRECISIONS)})")
        steps = [s.step for s in self.switches]
        if steps != sorted(set(steps)):
            raise ValueError(f"switch steps must be distinct and increasing, got {steps}")
        if (self.rejoins or self.node_kills) and not self.elastic:
            raise ValueError("device rejoins and node kills need an elastic run")

    @property
    def coordinated(self) -> bool:
        """Runs whose steps the launcher coordinates (commit agreement, transitions)."""
        return self.elastic or bool(self.switches)


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs besides the store: its device, rank and world."""

    options: TrainOptions
    strategy: str
    device_id: int
    rank: int
    ranks: Mapping[int, int]  # device id -> rank
    backend: str  # "gloo" or "nccl"
    torch_device: str  # "cpu" or "cuda:N"
    num_threads: int | None = None  # intra-op threads (CPU); None leaves torch's default
    store_prefix: str = "hspmd/gen0/"  # a later generation (after a failure) gets a fresh prefix
    cpus: tuple[int, ...] | None = None  # emulated devices: the cores this worker is pinned to
    joining: bool = False  # joins a running job: no world, no state until the coordinator's transition


def rank_map(devices: tuple[int, ...] | list[int]) -> dict[int, int]:
    """Ranks follow device ids: the rank order of every device group is its device order."""
    return {d: r for r, d in enumerate(sorted(set(devices)))}


@dataclass(frozen=True)
class StepReport:
    """One step as one worker saw it."""

    step: int
    rank: int
    device: int
    loss: float
    grad_norm: float
    tokens: int
    wall_s: float  # train_step wall time on this worker
    compute_s: float
    comm_s: float
    emulation_s: float  # seconds slept to emulate a slower device
    emulation_overrun_s: float = 0.0  # sleep mode: seconds the blocks' real compute ran past their targets


@dataclass(frozen=True)
class StepRecord:
    """One step of the run (what the metrics file and the progress bar show)."""

    step: int
    loss: float
    step_time_s: float  # the slowest worker's train_step wall time
    tokens_per_s: float
    strategy: str
    grad_norm: float
    emulation_s: float  # most any worker slept to emulate slowness this step
    emulation_overrun_s: float = 0.0  # sleep mode: most any worker's blocks ran past their targets

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def combine(reports: list[StepReport], strategy: str) -> StepRecord:
        first = min(reports, key=lambda r: r.rank)
        step_time = max(r.wall_s for r in reports)
        return StepRecord(step=first.step, loss=first.loss, step_time_s=step_time,
                          tokens_per_s=first.tokens / step_time if step_time > 0 else 0.0,
                          strategy=strategy, grad_norm=first.grad_norm,
                          emulation_s=max(r.emulation_s for r in reports),
                          emulation_overrun_s=max(r.emulation_overrun_s for r in reports))
