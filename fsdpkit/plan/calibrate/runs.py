"""Which steps calibration times: the models whose single-rank steps give the compute
terms, and the steps on several local processes the collective and shared-core terms are
fitted to (calibrate.fit), at which `fsdpkit plan --time` predicts them.
Profile terms fitted to the engine's own training steps on several local processes: the
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

from dataclasses import dataclass, replace

from ...engine.config import Strategy
from ..request import PlanRequest

MAX_RANKS = 8

LATENCY_MODEL = "fsdpkit.plan.calibrate.runs:many_narrow_units"


def many_narrow_units():
    """A calibration model: 16 blocks of 96 wide (the cost per unit and per tensor shows)."""
    from ...models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=16, n_head=2, n_embd=96))


def few_wide_units():
    """A calibration model: 2 blocks of 512 wide (the cost per parameter byte shows)."""
    from ...models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=512))


CALIBRATION_MODELS = ("fsdpkit.plan.calibrate.runs:many_narrow_units", "fsdpkit.plan.calibrate.runs:few_wide_units")

CALIBRATION_BATCHES = (1, 4)  # sequences per step: each model at both


def calibration_specs(request: PlanRequest) -> tuple[str, ...]:
    """The models whose steps give the compute terms: `--model` and the calibration models."""
    return (request.model, *(spec for spec in CALIBRATION_MODELS if spec != request.model))


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
    full = on_ranks(request, 2, model=LATENCY_MODEL)
    return full, under_grad_op(full), on_ranks(request, 2)


@dataclass(frozen=True)
class TimedStep:
    """A step measure() times: `run` on its world_size ranks, `copies` times side by side on the
    launch's first copies x world_size ranks, each copy on its own (no collectives between them)."""

    run: PlanRequest
    copies: int = 1

    @property
    def ranks(self) -> int:
        return self.copies * self.run.world_size


def all_cores_runs(request: PlanRequest, cores: int) -> tuple[TimedStep, TimedStep]:
    """The steps all_cores_slowdown is the ratio of: `request`'s model on one rank, alone and on
    each of all_cores_ranks(`cores`) ranks at once."""
    alone = on_ranks(request, 1)
    return TimedStep(alone), TimedStep(alone, all_cores_ranks(cores))


def more_ranks_runs(request: PlanRequest, cores: int) -> tuple[PlanRequest, PlanRequest, PlanRequest]:
    """The steps the more-ranks terms are fitted to, on more_ranks(`cores`) ranks: `request`'s
    model, LATENCY_MODEL, and `request`'s model under grad-op (fewer all-gathers, as much compute),
    so that the two terms are fitted to three steps rather than met by two."""
    ranks = more_ranks(cores)
    model = on_ranks(request, ranks)
    return model, on_ranks(request, ranks, model=LATENCY_MODEL), under_grad_op(model)


def under_grad_op(run: PlanRequest) -> PlanRequest:
    """`run` sharded under grad-op: the same compute, fewer all-gathers."""
    return replace(run, sharding=replace(run.sharding, strategy=Strategy.GRAD_OP))


def on_ranks(request: PlanRequest, ranks: int, *, model: str | None = None) -> PlanRequest:
    """`request` with one micro-batch of as many sequences per rank, on `ranks` ranks; with
    `model`, that model instead, one unit per block (no bucketing: its point is many units),
    in the engine's run and in the prediction alike."""
    run = replace(request, world_size=ranks, global_batch_size=request.micro_batch * ranks, grad_accum=1, no_sync=False)
    if model is None:
        return run
    return replace(run, model=model, wrap=(), wrap_min_params=None, wrap_every=1, sharding=replace(run.sharding, bucket_bytes=0))
