"""An object of a storage read at offsets as a file descriptor is (`pread`), for the readers
that parse headers, zip directories and pickles at scattered offsets (DCP's chunks): each read
is a ranged GET through the face, and aligned blocks of BLOCK_BYTES around small reads are
kept (at most KEPT_BLOCKS), since such parsers read many small pieces close together. The
handles of one listed checkpoint (`StoredPath`) share their kept blocks (`BlockCache`), so the
headers that detection, opening and reading each parse are fetched once.

The byte engine reads tensor bytes through `window` instead: one streamed GET per run of bytes
it reads (the face's `read_blocks`: requests in offset order, a few blocks read ahead, bounded
memory) that ends where the read ends, so each byte is fetched once whatever order the runs are
read in; a run the kept blocks hold whole (a small file's) is served from them, no GET. A run
that starts where the last GET ended (a ZeRO-3 rank file's partitions read tensor by tensor, in
file order) continues it: its GET asks for twice the last one's bytes (CONTINUED_MIN_BYTES at least), up to CONTINUED_BYTES
more than the run needs, so a file read front to back in many runs takes a few GETs, not one
per run (each a round trip on a real store, and a copy of the whole object on moto's server);
what a stream has not handed over when it is closed is never read.

A reader that knows which bytes it will want next, in another order than the file's (the full
output's tensors in name order from ZeRO-3 partitions in module order), fetches them first with
`read_ahead`: runs of bytes in offset order through the same stream, held in memory until the
next `read_ahead` or `drop_ahead`; `window` and `pread` serve reads inside them."""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter

from ...errors import DataCheckError
from .face import Storage

BLOCK_BYTES = 256 << 10
KEPT_BLOCKS = 16  # at most 4 MiB held per object
STREAM_BLOCK_BYTES = 1 << 20  # a block of a window's stream
CONTINUED_BYTES = 64 << 20  # at most this much past a run's end is asked for by a GET that continues the last one
CONTINUED_MIN_BYTES = 8 << 20  # and at least this much from where it starts
PREFETCH_GETS = 8  # blocks `prefetch` fetches at once


class BlockCache:
    """Blocks of objects by (name, index), the `limit` used last kept; of them, those fetched
    ahead (`reserve`) and not yet read at most half, whichever handles fetched them, so that
    handles fetching ahead at once do not push out each other's blocks before they are read."""

    def __init__(self, limit: int = KEPT_BLOCKS):
        self.limit, self._lock = limit, threading.Lock()
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._unread: set[tuple[str, int]] = set()

    def get(self, key: tuple[str, int]) -> bytes | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
                self._unread.discard(key)
            return block

    def put(self, key: tuple[str, int], block: bytes) -> None:
        with self._lock:
            self._blocks[key] = block
            if len(self._blocks) > self.limit:
                self._unread.discard(self._blocks.popitem(last=False)[0])

    def reserve(self, keys: list[tuple[str, int]]) -> bool:
        """Whether `keys` may be fetched ahead (then counted as unread until got or pushed out)."""
        with self._lock:
            if len(self._unread) + len(keys) > self.limit // 2:
                return False
            self._unread.update(keys)
            return True


class ObjectHandle:
    def __init__(self, storage: Storage, name: str, size: int, blocks: BlockCache | None = None):
        """`blocks`: the kept blocks, shared with other handles; this handle's own without."""
        self.storage, self.name, self.size = storage, name, size
        self._blocks = blocks if blocks is not None else BlockCache()
        self._stream: Iterator[tuple[int, memoryview]] | None = None  # the GET windows are read from
        self._held, self._held_start, self._streamed = bytearray(), 0, 0  # bytes [held_start, streamed) of it
        self._stream_start = self._stream_end = 0  # where the stream's GET starts and ends
        self._ahead: list[tuple[int, bytearray]] = []  # (offset, bytes) of the runs read ahead, in offset order

    def pread(self, count: int, offset: int) -> bytes:
        """Bytes [offset, offset + count), fewer only where the object ends."""
        end = min(offset + count, self.size)
        if end <= offset:
            return b""
        ahead = self._read_ahead(offset, end)
        if ahead is not None:
            return bytes(ahead[: end - offset])
        if end - offset > BLOCK_BYTES:
            return self.storage.read(self.name, offset, end)
        first, last = offset // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        data = b"".join(self._block(index) for index in range(first, last + 1))
        return data[offset - first * BLOCK_BYTES : end - first * BLOCK_BYTES]

    def prefetch(self, offsets: list[int], nbytes: int) -> None:
        """Keep the blocks that hold bytes [offset, offset + nbytes) of each of `offsets` (a zip's
        local headers), fetched at once, PREFETCH_GETS requests in flight, so that the small
        reads that follow take no request each; nothing where the kept blocks have no room for
        them beside those other handles fetched ahead (`BlockCache.reserve`)."""
        last = self.size - 1
        inside = [offset for offset in offsets if 0 <= offset <= last]  # a corrupt zip's others are its reader's to name
        wanted = {index for offset in inside for index in (offset // BLOCK_BYTES, min(offset + nbytes, last) // BLOCK_BYTES)}
        missing = [index for index in sorted(wanted) if self._blocks.get((self.name, index)) is None]
        if len(missing) < 2 or not self._blocks.reserve([(self.name, index) for index in missing]):
            return
        with ThreadPoolExecutor(min(PREFETCH_GETS, len(missing)), thread_name_prefix="fsdpkit-prefetch") as pool:
            for _ in pool.map(self._block, missing):
                pass

    def window(self, offset: int, length: int, until: int) -> bytes | memoryview:
        """Bytes [offset, offset + length) of a read that ends at `until` (fewer where the GET
        or a run read ahead ends): from the runs read ahead or the kept blocks when they hold it,
        from the stream the windows before it came from when it continues them, else from a new
        streamed GET from `offset` to `until`."""
        ahead = self._read_ahead(offset, offset + 1)
        if ahead is not None:
            return ahead[: min(length, until - offset)]
        kept = self._kept(offset, min(offset + length, until, self.size))
        if kept is not None:
            return kept
        if self._stream is None or not self._held_start <= offset <= self._streamed or offset >= self._stream_end:
            self._stream_end = self._get_end(offset, until)
            self._end_stream()
            self._stream_start = offset
            self._stream = self.storage.read_blocks(self.name, [(offset, self._stream_end)], block_bytes=STREAM_BLOCK_BYTES)
            self._held_start = self._streamed = offset
        end = min(offset + length, self._stream_end)
        while self._streamed < end:
            _, block = next(self._stream)
            self._held += block
            self._streamed += len(block)
        del self._held[: offset - self._held_start]  # windows move forward: what is before this one is done
        self._held_start = offset
        return bytes(self._held[: end - offset])

    def read_ahead(self, runs: list[tuple[int, int]]) -> None:
        """Fetch byte runs [start, end) (sorted, disjoint) into memory, dropping those of the last
        call: the stream continues from one run to the next where it can (see the docstrings)."""
        self._ahead = []
        fetched = []
        for start, end in runs:
            data, at = bytearray(end - start), start
            while at < end:
                window = self.window(at, min(end - at, STREAM_BLOCK_BYTES), end)
                if not window:
                    raise DataCheckError(f"{self.storage.where(self.name)}: object ends at byte {at}, before byte {end} (truncated)")
                data[at - start : at - start + len(window)] = window
                at += len(window)
            fetched.append((start, data))
        self._ahead = fetched

    def drop_ahead(self) -> None:
        self._ahead = []

    def _read_ahead(self, start: int, end: int) -> memoryview | None:
        """Bytes [start, run's end) of the run read ahead that holds bytes [start, end), else None."""
        index = bisect_right(self._ahead, start, key=itemgetter(0)) - 1
        if index < 0:
            return None
        offset, data = self._ahead[index]
        if end > offset + len(data):
            return None
        return memoryview(data)[start - offset :]

    def _get_end(self, offset: int, until: int) -> int:
        """Where a new GET from `offset` for a run that ends at `until` ends: further on when the
        run continues the last GET (see the module's docstring)."""
        end = max(until, offset + 1)
        if self._stream is not None and offset == self._stream_end:
            extra = max(2 * (self._stream_end - self._stream_start), CONTINUED_MIN_BYTES)
            end = max(end, min(offset + extra, end + CONTINUED_BYTES))
        return min(end, self.size)

    def _kept(self, start: int, end: int) -> bytes | None:
        """Bytes [start, end) when the kept blocks hold them all, else None."""
        first, last = start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        if end <= start:
            return None
        blocks = [self._blocks.get((self.name, index)) for index in range(first, last + 1)]
        found = [block for block in blocks if block is not None]
        if len(found) < len(blocks):
            return None
        return b"".join(found)[start - first * BLOCK_BYTES : end - first * BLOCK_BYTES]

    def close(self) -> None:
        """End the stream of windows (its GET and read-ahead) and drop the runs read ahead."""
        self._end_stream()
        self._ahead = []

    def _end_stream(self) -> None:
        stream, self._stream = self._stream, None
        end = getattr(stream, "close", None)  # a generator's: its finally stops the GETs in flight
        if end is not None:
            end()
        self._held = bytearray()

    def _block(self, index: int) -> bytes:
        block = self._blocks.get((self.name, index))
        if block is None:
            start = index * BLOCK_BYTES
            block = self.storage.read(self.name, start, min(start + BLOCK_BYTES, self.size))
            self._blocks.put((self.name, index), block)
        return block


def open_handle(storage: Storage, name: str) -> tuple[ObjectHandle, int]:
    """(handle, size) of object `name`; a DataCheckError when there is none."""
    size = storage.size(name)
    if size is None:
        raise DataCheckError(f"{storage.where(name)}: file is missing")
    return ObjectHandle(storage, name, size), size
