"""A decoder-only GPT in the GPT-2 shape, small enough to read in ten minutes.

    fsdpkit train --model gpt-tiny --nproc-per-node 2

Each `Block` is one FSDP unit under the default wrap policy; the root keeps the embeddings,
the final norm and the output head, whose weight is tied to the token embedding.

The output head computes on its weight padded with zero rows to a multiple of 64 (GPT-2's
50,257 -> 50,304: aligned shapes for the three matmuls) and returns only the vocabulary's
logits, so a padded row is never predicted and the loss is the unpadded model's. The padding
exists only inside the forward: the parameters, checkpoints and exports hold 50,257 rows.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.model_hooks import ModelHooks
from .gpt_config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, seq, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.init_seed = torch.initial_seed()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                self.init_parameter(name, param)

    def fsdpkit_hooks(self) -> ModelHooks:
        return ModelHooks(init_parameter=self.init_parameter)

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        """GPT-2 initialisation of one parameter, from a generator seeded by the model seed
        and the parameter's name: the same values eagerly, on the meta device then
        materialised unit by unit (fsdpkit.shard), or in any order."""
        if param.is_meta:
            return  # nothing to draw: fsdpkit.shard calls this again once the tensor is real
        if name.endswith("bias"):
            nn.init.zeros_(param)
            return
        if name.startswith("ln") or ".ln_" in name:
            nn.init.ones_(param)
            return
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
        generator = torch.Generator(device=param.device).manual_seed((self.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        nn.init.normal_(param, mean=0.0, std=std, generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, seq = idx.shape
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds the model's block size {self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.output_logits(self.ln_f(x))

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head.weight
        padding = self.config.padded_vocab_size - weight.shape[0]
        if padding:
            weight = F.pad(weight, (0, 0, 0, padding))
        return F.linear(x, weight)[..., : self.config.vocab_size]
