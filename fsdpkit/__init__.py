"""fsdpkit: Fully Sharded Data Parallel training as the PyTorch FSDP paper describes it."""

__version__ = "0.1.0"
