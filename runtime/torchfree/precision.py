"""Training precision: which autocast the engine and the reference run under (one policy for both).

auto: bf16 autocast on CUDA, fp32 elsewhere (the default, and what the profiles assume);
fp32: no autocast anywhere; bf16: bf16 autocast on every device, the CPU included (to exercise the
bf16 path, and its loss tolerances, on a machine without a GPU).
"""

from __future__ import annotations

from typing import Literal, get_args

Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


def uses_bf16(precision: Precision, device_type: str) -> bool:
    """Whether compute on a ``device_type`` ("cpu", "cuda") device runs under bf16 autocast."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (have: {', '.join(PRECISIONS)})")
    return precision == "bf16" or (precision == "auto" and device_type == "cuda")
