"""The one table of element types, in every spelling the project uses (no torch import: the
offline checkpoint commands use it too).

Each `Dtype` has its safetensors name (F32, BF16: what checkpoint headers and manifests
hold), its torch name (float32, bfloat16), its short name where the training flags accept it
(fp32, bf16, fp16: --mixed-precision, --reduce-dtype), other spellings the CLI accepts
(float, half...), the nccl-tests name where nccl-tests has the type, its size, and whether
`convert --dtype` may cast it (the floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Dtype:
    name: str  # the safetensors spelling: F32, BF16, I64, BOOL...
    itemsize: int
    torch_name: str  # torch.<torch_name>
    castable: bool = False  # a float that convert --dtype may cast (F16, BF16, F32, F64)
    short: str | None = None  # fp32, bf16, fp16
    aliases: tuple[str, ...] = ()  # other spellings accepted on the command line
    nccl_tests: str | None = None  # nccl-tests' -d name

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)


DTYPES = (
    Dtype("BOOL", 1, "bool"),
    Dtype("U8", 1, "uint8"),
    Dtype("I8", 1, "int8"),
    Dtype("I16", 2, "int16"),
    Dtype("U16", 2, "uint16"),
    Dtype("I32", 4, "int32"),
    Dtype("U32", 4, "uint32"),
    Dtype("I64", 8, "int64"),
    Dtype("U64", 8, "uint64"),
    Dtype("F8_E5M2", 1, "float8_e5m2"),
    Dtype("F8_E4M3", 1, "float8_e4m3fn"),
    Dtype("F16", 2, "float16", castable=True, short="fp16", aliases=("half",), nccl_tests="half"),
    Dtype("BF16", 2, "bfloat16", castable=True, short="bf16", nccl_tests="bfloat16"),
    Dtype("F32", 4, "float32", castable=True, short="fp32", aliases=("float",), nccl_tests="float"),
    Dtype("F64", 8, "float64", castable=True),
)
_BY_NAME = {d.name: d for d in DTYPES}
_BY_TORCH_NAME = {d.torch_name: d for d in DTYPES}
_BY_SPELLING = {
    spelling.lower(): d for d in DTYPES if d.castable and d.name != "F64" for spelling in (d.short, d.torch_name, *d.aliases) if spelling
}
SHORT_NAMES = tuple(d.short for d in DTYPES if d.short is not None)[::-1]  # fp32, bf16, fp16


def dtype_info(name: str) -> Dtype:
    """The dtype of safetensors name `name` (F32...); a ValueError naming the known ones otherwise."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(_BY_NAME)})") from None


def is_known_dtype(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and name in _BY_NAME


def from_spelling(text: str) -> Dtype | None:
    """The 16/32-bit float that a command-line spelling names (fp32, float32, float, bf16,
    bfloat16, fp16, float16, half; any case), or None."""
    return _BY_SPELLING.get(text.lower())


def from_short(text: str) -> Dtype | None:
    """The dtype of short name `text` (fp32, bf16, fp16), or None."""
    found = from_spelling(text)
    return found if found is not None and found.short == text else None


def of_torch(dtype: torch.dtype) -> Dtype:
    """The entry of a torch dtype; a ValueError when a checkpoint cannot hold it."""
    found = _BY_TORCH_NAME.get(str(dtype).removeprefix("torch."))
    if found is None:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint")
    return found
