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
STEPS = 8  # at least


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


def latency_run(request: PlanRequest, ranks: int) -> PlanRequest:
    """The step collective_latency times: LATENCY_MODEL on `ranks` ranks."""
    return _on_ranks(request, ranks, model=LATENCY_MODEL)


def fit_latency(run: PlanRequest, profile: Hardware, measured_s: float) -> float:
    """The latency per ring step at which the model predicts `measured_s` for the step of `run`."""
    from .time_plan import model_costs, predict

    costs = model_costs(run)

    def step_at(latency: float) -> float:
        with_latency = replace(profile, intra_latency_s=latency, inter_latency_s=latency)
        return predict(run, with_latency, costs, per_node=run.world_size).time.step_time_s

    return fit_value(measured_s, step_at, 0.0, MAX_LATENCY_S)


def collective_latency(request: PlanRequest, profile: Hardware, ranks: int, seconds: float) -> float:
    """The latency per ring step at which the model predicts the engine's step of LATENCY_MODEL."""
    run = latency_run(request, ranks)
    return fit_latency(run, profile, _measure(run, seconds))


def waiting_runs(request: PlanRequest, ranks: int) -> tuple[PlanRequest, PlanRequest]:
    """The steps waiting_holds_core times: `request`'s model and LATENCY_MODEL on `ranks` ranks."""
    return _on_ranks(request, ranks), _on_ranks(request, ranks, model=LATENCY_MODEL)


def fit_waiting(runs: Sequence[PlanRequest], profile: Hardware, measured_s: Sequence[float]) -> float:
    """The waiting share at which the model best predicts `measured_s` for the steps of `runs`."""
    from .time_plan import model_costs, predict

    parts = []
    for run, measured in zip(runs, measured_s, strict=True):
        alone = predict(run, replace(profile, compute_slots=0), model_costs(run), per_node=run.world_size).time
        parts.append(SharedStep(measured, alone.step_time_s, alone.compute_s, alone.copy_s))
    return fit_waiting_share(parts, profile.compute_share(runs[0].world_size))


def waiting_holds_core(request: PlanRequest, profile: Hardware, seconds: float) -> float:
    """Fitted to waiting_runs on twice as many processes as `profile.compute_slots`."""
    runs = waiting_runs(request, 2 * profile.compute_slots)
    return fit_waiting(runs, profile, [_measure(run, seconds / 2) for run in runs])


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


def _measure(run: PlanRequest, seconds: float) -> float:
    from .launch import LaunchOptions, launch

    return launch(_measured_step, run, seconds, options=LaunchOptions(nproc_per_node=run.world_size))[0]


def _measured_step(request: PlanRequest, seconds: float) -> float:
    """One rank's part: the median of the slowest rank's training step over at least STEPS
    steps and `seconds` (after WARMUP_STEPS)."""
    import torch.distributed as dist

    from .calibrate import ModelRun
    from .time_plan import micro_batch

    dist.init_process_group("gloo")
    try:
        run = ModelRun(request, request.model)
        steps: list[float] = []
        index = 0
        while index < WARMUP_STEPS + STEPS or sum(steps) < seconds:  # the same on every rank: maxima over ranks
            dist.barrier()
            elapsed = torch.tensor([sum(run.step(micro_batch(request)))])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if index >= WARMUP_STEPS:
                steps.append(float(elapsed))
            index += 1
        return statistics.median(steps)
    finally:
        dist.destroy_process_group()
