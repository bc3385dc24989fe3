"""One device's part of an in-memory switch between two strategies' layouts of the training state.

Its own module because two loops use it: the elastic worker (a failure's recovery, a planned ``--switch``)
and a documents run switching between its plan's strategies per step (runtime/launch/session.py).

From a ZeRO-1 plan with r >= 2 copies the switch takes two rounds (why: runtime/torchfree/elastic/state.py): the
moments' chunks first become full moments on every surviving replica, then the usual fused BSR runs; a
ZeRO-1 destination keeps only its chunks of the moments it receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def move_state(bsr: Any, source: dict[str, Any], groups: Any, program: Any, steps_done: int, device: Any,
               src: Any = None, *, ungathered: bool = False) -> None:
    """This device's part of a switch: run the fused BSR ``bsr`` (collective over ``bsr.devices``) from
    its ``source`` state (``local_state()`` layout of the old plan ``src``; empty if it held none) and load
    the result into ``program`` (None when the new plan leaves this device idle). ``src`` (the old plan's
    ``StrategyHandle``) is needed when it uses ZeRO-1; every device of the switch must pass it then.
    ``ungathered`` (ZeRO-1): the parameters of the sharded slices are final only on their chunks' holders
    (``Transition.ungathered``); the first round rebuilds them too."""
    import torch

    from runtime.comm.execute import run_bsr

    me = groups.my_device
    if src is not None and src.training.zero:
        source = _full_moments(src, bsr.excluded, source, groups, device, ungathered)
    into = None
    if program is not None and me in bsr.devices and not program.ctx.strategy.training.zero:
        # The BSR writes into the program's own tensors: its freshly built state is freed first, so the new
        # layout is held once beside the old (not a built copy, the BSR's output and the old).
        program.release_state()
        into = program.receive_state(list(program.param_annotations()), steps_done)
    out = run_bsr(bsr, source, groups, device=device, into=into) if me in bsr.devices else {}
    del source
    if program is not None and into is None:
        _keep_chunks(program, out)
        out["step"] = torch.tensor(float(steps_done))
        program.load_local_state(out)


# (stage index, its ``SwitchStage``, "allocated" | "done"): called when the destination's tensors of the stage
# are allocated (its peak, but for the BSR's buffers) and when the source's are freed
StageObserver = Callable[[int, Any, str], None]


def move_state_staged(switch: Any, src: Any, dst: Any, groups: Any, steps_done: int, device: Any,
                      observe: StageObserver | None = None) -> None:
    """This device's part of a staged switch (runtime/torchfree/elastic/staging.py ``StagedSwitch``, collective over
    each stage's devices) from program ``src`` to program ``dst`` (None where the strategy leaves this device
    idle): per stage, ``dst``'s tensors of the unit are allocated and written in place by the stage's fused
    BSR, then ``src``'s tensors of it are freed. Without ZeRO-1 (a documents run has none)."""
    from runtime.comm.execute import run_bsr

    me = groups.my_device
    src_names = set(src.param_annotations()) if src is not None else set()
    dst_names = set(dst.param_annotations()) if dst is not None else set()
    for k, stage in enumerate(switch.stages):
        gone = [n for n in stage.names if n in src_names]
        into = dst.receive_state([n for n in stage.names if n in dst_names], steps_done) if dst is not None else {}
        if observe is not None:
            observe(k, stage, "allocated")
        if me in stage.bsr.devices:
            source = src.local_state(gone) if gone else {}
            run_bsr(stage.bsr, source, groups, device=device, into=into)
            del source
        del into
        if gone:
            src.release_state(gone)
        if observe is not None:
            observe(k, stage, "done")


def _full_moments(src: Any, excluded: Any, source: dict[str, Any], groups: Any,
                  device: Any, ungathered: bool = False) -> dict[str, Any]:
    """``source`` with this device's ZeRO-1 moments (1-D chunks) replaced by full moments in the
    parameter's layout, rebuilt by ``plan_moment_gather`` from the surviving copies (``ungathered``: the
    sharded slices' parameters too, from their chunks' holders)."""
    import torch

    from runtime.comm.execute import run_bsr
    from runtime.engine.optim import flat_range
    from runtime.torchfree.annotations.from_plan import strategy_annotations
    from runtime.torchfree.annotations.states import relative
    from runtime.torchfree.elastic.state import MOMENT_SUFFIXES, moment_key, moment_slices, plan_moment_gather

    me = groups.my_device
    plan = plan_moment_gather(src, excluded, ungathered=ungathered)
    slices = moment_slices(src)
    ann = strategy_annotations(src)
    mine: dict[str, Any] = {}
    for name, sl in slices.items():
        if ungathered and name in source:
            p = ann.param(name)
            region = p.param.layout(p.shape).region(me)
            for i, s in enumerate(sl):
                a, b = s.chunk(me) if me in s.devices else (0, 0)
                if b > a:
                    mine[moment_key(name, "", i)] = flat_range(source[name][relative(s.region, region)], a, b)
        for suffix in MOMENT_SUFFIXES:
            flat = source.get(name + suffix)
            off = 0
            for i, s in enumerate(sl):
                if me not in s.devices:
                    continue
                a, b = s.chunk(me)
                if b > a:
                    mine[moment_key(name, suffix, i)] = flat[off:off + b - a]
                off += b - a
    got = run_bsr(plan, mine, groups, device=device) if me in plan.devices else {}
    del mine
    if not got:
        return source
    out = dict(source)
    for name, sl in slices.items():
        if name not in source:
            continue
        p = ann.param(name)
        region = p.param.layout(p.shape).region(me)
        if ungathered:
            param = source[name].clone()
            for i, s in enumerate(sl):
                if me in s.devices:
                    param[relative(s.region, region)] = got.pop(moment_key(name, "", i)).view(s.shape)
            out[name] = param
        for suffix in MOMENT_SUFFIXES:
            full = torch.empty(tuple(b - a for a, b in region), dtype=source[name].dtype, device=source[name].device)
            for i, s in enumerate(sl):
                if me in s.devices:
                    full[relative(s.region, region)] = got.pop(moment_key(name, suffix, i)).view(s.shape)
            out[name + suffix] = full
    return out


def _keep_chunks(program: Any, state: dict[str, Any]) -> None:
    """A ZeRO-1 program keeps its chunks of the full moments (parameter layout) that the switch delivered."""
    import torch

    from runtime.engine.optim import flat_range
    from runtime.torchfree.annotations.states import relative
    from runtime.torchfree.elastic.state import MOMENT_SUFFIXES

    pieces = program.moment_pieces()
    if not pieces:
        return
    shards = program.param_annotations()
    for name, ps in pieces.items():
        region = tuple((s.start, s.stop) for s in shards[name].region)
        for suffix in MOMENT_SUFFIXES:
            full = state[name + suffix]
            state[name + suffix] = torch.cat([flat_range(full[relative(p.region, region)], p.start, p.stop)
                                              for p in ps])


def carry_router_biases(old: dict[str, Any], program: Any, target: Any, device: Any) -> None:
    """Aux-loss-free balancing's router biases into the new layout (collective over the whole current world:
    every worker of a transition calls it). Every device that held a router before (its old program's, or
    the biases it kept after a failure: ``old``) adds its bias and a count of one; every holder of a router
    had the same bias, so the sum over the count is it, exactly (fp64), wherever the router now lives.
    ``target``: the new strategy's handle; ``program``: its program here, or None (idle)."""
    import torch
    import torch.distributed as dist

    from runtime.torchfree.models.params import router_biases

    model = target.model
    names = list(router_biases(model))
    if not names:
        return
    table = torch.zeros(len(names), model.moe.num_experts + 1, dtype=torch.float64, device=device)
    for i, n in enumerate(names):
        if n in old:
            table[i, :-1] = old[n].double()
            table[i, -1] = 1.0
    dist.all_reduce(table)
    if program is None:   # idle in the new strategy: it only lent its biases
        return
    held = program.router_biases()
    lost = [n for i, n in enumerate(names) if n in held and float(table[i, -1]) == 0.0]
    if lost:
        raise RuntimeError(f"no surviving device held the router biases {lost[:3]}")
    program.load_router_biases({n: table[i, :-1] / table[i, -1] for i, n in enumerate(names) if n in held})
