"""Profile terms fitted to the engine's own training steps on several local processes: the
values at which `fsdpkit plan --time` predicts the measured steps.

    link                 a model of many small units (LATENCY_MODEL) on 2 processes: what a
                         collective costs the engine beyond its bytes (issue, hooks, gloo's
                         handshakes); its step under grad-op, with fewer all-gathers, tells
                         what a reduction costs beyond an all-gather (the gradient's path);
                         `--model`'s step on 2 processes, whose collectives move more bytes
                         each, the bus bandwidth the engine's steps get (fitted within
                         BANDWIDTH_RANGE times either way of `fsdpkit bench`'s, which times
                         the collectives alone)
    all cores            `--model`'s step on one rank alone, and on each of as many ranks as
                         cores at once (all_cores_ranks; 2 at least), each on its own with no
                         collectives: how much slower a rank computes while the others keep
                         every core busy (all_cores_slowdown, the ratio of the two)
    more ranks           `--model` under its strategy and under grad-op, and LATENCY_MODEL, on
                         more processes (more_ranks: twice the cores, 4 to MAX_RANKS) give two
                         terms together, the pair (with the link fitted again for each) with
                         the least squared relative error on the three steps:
                           which share of that latency recurs per ring step, the rest being
                           fixed per collective (in steps of 0.1);
                           where those ranks outnumber the cores, how much slower than its
                           turns on a core a rank computes (compute_contention, in steps of 0.01)
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from .engine.config import Strategy
from .hardware import MAX_CONTENTION, Hardware
from .memory_plan import PlanRequest
from .step_time import shared_cores_seconds

if TYPE_CHECKING:
    from .calibrate import ModelRun
    from .time_plan import ModelCosts

MAX_RANKS = 8
LATENCY_MODEL = "fsdpkit.calibrate:many_narrow_units"
MAX_LATENCY_S = 0.1
BANDWIDTH_RANGE = 4.0  # the fitted bus bandwidth stays within this factor of the one fsdpkit bench measured
PER_STEP_SHARES = tuple(index / 10 for index in range(10, -1, -1))  # from 1: a ring's alpha-beta model where steps cannot tell
WARMUP_STEPS = 3
STEPS = 8  # at least


def fit_value(measured_s: float, step_at: Callable[[float], float], low: float, high: float) -> float:
    """The value in [low, high] at which `step_at` (the predicted step, which does not fall as
    the value grows) meets the measured step; an end of the range where it cannot. False position
    (Illinois), so that a step linear in the value, as the model's are, is met in a step or two."""
    at_low, at_high = step_at(low) - measured_s, step_at(high) - measured_s
    if at_high <= 0:
        return high
    if at_low >= 0:
        return low
    side = 0
    for _ in range(60):
        middle = (low * at_high - high * at_low) / (at_high - at_low)
        at_middle = step_at(middle) - measured_s
        if abs(at_middle) <= 1e-12 * measured_s or high - low <= 1e-12 * max(abs(high), 1e-12):
            return middle
        if at_middle < 0:
            low, at_low = middle, at_middle
            at_high = at_high / 2 if side == -1 else at_high
            side = -1
        else:
            high, at_high = middle, at_middle
            at_low = at_low / 2 if side == 1 else at_low
            side = 1
    return (low + high) / 2


def more_ranks(cores: int) -> int:
    """The processes the more-ranks steps run on: twice the cores, from 4 (so that a ring has more
    steps than between 2) to MAX_RANKS."""
    return max(4, min(2 * cores, MAX_RANKS))


def all_cores_ranks(cores: int) -> int:
    """The processes the all-cores step runs on: one per core, 2 to MAX_RANKS."""
    return max(2, min(cores, MAX_RANKS))


def link_runs(request: PlanRequest) -> tuple[PlanRequest, PlanRequest, PlanRequest]:
    """The steps the collectives' costs between 2 ranks are fitted to: LATENCY_MODEL under full
    (2N-1 all-gathers and N reduce-scatters of its N units) and under grad-op (N and N), whose
    difference is all-gathers alone; and `request`'s model, whose collectives move more bytes
    each (the bandwidth)."""
    full = _on_ranks(request, 2, model=LATENCY_MODEL)
    return full, _under_grad_op(full), _on_ranks(request, 2)


@dataclass(frozen=True)
class Placement:
    """A step measure() times: `run` on its world_size ranks, `copies` times side by side on the
    launch's first copies x world_size ranks, each copy on its own (no collectives between them)."""

    run: PlanRequest
    copies: int = 1

    @property
    def ranks(self) -> int:
        return self.copies * self.run.world_size


def all_cores_runs(request: PlanRequest, cores: int) -> tuple[Placement, Placement]:
    """The steps all_cores_slowdown is the ratio of: `request`'s model on one rank, alone and on
    each of all_cores_ranks(`cores`) ranks at once."""
    alone = _on_ranks(request, 1)
    return Placement(alone), Placement(alone, all_cores_ranks(cores))


def all_cores_slowdown(alone_s: float, at_once_s: float) -> float:
    """The ratio of all_cores_runs' two steps, within the profile's range."""
    return min(max(at_once_s / alone_s, 1.0), MAX_CONTENTION)


def more_ranks_runs(request: PlanRequest, cores: int) -> tuple[PlanRequest, PlanRequest, PlanRequest]:
    """The steps the more-ranks terms are fitted to, on more_ranks(`cores`) ranks: `request`'s
    model, LATENCY_MODEL, and `request`'s model under grad-op (fewer all-gathers, as much compute),
    so that the two terms are fitted to three steps rather than met by two."""
    ranks = more_ranks(cores)
    model = _on_ranks(request, ranks)
    return model, _on_ranks(request, ranks, model=LATENCY_MODEL), _under_grad_op(model)


def with_latency(profile: Hardware, latency_s: float, per_step: float) -> Hardware:
    """`profile` whose collective between 2 ranks costs `latency_s` beyond its bytes, `per_step`
    of it per ring step and the rest per collective."""
    per_ring_step = per_step * latency_s
    return replace(profile, intra_latency_s=per_ring_step, inter_latency_s=per_ring_step, collective_overhead_s=latency_s - per_ring_step)


@dataclass(frozen=True)
class Measured:
    """A step timed on `run`'s ranks, and the model's costs of it."""

    run: PlanRequest
    measured_s: float

    def predicted(self, profile: Hardware, costs: ModelCosts) -> float:
        """The model's step on `profile` (its ranks sharing a node's cores as the profile says)."""
        from .time_plan import predict

        return predict(self.run, profile, costs, per_node=self.run.world_size).time.step_time_s

    def alone(self, profile: Hardware, costs: ModelCosts) -> tuple[float, float]:
        """The model's (step, compute) with a core per rank."""
        from .time_plan import predict

        time = predict(self.run, replace(profile, compute_slots=0), costs, per_node=self.run.world_size).time
        return time.step_time_s, time.compute_s


def with_bandwidth(profile: Hardware, seconds_per_byte: float) -> Hardware:
    """`profile` whose collectives move a byte per rank in `seconds_per_byte`, inside nodes and between."""
    gbs = 1e-9 / seconds_per_byte
    return replace(profile, intra_bw_gbs=gbs, inter_bw_gbs=gbs)


def fit_link(profile: Hardware, steps: Sequence[Measured], per_step: float, costs_of: Callable[[PlanRequest], ModelCosts]) -> Hardware:
    """`profile` with the bus bandwidth, the latency and the reduction's extra fixed cost at which
    the model meets link_runs' three `steps`: the latency and the reduction's cost meet the first
    two at each bandwidth, the bandwidth the third, within BANDWIDTH_RANGE of `profile`'s. Where
    the third step's prediction does not grow as the bandwidth falls (its collectives move no more
    bytes each than the first's), the steps cannot tell the bandwidth and `profile`'s stays."""
    full, gathers_fewer, bytes_heavy = steps

    @functools.cache  # the range's ends and the bandwidth found are asked for again
    def at(seconds_per_byte: float) -> Hardware:
        return fit_latency(with_bandwidth(profile, seconds_per_byte), (full, gathers_fewer), per_step, costs_of(full.run))

    def step_at(seconds_per_byte: float) -> float:
        return bytes_heavy.predicted(at(seconds_per_byte), costs_of(bytes_heavy.run))

    benched = 1e-9 / profile.intra_bw_gbs
    low, high = benched / BANDWIDTH_RANGE, benched * BANDWIDTH_RANGE
    if step_at(high) - step_at(low) <= 1e-6 * bytes_heavy.measured_s:
        return at(benched)
    return at(fit_value(bytes_heavy.measured_s, step_at, low, high))


def fit_latency(profile: Hardware, steps: Sequence[Measured], per_step: float, costs: ModelCosts) -> Hardware:
    """`profile` with the collectives' latency between 2 ranks (`per_step` of it per ring step) and
    a reduction's extra fixed cost (`reduce_overhead_s`) at which the model meets the latency
    model's two `steps` (link_runs': under full and grad-op)."""
    full, gathers_fewer = steps

    def fitted_for(reduce_s: float) -> Hardware:
        reducing = replace(profile, reduce_overhead_s=reduce_s)

        def step_at(seconds: float) -> float:
            return full.predicted(with_latency(reducing, seconds, per_step), costs)

        return with_latency(reducing, fit_value(full.measured_s, step_at, 0.0, MAX_LATENCY_S), per_step)

    # along the latencies that meet the full step, the grad-op step grows with the reductions' share
    reduce_s = fit_value(gathers_fewer.measured_s, lambda seconds: gathers_fewer.predicted(fitted_for(seconds), costs), 0.0, MAX_LATENCY_S)
    return fitted_for(reduce_s)


def fit_collectives(profile: Hardware, link: Sequence[Measured], more: Sequence[Measured]) -> Hardware:
    """`profile` with the bus bandwidth, the collective latency, its share per ring step, the
    reductions' extra fixed cost and the compute contention that best predict the `link` steps
    (link_runs) and the `more` steps (more_ranks_runs), at `profile`'s all_cores_slowdown."""
    from .time_plan import model_costs

    by_units: dict[tuple, ModelCosts] = {}  # a model's costs are the same at every world size and strategy

    def costs_of(run: PlanRequest) -> ModelCosts:
        key = (run.config.model, run.sharding.bucket_bytes, run.config.data.seq_len)
        if key not in by_units:
            by_units[key] = model_costs(run)
        return by_units[key]

    ranks = more[0].run.world_size if more else 1
    fits = []
    for per_step in PER_STEP_SHARES if more else PER_STEP_SHARES[:1]:
        fitted = fit_link(profile, link, per_step, costs_of)
        steps = [SharedStep(step.measured_s, *step.alone(fitted, costs_of(step.run))) for step in more]
        contended = replace(fitted, compute_contention=best_contention(steps, fitted, ranks))
        fits.append((sum(step.error(contended.compute_slowdown(ranks)) for step in steps), contended))
    return min(fits, key=lambda fit: fit[0])[1]


@dataclass(frozen=True)
class SharedStep:
    """A step measured on shared cores, and the model's step and compute with a core per rank."""

    measured_s: float
    alone_s: float
    compute_s: float

    def predicted(self, slowdown: float) -> float:
        """As the step-time model charges compute that takes `slowdown` times as long."""
        return shared_cores_seconds(self.alone_s, self.compute_s, slowdown)

    def error(self, slowdown: float) -> float:
        return (self.predicted(slowdown) / self.measured_s - 1) ** 2


def best_contention(steps: Sequence[SharedStep], profile: Hardware, ranks_per_node: int) -> float:
    """The compute contention of `profile` with the least squared relative error on `steps`, taken on
    `ranks_per_node` ranks; 1 where those do not outnumber the cores."""
    if profile.compute_share(ranks_per_node) <= 1:
        return 1.0
    candidates = (1 + index / 100 for index in range(round((MAX_CONTENTION - 1) * 100) + 1))

    def error(contention: float) -> float:
        slowdown = replace(profile, compute_contention=contention).compute_slowdown(ranks_per_node)
        return sum(step.error(slowdown) for step in steps)

    return min(candidates, key=error)


def _under_grad_op(run: PlanRequest) -> PlanRequest:
    """`run` sharded under grad-op: the same compute, fewer all-gathers."""
    config = run.config
    return PlanRequest(replace(config, sharding=replace(config.sharding, strategy=Strategy.GRAD_OP)), run.world_size)


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


def measure(placements: Sequence[Placement], seconds: float) -> list[Measured]:
    """The engine's steps of `placements`, launched once on as many ranks as the largest takes
    (each on the first of them) and taken in turns, so that a drifting machine speed moves them
    alike; timed until they total at least `seconds` (and STEPS each)."""
    from .dist.launch import LaunchOptions, launch

    ranks = max(placement.ranks for placement in placements)
    medians = launch(_measured_steps, list(placements), seconds, options=LaunchOptions(nproc_per_node=ranks))[0]
    return [Measured(placement.run, median) for placement, median in zip(placements, medians, strict=True)]


def on_first_ranks(placement: Placement) -> tuple[Any, ModelRun | None]:
    """(process group of its ranks, the engine's model of this rank's copy) of `placement` on the
    first ranks of the launch; the group is None where that is every rank, the model None on the
    other ranks. Every rank must call it, as new_group requires."""
    import torch.distributed as dist

    from .calibrate import ModelRun

    run, world, rank = placement.run, dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(placement.ranks))) if placement.ranks < world else None
    if placement.copies == 1:
        own = group
    else:
        copies = [dist.new_group(list(range(start, start + run.world_size))) for start in range(0, placement.ranks, run.world_size)]
        own = copies[rank // run.world_size] if rank < placement.ranks else None
    return group, ModelRun(run, run.model, group=own) if rank < placement.ranks else None


def _measured_steps(placements: list[Placement], seconds: float) -> list[float]:
    """One rank's part: for each placement, the median of the slowest rank's training step over at
    least STEPS rounds (after WARMUP_STEPS) and until the rounds total `seconds`."""
    import torch.distributed as dist

    from .time_plan import micro_batch

    dist.init_process_group("gloo")
    try:
        models = [on_first_ranks(placement)[1] for placement in placements]  # every rank makes every group, as new_group requires
        steps: list[list[float]] = [[] for _ in placements]
        index = 0
        while index < WARMUP_STEPS + STEPS or sum(map(sum, steps)) < seconds:  # the same on every rank: maxima over ranks
            for placement, model, times in zip(placements, models, steps, strict=True):
                dist.barrier()
                elapsed = torch.tensor([sum(model.step(micro_batch(placement.run))) if model is not None else 0.0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if index >= WARMUP_STEPS:
                    times.append(float(elapsed))
            index += 1
        return [statistics.median(times) for times in steps]
    finally:
        dist.destroy_process_group()
