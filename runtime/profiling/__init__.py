"""Device profiles: the measurement code behind ``hspmd profile`` (``profiler``: the run; ``compute``:
timing the runtime's modules and the engine's micro-batch step; ``links``: p2p and collectives;
``host``: the emulated host's CPU shares and what sharing costs; ``fit``: samples to fits). The format
(``profile``), its tables and flat-table import are torch-free, in runtime/torchfree/profiling/. Nothing
here imports the planner."""
