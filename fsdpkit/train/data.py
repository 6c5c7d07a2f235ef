"""Token batches that depend on the step and the seed, never on the world size.

The global batch of step s is the same at every world size; each micro-batch of it is cut
into equal row ranges, one per rank. `synthetic` is a seeded, learnable stream (each token
mostly follows from the previous one); a file path is read as bytes (tokens 0..255) and
split 90/10 into training and held-out data.
"""

from __future__ import annotations

import os

import torch

from ..errors import UsageError

HELD_OUT_SEED_OFFSET = 1_000_003


class TokenSource:
    def __init__(self, data: str, *, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.train_tokens: torch.Tensor | None = None
        self.held_out_tokens: torch.Tensor | None = None
        if data != "synthetic":
            tokens = read_byte_tokens(data, seq_len=seq_len, vocab_size=vocab_size)
            split = max(seq_len + 1, int(len(tokens) * 0.9))
            self.train_tokens = tokens[:split]
            held = tokens[split:]
            self.held_out_tokens = held if len(held) > seq_len + 1 else tokens[-(seq_len + 1):]

    def global_batch(self, step: int, batch_size: int, *, held_out: bool = False) -> torch.Tensor:
        """(batch_size, seq_len + 1) tokens for `step` (inputs are [:, :-1], targets [:, 1:])."""
        generator = torch.Generator().manual_seed(self.seed * 7919 + step + (HELD_OUT_SEED_OFFSET if held_out else 0))
        source = self.held_out_tokens if held_out else self.train_tokens
        if source is None:
            return self._synthetic(generator, batch_size)
        starts = torch.randint(0, len(source) - self.seq_len, (batch_size,), generator=generator)
        return torch.stack([source[s:s + self.seq_len + 1] for s in starts.tolist()])

    def _synthetic(self, generator: torch.Generator, batch_size: int) -> torch.Tensor:
        length = self.seq_len + 1
        tokens = torch.empty(batch_size, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
        noise = torch.randint(0, self.vocab_size, (batch_size, length), generator=generator)
        keep = torch.rand(batch_size, length, generator=generator) < 0.9
        for position in range(1, length):
            follow = (tokens[:, position - 1] * 5 + 3) % self.vocab_size
            tokens[:, position] = torch.where(keep[:, position], follow, noise[:, position])
        return tokens


def read_byte_tokens(path: str, *, seq_len: int, vocab_size: int) -> torch.Tensor:
    if vocab_size < 256:
        raise UsageError(f"--data {path!r} is read as bytes (256 tokens) but the model's vocabulary has only {vocab_size}")
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise UsageError(f"cannot read data file {path!r}: {error.strerror or error}") from None
    if os.path.isdir(path):
        raise UsageError(f"data path {path!r} is a directory, not a text file")
    if len(raw) < seq_len + 2:
        raise UsageError(f"data file {path!r} has {len(raw)} bytes; --seq-len {seq_len} needs at least {seq_len + 2}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def local_rows(micro_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = micro_batch.shape[0] // world_size
    return micro_batch[rank * rows:(rank + 1) * rows]
