"""The systems benchmarks/engine.py compares, each built the same way from the same seed:
fsdpkit's engine, torch's fully_shard (FSDP2), torch's FullyShardedDataParallel (FSDP1)
and DistributedDataParallel, each with AdamW over nanoGPT's weight-decay groups. The
sharded systems wrap the same modules (the units fsdpkit's plan picks, bench_models.py).
A step runs in profiler regions (bench:step, forward, backward, optimizer) that
step_breakdown.py reads."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from bench_models import resolve_model
from torch.profiler import record_function

import fsdpkit
from fsdpkit.dist.comm import CommStats
from fsdpkit.train.data import TokenSource, local_rows

SYSTEMS = ("fsdpkit", "fsdpkit-int8", "fsdp2", "fsdp1", "ddp")
ENGINE_KINDS = {"fsdpkit": {}, "fsdpkit-int8": {"allgather_dtype": "int8"}}  # kind -> extra fsdpkit.shard options
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module.")
LR, WEIGHT_DECAY, BETAS = 1e-3, 0.1, (0.9, 0.95)


@dataclass(frozen=True)
class RunSettings:
    model: str
    batch: int  # global batch (rows), split evenly over ranks
    seq_len: int
    seed: int = 0
    mixed_precision: str = "none"  # none | bf16
    engine_options: dict = field(default_factory=dict)  # extra fsdpkit.shard keyword arguments
    compile: bool = False  # torch.compile each unit's forward (the wrappers' hooks outside), in every system


@dataclass
class System:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, tokens) -> logits
    autocast: bool = False
    step: int = 0
    last_loss: float = float("nan")
    sent_bytes: Callable[[], int] | None = None  # bytes this rank has sent so far (None: not counted)


def _sent_by_engine(stats: Any, world: int) -> Callable[[], int]:
    """Bytes a rank sends, from the engine's own counters (tensor bytes per collective): an
    all-gather or reduce-scatter sends (W-1)/W of its tensor, a ring all-reduce 2(W-1)/W."""
    share = {"all_gather": (world - 1) / world, "reduce_scatter": (world - 1) / world, "all_reduce": 2 * (world - 1) / world}
    return lambda: int(sum(count * share.get(kind, 0.0) for kind, count in stats.bytes.items()))


def _count_ddp_bytes(model: nn.Module, world: int) -> Callable[[], int]:
    """DDP's gradient all-reduce, counted bucket by bucket in a comm hook (sent: 2(W-1)/W)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counted = [0]

    def hook(state, bucket):  # unannotated: DDP checks the annotations it finds
        buffer = bucket.buffer()
        counted[0] += buffer.numel() * buffer.element_size()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)  # type: ignore[operator]
    return lambda: int(counted[0] * 2 * (world - 1) / world)


def supported_engine_options(options: dict) -> tuple[dict, list[str]]:
    """The fsdpkit.shard keyword arguments this engine accepts, and the names it does not."""
    accepted = set(inspect.signature(fsdpkit.shard).parameters) | {f.name for f in dataclasses.fields(fsdpkit.ShardingConfig)}
    return {k: v for k, v in options.items() if k in accepted}, [k for k in options if k not in accepted]


def _name_groups(model: nn.Module, plain_decay: set[str]) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        (decay if name in plain_decay else no_decay).append(param)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def build_system(kind: str, settings: RunSettings, device: torch.device, *, label: str | None = None) -> System:
    source = resolve_model(settings.model)
    model = source.build("cpu", seed=settings.seed).to(device)
    units = source.unit_modules(model)
    if settings.compile and kind in ("fsdp2", "ddp"):  # fsdpkit compiles its units itself (shard(compile=True))
        for name in units:
            unit = model.get_submodule(name)
            unit.forward = torch.compile(unit.forward)
    decay = {name for name, param in model.named_parameters() if param.dim() >= 2}
    bf16 = settings.mixed_precision == "bf16"
    autocast = False
    sent_bytes = None
    if kind in ENGINE_KINDS:
        options, _ = supported_engine_options(
            {**settings.engine_options, **ENGINE_KINDS[kind], **({"compile": True} if settings.compile else {})}
        )
        stats = CommStats()
        model = fsdpkit.shard(
            model, wrap=source.wrap(model), mixed_precision=settings.mixed_precision, device=device, comm_stats=stats, **options
        )
        groups = fsdpkit.param_groups(model, weight_decay=WEIGHT_DECAY)
        sent_bytes = _sent_by_engine(stats, dist.get_world_size())
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        for name in reversed(units):  # nested units before the units around them
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        groups = _name_groups(model, decay)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=_unit_policy(model, units), use_orig_params=True, device_id=device, mixed_precision=precision
        )
        groups = _name_groups(model, decay)
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        groups = _name_groups(model, decay)
        sent_bytes = _count_ddp_bytes(model, dist.get_world_size())
        autocast = bf16
    else:
        raise ValueError(f"unknown system {kind!r}: use one of {', '.join(SYSTEMS)}")
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True if device.type == "cuda" else None)  # as fsdpkit train
    return System(label or kind, model, optimizer, source.logits, autocast=autocast, sent_bytes=sent_bytes)


def _unit_policy(model: nn.Module, units: list[str]):
    """FSDP1's auto-wrap policy that wraps exactly the modules named in `units`."""
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    chosen = {id(model.get_submodule(name)) for name in units}
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda module: id(module) in chosen)


def train_steps(system: System, data: TokenSource, settings: RunSettings, device: torch.device, steps: int) -> None:
    """`steps` optimizer steps on this system's next batches (the same batches for every system)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(steps):
        batch = local_rows(data.global_batch(system.step, settings.batch), rank, world).to(device)
        cast = torch.autocast(device.type, dtype=torch.bfloat16) if system.autocast else contextlib.nullcontext()
        with record_function("bench:step"):
            with record_function("bench:forward"):
                with cast:
                    logits = system.logits(system.model, batch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            with record_function("bench:backward"):
                loss.backward()
            with record_function("bench:optimizer"):
                system.optimizer.step()
                system.optimizer.zero_grad(set_to_none=True)
        system.step += 1
        system.last_loss = loss.detach()


def global_loss(system: System, device: torch.device) -> float:
    total = torch.as_tensor(system.last_loss, dtype=torch.float64, device=device).reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
