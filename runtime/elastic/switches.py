"""Planned switches (``--switch STEP:PLAN``) once the run is under way: re-planned after a failure, reported.

A switch is a transition in the same world before its step. A failure may void one (in flight, or due at
the step being redone) or take devices a later one names: ``after_failure`` gives the recovery a due
switch's plan, and re-plans a switch whose plan lost devices for its survivors; one that cannot be is
dropped, logged and reported (``switch_dropped``), never silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.elastic.incident import device_list, slowest
from runtime.elastic.joining import Growth
from runtime.elastic.protocol import Switched, Transition
from runtime.torchfree.elastic.preplan import Replanner
from runtime.torchfree.elastic.state import check_compatible
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.handle import StrategyHandle

Log = Callable[[str], None]
Report = Callable[[dict[str, Any], Callable[[dict[str, Any]], str]], None]


def after_failure(switches: dict[int, StrategyHandle], step: int, failed: frozenset[int], *, ref: StrategyHandle,
                  alive: set[int], last: int, replan: Replanner | None, log: Log,
                  report: Report) -> StrategyHandle | None:
    """Planned switches after a failure: the one due by ``step`` (the step redone; the last of them if
    several) is what the recovery switches to, re-planned if its plan lost devices; a later one whose
    plan lost devices is re-planned now. One that cannot be re-planned is dropped and reported."""
    due: StrategyHandle | None = None
    for s in sorted(switches):
        target: StrategyHandle | None = switches.pop(s)
        if set(target.devices) & failed:
            target = _replan_switch(s, target, failed, alive, last, replan, log, report)
        if target is None:
            continue
        if s <= step:
            due = target
            log(f"the switch planned for step {s} is taken by the recovery: {target.describe()}")
        else:
            switches[s] = target
    if due is not None:
        check_compatible(ref.ctx, due.ctx)
    return due


def _replan_switch(step: int, target: StrategyHandle, failed: frozenset[int], alive: set[int], last: int,
                   replan: Replanner | None, log: Log, report: Report) -> StrategyHandle | None:
    lost = sorted(failed & set(target.devices))
    why = ""
    if replan is not None:
        try:
            new = StrategyHandle.of(replan(failed & set(target.devices), target.ctx, target.name, last - step + 1))
            if set(new.devices) <= alive:
                log(f"the switch planned for step {step} names failed device(s) {device_list(lost)}: "
                    f"re-planned as {new.describe()}")
                return new
            why = f"its re-plan uses devices {sorted(set(new.devices) - alive)} that are not alive"
        except HspmdError as err:
            why = "; ".join(err.lines())
    else:
        why = "no replanner was given"
    report({"event": "switch_dropped", "step": step, "strategy": target.name,
            "plan_file": str(target.ctx.path), "failed": lost, "reason": why},
           lambda e: f"the switch planned for step {step} to {target.describe()} is dropped: it names failed "
                     f"device(s) {device_list(lost)} and cannot be re-planned ({why})")
    return None


def switch_event(t: Transition, step: int, growth: Growth | None, plan_s: float, since: float, t_resumed: float,
                 times: dict[int, Switched]) -> dict[str, Any]:
    """A planned switch's event, or a growth's (``rejoin``): what moved, and each part at its slowest device."""
    which = ({"event": "switch", "step": step} if growth is None else
             {"event": "rejoin", "step": step + 1, "joined": list(growth.joining), "decide_s": growth.decide_s,
              "preplanned": growth.preplanned})
    return {**which, "from": t.source.describe(), "to": t.target.describe(), "devices": sorted(t.target.devices),
            "strategy": t.target.name, "plan_file": str(t.target.ctx.path), "plan_s": plan_s, **slowest(times),
            "switch_bytes": t.bsr.total_bytes, "modelled_transfer_s": t.bsr.modelled_time(t.target.ctx.cluster),
            "total_s": t_resumed - since}
