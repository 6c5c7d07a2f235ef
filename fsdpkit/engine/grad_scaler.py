"""Loss scaling for fp16 over sharded gradients: an inf or nan on any rank skips the step
on every rank (a local scaler would let ranks diverge)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .sharded import get_state


class ShardedGradScaler:
    def __init__(
        self,
        module: nn.Module,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                f"invalid grad scaler settings: init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}"
            )
        self.state = get_state(module)
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.last_step_skipped = False
        self.unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the sharded gradients by the scale (once per step; step() does it if needed)."""
        if self.unscaled:
            return
        for unit in self.state.units:
            for param in unit.params:
                if param.grad is not None:
                    param.grad.mul_(1.0 / self.scale_value)
        self.unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless any rank found inf/nan in its gradients. True if the optimizer stepped."""
        self.unscale_(optimizer)
        found = torch.tensor([0.0], device=self.state.device)
        for unit in self.state.units:
            for param in unit.params:
                if param.grad is not None and param.grad.numel() and not torch.isfinite(param.grad).all():
                    found.fill_(1.0)
        if self.state.mesh.world_size > 1:
            self.state.comms.all_reduce(found, self.state.mesh.group, op=dist.ReduceOp.MAX, label="grad_scaler")
        self.last_step_skipped = bool(found.item())
        if not self.last_step_skipped:
            optimizer.step()
        self.unscaled = False
        return not self.last_step_skipped

    def update(self) -> None:
        if self.last_step_skipped:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale_value *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.good_steps = int(state["good_steps"])
