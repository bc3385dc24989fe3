"""Failures and switches in memory: no checkpoint, no restart (docs/design.md §4, §7).

state.py and protocol.py import no torch and live in runtime/torchfree/elastic/, with events.py
(failure traces), preplan.py (replans planned ahead) and staging.py (a documents run's switch in stages).

* state.py: the model state as data, per ``StrategyHandle`` (runtime/torchfree/spec/handle.py):
  ``lost_state(ref, failed)`` (what a failure loses for good: parameters without a replica, ZeRO-1
  moment chunks without a copy; the coordinator and `hspmd replan` both ask it);
  ``state_moves(src, dst)`` /
  ``plan_switch(src, dst, excluded)`` (the fused BSR of every parameter and AdamW moment);
  ``check_compatible(a, b)``.
* protocol.py: the launcher <-> worker messages (``World``, ``Transition``, ``Commit``, ``Ready``, ...).
* coordinator.py: the launcher's side (``ElasticPolicy``, a policy of the supervisor's loop;
  ``Replanner``; ``UnrecoverableFailure``): ``runtime.launch.launch(options, ElasticPolicy(replan,
  on_event))`` runs an elastic (``options.elastic``) or switching (``options.switches``) run.
  Its decisions: preflight.py (user errors before the run), recovery.py (errors sorted, the plan for the
  survivors, the recovery's transition), switches.py (planned switches after a failure), joining.py
  (returning devices: when awaited, whether adopted), incident.py (a failure's record and event;
  ``UnrecoverableFailure``).
* worker.py: the worker's side (commit agreement, leaving a generation, transitions).

The runtime never imports the planner: a run that must replan gets a ``Replanner`` callback from the
CLI (hetu_cli/commands/train.py, which calls planner/replan.py). Nothing is imported here: a worker
process unpickles its loop (worker.py) before its heartbeat starts, so that import must stay light.
"""
