"""Device profiles: the format (``profile``: torch-free, shared with the planner) and the measurement
code behind ``hspmd profile`` (``profiler``: the run; ``compute``: timing the runtime's modules and the
engine's micro-batch step; ``links``: p2p and collectives; ``host``: the emulated host's CPU shares and
what sharing costs; ``fit``: samples to fits). Nothing here imports the planner."""
