"""hspmd command line: wires the planner and the runtime behind four verbs and a few helpers."""
