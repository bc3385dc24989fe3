"""The top tier: cross-pipeline gradient sync.

Every pipeline holds every parameter, each at its own TP degree: after the backward pass a parameter's
gradient is partial across pipelines (HDim -2, one summand per pipeline) and must become the full
gradient on every holder (HDim -1). Pipelines at different TP degrees make this a SplitAllReduce, which
the communication layer lays out from the annotations (runtime/torchfree/comm/gradsync.py) and which runs here
fused into its buckets (one all-reduce per device group per bucket). A single pipeline has nothing to
sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from runtime.comm.groups import ProcessGroups
from runtime.torchfree.annotations.states import Annotation, relative, volume
from runtime.torchfree.comm.gradsync import SyncBucket


class GradientSync:
    """SplitAllReduce of many gradients at once; build once per strategy, call ``sync`` every step.

    ``entries``: ``(name, global shape, grad annotation)``; ``buckets``: their ``gradsync.plan_sync``
    (those of other devices are skipped). The result on every holder is the sum over the annotation's
    summands (HDim -2 members, bottom-tier partials), in place.
    """

    def __init__(self, entries: Sequence[tuple[str, Sequence[int], Annotation]], buckets: Sequence[SyncBucket],
                 groups: ProcessGroups) -> None:
        self.names = [n for n, _, _ in entries]
        self.layouts = [a.layout(tuple(s)) for _, s, a in entries]
        self.groups = groups
        me = groups.my_device
        self.mine = [i for i, lay in enumerate(self.layouts) if me in lay]
        self.buckets = [b for b in buckets if me in b.devices]

    def sync(self, grads: Mapping[str, torch.Tensor], *, scale: float | None = None) -> None:
        """All-reduce this device's local gradients (by name) in place; then multiply by ``scale``."""
        me = self.groups.my_device
        holding = {i: self.layouts[i].by_device[me] for i in self.mine}
        for i in self.mine:
            g = grads[self.names[i]]
            if tuple(g.shape) != holding[i].shape:
                raise ValueError(f"gradient {self.names[i]!r}: local shape {list(g.shape)}, layout says "
                                 f"{list(holding[i].shape)}")
        pending = []
        for b in self.buckets:
            parts = []
            for i, region in b.entries:
                h = holding[i]
                g = grads[self.names[i]]
                if h.replica == 0:
                    parts.append(g[relative(region, h.region)].reshape(-1))
                else:
                    parts.append(g.new_zeros(volume(region)))
            flat = torch.cat(parts)
            work = dist.all_reduce(flat, group=self.groups.get(b.devices), async_op=True)
            pending.append((work, flat, b))
        for work, flat, b in pending:
            work.wait()
            off = 0
            for i, region in b.entries:
                h = holding[i]
                n = volume(region)
                grads[self.names[i]][relative(region, h.region)] = flat[off:off + n].view(
                    tuple(e - s for s, e in region))
                off += n
        if scale is not None:
            for i in self.mine:
                grads[self.names[i]].mul_(scale)
