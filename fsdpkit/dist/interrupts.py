"""Ctrl-C in a launched run, quiet in every worker at every moment.

A terminal's Ctrl-C reaches the launcher, the fork server and all the workers (one process
group), and the launcher passes SIGINT on as well. A worker that gets it while Python is still
starting it, or a fork server that gets it while importing torch, would print a traceback, and
a worker that gets a second SIGINT while exiting would print another. So the fork server starts
with SIGINT blocked (`sigint_held`: a blocked signal stays blocked across fork and exec, and one
sent meanwhile stays pending), every worker forked from it starts so too, and the worker's first
code (`run_quietly_interruptible`) installs a handler that raises KeyboardInterrupt once and
ignores the rest, then unblocks. An interrupted worker leaves with os._exit: interpreter
shutdown with live communication threads may abort, and atexit hooks would see a second
interrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

INTERRUPTED_EXIT_CODE = 130
SHUTDOWN_SECONDS = 5  # a killed child is waited for this long


@contextlib.contextmanager
def sigint_blocked_in_new_workers() -> Iterator[None]:
    """Every worker multiprocessing's forkserver starts meanwhile, and the server itself if it
    starts meanwhile, starts with SIGINT blocked (`sigint_held`). This process handles SIGINT
    and SIGTERM once the worker is started: a handler that raised while the server was still
    forking it would leave a worker nobody knows of, which fails noisily once this process is
    gone (the semaphores it is handed are removed with it). For the same reason, on the way
    out, a worker still alive is killed: the launcher does not stop one it was still starting
    when interrupted. The launcher's semaphores (the elastic agent's queues and event) are
    made with the handlers deferred too: one interrupted between its creation in /dev/shm and
    its registration with multiprocessing's resource tracker would stay there for good."""
    from multiprocessing import popen_forkserver, synchronize

    start = popen_forkserver.Popen._launch  # type: ignore[attr-defined]  # the one place a worker is started
    make_semaphore = synchronize.SemLock.__init__
    started: list[Any] = []

    def start_quietly(self: Any, process_obj: Any) -> Any:
        with _handlers_deferred((signal.SIGINT, signal.SIGTERM)), sigint_held():
            try:
                return start(self, process_obj)
            finally:
                started.append(self)

    def make_semaphore_quietly(self: Any, *args: Any, **kwargs: Any) -> None:
        with _handlers_deferred((signal.SIGINT, signal.SIGTERM)):
            make_semaphore(self, *args, **kwargs)

    popen_forkserver.Popen._launch = start_quietly  # type: ignore[attr-defined]
    synchronize.SemLock.__init__ = make_semaphore_quietly  # type: ignore[method-assign]
    try:
        yield
    finally:
        popen_forkserver.Popen._launch = start  # type: ignore[attr-defined]
        synchronize.SemLock.__init__ = make_semaphore  # type: ignore[method-assign]
        for child in started:
            if getattr(child, "pid", None) is not None and child.poll() is None:
                child.kill()
                child.wait(timeout=SHUTDOWN_SECONDS)


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile: a process started now starts with it blocked, and
    one that arrives meanwhile stays pending. multiprocessing's resource tracker is started
    first, as starting it unblocks SIGINT."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _handlers_deferred(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """The signals of `signals` that arrive meanwhile are raised again once the block is over, to
    their handlers as they were. Blocking a signal does not defer its Python handler: another
    thread of this process takes the signal, and Python runs the handler in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for signum in arrived:
            signal.raise_signal(signum)


def _interrupt_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_quietly_interruptible(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """fn(*args), where SIGINT raises KeyboardInterrupt once, and an interrupted worker exits 130
    with nothing printed."""
    try:
        signal.signal(signal.SIGINT, _interrupt_once)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return fn(*args)
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED_EXIT_CODE)
