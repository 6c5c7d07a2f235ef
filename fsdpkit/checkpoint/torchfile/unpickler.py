"""The allow-list unpickler of torch's pickles (no torch, nothing from the file runs):
`find_class`, the only way a pickle reaches a callable, returns fsdpkit's inert stand-ins for
the few globals these files name (a format adds its own); any other global is a
`DataCheckError` naming it, raised before anything is built. Persistent ids (storages) are
only recorded.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...dtypes import DTYPES
from ...errors import DataCheckError

# torch's dtype attribute names, the legacy aliases too -> the safetensors spelling used everywhere in fsdpkit
TORCH_DTYPES = {d.torch_name: d.name for d in DTYPES} | dict(float="F32", double="F64", half="F16", long="I64", int="I32", short="I16")
TORCH_DTYPE_NAMES = {d.name: d.torch_name for d in DTYPES}
# torch.save's legacy typed storage classes (`torch.FloatStorage`...) -> dtype
STORAGE_DTYPES = {
    "FloatStorage": "F32",
    "DoubleStorage": "F64",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}


class Record:
    """An inert stand-in for a pickled object: pickle's NEWOBJ/BUILD give it its state."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        record = object.__new__(cls)
        record.__dict__["args"] = args
        return record

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        if isinstance(state, dict):
            if not all(isinstance(key, str) for key in state):
                raise DataCheckError(f"{type(self).__name__}: state keys must be strings")
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def plain_value(self) -> Any:
        """What `plain` shows for this record: its class's qualified name, unless a kind says more."""
        return getattr(self, "qualname", type(self).__name__)


@dataclass(frozen=True)
class Dtype:
    name: str  # safetensors spelling


@dataclass(frozen=True)
class StorageType:
    dtype: str | None  # None: an untyped storage (bytes); the tensor record names the dtype


@dataclass(frozen=True)
class StorageRef:
    """A `torch.save` persistent id: ('storage', type, key, location, numel)."""

    storage_type: StorageType
    key: str
    numel: int


@dataclass(frozen=True)
class TensorRecord:
    storage: StorageRef
    storage_offset: int
    shape: tuple
    stride: tuple
    dtype: str | None  # given by _rebuild_tensor_v3; v2 takes the storage's


def plain(value: Any) -> Any:
    """A record tree as plain data: containers as dicts and lists, a tensor as its dtype and
    shape, a record as its `plain_value`, bytes as their length; other objects as their type's name."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, TensorRecord):
        return f"tensor {value.dtype or value.storage.storage_type.dtype}{list(value.shape)}"
    if isinstance(value, Record):
        return plain(value.plain_value())
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def count_items(value: Any) -> int:
    """The leaves of a record tree (an empty container counts as one)."""
    if isinstance(value, (dict, list)):
        return sum(map(count_items, value.values() if isinstance(value, dict) else value)) or 1
    return 1


def torch_size(values: Any = ()) -> tuple:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
        raise DataCheckError(f"torch.Size of {str(values)[:60]}: expected integers")
    return tuple(values)


def tensor_layout(name: Any) -> str:
    if name != "torch.strided":
        raise DataCheckError(f"tensor layout {str(name)[:40]!r} is not supported (only torch.strided)")
    return "strided"


def memory_format(value: Any) -> int:
    if value not in (0, 1, 2):
        raise DataCheckError(f"unknown memory format encoding {str(value)[:20]}")
    return int(value)


def ordered_dict(*args: Any) -> dict:
    if args:
        raise DataCheckError("OrderedDict with arguments is not expected here")
    return OrderedDict()


def rebuild_tensor_v2(storage: Any, offset: Any, shape: Any, stride: Any, *rest: Any, dtype: str | None = None) -> TensorRecord:
    if not isinstance(storage, StorageRef) or type(offset) is not int:
        raise DataCheckError("a tensor record without a storage or offset")
    return TensorRecord(storage, offset, torch_size(shape), torch_size(stride), dtype)


def rebuild_tensor_v3(
    storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> TensorRecord:
    if not isinstance(dtype, Dtype):
        raise DataCheckError("_rebuild_tensor_v3 without a dtype")
    return rebuild_tensor_v2(storage, offset, shape, stride, dtype=dtype.name)


TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): rebuild_tensor_v3,
    ("collections", "OrderedDict"): ordered_dict,
    ("torch.storage", "UntypedStorage"): StorageType(None),
    ("torch", "UntypedStorage"): StorageType(None),
    **{("torch", name): StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
    **{("torch", name): Dtype(dtype) for name, dtype in TORCH_DTYPES.items()},
}


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


def rebuild_from_type(rebuild: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    """`torch._tensor._rebuild_from_type_v2`: a tensor (subclass) rebuilt by `rebuild(*args)`;
    here only the allowed tensor rebuilds, the subclass and its attributes dropped."""
    if rebuild not in (rebuild_tensor_v2, rebuild_tensor_v3) or not isinstance(args, tuple):
        raise DataCheckError("_rebuild_from_type_v2 of something else than a tensor")
    return rebuild(*args)


def _parameter(data: Any, requires_grad: Any = None, hooks: Any = None, *rest: Any) -> Any:
    if not isinstance(data, TensorRecord):
        raise DataCheckError("a Parameter without a tensor")
    return data


TENSOR_TYPE = "tensor type"

# A whole `torch.save`d state dict: tensors, parameters, sizes and devices.
STATE_DICT_GLOBALS: dict[tuple[str, str], Any] = {
    **TENSOR_GLOBALS,
    ("torch", "Size"): torch_size,
    ("torch", "device"): _device,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch", "Tensor"): TENSOR_TYPE,
    ("torch.nn.parameter", "Parameter"): TENSOR_TYPE,
}


class NumpyDtype(Record):
    qualname = "numpy.dtype"


class NumpyArray(Record):
    """`numpy._core.multiarray._reconstruct(ndarray, (0,), b"b")`, then its state: (version,
    shape, dtype, Fortran order, the bytes)."""

    qualname = "numpy.ndarray"

    def plain_value(self) -> str:
        state = self.get("state")
        if isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], NumpyDtype) and isinstance(state[1], tuple):
            dtype = state[2].get("args", ("?",))[0]
            return f"numpy array {dtype}{list(state[1])}"
        return "numpy array"


def _latin1(text: Any, encoding: Any = None) -> bytes:
    """`_codecs.encode(text, "latin1")`: how pickle protocol 2 writes bytes."""
    if not isinstance(text, str) or encoding != "latin1":
        raise DataCheckError(f"_codecs.encode of {type(text).__name__} with {str(encoding)[:20]!r}: only latin1 text is read")
    return text.encode("latin1")


# numpy arrays (an RNG state's, as `np.random.get_state()` gives it) as records, and bytes
NUMPY_GLOBALS: dict[tuple[str, str], Any] = {
    **{(f"numpy.{core}.multiarray", "_reconstruct"): NumpyArray for core in ("core", "_core")},
    ("numpy", "ndarray"): NumpyArray.qualname,
    ("numpy", "dtype"): NumpyDtype,
    ("_codecs", "encode"): _latin1,
}


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, allowed: dict[tuple[str, str], Any], where: str, *, storages: bool):
        super().__init__(io.BytesIO(raw))
        self._allowed, self._where, self._storages = allowed, where, storages

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise DataCheckError(f"{self._where}: refers to {module}.{name}, which is not allowed (nothing from the file was run)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not self._storages:
            raise DataCheckError(f"{self._where}: holds a persistent id, which a DCP .metadata never does")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageType)):
            raise DataCheckError(f"{self._where}: unexpected persistent id {str(pid)[:80]}")
        if not isinstance(pid[2], str) or type(pid[4]) is not int or pid[4] < 0:
            raise DataCheckError(f"{self._where}: malformed storage id {str(pid)[:80]}")
        return StorageRef(pid[1], pid[2], pid[4])


def restricted_loads(raw: bytes, *, allowed: dict[tuple[str, str], Any], where: str, storages: bool = False) -> Any:
    """Unpickle `raw` admitting only the globals in `allowed`; any failure is one DataCheckError."""
    try:
        return _AllowListUnpickler(raw, allowed, where, storages=storages).load()
    except DataCheckError:
        raise
    except RecursionError:
        raise DataCheckError(f"{where}: pickle nested too deeply") from None
    except Exception as error:  # a malformed pickle raises anything from EOFError to TypeError
        raise DataCheckError(f"{where}: not a readable pickle ({type(error).__name__}: {str(error)[:100]})") from None
