"""The profile's terms fitted to what calibrate.measure timed: the compute terms by
non-negative least squares over single-rank steps, and the collective and shared-core terms by
finding the values at which the step-time model (fsdpkit.plan.predict) meets the steps
measured on several processes (calibrate.runs)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..predict import ModelCosts, model_costs
from ..profile import MAX_CONTENTION, FittedTerms, Hardware
from ..request import PlanRequest
from ..simulate import shared_cores_seconds
from .measure import Measured, MemoryRates, StepSample
from .runs import calibration_specs

MAX_LATENCY_S = 0.1

BANDWIDTH_RANGE = 4.0  # the fitted bus bandwidth stays within this factor of the one fsdpkit bench measured

PER_STEP_SHARES = tuple(index / 10 for index in range(10, -1, -1))  # from 1: a ring's alpha-beta model where steps cannot tell


def root_of_nondecreasing(measured_s: float, step_at: Callable[[float], float], low: float, high: float) -> float:
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


@dataclass(frozen=True)
class ComputeTerms:
    seconds_per_flop: float
    unit_overhead_s: float
    seconds_per_param_byte: float
    optimizer_tensor_s: float
    optimizer_passes: float


def fit_nonnegative(rows: Sequence[Sequence[float]], ys: Sequence[float], *, scales: Sequence[float] | None = None) -> list[float]:
    """Least-squares coefficients of ys against the columns of rows, none negative: a column
    whose coefficient comes out negative is dropped (coefficient 0) and the rest refitted.
    With `scales`, each row and its y count divided by its scale."""
    if scales is not None:
        rows = [[value / scale for value in row] for row, scale in zip(rows, scales, strict=True)]
        ys = [y / scale for y, scale in zip(ys, scales, strict=True)]
    active = list(range(len(rows[0])))
    while active:
        a = torch.tensor([[row[j] for j in active] for row in rows], dtype=torch.float64)
        scale = a.abs().amax(dim=0).clamp(min=1e-300)
        b = torch.tensor(list(ys), dtype=torch.float64).unsqueeze(1)
        solution = (torch.linalg.lstsq(a / scale, b, driver="gelsd").solution.squeeze(1) / scale).tolist()
        if min(solution) >= 0:
            coefficients = [0.0] * len(rows[0])
            for j, value in zip(active, solution, strict=True):
                coefficients[j] = value
            return coefficients
        active.pop(solution.index(min(solution)))
    return [0.0] * len(rows[0])


def compute_terms(samples: Sequence[StepSample]) -> ComputeTerms:
    """The compute terms of the profile, fitted over every sample (several models and batch
    sizes) with the least squared error relative to each measured time, so that a short step
    counts as much as a long one."""
    per_flop, per_unit, per_byte = fit_nonnegative(
        [(s.flops, s.unit_passes, s.param_bytes) for s in samples],
        [s.forward_backward_s - s.memory_s for s in samples],
        scales=[s.forward_backward_s for s in samples],
    )
    per_tensor, extra_passes = fit_nonnegative(
        [(s.tensors, s.optimizer_memory_s) for s in samples],
        [s.optimizer_s - s.optimizer_memory_s for s in samples],
        scales=[s.optimizer_s for s in samples],
    )
    return ComputeTerms(per_flop, per_unit, per_byte, per_tensor, 1.0 + extra_passes)


def measured_profile(
    request: PlanRequest, compute: tuple[float, MemoryRates, list[StepSample]], network: tuple[float, float], ranks: int
) -> Hardware:
    """The profile from measure_steps' (peak, memory rates, samples) and network_line's
    (latency, bus bandwidth) on `ranks` ranks, before fit_collectives."""
    peak, memory, samples = compute
    terms = compute_terms(samples)
    if terms.seconds_per_flop > 0:  # the models' matrix products may outrun the probe's
        peak = max(peak, 1.0 / terms.seconds_per_flop)
    latency, bandwidth = network
    return Hardware(
        name="calibrated",
        source=f"measured by fsdpkit plan --calibrate on this machine ({', '.join(calibration_specs(request))}; {ranks} gloo ranks)",
        peak_tflops={"fp32": peak / 1e12},
        fitted=FittedTerms(
            efficiency=1.0 / terms.seconds_per_flop / peak if terms.seconds_per_flop > 0 else 1.0,
            unit_overhead_s=terms.unit_overhead_s,
            param_passes=terms.seconds_per_param_byte * memory.elementwise,
            optimizer_tensor_s=terms.optimizer_tensor_s,
            optimizer_passes=terms.optimizer_passes,
        ),
        memory_gb=_memory_gb(),
        memory_bw_gbs=memory.copy / 1e9,
        memory_efficiency=memory.efficiency,
        ranks_per_node=1024,
        intra_bw_gbs=bandwidth / 1e9,
        intra_latency_s=latency,
        inter_bw_gbs=bandwidth / 1e9,
        inter_latency_s=latency,
        host_bw_gbs=memory.copy / 1e9,
        overlap=False,
        compute_slots=len(os.sched_getaffinity(0)),
    )


def _memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def all_cores_slowdown(alone_s: float, at_once_s: float) -> float:
    """The ratio of all_cores_runs' two steps, within the profile's range."""
    return min(max(at_once_s / alone_s, 1.0), MAX_CONTENTION)


def with_latency(profile: Hardware, latency_s: float, per_step: float) -> Hardware:
    """`profile` whose collective between 2 ranks costs `latency_s` beyond its bytes, `per_step`
    of it per ring step and the rest per collective."""
    per_ring_step = per_step * latency_s
    return profile.with_values(
        intra_latency_s=per_ring_step, inter_latency_s=per_ring_step, collective_overhead_s=latency_s - per_ring_step
    )


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
    return at(root_of_nondecreasing(bytes_heavy.measured_s, step_at, low, high))


def fit_latency(profile: Hardware, steps: Sequence[Measured], per_step: float, costs: ModelCosts) -> Hardware:
    """`profile` with the collectives' latency between 2 ranks (`per_step` of it per ring step) and
    a reduction's extra fixed cost (`reduce_overhead_s`) at which the model meets the latency
    model's two `steps` (link_runs': under full and grad-op)."""
    full, gathers_fewer = steps

    def fitted_for(reduce_s: float) -> Hardware:
        reducing = profile.with_values(reduce_overhead_s=reduce_s)

        def step_at(seconds: float) -> float:
            return full.predicted(with_latency(reducing, seconds, per_step), costs)

        return with_latency(reducing, root_of_nondecreasing(full.measured_s, step_at, 0.0, MAX_LATENCY_S), per_step)

    # along the latencies that meet the full step, the grad-op step grows with the reductions' share
    reduce_s = root_of_nondecreasing(
        gathers_fewer.measured_s, lambda seconds: gathers_fewer.predicted(fitted_for(seconds), costs), 0.0, MAX_LATENCY_S
    )
    return fitted_for(reduce_s)


def fit_collectives(profile: Hardware, link: Sequence[Measured], more: Sequence[Measured]) -> Hardware:
    """`profile` with the bus bandwidth, the collective latency, its share per ring step, the
    reductions' extra fixed cost and the compute contention that best predict the `link` steps
    (link_runs) and the `more` steps (more_ranks_runs), at `profile`'s all_cores_slowdown."""
    by_units: dict[tuple, ModelCosts] = {}  # a model's costs are the same at every world size and strategy

    def costs_of(run: PlanRequest) -> ModelCosts:
        key = run.units_key
        if key not in by_units:
            by_units[key] = model_costs(run)
        return by_units[key]

    ranks = more[0].run.world_size if more else 1
    fits = []
    for per_step in PER_STEP_SHARES if more else PER_STEP_SHARES[:1]:
        fitted = fit_link(profile, link, per_step, costs_of)
        steps = [SharedStep(step.measured_s, *step.alone(fitted, costs_of(step.run))) for step in more]
        contended = fitted.with_values(compute_contention=best_contention(steps, fitted, ranks))
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
        slowdown = profile.with_values(compute_contention=contention).compute_slowdown(ranks_per_node)
        return sum(step.error(slowdown) for step in steps)

    return min(candidates, key=error)
