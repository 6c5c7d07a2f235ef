"""The `fsdpkit` console script: the CLI imported and run inside one handler, so that Ctrl-C at
any moment, the imports of the first second included, and pressed again and again, ends with one
`error: interrupted` line and exit 130, never a traceback. (Before it runs, for the first tenth of
a second or so, Python itself is starting, and a Ctrl-C then gets Python's own traceback: this
module imports nothing slow.)

A KeyboardInterrupt can be swallowed by code that catches everything (an optional import
somewhere below torch, say); the SIGINT handler therefore also leaves a mark in the
environment (INTERRUPTED_ENV), which `fsdpkit.dist.launch` checks before it starts any worker.
A KeyboardInterrupt raised while torch's own import runs can abort the interpreter (a C++
initialiser sees a Python error), so an interrupt that comes then is raised once the import
is over: a timer (SIGALRM) looks again shortly after.

The interrupt is raised once: a second or third Ctrl-C, or the timer, while the first one's
exit is under way (its KeyboardInterrupt or the exit it became is being handled, or the run is
in its last cleanup) only leaves the mark; the timer is stopped and SIGALRM ignored on the way
out, so it cannot end the process after Python has put the default action back.
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


class Interrupts:
    """The console script's handler of SIGINT and of the retry timer's SIGALRM, and its hook for
    exceptions Python can only report."""

    def __init__(self) -> None:
        self.raised = False  # a KeyboardInterrupt was raised (and not lost where Python could only report it)
        self.finishing = False  # the run's last cleanup: nothing is raised any more

    def __call__(self, signum: int, frame: object) -> None:
        os.environ[INTERRUPTED_ENV] = "1"
        if self.raised or self.finishing or isinstance(sys.exception(), (KeyboardInterrupt, SystemExit)):
            return  # an interrupt's exit (or the run's end) is under way: this one changes nothing
        if _importing("torch"):
            signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
            return
        self.raised = True
        handler = signal.getsignal(signal.SIGINT)
        if signum == signal.SIGALRM and callable(handler) and handler is not self:
            handler(signal.SIGINT, frame)  # the launcher's own, while it runs
        raise KeyboardInterrupt

    def unraisable_hook(self, unraisable: sys.UnraisableHookArgs) -> None:
        """Python's report of an exception it could not raise, except an interrupt (one raised in a
        weakref callback of the import machinery or in a `__del__`, where Python can only report
        it): that one comes again through the timer, as one held back during torch's import does,
        so the run still ends with one line and exit 130, and without a traceback."""
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.raised = False
            signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
        else:
            sys.__unraisablehook__(unraisable)

    def stop(self) -> None:
        """No interrupt raised from here on: the timer stopped, both signals ignored."""
        self.finishing = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupted(error: BaseException | None) -> bool:
    """Whether `error` is a KeyboardInterrupt or what one became on its way up: Python 3.11 wraps
    one raised in a class's `__set_name__` (a dataclass's fields, defined as a module is
    imported) in a RuntimeError."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def main() -> None:
    interrupts = Interrupts()
    sys.unraisablehook = interrupts.unraisable_hook
    signal.signal(signal.SIGINT, interrupts)
    signal.signal(signal.SIGALRM, interrupts)
    early = None
    try:
        if any(arg.startswith(("--nproc-per-node", "--nproc_per_node")) for arg in sys.argv):  # a spread run's workers, first
            from fsdpkit.checkpoint.spread.processes import start_early

            early = start_early(sys.argv[1:])
        from .app import main as run

        run(early)
    except BaseException as error:
        if not _interrupted(error):
            raise
        interrupts.stop()
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    finally:
        interrupts.finishing = True  # before any call: a handler may run at each one
        interrupts.stop()  # nor during the wait for the launch's helpers
        if early is not None:
            early.close()
        from fsdpkit.dist.worker_entry import stop_fork_server

        stop_fork_server()
