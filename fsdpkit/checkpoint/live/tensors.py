"""Checkpoint bytes as torch tensors: dtype names, raw bytes, and readers of element ranges of
named tensors from a sharded checkpoint, a full one, or a full one with an export layout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ...dtypes import dtype_info, of_torch
from ...flat_layout import ElementRange
from ..core.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..format.manifest import Manifest
from ..format.reader import FullCheckpoint, open_full, open_sharded, open_sharded_lazily


def safetensors_dtype(dtype: torch.dtype) -> str:
    return of_torch(dtype).name


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (numpy's buffer protocol)."""
    array: Any = tensor.view(torch.uint8).numpy()  # numpy's stubs do not declare the buffer protocol
    return memoryview(array)


def raw_bytes(data: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, copied to CPU if needed."""
    flat = data.detach().reshape(-1).cpu().contiguous()
    return byte_view(flat) if flat.numel() else memoryview(b"")


class RangeReader(Protocol):
    """What a load reads through: element ranges of named tensors, and whole tensors."""

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor: ...

    def read_tensor(self, name: str) -> torch.Tensor: ...


class TensorReader:
    """Element ranges of named tensors as torch tensors, through the byte engine (every
    checksummed piece verified when first touched)."""

    def __init__(self, sources: list[SourceTensor], aliases: dict[str, str]):
        self._sources = {source.name: source for source in sources}
        self.aliases = dict(aliases)
        self._copier = ByteEngine(chunk_size=DEFAULT_CHUNK_SIZE)

    def source(self, name: str) -> SourceTensor:
        source = self._sources.get(self.aliases.get(name, name))
        if source is None:
            raise KeyError(f"no tensor {name!r} in the checkpoint")
        return source

    def tensor_names(self) -> list[str]:
        return list(self._sources)

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        """Elements `wanted` of the flat form of tensor `name` (an alias reads its stored tensor)."""
        source = self.source(name)
        if wanted.end > source.numel:
            raise ValueError(f"range [{wanted.start}, {wanted.end}) outside {source.name!r} of {source.numel} elements")
        out = torch.empty(wanted.size, dtype=dtype_info(source.dtype).torch)
        if wanted.size:
            self._copier.read_into(source, wanted, byte_view(out))
        return out

    def read_tensor(self, name: str) -> torch.Tensor:
        source = self.source(name)
        return self.read_range(name, ElementRange(0, source.numel)).reshape(source.shape)

    def close(self) -> None:
        self._copier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CheckpointReader(TensorReader):
    """A sharded checkpoint (run dir, following `latest`, or step dir) with a validated manifest;
    `validate_all=False` (a worker's load) validates each file when first touched, not all first."""

    def __init__(self, path: str | os.PathLike, *, validate_all: bool = True):
        checkpoint = open_sharded(path) if validate_all else open_sharded_lazily(path)
        super().__init__(checkpoint.sources(), checkpoint.manifest.aliases)
        self.step_dir: Path = checkpoint.step_dir
        self.manifest: Manifest = checkpoint.manifest
        self.training_state: dict = checkpoint.manifest.training_state

    def fragments(self, name: str) -> list[tuple[str, ElementRange]]:
        """(file name, element range) of every fragment of tensor `name`, in order."""
        source = self.source(name)
        return [(piece.path.name, piece.range) for piece in source.pieces_in(ElementRange(0, source.numel))]


class RestoredReader(TensorReader):
    """A full checkpoint written with an export layout (export.py), read under fsdpkit's names and
    orientation. A range of a transposed weight is read as one short run from each stored row,
    so a rank still reads about the bytes it owns."""

    def __init__(self, full: FullCheckpoint):
        layout = full.layout
        if layout is None:
            raise ValueError(f"{full.root}: records no export layout to restore")
        sources, self._stored = [], {}
        for tensor in full.tensors:
            name = layout.original_name(tensor.name)
            if name is None:
                continue
            shape = tuple(reversed(tensor.shape))
            if layout.is_transposed(name, shape):
                self._stored[name] = tensor
                sources.append(SourceTensor(name, shape, tensor.dtype))
            else:
                sources.append(SourceTensor(name, tensor.shape, tensor.dtype, tensor.pieces))
        aliases = {layout.original_name(a) or a: layout.original_name(t) or t for a, t in full.aliases.items()}
        super().__init__(sources, aliases)

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        source = self.source(name)
        stored = self._stored.get(source.name)
        if stored is None:
            return super().read_range(name, wanted)
        rows, cols = source.shape  # fsdpkit's orientation; the file holds the (cols, rows) transpose
        out = torch.empty(wanted.size, dtype=dtype_info(source.dtype).torch)
        if not wanted.size:
            return out
        first, last = wanted.start // cols, (wanted.end - 1) // cols + 1
        block = torch.empty(cols, last - first, dtype=out.dtype)
        for column in range(cols):
            run = ElementRange(column * rows + first, column * rows + last)
            self._copier.read_into(stored, run, byte_view(block[column]))
        return block.t().reshape(-1)[wanted.start - first * cols : wanted.end - first * cols].clone()


def full_reader(path: str | os.PathLike, names: Sequence[str] = ()) -> TensorReader:
    """A full (Hugging Face style) checkpoint's tensors, tied aliases resolved; through its
    export layout (RestoredReader) where the `names` asked for are not there as stored."""
    full = open_full(path)
    stored = {t.name for t in full.tensors} | set(full.aliases)
    if full.layout is not None and not all(name in stored for name in names):
        return RestoredReader(full)
    return TensorReader(list(full.tensors), full.aliases)
