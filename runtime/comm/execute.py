"""Running resolved ops and BSR plans on torch.distributed, with autograd.

Every function here is called by every device that takes part, with its own local tensors; all
collectives are issued in one global order (the plan's), so ranks never wait on each other in a
cycle. Buffers are allocated on the input's device (or ``ProcessGroups.device`` on devices that only
receive), so the same code runs on gloo/CPU and NCCL/CUDA. Point-to-point messages go through one
``batch_isend_irecv`` round on the world group with everything for one peer packed in one buffer.
Gloo has no uneven all-gather: gathers pad every part to the largest.

NCCL notes: set the CUDA device before the first call and run one collective on the world group
(e.g. ``dist.barrier()``) before the first ``batch_isend_irecv``: NCCL requires every rank of a group to
take part in the group's first call. Several messages to one peer in one batch are matched in posting
order, so post them in the same order on both sides (the plans here send one message per peer).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from runtime.comm.groups import ProcessGroups
from runtime.torchfree.annotations.states import Region, relative, volume
from runtime.torchfree.comm.bsr import BsrPlan, DType, Message
from runtime.torchfree.comm.resolve import CommOp


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a plan's element type (plans made without torch name it: ``bsr.ElementType``)."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype.name)  # type: ignore[attr-defined]


# torch 2.13 renamed the flat-tensor collectives; older torch (>= 2.4) has only the old names. Everyone
# (the optimizer, the link profiler) calls them through these two names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ---------------------------------------------------------------------------------------------------
# Point-to-point round


def run_p2p(plan: BsrPlan, me: int, sources: Mapping[int, torch.Tensor], outputs: Mapping[int, torch.Tensor],
            mid_regions: Mapping[int, Region], ranks: Mapping[int, int], *, as_bytes: bool) -> None:
    """Local copies, then one batched P2P round; writes into ``outputs`` (tensor index -> local dst)."""
    for c in plan.local_copies(me):
        out = outputs[c.tensor]
        dst_region = plan.tensors[c.tensor].dst.by_device[me].region
        out[relative(c.region, dst_region)] = sources[c.tensor][relative(c.region, mid_regions[c.tensor])]
    sends, recvs = plan.sends(me), plan.recvs(me)
    if not sends and not recvs:
        return
    ops = [dist.P2POp(dist.isend, _pack(m, sources, mid_regions, as_bytes), ranks[m.peer]) for m in sends]
    bufs = []
    for m in recvs:
        some = outputs[m.pieces[0].tensor]
        bufs.append(torch.empty(m.nbytes if as_bytes else sum(volume(p.region) for p in m.pieces),
                                dtype=torch.uint8 if as_bytes else some.dtype, device=some.device))
        ops.append(dist.P2POp(dist.irecv, bufs[-1], ranks[m.peer]))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for m, buf in zip(recvs, bufs):
        off = 0
        for piece in m.pieces:
            out = outputs[piece.tensor]
            n = volume(piece.region)
            nb = n * out.element_size() if as_bytes else n
            flat = buf[off:off + nb]
            if as_bytes:  # pieces of mixed dtypes share the buffer: realign before viewing
                flat = (flat if off % out.element_size() == 0 else flat.clone()).view(out.dtype)
            off += nb
            dst_region = plan.tensors[piece.tensor].dst.by_device[me].region
            out[relative(piece.region, dst_region)] = flat.view(tuple(b - a for a, b in piece.region))


def _pack(m: Message, sources: Mapping[int, torch.Tensor], regions: Mapping[int, Region],
          as_bytes: bool) -> torch.Tensor:
    blocks = [sources[p.tensor][relative(p.region, regions[p.tensor])].reshape(-1) for p in m.pieces]
    parts = [b.contiguous().view(torch.uint8) for b in blocks] if as_bytes else blocks
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous().clone()


# ---------------------------------------------------------------------------------------------------
# Resolved ops without autograd


def run(op: CommOp, x: torch.Tensor | None, groups: ProcessGroups, *, dtype: torch.dtype | None = None,
        device: torch.device | None = None) -> torch.Tensor | None:
    """Execute ``op`` on this device: ``x`` is its local source tensor (None when it holds none).

    Returns the local destination tensor, or None when this device holds no destination.
    """
    me = groups.my_device
    if me is None:
        raise RuntimeError("this rank has no device id in ProcessGroups.ranks")
    in_src, in_dst = me in op.src, me in op.dst
    if in_src:
        if x is None:
            raise ValueError(f"device {me} holds the source of this op: pass its local tensor")
        expect = op.src.local_shape(me)
        if tuple(x.shape) != expect:
            raise ValueError(f"device {me}: local source has shape {list(x.shape)}, the layout says {list(expect)}")
    if not in_src and not in_dst:
        return None
    dtype = x.dtype if x is not None else dtype
    device = x.device if x is not None else (device or groups.device)
    if dtype is None:
        raise ValueError(f"device {me} only receives: pass dtype=")
    mid = _reduce_phase(op, x, me, groups) if (in_src and op.reduce) else x
    out = torch.empty(op.dst.local_shape(me), dtype=dtype, device=device) if in_dst else None
    _gathers(op, mid, out, me, groups)
    run_p2p(op.p2p, me, {0: mid} if mid is not None else {}, {0: out} if out is not None else {},
            {0: op.src.by_device[me].region} if in_src else {}, groups.ranks, as_bytes=False)
    return out


def _reduce_phase(op: CommOp, x: torch.Tensor, me: int, groups: ProcessGroups) -> torch.Tensor:
    h = op.src.by_device[me]
    mid = x.detach().clone()
    contribute = h.replica == 0
    pending = []
    for b in op.reduce:
        if me not in b.devices or len(b.devices) == 1:
            continue
        pg = groups.get(b.devices)
        blocks = [x[relative(r, h.region)].reshape(-1) for r in b.regions]
        flat = torch.cat(blocks) if contribute else torch.zeros(b.numel, dtype=x.dtype, device=x.device)
        if b.needers is None:
            work = dist.all_reduce(flat, group=pg, async_op=True)
            pending.append((work, flat, list(b.regions)))
            continue
        order = groups.order(pg)
        sizes = dict.fromkeys(order, 0)
        chunks: dict[int, list[torch.Tensor]] = {d: [] for d in order}
        mine: list[Region] = []
        off = 0
        for r, needer in zip(b.regions, b.needers):
            n = volume(r)
            chunks[needer].append(flat[off:off + n])
            sizes[needer] += n
            off += n
            if needer == me:
                mine.append(r)
        width = max(sizes.values())
        padded = []
        for d in order:
            pad = width - sizes[d]
            padded.extend(chunks[d])
            if pad:
                padded.append(torch.zeros(pad, dtype=x.dtype, device=x.device))
        inp = torch.cat(padded)
        out = torch.empty(width, dtype=x.dtype, device=x.device)
        work = reduce_scatter_flat(out, inp, group=pg, async_op=True)
        pending.append((work, out, mine))
    for work, flat, regions in pending:
        work.wait()
        off = 0
        for r in regions:
            n = volume(r)
            mid[relative(r, h.region)] = flat[off:off + n].view(tuple(b - a for a, b in r))
            off += n
    return mid


def _gathers(op: CommOp, mid: torch.Tensor | None, out: torch.Tensor | None, me: int,
             groups: ProcessGroups) -> None:
    for g in op.gathers:
        if me not in g.devices:
            continue
        assert mid is not None and out is not None
        pg = groups.get(g.devices)
        order = groups.order(pg)
        part = dict(zip(g.devices, g.parts))
        width = max(volume(p) for p in g.parts)
        mine = mid.reshape(-1)
        if mine.numel() < width:
            mine = torch.cat([mine, mine.new_zeros(width - mine.numel())])
        buf = torch.empty(width * len(order), dtype=mid.dtype, device=mid.device)
        all_gather_flat(buf, mine.contiguous(), group=pg)
        dst_region = op.dst.by_device[me].region
        for i, d in enumerate(order):
            p = part[d]
            out[relative(p, dst_region)] = buf[i * width:i * width + volume(p)].view(tuple(b - a for a, b in p))


# ---------------------------------------------------------------------------------------------------
# Autograd


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op: CommOp, groups: ProcessGroups, has_src: bool, dtype, device):  # type: ignore[override]
        ctx.op, ctx.groups, ctx.has_src = op, groups, has_src
        ctx.dtype, ctx.device = dtype, device
        y = run(op, x if has_src else None, groups, dtype=dtype, device=device)
        return y if y is not None else torch.empty(0, dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        op: CommOp = ctx.op
        me = ctx.groups.my_device
        g_in = gy.contiguous() if me in op.dst else None
        gx = run(op.adjoint, g_in, ctx.groups, dtype=ctx.dtype, device=ctx.device)
        if not ctx.has_src:
            gx = torch.zeros(0, dtype=ctx.dtype, device=ctx.device)
        return gx, None, None, None, None, None


def execute(op: CommOp, x: torch.Tensor | None, groups: ProcessGroups, *, dtype: torch.dtype | None = None,
            device: torch.device | None = None, requires_grad: bool | None = None) -> torch.Tensor | None:
    """Run ``op`` on this device with autograd; every device of ``op.devices`` must call it.

    * holds source and destination: returns the local destination tensor;
    * only sends: returns an empty tensor attached to the graph. Add ``y.sum()`` to the loss (or pass
      it to ``torch.autograd.backward``) so this device joins the backward communication;
    * only receives: ``x`` is None, give ``dtype`` (``device`` defaults to ``groups.device``); the
      result requires grad when ``requires_grad`` (default: grad mode is on and dtype is floating);
    * holds neither: returns None.

    The backward pass runs ``op.adjoint`` (dst gradient layout -> src gradient layout).
    """
    me = groups.my_device
    if me is None or (me not in op.src and me not in op.dst):
        return None
    has_src = me in op.src
    if has_src and x is None:
        raise ValueError(f"device {me} holds the source of this op: pass its local tensor")
    dtype = x.dtype if x is not None else dtype
    device = x.device if x is not None else (device or groups.device)
    if dtype is None:
        raise ValueError(f"device {me} only receives: pass dtype=")
    if has_src:
        assert x is not None
        if not x.requires_grad or not torch.is_grad_enabled():
            y = run(op, x, groups)
            return y if me in op.dst else torch.empty(0, dtype=x.dtype, device=x.device)
        return _Reshard.apply(x, op, groups, True, dtype, device)
    grad = requires_grad if requires_grad is not None else (torch.is_grad_enabled() and dtype.is_floating_point)
    if not grad:
        return run(op, None, groups, dtype=dtype, device=device)
    anchor = torch.zeros(0, dtype=dtype, device=device, requires_grad=True)
    return _Reshard.apply(anchor, op, groups, False, dtype, device)


# ---------------------------------------------------------------------------------------------------
# Fused BSR of many tensors


def run_bsr(plan: BsrPlan, tensors: Mapping[str, torch.Tensor], groups: ProcessGroups, *,
            device: torch.device | None = None,
            into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Execute a (fused) BSR plan on this device in one batched P2P round.

    ``tensors``: this device's local source tensor of every plan tensor it holds, by name. Returns
    its local destination tensors by name (new tensors, or those of ``into`` where it names them: written
    in place, no second copy; sources are not modified). Excluded devices must not call it; every other
    device of ``plan.devices`` must.
    """
    me = groups.my_device
    if me is None:
        raise RuntimeError("this rank has no device id in ProcessGroups.ranks")
    if me in plan.excluded:
        raise RuntimeError(f"device {me} is excluded from this BSR plan")
    sources: dict[int, torch.Tensor] = {}
    regions: dict[int, Region] = {}
    outputs: dict[int, torch.Tensor] = {}
    for i, t in enumerate(plan.tensors):
        if me in t.src:
            if t.name not in tensors:
                raise KeyError(f"device {me} holds tensor {t.name!r} in the source layout: pass it")
            x = tensors[t.name]
            if tuple(x.shape) != t.src.local_shape(me):
                raise ValueError(f"tensor {t.name!r}: local shape {list(x.shape)} on device {me}, layout says "
                                 f"{list(t.src.local_shape(me))}")
            if x.dtype != torch_dtype(t.dtype):
                raise ValueError(f"tensor {t.name!r}: dtype {x.dtype} on device {me}, plan says {t.dtype}")
            sources[i] = x.detach()
            regions[i] = t.src.by_device[me].region
        if me in t.dst and into is not None and t.name in into:
            outputs[i] = into[t.name]
            if tuple(outputs[i].shape) != t.dst.local_shape(me):
                raise ValueError(f"tensor {t.name!r}: destination shape {list(outputs[i].shape)} on device {me}, "
                                 f"layout says {list(t.dst.local_shape(me))}")
        elif me in t.dst:
            dev = tensors[t.name].device if t.name in tensors else (device or groups.device)
            outputs[i] = torch.empty(t.dst.local_shape(me), dtype=torch_dtype(t.dtype), device=dev)
    run_p2p(plan, me, sources, outputs, regions, groups.ranks, as_bytes=True)
    return {plan.tensors[i].name: out for i, out in outputs.items()}


# ---------------------------------------------------------------------------------------------------
# Pieces for schedules that fuse an op's messages into their own batch_isend_irecv


def start_output(op: CommOp, x: torch.Tensor | None, me: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> torch.Tensor | None:
    """Allocate this device's destination tensor and fill what it holds locally (None if not a
    destination). For ``op.p2p_only`` ops; the messages fill the rest."""
    if not op.p2p_only:
        raise ValueError(f"{op.kind} is not point-to-point only; run it with execute()")
    if me not in op.dst:
        return None
    dtype = x.dtype if x is not None else dtype
    device = x.device if x is not None else device
    if dtype is None or device is None:
        raise ValueError("pass dtype= and device= on a device without a source tensor")
    out = torch.empty(op.dst.local_shape(me), dtype=dtype, device=device)
    dst_region = op.dst.by_device[me].region
    for c in op.p2p.local_copies(me):
        assert x is not None
        out[relative(c.region, dst_region)] = x[relative(c.region, op.src.by_device[me].region)]
    return out


def pack_message(op: CommOp, message: Message, x: torch.Tensor, me: int) -> torch.Tensor:
    """The flat send buffer of one outgoing message of ``op.sends(me)`` (dtype of ``x``)."""
    return _pack(message, {0: x}, {0: op.src.by_device[me].region}, False)


def recv_buffer(message: Message, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty buffer for one incoming message of ``op.recvs(me)``."""
    return torch.empty(sum(volume(p.region) for p in message.pieces), dtype=dtype, device=device)


def unpack_message(op: CommOp, message: Message, buf: torch.Tensor, out: torch.Tensor, me: int) -> None:
    """Copy a received message into this device's destination tensor."""
    dst_region = op.dst.by_device[me].region
    off = 0
    for piece in message.pieces:
        n = volume(piece.region)
        out[relative(piece.region, dst_region)] = buf[off:off + n].view(tuple(b - a for a, b in piece.region))
        off += n
