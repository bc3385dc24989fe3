"""A torchrun worker on a described machine: ``torchrun ... fake_gpu_torchrun.py PLAN NODE GPU_NAME GIB COUNT``
runs ``hspmd train --plan PLAN --node NODE --steps 1`` as one of torchrun's workers, with the machine's GPUs
described (COUNT GPUs named GPU_NAME of GIB GiB) instead of read from CUDA. Bad placement: its one line on
stderr, exit 2, as the CLI does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from runtime.launch.options import TrainOptions
from runtime.launch.placement import GIB, FixedGpus, GpuInfo
from runtime.launch.torchrun import TorchrunEnv, run_torchrun
from runtime.torchfree.errors import HspmdError


def main() -> int:
    plan, node, name, gib, count = sys.argv[1:6]
    env = TorchrunEnv.detect(os.environ)
    assert env is not None
    gpus = FixedGpus("loopback", (GpuInfo(name, int(float(gib) * GIB)),) * int(count))
    try:
        run_torchrun(TrainOptions(plan=Path(plan), steps=1, timeout_s=30, node=node, gpus=gpus), env)
    except HspmdError as e:
        print("\n".join(e.lines()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
