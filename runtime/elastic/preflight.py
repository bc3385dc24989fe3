"""User errors of a coordinated run (elastic or switching), found before any process starts.

``check_run`` refuses what the coordinator cannot do (ZeRO-1 with one copy of the moments, a heartbeat
timeout no shorter than the op timeout, a step outside the run, an unknown node, a switch to a plan for
another cluster or model) and loads the planned switches' plans; ``single_copy_note`` warns of parameters
whose one device's loss would end an elastic run.
"""

from __future__ import annotations

from runtime.launch.options import PlannedSwitch, TrainOptions
from runtime.torchfree.elastic.state import check_compatible, lost_tensors
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext, load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle


def first_step(options: TrainOptions, ctx: PlanContext) -> int:
    """The run's first step: 1, or the one after the checkpoint it loads."""
    if options.load_dir is None:
        return 1
    from runtime.checkpoint import read_checkpoint_info

    return read_checkpoint_info(options.load_dir, ctx).step + 1


def check_run(options: TrainOptions, ctx: PlanContext, first: int) -> dict[int, StrategyHandle]:
    """Every planned switch's target by its step, once the run's options are found sound for ``ctx``."""
    if ctx.plan.training.zero and ctx.plan.training.zero_redundancy < 2:
        raise HspmdError(f"{ctx.path}: training.zero: {'--elastic' if options.elastic else '--switch'} moves "
                         "AdamW moments from surviving copies, and ZeRO-1 keeps one copy of each: use a plan "
                         "with zero_redundancy: 2 or zero: false (hspmd plan --elastic)")
    if options.elastic and options.heartbeat_timeout_s >= options.timeout_s:
        raise HspmdError(f"--elastic: the heartbeat timeout ({options.heartbeat_timeout_s:g} s) must be shorter "
                         f"than the op timeout (--timeout {options.timeout_s:g} s), so that a hang is found "
                         "before the survivors' collectives time out")
    last = first - 1 + options.steps
    switches = {sw.step: switch_target(sw, ctx, first, last) for sw in options.switches}
    for what, step in [(f"rejoin of device {r.device}", r.step) for r in options.rejoins] + \
            [(f"kill of node {k.node!r}", k.step) for k in options.node_kills]:
        check_step(f"{what} at step {step}", step, first, last)
    nodes = {n.name for n in ctx.cluster.nodes}
    for k in options.node_kills:
        if k.node not in nodes:
            raise HspmdError(f"node kill at step {k.step}: unknown node {k.node!r} (cluster "
                             f"{ctx.cluster.name!r} has nodes {', '.join(sorted(nodes))})")
    return switches


def check_step(what: str, step: int, first: int, last: int) -> None:
    if not first < step <= last:
        raise HspmdError(f"{what}: the step must come after the first step of the run ({first}) and at most at "
                         f"its last ({last})")


def switch_target(sw: PlannedSwitch, ctx: PlanContext, first: int, last: int) -> StrategyHandle:
    where = f"--switch {sw.step}:{sw.plan}"
    check_step(where, sw.step, first, last)
    target = load_plan_context(sw.plan)
    if target.cluster != ctx.cluster:
        raise HspmdError(f"{where}: plan is for cluster {target.cluster.name!r}, the run is on {ctx.cluster.name!r}")
    check_compatible(ctx, target)
    return StrategyHandle.of(target, sw.strategy)


def single_copy_note(ref: StrategyHandle) -> str | None:
    """The warning for an elastic run whose parameters some device holds the only copy of; None if none."""
    singles = [(d, len(lost)) for d in ref.devices if (lost := lost_tensors(ref, [d]))]
    if not singles:
        return None
    where = ", ".join(f"device {d} ({n} tensors)" for d, n in singles)
    return (f"note: some parameters have a single copy, on {where}: if such a device fails the run "
            "cannot continue in memory (plan with `hspmd plan --elastic` to keep >= 2 pipelines)")
