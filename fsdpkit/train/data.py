"""Token batches that depend on the step and the seed, never on the world size.

The global batch of step s is the same at every world size; each micro-batch of it is cut
into equal row ranges, one per rank. Sources:

- `synthetic`: a seeded, learnable stream (each token mostly follows from the previous one);
- a `.bin` token file (fsdpkit/data/tokens.py), memory-mapped: a batch reads only its rows;
- a text file, tokenised by the model's tokenizer when it has one (hf:DIR), else as bytes.

Files are split 90/10 into training and held-out tokens; a batch's rows start at positions
drawn from a generator seeded by (seed, step).
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.tokens import TokenDtype, load_tokenizer, open_token_file, text_tokens
from ..errors import DataCheckError, UsageError

HELD_OUT_SEED_OFFSET = 1_000_003


class TokenSource:
    def __init__(
        self,
        data: str,
        *,
        vocab_size: int,
        seq_len: int,
        seed: int,
        token_dtype: TokenDtype = TokenDtype.UINT16,
        tokenizer: str | None = None,
    ) -> None:
        self.data = data
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.train_tokens: np.ndarray | None = None
        self.held_out_tokens: np.ndarray | None = None
        if data == "synthetic":
            return
        if data.endswith(".bin"):
            tokens = open_token_file(data, TokenDtype(token_dtype))
        else:
            reader = load_tokenizer(tokenizer or "bytes")
            if reader.vocab_size > vocab_size:
                raise UsageError(
                    f"--data {data!r} is tokenised by {reader.spec} ({reader.vocab_size} tokens) but the "
                    f"model's vocabulary has only {vocab_size}"
                )
            tokens = text_tokens(data, reader)
        if len(tokens) < seq_len + 2:
            raise UsageError(f"data file {data!r} has {len(tokens)} tokens; --seq-len {seq_len} needs at least {seq_len + 2}")
        split = max(seq_len + 1, int(len(tokens) * 0.9))
        self.train_tokens = tokens[:split]
        held = tokens[split:]
        self.held_out_tokens = held if len(held) > seq_len + 1 else tokens[-(seq_len + 1) :]

    def global_batch(self, step: int, batch_size: int, *, held_out: bool = False) -> torch.Tensor:
        """(batch_size, seq_len + 1) tokens for `step` (inputs are [:, :-1], targets [:, 1:])."""
        generator = torch.Generator().manual_seed(self.seed * 7919 + step + (HELD_OUT_SEED_OFFSET if held_out else 0))
        source = self.held_out_tokens if held_out else self.train_tokens
        if source is None:
            return self._synthetic(generator, batch_size)
        starts = torch.randint(0, len(source) - self.seq_len, (batch_size,), generator=generator)
        rows = torch.from_numpy(np.stack([source[s : s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64))
        largest = int(rows.max())
        if largest >= self.vocab_size:
            raise DataCheckError(
                f"--data {self.data!r} holds token {largest}, outside the model's vocabulary of "
                f"{self.vocab_size} (another tokenizer, or another --token-dtype?)"
            )
        return rows

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


def local_rows(micro_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = micro_batch.shape[0] // world_size
    return micro_batch[rank * rows : (rank + 1) * rows]
