"""Output files written by several processes (no torch), as docs/checkpoint-format.md's "How
convert and reshard copy" says: at a large world size a reshard is bound by one core, so the files
are cut into contiguous shares, each but the first written by a child forked from this process
(the layout tables and the sources are inherited, never sent).
A child sends its progress, then its result or its exception, through a pipe; the first error is
raised once every child has been stopped and reaped, so the caller can remove its staging
directory with nothing still writing into it. fsdpkit's rank files (`format.writer`) and the
DeepSpeed writer (its files shared out by size, `even_shares`) use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection, Pipe, wait
from typing import TypeVar

from ...errors import RunError

SPLIT_RANK_FILES = 1024  # outputs of at least this many rank files are written by several processes
MAX_PROCESSES = 2
T = TypeVar("T")


def process_count(files: int, *, split_at: int = SPLIT_RANK_FILES) -> int:
    """How many processes write `files` output files (several from `split_at` files on). A
    process that has loaded the object-store client writes alone: its runtime's threads, which
    serve a bucket's reads, do not survive a fork."""
    if files < split_at or not hasattr(os, "fork") or "obstore" in sys.modules:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_PROCESSES, cores, files))


def even_shares(sizes: Sequence[int], count: int) -> list[range]:
    """At most `count` contiguous, non-empty ranges of indices into `sizes`, each of about the
    same total size."""
    total, begin, running = sum(sizes), 0, 0
    shares: list[range] = []
    for index, size in enumerate(sizes):
        running += size
        if len(shares) < count - 1 and running * count >= total * (len(shares) + 1):
            shares.append(range(begin, index + 1))
            begin = index + 1
    shares.append(range(begin, len(sizes)))
    return [share for share in shares if share]


def in_processes(
    shares: Sequence[range],
    work: Callable[[range, Callable[[int], None] | None], T],
    progress: Callable[[int], None] | None = None,
) -> list[T]:
    """`work(share, report)` for each share, the first in this process and each other in a child
    forked from it; the results in the shares' order. `report(nbytes)` is the share's progress."""
    children = _Children(progress)
    try:
        for share in shares[1:]:
            children.start(partial(work, share))
        first = work(shares[0], children.relay)
        return [first, *children.results()]
    finally:
        children.stop()


class _Children:
    """Forked children, each running one function, and the pipes they report through."""

    def __init__(self, progress: Callable[[int], None] | None):
        self._progress = progress
        self._pids: dict[Connection, int] = {}  # children not yet reaped
        self._results: dict[Connection, tuple] = {}

    def start(self, function: Callable[[Callable[[int], None]], object]) -> None:
        """Fork a child that runs `function(report)` and sends its result (or its exception)."""
        receive, send = Pipe(duplex=False)
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            status = 1
            try:
                receive.close()
                send.send(("done", function(send.send)))
                status = 0
            except BaseException as error:
                try:
                    send.send(("error", error))
                except BaseException:  # one that cannot be pickled: a RunError with its line
                    with contextlib.suppress(BaseException):
                        send.send(("error", RunError(f"{type(error).__name__}: {error}")))
            finally:
                os._exit(status)
        send.close()
        self._pids[receive] = pid

    def relay(self, nbytes: int) -> None:
        """This process's progress; then whatever the children have sent (their first error raised)."""
        if self._progress is not None:
            self._progress(nbytes)
        for receive in self._pids:
            while receive not in self._results and receive.poll():
                self._take(receive)

    def results(self) -> list:
        """Every child's result in the order they were started, once all have finished."""
        while running := [receive for receive in self._pids if receive not in self._results]:
            for receive in wait(running):
                self._take(receive)  # type: ignore[arg-type]
        return [self._results[receive][1] for receive in self._pids]

    def _take(self, receive: Connection) -> None:
        try:
            message = receive.recv()
        except EOFError:
            raise RunError(f"a worker process writing rank files (pid {self._pids[receive]}) died without a result") from None
        if isinstance(message, int):
            if self._progress is not None:
                self._progress(message)
        elif message[0] == "error":
            raise message[1]
        else:
            self._results[receive] = message

    def stop(self) -> None:
        """Kill the children still running (after an error) and reap them all."""
        for receive, pid in self._pids.items():
            if receive not in self._results:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            receive.close()
        self._pids.clear()
