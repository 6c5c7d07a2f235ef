"""The coordination of a spread run without torch: rank 0 (the process that launched the run on
node 0) serves the other ranks over a socket (multiprocessing.connection, with a key): the
gathers and broadcasts of small objects, and the store the progress count posts to. On one node
it listens on a free local port with a key made for the run; across nodes on --master-port of
every interface, with a key every node derives from the run (`shared_key`). A worker joins
through `handshake` (each side gives up on the other once the timeout passes), then asks and
waits for the answer:

    ("join", rank, world_size) -> ("ok", (task, hands_job)) or ("error", line)
    ("gather", value)        -> ("ok", [every rank's value]), ("gone", (line, rank)) or ("error", line)
    ("set", key, value) | ("get", key) | ("check", keys)   -> ("ok", result)
    ("failed", reason)       no answer: why this worker is about to exit

A gather fails, naming the rank, when a rank that has not given its value has exited or closed
its connection (a process that dies, on any node, closes it), or has not been heard from (a
gather, a post of its progress) for the timeout: a rank still at work posts its count every
half second. Every gather then fails with that first line (a worker whose gather failed exits:
it is not named in its place). A worker whose rank 0 has gone fails its own.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

from ... import log
from ...errors import RunError
from . import handshake

POLL_SECONDS = 0.05
CONNECT_RETRY_SECONDS = 0.2  # a worker whose rank 0 is not listening yet tries again after this
KEY_ENV = "FSDPKIT_SPREAD_KEY"  # a secret every node's environment holds: part of the shared key
LOCAL = ("127.0.0.1", 0)  # one node: a free port on loopback


def shared_key(*run: str) -> bytes:
    """The key of a run across nodes: what every node knows alike (the run's arguments, given
    as `run`, and $FSDPKIT_SPREAD_KEY where set). Without that variable it keeps out connections
    of other runs, not someone who knows the command line."""
    return hashlib.sha256("\0".join([os.environ.get(KEY_ENV, ""), *run]).encode()).digest()


class RankGone(RunError):
    """A gather that failed because `rank` left (exited, closed its connection) or went silent."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class JoinUnfinished(RunError):
    """A rank whose connection rank 0 took but whose handshake or join did not finish within the
    timeout: something only this rank saw, so it says so itself."""


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
    """Rank 0's side: `address` and `key` are what a worker needs to join (`listen`: where, by
    default a free port on loopback; `key`: by default one made for the run); `task` is sent to
    each, and `hands_job`: whether rank 0 hands the workers what it opened (every rank on its node)."""

    rank = 0

    def __init__(
        self,
        world_size: int,
        timeout: float,
        task: Any,
        *,
        listen: tuple[str, int] = LOCAL,
        key: bytes | None = None,
        hands_job: bool = False,
    ):
        self.world_size, self.timeout, self.task, self.hands_job = world_size, timeout, task, hands_job
        self.key = key or secrets.token_bytes(32)
        try:
            self.listener = handshake.listen(listen, world_size)
        except OSError as error:
            raise RunError(f"rank 0 cannot listen on {listen[0] or '*'}:{listen[1]} for the other ranks: {error}") from None
        self.address: tuple[str, int] = self.listener.getsockname()
        self._joined: set[int] = set()
        self._started = time.monotonic()
        self._refused: list[str] = []  # peers that came without this run's key
        self._heard = [time.monotonic()] * world_size  # when each rank was last heard from
        self.store = KeyStore(heard=lambda: self._hear(0))
        self.processes: dict[int, Any] = {}  # rank -> its Popen, to name how a rank that left did
        self._changed = threading.Condition()
        self._rounds: list[dict[int, Any]] = []
        self._next = [0] * world_size  # the round each rank's next gather joins
        self._left: dict[int, str] = {}  # rank -> why it no longer answers
        self._failed: tuple[str, int] | None = None  # the first gather's failure: every gather's then (a rank it fails exits)
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
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (closing alone does not, on Linux)
        except OSError:
            pass
        self.listener.close()

    def wait_until_left(self, seconds: float) -> None:
        """Wait up to `seconds` for every other rank to close its connection (or its process to
        exit); a rank of another node that has not joined, only until its --timeout to join is out."""
        deadline = time.monotonic() + seconds
        with self._changed:
            while time.monotonic() < deadline and any(self._may_still_hear(rank) for rank in range(1, self.world_size)):
                self._changed.wait(POLL_SECONDS)

    def _may_still_hear(self, rank: int) -> bool:
        if rank in self._left or self._exit_code(rank) is not None:
            return False
        return rank in self._joined or rank in self.processes or time.monotonic() < self._started + self.timeout

    def _accept(self) -> None:
        """Each connection's handshake in a thread of its own: one that stalls holds up no other."""
        while not self._closed:
            try:
                sock, peer = self.listener.accept()
            except OSError:  # the listener closed, or a connection that left before it was accepted
                continue
            threading.Thread(target=self._join, args=(sock, peer[0]), daemon=True).start()

    def _join(self, sock: socket.socket, host: str) -> None:
        try:
            conn, (_, rank, world_size) = handshake.greet(sock, self.key, time.monotonic() + self.timeout)
        except AuthenticationError:  # another run's key (another command line, or another $FSDPKIT_SPREAD_KEY)
            if host not in self._refused:
                log.warn(
                    f"rank 0 refused a connection from {host} with another key: every node must run the same command "
                    f"(and the same ${KEY_ENV} where set); waiting up to --timeout {self.timeout:g} s for the ranks not joined"
                )
            self._refused.append(host)
            return
        except (OSError, EOFError, ValueError, TypeError, handshake.Unfinished):  # it left, said nothing, or said something else
            return
        problem = self._join_problem(rank, world_size)
        try:
            conn.send(("error", problem) if problem else ("ok", (self.task, self.hands_job)))
        except OSError:  # it left before it heard: it may join again
            if problem is None:
                with self._changed:
                    self._joined.discard(rank)
            conn.close()
            return
        if problem is None:
            self._serve(conn, rank)
        else:
            conn.close()

    def _join_problem(self, rank: int, world_size: int) -> str | None:
        with self._changed:
            if world_size != self.world_size:
                return (
                    f"rank {rank} counts {world_size} ranks, rank 0 {self.world_size}: "
                    "every node must give the same --nnodes and --nproc-per-node"
                )
            if not 0 < rank < self.world_size or rank in self._joined:
                return f"rank {rank} joined twice or is outside 1..{self.world_size - 1}: give each node its own --node-rank"
            self._joined.add(rank)
            return None

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
                    except RankGone as error:
                        answer = ("gone", (str(error), error.rank))
                    except RunError as error:
                        answer = ("error", str(error))
                else:
                    answer = ("ok", getattr(self.store, message[0])(*message[1:]))
                _send(conn, answer, rank)
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
                if self._failed is None:
                    self._failed = self._failure([rank for rank in range(self.world_size) if rank not in values])
                if self._failed is not None:
                    raise RankGone(*self._failed)
                self._changed.wait(POLL_SECONDS)
            return [values[rank] for rank in range(self.world_size)]

    def _failure(self, missing: list[int]) -> tuple[str, int] | None:
        """Why a gather that waits for `missing` fails now (their first rank that left, or went
        silent), or None while it may still complete."""
        gone = [rank for rank in missing if rank in self._left or self._exit_code(rank) is not None]
        if gone:
            return f"worker rank {gone[0]} {self._how_it_left(gone[0])}", gone[0]
        silent = [rank for rank in missing if time.monotonic() - self._heard[rank] > self.timeout]
        if silent:
            refused = f" (refused connections from {', '.join(sorted(set(self._refused)))} with another key)" if self._refused else ""
            answer = "answer" if silent[0] in self._joined else "join"
            return f"rank {silent[0]} did not {answer} within --timeout {self.timeout:g} s{refused}", silent[0]
        return None

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
            return "closed its connection" if process is not None else "closed its connection (it exited, or its node went away)"
        before = "" if rank in self._joined else " before it joined"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}{before}"
        return f"exited with code {code}{before}"


def _send(conn: Connection, answer: tuple[str, Any], rank: int) -> None:
    """`answer` to rank `rank`; one that does not pickle becomes its error line (else the rank would wait until --timeout)."""
    try:
        conn.send(answer)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        conn.send(("error", f"rank {rank}: rank 0 could not send its answer ({type(error).__name__}: {error})"))


class HubClient:
    """A worker's side: the same collectives and store as rank 0's, each one question and its answer."""

    def __init__(self, address: tuple[str, int], key: bytes, rank: int, world_size: int, timeout: float = 300.0):
        self.rank, self.world_size = rank, world_size
        self.conn, (kind, value) = _join(address, key, rank, world_size, timeout)
        if kind == "error":
            self.conn.close()
            raise RunError(value)
        self._lock = threading.Lock()
        self.task, self.hands_job = value
        self.store = _RemoteStore(self)

    def close(self) -> None:
        self.conn.close()

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
        if kind == "gone":
            raise RankGone(*value)
        if kind == "error":
            raise RunError(value)
        return value


def _join(address: tuple[str, int], key: bytes, rank: int, world_size: int, timeout: float) -> tuple[Connection, tuple[str, Any]]:
    """A connection to rank 0's hub and its answer to this rank's join, within `timeout`: tried
    again while it does not listen yet (another node's rank 0 may start later)."""
    where = f"{address[0]}:{address[1]}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            return handshake.connect(address, key, ("join", rank, world_size), deadline)
        except AuthenticationError:
            raise RunError(
                f"rank {rank}: rank 0 at {where} refused this node's key: every node must run the same command "
                "(and the same $FSDPKIT_SPREAD_KEY where set)"
            ) from None
        except handshake.Unfinished:
            raise JoinUnfinished(
                f"rank {rank}: rank 0 at {where} took the connection but did not finish the handshake within --timeout {timeout:g} s"
            ) from None
        except (OSError, EOFError) as error:
            if time.monotonic() > deadline:
                raise RunError(f"rank {rank}: rank 0 did not answer at {where} within --timeout {timeout:g} s ({error})") from None
            time.sleep(CONNECT_RETRY_SECONDS)


class _RemoteStore:
    def __init__(self, client: HubClient):
        self.client = client

    def set(self, key: str, value: str) -> None:
        self.client.ask("set", key, value)

    def get(self, key: str) -> bytes:
        return self.client.ask("get", key)

    def check(self, keys: list[str]) -> bool:
        return self.client.ask("check", keys)
