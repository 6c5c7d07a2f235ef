"""The allow-list for the `data.pkl` of a per-rank state dict holding FSDP2 DTensors: the
DeepSpeed allow-list's tensors and containers, plus the classes a pickled DTensor names
(its spec, device mesh and placements), mapped to inert records, never imported.

A DTensor pickles as `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor,
dtype, size, stride, ...), {"_local_tensor": ..., "_spec": ...})`; here it becomes a
`DTensorRecord`: the global shape, the rank's local tensor and its placements. Any other
global is a DataCheckError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import DataCheckError
from ..dcp import unpickler as u
from ..deepspeed.unpickler import DEEPSPEED_GLOBALS

DTENSOR = "torch.distributed.tensor.DTensor"


@dataclass(frozen=True)
class DTensorRecord:
    shape: tuple[int, ...]  # the whole tensor's
    local: u.TensorRecord  # this rank's part
    placements: tuple[Any, ...]  # one per mesh dimension: Shard or Replicate records


@dataclass(frozen=True)
class _Wrapper:
    cls: Any
    shape: tuple[int, ...]


class Shard(u.Record):
    pass


class Replicate(u.Record):
    pass


def _record(module: str, name: str) -> type[u.Record]:
    return type(name, (u.Record,), {"qualname": f"{module}.{name}"})


def _wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> _Wrapper:
    if cls != DTENSOR:
        raise DataCheckError(f"a tensor subclass {cls!r}: only DTensors are read")
    return _Wrapper(cls, tuple(size))


def _from_type(rebuild: Any, new_type: Any, args: Any, state: Any) -> Any:
    """`torch._tensor._rebuild_from_type_v2`: a plain tensor, a Parameter's, or a DTensor."""
    if rebuild is _wrapper_subclass:
        wrapper = rebuild(*args)
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        state = state if isinstance(state, dict) else {}
        local, spec = state.get("_local_tensor"), state.get("_spec")
        if not isinstance(local, u.TensorRecord) or not isinstance(spec, u.Record):
            raise DataCheckError("a DTensor without its local tensor and spec")
        return DTensorRecord(wrapper.shape, local, tuple(spec.get("placements") or ()))
    if rebuild not in (u._tensor_v2, u._tensor_v3) or not isinstance(args, tuple):
        raise DataCheckError("_rebuild_from_type_v2 of something else than a tensor")
    return rebuild(*args)


_SPEC_CLASSES = (
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
)

TORCHSAVE_GLOBALS: dict[tuple[str, str], Any] = {
    **DEEPSPEED_GLOBALS,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
    ("torch.distributed.tensor", "DTensor"): DTENSOR,
    ("torch.serialization", "_get_layout"): u._layout,
    ("torch.distributed.tensor.placement_types", "Shard"): Shard,
    ("torch.distributed.tensor.placement_types", "Replicate"): Replicate,
    **{(module, name): _record(module, name) for module, name in _SPEC_CLASSES},
}


def loads(raw: bytes, *, where: str) -> Any:
    """Unpickle a rank file's `data.pkl`: tensors become `TensorRecord`s, DTensors `DTensorRecord`s."""
    return u.restricted_loads(raw, allowed=TORCHSAVE_GLOBALS, where=where, storages=True)
