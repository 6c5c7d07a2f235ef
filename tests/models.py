"""Small models for engine tests, built to hit the layout's edge cases."""

from __future__ import annotations

import torch
import torch.nn as nn


class OddUnit(nn.Module):
    """A unit whose parameter count (in*out + out + 1) divides by neither 2 nor 4."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(fan_in, fan_out)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class GainUnit(nn.Module):
    """A unit of one element: at world size 4, ranks 1..3 hold only padding."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class EdgeCaseNet(nn.Module):
    """Root holds the input layer, the head (bias of 2 elements, fewer than 4 ranks) and a
    branch that only some steps use (its parameters then get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.layers = nn.ModuleList([OddUnit(7, 7), OddUnit(7, 3), GainUnit()])
        self.branch = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        if self.use_branch:
            h = h + self.branch(h)
        return self.head(h)
