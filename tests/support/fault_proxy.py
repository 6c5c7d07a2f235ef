"""A small HTTP proxy in front of a test server that answers a given fraction of requests
with a fault: `503 SlowDown` (S3's throttling), another 5xx, a 400 (which no client retries),
a connection dropped without an answer, a request held unanswered until the proxy closes
(`held` is set when the first one arrives: the moment to kill a client mid-upload), or
(`cut`, asked for by name) an answer cut off after half its body; `only` limits the faults to
requests whose path holds it (or one of them). `arm(passing)` instead holds the requests that
would fail after the next `passing` of them, until `release()` drops them: a moment of an
upload to kill its client at, again and again. The request is read whole first, so a fault other than `cut`
never reaches the server; which requests fail comes from a seeded generator, so a run is
repeatable; the kinds take turns. `faults` counts what was injected, `gets` the GETs answered per object."""

from __future__ import annotations

import http.client
import random
import socket
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'
INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>'
)
BAD_REQUEST = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidRequest</Code><Message>Injected by the test proxy.</Message></Error>'
)
PAYLOADS = {"503": SLOW_DOWN, "500": INTERNAL, "400": BAD_REQUEST}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FaultProxy:
    """`with FaultProxy(upstream, fraction=0.05) as proxy:` then send requests to `proxy.url`."""

    def __init__(
        self,
        upstream: str,
        *,
        fraction: float,
        seed: int = 0,
        kinds: tuple[str, ...] = ("503", "500", "drop"),
        methods: tuple[str, ...] = ("GET", "HEAD", "PUT", "POST", "DELETE"),
        only: str | tuple[str, ...] = "",
    ):
        self.upstream = urlsplit(upstream)
        self.fraction, self.kinds, self.methods = fraction, kinds, methods  # only requests of `methods` fail
        self.only = (only,) if isinstance(only, str) else only
        self._passing: int | None = None  # with arm(): requests still to pass before the holding starts; None: not armed
        self.held, self.released = threading.Event(), threading.Event()
        self.faults: dict[str, int] = dict.fromkeys(kinds, 0)
        self.requests = 0
        self.got_bytes = 0  # bytes of the answers to GETs the server gave
        self.gets: Counter[str] = Counter()  # GETs the server answered, by path (bucket/key)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()

    def arm(self, passing: int) -> None:
        """Hold the requests that would fail after the next `passing` of them, until release()."""
        with self._lock:
            self._passing = passing
            self.held, self.released = threading.Event(), threading.Event()

    def release(self) -> None:
        """Drop the requests held, and hold no more."""
        with self._lock:
            self._passing = None
            self.released.set()

    def draw(self, method: str, path: str = "") -> str | None:
        """The fault for the next request, or None."""
        with self._lock:
            self.requests += 1
            if method not in self.methods or not any(part in path for part in self.only) or self._random.random() >= self.fraction:
                return None
            if self.kinds == ("hold",) and self.released.is_set():
                return None
            if self._passing:
                self._passing -= 1
                return None
            kind = self.kinds[sum(self.faults.values()) % len(self.kinds)]  # each kind in turn
            self.faults[kind] += 1
            return kind


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up on an answer (as one does after a failed upload) is no error of the
    server's: socketserver would print its traceback into the captured output of the command under test."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _any(self) -> None:
            body = self._body()
            fault = proxy.draw(self.command, self.path)
            if fault == "hold":
                proxy.held.set()
                proxy.released.wait()
                fault = "drop"
            if fault == "drop":
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if fault == "cut":
                self._forward(body, cut=True)
                return
            if fault is not None:
                payload = PAYLOADS[fault]
                self.send_response(int(fault))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self._forward(body)

        def _forward(self, body: bytes, *, cut: bool = False) -> None:
            upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
            headers = {key: value for key, value in self.headers.items() if key.lower() not in HOP_BY_HOP}
            if self.headers.get("Transfer-Encoding"):
                headers["Content-Length"] = str(len(body))
            try:
                upstream.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None, headers=headers)
                answer = upstream.getresponse()
                payload = answer.read()
                if self.command == "GET":
                    with proxy._lock:
                        proxy.got_bytes += len(payload)
                        proxy.gets[urlsplit(self.path).path] += 1
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)) if self.command != "HEAD" else answer.getheader("Content-Length", "0"))
                self.end_headers()
                if cut:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                elif self.command != "HEAD":
                    self.wfile.write(payload)
            finally:
                upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler
