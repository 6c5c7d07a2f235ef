"""Starting a training run: check everything that can be checked before a process starts
(exit 2, or 3 for a bad checkpoint), take the lock of the run directory, then launch the
workers, or, under torchrun, be one.

The launcher holds `--save-dir`'s lock (checkpoint/lock.py) from before the launch until the
workers are gone, whatever ends them, and gives every attempt's workers its run id and a
progress file (attempts.py); on several nodes the run id is the shared rendezvous id instead.
Under torchrun there is no fsdpkit launcher: no lock is taken, and the run id is torchrun's
--rdzv-id (TORCHELASTIC_RUN_ID), so that a worker torchrun restarts resumes from its run's
checkpoints too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .. import log
from ..checkpoint.live.manager import RunLock, check_before_launch, check_reachable, check_save_dir, continued_run_id, set_aside
from ..checkpoint.storage.location import is_url
from ..dist.launch import launch, under_torchrun
from ..errors import DataCheckError, UsageError
from ..models.source import resolve
from ..paths import check_writable_directory, check_writable_file
from .attempts import RunContext, attempt_number
from .config import Device, TrainConfig
from .data import TokenSource, check_streamed
from .foreign import converted, foreign_format
from .loop import build_optimizer, train_worker
from .metrics import check_tensorboard_installed
from .model_setup import initial_weights, inspect_model
from .resume import saved_run
from .snapshots import snapshot_store
from .summary import TrainSummary
from .trackers import check_installed


def validate(config: TrainConfig, world_size: int, *, run_id: str | None = None) -> int:
    """Every check that needs no process group; the only place the world size is checked.
    `run_id`: the run's id where it is known before launch (under torchrun). Returns the
    model's parameter count."""
    config.check_world_size(world_size)
    source = resolve(config.model.name)
    info = inspect_model(config.model, source)
    if info.block_size is not None and config.data.seq_len > info.block_size:
        raise UsageError(f"--seq-len {config.data.seq_len} exceeds model {config.model.name!r} block size {info.block_size}")
    if config.data.source != "synthetic":
        data = TokenSource(
            config.data.source,
            vocab_size=info.vocab_size,
            seq_len=config.data.seq_len,
            seed=config.seed,
            token_dtype=config.data.token_dtype,
            tokenizer=source.tokenizer,
            text_field=config.data.text_field,
            eval_data=config.data.eval_data,
            streaming=config.data.streaming,
        )
        if config.data.streaming:
            check_streamed(
                config.data.source,
                text_field=config.data.text_field,
                world_size=world_size,
                seq_len=config.data.seq_len,
                global_batch_size=config.data.global_batch_size,
                tokenizer=source.tokenizer,
            )
        else:
            data.check_batch_size(config.data.global_batch_size)
            data.global_batch(0, 1)
    if config.device is Device.CUDA and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    checkpoint = config.checkpoint
    if checkpoint.save_dir:
        _check_save_dir(checkpoint.save_dir, config, run_id)
    if config.logging.metrics:
        check_writable_file(config.logging.metrics, "--metrics")
    if config.logging.wandb or config.logging.mlflow:
        check_installed(wandb=bool(config.logging.wandb), mlflow=bool(config.logging.mlflow))
    if config.logging.tensorboard:
        check_tensorboard_installed()
        check_writable_directory(config.logging.tensorboard, "--tensorboard")
    if checkpoint.resume:
        optimizer = build_optimizer(info.meta_model, config)
        try:
            check_before_launch(checkpoint.resume, model=info.meta_model, optimizer=optimizer, strict=checkpoint.strict)
        except DataCheckError as error:
            saved_model = saved_run(checkpoint.resume).model
            if saved_model is None or saved_model == config.model.name:
                raise
            raise DataCheckError(f"{error} (saved from {saved_model}, not {config.model.name})") from None
    weights = initial_weights(checkpoint, source)
    if weights:
        check_before_launch(weights, model=info.meta_model, optimizer=None, strict=False)
    return info.num_params


def _check_save_dir(save_dir: str, config: TrainConfig, run_id: str | None) -> None:
    """--save-dir can be written (a local directory, or a bucket these credentials list) and holds no other run's checkpoints."""
    if is_url(save_dir):
        check_reachable(save_dir)
    else:
        check_writable_directory(save_dir, "--save-dir")
    check_save_dir(save_dir, resume=config.checkpoint.resume, new_run=config.checkpoint.new_run, run_id=run_id)


def run_training(config: TrainConfig) -> TrainSummary | None:
    """Validate, then train: launch config.launch's workers, or, under torchrun, be one.
    Returns rank 0's summary (None on the other ranks and nodes)."""
    if under_torchrun():
        rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        run_id = f"torchrun-{rdzv_id}" if rdzv_id not in ("", "none") else None
        _no_conversion_under_torchrun(config)
        validate(config, int(os.environ["WORLD_SIZE"]), run_id=run_id)
        if config.checkpoint.save_dir:
            run_id = continued_run_id(config.checkpoint.save_dir, config.checkpoint.resume) or run_id
        if os.environ.get("RANK") == "0" and attempt_number() == 0:
            _set_aside_earlier_run(config)
        return run_in_process_group(config, RunContext(run_id=run_id))
    with converted(config, config.launch.world_size) as config:
        num_params = validate(config, config.launch.world_size)
        with (
            _run_lock(config) as run_id,
            _progress_file() as progress_path,
            snapshot_store(config, run_id, num_params) as snapshot_dir,
        ):
            if config.launch.node_rank == 0:
                _set_aside_earlier_run(config)
            log.note(launch_line(config))
            return launch(_worker_entry, config, RunContext(run_id, progress_path, snapshot_dir), options=config.launch).get(0)


def _no_conversion_under_torchrun(config: TrainConfig) -> None:
    """Under torchrun every process is a worker: none converts a checkpoint for the others."""
    checkpoint = config.checkpoint
    for flag, path, init_from in (("--resume", checkpoint.resume, False), ("--init-from", checkpoint.init_from, True)):
        found = foreign_format(path, init_from=init_from)
        if found is not None:
            raise UsageError(
                f"{flag} {path} is a {found} checkpoint: under torchrun convert it first "
                f"(fsdpkit convert {path} OUT --to sharded --world-size {os.environ['WORLD_SIZE']} --model {config.model.name})"
            )


def _set_aside_earlier_run(config: TrainConfig) -> None:
    """--new-run: the earlier checkpoints of --save-dir move aside (checkpoint/format/save_dir.py)."""
    if config.checkpoint.new_run and config.checkpoint.save_dir:
        moved = set_aside(config.checkpoint.save_dir)
        if moved is not None:
            log.note(f"new run: the earlier checkpoints of {config.checkpoint.save_dir} are now in {moved}")


def backend_and_device(device: Device) -> tuple[str, str]:
    use_cuda = device is Device.CUDA or (device is Device.AUTO and torch.cuda.is_available())
    return ("nccl", "cuda") if use_cuda else ("gloo", "cpu")


def launch_line(config: TrainConfig) -> str:
    """What starts: workers, backend, device, rendezvous."""
    options = config.launch
    backend, device = backend_and_device(config.device)
    where = "this node" if options.nnodes == 1 else f"node {options.node_rank} of {options.nnodes}"
    endpoint = options.endpoint or "a local port"
    return (
        f"launching {options.local_processes} workers on {where} (world size {options.world_size}), "
        f"backend {backend}, device {device}, rendezvous {options.rdzv_backend} at {endpoint}"
    )


@contextlib.contextmanager
def _run_lock(config: TrainConfig) -> Iterator[str | None]:
    """The run id of --save-dir's lock, held until the block ends (None without --save-dir): a
    run resumed from its own newest checkpoint keeps that run's id (checkpoint/format/save_dir.py). On several
    nodes every node's launcher would want the lock of the one shared directory: there the run
    id is the rendezvous id all nodes share, and no lock is taken."""
    save_dir = config.checkpoint.save_dir
    if not save_dir:
        yield None
        return
    continued = continued_run_id(save_dir, config.checkpoint.resume)
    if config.launch.nnodes > 1:
        yield continued or f"rdzv-{config.launch.job_id}"
    else:
        with RunLock.acquire(save_dir, warn=log.warn, run_id=continued) as lock:
            yield lock.run_id


@contextlib.contextmanager
def _progress_file() -> Iterator[str]:
    fd, path = tempfile.mkstemp(prefix="fsdpkit-progress-", suffix=".jsonl")
    os.close(fd)
    try:
        yield path
    finally:
        os.unlink(path)


@record
def _worker_entry(config: TrainConfig, context: RunContext) -> TrainSummary | None:
    log.setup(quiet=config.logging.quiet)
    return run_in_process_group(config, context)


def run_in_process_group(config: TrainConfig, context: RunContext) -> TrainSummary | None:
    """Init the process group from the launcher's environment (elastic launcher or torchrun),
    train, tear down."""
    backend, _ = backend_and_device(config.device)
    started = time.time()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.launch.timeout))
    try:
        return train_worker(config, context, joined=(started, time.time()))
    finally:
        dist.destroy_process_group()
