"""hspmd runtime: annotations, communication, specialization and execution.

Layering rule: nothing in ``runtime`` imports ``planner`` or ``hetu_cli``.
"""
