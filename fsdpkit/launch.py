"""Starting worker processes with torch's elastic launcher (the machinery behind torchrun).

`launch(worker_fn, *args, options=...)` runs `worker_fn(*args)` in `nproc_per_node` processes
on this node, joined with the other nodes through c10d rendezvous, and returns the workers'
return values keyed by global rank. `worker_fn` must be a module-level function; it reads
its rank from the environment the launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, ...), which
is also what torchrun sets, so the same worker runs unchanged under torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from .errors import DataCheckError, RunError, UsageError


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_processes_per_node: int = 64

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nproc_per_node > self.max_processes_per_node:
            raise UsageError(
                f"--nproc-per-node {self.nproc_per_node} is more than this launcher allows per node ({self.max_processes_per_node})"
            )
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT that every node can reach")
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint!r} must be HOST:PORT")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def launch(worker_fn: Callable[..., Any], *args: Any, options: LaunchOptions) -> dict[int, Any]:
    """Run worker_fn(*args) on every local process; return {global rank: return value}.

    A failed worker raises RunError naming the rank and its reason.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The launcher logs every worker's traceback; fsdpkit reports the failure in one line instead.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun does this; elastic_launch does not
    single_node = options.nnodes == 1 and not options.rdzv_endpoint
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=options.rdzv_id or ("fsdpkit-" + uuid.uuid4().hex[:8] if single_node else "fsdpkit"),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0" if single_node else options.rdzv_endpoint,
        rdzv_configs={"rank": options.node_rank} if not single_node else {},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        return elastic_launch(config, worker_fn)(*args)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()  # the root cause: the others usually fail because it did
        reason = _failure_reason(failure)
        if reason.startswith(DataCheckError.__name__ + ":"):  # a corrupt input found by a worker: exit 3 as anywhere
            raise DataCheckError(f"worker rank {rank}: {reason.split(':', 1)[1].strip()}") from None
        raise RunError(f"worker rank {rank} failed: {reason}") from None


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
