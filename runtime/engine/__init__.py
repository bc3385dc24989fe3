"""The engine: per-device specialized programs that train exactly like the single-device reference.

The launcher (runtime/launch/) creates the world and calls, per worker::

    groups = ProcessGroups(DeviceProgram.required_groups(plan, strategy), ranks, timeout=...)
    program = DeviceProgram(WorkerContext(plan, strategy, device_id, ranks, torch_device, timeout), groups, hooks)
    stats = program.train_step(global_batch)      # StepStats, the same loss/grad_norm on every rank

``ReferenceTrainer`` is the single-process training every plan must reproduce.
"""

from runtime.engine.api import NULL_HOOKS, Hooks, StepStats, WorkerContext
from runtime.engine.describe import OpLine, ProgramDescription, describe_program
from runtime.engine.program import DeviceProgram
from runtime.engine.reference import ReferenceTrainer, autocast_for
from runtime.engine.specialize import ParamShard, StageRole, parameter_shards, stage_role

__all__ = [
    "NULL_HOOKS", "Hooks", "StepStats", "WorkerContext", "OpLine", "ProgramDescription", "describe_program",
    "DeviceProgram", "ReferenceTrainer", "autocast_for", "ParamShard", "StageRole", "parameter_shards",
    "stage_role",
]
