"""AdamW on local shards and global-norm clipping.

AdamW is element-wise, so running it on each device's shard of a parameter gives exactly the slice of
the single-device update, provided the gradient is the full (synced, normalised) one and clipping uses
the global norm. The optimizer sees plain tensors that alias the local shards (DTensor's local tensor
or the plain parameter): the same code for TP 1 and TP > 1, and no DTensor dispatch in the update.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.optim.adamw import adamw

from runtime.comm.execute import all_gather_flat
from runtime.comm.groups import ProcessGroups
from runtime.torchfree.annotations.states import Region, relative, volume
from runtime.torchfree.engine.zero import ZeroBucket, ZeroSlice, moment_pieces
from runtime.torchfree.spec import OptimizerSettings

MOMENTS = ("exp_avg", "exp_avg_sq")
IN_FLIGHT = 2  # ZeRO-1 parameter all-gathers outstanding at once (each at most a gradient-sync bucket)


def build_adamw(params: Sequence[torch.Tensor], settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW (decoupled weight decay on every parameter) with the plan's settings."""
    return torch.optim.AdamW(list(params), lr=settings.lr, betas=(settings.beta1, settings.beta2),
                             eps=settings.eps, weight_decay=settings.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """What torch's LR schedulers do between steps: the rate is the param groups' ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by; None when clipping is off."""
    if max_norm <= 0:
        return None
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


class LocalAdamW:
    """AdamW over this device's shards.

    ``shards``: name -> the local tensor of each parameter (aliases the module's storage, so an update
    here is an update of the module). Gradients are handed in at ``step`` time as plain local tensors.
    """

    def __init__(self, shards: dict[str, torch.Tensor], settings: OptimizerSettings) -> None:
        self.names = list(shards)
        # nn.Parameter(t) shares t's storage: stepping these updates the model in place.
        self.params = [torch.nn.Parameter(shards[n].detach(), requires_grad=False) for n in self.names]
        self.settings = settings
        self.optimizer = build_adamw(self.params, settings)
        self._index = {n: i for i, n in enumerate(self.names)}
        # What each shard's storage holds when allocated (``release`` frees it, ``receive`` restores it).
        self._storage_bytes = [p.untyped_storage().nbytes() for p in self.params]

    def step(self, grads: dict[str, torch.Tensor], coef: torch.Tensor | None, lr: float | None = None) -> float:
        """One AdamW update at ``lr`` (None: the schedule's rate for this update); returns the rate used."""
        if lr is None:
            lr = self.settings.lr_at(self.step_count)
        set_lr(self.optimizer, lr)
        gs = [grads[n] for n in self.names]
        if coef is not None:
            torch._foreach_mul_(gs, coef.to(gs[0].device))
        for p, g in zip(self.params, gs):
            p.grad = g
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        return lr

    @property
    def step_count(self) -> int:
        for p in self.params:
            st = self.optimizer.state.get(p)
            if st and "step" in st:
                return int(st["step"])
        return 0

    def state(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """``NAME`` (the shard), ``NAME.exp_avg``, ``NAME.exp_avg_sq`` and ``step`` (a 0-d tensor), of every
        parameter or of ``names`` (views, not copies, except moments not created yet: zeros)."""
        out: dict[str, torch.Tensor] = {}
        for n in self.names if names is None else names:
            p = self.params[self._index[n]]
            out[n] = p.detach()
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}.{key}"] = st[key] if key in st else torch.zeros_like(p)
        out["step"] = torch.tensor(float(self.step_count))
        return out

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of ``state``: shards and moments copied in place; ``step`` restores bias correction."""
        missing = [k for n in self.names for k in (n, f"{n}.exp_avg", f"{n}.exp_avg_sq") if k not in state]
        if missing or "step" not in state:
            raise KeyError(f"local state lacks {(missing + ['step'] if 'step' not in state else missing)[:5]}")
        step = float(state["step"])
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            src = state[n]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{n}: shard shape {tuple(src.shape)} does not match {tuple(p.shape)}")
            self._allocate(i)
            p.copy_(src)
            if step > 0:
                self.optimizer.state[p] = {
                    "step": torch.tensor(step),
                    "exp_avg": state[f"{n}.exp_avg"].to(p.device, p.dtype).clone(),
                    "exp_avg_sq": state[f"{n}.exp_avg_sq"].to(p.device, p.dtype).clone(),
                }
            else:
                self.optimizer.state.pop(p, None)

    # -- holding no state while another strategy runs (a documents run: runtime/torchfree/elastic/staging.py) ----------

    def release(self, names: Sequence[str] | None = None) -> None:
        """Free the storage of these shards (all: None) and drop their moments. The tensors keep their shapes
        (the module's parameters alias the same storage: they are freed too); ``receive`` or ``load_state``
        allocates them again. Why storage and not the tensors: the programs' modules, DTensors and schedule
        stay built, so a strategy can be switched to without being specialized again."""
        for n in self.names if names is None else names:
            p = self.params[self._index[n]]
            p.untyped_storage().resize_(0)
            self.optimizer.state.pop(p, None)

    def receive(self, names: Sequence[str], step: int) -> dict[str, torch.Tensor]:
        """Allocate these shards again and their moments (``step`` > 0: kept; 0: a fresh AdamW keeps none, so
        the moments received are scratch) and return them by state name, for a switch to write into."""
        out: dict[str, torch.Tensor] = {}
        for n in names:
            i = self._index[n]
            p = self.params[i]
            self._allocate(i)
            moments = {key: torch.empty_like(p) for key in MOMENTS}
            if step > 0:
                self.optimizer.state[p] = {"step": torch.tensor(float(step)), **moments}
            out[n] = p.detach()
            out.update({f"{n}.{key}": m for key, m in moments.items()})
        return out

    def _allocate(self, i: int) -> None:
        st = self.params[i].untyped_storage()
        if st.nbytes() == 0 and self._storage_bytes[i]:
            st.resize_(self._storage_bytes[i])

# ---------------------------------------------------------------------------------------------------
# ZeRO-1 (runtime/torchfree/engine/zero.py lays the moments out)


def flat_range(view: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of ``view``'s row-major flattening, copying at most the rows they span
    (a slice of a column-split cell is not contiguous)."""
    if view.is_contiguous() or view.dim() <= 1:
        return view.reshape(-1)[start:stop]
    inner = view.numel() // view.shape[0]
    r0, r1 = start // inner, -(-stop // inner)
    return view[r0:r1].reshape(-1)[start - r0 * inner:stop - r0 * inner]


def write_flat_range(view: torch.Tensor, start: int, stop: int, values: torch.Tensor) -> None:
    """Set elements [start, stop) of ``view``'s row-major flattening to ``values`` (``flat_range`` may copy)."""
    if view.dim() <= 1:
        view[start:stop].copy_(values)
        return
    if view.is_contiguous():
        view.view(-1)[start:stop].copy_(values)
        return
    inner = view.numel() // view.shape[0]
    r0, r1 = start // inner, -(-stop // inner)
    rows = view[r0:r1].reshape(-1).clone()
    rows[start - r0 * inner:stop - r0 * inner] = values
    view[r0:r1].copy_(rows.view(view[r0:r1].shape))


class _Entry(NamedTuple):
    name: str
    region: Region  # the slice (global)
    index: tuple[slice, ...]  # the slice inside this device's local tensor
    shape: tuple[int, ...]
    start: int  # this device's chunk (kept and updated)
    stop: int
    send: tuple[int, int]  # the part of it this device sends, relative to ``start``
    parts: tuple[tuple[int, int], ...]  # (offset in the gathered buffer, length) of every part, in element order


class _Bucket:
    """One all-gather as this device runs it, with its flat moments (its chunks, bucket order)."""

    def __init__(self, zb: ZeroBucket, me: int, regions: Mapping[str, Region], groups: ProcessGroups,
                 device: torch.device) -> None:
        self.devices = zb.devices
        self.group = groups.get(zb.devices)
        slot = {d: q for q, d in enumerate(groups.order(self.group))}
        self.width = zb.width
        offsets = {d: slot[d] * self.width for d in zb.devices}
        entries = []
        for s in zb.slices:
            parts = []
            for d, (a, b) in s.senders():  # element order
                parts.append((offsets[d], b - a))
                offsets[d] += b - a
            (a, b), (x, y) = s.chunk(me), s.part(me)
            entries.append(_Entry(s.name, s.region, relative(s.region, regions[s.name]), s.shape, a, b,
                                  (x - a, y - a) if y > x else (0, 0), tuple(parts)))
        self.entries = tuple(entries)
        self.sends_all = all(e.send == (0, e.stop - e.start) for e in entries)  # r = 1: no copy to cut
        self.length = zb.length(me)
        self.exp_avg = torch.zeros(self.length, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.length, dtype=torch.float32, device=device)

    def chunks(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This device's chunks of ``tensors`` (local shards by name), packed (a new tensor)."""
        return torch.cat([flat_range(tensors[e.name][e.index], e.start, e.stop) for e in self.entries])

    def sends(self, packed: torch.Tensor) -> torch.Tensor:
        """What this device sends of its packed, updated chunks: every chunk's part (all of it when r = 1)."""
        if self.sends_all:
            return packed
        out, off = [], 0
        for e in self.entries:
            out.append(packed[off + e.send[0]:off + e.send[1]])
            off += e.stop - e.start
        return torch.cat(out) if out else packed[:0]

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
    def update(self, grads: Mapping[str, torch.Tensor], coef: torch.Tensor | None) -> float:
        """AdamW on this device's chunks (and its unsharded parameters) at the schedule's rate, which it
        returns; ``gather`` must follow."""
        lr = self.settings.lr_at(self.steps)
        if self.rest is not None:
            self.rest.step({n: grads[n] for n in self.rest.names}, coef, lr)
        params = [b.chunks(self.shards) for b in self.buckets]
        gs = [b.chunks(grads) for b in self.buckets]
        if coef is not None and gs:
            torch._foreach_mul_(gs, coef.to(gs[0].device))
        s = self.settings
        steps = [torch.tensor(float(self.steps)) for _ in self.buckets]
        if params:
            adamw(params, gs, [b.exp_avg for b in self.buckets], [b.exp_avg_sq for b in self.buckets], [], steps,
                  amsgrad=False, beta1=s.beta1, beta2=s.beta2, lr=lr, weight_decay=s.weight_decay, eps=s.eps,
                  maximize=False)
        self.steps += 1
        self._updated = params
        return lr

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the updated chunks in every bucket's group; every holder gets whole slices back.

        At most ``IN_FLIGHT`` buckets at a time, so the receive buffers stay a few buckets, not a copy
        of every local parameter. Buckets go in the one global order on every device, so waiting for
        the oldest never blocks a peer that waits for an earlier one. (On a GPU ``work.wait()`` only makes
        the stream wait and the host would post every bucket at once, each with its own buffer: the host
        waits for the stream to finish the oldest instead. The pipeline's receives are all waited for by
        now, so this sync waits for nothing a peer still needs from this device.)
        """
        pending: deque[tuple[Any, torch.Tensor, _Bucket]] = deque()
        # The updated chunks stay pending until every bucket is back: a failure in between leaves the slices
        # half-gathered, and ``state`` then writes them in (elastic recovery rebuilds the rest from them).
        updated = self._updated
        for b, packed in zip(self.buckets, updated):
            mine = b.sends(packed)
            if mine.numel() < b.width:
                mine = torch.cat([mine, mine.new_zeros(b.width - mine.numel())])
            out = mine.new_empty(b.width * len(b.devices))
            pending.append((all_gather_flat(out, mine, group=b.group, async_op=True), out, b))
            while len(pending) > IN_FLIGHT:
                self._finish(*pending.popleft())
                if out.is_cuda:
                    torch.cuda.current_stream(out.device).synchronize()
        while pending:
            self._finish(*pending.popleft())
        self._updated = []

    def _settle(self) -> None:
        """After an interrupted ``gather``: this device's updated chunks into its parameters. The other
        elements of a slice are then of either step (whatever buckets arrived); this device's chunks, like its
        moments, are the committed step's."""
        for b, packed in zip(self.buckets, self._updated):
            off = 0
            for e in b.entries:
                n = e.stop - e.start
                if n:
                    write_flat_range(self.shards[e.name][e.index], e.start, e.stop, packed[off:off + n])
                off += n
        self._updated = []

    def _finish(self, work: Any, gathered: torch.Tensor, bucket: _Bucket) -> None:
        work.wait()
        bucket.unpack(gathered, self.shards)

    def step(self, grads: Mapping[str, torch.Tensor], coef: torch.Tensor | None) -> float:
        lr = self.update(grads, coef)
        self.gather()
        return lr

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
        chunks of its slices, in ``self.pieces[name]`` order. After an interrupted ``gather`` a sharded
        parameter is final only on this device's chunks (``_settle``)."""
        if self._updated:
            self._settle()
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
