"""Remote servers: weight updates sent over torch.distributed to machines that hold a copy."""
