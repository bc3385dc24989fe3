"""Communication: planning reshards, BSR and the gradient sync (pure, no torch), and running them on
torch.distributed.

Everything is addressed by **device ids** (cluster ids); ``ProcessGroups.ranks`` maps them to the
ranks of the current world, which change when survivors of a failure form a new world.

Modules (resolve.py, bsr.py and gradsync.py import no torch: they are in runtime/torchfree/comm/):
groups.py (``ProcessGroups``: every group created in one global order on every rank),
resolve.py (``resolve``: names and plans the op of a reshard, pure), bsr.py (``plan_bsr``: the fused BSR
and its cost model, pure; element types are anything with an ``itemsize``), execute.py (running both on
torch.distributed), gradsync.py (``plan_sync``: the bucketed gradient sync, pure, priced by the planner
too), world.py (``LocalWorld``: persistent local gloo workers for tests and benchmarks).

For the training runtime
------------------------
(1) **Stage boundaries / P2P.** ``op = resolve(src, dst, shape, dtype=..., bandwidth=cluster)``. When
    ``op.p2p_only`` (identity / local_slice / send_recv / scatter / bsr: no collective), a schedule can
    fuse the op's messages into its own ``batch_isend_irecv``: ``op.sends(me)`` / ``op.recvs(me)`` (one
    message per peer, fixed packing order; peer rank = ``groups.ranks[m.peer]``) with ``start_output``,
    ``pack_message``, ``recv_buffer`` and ``unpack_message``. Regions are global ``((start, stop), ...)``
    per dim. The backward of a boundary op is ``op.adjoint``. Ready-made, with autograd:
    ``y = execute(op, x, groups)`` (sender-only devices get an empty tensor to add to the loss).
(2) **Gradient sync.** ``GradientSync(entries, plan_sync(layouts), groups)`` all-reduces every gradient in
    place, one collective per device group per bucket, counting a subgroup's internal replicas once
    (TP-duplicated norm weights are not double-counted).
(3) **Groups.** ``runtime.torchfree.annotations.from_plan.strategy_groups`` lists every device group a strategy
    needs; pass it to ``ProcessGroups`` once, on every rank.
(4) **State switch (failures).** ``plan_bsr(moves, bandwidth=cluster, excluded=failed)`` then
    ``run_bsr(plan, local_tensors_by_name, groups)``: one batched P2P round for all parameters and
    optimizer states.
"""
