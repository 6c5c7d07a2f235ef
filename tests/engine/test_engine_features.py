"""The engine's training features against unsharded references computed in the same worker
(world size 2): mixed precision, the fp16 sharded grad scaler, CPU offload, deferred meta
init, activation checkpointing, frozen parameters, no_sync accumulation, nested units and
K blocks per unit, and prefetching (identical results, and the event order that proves the
next all-gather was issued before the current unit's compute finished)."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from support.distributed import run_distributed

import fsdpkit
from fsdpkit.dist.comm import CommStats
from fsdpkit.engine.flat_unit import UnitState
from fsdpkit.engine.sharded import get_state
from fsdpkit.models.gpt import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18)


def _tokens(step: int, rows: int = 4) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (rows, 17), generator=torch.Generator().manual_seed(7 + step))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())


def _local(tokens: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = tokens.shape[0] // world
    return tokens[rank * rows : (rank + 1) * rows]


def _global_loss(loss: torch.Tensor) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _max_weight_error(sharded: nn.Module, reference: nn.Module) -> float:
    full = fsdpkit.full_state_dict(sharded)
    return max(((full[n] - t).norm() / t.norm()).item() for n, t in reference.state_dict().items())


T = TypeVar("T")


@dataclass
class Outcome(Generic[T]):
    """One check's result, or the error it raised (the other checks still run)."""

    value: T | None = None
    error: str | None = None

    def get(self) -> T:
        assert self.error is None, self.error
        return self.value


def _attempt(check: Callable[..., T], *args: Any, **kwargs: Any) -> Outcome[T]:
    try:
        return Outcome(check(*args, **kwargs))
    except Exception:
        return Outcome(error=traceback.format_exc(limit=-4))


@dataclass
class PairResult:
    weight_error: float  # max relative error of the trained weights vs the unsharded reference
    frozen_unchanged: bool
    frozen_grads_none: bool
    frozen_without_state: bool
    reduce_scatters: list[int]  # per step
    units: int
    offloaded: bool


def _train_pair(steps: int, *, freeze: tuple[str, ...] = (), micro: int = 1, no_sync: bool = False, **shard_kwargs) -> PairResult:
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    for name, param in reference.named_parameters():
        param.requires_grad_(name not in freeze)
    frozen_before = {n: p.detach().clone() for n, p in reference.named_parameters() if n in freeze}
    stats = CommStats()
    sharded = fsdpkit.shard(copy.deepcopy(reference), wrap=shard_kwargs.pop("wrap", (Block,)), comm_stats=stats, **shard_kwargs)
    ref_opt = torch.optim.AdamW(fsdpkit.param_groups(reference, weight_decay=0.1), lr=3e-3)
    opt = torch.optim.AdamW(fsdpkit.param_groups(sharded, weight_decay=0.1), lr=3e-3)
    losses, reduce_scatters = [], []
    for step in range(steps):
        tokens = _tokens(step, rows=4 * micro)
        stats.reset()
        for index, chunk in enumerate(tokens.chunk(micro)):
            (_loss(reference, chunk) / micro).backward()
            use_no_sync = no_sync and index < micro - 1
            with fsdpkit.no_sync(sharded) if use_no_sync else torch.enable_grad():
                (_loss(sharded, _local(chunk)) / micro).backward()
        reduce_scatters.append(stats.calls.get("reduce_scatter", 0))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        losses.append(_global_loss(_loss(sharded, _local(tokens[:4]))))
    full = fsdpkit.full_state_dict(sharded)
    return PairResult(
        weight_error=max(((full[n] - t).norm() / t.norm()).item() for n, t in reference.state_dict().items() if n not in freeze),
        frozen_unchanged=all(torch.equal(full[n], t) for n, t in frozen_before.items()),
        frozen_grads_none=all(p.grad is None for n, p in sharded.named_parameters() if n in freeze),
        frozen_without_state=all(p not in opt.state for n, p in sharded.named_parameters() if n in freeze),
        reduce_scatters=reduce_scatters,
        units=len(get_state(sharded).units),
        offloaded=all(unit.flat_shard.device.type == "cpu" and unit.offload for unit in get_state(sharded).units),
    )


@dataclass
class PrecisionRun:
    losses: list[float]
    gather_bytes: int
    master_dtypes: list[str]
    int_buffer: str
    float_buffer: str


@dataclass
class MixedPrecisionResult:
    fp32: PrecisionRun
    bf16: PrecisionRun
    reference_losses: list[float]  # bf16 reference that casts its parameters once per step
    bf16_weight_error: float  # matrices, per tensor
    bf16_model_error: float  # whole model


def mixed_precision_checks() -> MixedPrecisionResult:
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    reference.register_buffer("position_ids", torch.arange(16), persistent=False)
    reference.register_buffer("scale_buffer", torch.ones(3))
    runs, weights = {}, {}
    for name in ("none", "bf16"):
        stats = CommStats()
        policy = (
            fsdpkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
            if name == "bf16"
            else None
        )
        sharded = fsdpkit.shard(copy.deepcopy(reference), wrap=(Block,), mixed_precision=policy, comm_stats=stats)
        opt = torch.optim.AdamW(fsdpkit.param_groups(sharded, weight_decay=0.1), lr=3e-3)
        losses = []
        for step in range(3):
            stats.reset()
            loss = _loss(sharded, _local(_tokens(step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_global_loss(loss))
        runs[name] = PrecisionRun(
            losses,
            stats.bytes["all_gather"],
            sorted({str(p.dtype) for p in sharded.parameters()}),
            str(sharded.position_ids.dtype),
            str(sharded.scale_buffer.dtype),
        )
        weights[name] = fsdpkit.full_state_dict(sharded)
    # the reference casts its parameters once per step, as the engine does once per unit
    master = copy.deepcopy(reference)
    opt = torch.optim.AdamW(fsdpkit.param_groups(master, weight_decay=0.1), lr=3e-3)
    ref_losses = []
    for step in range(3):
        low = copy.deepcopy(master).to(torch.bfloat16)
        loss = _loss(low, _tokens(step))
        loss.backward()
        for p_master, p_low in zip(master.parameters(), low.parameters(), strict=True):
            p_master.grad = p_low.grad.float()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    # Matrices per tensor; zero-initialised biases (a few Adam steps of bf16 noise, signs
    # flipping) only in the whole-model norm.
    floats = {n: t for n, t in master.state_dict().items() if t.is_floating_point()}
    bf16 = weights["bf16"]
    return MixedPrecisionResult(
        fp32=runs["none"],
        bf16=runs["bf16"],
        reference_losses=ref_losses,
        bf16_weight_error=max(((bf16[n] - t).norm() / t.norm()).item() for n, t in floats.items() if t.dim() >= 2),
        bf16_model_error=(
            sum(float((bf16[n] - t).pow(2).sum()) for n, t in floats.items()) / sum(float(t.pow(2).sum()) for t in floats.values())
        )
        ** 0.5,
    )


@dataclass
class ScalerResult:
    skip_returned: bool
    unchanged_after_skip: bool
    scale_after: float
    stepped: bool
    step_count: int


def grad_scaler_checks() -> ScalerResult:
    torch.manual_seed(0)
    model = fsdpkit.shard(GPT(CONFIG), wrap=(Block,), mixed_precision="fp16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fsdpkit.ShardedGradScaler(model, init_scale=1024.0)
    before = fsdpkit.full_state_dict(model)
    scaler.scale(_loss(model, _local(_tokens(0)))).backward()
    if dist.get_rank() == 1:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
    skipped_stepped = scaler.step(opt)
    scaler.update()
    after_skip = fsdpkit.full_state_dict(model)
    opt.zero_grad()
    scaler.scale(_loss(model, _local(_tokens(1)))).backward()
    stepped = scaler.step(opt)
    scaler.update()
    return ScalerResult(
        skip_returned=skipped_stepped,
        unchanged_after_skip=all(torch.equal(before[n], after_skip[n]) for n in before),
        scale_after=scaler.scale_value,
        stepped=stepped,
        step_count=max(int(s["step"]) for s in opt.state.values()),
    )


@dataclass
class DeferredResult:
    equal: bool
    tied: bool
    no_meta: bool


def deferred_init_checks() -> DeferredResult:
    torch.manual_seed(5)
    eager = GPT(CONFIG)
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = GPT(CONFIG)
    sharded = fsdpkit.shard(meta, wrap=(Block,))
    full = fsdpkit.full_state_dict(sharded)
    with fsdpkit.full_params(sharded):
        tied = sharded.lm_head.weight is sharded.wte.weight
    return DeferredResult(
        equal=all(torch.equal(full[n], t) for n, t in eager.state_dict().items()),
        tied=tied,
        no_meta=not any(p.is_meta for p in sharded.parameters()),
    )


@dataclass
class GenericInitResult:
    initialised: bool
    bias_in_kaiming_bound: bool
    odd_error: str  # a parameter no reset_parameters() sets
    buffer_error: str  # a meta buffer fsdpkit cannot recompute


def _shard_error(model: nn.Module) -> str:
    try:
        fsdpkit.shard(model)
        return "no error"
    except Exception as error:
        return str(error)


def deferred_generic_checks() -> GenericInitResult:
    """Models without init_parameter: each module's reset_parameters(); anything left
    uninitialised, or a buffer that cannot be recomputed, is an error, never garbage."""
    from support.models import EdgeCaseNet

    def layers():
        return nn.Sequential(nn.Linear(4, 8), nn.ModuleList([nn.Linear(8, 8), nn.LayerNorm(8)]), nn.Linear(8, 2))

    with torch.device("meta"):
        plain = layers()
    sharded = fsdpkit.shard(plain, wrap=lambda name, module: name == "1.0")
    full = fsdpkit.full_state_dict(sharded)
    with torch.device("meta"):
        odd = EdgeCaseNet()  # OddUnit.scale has no module that can reset it
        masked = layers()
        masked.register_buffer("mask", torch.ones(3))
    return GenericInitResult(
        initialised=all(torch.isfinite(t).all() for t in full.values()),
        bias_in_kaiming_bound=bool(full["1.0.bias"].abs().max() <= 8**-0.5),
        odd_error=_shard_error(odd),
        buffer_error=_shard_error(masked),
    )


@dataclass
class PrefetchRun:
    events: list[tuple[str, str]]  # of the last step
    weights: dict[str, torch.Tensor]


def prefetch_checks() -> dict[str, PrefetchRun]:
    out = {}
    settings = {
        "pre": dict(backward_prefetch="pre"),
        "post": dict(backward_prefetch="post"),
        "none": dict(backward_prefetch="none", limit_all_gathers=0),
        "forward": dict(forward_prefetch=True, limit_all_gathers=1),
    }
    for label, kwargs in settings.items():
        torch.manual_seed(0)
        model = fsdpkit.shard(GPT(CONFIG), wrap=(Block,), record_events=True, bucket_bytes=0, **kwargs)  # one unit per block
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(3):
            fsdpkit.recorded_events(model).clear()
            _loss(model, _local(_tokens(step))).backward()
            opt.step()
            opt.zero_grad()
        out[label] = PrefetchRun(list(fsdpkit.recorded_events(model)), fsdpkit.full_state_dict(model))
    return out


@dataclass
class BatchNormResult:
    input: str  # dtypes the batch norm saw under the bf16 preset
    weight: str
    output: str
    running_mean: str
    finite: bool


def batch_norm_checks() -> BatchNormResult:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())]), nn.Linear(8, 2))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.out = net[0], net[1], net[2]

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    model = fsdpkit.shard(Net(), mixed_precision="bf16")
    seen = {}
    bn = model.blocks[0][1]
    bn.register_forward_hook(lambda m, args, out: seen.update(input=str(args[0].dtype), weight=str(m.weight.dtype), output=str(out.dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    loss = F.mse_loss(model(_local(x)).float(), torch.zeros(8 // dist.get_world_size(), 2))
    loss.backward()
    opt.step()
    return BatchNormResult(**seen, running_mean=str(bn.running_mean.dtype), finite=bool(torch.isfinite(loss).item()))


@dataclass
class RecoveryResult:
    raised: bool
    half_done: bool  # reductions were pending when the backward raised
    weight_error: float


def recovery_checks() -> RecoveryResult:
    """A backward that raises half-way (an OOM, say) must leave the model trainable."""
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    # one unit per block, so that h.1 and h.2 have reduced when h.0's backward raises
    sharded = fsdpkit.shard(copy.deepcopy(reference), wrap=(Block,), bucket_bytes=0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(sharded.parameters(), lr=3e-3)

    def fail(grad):
        raise RuntimeError("simulated failure in backward")

    def arm(module, args, output) -> None:
        output.register_hook(fail)

    handle = sharded.h[0].register_forward_hook(arm)
    raised = False
    try:
        _loss(sharded, _local(_tokens(0))).backward()
    except RuntimeError:
        raised = True
    handle.remove()
    half_done = len(get_state(sharded).pending) > 0
    opt.zero_grad(set_to_none=True)
    for step in range(1, 3):
        _loss(reference, _tokens(step)).backward()
        _loss(sharded, _local(_tokens(step))).backward()
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    return RecoveryResult(raised, half_done, _max_weight_error(sharded, reference))


@dataclass
class StaleResult:
    loss_error: float  # relative, the forward after the optimizer step
    weight_error: float


def forward_without_backward_checks() -> StaleResult:
    """A forward with grad that no backward follows (a metric, say) leaves the root and the
    last unit gathered; after an optimizer step the next forward must not read them."""
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    sharded = fsdpkit.shard(copy.deepcopy(reference), wrap=(Block,))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(sharded.parameters(), lr=3e-3)
    losses = []
    for step in range(3):
        losses.append((_loss(reference, _tokens(step)).item(), _global_loss(_loss(sharded, _local(_tokens(step))))))
        _loss(reference, _tokens(step)).backward()
        _loss(sharded, _local(_tokens(step))).backward()
        _loss(sharded, _local(_tokens(step)))  # no backward follows this one
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    return StaleResult(max(abs(mine - ref) / ref for ref, mine in losses), _max_weight_error(sharded, reference))


@dataclass
class FrozenPeaks:
    trainable: int  # peak unsharded bytes, all blocks trainable
    frozen: int  # peak unsharded bytes, all blocks frozen
    frozen_all_resharded: bool
    unit_bytes: list[int]  # root first


def frozen_units_memory() -> FrozenPeaks:
    """Units with no trainable parameter still reshard right after their backward."""
    peaks, resharded = {}, {}
    for label, frozen in (("trainable", False), ("frozen", True)):
        torch.manual_seed(0)
        model = GPT(CONFIG)
        for name, param in model.named_parameters():
            param.requires_grad_(not (frozen and name.startswith("h.")))
        model = fsdpkit.shard(model, wrap=(Block,), bucket_bytes=0)  # one unit per block
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        _loss(model, _local(_tokens(0))).backward()
        opt.step()
        peaks[label] = fsdpkit.memory_stats(model)["peak_unsharded"]
        resharded[label] = all(unit.state is UnitState.SHARDED for unit in get_state(model).units)
    return FrozenPeaks(
        peaks["trainable"], peaks["frozen"], resharded["frozen"], [unit.layout.padded_numel * 4 for unit in get_state(model).units]
    )


PAIRS = {  # each trains a sharded GPT beside an unsharded one
    "offload": lambda: _train_pair(3, cpu_offload=True),
    "checkpointing": lambda: _train_pair(3, activation_checkpointing=True),
    "frozen": lambda: _train_pair(3, freeze=("h.0.ln_1.weight", "h.0.attn.c_attn.bias", "h.1.mlp.c_fc.weight")),
    "accumulate_with_comm": lambda: _train_pair(2, micro=2),
    "no_sync": lambda: _train_pair(2, micro=2, no_sync=True),
    "nested_units": lambda: _train_pair(
        2,
        wrap=lambda name, module: isinstance(module, (Block, nn.Linear)) and "mlp" in name or isinstance(module, Block),
        bucket_bytes=0,  # the unit counts are the policy's, unmerged
    ),
    "two_blocks_per_unit": lambda: _train_pair(2, wrap=fsdpkit.WrapPolicy(module_classes=(Block,), every=2), bucket_bytes=0),
}


@dataclass
class FeatureResults:
    frozen_units: Outcome[FrozenPeaks]
    recovery: Outcome[RecoveryResult]
    stale: Outcome[StaleResult]
    batch_norm: Outcome[BatchNormResult]
    pairs: dict[str, Outcome[PairResult]]  # PAIRS' names
    mixed_precision: Outcome[MixedPrecisionResult]
    grad_scaler: Outcome[ScalerResult]
    deferred_init: Outcome[DeferredResult]
    deferred_generic: Outcome[GenericInitResult]
    prefetch: Outcome[dict[str, PrefetchRun]]


def features_worker() -> FeatureResults:
    return FeatureResults(
        frozen_units=_attempt(frozen_units_memory),
        recovery=_attempt(recovery_checks),
        stale=_attempt(forward_without_backward_checks),
        batch_norm=_attempt(batch_norm_checks),
        pairs={name: _attempt(run) for name, run in PAIRS.items()},
        mixed_precision=_attempt(mixed_precision_checks),
        grad_scaler=_attempt(grad_scaler_checks),
        deferred_init=_attempt(deferred_init_checks),
        deferred_generic=_attempt(deferred_generic_checks),
        prefetch=_attempt(prefetch_checks),
    )


@pytest.fixture(scope="module")
def features() -> FeatureResults:
    return run_distributed(features_worker, 2)[0]


@pytest.mark.parametrize("case", list(PAIRS))
def test_feature_matches_reference(features, case):
    result = features.pairs[case].get()
    assert result.weight_error < 1e-4, result.weight_error


def test_offload_keeps_shards_on_host(features):
    assert features.pairs["offload"].get().offloaded


def test_frozen_parameters_get_no_grad_no_state_no_change(features):
    frozen = features.pairs["frozen"].get()
    assert frozen.frozen_unchanged and frozen.frozen_grads_none and frozen.frozen_without_state


def test_no_sync_reduces_once_per_step(features):
    units = features.pairs["no_sync"].get().units
    assert features.pairs["accumulate_with_comm"].get().reduce_scatters == [2 * units, 2 * units]
    assert features.pairs["no_sync"].get().reduce_scatters == [units, units]


def test_unit_policies_change_the_unit_count(features):
    assert features.pairs["nested_units"].get().units == 1 + 3 + 3 * 2  # root, blocks, two Linear units in each mlp
    assert features.pairs["two_blocks_per_unit"].get().units == 1 + 2  # root, h.0+h.1, h.2


def test_bf16_matches_a_reference_that_casts_once_and_halves_all_gather_bytes(features):
    mp = features.mixed_precision.get()
    for mine, ref in zip(mp.bf16.losses, mp.reference_losses, strict=True):
        assert abs(mine - ref) / ref < 2e-2
    assert mp.bf16_weight_error < 2e-2 and mp.bf16_model_error < 1e-2
    assert mp.bf16.master_dtypes == ["torch.float32"]
    assert mp.bf16.gather_bytes * 2 == mp.fp32.gather_bytes
    assert mp.bf16.int_buffer == "torch.int64" and mp.bf16.float_buffer == "torch.bfloat16"


def test_fp16_inf_on_one_rank_skips_the_step_everywhere(features):
    scaler = features.grad_scaler.get()
    assert scaler.skip_returned is False and scaler.unchanged_after_skip
    assert scaler.scale_after == 512.0 and scaler.stepped is True and scaler.step_count == 1


def test_training_goes_on_after_a_backward_that_raised(features):
    recovery = features.recovery.get()
    assert recovery.raised and recovery.half_done and recovery.weight_error < 1e-4


def test_a_forward_without_backward_leaves_no_stale_weights(features):
    stale = features.stale.get()
    assert stale.loss_error < 1e-5 and stale.weight_error < 1e-4, stale


def test_frozen_units_do_not_stay_gathered_through_backward(features):
    peaks = features.frozen_units.get()
    root, *blocks = peaks.unit_bytes
    # the root stays gathered; of the three frozen blocks at most the current one and the
    # prefetched next one are gathered at once (without resharding all three would be)
    assert peaks.frozen <= root + 2 * max(blocks) < root + sum(blocks)
    assert peaks.frozen_all_resharded


def test_batch_norm_runs_in_fp32_under_bf16(features):
    bn = features.batch_norm.get()
    assert bn.input == bn.weight == bn.running_mean == "torch.float32" and bn.finite


def test_deferred_init_equals_eager_and_keeps_ties(features):
    assert features.deferred_init.get() == DeferredResult(equal=True, tied=True, no_meta=True)


def test_deferred_init_without_init_parameter_initialises_or_refuses(features):
    generic = features.deferred_generic.get()
    assert generic.initialised and generic.bias_in_kaiming_bound
    assert "nothing initialises parameter" in generic.odd_error and "scale" in generic.odd_error
    assert "buffer 'mask'" in generic.buffer_error and "--eager-init" in generic.buffer_error


def test_prefetch_changes_order_not_results(features):
    runs = features.prefetch.get()
    for label in ("post", "none", "forward"):
        for name, tensor in runs["pre"].weights.items():
            assert torch.equal(tensor, runs[label].weights[name]), (label, name)
    events = runs["pre"].events
    # backward prefetch: h.0's all-gather is issued before h.1's gradient computation ends
    assert events.index(("all_gather", "h.0"), events.index(("pre_backward", "h.1"))) < events.index(("post_backward", "h.1"))
    # except for the first unit of the backward (h.2, computed at the activation peak): h.1
    # is gathered only once h.2's gradient is done
    assert events.index(("all_gather", "h.1"), events.index(("pre_backward", "h.2"))) > events.index(("post_backward", "h.2"))
    none = runs["none"].events
    assert ("prefetch", "h.0") not in none
    assert none.index(("all_gather", "h.0"), none.index(("pre_backward", "h.1"))) > none.index(("post_backward", "h.1"))
    forward = runs["forward"].events
    # forward prefetch (from the previous iteration's order): h.1 gathered before h.0's forward ends
    assert forward.index(("all_gather", "h.1")) < forward.index(("post_forward", "h.0"))
