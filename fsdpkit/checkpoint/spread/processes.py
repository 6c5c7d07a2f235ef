"""The worker processes of a spread run started by fsdpkit's own flags (`--nproc-per-node`, and
`--nnodes` with `--master-addr`/`--master-port`; torchrun's workers use a gloo group instead):
the launching process of each node is one rank (node 0's is rank 0, which serves the hub, `hub`);
the node's other ranks are plain Python processes, started all at once, each importing only what
its work needs (no torch), that join rank 0's hub and run their parts. A worker that fails leaves
the line to rank 0 (it got the same one from the last gather) and exits with its exit code; on
Ctrl-C every worker leaves quietly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ...dist.interrupts import INTERRUPTED_EXIT_CODE
from ...errors import FsdpkitError
from .hub import HubClient

HUB_ENV = "FSDPKIT_SPREAD_HUB"  # HOST:PORT:KEY (hex) of rank 0's hub
TIMEOUT_ENV = "FSDPKIT_SPREAD_TIMEOUT"  # --timeout: how long a worker tries to reach rank 0
WORKER_CODE = "from fsdpkit.checkpoint.spread.processes import worker_main; worker_main()"


def start_workers(address: tuple[str, int], key: bytes, ranks: range, world_size: int, timeout: float) -> dict[int, subprocess.Popen]:
    """`ranks` (this node's but its first), each told where rank 0's hub is (and its key) in its environment."""
    host, port = address
    processes = {}
    for local_rank, rank in enumerate(ranks, 1):
        env = {
            **os.environ,
            HUB_ENV: f"{host}:{port}:{key.hex()}",
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            TIMEOUT_ENV: str(timeout),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        processes[rank] = subprocess.Popen(
            [sys.executable, "-c", WORKER_CODE], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
    return processes


def stop_workers(processes: dict[int, subprocess.Popen], *, grace: float) -> None:
    """Wait up to `grace` seconds for the workers to exit, then kill those still there."""
    deadline = time.monotonic() + grace
    for process in processes.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def worker_main() -> None:
    """A worker's whole life: join the hub, run this rank's share of the task it sends, exit."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED_EXIT_CODE))
    host, port, key = os.environ.pop(HUB_ENV).rsplit(":", 2)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        client = HubClient((host, int(port)), bytes.fromhex(key), rank, world_size, float(os.environ[TIMEOUT_ENV]))
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
