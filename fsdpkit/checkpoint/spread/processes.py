"""The worker processes of a spread run on one node (fsdpkit's own `--nproc-per-node`; torchrun and
several nodes use a gloo group instead): rank 0 is the launching process, which has opened the
source and planned already; ranks 1..N-1 are plain Python processes, started all at once, each
importing only what its work needs (no torch), that join rank 0's hub (`hub`) and run their parts.
A worker that fails leaves the line to rank 0 (it got the same one from the last gather) and
exits with its exit code; on Ctrl-C every worker leaves quietly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ...dist.interrupts import INTERRUPTED_EXIT_CODE
from ...errors import FsdpkitError
from .hub import Hub, HubClient

HUB_ENV = "FSDPKIT_SPREAD_HUB"  # HOST:PORT:KEY (hex) of rank 0's hub
WORKER_CODE = "from fsdpkit.checkpoint.spread.processes import worker_main; worker_main()"


def start_workers(hub: Hub) -> None:
    """Ranks 1..world_size-1, each told where rank 0's hub is (and its key) in its environment."""
    host, port = hub.address
    for rank in range(1, hub.world_size):
        env = {
            **os.environ,
            HUB_ENV: f"{host}:{port}:{hub.key.hex()}",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(hub.world_size),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        hub.processes[rank] = subprocess.Popen(
            [sys.executable, "-c", WORKER_CODE], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )


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


def worker_main() -> None:
    """A worker's whole life: join the hub, run this rank's share of the task it sends, exit."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED_EXIT_CODE))
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
