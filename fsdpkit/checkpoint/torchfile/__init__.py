"""torch's zip and pickle formats read and written without torch: what DCP, DeepSpeed and
per-rank `torch.save` checkpoints share."""
