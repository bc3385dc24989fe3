"""ZeRO-1: AdamW moments sharded over the data-parallel replicas of every parameter slice.

With several pipelines every parameter is held by each of them. After the gradient sync
(data_parallel.py) each finest slice of a parameter -- one entry of the SplitAllReduce planned by
runtime/comm/gradsync.py -- is held, with the full summed gradient, by a fixed group of devices: its
replicas. ZeRO-1 gives each of them one contiguous chunk of the slice's elements (row-major, near-equal:
the j-th device of the sorted group takes ``[n*j//k, n*(j+1)//k)``); a device keeps AdamW moments only
for its chunks and updates only them, then the group all-gathers the updated chunks so that every
holder has the whole new slice again. The all-gathers use the gradient sync's groups and bucket packing
(one collective per group per bucket); each device's part is padded to the group's longest, since gloo
has no uneven all-gather. A plan with one pipeline has no replicas: nothing is sharded there.

Choices:

* Chunks are cut per slice, not per bucket, so the moment layout is a function of the plan alone (not
  of the bucket size): checkpoints (runtime/checkpoint.py) and ``hspmd show --device`` derive it
  without a running program (``zero_slices``).
* A member that duplicates a slice inside its TP group (a norm weight at TP 2) is *one* summand of the
  gradient sync but *each* of its devices is a holder of the synced gradient, so here each of them
  takes a chunk like any other holder: nothing is updated twice, no moment is kept twice, and the
  all-gather leaves both TP ranks with the same values.
* Exactness: AdamW is element-wise and runs through the same functional torch code as
  ``torch.optim.AdamW`` (``torch.optim.adamw.adamw``, default foreach/fused choice); clipping uses
  the global norm of the full synced gradients, computed before the update (program.py).
* Traffic: the gradient is still all-reduced, then the parameters are all-gathered (about 1.5x the
  all-reduce bytes of ``zero: false``); a reduce-scatter of the gradient would save a third, but gloo
  emulates reduce-scatter at twice its cost and the global norm would then need the chunks.
* The step is no longer all-or-nothing at the commit point (the all-gather follows the update), and
  no moment has a second copy: elastic recovery and planned switches refuse ``zero: true`` plans.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw

from runtime.annotations.from_plan import StrategyAnnotations
from runtime.annotations.states import Region, relative, volume
from runtime.comm.gradsync import plan_sync
from runtime.comm.groups import ProcessGroups
from runtime.comm.resolve import plan_reduce
from runtime.engine.optim import LocalAdamW
from runtime.spec import OptimizerSettings

MOMENTS = ("exp_avg", "exp_avg_sq")
IN_FLIGHT = 2  # parameter all-gathers outstanding at once (each at most a gradient-sync bucket)

# torch 2.13 renamed the flat-tensor collective; older torch (>= 2.4) has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ZeroSlice:
    """One finest slice of a parameter and the devices that hold it after the gradient sync."""

    name: str
    region: Region  # global (start, stop) per dim
    devices: tuple[int, ...]  # sorted device ids; the j-th updates chunk j

    @property
    def numel(self) -> int:
        return volume(self.region)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    def chunk(self, device: int) -> tuple[int, int]:
        """[start, stop) of the slice's row-major elements that ``device`` updates."""
        k, j, n = len(self.devices), self.devices.index(device), self.numel
        return n * j // k, n * (j + 1) // k


class MomentPiece(NamedTuple):
    """Elements [start, stop) of the row-major flattening of the slice ``region`` of a parameter."""

    region: Region
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def zero_slices(annotations: StrategyAnnotations) -> dict[str, tuple[ZeroSlice, ...]]:
    """Every parameter with data-parallel replicas -> its slices, in the gradient sync's order.

    Parameters absent from the result (one pipeline) keep their moments in the parameter's layout.
    """
    out: dict[str, tuple[ZeroSlice, ...]] = {}
    memo: dict[tuple[object, tuple[int, ...]], tuple[tuple[Region, tuple[int, ...]], ...]] = {}
    for p in annotations.params:
        key = (p.grad, p.shape)
        if key not in memo:
            lay = p.grad.layout(p.shape)
            memo[key] = tuple((r, b.devices) for b in plan_reduce(lay, None) if len(b.devices) > 1
                              for r in b.regions) if lay.is_partial else ()
        if memo[key]:
            out[p.name] = tuple(ZeroSlice(p.name, r, devs) for r, devs in memo[key])
    return out


def moment_pieces(slices: Mapping[str, Sequence[ZeroSlice]], device: int) -> dict[str, tuple[MomentPiece, ...]]:
    """What ``device`` keeps of each sharded parameter's moments, in the order of ``local_state()``."""
    out: dict[str, tuple[MomentPiece, ...]] = {}
    for name, sl in slices.items():
        mine = tuple(MomentPiece(s.region, *s.chunk(device)) for s in sl if device in s.devices)
        if mine:
            out[name] = mine
    return out


@dataclass(frozen=True)
class ZeroBucket:
    """The slices one all-gather carries: the gradient sync's bucket of the same group."""

    devices: tuple[int, ...]
    slices: tuple[ZeroSlice, ...]

    def length(self, device: int) -> int:
        """Elements ``device`` updates (and sends) in this bucket."""
        return sum(b - a for a, b in (s.chunk(device) for s in self.slices))

    @property
    def width(self) -> int:
        """Each device's part of the all-gather, padded to the longest."""
        return max(self.length(d) for d in self.devices)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slices)


def zero_buckets(annotations: StrategyAnnotations, slices: Mapping[str, Sequence[ZeroSlice]], *,
                 bucket_bytes: int, itemsize: int = 4) -> list[ZeroBucket]:
    """Every all-gather of the strategy in one global order: the gradient sync's buckets, reused."""
    names = [p.name for p in annotations.params]
    by_key = {(s.name, s.region): s for sl in slices.values() for s in sl}
    layouts = [p.grad.layout(p.shape) for p in annotations.params]
    return [ZeroBucket(b.devices, tuple(by_key[(names[i], r)] for i, r in b.entries))
            for b in plan_sync(layouts, bucket_numel=max(1, bucket_bytes // itemsize))]


def flat_range(view: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of ``view``'s row-major flattening, copying at most the rows they span
    (a slice of a column-split cell is not contiguous)."""
    if view.is_contiguous() or view.dim() <= 1:
        return view.reshape(-1)[start:stop]
    inner = view.numel() // view.shape[0]
    r0, r1 = start // inner, -(-stop // inner)
    return view[r0:r1].reshape(-1)[start - r0 * inner:stop - r0 * inner]


class _Entry(NamedTuple):
    name: str
    region: Region  # the slice (global)
    index: tuple[slice, ...]  # the slice inside this device's local tensor
    shape: tuple[int, ...]
    start: int  # this device's chunk
    stop: int
    parts: tuple[tuple[int, int], ...]  # (offset in the gathered buffer, length) of every chunk, in order


class _Bucket:
    """One all-gather as this device runs it, with its flat moments (its chunks, bucket order)."""

    def __init__(self, zb: ZeroBucket, me: int, regions: Mapping[str, Region], groups: ProcessGroups,
                 device: torch.device) -> None:
        self.devices = zb.devices
        self.group = groups.get(zb.devices)
        by_rank = {r: d for d, r in groups.ranks.items()}
        slot = {by_rank[r]: q for q, r in enumerate(dist.get_process_group_ranks(self.group))}
        self.width = zb.width
        offsets = {d: slot[d] * self.width for d in zb.devices}
        entries = []
        for s in zb.slices:
            parts = []
            for d in s.devices:  # chunk order
                a, b = s.chunk(d)
                parts.append((offsets[d], b - a))
                offsets[d] += b - a
            entries.append(_Entry(s.name, s.region, relative(s.region, regions[s.name]), s.shape, *s.chunk(me),
                                  tuple(parts)))
        self.entries = tuple(entries)
        self.length = zb.length(me)
        self.exp_avg = torch.zeros(self.length, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.length, dtype=torch.float32, device=device)

    def chunks(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This device's chunks of ``tensors`` (local shards by name), packed (a new tensor)."""
        return torch.cat([flat_range(tensors[e.name][e.index], e.start, e.stop) for e in self.entries])

    def unpack(self, gathered: torch.Tensor, shards: Mapping[str, torch.Tensor]) -> None:
        for e in self.entries:
            cell = torch.cat([gathered[off:off + n] for off, n in e.parts])
            shards[e.name][e.index].copy_(cell.view(e.shape))


class ShardedAdamW:
    """AdamW with ZeRO-1: ``update`` changes this device's chunks, ``gather`` all-gathers them.

    ``shards``: name -> local tensor of each parameter (aliases the module's storage, like LocalAdamW);
    ``regions``: name -> the global region each holds; ``buckets``: every bucket of the strategy
    (``zero_buckets``). Parameters in no bucket of this device run a plain ``LocalAdamW``.
    """

    def __init__(self, shards: Mapping[str, torch.Tensor], regions: Mapping[str, Region],
                 slices: Mapping[str, Sequence[ZeroSlice]], buckets: Sequence[ZeroBucket],
                 settings: OptimizerSettings, groups: ProcessGroups) -> None:
        me = groups.my_device
        assert me is not None
        self.settings = settings
        self.shards = {n: t.detach() for n, t in shards.items()}
        self.pieces = moment_pieces({n: s for n, s in slices.items() if n in shards}, me)
        device = next(iter(self.shards.values())).device
        self.buckets = [_Bucket(b, me, regions, groups, device) for b in buckets if me in b.devices]
        where: dict[tuple[str, Region], tuple[int, int]] = {}  # (name, slice) -> (bucket, offset in its moments)
        for bi, b in enumerate(self.buckets):
            off = 0
            for e in b.entries:
                where[(e.name, e.region)] = (bi, off)
                off += e.stop - e.start
        self._where = where
        for name, pieces in self.pieces.items():
            if sum(volume(p.region) for p in pieces) != self.shards[name].numel():
                raise AssertionError(f"{name}: ZeRO slices do not cover device {me}'s shard")
        rest = {n: t for n, t in shards.items() if n not in self.pieces}
        self.rest = LocalAdamW(rest, settings) if rest else None
        self.steps = 0
        self._updated: list[torch.Tensor] = []

    # -- one step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, grads: Mapping[str, torch.Tensor], coef: torch.Tensor | None) -> None:
        """AdamW on this device's chunks (and its unsharded parameters); ``gather`` must follow."""
        if self.rest is not None:
            self.rest.step({n: grads[n] for n in self.rest.names}, coef)
        params = [b.chunks(self.shards) for b in self.buckets]
        gs = [b.chunks(grads) for b in self.buckets]
        if coef is not None and gs:
            torch._foreach_mul_(gs, coef.to(gs[0].device))
        s = self.settings
        steps = [torch.tensor(float(self.steps)) for _ in self.buckets]
        if params:
            adamw(params, gs, [b.exp_avg for b in self.buckets], [b.exp_avg_sq for b in self.buckets], [], steps,
                  amsgrad=False, beta1=s.beta1, beta2=s.beta2, lr=s.lr, weight_decay=s.weight_decay, eps=s.eps,
                  maximize=False)
        self.steps += 1
        self._updated = params

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the updated chunks in every bucket's group; every holder gets whole slices back.

        At most ``IN_FLIGHT`` buckets at a time, so the receive buffers stay a few buckets, not a copy
        of every local parameter. Buckets go in the one global order on every device, so waiting for
        the oldest never blocks a peer that waits for an earlier one.
        """
        pending: deque[tuple[Any, torch.Tensor, _Bucket]] = deque()
        updated, self._updated = self._updated, []
        for b, mine in zip(self.buckets, updated):
            if mine.numel() < b.width:
                mine = torch.cat([mine, mine.new_zeros(b.width - mine.numel())])
            out = mine.new_empty(b.width * len(b.devices))
            pending.append((_all_gather_flat(out, mine, group=b.group, async_op=True), out, b))
            while len(pending) > IN_FLIGHT:
                self._finish(*pending.popleft())
        while pending:
            self._finish(*pending.popleft())

    def _finish(self, work: Any, gathered: torch.Tensor, bucket: _Bucket) -> None:
        work.wait()
        bucket.unpack(gathered, self.shards)

    def step(self, grads: Mapping[str, torch.Tensor], coef: torch.Tensor | None) -> None:
        self.update(grads, coef)
        self.gather()

    # -- state ---------------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.steps

    def moment_numel(self) -> int:
        """AdamW moment elements this device keeps (each of the two moments)."""
        rest = sum(t.numel() for n, t in self.shards.items() if n not in self.pieces)
        return rest + sum(b.length for b in self.buckets)

    def _views(self, name: str, key: str) -> list[torch.Tensor]:
        out = []
        for p in self.pieces[name]:
            bi, off = self._where[(name, p.region)]
            out.append(getattr(self.buckets[bi], key)[off:off + p.numel])
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """Like ``LocalAdamW.state``, except that a sharded parameter's moments are 1-D: this device's
        chunks of its slices, in ``self.pieces[name]`` order."""
        out = self.rest.state() if self.rest is not None else {}
        for name in self.pieces:
            out[name] = self.shards[name]
            for key in MOMENTS:
                out[f"{name}.{key}"] = torch.cat(self._views(name, key))
        out["step"] = torch.tensor(float(self.steps))
        return out

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Inverse of ``state`` (the same layouts)."""
        if "step" not in state:
            raise KeyError("local state lacks 'step'")
        if self.rest is not None:
            self.rest.load_state({k: state[k] for n in self.rest.names for k in (n, f"{n}.exp_avg", f"{n}.exp_avg_sq")
                                  if k in state} | {"step": state["step"]})
        for name, pieces in self.pieces.items():
            src = state[name]
            if tuple(src.shape) != tuple(self.shards[name].shape):
                raise ValueError(f"{name}: shard shape {tuple(src.shape)} does not match "
                                 f"{tuple(self.shards[name].shape)}")
            self.shards[name].copy_(src)
            n = sum(p.numel for p in pieces)
            for key in MOMENTS:
                flat = state[f"{name}.{key}"]
                if tuple(flat.shape) != (n,):
                    raise ValueError(f"{name}.{key}: ZeRO-1 moments are this device's {n} elements, got shape "
                                     f"{tuple(flat.shape)}")
                off = 0
                for v in self._views(name, key):
                    v.copy_(flat[off:off + v.numel()])
                    off += v.numel()
        self.steps = int(float(state["step"]))


def describe_zero(annotations: StrategyAnnotations, device: int, *, bucket_bytes: int) -> list[tuple[str, str]]:
    """(name, detail) of each parameter all-gather this device joins after the optimizer, in order."""
    slices = zero_slices(annotations)
    out = []
    for b in zero_buckets(annotations, slices, bucket_bytes=bucket_bytes):
        if device not in b.devices:
            continue
        names = sorted({s.name for s in b.slices})
        out.append((f"param all-gather [{','.join(map(str, b.devices))}]",
                    f"ZeRO-1 bucket: {b.numel} elements in {len(b.slices)} slices of {len(names)} parameters; "
                    f"this device updated {b.length(device)}, parts padded to {b.width}"))
    return out


__all__ = ["MOMENTS", "MomentPiece", "ShardedAdamW", "ZeroBucket", "ZeroSlice", "describe_zero", "flat_range",
           "moment_pieces", "zero_buckets", "zero_slices"]
