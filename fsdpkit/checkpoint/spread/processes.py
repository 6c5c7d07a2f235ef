"""The worker processes of a spread run on one node (fsdpkit's own `--nproc-per-node`; torchrun and
several nodes use a gloo group instead): rank 0 is the launching process, which has opened the
source and planned already; ranks 1..N-1 are plain Python processes, started all at once, each
importing only what its work needs (no torch), that join rank 0's hub (`hub`) and run their parts.
The command line `fsdpkit convert|reshard|verify|diff ... --nproc-per-node N` starts its workers
first thing (`start_early`, before the CLI's own imports): each imports what a run needs, in
parallel with rank 0's imports, then waits on its stdin for the hub's address, which rank 0
writes once it has one (or closes, when the command turns out not to be a spread run: the worker
leaves having done nothing).
A worker that fails leaves the line to rank 0 (it got the same one from the last gather) and
exits with its exit code; on Ctrl-C every worker leaves quietly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from ...dist.interrupts import INTERRUPTED_EXIT_CODE
from ...errors import FsdpkitError

if TYPE_CHECKING:  # the command line imports this module before anything else: it stays light
    from .hub import Hub

HUB_ENV = "FSDPKIT_SPREAD_HUB"  # HOST:PORT:KEY (hex) of rank 0's hub
WORKER_CODE = "from fsdpkit.checkpoint.spread.processes import worker_main; worker_main()"
EARLY_CODE = (  # Ctrl-C during the imports: the worker leaves quietly, as later
    f"import os, signal; signal.signal(signal.SIGINT, lambda *_: os._exit({INTERRUPTED_EXIT_CODE})); "
    "from fsdpkit.checkpoint.spread.processes import early_worker_main; early_worker_main()"
)
SPREAD_COMMANDS = ("convert", "reshard", "verify", "diff")
NOT_EARLY_FLAGS = ("--dry-run", "--help", "-h", "--nnodes", "--node-rank", "--master-addr", "--rdzv-endpoint", "--rdzv-backend")


class EarlyWorkers:
    """Ranks 1..N-1 started before the command line was parsed, waiting for the hub's address."""

    def __init__(self, processes: dict[int, subprocess.Popen]):
        self.processes = processes

    def take(self, rank: int) -> subprocess.Popen | None:
        return self.processes.pop(rank, None)

    def close(self) -> None:
        """The workers not taken leave (their stdin closes: nothing to do)."""
        for process in self.processes.values():
            _close_quietly(process)
        self.processes = {}


def early_nproc(argv: list[str]) -> int | None:
    """N of `convert|reshard|verify|diff ... --nproc-per-node N` on one node outside torchrun
    (None for anything else: the workers then start as the run begins)."""
    if not argv or argv[0] not in SPREAD_COMMANDS or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    flags = [arg.split("=", 1)[0].replace("_", "-") for arg in argv]
    if any(flag in NOT_EARLY_FLAGS for flag in flags) or "--nproc-per-node" not in flags:
        return None
    at = flags.index("--nproc-per-node")
    value = argv[at].split("=", 1)[1] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else "")
    return int(value) if value.isdigit() and int(value) > 1 else None


def start_early(argv: list[str]) -> EarlyWorkers | None:
    """The workers of the spread run `argv` (the command line, less the program) asks for, if any."""
    world_size = early_nproc(argv)
    if world_size is None:
        return None
    processes = {
        rank: subprocess.Popen(
            [sys.executable, "-c", EARLY_CODE], env=_worker_env(rank, world_size), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
        )
        for rank in range(1, world_size)
    }
    return EarlyWorkers(processes)


def _worker_env(rank: int, world_size: int, hub_line: str | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    return env if hub_line is None else {**env, HUB_ENV: hub_line}


def _close_quietly(process: subprocess.Popen) -> None:
    try:
        if process.stdin is not None:
            process.stdin.close()
    except OSError:  # it has gone: the hub sees it exit
        pass


def start_workers(hub: Hub, early: EarlyWorkers | None = None) -> None:
    """Ranks 1..world_size-1, each told where rank 0's hub is (and its key): on its stdin if it
    was started early, else in its environment."""
    host, port = hub.address
    line = f"{host}:{port}:{hub.key.hex()}"
    for rank in range(1, hub.world_size):
        process = early.take(rank) if early is not None else None
        if process is not None and process.stdin is not None:
            try:
                process.stdin.write(f"{line}\n".encode())
            except OSError:  # it has gone: the hub sees it exit
                pass
            _close_quietly(process)
        else:
            env = _worker_env(rank, hub.world_size, line)
            process = subprocess.Popen([sys.executable, "-c", WORKER_CODE], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        hub.processes[rank] = process
    if early is not None:
        early.close()


def stop_workers(hub: Hub, *, grace: float) -> None:
    """Wait up to `grace` seconds for the workers to exit, then kill those still there."""
    deadline = time.monotonic() + grace
    for process in hub.processes.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    hub.close()


def early_worker_main() -> None:
    """A worker started early: the run's imports, then the hub's address from stdin, then its life."""
    from . import dispatch, runner  # noqa: F401  (imported now, while rank 0 imports the CLI)

    line = sys.stdin.readline().strip()
    if not line:
        os._exit(0)
    os.environ[HUB_ENV] = line
    worker_main()


def worker_main() -> None:
    """A worker's whole life: join the hub, run this rank's share of the task it sends, exit."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED_EXIT_CODE))
    from .hub import HubClient

    host, port, key = os.environ.pop(HUB_ENV).rsplit(":", 2)
    client = HubClient((host, int(port)), bytes.fromhex(key), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
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
