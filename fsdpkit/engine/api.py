"""The public engine API: shard a module in place, and the helpers users need around it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..dist.comm import Collectives, CommStats
from ..errors import UsageError
from .config import MixedPrecision, ShardingConfig
from .deferred_init import has_meta_tensors, initialize_meta_parameters, materialize_buffers, meta_parameter_names
from .flat_unit import SHAPE_ATTR
from .memory import optimizer_state_bytes
from .mesh import build_mesh
from .model_hooks import hooks_of
from .precision import FP32_MODULE_CLASSES, keep_in_fp32
from .sharded import STATE_ATTR, RootRuntime, get_state
from .wrapping import WrapPolicy, bucket_units, split_units

WrapSpec = WrapPolicy | tuple[type[nn.Module], ...] | list[type[nn.Module]] | type[nn.Module] | Callable[[str, nn.Module], bool] | None


def _as_policy(wrap: WrapSpec) -> WrapPolicy:
    if wrap is None:
        return WrapPolicy()
    if isinstance(wrap, WrapPolicy):
        return wrap
    if isinstance(wrap, type):  # a class is not a predicate, even though it is callable
        if issubclass(wrap, nn.Module):
            return WrapPolicy(module_classes=(wrap,))
    elif isinstance(wrap, (tuple, list)):
        return WrapPolicy(module_classes=tuple(wrap))
    elif callable(wrap):
        return WrapPolicy(predicate=wrap)
    raise UsageError(f"wrap must be a WrapPolicy, module classes or a predicate, got {type(wrap).__name__}")


def shard(
    module: nn.Module,
    config: ShardingConfig | None = None,
    *,
    wrap: WrapSpec = None,
    group: Any = None,
    device: torch.device | str | None = None,
    comm_stats: CommStats | None = None,
    record_events: bool = False,
    **options: Any,
) -> nn.Module:
    """Shard `module` in place across the ranks of `group` and return it.

    `config` says how (a ShardingConfig); keyword `options` are shortcuts for its fields
    (`shard(model, strategy="grad-op", mixed_precision="bf16")`) and override `config`.
    Every rank must call this with an identically initialised module, or with a module
    built on the meta device (materialised here one unit at a time). Afterwards
    `named_parameters()` yields the model's own names, each a 1-D fragment of this rank's
    chunk of its unit's flat parameter; a standard torch optimizer can train them.
    """
    if hasattr(module, STATE_ATTR):
        raise UsageError(f"{type(module).__name__} is already sharded")
    if not dist.is_initialized():
        raise UsageError("fsdpkit.shard() needs an initialised process group (torch.distributed.init_process_group)")
    config = with_options(config or ShardingConfig(), options)
    mesh = build_mesh(config, group)
    device = torch.device(device) if device is not None else _default_device()
    deferred = has_meta_tensors(module)
    if deferred:
        materialize_buffers(module, device)
    keep_dtype = hooks_of(module).keep_dtype_buffers
    for owner_name, buffer_owner in module.named_modules():
        for name, buffer in buffer_owner._buffers.items():
            if buffer is not None:
                kept = f"{owner_name}.{name}" if owner_name else name
                buffer_owner._buffers[name] = _place_buffer(buffer, kept in keep_dtype, buffer_owner, device, config.mixed_precision)
    specs = bucket_units(module, split_units(module, _as_policy(wrap)), config.bucket_bytes)
    meta_names = meta_parameter_names(module) if deferred else set()
    state = RootRuntime(module, specs, mesh, config, Collectives(comm_stats), device, record_events=record_events)
    if meta_names:
        initialize_meta_parameters(module, state.units, meta_names, device)
    object.__setattr__(module, STATE_ATTR, state)
    if config.mixed_precision.param_dtype is not None:  # mixed precision enabled
        state.handles += keep_in_fp32(module, config.mixed_precision.param_dtype)
    for member in _leaf_unit_members(state):
        if config.compile:
            member.forward = torch.compile(member.forward)  # the module's hooks stay outside the compiled region
        if config.activation_checkpointing:
            member.forward = _checkpointed(member.forward)
    return module


def with_options(config: ShardingConfig, options: dict[str, Any]) -> ShardingConfig:
    known = {f.name for f in dataclasses.fields(ShardingConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(f"fsdpkit.shard() got unknown option {unknown[0]!r}: use one of {', '.join(sorted(known))}")
    if isinstance(options.get("mixed_precision"), str):
        options["mixed_precision"] = MixedPrecision.from_name(options["mixed_precision"])
    if options.get("mixed_precision", config.mixed_precision) is None:
        options["mixed_precision"] = MixedPrecision()
    return dataclasses.replace(config, **options) if options else config


def _leaf_unit_members(state: RootRuntime) -> list[nn.Module]:
    """The modules of the non-root units with no nested units (the transformer blocks): those
    whose activations are recomputed (activation checkpointing) and that torch.compile runs,
    as torchtitan compiles each block."""
    member_names = [name for unit in state.units for name in unit.spec.members]
    members = []
    for unit in state.units:
        if unit.is_root:
            continue
        if any(other != name and other.startswith(name + ".") for name in unit.spec.members for other in member_names):
            continue
        members.extend(unit.members)
    return members


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch_checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _place_buffer(
    buffer: torch.Tensor, keep: bool, owner: nn.Module, device: torch.device, mixed_precision: MixedPrecision
) -> torch.Tensor:
    """On `device`; floating buffers in buffer_dtype, except batch-norm statistics (fp32) and
    those the model's hooks keep (`keep`: rotary frequencies it computes with in fp32)."""
    if buffer.is_floating_point() and mixed_precision.buffer_dtype is not None and not isinstance(owner, FP32_MODULE_CLASSES) and not keep:
        return buffer.to(device=device, dtype=mixed_precision.buffer_dtype)
    return buffer.to(device)


@contextlib.contextmanager
def full_params(module: nn.Module, *, writeback: bool = True) -> Iterator[nn.Module]:
    """Gather the full parameters (master dtype) for evaluation, generation or export.

    Inside, `named_parameters()` and `state_dict()` show full tensors with their original
    shapes; with writeback, changes to them are kept. Every rank must enter it.
    """
    with get_state(module).full_params(writeback=writeback):
        yield module


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[nn.Module]:
    """Accumulate gradients locally, unsharded, without communication; the first backward
    outside the context reduces the sum once. Costs one full gradient per unit per rank."""
    with get_state(module).no_sync():
        yield module


def recorded_events(module: nn.Module) -> list[tuple[str, str]]:
    """The engine's events in order (shard(..., record_events=True)): hook firings and
    collectives, each as (kind, unit name)."""
    events = get_state(module).events
    if events is None:
        raise ValueError("events were not recorded: shard the module with record_events=True")
    return events


def original_shape(param: torch.Tensor) -> torch.Size:
    """The shape a sharded parameter had before sharding (`p.dim()` of a fragment is 1)."""
    return getattr(param, SHAPE_ATTR, param.shape)


def param_groups(module: nn.Module, *, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's optimizer groups: weight decay on matrices and embeddings (original
    dim >= 2), none on biases and norms. Works on sharded and plain modules."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in module.named_parameters():
        if param.requires_grad:
            (decay if len(original_shape(param)) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def comm_stats(module: nn.Module) -> CommStats:
    return get_state(module).comms.stats


def is_sharded(module: nn.Module) -> bool:
    return hasattr(module, STATE_ATTR)


def local_shard_bytes(module: nn.Module) -> int:
    """Bytes of this rank's sharded parameters (master dtype)."""
    return sum(unit.flat_shard.numel() * unit.flat_shard.element_size() for unit in get_state(module).units)


def memory_stats(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank's engine holds now, and peaks since sharding (or reset_peak_memory)."""
    counter = get_state(module).memory
    return {
        "sharded_params": counter.sharded_params,
        "sharded_grads": counter.sharded_grads,
        "optimizer_state": optimizer_state_bytes(optimizer),
        "unsharded_params": counter.unsharded_params,
        "unsharded_grads": counter.unsharded_grads,
        "peak_unsharded": counter.peak_unsharded,
        "peak_total": counter.peak_total + optimizer_state_bytes(optimizer),
    }


def reset_peak_memory(module: nn.Module) -> None:
    get_state(module).memory.reset_peaks()


def full_state_dict(module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict (model's own names, original shapes, on CPU); with rank0_only,
    other ranks get {}. Every rank must call it. For models that fit in one host's memory."""
    with full_params(module, writeback=False):
        if rank0_only and get_state(module).mesh.rank != 0:
            return {}
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}
