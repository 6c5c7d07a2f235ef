"""A hybrid-sharded resume reads each byte from storage once: 4 ranks, shard groups of 2, so 2
replicas of each shard. Storage bytes come from /proc/self/io's read_bytes: what the kernel
read from the disk for the process, page faults of mapped files included (the reader maps
rank files, which rchar, counting read() calls only, would miss). The page cache is one per
node, so each replica loads its own copy of the checkpoint, evicted from the cache before the
load: the replicas read as from separate nodes. Loading on every replica reads about 2x the
checkpoint; sharing the reads, at most 1.05x. Both loads, continued for two steps, are
bitwise equal to the run that never stopped. Where the replica that reads finds a file
corrupt, every rank fails with its error at once, the other replica (whose copy is intact)
included."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from support.distributed import run_distributed

import fsdpkit
from fsdpkit.engine.config import ShardingConfig
from fsdpkit.engine.view import describe
from fsdpkit.errors import DataCheckError

WIDTH = 256  # 3 layers of 256 x 256: a checkpoint of about 2.4 MB with AdamW, against a few KB of manifest and headers


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    return fsdpkit.shard(model, ShardingConfig(strategy="hybrid", shard_group_size=2))


def _steps(model, optimizer, first: int, count: int) -> None:
    rank = dist.get_rank()
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model, optimizer) -> list[torch.Tensor]:
    """This rank's shards and their AdamW state, copied."""
    tensors = []
    for unit in describe(model).units:
        for param in unit.params:
            tensors.append(param.tensor.detach().clone())
            tensors.extend(value.clone() for value in optimizer.state.get(param.tensor, {}).values())
    return tensors


def _cold_copy(step_dir: Path, to: Path) -> None:
    """A copy of the checkpoint, on disk and out of the page cache."""
    shutil.copytree(step_dir, to)
    for file in to.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_bytes() -> int:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"])


def resume_worker(directory: str) -> dict:
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, optimizer, 0, 2)
    step_dir = Path(fsdpkit.save(model, optimizer, directory + "/run", step=2))
    _steps(model, optimizer, 2, 2)
    result: dict = {"uninterrupted": _state(model, optimizer), "size": sum(f.stat().st_size for f in step_dir.iterdir())}
    replica = describe(model).replica
    # a first load, not counted: what loading imports or maps of its own is read from disk by then
    warm = _model()
    fsdpkit.Checkpointer(warm, torch.optim.AdamW(warm.parameters(), lr=1e-2)).load(str(step_dir))
    for mode, every_replica in (("shared", False), ("every", True)):
        if dist.get_rank() == 0:
            for r in range(describe(model).replicas):
                _cold_copy(step_dir, Path(directory) / f"{mode}-{r}")
        dist.barrier()
        torch.manual_seed(1)  # other initial weights: the load must replace them all
        resumed = _model()
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        before = _read_bytes()
        fsdpkit.Checkpointer(resumed, resumed_optimizer).load(f"{directory}/{mode}-{replica}", every_replica=every_replica)
        result[f"{mode}_read"] = _read_bytes() - before
        _steps(resumed, resumed_optimizer, 2, 2)
        result[mode] = _state(resumed, resumed_optimizer)
    if dist.get_rank() == 0:  # the first replica's copy damaged, the second's intact
        for r in range(describe(model).replicas):
            shutil.copytree(step_dir, Path(directory) / f"corrupt-{r}")
        for file in (Path(directory) / "corrupt-0").glob("*.safetensors"):
            data = bytearray(file.read_bytes())
            data[-100] ^= 0xFF
            file.write_bytes(bytes(data))
    dist.barrier()
    started = time.monotonic()
    try:
        fsdpkit.Checkpointer(resumed, resumed_optimizer).load(f"{directory}/corrupt-{replica}")
    except DataCheckError as error:
        result["corrupt"] = (str(error), time.monotonic() - started)
    return result


def test_hybrid_resume_reads_each_byte_once(tmp_path):
    results = run_distributed(resume_worker, 4, str(tmp_path))
    size = results[0]["size"]
    every = sum(r["every_read"] for r in results.values())
    shared = sum(r["shared_read"] for r in results.values())
    assert every >= 1.9 * size, f"reading on both replicas read {every} bytes of a {size}-byte checkpoint: read_bytes not counted here?"
    assert shared <= 1.05 * size, f"shared reads read {shared} bytes of a {size}-byte checkpoint ({shared / size:.2f}x)"
    for rank, result in results.items():
        for mode in ("shared", "every"):
            assert len(result[mode]) == len(result["uninterrupted"]) > 0
            for got, want in zip(result[mode], result["uninterrupted"], strict=True):
                assert torch.equal(got, want), (rank, mode)
        message, seconds = result.get("corrupt", ("no error", 0.0))
        assert ".safetensors" in message and seconds < 30, (rank, message, seconds)
