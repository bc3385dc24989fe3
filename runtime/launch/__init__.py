"""Starting a training run: one worker process per device of the plan, watched by a launcher.

* ``launch(options, on_step=..., on_log=...)`` (launcher.py): the local launcher behind ``hspmd train``;
  it hosts the TCPStore, starts workers with multiprocessing 'spawn' (gloo on CPU, NCCL with one
  process per GPU), aggregates their per-step reports into ``StepRecord``s, and on any worker's failure
  stops them all and raises ``WorkerFailure``.
* ``run_torchrun(options, TorchrunEnv.detect(os.environ), ...)`` (torchrun.py): the same worker under
  torchrun, for multi-node runs.
* ``train_worker`` (worker.py): the per-device loop both share.
* Elastic and switching runs (``TrainOptions(elastic=True)``, ``switches=(PlannedSwitch(step, plan), ...)``)
  are coordinated by runtime/elastic/ (``launch(options, replan=..., on_event=...)``).

Submodules import torch lazily, so importing this package stays cheap.
"""

from runtime.launch.launcher import RunSummary, WorkerFailure, launch
from runtime.launch.options import Fault, PlannedSwitch, StepRecord, StepReport, TrainOptions, WorkerSpec
from runtime.launch.torchrun import TorchrunEnv, run_torchrun

__all__ = ["Fault", "PlannedSwitch", "RunSummary", "StepRecord", "StepReport", "TorchrunEnv", "TrainOptions",
           "WorkerFailure", "WorkerSpec", "launch", "run_torchrun"]
