"""Communication on torch.distributed: process groups, reshard resolution, BSR, execution."""
