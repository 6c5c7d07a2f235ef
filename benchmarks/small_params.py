"""A transformer with many small parameters, for the engine benchmarks: LayerNorm weights
and biases, a bias on every Linear, a learned scalar gate per residual branch, a separate
learned position embedding and an untied head with a bias. Of its parameter tensors most
hold a few hundred elements or fewer: what a per-parameter engine pays for, and what
bucketing small units is for.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py --model small-params
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class SmallParamsConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 8
    n_head: int = 4
    dim: int = 192


class GatedBlock(nn.Module):
    def __init__(self, config: SmallParamsConfig) -> None:
        super().__init__()
        dim = config.dim
        self.n_head = config.n_head
        self.attn_norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.head_scale = nn.Parameter(torch.ones(config.n_head))
        self.attn_gate = nn.Parameter(torch.ones(1))
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.mlp_gate = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(batch, seq, self.n_head, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) * self.head_scale.view(1, -1, 1, 1)
        x = x + self.attn_gate * self.o(y.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp_gate * self.down(F.gelu(self.up(self.mlp_norm(x))))


class SmallParams(nn.Module):
    def __init__(self, config: SmallParamsConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.tok_embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embed = nn.Embedding(config.block_size, config.dim)
        self.blocks = nn.ModuleList(GatedBlock(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_embed(idx) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def small_params() -> SmallParams:
    return SmallParams(SmallParamsConfig())


def small_units() -> SmallParams:
    """16 narrow blocks of about 200 KB each: units small enough for bucketing to matter."""
    return SmallParams(SmallParamsConfig(n_layer=16, dim=64))
