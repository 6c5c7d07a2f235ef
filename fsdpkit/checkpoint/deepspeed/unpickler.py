"""The allow-list for the `data.pkl` of a DeepSpeed rank file: torch's allow-list for a whole
state dict (`torchfile.unpickler`), plus DeepSpeed's own classes by name, each a
`DeepSpeedRecord` that keeps the arguments and state pickle hands it (never imported, nothing
called). Any other global is a `DataCheckError` naming it.
"""

from __future__ import annotations

from typing import Any

from ..torchfile import unpickler as u


class DeepSpeedRecord(u.Record):
    """A DeepSpeed object as its pickled arguments and state (`args`, attributes)."""

    qualname = "deepspeed"

    def value(self) -> Any:
        """An enum's value (its one argument), else the record itself."""
        args = self.get("args", ())
        return args[0] if len(args) == 1 else self

    def plain_value(self) -> Any:
        inner = self.value()
        return inner if inner is not self else self.qualname


# The DeepSpeed globals its checkpoints name (0.19), the config enums an engine may pickle included
DEEPSPEED_GLOBALS: dict[tuple[str, str], Any] = u.STATE_DICT_GLOBALS | {
    (module, name): type(name, (DeepSpeedRecord,), {"qualname": f"{module}.{name}"})
    for module, name in (
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum"),
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
        ("deepspeed.checkpoint.utils", "fragment_address"),
        ("deepspeed.runtime.utils", "fragment_address"),
    )
}


def loads(raw: bytes, *, where: str) -> Any:
    """Unpickle a rank file's `data.pkl`: tensors become `TensorRecord`s (storage ids only)."""
    return u.restricted_loads(raw, allowed=DEEPSPEED_GLOBALS, where=where, storages=True)
