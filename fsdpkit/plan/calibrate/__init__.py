"""`fsdpkit plan --calibrate OUT.toml`: a hardware profile of this machine, measured.

    memory    a large copy gives the memory bandwidth, a large elementwise sum the share of
              it that bandwidth-bound kernels reach (memory_efficiency: the optimizer step,
              the operators that are not matrix products, the loss, the casts)
    compute   a large matrix product gives the peak; the engine's training step on one
              rank of several models (`--model` and two of many narrow and few wide units)
              at two micro-batch sizes, taking turns, gives by non-negative least squares
              the achieved fraction of the peak (efficiency), the cost per unit and pass
              and per parameter byte and pass, and the optimizer's cost per tensor and its
              traffic over its kernels'. The cost per operator is not fitted (0): these
              models' operators grow with their units, so the two cannot be told apart
    network   `fsdpkit bench` of the engine's all-gather and reduce-scatter on `ranks` local
              processes: the least-squares line of time against size gives the bus
              bandwidth of the collectives alone (slope; the median over several launches);
              `--model`'s step on one rank alone and on a rank per core at once gives how
              much slower a rank computes while the others keep every core busy; the
              engine's steps of a model of many units on 2 processes under full and grad-op,
              of `--model` on 2, and of both on more, give what a collective costs beyond
              its bytes, what a reduction costs beyond an all-gather, the bus bandwidth the
              steps get, how much of the latency recurs per ring step, and how much slower
              still a rank computes where ranks outnumber cores

calibrate.runs says which steps are timed, calibrate.measure times them and calibrate.fit
fits the profile's terms to them.

Numbers are medians of repeated timings, each going on for at least `--calibrate-seconds`:
a shared machine's speed can drift by 15% within seconds (a virtual machine's neighbours), so
a longer calibration lands nearer its average. A loaded machine gives a slower profile.
"""

from __future__ import annotations

import sys

from ..profile import CALIBRATE_SECONDS, Hardware
from ..request import PlanRequest
from .fit import all_cores_slowdown, fit_collectives, measured_profile
from .measure import measure, measure_steps, network_line
from .runs import CALIBRATION_BATCHES, TimedStep, all_cores_runs, calibration_specs, link_runs, more_ranks_runs


def calibrate(request: PlanRequest, *, ranks: int = 2, seconds: float = CALIBRATE_SECONDS) -> Hardware:
    """The compute terms time training steps for at least `seconds`, the busy cores, latency and
    more-ranks terms (taken in turns) for twice that: the longer, the more of a machine's
    drifting speed is averaged over."""
    from tqdm import tqdm

    from ...dist.launch import LaunchOptions, launch

    with tqdm(total=3, desc="calibrate", unit="part", file=sys.stderr, disable=None, leave=False) as progress:
        progress.set_postfix_str("compute, one rank")
        # in a launched rank, as training runs its steps
        one_rank = LaunchOptions(nproc_per_node=1)
        compute = launch(measure_steps, request, calibration_specs(request), CALIBRATION_BATCHES, seconds, options=one_rank)[0]
        progress.update()
        progress.set_postfix_str(f"bus bandwidth, {ranks} ranks")
        profile = measured_profile(request, compute, network_line(ranks, seconds), ranks)
        progress.update()
        all_cores, more = all_cores_runs(request, profile.compute_slots), more_ranks_runs(request, profile.compute_slots)
        progress.set_postfix_str(f"collectives on 2 ranks, compute on {all_cores[1].ranks} at once, steps on {more[0].world_size}")
        alone, at_once, full, gathers_fewer, bytes_heavy, *more_steps = measure(
            [*all_cores, *map(TimedStep, (*link_runs(request), *more))], 2 * seconds
        )
        progress.update()
    profile = profile.with_values(all_cores_slowdown=all_cores_slowdown(alone.measured_s, at_once.measured_s))
    return fit_collectives(profile, [full, gathers_fewer, bytes_heavy], more_steps)
