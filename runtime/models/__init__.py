"""Plain PyTorch models and the parameter table that annotations are built from."""
