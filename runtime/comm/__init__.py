"""Communication: planning reshards, BSR and the gradient sync (pure, no torch), and running them on
torch.distributed.

Everything is addressed by **device ids** (cluster ids); ``ProcessGroups.ranks`` maps them to the
ranks of the current world, which change when survivors of a failure form a new world.

Modules: groups.py (``ProcessGroups``: every group created in one global order on every rank),
resolve.py (``resolve``: names and plans the op of a reshard, pure), bsr.py (``plan_bsr``: the fused BSR
and its cost model, pure; element types are anything with an ``itemsize``), execute.py (running both on
torch.distributed), gradsync.py (``plan_sync``: the bucketed gradient sync, pure, priced by the planner
too), world.py (``LocalWorld``: persistent local gloo workers for tests and benchmarks).

For the training runtime
------------------------
(1) **Stage boundaries / P2P.** ``op = resolve(src, dst, shape, dtype=..., bandwidth=cluster)``.
    ``op.p2p_only`` is True for identity / local_slice / send_recv / scatter / bsr ops (no collective).
    For those, per device ``me``::

        op.sends(me) -> [Message(peer: device id, pieces: ((tensor, region), ...), nbytes)]
        op.recvs(me) -> [Message(...)]          # one message per peer, fixed packing order
        out = start_output(op, x, me, dtype=, device=)   # dst tensor with local parts filled
        buf = pack_message(op, m, x, me)                 # flat send buffer (x.dtype)
        buf = recv_buffer(m, dtype=, device=)            # flat receive buffer
        unpack_message(op, m, buf, out, me)              # after the wait

    so a pipeline schedule can put them into its own ``batch_isend_irecv`` with other boundary ops
    (peer rank = ``groups.ranks[m.peer]``). Regions are global ``((start, stop), ...)`` per dim;
    ``relative(region, op.src.region(me))`` indexes the local tensor. The backward of a boundary op is
    ``op.adjoint`` (itself p2p_only for send_recv/bsr). Ready-made alternative with autograd:
    ``y = execute(op, x, groups)`` (see its docstring: sender-only devices get an empty tensor to add
    to the loss; receiver-only devices pass ``x=None, dtype=``).
(2) **Gradient sync.** ``GradientSync(entries, plan_sync(layouts), groups)`` with entries
    ``(name, global shape, grad annotation)`` (HDim -2 across the pipelines holding the parameter,
    the same members as the parameter; see annotations.from_plan). ``sync.sync(grads, scale=None)``
    all-reduces every gradient in place, one collective per device group per bucket, and counts a
    subgroup's internal replicas once (TP-duplicated norm weights are not double-counted);
    ``scale`` multiplies afterwards (e.g. 1 / global sample count).
(3) **Groups.** ``runtime.annotations.from_plan.strategy_groups(strategy, model, training)`` lists
    every device group a strategy needs (TP groups, gradient-sync groups, boundary gathers, the whole
    strategy); pass it to ``ProcessGroups`` once, on every rank.
(4) **State switch (failures).** ``plan_bsr([TensorMove(name, shape, dtype, src, dst), ...],
    bandwidth=cluster, excluded=failed)`` then ``run_bsr(plan, local_tensors_by_name, groups)`` ->
    new local tensors by name, one batched P2P round for all parameters and optimizer states.
"""
