"""The engine: per-device specialized programs that train exactly like the single-device reference.

The launcher (runtime/launch/) creates the world and calls, per worker::

    handle = StrategyHandle.of(plan_context, strategy_name)            # runtime/torchfree/spec/handle.py
    groups = ProcessGroups(DeviceProgram.required_groups(handle), ranks, timeout=...)
    program = DeviceProgram(WorkerContext(handle, device_id, ranks, torch_device, timeout), groups, hooks)
    stats = program.train_step(global_batch)      # StepStats, the same loss/grad_norm on every rank

``ReferenceTrainer`` is the single-process training every plan must reproduce.

The planning half imports no torch and lives in runtime/torchfree/engine/: ``specialize``
(``specialize(handle, device) -> DevicePlan``), ``describe`` and ``zero`` (ZeRO-1's layout); the action
lists come from runtime/torchfree/pipeline_schedules.py through ``handle.pipeline_schedule``. The
modules here (``program``, ``pipeline``, ``data_parallel``, ``tensor_parallel``, ``optim``,
``reference``, ``api``) execute and need torch; import each from its module: this package imports
none of them.
"""
