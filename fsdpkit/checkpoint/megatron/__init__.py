"""Megatron-Core `torch_dist` and NeMo 2 checkpoints read and written without Megatron (docs/megatron.md)."""
