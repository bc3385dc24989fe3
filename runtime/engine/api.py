"""The engine's contract with the launcher: what a worker hands the engine and what a step returns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch

from runtime.torchfree.precision import Precision
from runtime.torchfree.spec.handle import StrategyHandle

SpanKind = str  # "compute" | "comm"


@dataclass(frozen=True)
class WorkerContext:
    """Everything one worker process knows about its place in the run."""

    strategy: StrategyHandle  # the strategy to run, in its validated plan context
    device_id: int  # cluster device id of this worker
    ranks: Mapping[int, int]  # device id -> rank in the current torch.distributed world
    torch_device: torch.device  # cpu, or cuda:local_rank
    timeout: timedelta  # for every process group and collective
    precision: Precision = "auto"  # autocast policy (runtime/torchfree/precision.py)


class Hooks(Protocol):
    """Instrumentation points: the launcher implements tracing and the emulated slowdown with them.

    kinds: "compute" (each forward/backward block of a stage on a micro-batch, the optimizer step),
    "comm" (boundary send/recv, gradient sync, statistics). Idle time is what lies between them.
    """

    def span(self, kind: SpanKind, name: str, **args: object) -> contextlib.AbstractContextManager[None]: ...


class _NullHooks:
    @contextlib.contextmanager
    def span(self, kind: SpanKind, name: str, **args: object) -> Iterator[None]:
        yield


NULL_HOOKS: Hooks = _NullHooks()


@dataclass(frozen=True)
class StepStats:
    """One optimizer step as seen by one device; loss/grad_norm/tokens are the same on every rank."""

    loss: float  # sum of token losses / global token count
    grad_norm: float  # global gradient norm before clipping (equals the single-device norm)
    tokens: int  # tokens in the global batch
    compute_s: float  # this device's time in compute spans (best effort)
    comm_s: float  # this device's time in comm spans (best effort)
    lr: float = 0.0  # the learning rate of the step's update (OptimizerSettings.lr_at)
    # A MoE model's routers' loads over the step: per router (its bias buffer's name, ``params.router_bias_names``)
    # the tokens each expert was given, summed over every device that routed a share (the same on each holder);
    # only the routers this device holds.
    expert_loads: Mapping[str, tuple[float, ...]] | None = None
