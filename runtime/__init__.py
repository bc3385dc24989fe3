"""hspmd runtime: annotations, communication, specialization and execution.

The half that imports no torch, directly or through anything it imports, is runtime/torchfree/;
the rest runs on a device and may import torch.

Layering rule: nothing in ``runtime`` imports ``planner`` or ``hetu_cli``.
"""
