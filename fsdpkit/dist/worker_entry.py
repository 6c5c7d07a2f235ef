"""The function a launch runs, as each worker process starts it.

Workers are forked from a server process that imported PRELOAD, and the module of the first launch's
worker function, once (multiprocessing's forkserver): a spawned worker imports torch again, seconds
of CPU per worker, per launch and per restart. The server lives until the process that launches
stops it (`stop_fork_server`, as the command line does before it exits), so its later launches fork at once. A fork starts with the server's environment as it was
when the server started, which may predate what the launcher set since (a stop notice, a caller's
variables), so WorkerEntry carries the launcher's environment, taken as each worker is started, and
puts it in place before anything else runs in the worker; the launcher's own per-worker variables
(RANK, ...) go on top of it, as under spawn. What torch read from the server's environment when it
was imported is read again from the launcher's: the intra-op thread count (OMP_NUM_THREADS) and
torch.distributed's debug level (TORCH_DISTRIBUTED_DEBUG).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

from .interrupts import run_quietly_interruptible

PRELOAD = ["torch", "torch.distributed", "torch.distributed.elastic.multiprocessing"]


def preload_fork_server(worker_fn: Callable[..., Any]) -> None:
    """What the fork server imports when it starts (this process's first launch): PRELOAD and
    `worker_fn`'s module."""
    module = [worker_fn.__module__] if worker_fn.__module__ != "__main__" else []
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *module])


def stop_fork_server() -> None:
    """Stop the fork server and multiprocessing's resource tracker, where this process started
    them, and wait until they have exited. Left to notice this process's exit, they outlive it
    by a second or more (the server unloads torch), in its process group, as zombies once their
    parent is gone: a caller waiting on the group, or starting the next run at once, sees them."""
    from multiprocessing import forkserver, resource_tracker

    server: Any = forkserver._forkserver  # its private parts: the stubs know only the public ones
    if server._forkserver_pid is not None:  # SIGTERM ends it at once; asked to stop, it would unload torch first
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGTERM)
    server._stop()
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


class WorkerEntry:
    """`fn` as a worker's entry point (picklable when `fn` is a module-level function)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # the elastic launcher names and wraps its entry point by these

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "environ": dict(os.environ)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        os.environ.clear()
        os.environ.update(state["environ"])
        self.__init__(state["fn"])  # type: ignore[misc]

    def __call__(self, *args: Any) -> Any:
        _torch_settings_from_environment()
        return run_quietly_interruptible(self.fn, args)


def _torch_settings_from_environment() -> None:
    import torch
    import torch.distributed as dist

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
    if dist.is_available():
        dist.set_debug_level_from_env()
