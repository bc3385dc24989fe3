"""Starting a training run: one worker process per device of the plan, supervised by the launcher.

* ``launch(options, policy, on_step=..., on_log=...)`` (launcher.py): ``hspmd train``'s own launcher: it
  hosts the TCPStore, starts the workers and runs the supervisor's event loop (supervise.py) under a
  policy: ``PlainPolicy`` (stop on the first failure, raise ``WorkerFailure``), or for elastic and
  switching runs runtime.elastic.ElasticPolicy.
* ``run_torchrun(options, TorchrunEnv.detect(os.environ), ...)`` (torchrun.py): the same worker under
  torchrun, for multi-node runs.
* ``train_worker`` (worker.py): the per-device loop both share, on a ``Session`` (session.py);
  the words on the pipes and the run's options are torch-free, in
  runtime/torchfree/launch/. Submodules import torch lazily: importing this package is cheap.
"""

from runtime.launch.launcher import launch
from runtime.launch.options import Fault, PlannedSwitch, StepRecord, StepReport, TrainOptions, WorkerSpec
from runtime.launch.supervise import PlainPolicy, RunSummary, WorkerFailure
from runtime.launch.torchrun import TorchrunEnv, run_torchrun

__all__ = ["Fault", "PlainPolicy", "PlannedSwitch", "RunSummary", "StepRecord", "StepReport", "TorchrunEnv",
           "TrainOptions", "WorkerFailure", "WorkerSpec", "launch", "run_torchrun"]
