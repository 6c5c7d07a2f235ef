"""Token batches that depend on the step and the seed, never on the world size.

The global batch of step s is the same at every world size; each micro-batch of it is cut
into equal row ranges, one per rank. Sources:

- `synthetic`: a seeded, learnable stream (each token mostly follows from the previous one);
- a `.bin` token file (fsdpkit/data/tokens.py), memory-mapped: a batch reads only its rows;
- a text file, tokenised by the model's tokenizer when it has one (hf:DIR), else as bytes;
- documents (jsonl, parquet, a `datasets` directory or cached Hub name: fsdpkit/data),
  tokenised the same way and packed into windows (fsdpkit/data/packing.py).

Files are split 90/10 into training and held-out tokens unless `eval_data` names the held-out
source. A token or text file's batch rows start at positions drawn from a generator seeded by
(seed, step); packed documents are taken window after window in an order seeded per epoch, so
that the loader's position is a function of the step and the seed, recorded in checkpoints.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.documents import is_document_source, open_documents
from ..data.packing import PackedCorpus, WindowOrder, end_of_text, pack_corpus
from ..data.streaming import Prefetcher, RankStream, StreamPosition, check_shards
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
        text_field: str = "text",
        eval_data: str | None = None,
        streaming: bool = False,
    ) -> None:
        self.data = data
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.train_tokens: np.ndarray | None = None
        self.held_out_tokens: np.ndarray | None = None
        self.corpus: PackedCorpus | None = None  # packed documents, taken window after window
        self.order: WindowOrder | None = None
        if data == "synthetic":
            return
        if streaming:  # the training tokens come from StreamedBatches; only the held-out ones from here
            if eval_data:
                self.held_out_tokens = self._tokens(eval_data, token_dtype, tokenizer, text_field, flag="--eval-data")
            return
        tokens = self._tokens(data, token_dtype, tokenizer, text_field)
        if len(tokens) < seq_len + 2:
            raise UsageError(f"data file {data!r} has {len(tokens)} tokens; --seq-len {seq_len} needs at least {seq_len + 2}")
        length = seq_len + 1
        if eval_data:
            split = len(tokens)
            self.held_out_tokens = self._tokens(eval_data, token_dtype, tokenizer, text_field, flag="--eval-data")
            if len(self.held_out_tokens) < length:
                raise DataCheckError(
                    f"--eval-data {eval_data!r} has {len(self.held_out_tokens)} tokens, fewer than one sequence of {length}"
                )
        else:
            split = max(length, int(len(tokens) * 0.9))
            held = tokens[split:]
            self.held_out_tokens = held if len(held) > length else tokens[-length:]
        self.train_tokens = tokens[:split]
        if self.corpus is not None:
            self.order = WindowOrder(count=max(1, split // length), length=length, seed=seed)

    def _tokens(self, data: str, token_dtype: TokenDtype, tokenizer: str | None, text_field: str, flag: str = "--data") -> np.ndarray:
        if data.endswith(".bin"):
            return open_token_file(data, TokenDtype(token_dtype))
        reader = load_tokenizer(tokenizer or "bytes")
        if reader.vocab_size > self.vocab_size:
            raise UsageError(
                f"{flag} {data!r} is tokenised by {reader.spec} ({reader.vocab_size} tokens) but the "
                f"model's vocabulary has only {self.vocab_size}"
            )
        if not is_document_source(data):
            return text_tokens(data, reader)
        corpus = pack_corpus(open_documents(data, text_field=text_field), reader, vocab_size=self.vocab_size)
        if flag == "--data":
            self.corpus = corpus
        return corpus.tokens

    def check_batch_size(self, batch_size: int) -> None:
        """Packed documents must fill at least one global batch of windows."""
        if self.order is not None and self.order.count < batch_size:
            raise DataCheckError(
                f"--data {self.data!r} packs into {self.order.count} training sequences of {self.seq_len + 1} tokens, "
                f"fewer than one global batch of {batch_size}"
            )

    def position(self, step: int, batch_size: int) -> dict | None:
        """Where the loader stands before `step` (packed documents only): the epoch, the window
        in it, and the shard, row and token offset that window starts at."""
        if self.order is None or self.corpus is None:
            return None
        k = step * batch_size
        epoch, window = self.order.window(k)
        return {
            "kind": "packed",
            "seed": self.seed,
            "epoch": epoch,
            "window": k % self.order.count,
            "windows": self.order.count,
            **self.corpus.where(window * self.order.length),
        }

    def check_position(self, step: int, batch_size: int, saved: dict | None) -> None:
        """A checkpoint's data position must be where this data puts `step`: else the data changed."""
        mine = self.position(step, batch_size)
        if saved is None or mine is None:
            return
        keys = ("epoch", "window", "windows", "shard", "row", "token")
        if any(saved.get(key) != mine[key] for key in keys):
            shown = ", ".join(f"{key} {saved.get(key)}" for key in keys)
            raise DataCheckError(
                f"the checkpoint's data position ({shown}) is not where --data {self.data!r} puts step {step} "
                f"({', '.join(f'{key} {mine[key]}' for key in keys)}): the data changed since it was saved, or --seq-len, "
                "--global-batch-size or --seed did"
            )

    def global_batch(self, step: int, batch_size: int, *, held_out: bool = False) -> torch.Tensor:
        """(batch_size, seq_len + 1) tokens for `step` (inputs are [:, :-1], targets [:, 1:])."""
        if self.order is not None and self.train_tokens is not None and not held_out:
            return torch.from_numpy(self.order.rows(self.train_tokens, step * batch_size, batch_size))
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


class StreamedBatches:
    """With --data-streaming: this rank's rows of each step's batch, read from its own shards in
    a background thread (fsdpkit/data/streaming.py). `position` is where the stream stands after
    the rows handed out so far; a run started from it continues them exactly."""

    def __init__(
        self,
        data: str,
        *,
        vocab_size: int,
        seq_len: int,
        rows: int,
        rank: int,
        world_size: int,
        tokenizer: str | None = None,
        text_field: str = "text",
        start: StreamPosition | None = None,
    ) -> None:
        reader = load_tokenizer(tokenizer or "bytes")
        documents = open_documents(data, text_field=text_field)
        eot = end_of_text(reader)
        stream = RankStream(documents, reader, eot, length=seq_len + 1, rank=rank, world_size=world_size, start=start)
        self.position = stream.position
        self.vocab_size = vocab_size
        self.data = data
        self._prefetch = Prefetcher(stream, rows)

    def next_rows(self) -> torch.Tensor:
        rows, self.position = self._prefetch.next()
        largest = int(rows.max())
        if largest >= self.vocab_size:
            raise DataCheckError(f"--data {self.data!r} holds token {largest}, outside the model's vocabulary of {self.vocab_size}")
        return torch.from_numpy(rows)

    def close(self) -> None:
        self._prefetch.close()


def streamed_position(positions: list[StreamPosition]) -> dict:
    """The data position a checkpoint keeps for a streamed run: every rank's."""
    return {"kind": "streamed", "world_size": len(positions), "ranks": [p.to_json() for p in positions]}


def rank_start(saved: dict | None, rank: int, world_size: int) -> StreamPosition | None:
    """This rank's stream position from a checkpoint's data position (None: from the start)."""
    if not saved:
        return None
    if saved.get("kind") != "streamed":
        raise UsageError("--data-streaming cannot resume a checkpoint whose data was not streamed (drop --data-streaming)")
    if saved.get("world_size") != world_size:
        raise UsageError(
            f"--data-streaming resumes at the world size it was saved at ({saved.get('world_size')} ranks, not {world_size}): "
            "each rank streams its own shards"
        )
    return StreamPosition.from_json(saved["ranks"][rank])


def check_streamed(
    data: str, *, text_field: str, world_size: int, seq_len: int, global_batch_size: int, tokenizer: str | None = None
) -> None:
    """Before launch, reading only the first step's documents of each rank: documents with the
    text field, a shard per rank, and for every rank enough tokens for its rows of one global batch."""
    if not is_document_source(data):
        raise UsageError(f"--data-streaming reads documents (jsonl, parquet, datasets); {data!r} is not one")
    documents = open_documents(data, text_field=text_field)
    check_shards(documents, world_size)
    reader = load_tokenizer(tokenizer or "bytes")
    rows = global_batch_size // world_size
    for rank in range(world_size):
        stream = RankStream(documents, reader, end_of_text(reader), length=seq_len + 1, rank=rank, world_size=world_size)
        _, after = stream.next_rows(rows)
        if after.epoch > 0:
            names = ", ".join(documents.shards[index].name for index in stream.shards)
            raise DataCheckError(
                f"--data {data!r}: the shards of rank {rank} ({names}) hold fewer than its {rows} sequences of "
                f"{seq_len + 1} tokens of one global batch of {global_batch_size} (--data-streaming: each rank reads its own shards)"
            )
