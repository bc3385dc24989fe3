"""The top tier: cross-pipeline gradient sync.

Every pipeline holds every parameter, each at its own TP degree: after the backward pass a parameter's
gradient is partial across pipelines (HDim -2, one summand per pipeline) and must become the full
gradient on every holder (HDim -1). Pipelines at different TP degrees make this a SplitAllReduce, which
the communication layer plans from the annotations and runs fused into buckets (one all-reduce per
device group per bucket). A single pipeline has nothing to sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from runtime.annotations.from_plan import StrategyAnnotations
from runtime.comm.gradsync import GradientSync, SyncBucket, plan_sync
from runtime.comm.groups import ProcessGroups

BUCKET_BYTES = 32 << 20


class GradSync:
    """In-place sum of this device's local gradients with the other pipelines' summands."""

    def __init__(self, annotations: StrategyAnnotations, groups: ProcessGroups, *,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        entries = [(p.name, p.shape, p.grad) for p in annotations.params]
        self.sync_op = GradientSync(entries, groups, bucket_bytes=bucket_bytes)

    @property
    def buckets(self) -> list[SyncBucket]:
        return self.sync_op.buckets

    def sync(self, grads: Mapping[str, torch.Tensor]) -> None:
        self.sync_op.sync(grads)


def describe_grad_sync(annotations: StrategyAnnotations, device: int, *,
                       bucket_bytes: int = BUCKET_BYTES) -> list[tuple[str, str]]:
    """(name, detail) of each gradient all-reduce this device joins, in execution order."""
    layouts = [p.grad.layout(p.shape) for p in annotations.params]
    names = [p.name for p in annotations.params]
    out = []
    for b in plan_sync(layouts, bucket_numel=bucket_bytes // 4):
        if device not in b.devices:
            continue
        tensors = sorted({names[i] for i, _ in b.entries})
        out.append((f"grad all-reduce [{','.join(map(str, b.devices))}]",
                    f"SplitAllReduce bucket: {b.numel} elements, {len(b.entries)} slices of {len(tensors)} "
                    f"gradients ({_short(tensors)})"))
    return out


def _short(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... (+{len(names) - n})" if len(names) > n else "")
