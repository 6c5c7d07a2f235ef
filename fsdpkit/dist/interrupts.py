"""Ctrl-C in a launched run, quiet in every worker at every moment.

A terminal's Ctrl-C reaches the launcher and all its workers (one process group), and the
launcher passes SIGINT on as well. A worker that gets it while Python is still starting (the
spawn bootstrap imports torch before any code of ours runs) would print a traceback, and one
that gets a second SIGINT while exiting would print another. So the launcher starts each
worker with SIGINT blocked (`sigint_blocked_while_spawning`: a blocked signal stays blocked
across fork and exec, and one sent meanwhile stays pending), and the worker's first code
(`QuietlyInterruptible`) installs a handler that raises KeyboardInterrupt once and ignores the
rest, then unblocks. An interrupted worker leaves with os._exit: interpreter shutdown with
live communication threads may abort, and atexit hooks would see a second interrupt.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

INTERRUPTED_EXIT_CODE = 130
SHUTDOWN_SECONDS = 5  # a killed child is waited for this long


@contextlib.contextmanager
def sigint_blocked_while_spawning() -> Iterator[None]:
    """Every process that multiprocessing's spawn starts meanwhile starts with SIGINT blocked;
    this process takes SIGINT as before, once the child is started. On the way out, a child
    still alive is killed: one the launcher was still starting when it was interrupted is not
    among the workers it stops, and would fail noisily once this process is gone (the
    semaphores it is handed are removed with it)."""
    from multiprocessing import popen_spawn_posix

    spawn = popen_spawn_posix.Popen._launch  # type: ignore[attr-defined]  # the one place a child is exec'd
    started: list[Any] = []

    def spawn_blocked(self: Any, process_obj: Any) -> Any:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return spawn(self, process_obj)
        finally:
            started.append(self)
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    popen_spawn_posix.Popen._launch = spawn_blocked  # type: ignore[attr-defined]
    try:
        yield
    finally:
        popen_spawn_posix.Popen._launch = spawn  # type: ignore[attr-defined]
        for child in started:
            if getattr(child, "pid", None) is not None and child.poll() is None:
                child.kill()
                child.wait(timeout=SHUTDOWN_SECONDS)


def _interrupt_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


class QuietlyInterruptible:
    """`fn` as a worker's entry point (picklable when `fn` is a module-level function): SIGINT
    raises KeyboardInterrupt once, and an interrupted worker exits 130 with nothing printed."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # the elastic launcher names and wraps its entry point by these

    def __call__(self, *args: Any) -> Any:
        try:
            signal.signal(signal.SIGINT, _interrupt_once)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            return self.fn(*args)
        except KeyboardInterrupt:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(INTERRUPTED_EXIT_CODE)
