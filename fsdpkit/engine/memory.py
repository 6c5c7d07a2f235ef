"""Bytes the engine holds, counted as it allocates and frees them (one counter per sharded
model): sharded parameters and gradients, unsharded parameters and gradients in flight, and
the peak of their sum. Optimizer state is read from the optimizer when asked."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MemoryCounter:
    sharded_params: int = 0
    sharded_grads: int = 0
    unsharded_params: int = 0
    unsharded_grads: int = 0
    peak_unsharded: int = 0
    peak_total: int = 0

    def add(self, field: str, num_bytes: int) -> None:
        setattr(self, field, getattr(self, field) + num_bytes)
        unsharded = self.unsharded_params + self.unsharded_grads
        self.peak_unsharded = max(self.peak_unsharded, unsharded)
        self.peak_total = max(self.peak_total, unsharded + self.sharded_params + self.sharded_grads)

    def reset_peaks(self) -> None:
        self.peak_unsharded = self.unsharded_params + self.unsharded_grads
        self.peak_total = self.peak_unsharded + self.sharded_params + self.sharded_grads


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor))
