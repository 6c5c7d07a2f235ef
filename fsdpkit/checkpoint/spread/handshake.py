"""How a rank and rank 0's hub meet, each side within a deadline: the TCP connection (the hub
listens with room for every rank connecting at once: a queue of one, multiprocessing's default,
drops the connections that arrive together), multiprocessing.connection's challenge with the
run's key, both ways, and the rank's first message with the hub's answer. A side that stops
answering midway (a peer that connects and says nothing; a connection the hub's kernel dropped,
which the rank still takes for open) is cut off at the deadline (`Unfinished`) instead of
holding the other side forever.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any


class Unfinished(Exception):
    """The other side took the connection but did not finish the handshake by the deadline."""


def listen(address: tuple[str, int], ranks: int) -> socket.socket:
    """A socket listening on `address` whose queue holds `ranks` connections not yet accepted."""
    return socket.create_server(address, backlog=ranks)


def connect(address: tuple[str, int], key: bytes, hello: Any, deadline: float) -> tuple[Connection, Any]:
    """A rank's connection to the hub at `address`, and the hub's answer to `hello`, by `deadline`
    (time.monotonic()). Raises OSError or EOFError where there is no hub to answer (not listening,
    or it closed the connection), AuthenticationError where it has another key, Unfinished."""
    sock = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.01))
    sock.settimeout(None)
    conn = _connection(sock)
    try:
        with within(conn, deadline):
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
            conn.send(hello)
            return conn, conn.recv()
    except BaseException:
        conn.close()
        raise


def greet(sock: socket.socket, key: bytes, deadline: float) -> tuple[Connection, Any]:
    """The hub's side of `connect` for a connection it accepted: the connection and the rank's
    first message, by `deadline`. Raises as `connect` does (AuthenticationError: another key)."""
    conn = _connection(sock)
    try:
        with within(conn, deadline):
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
            return conn, conn.recv()
    except BaseException:
        conn.close()
        raise


def _connection(sock: socket.socket) -> Connection:
    """`sock` as a Connection, with Nagle's algorithm off: a side's two small writes in a row (the
    handshake's last message and the join that follows it) would otherwise wait for the other's
    delayed ACK (40 ms on Linux)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Connection(sock.detach())


@contextlib.contextmanager
def within(conn: Connection, deadline: float) -> Iterator[None]:
    """The block's reads and writes of `conn` cut off at `deadline` (its socket shut down): the
    block then raises Unfinished, whatever the cut made it raise."""
    cut = threading.Event()

    def shut() -> None:
        cut.set()
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)  # the socket, not just this descriptor: a blocked read returns

    timer = threading.Timer(max(deadline - time.monotonic(), 0.0), shut)
    timer.daemon = True
    timer.start()
    try:
        yield
    except (OSError, EOFError):
        if not cut.is_set():
            raise
    finally:
        timer.cancel()
        timer.join()
    if cut.is_set():
        raise Unfinished
