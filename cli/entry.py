"""The `fsdpkit` console script: the CLI imported and run inside one handler, so that Ctrl-C at
any moment, the imports of the first second included, ends with `error: interrupted` and exit
130, never a traceback. (Before it runs, for the first tenth of a second or so, Python itself is
starting, and a Ctrl-C then gets Python's own traceback: this module imports nothing slow.)

A KeyboardInterrupt can be swallowed by code that catches everything (an optional import
somewhere below torch, say); the SIGINT handler therefore also leaves a mark in the
environment (INTERRUPTED_ENV), which `fsdpkit.dist.launch` checks before it starts any worker.
A KeyboardInterrupt raised while torch's own import runs can abort the interpreter (a C++
initialiser sees a Python error), so an interrupt that comes then is raised once the import
is over: a timer (SIGALRM) looks again shortly after.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED_ENV = "FSDPKIT_INTERRUPTED"  # fsdpkit.dist.launch reads the same name
RETRY_SECONDS = 0.05


def _importing(name: str) -> bool:
    """True while module `name` is being executed by an import (importlib marks its spec)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _interrupt(signum: int, frame: object) -> None:
    os.environ[INTERRUPTED_ENV] = "1"
    if _importing("torch"):
        signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
        return
    handler = signal.getsignal(signal.SIGINT)
    if signum == signal.SIGALRM and callable(handler) and handler is not _interrupt:
        handler(signal.SIGINT, frame)  # the launcher's own, while it runs
    raise KeyboardInterrupt


def unraisable_hook(unraisable: sys.UnraisableHookArgs) -> None:
    """Python's report of an exception it could not raise, except an interrupt (one raised in a
    weakref callback of the import machinery or in a `__del__`, where Python can only report it):
    that one comes again through the timer, as one held back during torch's import does, so the
    run still ends with one line and exit 130, and without a traceback."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
    else:
        sys.__unraisablehook__(unraisable)


def main() -> None:
    sys.unraisablehook = unraisable_hook
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGALRM, _interrupt)
    try:
        from .app import main as run

        run()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # nor the wait for the launch's helpers
        from fsdpkit.dist.worker_entry import stop_fork_server

        stop_fork_server()
