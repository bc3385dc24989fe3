"""The torch-free modules of runtime/models/ (plain PyTorch models and the parameter table that annotations are built
from): they import no torch, directly or through anything they import. The modules that run on a device stay in
runtime/models/."""
