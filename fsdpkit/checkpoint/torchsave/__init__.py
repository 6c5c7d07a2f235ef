"""Per-rank `torch.save` state dicts of FSDP2 DTensors or FSDP1 ShardedTensors (verl's FSDP
checkpoint manager's `model_world_size_W_rank_R.pt` and `optim_world_size_W_rank_R.pt` files),
read without torch: an allow-list unpickler and the tensors as byte ranges of the rank files."""
