"""The storage face over an object store (S3, GCS, Azure) through obstore, Rust's object_store:
requests run outside the GIL, several in flight. Reads are streamed GETs of segments of
SEGMENT_BYTES, the next requested while one is read, issued in offset order, each read ahead
a few blocks (bounded memory, each byte fetched once, one request per segment; a stream cut
midway obstore resumes where it stopped); writes are multipart uploads of PART_BYTES
parts, PARTS_IN_FLIGHT at once, aborted when the stream fails; the commit is one PUT, the
conditional create a PUT with `If-None-Match: *`. Throttling (503 SlowDown), other 5xx answers
and dropped connections are retried with exponential backoff and jitter; what still fails is
one line naming the object and the reason."""

from __future__ import annotations

import contextlib
import queue
import re
import threading
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from ...errors import DataCheckError, FsdpkitError, RunError, UsageError, install_hint
from .credentials import store_config
from .face import PART_BYTES, PARTS_IN_FLIGHT, READ_BLOCK_BYTES
from .location import SCHEMES, ObjectUrl
from .names import checked_name

RETRIES = 10
RETRY_TIMEOUT = timedelta(minutes=3)
BACKOFF = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2}
DELETE_BATCH = 1000
SEGMENT_BYTES = 256 << 20  # one streamed GET (memory is bounded by the blocks read ahead, not by this)
SEGMENTS_IN_FLIGHT = 2  # the next segment is requested while one is read
BLOCKS_AHEAD = 2  # blocks' worth of bytes a segment's stream reads ahead: at most SEGMENTS_IN_FLIGHT * (BLOCKS_AHEAD + 1) blocks held
# the pieces a stream hands over: obstore joins the body's frames into them, a copy that costs more the larger they are
CHUNK_BYTES = 1 << 20


class ObjectStorage:
    def __init__(self, url: ObjectUrl, store: Any):
        self.url, self._store = url, store
        self.root = str(url)

    @classmethod
    def open(cls, url: ObjectUrl) -> ObjectStorage:
        try:
            import obstore.store
        except ImportError:
            raise UsageError(f"{url}: object storage needs the cloud extra: {install_hint('cloud')}") from None
        config = store_config(url)
        options = {"allow_http": True} if str(config.get("endpoint", "")).startswith("http://") else {}
        kind = {"s3": obstore.store.S3Store, "gs": obstore.store.GCSStore, "az": obstore.store.AzureStore}[url.scheme]
        retry = {"max_retries": RETRIES, "retry_timeout": RETRY_TIMEOUT, "backoff": BACKOFF}
        try:
            store = kind(url.bucket, prefix=url.prefix or None, config=config, client_options=options, retry_config=retry)
        except Exception as error:  # obstore's configuration errors are plain exceptions naming the bad key
            raise UsageError(f"{url}: cannot configure the {SCHEMES[url.scheme]} client: {_reason(error)}") from None
        return cls(url, store)

    def where(self, name: str) -> str:
        return str(self.url.child(name)) if name else str(self.url)

    def child(self, name: str) -> ObjectStorage:
        return ObjectStorage.open(self.url.child(checked_name(name, self.root)))

    def size(self, name: str) -> int | None:
        import obstore

        try:
            return int(self._call(obstore.head, name)["size"])
        except _Missing:
            return None

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        import obstore

        if end is None:
            return bytes(self._call(obstore.get, name, options={"range": {"offset": start}} if start else None).bytes())
        return bytes(self._call(obstore.get_range, name, start=start, end=end)) if end > start else b""

    def read_blocks(
        self, name: str, ranges: Iterable[tuple[int, int]], *, block_bytes: int = READ_BLOCK_BYTES
    ) -> Generator[tuple[int, memoryview], None, None]:
        """Streamed GETs of segments of at most SEGMENT_BYTES, issued in offset order: the
        segment being read streams in this thread, and the next SEGMENTS_IN_FLIGHT - 1 are
        requested meanwhile, each read ahead at most BLOCKS_AHEAD blocks by a thread of its own
        (an object of one segment, the most common, needs no thread)."""
        segments = [(offset, min(offset + SEGMENT_BYTES, end)) for start, end in ranges for offset in range(start, end, SEGMENT_BYTES)]
        chunk_bytes = min(block_bytes, CHUNK_BYTES)
        stop = threading.Event()
        ahead: deque[queue.Queue] = deque()  # the segments after the one read here, in order
        with ThreadPoolExecutor(SEGMENTS_IN_FLIGHT - 1, thread_name_prefix="fsdpkit-get") as pool:
            try:
                for index, (start, end) in enumerate(segments):
                    chunks = _drained(ahead.popleft()) if index else self._chunks(name, start, end, chunk_bytes)
                    while len(ahead) < SEGMENTS_IN_FLIGHT - 1 and (following := index + 1 + len(ahead)) < len(segments):
                        ahead.append(queue.Queue(max(1, BLOCKS_AHEAD * block_bytes // chunk_bytes)))
                        pool.submit(self._read_ahead, name, *segments[following], chunk_bytes, ahead[-1], stop)
                    yield from _blocks(chunks, start, block_bytes)
            finally:
                stop.set()
                for waiting in ahead:  # unblock threads still putting
                    with contextlib.suppress(queue.Empty):
                        while True:
                            waiting.get_nowait()

    def _chunks(self, name: str, start: int, end: int, chunk_bytes: int) -> Iterator[Any]:
        """The bytes [start, end) of object `name` as they arrive, in pieces of at least
        `chunk_bytes` (but the last); the GET is issued now, before the first piece is taken.
        obstore resumes a stream cut midway from the byte where it stopped."""
        import obstore

        return self._streamed(self._call(obstore.get, name, options={"range": (start, end)}), name, start, end, chunk_bytes)

    def _streamed(self, result: Any, name: str, start: int, end: int, chunk_bytes: int) -> Iterator[Any]:
        position = start
        try:
            for chunk in result.stream(min_chunk_size=chunk_bytes):
                position += len(chunk)
                yield chunk
        except Exception as error:
            raise _translated(error, self.where(name), "read") from None
        if position < end:
            raise DataCheckError(f"{self.where(name)}: object ends at byte {position}, {end - position} bytes early (truncated)")

    def _read_ahead(self, name: str, start: int, end: int, chunk_bytes: int, into: queue.Queue, stop: threading.Event) -> None:
        """Put the pieces of bytes [start, end) of object `name` into `into`, then None; an
        error in their place. A reader that stopped ends it."""
        try:
            for chunk in self._chunks(name, start, end, chunk_bytes):
                if not _put(into, chunk, stop):
                    return
        except FsdpkitError as error:
            _put(into, error, stop)
            return
        _put(into, None, stop)

    def list(self, prefix: str = "") -> dict[str, int]:
        import obstore

        found: dict[str, int] = {}
        try:
            for chunk in obstore.list(self._store, prefix=prefix or None, chunk_size=1000):
                found.update((meta["path"], int(meta["size"])) for meta in chunk)
        except Exception as error:
            raise _translated(error, self.where(prefix), "list") from None
        return found

    @contextlib.contextmanager
    def write(self, name: str) -> Iterator[_ObjectStream]:
        import obstore

        where = self.where(checked_name(name, self.root))
        upload = obstore.open_writer(self._store, name, buffer_size=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT)
        try:
            yield _ObjectStream(upload, where)
        except BaseException as error:
            with contextlib.suppress(Exception):  # aborts the multipart upload
                upload.__exit__(type(error), error, error.__traceback__)
            raise
        try:
            upload.close()
        except Exception as error:
            raise _translated(error, where, "write") from None

    def put(self, name: str, data: bytes) -> None:
        import obstore

        self._call(obstore.put, name, data, chunk_size=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT, operation="write")

    def commit(self, name: str, data: bytes) -> None:
        import obstore

        self._call(obstore.put, name, data, use_multipart=False, operation="write")

    def create_exclusive(self, name: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotSupportedError, PreconditionError

        try:
            self._call(obstore.put, name, data, mode="create", operation="write", passing=(AlreadyExistsError, NotSupportedError))
        except (AlreadyExistsError, PreconditionError):
            return False
        except NotSupportedError:  # a store without conditional writes: a check, then a write (docs/object-storage.md)
            if self.size(name) is not None:
                return False
            self.commit(name, data)
        return True

    def delete(self, names: Iterable[str]) -> None:
        import obstore

        names = [checked_name(name, self.root) for name in names]
        for first in range(0, len(names), DELETE_BATCH):
            with contextlib.suppress(_Missing):
                self._call(obstore.delete, names[first : first + DELETE_BATCH], operation="delete")

    def _call(self, function, name, *args, operation: str = "read", passing: tuple = (), **kwargs):
        """`function(store, name, ...)`, its failures as fsdpkit's one-line errors."""
        try:
            return function(self._store, name, *args, **kwargs)
        except passing:
            raise
        except Exception as error:
            where = self.where(name) if isinstance(name, str) else self.root
            raise _translated(error, where, operation) from None


class _ObjectStream:
    """A multipart upload written to; every PARTS_IN_FLIGHT parts it waits for the parts in
    flight (obstore's writer takes what it is given without waiting, so a store slower than the
    writer would otherwise pile the parts up in memory). A writable buffer it is given is copied
    first: obstore holds a reference to the caller's buffer until the part is sent, and a buffer
    the caller fills again (a reader's reused block) would go up with its later bytes; read-only
    views (bytes a GET returned, a read-only mapping of a file) go as they are."""

    def __init__(self, upload: Any, where: str):
        self._upload, self._where = upload, where
        self._unflushed = 0

    def write(self, data: bytes | memoryview, /) -> int:
        if not isinstance(data, bytes) and not (isinstance(data, memoryview) and data.readonly):
            data = bytes(data)  # obstore keeps the caller's buffer, uncopied, until its part goes up
        try:
            written = self._upload.write(data)
            self._unflushed += written
            if self._unflushed >= PART_BYTES * PARTS_IN_FLIGHT:
                self._upload.flush()
                self._unflushed = 0
            return written
        except Exception as error:
            raise _translated(error, self._where, "write") from None


def _drained(source: queue.Queue) -> Iterator[Any]:
    """The pieces a read-ahead thread puts into `source`, up to its None; its error raised."""
    while (chunk := source.get()) is not None:
        if isinstance(chunk, Exception):
            raise chunk
        yield chunk


def _blocks(chunks: Iterable[Any], start: int, block_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, view) of `chunks`, the bytes from `start` on, cut into blocks of at most `block_bytes`."""
    position = start
    for chunk in chunks:
        view = memoryview(chunk)
        for first in range(0, len(view), block_bytes):
            yield position + first, view[first : first + block_bytes]
        position += len(view)


def _put(into: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """`item` put into `into` once there is room, unless the reader stops first (False)."""
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            into.put(item, timeout=0.5)
            return True
    return False


class _Missing(DataCheckError):
    """An object that is not there."""


def _translated(error: Exception, where: str, operation: str) -> FsdpkitError:
    from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

    reason = _reason(error)
    if "NoSuchBucket" in str(error) or "ContainerNotFound" in str(error):
        return UsageError(f"{where}: the bucket does not exist (or is not visible to these credentials)")
    if isinstance(error, NotFoundError | FileNotFoundError):  # obstore raises the builtin for a missing object
        return _Missing(f"{where}: object is missing")
    if isinstance(error, UnauthenticatedError | PermissionDeniedError) or "InvalidAccessKeyId" in str(error):
        return UsageError(f"{where}: access denied ({reason}); check the credentials in the environment or the profile")
    if operation == "write":
        return RunError(f"{where}: write failed after retries, nothing committed: {reason}")
    return RunError(f"{where}: {operation} failed after retries: {reason}")


def _reason(error: Exception) -> str:
    """What went wrong, in one line of at most 300 characters: the HTTP status and the store's
    error code and message where it answered, without obstore's debug dump of the request."""
    text = " ".join(str(error).split()).partition(" Debug source:")[0]
    status = re.search(r"status code: (\d{3}[^:<]*)", text)
    code, message = re.search(r"<Code>([^<]*)</Code>", text), re.search(r"<Message>([^<]*)</Message>", text)
    if status is not None:
        said = f" ({code.group(1)}: {message.group(1) if message else ''})" if code else ""
        return f"HTTP {status.group(1).strip()}{said}"[:300]
    return text[:300] or type(error).__name__
