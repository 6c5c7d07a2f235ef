"""The objects of DeepSpeed's checkpoint files as pickle records (`torchfile.pickler`), written
without DeepSpeed or torch: its classes are named by module and name and looked up only when
DeepSpeed loads the file. Tensors are `_rebuild_tensor_v2` over a legacy typed storage, as
torch.save writes float32, bfloat16 and float16 tensors.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass

from ...errors import UsageError
from ..torchfile.archive import LEGACY_STORAGE_NAMES, tensor_pickle
from ..torchfile.pickler import Global, NewObject, Raw, Reduce

DYNAMIC_LOSS_SCALER = Global("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")


def tensor(dtype: str, key: int, shape: tuple[int, ...]) -> Raw:
    """A contiguous tensor of `shape` filling storage `key` from its start."""
    if dtype not in LEGACY_STORAGE_NAMES:
        raise UsageError(f"DeepSpeed output of {dtype} tensors is not supported (float32, bfloat16, float16 are)")
    return Raw(tensor_pickle(dtype, str(key), shape))


def size(shape: tuple[int, ...]) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(shape),))


def loss_scaler() -> NewObject:
    return NewObject(Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), {"cur_scale": 1.0, "dynamic": False})


@dataclass(frozen=True)
class DynamicScale:
    """The state of DeepSpeed's `DynamicLossScaler`, its attributes by name in the order it
    pickles them (the defaults: as its `__init__` leaves it, no step counted, no overflow seen)."""

    cur_scale: float
    _: KW_ONLY
    cur_iter: int = 0
    last_overflow_iter: int = -1
    scale_factor: float = 2.0
    scale_window: int
    min_scale: float
    delayed_shift: int  # hysteresis
    cur_hysteresis: int
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True


def dynamic_loss_scaler(scale: DynamicScale) -> NewObject:
    state = {"cur_scale": scale.cur_scale, "dynamic": True} | asdict(scale) | {"dtype": Global("torch", "float16")}
    return NewObject(DYNAMIC_LOSS_SCALER, state)


def zero_stage(stage: int) -> Reduce:
    return Reduce(Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (stage,))


def fragment_address(numel: int, start: int) -> NewObject:
    return NewObject(Global("deepspeed.utils.tensor_fragment", "fragment_address"), {"numel": numel, "start": start})
