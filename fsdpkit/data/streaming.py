"""Streamed documents (no torch, no process group): each rank reads only its own shards, one
document at a time, and packs them into windows ahead of the step, in a background thread.

    stream = RankStream(documents, tokenizer, eot, length=seq_len + 1, rank=r, world_size=w)
    rows, position = stream.next_rows(count)

Rank r reads shards r, r + w, r + 2w, ... (in the documents' shard order), packs their
documents (each followed by the end-of-text token) into consecutive windows of `length`
tokens, and starts over (the next epoch) after its last shard. Memory holds one shard's
current read (a parquet row group, a jsonl line) and a few batches of windows, whatever the
dataset's size.

Position: (epoch, shard, row, token) of the next token the rank has not handed out; a stream
started from a position hands out exactly the windows the original would have next. What the
global batch is depends on the world size (which rank reads which shard); at one world size it
is the same run after run, and a resume continues it exactly.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import DataCheckError, UsageError
from .documents import Documents
from .packing import encode_document
from .tokens import ByteTokenizer, HfTokenizer

PREFETCH_BATCHES = 2


@dataclass(frozen=True)
class StreamPosition:
    epoch: int = 0
    shard: int = 0  # index into the documents' shards
    row: int = 0
    token: int = 0  # tokens of that row (its end-of-text token included) already handed out

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> StreamPosition:
        return cls(**{key: int(value.get(key, 0)) for key in ("epoch", "shard", "row", "token")})


def rank_shards(count: int, rank: int, world_size: int) -> list[int]:
    return list(range(rank, count, world_size))


def check_shards(documents: Documents, world_size: int) -> None:
    if len(documents.shards) < world_size:
        raise UsageError(
            f"--data-streaming reads whole shards per rank: --data {documents.spec!r} has {len(documents.shards)} "
            f"shard(s), fewer than the {world_size} ranks (split it into at least {world_size} files, or drop --data-streaming)"
        )


class RankStream:
    def __init__(
        self,
        documents: Documents,
        tokenizer: ByteTokenizer | HfTokenizer,
        eot: int,
        *,
        length: int,
        rank: int,
        world_size: int,
        start: StreamPosition | None = None,
    ) -> None:
        check_shards(documents, world_size)
        self.documents = documents
        self.tokenizer = tokenizer
        self.eot = eot
        self.length = length
        self.rank = rank
        self.shards = rank_shards(len(documents.shards), rank, world_size)
        self.position = start or StreamPosition(shard=self.shards[0])
        if self.position.shard not in self.shards:
            raise UsageError(f"stream position shard {self.position.shard} is not one of rank {rank}'s shards {self.shards}")
        self._documents = self._from(self.position)
        self._doc: tuple[StreamPosition, np.ndarray] | None = None  # the document being handed out
        self._offset = self.position.token

    def _from(self, start: StreamPosition) -> Iterator[tuple[StreamPosition, np.ndarray]]:
        """(position of the document, its tokens) from `start` on, epoch after epoch."""
        epoch, shard, row = start.epoch, start.shard, start.row
        while True:
            found = False
            for index in self.shards[self.shards.index(shard) :]:
                first = row if index == shard else 0
                for number, text in enumerate(self.documents.shards[index].texts(first), start=first):
                    found = True
                    yield StreamPosition(epoch, index, number, 0), encode_document(self.tokenizer, text, self.eot)
            if not found and (shard, row) == (self.shards[0], 0):
                names = ", ".join(self.documents.shards[index].name for index in self.shards)
                raise DataCheckError(f"--data {self.documents.spec!r}: the shards of rank {self.rank} ({names}) hold no documents")
            epoch, shard, row = epoch + 1, self.shards[0], 0

    def next_rows(self, count: int) -> tuple[np.ndarray, StreamPosition]:
        """The next `count` windows, (count, length) int64, and the position after them."""
        rows = np.empty((count, self.length), dtype=np.int64)
        for index in range(count):
            filled = 0
            while filled < self.length:
                if self._doc is None:
                    where, tokens = next(self._documents)
                    if (where.epoch, where.shard, where.row) != (self.position.epoch, self.position.shard, self.position.row):
                        self._offset = 0  # a saved row past the shard's end: the next one starts whole
                    self._doc = (where, tokens)
                tokens = self._doc[1]
                take = tokens[self._offset : self._offset + self.length - filled]
                rows[index, filled : filled + len(take)] = take
                filled += len(take)
                self._offset += len(take)
                where = self._doc[0]
                if self._offset < len(tokens):
                    self.position = StreamPosition(where.epoch, where.shard, where.row, self._offset)
                else:
                    self.position = StreamPosition(where.epoch, where.shard, where.row + 1, 0)
                    self._doc, self._offset = None, 0
        return rows, self.position


class Prefetcher:
    """RankStream.next_rows(count) run ahead in a daemon thread, `depth` results at most."""

    def __init__(self, stream: RankStream, count: int, depth: int = PREFETCH_BATCHES) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(stream, count), name="fsdpkit-data", daemon=True)
        self._thread.start()

    def _fill(self, stream: RankStream, count: int) -> None:
        while not self._stop.is_set():
            try:
                item: object = stream.next_rows(count)
            except BaseException as error:  # handed to the training thread, raised there
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next(self) -> tuple[np.ndarray, StreamPosition]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
