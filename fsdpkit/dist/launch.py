"""Starting worker processes with torch's elastic launcher (the machinery behind torchrun).

`launch(worker_fn, *args, options=...)` runs `worker_fn(*args)` in `nproc_per_node` processes
on this node, joined with the other nodes through c10d rendezvous, and returns the workers'
return values keyed by global rank. `worker_fn` must be a module-level function; it reads
its rank from the environment the launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, ...), which
is also what torchrun sets, so the same worker runs unchanged under torchrun.

Faults: `max_restarts` lets torch's elastic agent restart the whole worker group after a
worker dies or fails (a training worker resumes from its run's newest checkpoint); `timeout`
bounds the rendezvous and, through the workers' process groups, every collective. While
workers run, the launching process handles two signals itself (torch's agent would turn
either into a SignalException and kill the workers): SIGTERM, a scheduler's notice, is passed
on to the workers, and to any worker started after it (STOP_ENV), which finish their step,
save and exit 0; a second SIGTERM, or SIGINT, stops the workers now (KeyboardInterrupt here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import DataCheckError, RunError, UsageError
from ..settings import setting
from . import MAX_PROCESSES_PER_NODE
from .interrupts import sigint_blocked_in_new_workers
from .worker_entry import WorkerEntry, preload_fork_server

RDZV_BACKENDS = ("c10d", "static")
MAX_PORT = 65535
DEFAULT_TIMEOUT_SECONDS = 300.0
STOP_ENV = "FSDPKIT_STOP"  # "1": a SIGTERM reached the launcher; workers stop after their step
INTERRUPTED_ENV = "FSDPKIT_INTERRUPTED"  # "1": the console script got a SIGINT (one that was swallowed too)
LOG_DIR_PREFIX = "fsdpkit-launch-"  # the workers' error files, removed when the launch ends
SHUTDOWN_SECONDS = 5  # a worker the agent stops (after a failure, or on SIGINT) is killed after this
SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX socket's path: sun_path's 108, less a NUL
SOCKET_NAME = "/listener-12345678"  # multiprocessing's socket in its directory (8 random letters)
SOCKET_DIR_NAME = "/pymp-12345678"  # multiprocessing's directory for its sockets, made under TMPDIR
SHORT_TEMP_DIR = "/tmp"


def under_torchrun() -> bool:
    """True in a process that torchrun (or another elastic agent) started as a worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def parse_nproc(text: str) -> int:
    """torchrun's --nproc-per-node values: a number, gpu (one per GPU), cpu (one per core), auto
    (gpu if there is one, else cpu)."""
    if text.strip().isdigit():
        return int(text)
    if text not in ("gpu", "cpu", "auto"):
        raise UsageError(f"--nproc-per-node {text!r}: use a number, gpu, cpu or auto")
    gpus = _cuda_devices()
    if text == "gpu" and not gpus:
        raise UsageError("--nproc-per-node gpu: torch sees no CUDA device here")
    return gpus if text == "gpu" or (text == "auto" and gpus) else (os.cpu_count() or 1)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class LaunchOptions:
    """Where the workers run: torchrun's flags, with torchrun's meanings."""

    nproc_per_node: int | None = setting(
        None,
        "Processes on this node: a number, gpu, cpu or auto (default: one per GPU, or 2 without a GPU).",
        parse=parse_nproc,
        metavar="N|gpu|cpu|auto",
    )
    nnodes: int = setting(1, "Number of nodes (a fixed number: no MIN:MAX ranges).")
    node_rank: int = setting(0, "This node's rank, 0..nnodes-1.")
    rdzv_endpoint: str | None = setting(
        None, "HOST:PORT of the rendezvous that every node can reach (needed with --nnodes > 1).", metavar="HOST:PORT"
    )
    rdzv_backend: str = setting("c10d", "c10d (a store on the endpoint) or static (ranks from --node-rank).", choices=RDZV_BACKENDS)
    rdzv_id: str | None = setting(
        None, "The job id every node of one run shares (default: a new one per run on one node, 'fsdpkit' on several).", metavar="ID"
    )
    standalone: bool = setting(
        False, "One node, a rendezvous on a free local port: what fsdpkit does on one node anyway (accepted for torchrun's sake)."
    )
    master_addr: str | None = setting(None, "torchrun's shortcut: --master-addr A --master-port P is --rdzv-endpoint A:P.", metavar="HOST")
    master_port: int | None = setting(None, "See --master-addr (default port 29500 when only the address is given).", metavar="PORT")
    max_restarts: int = setting(
        0,
        "Restart the worker group up to N times when a worker dies or fails "
        "(training resumes from the newest checkpoint of the run in --save-dir).",
        metavar="N",
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT_SECONDS,
        "Seconds any collective or the rendezvous may wait before the run fails, naming the rank, the collective and the step.",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nproc_per_node is not None and self.nproc_per_node > MAX_PROCESSES_PER_NODE:
            raise UsageError(
                f"--nproc-per-node {self.nproc_per_node} is more than this launcher allows per node ({MAX_PROCESSES_PER_NODE})"
            )
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not (math.isfinite(self.timeout) and self.timeout >= 1):
            raise UsageError(f"--timeout must be at least 1 second, got {self.timeout:g}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise UsageError(f"unknown --rdzv-backend {self.rdzv_backend!r}: use one of {', '.join(RDZV_BACKENDS)} (no etcd)")
        if self.master_port is not None and not 0 < self.master_port <= MAX_PORT:
            raise UsageError(f"--master-port {self.master_port} is outside 1..{MAX_PORT}")
        if self.rdzv_endpoint and (self.master_addr or self.master_port):
            raise UsageError("--rdzv-endpoint and --master-addr/--master-port name the same thing: give one of them")
        if self.standalone and (self.nnodes > 1 or self.endpoint):
            raise UsageError(
                "--standalone runs on one node with a local rendezvous: it excludes --nnodes > 1, "
                "--rdzv-endpoint and --master-addr/--master-port"
            )
        if self.nnodes > 1 and not self.endpoint:
            raise UsageError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (or --master-addr HOST) that every node can reach")
        if self.endpoint:
            host, _, port = self.endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(f"--rdzv-endpoint {self.endpoint!r} must be HOST:PORT")
            if not 0 < int(port) <= MAX_PORT:
                raise UsageError(f"--rdzv-endpoint {self.endpoint!r}: port {port} is outside 1..{MAX_PORT}")

    @property
    def endpoint(self) -> str | None:
        if self.master_addr or self.master_port:
            return f"{self.master_addr or '127.0.0.1'}:{self.master_port or 29500}"
        return self.rdzv_endpoint

    @property
    def job_id(self) -> str | None:
        """The rendezvous id all nodes share: --rdzv-id, or 'fsdpkit' on several nodes; None on
        one node without one (each launch then makes a new one)."""
        if self.rdzv_id:
            return self.rdzv_id
        return None if self.nnodes == 1 and not self.endpoint else "fsdpkit"

    @property
    def local_processes(self) -> int:
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        return _cuda_devices() or 2

    @property
    def world_size(self) -> int:
        return self.local_processes * self.nnodes


def launch(worker_fn: Callable[..., Any], *args: Any, options: LaunchOptions) -> dict[int, Any]:
    """Run worker_fn(*args) on every local process; return {global rank: return value}.

    A failed worker raises RunError naming the rank and its reason (after `max_restarts`
    restarts); SIGINT, or a second SIGTERM, raises KeyboardInterrupt once the workers stopped.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    # The launcher logs every worker's traceback; fsdpkit reports the failure in one line instead.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun does this; elastic_launch does not
    # Workers sharing the agent's rendezvous store read the previous attempt's addresses after
    # a restart (a known torch bug: connection refused); their own store per attempt does not.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    single_node = options.nnodes == 1 and not options.endpoint
    endpoint = (_local_endpoint(options.rdzv_backend) if single_node else options.endpoint) or ""
    try:
        _socket_dir_that_fits()
        preload_fork_server(worker_fn)
        with _stop_signals(), _prompt_stops(), sigint_blocked_in_new_workers():
            if os.environ.get(INTERRUPTED_ENV) == "1":  # an interrupt some code before here swallowed
                raise KeyboardInterrupt
            with _worker_logs() as log_dir:
                return elastic_launch(_launch_config(options, endpoint, log_dir), WorkerEntry(worker_fn))(*args)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()  # the only one: torch reports the first worker to exit
        reason = _failure_reason(failure)
        kind, _, message = reason.partition(":")
        if kind == DataCheckError.__name__:  # a corrupt input found by a worker: exit 3 as anywhere
            raise DataCheckError(f"worker rank {rank}: {message.strip()}") from None
        after = f" (after {options.max_restarts} restart{'s' * (options.max_restarts > 1)})" if options.max_restarts else ""
        if kind == "CollectiveTimeout":  # its message names the rank, the collective and the step
            raise RunError(message.strip() + after) from None
        raise RunError(f"worker rank {rank} failed: {reason}{after}") from None
    except RendezvousError as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RunError(
            f"the rendezvous at {endpoint} did not complete within --timeout {options.timeout:g} s "
            f"({options.nnodes} nodes expected): {detail}"
        ) from None


def _socket_dir_that_fits() -> None:
    """multiprocessing's directory for its sockets (the fork server's listener among them), made
    once per process under TMPDIR: under a TMPDIR too long for an AF_UNIX path, made under
    SHORT_TEMP_DIR instead, as newer Pythons do; where that fails too, a UsageError saying what to set."""
    from multiprocessing import util

    tmpdir, saved = tempfile.gettempdir(), tempfile.tempdir
    fits = SOCKET_PATH_MAX - len(SOCKET_DIR_NAME + SOCKET_NAME)  # the longest TMPDIR that works
    if len(os.fsencode(tmpdir)) > fits:
        tempfile.tempdir = SHORT_TEMP_DIR  # for multiprocessing's first use only
    try:
        socket_path = util.get_temp_dir() + SOCKET_NAME
    except OSError as error:
        raise UsageError(
            f"TMPDIR {tmpdir} is too long for the launcher's AF_UNIX socket and {SHORT_TEMP_DIR} is not usable "
            f"({error.strerror}): set TMPDIR to a directory of at most {fits} bytes"
        ) from None
    finally:
        tempfile.tempdir = saved
    if len(os.fsencode(socket_path)) > SOCKET_PATH_MAX:
        raise UsageError(
            f"the launcher's AF_UNIX socket {socket_path} would be {len(os.fsencode(socket_path))} bytes, "
            f"more than {SOCKET_PATH_MAX}: set TMPDIR to a directory of at most {fits} bytes"
        )


def _launch_config(options: LaunchOptions, endpoint: str, log_dir: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    seconds = math.ceil(options.timeout)
    return LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.local_processes,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        run_id=options.job_id or "fsdpkit-" + uuid.uuid4().hex[:8],
        rdzv_backend=options.rdzv_backend,
        rdzv_endpoint=endpoint,
        rdzv_configs={
            "join_timeout": seconds,
            "timeout": seconds,
            **({"rank": options.node_rank} if options.rdzv_backend == "static" else {}),
        },
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM and SIGINT: _stop_signals
    )


@contextlib.contextmanager
def _worker_logs() -> Iterator[str]:
    """The directory of the workers' error files (torch's agent reads a failed worker's reason
    from it), under TMPDIR and removed when the launch ends: torch's own default, a
    /tmp/torchelastic_* directory per launch, stays behind."""
    log_dir = tempfile.mkdtemp(prefix=LOG_DIR_PREFIX)
    try:
        yield log_dir
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM: pass it on to the workers, and to those started later (STOP_ENV); a second
    SIGTERM or SIGINT: pass SIGINT on and raise KeyboardInterrupt, once (the agent then stops the
    workers, killing any still there after SHUTDOWN_SECONDS, and a later one must not cut that short)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    stopping: list[int] = []  # the signal that raised KeyboardInterrupt: raised once, the agent's cleanup is not cut short

    def stop_now(signum: int, frame: Any) -> None:
        _signal_workers(signal.SIGINT)
        if not stopping:
            stopping.append(signum)
            raise KeyboardInterrupt

    def stop_after_step(signum: int, frame: Any) -> None:
        if os.environ.get(STOP_ENV) == "1":
            stop_now(signum, frame)
        os.environ[STOP_ENV] = "1"
        _signal_workers(signal.SIGTERM)

    previous = {sig: signal.signal(sig, handler) for sig, handler in ((signal.SIGTERM, stop_after_step), (signal.SIGINT, stop_now))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(STOP_ENV, None)


@contextlib.contextmanager
def _prompt_stops() -> Iterator[None]:
    """elastic_launch, stopping the other workers within SHUTDOWN_SECONDS of a failure or a
    restart, not 30 s: torch waits that long for a worker that does not exit on SIGTERM (a
    stopped one; one finishing its step) wherever its agent closes the workers (PContext.close:
    a restart passes 30 s whatever the launch asked, and torch 2.11's LaunchConfig has no
    shutdown_timeout) and where the process context finds a failed worker (ProcessContext.join
    without a grace period). A finished process context also removes its workers' traceback files."""
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.multiprocessing.spawn import ProcessContext

    close, join = PContext.close, ProcessContext.join

    def prompt_close(self: Any, death_sig: signal.Signals | None = None, timeout: int = SHUTDOWN_SECONDS) -> None:
        close(self, death_sig, min(timeout, SHUTDOWN_SECONDS))

    def prompt_join(self: Any, timeout: float | None = None, grace_period: float | None = None) -> bool:
        finished = True  # a raised failure ends the context too
        try:
            finished = join(self, timeout, SHUTDOWN_SECONDS / 2 if grace_period is None else grace_period)
            return finished
        finally:
            if finished:  # the traceback files a failed worker wrote under TMPDIR, never removed by torch
                for path in self.error_files:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)

    # Patching torch's classes in place for the duration: the stubs do not allow assigning to them.
    PContext.close, ProcessContext.join = prompt_close, prompt_join  # type: ignore[method-assign]
    try:
        yield
    finally:
        PContext.close, ProcessContext.join = close, join  # type: ignore[method-assign]


def _signal_workers(sig: signal.Signals) -> None:
    """`sig` to every worker process this process started (the agent's multiprocessing children)."""
    for child in multiprocessing.active_children():
        if child.pid is not None:  # None only before start(); active children are started
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, sig)


def _local_endpoint(backend: str) -> str:
    """c10d binds port 0 itself; the static backend needs a port its store can be told."""
    if backend != "static":
        return "localhost:0"
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _failure_reason(failure: Any) -> str:
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):
        message = message.get("message", "") or json.dumps(message)
    text = str(message).strip()
    if text.startswith("{"):
        try:
            text = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            pass
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        return lines[-1] if len(lines) > 1 and "Traceback" in text else " ".join(lines)
    return f"exit code {getattr(failure, 'exitcode', '?')}"
