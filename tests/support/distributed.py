"""The one helper tests use to run code in several processes (gloo, CPU).

Each launch costs seconds, so a test batches many checks into one worker function and
returns plain data (tensors, numbers) that the test process compares.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fsdpkit.dist.launch import LaunchOptions, launch

COLLECTIVE_TIMEOUT_SECONDS = 120  # a collective that waits longer fails the test (torch's default: 30 min)


def run_distributed(worker: Callable[..., Any], world_size: int, *args: Any) -> dict[int, Any]:
    """Run worker(*args) on `world_size` gloo ranks; return {rank: result}."""
    return launch(_entry, worker, args, options=LaunchOptions(nproc_per_node=world_size))


@record
def _entry(worker: Callable[..., Any], args: tuple) -> Any:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS))
    try:
        return worker(*args)
    finally:
        dist.destroy_process_group()
