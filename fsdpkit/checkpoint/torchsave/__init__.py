"""Per-rank `torch.save` state dicts of FSDP2 DTensors or FSDP1 ShardedTensors (verl's files),
read without torch."""
