"""A Llama-style decoder (RMSNorm, rotary attention without biases, SwiGLU MLP, untied
head): a transformer that is not fsdpkit's built-in GPT, for the engine benchmarks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py --model llama-small
    fsdpkit train --model benchmarks.llama_style:llama_small   # any package.module:factory works too
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaStyleConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 4
    dim: int = 256
    hidden: int = 704  # SwiGLU width: about 8/3 of dim, a multiple of 64
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_head or (self.dim // self.n_head) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.n_head} heads of even size")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaStyleConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (
            proj(x).view(batch, seq, self.n_head, dim // self.n_head).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaStyleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaStyleConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaStyle(nn.Module):
    def __init__(self, config: LlamaStyleConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        head_dim = config.dim // config.n_head
        inverse = 1.0 / config.rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inverse)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block size {self.config.block_size}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def llama_small() -> LlamaStyle:
    """6 blocks, dim 256, 4 heads, SwiGLU 704: about 4.9M parameters."""
    return LlamaStyle(LlamaStyleConfig())
