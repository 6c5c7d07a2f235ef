"""The training worker: one process of a sharded run. Started by `fsdpkit train` through
the elastic launcher, or directly under torchrun (`torchrun -m fsdpkit_cli train ...`).

Faults: a worker that the elastic agent restarted resumes from its run's newest checkpoint
(attempts.py); SIGTERM stops every rank after the same step, with a checkpoint (signals.py);
a collective that fails or times out ends the worker with one line naming the rank, the
collective and the step (collective_failure.py)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdpkit

from .. import log
from ..checkpoint.live.manager import CheckpointManager
from ..checkpoint.memory.choice import Source
from ..checkpoint.memory.recovery import restore
from ..data.streaming import StreamPosition
from ..dist import faults
from ..dist.comm import CollectiveError, Collectives
from ..dist.host import peak_rss_bytes
from ..engine.view import describe
from ..models.recipe import Optimizer, precision_names
from ..models.source import resolve
from ..models.units import wrap_policy
from ..plan.kernels import OptimizerKernel, optimizer_kernel_for
from .attempts import History, Restart, RunContext, attempt_number, read_records
from .collective_failure import collective_failure
from .config import Device, TrainConfig
from .data import StreamedBatches, TokenSource, local_rows, rank_start, streamed_position
from .model_setup import build_for_training, initial_weights, inspect_model
from .outputs import Outputs, open_outputs
from .progress import Throughput
from .schedule import lr_at
from .signals import StopSignals
from .snapshots import open_writer, wanted
from .summary import TrainSummary


def pick_device(device: Device) -> torch.device:
    if device is Device.CUDA or (device is Device.AUTO and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with the kernel the planner charges (`optimizer_kernel_for`): torch's fused one when
    every parameter is on CUDA; otherwise (CPU, or --cpu-offload's host shards) torch's default
    implementation, bitwise as it always was."""
    optimizer = config.optimizer
    groups = fsdpkit.param_groups(model, weight_decay=optimizer.weight_decay)
    if optimizer.name is Optimizer.ADAMW:
        kernel = optimizer_kernel_for(all(p.is_cuda for group in groups for p in group["params"]))
        fused = True if kernel is OptimizerKernel.FUSED else None
        return torch.optim.AdamW(groups, lr=config.peak_lr, betas=optimizer.betas, fused=fused)
    return torch.optim.SGD(groups, lr=config.peak_lr, momentum=optimizer.momentum, nesterov=optimizer.nesterov)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak. CPU: the peak RSS of this worker's own address space."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


class Trainer:
    """A sharded model, its optimizer and data, and the training state that a checkpoint keeps.
    Assumes the config was checked against the world size (TrainConfig.check_world_size).

    The first attempt starts from --resume, --init-from or the seed; a restarted one (the
    elastic agent's, see attempts.py) from the newest checkpoint of its own run in --save-dir,
    if there is one."""

    def __init__(self, config: TrainConfig, context: RunContext = RunContext(), *, joined: tuple[float, float] | None = None) -> None:
        """`joined`: wall-clock times the worker began and joined its process group (default: now)."""
        self.started_at, self.joined_at = joined or (time.time(), time.time())
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = pick_device(config.device)
        self.source = resolve(config.model.name)
        info = inspect_model(config.model, self.source)
        self.vocab_size = info.vocab_size
        self.num_params = info.num_params
        self.comms = Collectives()
        self.current_step = 0  # the step being run or saved, for error messages
        self.stopping = False  # a rank was asked to stop after the last step (SIGTERM)
        checkpoint = config.checkpoint
        own = None  # the newest checkpoint this run saved, for a restarted attempt
        self.restarted = self._restarted()
        if self.restarted and checkpoint.save_dir and context.run_id:
            own = CheckpointManager.newest_of_run(checkpoint.save_dir, context.run_id)
        weights = initial_weights(checkpoint, self.source)
        model = build_for_training(config.model, self.source, config.seed, weights_follow=bool(own or weights or checkpoint.resume))
        wrap = wrap_policy(config.model, self.source, model)
        self.model = fsdpkit.shard(model, config.sharding, wrap=wrap, device=self.device)
        self.unit_names = {unit.name for unit in describe(self.model).units}
        self.optimizer = build_optimizer(self.model, config)
        self.scaler = fsdpkit.ShardedGradScaler(self.model) if config.sharding.mixed_precision.param_dtype is torch.float16 else None
        self.data = TokenSource(
            config.data.source,
            vocab_size=self.vocab_size,
            seq_len=config.data.seq_len,
            seed=config.seed,
            token_dtype=config.data.token_dtype,
            tokenizer=self.source.tokenizer,
            text_field=config.data.text_field,
            eval_data=config.data.eval_data,
            streaming=config.data.streaming,
        )
        self.streamed: StreamedBatches | None = None  # --data-streaming: opened at the first step, from the restored position
        self.stream_start: StreamPosition | None = None
        self.last_data_seconds = 0.0  # the last step's wait for its batch (the loader's time not hidden behind compute)
        self.tracker_ids: dict[str, str] = {}  # the experiment trackers' run ids (rank 0's), kept in checkpoints
        self.step = 0  # training steps run (batches consumed)
        self.optimizer_steps = 0  # steps the optimizer took (fp16 skips do not count)
        self.last_grad_norm: float | None = None
        self.resumed_from_step: int | None = None
        self.checkpoints = CheckpointManager(
            checkpoint.save_dir,
            self.model,
            self.optimizer,
            async_save=checkpoint.async_save,
            keep_last=checkpoint.keep_last,
            run_id=context.run_id,
        )
        if self.restarted and self.rank == 0:
            self.checkpoints.remove_unfinished()  # a save the failure cut short
        self.snapshots = open_writer(context.snapshot_dir, config, self.model, self.optimizer)
        self.source_of_state = self._start_with_own_settings(own, weights, context)
        self.start_step = self.step  # where this attempt starts
        self.restored_at = time.time()

    def _restarted(self) -> bool:
        """Whether this group continues a run: any rank's agent restarted it. With several
        nodes a node that was replaced starts at attempt 0 while the others are past it."""
        if self.config.launch.nnodes == 1 or self.config.launch.max_restarts == 0:
            return attempt_number() > 0
        attempts = torch.tensor([attempt_number()], dtype=torch.int64, device=self.device)
        self.comms.all_reduce(attempts, None, op=dist.ReduceOp.MAX, label="attempt")
        return int(attempts.item()) > 0

    def restart(self) -> Restart:
        return Restart(self.source_of_state.value, self.started_at, self.joined_at, self.restored_at)

    def _start_with_own_settings(self, own: str | Path | None, weights: str | None, context: RunContext) -> Source:
        """`_start_from`, then this run's optimizer settings again: a load gives the saved run's,
        and a flag given on resume (--weight-decay, --betas...) wins over them."""
        built = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        source = self._start_from(own, weights, context)
        for group, settings in zip(self.optimizer.param_groups, built, strict=True):
            group.update(settings)
        return source

    def _start_from(self, own: str | Path | None, weights: str | None, context: RunContext) -> Source:
        """Restore this attempt's state: a restarted attempt from the newest of its snapshots
        and its own checkpoints; the first from --resume, --init-from or the seed."""
        checkpoint = self.config.checkpoint
        if self.restarted and wanted(self.config):
            disk_step = CheckpointManager.step_of(own) if own is not None else None
            store = self.snapshots.store if self.snapshots else None
            choice, state = restore(store, self.model, self.optimizer, self.comms, disk_step=disk_step, warn=log.warn)
            if state is not None:
                self.restore(state)
                return choice.source
        if own is not None:
            self.restore(self.checkpoints.load(own))
            return Source.DISK
        if checkpoint.resume:
            self.restore(self.checkpoints.load(checkpoint.resume, strict=checkpoint.strict))
            self.resumed_from_step = self.step
            return Source.DISK
        if weights:
            self.checkpoints.init_weights(weights)
        return Source.NONE

    def training_state(self) -> dict[str, Any]:
        """World-size independent: the data stream is a function of (seed, step), the learning
        rate of the optimizer step count; the RNG state is the same on every rank."""
        optimizer = self.config.optimizer
        return {
            "step": self.step,
            "optimizer_steps": self.optimizer_steps,
            "samples": self.step * self.config.data.global_batch_size,
            "lr_schedule": {
                "kind": optimizer.schedule.value,
                "position": self.optimizer_steps,
                "warmup_steps": self.config.warmup_steps,
                "base_lr": self.config.peak_lr,
                "decay_steps": self.config.schedule_steps,
            },
            "grad_scaler": self.scaler.state_dict() if self.scaler else None,
            "data_position": self._data_position(),
            "trackers": self.tracker_ids,
            "rng": {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")},
            "world_size": self.world_size,
            "config": self.config.to_values(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's training state (the inverse of training_state)."""
        self.step = int(state.get("step", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", self.step))
        self.tracker_ids = dict(state.get("trackers") or {})
        if self.config.data.streaming:
            self.stream_start = rank_start(state.get("data_position"), self.rank, self.world_size)
        else:
            self.data.check_position(self.step, self.config.data.global_batch_size, state.get("data_position"))
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        rng = (state.get("rng") or {}).get("torch_cpu")
        if rng:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))

    def _data_position(self) -> dict | None:
        """Where the loader stands: a function of the step, or with streaming, every rank's stream (a collective)."""
        if not self.config.data.streaming:
            return self.data.position(self.step, self.config.data.global_batch_size)
        mine = self.streamed.position if self.streamed else (self.stream_start or StreamPosition(shard=self.rank))
        positions: list[Any] = [None] * self.world_size
        dist.all_gather_object(positions, mine)
        return streamed_position(positions)

    def local_micro_batches(self) -> list[torch.Tensor]:
        """This rank's rows of each micro-batch of the step's global batch."""
        data = self.config.data
        if data.streaming:
            if self.streamed is None:
                self.streamed = StreamedBatches(
                    data.source,
                    vocab_size=self.vocab_size,
                    seq_len=data.seq_len,
                    rows=data.global_batch_size // self.world_size,
                    rank=self.rank,
                    world_size=self.world_size,
                    tokenizer=self.source.tokenizer,
                    text_field=data.text_field,
                    start=self.stream_start,
                )
            return list(self.streamed.next_rows().chunk(data.grad_accum))
        batch = self.data.global_batch(self.step, data.global_batch_size)
        micro_rows = data.global_batch_size // data.grad_accum
        return [local_rows(batch[m * micro_rows : (m + 1) * micro_rows], self.rank, self.world_size) for m in range(data.grad_accum)]

    def save(self) -> None:
        self.current_step = self.step
        self.checkpoints.save(step=self.step, training_state=self.training_state())

    def _loss_on(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device)
        logits = self.source.logits(self.model, tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def _global_sums(self, values: list[float], label: str) -> list[float]:
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.comms.all_reduce(total, None, label=label)
        return total.tolist()

    def train_step(self, *, stop_requested: Callable[[], bool] | None = None) -> float:
        """One optimizer step over the global batch; returns its loss (mean over all tokens).
        `stopping` then says whether any rank was asked to stop (`stop_requested()`, asked at
        the end of the step, so that a stop asked for during the step counts): the ranks agree
        on it in the loss's all-reduce."""
        self.current_step = self.step + 1
        faults.step_started(self.current_step)
        optimizer, data = self.config.optimizer, self.config.data
        lr = lr_at(
            self.optimizer_steps,
            base_lr=self.config.peak_lr,
            warmup_steps=self.config.warmup_steps,
            total_steps=self.config.schedule_steps,
            schedule=optimizer.schedule,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        local_loss = 0.0
        data_start = time.perf_counter()
        micro_batches = self.local_micro_batches()
        self.last_data_seconds = time.perf_counter() - data_start
        for micro, micro_batch in enumerate(micro_batches):
            last = micro == data.grad_accum - 1
            with contextlib.nullcontext() if (last or not data.no_sync) else fsdpkit.no_sync(self.model):
                loss = self._loss_on(micro_batch) / data.grad_accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            local_loss += loss.item()
        if optimizer.max_grad_norm is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            self.last_grad_norm = fsdpkit.clip_grad_norm_(self.model, optimizer.max_grad_norm).item()
        if self.scaler:
            stepped = self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
            stepped = True
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.optimizer_steps += int(stepped)
        snapshot_flag = self.snapshots.finished_flag() if self.snapshots else 1.0
        stop_flag = float(stop_requested()) if stop_requested is not None else 0.0
        loss_sum, stops, snapshots_finished = self._global_sums([local_loss, stop_flag, snapshot_flag], "loss")
        self.stopping = stops > 0
        if self.snapshots:
            self.snapshots.confirm(snapshots_finished, self.world_size)
        return loss_sum / self.world_size

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out loss, in eval mode (no dropout)."""
        data = self.config.data
        losses = []
        self.model.eval()
        try:
            for index in range(data.eval_batches):
                batch = self.data.global_batch(index, data.global_batch_size, held_out=True)
                losses.append(self._loss_on(local_rows(batch, self.rank, self.world_size)).item())
        finally:
            self.model.train()
        return self._global_sums([sum(losses) / len(losses)], "eval loss")[0] / self.world_size


PEER_GONE_SECONDS = 3.0  # how long a rank whose peer went away waits before failing


def train_worker(
    config: TrainConfig, context: RunContext = RunContext(), *, joined: tuple[float, float] | None = None
) -> TrainSummary | None:
    """Run a whole training on this rank; rank 0 returns the summary, others None. A collective
    that fails raises RunError (CollectiveTimeout when it timed out) naming rank, collective, step."""
    trainer = None
    with StopSignals() as stop:
        try:
            trainer = Trainer(config, context, joined=joined)
            return _train(trainer, stop, context)
        except CollectiveError as error:
            if not error.timed_out:
                # A peer's connection closed: it failed or was killed. The launcher reports the first
                # worker to exit, which should be that peer, the cause; it stops this one meanwhile.
                stop.wait(PEER_GONE_SECONDS)
            raise collective_failure(
                error,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                step=trainer.current_step if trainer else 0,
                timeout=config.launch.timeout,
                units=trainer.unit_names if trainer else set(),
                attempt=attempt_number(),
            ) from None


def _step_record(trainer: Trainer, loss: float, step_time: float) -> dict[str, Any]:
    config = trainer.config
    record: dict[str, Any] = {
        "step": trainer.step,
        "loss": loss,
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "step_time_s": step_time,
        "data_time_s": trainer.last_data_seconds,
        "tokens_per_second": config.tokens_per_step / step_time,
        "peak_memory_bytes": peak_memory_bytes(trainer.device),
    }
    if trainer.last_grad_norm is not None:
        record["grad_norm"] = trainer.last_grad_norm
    if trainer.scaler is not None:
        record["loss_scale"] = trainer.scaler.scale_value
    if config.data.eval_every and trainer.step % config.data.eval_every == 0:
        record["eval_loss"] = trainer.evaluate()
    return record


def _run_steps(trainer: Trainer, stop: StopSignals, outputs: Outputs, throughput: Throughput) -> tuple[list[float], list[dict]]:
    """Train up to the step count (or a stop), saving as asked; returns (losses, eval losses)."""
    config = trainer.config
    saving = config.checkpoint.save_every
    losses: list[float] = []
    eval_losses: list[dict] = []
    while trainer.step < config.steps and not trainer.stopping:
        step_start = time.perf_counter()
        loss = trainer.train_step(stop_requested=lambda: stop.requested)
        step_time = time.perf_counter() - step_start
        throughput.add(step_time)
        losses.append(loss)
        record = _step_record(trainer, loss, step_time)
        if "eval_loss" in record:
            eval_losses.append({"step": trainer.step, "loss": record["eval_loss"]})
        if outputs.metrics:
            outputs.metrics.write(record)
        if outputs.trackers:
            outputs.trackers.log(record)
        if outputs.progress_log:
            offset = outputs.metrics.offset if outputs.metrics else None
            outputs.progress_log.stepped(trainer.step, loss, eval_loss=record.get("eval_loss"), metrics_offset=offset)
        outputs.progress.update(trainer.step, loss=loss, tokens_per_second=throughput.tokens_per_second)
        faults.reached("step", trainer.step)
        if trainer.checkpoints.saves and saving and trainer.step % saving == 0 and trainer.step < config.steps:
            trainer.save()  # the save after the last step is _train's
        elif trainer.snapshots and trainer.step % config.checkpoint.snapshot_every == 0 and trainer.step < config.steps:
            trainer.snapshots.offer(trainer.step, trainer.training_state())
    return losses, eval_losses


def _finish_saves(trainer: Trainer, *, saved_at_stop: bool) -> float:
    """Wait for the last snapshot, save after the last step (unless a stop just saved) and wait
    for it; return the seconds this rank's training thread spent in saves between steps (the
    save after the last step, and waiting for it, hold up no step)."""
    if trainer.snapshots:
        trainer.snapshots.wait()
    if not trainer.checkpoints.saves:
        return 0.0
    stall = trainer.checkpoints.stall_seconds
    if not saved_at_stop:
        trainer.save()
    trainer.checkpoints.wait()
    return stall


def _train(trainer: Trainer, stop: StopSignals, context: RunContext) -> TrainSummary | None:
    config = trainer.config
    throughput = Throughput(config.tokens_per_step)
    saving = config.checkpoint.save_every
    started = time.perf_counter()
    outputs = open_outputs(trainer, context)
    try:
        losses, eval_losses = _run_steps(trainer, stop, outputs, throughput)
        stall = _finish_saves(trainer, saved_at_stop=bool(saving and trainer.step % saving == 0 and trainer.step < config.steps and losses))
    finally:
        outputs.close()
        if trainer.streamed:
            trainer.streamed.close()
    elapsed = time.perf_counter() - started
    snapshot_stall = trainer.snapshots.stall_seconds if trainer.snapshots else 0.0
    peak_and_stalls = torch.tensor([peak_memory_bytes(trainer.device), stall, snapshot_stall], dtype=torch.float64, device=trainer.device)
    trainer.comms.all_reduce(peak_and_stalls, None, op=dist.ReduceOp.MAX, label="peak memory and stalls")
    peak, stall, snapshot_stall = peak_and_stalls.tolist()
    if trainer.rank != 0:
        return None
    history = outputs.progress_log.history if outputs.progress_log else None
    resumed_from = trainer.resumed_from_step
    if history is not None and history.first_step is not None and config.checkpoint.resume:
        resumed_from = history.first_step  # a restart resumed from its own checkpoint; the run from --resume
    if history is not None:
        earlier = history.steps_before(trainer.start_step)
        losses = [history.losses[s] for s in earlier if s in history.losses] + losses
        eval_losses = [{"step": s, "loss": history.eval_losses[s]} for s in earlier if s in history.eval_losses] + eval_losses
    attempt = attempt_number()
    return TrainSummary(
        model=config.model.name,
        num_params=trainer.num_params,
        world_size=trainer.world_size,
        strategy=str(getattr(config.sharding.strategy, "value", config.sharding.strategy)),
        mixed_precision=precision_names(config.sharding.mixed_precision)[0],
        device=trainer.device.type,
        steps=trainer.step,
        resumed_from_step=resumed_from,
        optimizer_steps=trainer.optimizer_steps,
        global_batch_size=config.data.global_batch_size,
        seq_len=config.data.seq_len,
        losses=losses,
        eval_losses=eval_losses,
        tokens_per_second=config.tokens_per_step * (trainer.step - trainer.start_step) / elapsed,
        step_tokens_per_second=throughput.tokens_per_second,
        elapsed_seconds=elapsed,
        peak_memory_bytes=int(peak),
        checkpoint=trainer.checkpoints.last_saved,
        save_stall_s=stall,
        snapshot_stall_s=snapshot_stall,
        save_timings=dataclasses.asdict(timings) if (timings := trainer.checkpoints.timings) is not None else None,
        restarts=attempt,
        steps_redone=history.steps_redone(trainer.start_step) if history is not None else (0 if not attempt else None),
        preempted=trainer.stopping and trainer.step < config.steps,
        recoveries=History.of(read_records(context.progress_path)).recoveries() if context.progress_path else [],
        lr=config.peak_lr,
    )
