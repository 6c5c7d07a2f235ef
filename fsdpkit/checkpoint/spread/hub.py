"""The coordination of a spread run on one node, without torch: rank 0 (the process that launched
the run) serves the other ranks over a local socket (multiprocessing.connection, with a key made
for the run): the gathers and broadcasts of small objects, and the store the progress count posts
to. Each worker asks and waits for the answer:

    ("gather", value)        -> ("ok", [every rank's value]) or ("error", line)
    ("set", key, value) | ("get", key) | ("check", keys)   -> ("ok", result)
    ("failed", reason)       no answer: why this worker is about to exit

A gather fails, naming the rank, when a rank that has not given its value has exited, or has not
been heard from (a gather, a post of its progress) for the timeout: a rank still at work posts
its count every half second. A worker whose rank 0 has gone fails its own.
"""

from __future__ import annotations

import secrets
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from ...errors import RunError

POLL_SECONDS = 0.05


class KeyStore:
    """The few keys the progress count posts: what a TCPStore's set, get and check give.
    `heard` is called on each set (rank 0's own: a sign of life)."""

    def __init__(self, heard: Callable[[], None] = lambda: None) -> None:
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.heard = heard

    def set(self, key: str, value: str) -> None:
        self.heard()
        with self._lock:
            self._values[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._values[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(key in self._values for key in keys)


class Hub:
    """Rank 0's side: `address` and `key` are what a worker needs to join; `task` is sent to each."""

    rank = 0

    def __init__(self, world_size: int, timeout: float, task: Any):
        self.world_size, self.timeout, self.task = world_size, timeout, task
        self.key = secrets.token_bytes(32)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.address: tuple[str, int] = self.listener.address  # type: ignore[assignment]
        self._heard = [time.monotonic()] * world_size  # when each rank was last heard from
        self.store = KeyStore(heard=lambda: self._hear(0))
        self.processes: dict[int, Any] = {}  # rank -> its Popen, to name how a rank that left did
        self._changed = threading.Condition()
        self._rounds: list[dict[int, Any]] = []
        self._next = [0] * world_size  # the round each rank's next gather joins
        self._left: dict[int, str] = {}  # rank -> why it no longer answers
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value, which the workers get as they ask for it: rank 0 goes on at once."""
        self._give(0, value)
        return value

    def all_gather(self, value: Any) -> list[Any]:
        return self._wait(self._give(0, value))

    def gather_later(self, value: Any) -> tuple[Callable[[], bool], Callable[[], list[Any]]]:
        """Rank 0's value given now: (whether every rank has given its own, every rank's value
        once they have, waiting for them as `all_gather` does)."""
        number = self._give(0, value)
        return (lambda: self._complete(number)), (lambda: self._wait(number))

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
                _, rank = conn.recv()
                conn.send(self.task)
            except (OSError, EOFError, AuthenticationError):  # the listener closed, or a connection without the key
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn, rank), daemon=True).start()

    def _serve(self, conn: Connection, rank: int) -> None:
        try:
            while True:
                message = conn.recv()
                self._hear(rank)
                if message[0] == "failed":
                    self._leave(rank, f"failed: {message[1]}")
                    continue
                if message[0] == "gather":
                    try:
                        answer: tuple[str, Any] = ("ok", self._wait(self._give(rank, message[1])))
                    except RunError as error:
                        answer = ("error", str(error))
                else:
                    answer = ("ok", getattr(self.store, message[0])(*message[1:]))
                conn.send(answer)
        except (EOFError, OSError):
            self._leave(rank, "")

    def _give(self, rank: int, value: Any) -> int:
        with self._changed:
            number = self._next[rank]
            self._next[rank] += 1
            while len(self._rounds) <= number:
                self._rounds.append({})
            self._rounds[number][rank] = value
            self._changed.notify_all()
            return number

    def _leave(self, rank: int, reason: str) -> None:
        with self._changed:
            self._left.setdefault(rank, reason)
            self._changed.notify_all()

    def _hear(self, rank: int) -> None:
        self._heard[rank] = time.monotonic()

    def _complete(self, number: int) -> bool:
        with self._changed:
            return len(self._rounds[number]) == self.world_size

    def _wait(self, number: int) -> list[Any]:
        with self._changed:
            values = self._rounds[number]
            while len(values) < self.world_size:
                missing = [rank for rank in range(self.world_size) if rank not in values]
                gone = [rank for rank in missing if rank in self._left or self._exit_code(rank) is not None]
                if gone:
                    raise RunError(f"worker rank {gone[0]} {self._how_it_left(gone[0])}")
                silent = [rank for rank in missing if time.monotonic() - self._heard[rank] > self.timeout]
                if silent:
                    raise RunError(f"rank {silent[0]} did not answer within --timeout {self.timeout:g} s")
                self._changed.wait(POLL_SECONDS)
            return [values[rank] for rank in range(self.world_size)]

    def _exit_code(self, rank: int) -> int | None:
        process = self.processes.get(rank)
        return None if process is None else process.poll()

    def _how_it_left(self, rank: int) -> str:
        reason = self._left.get(rank, "")
        if reason:
            return reason
        process = self.processes.get(rank)
        code = None
        if process is not None:
            try:
                code = process.wait(1.0)
            except Exception:  # still running with its connection closed
                code = None
        if code is None:
            return "closed its connection"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class HubClient:
    """A worker's side: the same collectives and store as rank 0's, each one question and its answer."""

    def __init__(self, address: tuple[str, int], key: bytes, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.conn = Client(address, authkey=key)
        self.conn.send(("join", rank))
        self.task = self.conn.recv()
        self._lock = threading.Lock()
        self.store = _RemoteStore(self)

    def broadcast(self, value: Any) -> Any:
        return self.all_gather(None)[0]

    def all_gather(self, value: Any) -> list[Any]:
        return self.ask("gather", value)

    def failed(self, reason: str) -> None:
        try:
            self.conn.send(("failed", reason))
        except OSError:
            pass

    def ask(self, *message: Any) -> Any:
        with self._lock:
            try:
                self.conn.send(message)
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                raise RunError(f"rank {self.rank}: rank 0 stopped answering") from None
        if kind == "error":
            raise RunError(value)
        return value


class _RemoteStore:
    def __init__(self, client: HubClient):
        self.client = client

    def set(self, key: str, value: str) -> None:
        self.client.ask("set", key, value)

    def get(self, key: str) -> bytes:
        return self.client.ask("get", key)

    def check(self, keys: list[str]) -> bool:
        return self.client.ask("check", keys)
