"""Gradient clipping over sharded gradients: the true global norm."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .sharded import get_state


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a sharded module in place; return the total norm before clipping.

    The norm is taken over the shards of one replica (summed across the shard group; never
    across hybrid replicas, which hold the same chunk), padding excluded since only
    parameter fragments are counted. Every rank must call it.
    """
    state = get_state(module)
    grads = [p.grad for unit in state.units for p in unit.params if p.grad is not None]
    host = state.units[0].host if state.units else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().float() for g in grads if g.numel()), default=torch.tensor(0.0))
        total = torch.as_tensor(local, dtype=torch.float32, device=state.device).clone()
        if state.mesh.shard_group is not None:
            state.comms.all_reduce(total, state.mesh.shard_group, op=dist.ReduceOp.MAX, label="clip_grad_norm")
    else:
        local = sum((g.detach().float().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0))
        total = torch.as_tensor(local, dtype=torch.float32, device=state.device).clone()
        if state.mesh.shard_group is not None:
            state.comms.all_reduce(total, state.mesh.shard_group, label="clip_grad_norm")
        total = total.pow(1.0 / norm_type)
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0).to(host)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return total
