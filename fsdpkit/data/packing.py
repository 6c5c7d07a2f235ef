"""Documents packed into windows of tokens (numpy only, no torch, no process group).

Each document is tokenised (the model's tokenizer, or its UTF-8 bytes) and followed by one
end-of-text token; the documents, in shard and row order, make one stream of tokens cut into
windows of `seq_len + 1` tokens (inputs are a window's first `seq_len`, targets its last).
A document may start in one window and end in the next, and a window may hold several:
attention and the loss run across the end-of-text token as across any other (no mask at
document boundaries): the model learns to predict the end-of-text token, and the first token of
the next document from it.

The end-of-text token: the tokenizer's own (`eos_token_id`) for `hf:` tokenizers; for bytes,
255, a byte that never occurs in UTF-8 text (and the id an exported 256-token built-in GPT
names as its end of sequence).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DataCheckError, UsageError
from .documents import Documents
from .tokens import ByteTokenizer, HfTokenizer

BYTES_END_OF_TEXT = 0xFF


def end_of_text(tokenizer: ByteTokenizer | HfTokenizer) -> int:
    if isinstance(tokenizer, ByteTokenizer):
        return BYTES_END_OF_TEXT
    token = tokenizer.eos_token_id
    if token is None:
        raise UsageError(f"tokenizer {tokenizer.spec!r} has no end-of-text (eos) token to put between documents")
    return int(token)


def encode_document(tokenizer: ByteTokenizer | HfTokenizer, text: str, eot: int) -> np.ndarray:
    """A document's tokens followed by the end-of-text token (int64)."""
    ids = np.asarray(tokenizer.encode(text.encode("utf-8")), dtype=np.int64)
    return np.append(ids, np.int64(eot))


def shard_documents(documents: Documents, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, int, str]]:
    """(shard index, row, text) from (shard, row) `start` on, to the end of the last shard."""
    first_shard, first_row = start
    for index in range(first_shard, len(documents.shards)):
        shard = documents.shards[index]
        for row, text in enumerate(shard.texts(first_row if index == first_shard else 0), start=first_row if index == first_shard else 0):
            yield index, row, text


@dataclass(frozen=True)
class PackedCorpus:
    """Every document's tokens in one array, with where each document starts and comes from."""

    documents: Documents
    tokens: np.ndarray  # int32 or int64
    starts: np.ndarray  # token index at which each document starts
    shard: np.ndarray  # each document's shard index
    row: np.ndarray  # each document's row in its shard

    def where(self, token: int) -> dict[str, Any]:
        """The shard, row and token offset within that row of token index `token`."""
        doc = int(np.searchsorted(self.starts, token, side="right")) - 1
        shard = int(self.shard[doc])
        return {
            "shard": shard,
            "shard_name": self.documents.shards[shard].name,
            "row": int(self.row[doc]),
            "token": int(token - self.starts[doc]),
        }


def pack_corpus(
    documents: Documents,
    tokenizer: ByteTokenizer | HfTokenizer,
    *,
    vocab_size: int,
    progress: Callable[[int], None] | None = None,
) -> PackedCorpus:
    """Tokenise every document into memory; `progress(n)` after each n documents."""
    eot = end_of_text(tokenizer)
    pieces: list[np.ndarray] = []
    shards: list[int] = []
    rows: list[int] = []
    for shard, row, text in shard_documents(documents):
        pieces.append(encode_document(tokenizer, text, eot))
        shards.append(shard)
        rows.append(row)
        if progress is not None and len(pieces) % 1000 == 0:
            progress(1000)
    if not pieces:
        raise DataCheckError(f"--data {documents.spec!r} holds no documents")
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.concatenate(pieces)
    largest = int(tokens.max())
    if largest >= vocab_size:
        raise UsageError(
            f"--data {documents.spec!r} is tokenised by {tokenizer.spec} into ids up to {largest}, outside the vocabulary of {vocab_size}"
        )
    tokens = tokens.astype(np.int32 if largest < 2**31 else np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return PackedCorpus(documents, tokens, starts, np.asarray(shards, dtype=np.int32), np.asarray(rows, dtype=np.int64))


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(count)


@dataclass(frozen=True)
class WindowOrder:
    """Consecutive windows of `length` tokens over `tokens`, taken in a seeded order that is new
    every epoch: global window k is window order(epoch)[k % count] of epoch k // count."""

    count: int
    length: int
    seed: int

    def window(self, k: int) -> tuple[int, int]:
        """(epoch, window index) of the k-th window the run takes."""
        epoch, within = divmod(k, self.count)
        return epoch, int(_epoch_order(self.seed, epoch, self.count)[within])

    def rows(self, tokens: np.ndarray, first: int, size: int) -> np.ndarray:
        """Windows first .. first + size - 1 as a (size, length) int64 array."""
        picks = [self.window(k)[1] * self.length for k in range(first, first + size)]
        return np.stack([tokens[p : p + self.length] for p in picks]).astype(np.int64)
