"""One device's part of an in-memory switch between two strategies' layouts of the training state.

Its own module because two loops use it: the elastic worker (a failure's recovery, a planned ``--switch``)
and a documents run switching between its plan's strategies per step (runtime/launch/session.py).
"""

from __future__ import annotations

from typing import Any


def move_state(bsr: Any, source: dict[str, Any], groups: Any, program: Any, steps_done: int, device: Any) -> None:
    """This device's part of a switch: run the fused BSR ``bsr`` (collective over ``bsr.devices``) from
    its ``source`` state (``local_state()`` layout of the old plan; empty if it held none) and load the
    result into ``program`` (None when the new plan leaves this device idle)."""
    import torch

    from runtime.comm.execute import run_bsr

    me = groups.my_device
    out = run_bsr(bsr, source, groups, device=device) if me in bsr.devices else {}
    if program is not None:
        out["step"] = torch.tensor(float(steps_done))
        program.load_local_state(out)
