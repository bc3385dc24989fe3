"""Starting a training run: one worker process per device of the plan, supervised by the launcher.

* ``launch(options, policy, on_step=..., on_log=...)`` (launcher.py): the local launcher behind ``hspmd
  train``; it hosts the TCPStore, starts workers with multiprocessing 'spawn' (gloo on CPU, NCCL with one
  process per GPU) and runs the supervisor's event loop (supervise.py) under a policy: ``PlainPolicy``
  (the default) aggregates the per-step reports into ``StepRecord``s and on any worker's failure stops
  them all and raises ``WorkerFailure``; elastic and switching runs use runtime.elastic.ElasticPolicy.
* ``run_torchrun(options, TorchrunEnv.detect(os.environ), ...)`` (torchrun.py): the same worker under
  torchrun, for multi-node runs.
* ``train_worker`` (worker.py): the per-device loop both share, on one device's ``Session`` (session.py);
  messages.py: the words on the pipes.

Submodules import torch lazily, so importing this package stays cheap.
"""

from runtime.launch.launcher import launch
from runtime.launch.options import Fault, PlannedSwitch, StepRecord, StepReport, TrainOptions, WorkerSpec
from runtime.launch.supervise import PlainPolicy, RunSummary, WorkerFailure
from runtime.launch.torchrun import TorchrunEnv, run_torchrun

__all__ = ["Fault", "PlainPolicy", "PlannedSwitch", "RunSummary", "StepRecord", "StepReport", "TorchrunEnv",
           "TrainOptions", "WorkerFailure", "WorkerSpec", "launch", "run_torchrun"]
