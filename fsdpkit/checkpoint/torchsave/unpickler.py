"""The allow-list for the `data.pkl` of a per-rank state dict holding FSDP2 DTensors or FSDP1
ShardedTensors: torch's allow-list for a whole state dict (`torchfile.unpickler`), plus the classes a pickled
DTensor or ShardedTensor names (spec, device mesh, placements, shard metadata, sharding spec),
mapped to inert records, never imported.

A DTensor pickles as `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor,
dtype, size, stride, ...), {"_local_tensor": ..., "_spec": ...})`; here it becomes a
`DTensorRecord`: the global shape, the rank's local tensor and its placements. A ShardedTensor
pickles the same way with the state `(local shards, metadata, process group state, sharding
spec, init_rrefs)`; it becomes a `ShardedTensorRecord`: the global shape and the rank's local
shards, each a tensor at its offsets. The process group state's class is reached by
`getattr(ShardedTensor, "ProcessGroupState")`: that one call is allowed, no other getattr.
Any other global is a DataCheckError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from ...errors import DataCheckError
from ..torchfile import unpickler as u

DTENSOR = "torch.distributed.tensor.DTensor"
SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"
_SHARDED_MODULE = "torch.distributed._shard.sharded_tensor"


@dataclass(frozen=True)
class DTensorRecord:
    shape: tuple[int, ...]  # the whole tensor's
    local: u.TensorRecord  # this rank's part
    placements: tuple[Any, ...]  # one per mesh dimension: Shard or Replicate records


@dataclass(frozen=True)
class LocalShard:
    offsets: tuple[int, ...]  # of its first element in the whole tensor
    sizes: tuple[int, ...]
    tensor: u.TensorRecord


@dataclass(frozen=True)
class ShardedTensorRecord:
    shape: tuple[int, ...]  # the whole tensor's
    dtype: str
    shards: tuple[LocalShard, ...]  # this rank's (none where it holds no part)


class Shard(u.Record):
    pass


class Replicate(u.Record):
    pass


class _Shard(u.Record):  # a ShardedTensor's local shard (its tensor and metadata)
    pass


class ShardMetadata(u.Record):
    pass


class ProcessGroupState(u.Record):
    pass


def _record(module: str, name: str) -> type[u.Record]:
    return type(name, (u.Record,), {"qualname": f"{module}.{name}"})


def _wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> tuple[str, tuple[int, ...], str]:
    """(class, the whole tensor's shape, dtype) of a DTensor or ShardedTensor."""
    if cls not in (DTENSOR, SHARDED_TENSOR):
        raise DataCheckError(f"a tensor subclass {cls!r}: only DTensors and ShardedTensors are read")
    if not isinstance(dtype, u.Dtype):
        raise DataCheckError(f"a {cls} without a dtype")
    return cls, u.torch_size(size), dtype.name


def _from_type(rebuild: Any, new_type: Any, args: Any, state: Any) -> Any:
    """`torch._tensor._rebuild_from_type_v2`: a plain tensor, a Parameter's, a DTensor or a ShardedTensor."""
    if rebuild is _wrapper_subclass and isinstance(args, tuple):
        cls, shape, dtype = rebuild(*args)
        return _dtensor(shape, state) if cls == DTENSOR else _sharded_tensor(shape, dtype, state)
    return u.rebuild_from_type(rebuild, new_type, args, state)


def _dtensor(shape: tuple[int, ...], state: Any) -> DTensorRecord:
    if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
        state = {**(state[0] or {}), **(state[1] or {})}
    state = state if isinstance(state, dict) else {}
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, u.TensorRecord) or not isinstance(spec, u.Record):
        raise DataCheckError("a DTensor without its local tensor and spec")
    return DTensorRecord(shape, local, tuple(spec.get("placements") or ()))


def _sharded_tensor(shape: tuple[int, ...], dtype: str, state: Any) -> ShardedTensorRecord:
    """The state `ShardedTensor.__getstate__` gives: (local shards, metadata, ...)."""
    if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[0], list):
        raise DataCheckError("a ShardedTensor without its local shards")
    shards = []
    for shard in state[0]:
        metadata = shard.get("metadata") if isinstance(shard, _Shard) else None
        tensor = shard.get("tensor") if isinstance(shard, _Shard) else None
        if not isinstance(metadata, ShardMetadata) or not isinstance(tensor, u.TensorRecord):
            raise DataCheckError("a ShardedTensor's local shard without its tensor and metadata")
        offsets, sizes = metadata.get("shard_offsets"), metadata.get("shard_sizes")
        shards.append(LocalShard(u.torch_size(offsets), u.torch_size(sizes), tensor))
    return ShardedTensorRecord(shape, dtype, tuple(shards))


def _getattr(owner: Any, name: Any) -> Any:
    """`getattr` in a ShardedTensor's pickle: only `ShardedTensor.ProcessGroupState`."""
    if owner != SHARDED_TENSOR or name != "ProcessGroupState":
        raise DataCheckError(f"getattr({str(owner)[:60]}, {str(name)[:40]!r}) is not allowed (nothing from the file was run)")
    return ProcessGroupState


_SPEC_CLASSES = (
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
    (f"{_SHARDED_MODULE}.metadata", "ShardedTensorMetadata"),
    (f"{_SHARDED_MODULE}.metadata", "TensorProperties"),
    ("torch.distributed.remote_device", "_remote_device"),
    ("torch.distributed._shard.sharding_spec.api", "EnumerableShardingSpec"),
    ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"),
)

TORCHSAVE_GLOBALS: dict[tuple[str, str], Any] = {
    **u.STATE_DICT_GLOBALS,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
    ("torch.distributed.tensor", "DTensor"): DTENSOR,
    ("torch.serialization", "_get_layout"): u.tensor_layout,
    ("torch.distributed.tensor.placement_types", "Shard"): Shard,
    ("torch.distributed.tensor.placement_types", "Replicate"): Replicate,
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"): SHARDED_TENSOR,
    (f"{_SHARDED_MODULE}.shard", "Shard"): _Shard,
    ("torch.distributed._shard.metadata", "ShardMetadata"): ShardMetadata,
    (f"{_SHARDED_MODULE}.metadata", "MEM_FORMAT_ENCODING"): u.memory_format,
    ("__builtin__", "getattr"): _getattr,
    ("builtins", "getattr"): _getattr,
    **{(module, name): _record(module, name) for module, name in _SPEC_CLASSES},
}


# a rank file's `data.pkl`: tensors as `TensorRecord`s, DTensors `DTensorRecord`s, ShardedTensors `ShardedTensorRecord`s
loads = partial(u.restricted_loads, allowed=TORCHSAVE_GLOBALS, storages=True)


# A training run's extra state (verl's `extra_state_...`: the LR scheduler's state dict and the
# RNG states, numpy's among them) adds numpy arrays and dtypes, as records, and bytes.
EXTRA_STATE_GLOBALS: dict[tuple[str, str], Any] = {
    **TORCHSAVE_GLOBALS,
    **u.NUMPY_GLOBALS,
}
extra_state_loads = partial(u.restricted_loads, allowed=EXTRA_STATE_GLOBALS, storages=True)
