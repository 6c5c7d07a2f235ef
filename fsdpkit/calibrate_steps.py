"""Profile terms fitted to the engine's own training steps on several local processes: the
value at which `fsdpkit plan --time` predicts the measured step.

    collective_latency   a model of many small units (fsdpkit.calibrate:many_narrow_units)
                         on `ranks` processes: what each ring step of a collective costs the
                         engine (issue, hooks, gloo's handshakes), beyond its bytes
    waiting_holds_core   `--model` and the many-unit model on twice as many processes as
                         cores (up to SHARED_CORES_MAX_RANKS): how much of its waiting in
                         collectives a rank still keeps a core busy; the value in [0, 1], in
                         steps of 0.02, with the least squared relative error on the two
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .hardware import Hardware
from .memory_plan import PlanRequest
from .step_time import shared_cores_seconds

SHARED_CORES_MAX_RANKS = 8
LATENCY_MODEL = "fsdpkit.calibrate:many_narrow_units"
MAX_LATENCY_S = 0.1
WARMUP_STEPS = 3
STEPS = 8


def fit_value(measured_s: float, step_at: Callable[[float], float], low: float, high: float) -> float:
    """The value in [low, high] at which `step_at` (the predicted step, which does not fall as
    the value grows) meets the measured step; an end of the range where it cannot."""
    if step_at(high) <= measured_s:
        return high
    if step_at(low) >= measured_s:
        return low
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if step_at(middle) < measured_s else (low, middle)
    return (low + high) / 2


def collective_latency(request: PlanRequest, profile: Hardware, ranks: int) -> float:
    """The latency per ring step at which the model predicts the engine's step of LATENCY_MODEL."""
    from .time_plan import model_costs, predict

    run = _on_ranks(request, ranks, model=LATENCY_MODEL)
    measured, costs = _measure(run), model_costs(run)

    def step_at(latency: float) -> float:
        with_latency = replace(profile, intra_latency_s=latency, inter_latency_s=latency)
        return predict(run, with_latency, costs, per_node=ranks).time.step_time_s

    return fit_value(measured, step_at, 0.0, MAX_LATENCY_S)


def waiting_holds_core(request: PlanRequest, profile: Hardware) -> float:
    """Fitted to the engine's steps of `request`'s model and of LATENCY_MODEL on twice as many
    processes as `profile.compute_slots`."""
    from .time_plan import model_costs, predict

    ranks = 2 * profile.compute_slots
    share = profile.compute_share(ranks)
    parts = []
    for model in (None, LATENCY_MODEL):
        run = _on_ranks(request, ranks, model=model)
        alone = predict(run, replace(profile, compute_slots=0), model_costs(run), per_node=ranks).time
        parts.append(SharedStep(_measure(run), alone.step_time_s, alone.compute_s, alone.copy_s))
    return fit_waiting_share(parts, share)


@dataclass(frozen=True)
class SharedStep:
    """A step measured on shared cores, and the model's parts of it with a core per rank."""

    measured_s: float
    alone_s: float
    compute_s: float
    copy_s: float

    def predicted(self, share: float, waiting: float) -> float:
        """As the step-time model charges `share` ranks per core (without overlap)."""
        return shared_cores_seconds(self.alone_s, self.compute_s + self.copy_s, share, waiting)


def fit_waiting_share(steps: Sequence[SharedStep], share: float) -> float:
    def error(waiting: float) -> float:
        return sum((step.predicted(share, waiting) / step.measured_s - 1) ** 2 for step in steps)

    return min((index / 50 for index in range(51)), key=lambda waiting: (error(waiting), -waiting))


def _on_ranks(request: PlanRequest, ranks: int, *, model: str | None = None) -> PlanRequest:
    """`request` with one micro-batch of as many sequences per rank, on `ranks` ranks; with
    `model`, that model instead, one unit per block (no bucketing: its point is many units),
    in the engine's run and in the prediction alike."""
    from .time_plan import micro_batch

    config, data = request.config, request.config.data
    per_rank = micro_batch(request)
    config = replace(config, data=replace(data, global_batch_size=per_rank * ranks, grad_accum=1))
    if model is not None:
        config = replace(
            config,
            model=replace(config.model, name=model, wrap=(), wrap_min_params=None, wrap_every=1),
            sharding=replace(config.sharding, bucket_bytes=0),
        )
    return PlanRequest(config, ranks)


def _measure(run: PlanRequest) -> float:
    from .launch import LaunchOptions, launch

    return launch(_measured_step, run, options=LaunchOptions(nproc_per_node=run.world_size))[0]


def _measured_step(request: PlanRequest) -> float:
    """One rank's part: the median over STEPS (after WARMUP_STEPS) of the slowest rank's training step."""
    import torch.distributed as dist

    from .calibrate import ModelRun
    from .time_plan import micro_batch

    dist.init_process_group("gloo")
    try:
        run = ModelRun(request, request.model)
        steps = []
        for index in range(WARMUP_STEPS + STEPS):
            dist.barrier()
            elapsed = torch.tensor([sum(run.step(micro_batch(request)))])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if index >= WARMUP_STEPS:
                steps.append(float(elapsed))
        return statistics.median(steps)
    finally:
        dist.destroy_process_group()
