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


class ZooBlock(nn.Module):
    """What the built-in GPT lacks, in one unit: RMSNorm (the weight used elementwise), a
    scalar (0-d) gate, a float buffer, and a keyword argument. Its own parameter is reset at
    the end of __init__, after its children, as torch's modules do. `scalar=False` makes
    the gate 1-D (one element) for torch's FSDP2, which refuses 0-d parameters."""

    def __init__(self, dim: int, *, buffer: bool = True, scalar: bool = True) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.empty(() if scalar else (1,)))
        if buffer:
            self.register_buffer("scale", torch.full((dim,), 0.5))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gate, 0.5, 1.5)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x if shift is None else x + shift)
        if hasattr(self, "scale"):
            h = h * self.scale
        return x + self.gate * torch.tanh(self.proj(h))


class FrozenAdapter(nn.Module):
    """A unit whose parameters are all frozen; ZooNet calls it twice in one forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class ZooNet(nn.Module):
    """Embedding tied to a head in another unit (`out`), ZooBlocks, optionally a frozen
    adapter used twice. Initialised only through the modules' reset_parameters(). `keyword`:
    the blocks get an fp32 tensor as a keyword argument."""

    def __init__(
        self,
        vocab: int = 23,
        dim: int = 12,
        layers: int = 2,
        *,
        buffers: bool = True,
        adapter: bool = False,
        scalar_gates: bool = True,
        keyword: bool = True,
    ) -> None:
        super().__init__()
        self.keyword = keyword
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([ZooBlock(dim, buffer=buffers, scalar=scalar_gates) for _ in range(layers)])
        self.adapter = FrozenAdapter(dim) if adapter else None
        self.out = nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False))
        self.out[1].weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        shift = torch.full(h.shape, 0.01) if self.keyword else None  # fp32 whatever the compute dtype
        for index, block in enumerate(self.blocks):
            h = block(h, shift=shift)
            if index == 0 and self.adapter is not None:
                h = self.adapter(self.adapter(h))
        return self.out(h)


def zoo_units(name: str, module: nn.Module) -> bool:
    """ZooNet's wrap policy: each block, the adapter and the output stack."""
    return isinstance(module, (ZooBlock, FrozenAdapter)) or name == "out"
