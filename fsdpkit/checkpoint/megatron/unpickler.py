"""The allow-list for Megatron's pickles: its `.metadata` (DCP's classes, and 0.15's
`MCoreMetadata`), its common state (`common.pt`, `common_state/shard_0_1`) and a legacy zarr
checkpoint's sharded objects (`shard_*.pt`): torch's allow-list for a state dict, numpy's arrays (the
zarr `rng_state`'s), `argparse.Namespace` (Megatron-LM's `args`) and any class or enum of Megatron
or NeMo, each an inert record that keeps what pickle hands it. Nothing is imported or called; any
other global is a `DataCheckError` naming it.
"""

from __future__ import annotations

from typing import Any

from ...errors import DataCheckError
from ..torchfile import unpickler as u

OWN_PACKAGES = ("megatron.", "nemo.")  # whose classes and enums become inert records


class MegatronRecord(u.Record):
    """A Megatron or NeMo object (an enum member: its one argument) as its pickled arguments and state."""

    qualname = "megatron"

    def plain_value(self) -> Any:
        args = self.get("args", ())
        return args[0] if len(args) == 1 and isinstance(args[0], (int, str, float)) else self.qualname


class NamespaceRecord(u.Record):
    """`argparse.Namespace`: its attributes."""

    qualname = "argparse.Namespace"

    def plain_value(self) -> Any:
        return {key: value for key, value in self.__dict__.items() if key != "args"}


def _path(*parts: Any) -> str:
    if not all(isinstance(part, str) for part in parts):
        raise DataCheckError("a pickled path must be made of strings")
    return "/".join(parts)


COMMON_GLOBALS: dict[tuple[str, str], Any] = (
    u.STATE_DICT_GLOBALS
    | u.NUMPY_GLOBALS
    | {
        ("argparse", "Namespace"): NamespaceRecord,
        **{("pathlib", name): _path for name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path")},
    }
)


def own_record(module: str, name: str) -> type[u.Record] | None:
    """An inert record class for a Megatron or NeMo global, None for anything else."""
    if not module.startswith(OWN_PACKAGES) or not all(part.isidentifier() for part in (*module.split("."), name)):
        return None
    return type(name, (MegatronRecord,), {"qualname": f"{module}.{name}"})


class CommonAllowList(dict):
    """COMMON_GLOBALS, and any Megatron or NeMo global as an inert record."""

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key)
        return found if found is not None else own_record(*key) or default


def loads_common(raw: bytes, *, where: str) -> Any:
    """Unpickle a common state's `data.pkl`: tensors become `TensorRecord`s (storage ids only)."""
    return u.restricted_loads(raw, allowed=CommonAllowList(COMMON_GLOBALS), where=where, storages=True)
