"""The shape of the built-in GPT (models/gpt.py), without torch: the model names and the flags
that take them are known before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_MULTIPLE = 64  # the output head's matmuls run on a vocabulary padded to this multiple


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def padded_vocab_size(self) -> int:
        """GPT-2's 50,257 -> 50,304: the output head's rows as its matmuls see them."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
