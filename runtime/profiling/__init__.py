"""Device profiles: the format (``profile``: torch-free, shared with the planner) and the measurement
code behind ``hspmd profile`` (``measure``: timing the runtime's modules; ``profiler``: the run).
Nothing here imports the planner."""
