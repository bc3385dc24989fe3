"""The half of the runtime that imports no torch, directly or through anything it imports.

Formats and specs, annotations, schedules, specialization, communication planning (reshards, BSR, the
gradient-sync layout), profile pricing, state diffs, dispatch and the messages of a run: what the planner,
the simulator and every verb that does not train share with the runtime. The rest of runtime/ runs on a
device and may import torch. tests/unit/test_layering.py (statically) and
tests/unit/test_planning_torch_free.py (in a fresh interpreter) hold this package to that.
"""
