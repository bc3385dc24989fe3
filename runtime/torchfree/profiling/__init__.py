"""The torch-free modules of runtime/profiling/ (device profiles): they import no torch, directly or through anything
they import. The modules that run on a device stay in runtime/profiling/."""
