"""What one rank writes at save time: its fragments, into its own safetensors file.

No process group here; the engine calls this on every rank, gathers the returned records
on rank 0 and builds the manifest (see `commit.py` for the whole sequence)::

    tmp = commit.begin(run_dir, step)                     # every rank (same path: shared FS)
    record = write_rank_file(tmp, rank=r, world_size=W, fragments=[
        FragmentData("h.0.attn.weight", (768, 768), ElementRange(0, 4096), flat_piece),
        FragmentData("optim.exp_avg.h.0.attn.weight", (768, 768), ElementRange(0, 4096), exp_avg_piece),
        ...])                                             # every rank, in parallel
    records = gather_object(record) to rank 0; barrier
    manifest = build_manifest(world_size=W, strategy="full_shard", plan=Plan.flat(units),
                              records=records, training_state={...}, aliases={...})
    commit.commit(tmp, run_dir, step, manifest, keep_last=K)   # rank 0; then barrier

A fragment is (tensor name, full tensor shape, element range of the flat tensor, 1-D tensor
holding exactly those elements). Empty ranges are allowed (they are recorded so a
zero-element tensor still gets a manifest entry, and never stored). The dtype stored is the
data's dtype. Each fragment is copied to CPU one at a time (extra memory: one fragment),
its crc32 computed, and written; the file is fsynced before this returns.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..layout import ElementRange
from .format import numel, rank_file_name
from .safetensors_io import StreamingWriter

TORCH_TO_SAFETENSORS = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3",
}
SAFETENSORS_TO_TORCH = {name: dtype for dtype, name in TORCH_TO_SAFETENSORS.items()}


@dataclass(frozen=True)
class FragmentData:
    name: str
    shape: tuple[int, ...]  # shape of the whole tensor
    range: ElementRange  # the elements of its flat form held here
    data: torch.Tensor  # 1-D, exactly range.size elements


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint") from None


def tensor_bytes(data: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, copied to CPU if needed."""
    flat = data.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_rank_file(directory: str | Path, *, rank: int, world_size: int, fragments: Iterable[FragmentData]) -> dict:
    """Write `rank-0000r-of-0000W.safetensors` in `directory`; return its JSON-able record:
    {"file", "rank", "size", "fragments": [{"name", "key", "shape", "dtype", "start", "end", "crc32"}]}."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    items = [_checked(f) for f in fragments]
    names = [f.name for f in items]
    if len(set(names)) != len(names):
        raise ValueError(f"rank {rank} has two fragments of one tensor: {sorted({n for n in names if names.count(n) > 1})[:3]}")
    file_name = rank_file_name(rank, world_size)
    stored = {f.name: f for f in items if f.range.size}
    entries = [(f.name, safetensors_dtype(f.data.dtype), (f.range.size,)) for f in stored.values()]
    crcs = {}
    with StreamingWriter(Path(directory) / file_name, entries, metadata={"format": "pt"}) as writer:
        for name, _ in writer.order:
            data = tensor_bytes(stored[name].data)
            crcs[name] = zlib.crc32(data)
            writer.write(data)
    return {"file": file_name, "rank": rank, "size": writer.size, "fragments": [
        {"name": f.name, "key": f.name, "shape": list(f.shape), "dtype": safetensors_dtype(f.data.dtype),
         "start": f.range.start, "end": f.range.end, "crc32": crcs.get(f.name, 0)} for f in items]}


def _checked(fragment) -> FragmentData:
    if not isinstance(fragment, FragmentData):
        name, shape, rng, data = fragment
        fragment = FragmentData(name, tuple(shape), rng, data)
    shape = tuple(int(d) for d in fragment.shape)
    if fragment.data.dim() != 1 or fragment.data.numel() != fragment.range.size:
        raise ValueError(f"fragment of {fragment.name!r}: data has shape {list(fragment.data.shape)}, "
                         f"expected 1-D with {fragment.range.size} elements for [{fragment.range.start}, {fragment.range.end})")
    if fragment.range.end > numel(shape):
        raise ValueError(f"fragment of {fragment.name!r}: range ends at {fragment.range.end}, tensor {list(shape)} has {numel(shape)} elements")
    return FragmentData(fragment.name, shape, fragment.range, fragment.data)
