"""The worker processes of a spread run started by fsdpkit's own flags (`--nproc-per-node`, and
`--nnodes` with `--master-addr`/`--master-port`; torchrun's workers use a gloo group instead):
the launching process of each node is one rank (node 0's is rank 0, which serves the hub, `hub`);
the node's other ranks are plain Python processes, started all at once, each importing only what
its work needs (no torch), that join rank 0's hub and run their parts.
The command line `fsdpkit convert|reshard|verify|diff ... --nproc-per-node N` starts its node's
workers first thing (`start_early`, before the CLI's own imports): each imports what a run needs
(numpy too, which a cast would otherwise import in the worker's first part), in parallel with the
launching process's imports, then waits on its stdin for its rank and the hub's address, which
the launching process writes once it has them (or closes, when the command turns out not to be a
spread run: the worker leaves having done nothing).
A worker that fails leaves the line to rank 0 (it got the same one from the last gather) and
exits with its exit code, but for a handshake with rank 0 that did not finish, which only it
saw; on Ctrl-C every worker leaves quietly. A worker whose launching process has gone (killed)
exits within PARENT_POLL_SECONDS: none outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from ...dist import MAX_PROCESSES_PER_NODE
from ...dist.interrupts import INTERRUPTED_EXIT_CODE
from ...errors import FsdpkitError

HUB_ENV = "FSDPKIT_SPREAD_HUB"  # HOST:PORT:KEY (hex) of rank 0's hub
TIMEOUT_ENV = "FSDPKIT_SPREAD_TIMEOUT"  # --timeout: how long a worker tries to reach rank 0
PARENT_ENV = "FSDPKIT_SPREAD_PARENT"  # the pid of the process that started the worker
PARENT_POLL_SECONDS = 0.5
WORKER_CODE = "from fsdpkit.checkpoint.spread.processes import worker_main; worker_main()"
EARLY_CODE = (  # Ctrl-C during the imports: the worker leaves quietly, as later
    f"import os, signal; signal.signal(signal.SIGINT, lambda *_: os._exit({INTERRUPTED_EXIT_CODE})); "
    "from fsdpkit.checkpoint.spread.processes import early_worker_main; early_worker_main()"
)
SPREAD_COMMANDS = ("convert", "reshard", "verify", "diff")
NOT_EARLY_FLAGS = ("--dry-run", "--help", "-h")


class EarlyWorkers:
    """A node's workers started before the command line was parsed (by local rank 1..N-1),
    waiting for their run's settings."""

    def __init__(self, processes: dict[int, subprocess.Popen]):
        self.processes = processes

    def take(self, local_rank: int) -> subprocess.Popen | None:
        return self.processes.pop(local_rank, None)

    def close(self) -> None:
        """The workers not taken leave (their stdin closes: nothing to do)."""
        for process in self.processes.values():
            _close_quietly(process)
        self.processes = {}


def early_nproc(argv: list[str]) -> int | None:
    """N of `convert|reshard|verify|diff ... --nproc-per-node N` (on this node) outside torchrun
    (None for anything else, and for more than a launch allows, which the run then refuses: the
    workers start as the run begins)."""
    if not argv or argv[0] not in SPREAD_COMMANDS or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    flags = [arg.split("=", 1)[0].replace("_", "-") for arg in argv]
    if any(flag in NOT_EARLY_FLAGS for flag in flags) or "--nproc-per-node" not in flags:
        return None
    at = flags.index("--nproc-per-node")
    value = argv[at].split("=", 1)[1] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else "")
    return int(value) if value.isdigit() and 1 < int(value) <= MAX_PROCESSES_PER_NODE else None


def start_early(argv: list[str]) -> EarlyWorkers | None:
    """This node's workers of the spread run `argv` (the command line, less the program) asks for, if any."""
    per_node = early_nproc(argv)
    if per_node is None:
        return None
    processes = {
        local_rank: subprocess.Popen(
            [sys.executable, "-c", EARLY_CODE], env=_worker_env(local_rank), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
        )
        for local_rank in range(1, per_node)
    }
    return EarlyWorkers(processes)


def start_workers(
    address: tuple[str, int], key: bytes, ranks: range, world_size: int, timeout: float, early: EarlyWorkers | None = None
) -> dict[int, subprocess.Popen]:
    """`ranks` (this node's but its first), each told where rank 0's hub is (and its key): on its
    stdin if the command line started it (`early`), else in its environment."""
    host, port = address
    processes = {}
    for local_rank, rank in enumerate(ranks, 1):
        run = {HUB_ENV: f"{host}:{port}:{key.hex()}", "RANK": str(rank), "WORLD_SIZE": str(world_size), TIMEOUT_ENV: str(timeout)}
        process = early.take(local_rank) if early is not None else None
        if process is not None:
            _hand(process, json.dumps(run))
        else:
            env = _worker_env(local_rank, run)
            process = subprocess.Popen([sys.executable, "-c", WORKER_CODE], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        processes[rank] = process
    if early is not None:
        early.close()
    return processes


def _worker_env(local_rank: int, run: dict[str, str] | None = None) -> dict[str, str]:
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return {**os.environ, "LOCAL_RANK": str(local_rank), "OMP_NUM_THREADS": threads, PARENT_ENV: str(os.getpid()), **(run or {})}


def _hand(process: subprocess.Popen, line: str) -> None:
    """`line` to a worker waiting on its stdin, which then closes."""
    try:
        assert process.stdin is not None
        process.stdin.write(f"{line}\n".encode())
    except OSError:  # it has gone: the hub sees it exit
        pass
    _close_quietly(process)


def _close_quietly(process: subprocess.Popen) -> None:
    try:
        if process.stdin is not None:
            process.stdin.close()
    except OSError:  # it has gone: the hub sees it exit
        pass


def stop_workers(processes: dict[int, subprocess.Popen], *, grace: float) -> None:
    """Wait up to `grace` seconds for the workers to exit, then kill those still there."""
    deadline = time.monotonic() + grace
    for process in processes.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def early_worker_main() -> None:
    """A worker started early: the run's imports, then its rank and the hub's address from stdin, then its life."""
    import numpy  # noqa: F401  (the casts' (core/crc imports it at the first cast): now, not in this worker's first part)

    from . import dispatch, runner  # noqa: F401  (imported now, while rank 0 imports the CLI)

    line = sys.stdin.readline().strip()
    if not line:
        os._exit(0)
    os.environ.update(json.loads(line))
    worker_main()


def worker_main() -> None:
    """A worker's whole life: join the hub, run this rank's share of the task it sends, exit."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED_EXIT_CODE))
    from .hub import HubClient, JoinUnfinished

    host, port, key = os.environ.pop(HUB_ENV).rsplit(":", 2)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    parent = int(os.environ.pop(PARENT_ENV))
    threading.Thread(target=_exit_when_gone, args=(parent, rank), daemon=True).start()
    try:
        client = HubClient((host, int(port)), bytes.fromhex(key), rank, world_size, float(os.environ[TIMEOUT_ENV]))
    except JoinUnfinished as error:  # only this rank saw it
        sys.stderr.write(f"error: {error}\n")
        os._exit(error.exit_code)
    except FsdpkitError as error:  # rank 0 never answered, or refused: the node's first rank says so
        os._exit(error.exit_code)
    from .runner import run_ranks

    try:
        run_ranks(client.task, client)
    except FsdpkitError as error:
        sys.stderr.flush()
        os._exit(error.exit_code)
    except BaseException as error:
        client.failed(f"{type(error).__name__}: {error}")
        raise
    sys.stderr.flush()
    os._exit(0)  # its parts written and reported: no interpreter teardown for rank 0 to wait for


def _exit_when_gone(parent: int, rank: int) -> None:
    """Exit once the process `parent` that started this worker has gone (this worker then has another parent)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    sys.stderr.write(f"error: rank {rank}: the process that started it (pid {parent}) has gone; it stops\n")
    os._exit(1)
