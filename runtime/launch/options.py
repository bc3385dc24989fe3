"""What a training run is asked to do, and what each worker process is told (all picklable)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from runtime.launch.placement import CudaGpus, GpuProbe
from runtime.profiling.host import WorkerCpus
from runtime.torchfree.dispatch import StrategyCost
from runtime.torchfree.precision import PRECISIONS, Precision

if TYPE_CHECKING:
    from runtime.torchfree.spec import PlanContext

FaultKind = Literal["error", "user-error", "exit", "kill", "hang"]
FaultPoint = Literal["start", "after-commit"]


@dataclass(frozen=True)
class Fault:
    """An injected failure (tests, demos): at ``point`` of ``step`` the worker of ``device`` ...

    error: raises RuntimeError (a bug); user-error: raises HspmdError; exit: exits with status 3
    without a word; kill: SIGKILLs itself; hang: SIGSTOPs itself (only the heartbeat can tell).

    point: "start" (of the step), or "after-commit" (elastic runs: as the committed step's optimizer update
    and ZeRO-1 parameter all-gather begin, so that its peers are left inside that all-gather).
    """

    device: int
    step: int
    kind: FaultKind
    point: FaultPoint = "start"

    def __post_init__(self) -> None:
        if self.kind not in get_args(FaultKind):
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.point not in get_args(FaultPoint):
            raise ValueError(f"unknown fault point {self.point!r}")
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


DEFAULT_HEARTBEAT_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
# hspmd train --elastic's defaults: a failure should cost seconds, and gloo cannot abort an op in flight, so
# only the worst case waits for the op timeout (runtime/elastic/).
ELASTIC_TIMEOUT_S = 30.0
ELASTIC_HEARTBEAT_TIMEOUT_S = 5.0


def agent_timeout_s(heartbeat_timeout_s: float) -> float:
    """How long a node agent may be silent before its node counts as lost: below a worker's hang timeout, so
    that the node's loss (not its workers' silence) is the cause reported."""
    return heartbeat_timeout_s / 2


def node_loss_detect_s(heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                       heartbeat_timeout_s: float = ELASTIC_HEARTBEAT_TIMEOUT_S) -> float:
    """The longest a lost node goes unnoticed: the agent timeout plus one heartbeat (the coordinator's
    check runs once per heartbeat); the model of a failure trace prices a node's loss with it."""
    return agent_timeout_s(heartbeat_timeout_s) + heartbeat_s


class BlockTargets(Protocol):
    """Minimum durations of a device's compute blocks: for ``device`` in ``strategy`` of ``ctx``, a function of
    a compute span's name and args giving the seconds the block lasts at least (None: as long as it takes),
    or None where the device's blocks have no minimum. The worker's ``EmulatedTarget`` hook (runtime/trace.py)
    waits each block out to it. Asked again for each strategy a worker builds, so an elastic run's new
    strategies are covered; the object is pickled to the workers."""

    def for_device(self, ctx: PlanContext, strategy: str,
                   device: int) -> Callable[[str, Mapping[str, Any]], float | None] | None: ...


@dataclass(frozen=True)
class TrainOptions:
    """One ``hspmd train`` run. Steps are numbered from 1; a run loaded from a checkpoint of step k
    continues with step k + 1 (and its data)."""

    plan: Path
    strategy: str | None = None  # None: the plan's first strategy
    # The cluster and model to run the plan on instead of the ones it names (``--cluster``, ``--model``).
    cluster: str | None = None
    model: str | None = None
    steps: int = 10
    trace_dir: Path | None = None
    data_file: Path | None = None
    save_dir: Path | None = None  # the run's step checkpoints (runtime/checkpoint_series.py)
    save_every: int = 0  # also save every N steps (0: only at the end)
    keep: int | None = None  # keep the newest K step checkpoints (None: all)
    # Periodic saves written by a background thread from a host copy of the whole state on the writer
    # (training pauses only for the gather); False: written before training goes on, one BSR round at a
    # time (host memory for one round, for states larger than the writer's memory).
    save_in_background: bool = True
    load_dir: Path | None = None
    timeout_s: float = 120.0  # every store operation, process group and collective
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S  # a worker silent this long counts as hung
    faults: tuple[Fault, ...] = ()
    # Elastic: on a device's death or hang the survivors replan (the launcher's ``replan`` callback),
    # move the state from surviving replicas and redo the step (runtime/elastic/).
    elastic: bool = False
    switches: tuple[PlannedSwitch, ...] = ()  # planned in-memory switches, by step
    # Gloo only: a worker leaving a failed step shuts its connections down, so that peers blocked on it fail
    # at once, before the launcher's abort reaches them (runtime/comm/abort.py). False leaves their release
    # to that abort alone, the only way NCCL has (a test runs recovery so, to prove the abort path).
    gloo_shut_on_leave: bool = True
    # Elastic: devices returning to the running job (a worker started for each at the start of its step;
    # the coordinator adopts it when the predicted gain beats the switch cost), and whole nodes lost.
    rejoins: tuple[Rejoin, ...] = ()
    node_kills: tuple[NodeKill, ...] = ()
    precision: Precision = "auto"  # autocast policy (runtime/torchfree/precision.py)
    # Documents (docs/lengths.md): synthetic lengths (a distribution name or histogram file), a local
    # tokenizer.json for --data, and what happens to documents longer than training.seq_len.
    lengths: str | None = None
    tokenizer: Path | None = None
    long_documents: str = "split"
    # Documents runs: the cost models dispatch weighs, one per run strategy in plan order (None: priced from the
    # plan alone, runtime/torchfree/dispatch.py ``plan_strategy_cost``); e.g. the planner's, from measured profiles.
    dispatch_costs: tuple[StrategyCost, ...] | None = None
    # This machine's node in the cluster file (None: its host name), and how its GPUs are read (tests
    # describe a machine instead): the placement check every worker makes (runtime/launch/placement.py).
    node: str | None = None
    gpus: GpuProbe = CudaGpus()
    # Minimum durations of compute blocks, per strategy and device (None: every block takes what it takes).
    block_targets: BlockTargets | None = None
    # The workers' CPU share (threads, pinned cores); None: as the OS and torch set them.
    worker_cpus: WorkerCpus | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must not be negative, got {self.steps}")
        if self.save_every < 0 or (self.keep is not None and self.keep < 1):
            raise ValueError(f"save_every must be >= 0 and keep >= 1, got {self.save_every}, {self.keep}")
        if self.save_every and self.save_dir is None:
            raise ValueError("save_every needs a save_dir")
        if self.timeout_s <= 0 or self.heartbeat_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError("timeouts must be positive and heartbeat_timeout_s > heartbeat_s")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r} (have: {', '.join(PRECISIONS)})")
        if self.long_documents not in ("split", "truncate", "error"):
            raise ValueError(f"unknown long-document policy {self.long_documents!r}")
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
    node: str | None = None  # the node this worker's machine is (a node agent's); None: ``options.node``


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
    lr: float = 0.0  # the learning rate of the step's update
    lengths: LengthsStep | None = None  # documents runs: the step's dispatch (the same on every device)
    idle: bool = False  # documents runs: the step's strategy leaves this device idle (no loss, no time)
    peak_memory_bytes: int = 0  # the device's peak so far: CUDA's allocator peak, or the process' peak RSS on CPU
    # MoE: the step's expert loads of the routers this device holds (``StepStats.expert_loads``)
    expert_loads: Mapping[str, tuple[float, ...]] | None = None


@dataclass(frozen=True)
class LengthsStep:
    """A documents step as dispatch decided it (computed identically on every device)."""

    strategy: str
    documents: int
    padding_fraction: float  # padded slots / all token slots of the step's micro-batches
    imbalance: float  # slowest / mean predicted pipeline time
    predicted_s: float  # the chosen strategy's modelled step time
    method: str  # "ilp" or "greedy" (runtime/torchfree/dispatch.py)
    dispatch_s: float = 0.0  # this device's wall time computing the dispatch (and packing the step)
    switched_from: str | None = None  # the previous step's strategy, when this step switched
    switch_s: float = 0.0  # this device's wall time of the in-memory switch (fused BSR)
    switch_bytes: int = 0  # bytes this device sent in it
    switch_modelled_s: float = 0.0  # the switch cost dispatch weighed
    switch_gain_s: float = 0.0  # the modelled gain that paid for it (0 when forced: the old one could not serve)


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
    lr: float | None = None  # the learning rate of the step's update (the plan's schedule)
    # Peak memory of each device so far (device id -> bytes: the CUDA allocator's peak, or on CPU the worker
    # process' peak resident set), and the model FLOPs utilization (hetu_cli fills it: docs/training.md).
    peak_memory_bytes: dict[str, int] | None = None
    mfu: float | None = None
    # A MoE model's routing over the step: the tokens each expert was given, summed over the MoE layers
    # (``expert_load``: what `hspmd plan --expert-load` reads), and the most loaded expert of any layer
    # against its layer's mean (1: every layer even).
    expert_load: list[float] | None = None
    expert_load_max_over_mean: float | None = None
    # Documents runs (omitted from the JSON otherwise): the step's documents and tokens, its padding, the
    # dispatch imbalance, and the switch (wall time: the slowest device's; bytes: all devices') when the
    # strategy changed.
    documents: int | None = None
    tokens: int | None = None
    padding_fraction: float | None = None
    imbalance: float | None = None
    predicted_s: float | None = None
    dispatch_method: str | None = None
    dispatch_s: float | None = None
    switched_from: str | None = None
    switch_s: float | None = None
    switch_bytes: int | None = None
    switch_modelled_s: float | None = None
    switch_gain_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @staticmethod
    def combine(reports: list[StepReport], strategy: str) -> StepRecord:
        active = [r for r in reports if not r.idle] or reports
        first = min(active, key=lambda r: r.rank)
        # a documents step lasts from its dispatch to its optimizer update: dispatch and switch included
        step_time = max(r.wall_s + (r.lengths.dispatch_s + r.lengths.switch_s if r.lengths else 0.0) for r in reports)
        d = first.lengths
        extra: dict[str, Any] = {}
        if d is not None:
            strategy = d.strategy
            extra.update(documents=d.documents, tokens=first.tokens, padding_fraction=d.padding_fraction,
                         imbalance=d.imbalance, predicted_s=d.predicted_s, dispatch_method=d.method,
                         dispatch_s=max(r.lengths.dispatch_s for r in reports if r.lengths is not None))
            if d.switched_from is not None:
                extra.update(switched_from=d.switched_from,
                             switch_s=max(r.lengths.switch_s for r in reports if r.lengths is not None),
                             switch_bytes=sum(r.lengths.switch_bytes for r in reports if r.lengths is not None),
                             switch_modelled_s=d.switch_modelled_s, switch_gain_s=d.switch_gain_s)
        return StepRecord(step=first.step, loss=first.loss, step_time_s=step_time,
                          tokens_per_s=first.tokens / step_time if step_time > 0 else 0.0,
                          strategy=strategy, grad_norm=first.grad_norm, lr=first.lr,
                          peak_memory_bytes={str(r.device): r.peak_memory_bytes for r in reports
                                             if r.peak_memory_bytes} or None,
                          emulation_s=max(r.emulation_s for r in reports),
                          emulation_overrun_s=max(r.emulation_overrun_s for r in reports),
                          **expert_load_fields(reports), **extra)


def expert_load_fields(reports: Sequence[StepReport]) -> dict[str, Any]:
    """A step's ``expert_load`` and ``expert_load_max_over_mean`` from its workers' routers (each router's
    loads are the same on all its holders: taken once), or nothing for a dense model."""
    routers: dict[str, tuple[float, ...]] = {}
    for r in reports:
        routers.update(r.expert_loads or {})
    if not routers:
        return {}
    total = [sum(col) for col in zip(*routers.values())]
    worst = max((max(v) / (sum(v) / len(v)) for v in routers.values() if sum(v) > 0), default=1.0)
    return {"expert_load": total, "expert_load_max_over_mean": worst}
