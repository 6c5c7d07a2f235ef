"""What a DeepSpeed run's precision changes in its checkpoint, as DeepSpeed 0.19.8 writes it
(pure data; the fp32 master weights and Adam's moments are laid out alike at every precision):
the module's floating tensors are in the run's dtype (DeepSpeed casts the module with
`.bfloat16()` or `.half()`; trainable ones rounded from the fp32 masters as its step leaves
them), bf16 runs name their optimizer files `bf16_zero_pp_rank_*`, and the loss scaler is a
static 1.0 for fp32 and bf16; for fp16 DeepSpeed's `DynamicLossScaler`, the source's when it
was an fp16 run, else DeepSpeed's defaults as a fresh fp16 run starts it.
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Any

from ...errors import DataCheckError
from . import writer_records as records
from .unpickler import DeepSpeedRecord

FLOATING = ("F64", "F32", "BF16", "F16")
# DeepSpeed's fp16 defaults: initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min_loss_scale 1
FP16_SCALER = records.DynamicScale(cur_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, cur_hysteresis=2)
DYNAMIC_LOSS_SCALER = f"{records.DYNAMIC_LOSS_SCALER.module}.{records.DYNAMIC_LOSS_SCALER.name}"


class Precision(Enum):
    F32 = "F32"
    BF16 = "BF16"
    F16 = "F16"

    @property
    def optim_prefix(self) -> str:
        return "bf16_" if self is Precision.BF16 else ""

    @property
    def config(self) -> dict[str, Any]:
        """The run's part of `ds_config`."""
        key = {Precision.BF16: "bf16", Precision.F16: "fp16"}.get(self)
        return {key: {"enabled": True}} if key else {}

    def module_dtype(self, dtype: str) -> str:
        """The dtype that a module tensor stored as `dtype` has in the run."""
        return self.value if self is not Precision.F32 and dtype in FLOATING else dtype

    def scaler_state(self, saved: records.DynamicScale | None) -> dict[str, Any]:
        """The loss-scaler items of the optimizer state (fp16: the `saved` scaler, if any)."""
        if self is Precision.F16:
            return {"loss_scaler": records.dynamic_loss_scaler(saved or FP16_SCALER), "dynamic_loss_scale": True}
        return {"loss_scaler": records.loss_scaler(), "dynamic_loss_scale": False}


def saved_scale(record: Any) -> records.DynamicScale | None:
    """The state of a source's fp16 `DynamicLossScaler` record; None for any other loss scaler."""
    if not isinstance(record, DeepSpeedRecord) or record.qualname != DYNAMIC_LOSS_SCALER:
        return None
    values = {f.name: record.get(f.name) for f in fields(records.DynamicScale)}
    for name, value in values.items():
        if type(value) not in (int, float, bool):
            raise DataCheckError(f"the source's fp16 loss scaler has {name} {value!r}, not a number")
    return records.DynamicScale(**values)
