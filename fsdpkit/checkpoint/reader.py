"""Loading from a sharded checkpoint by element ranges (torch side, used by the engine).

    reader = CheckpointReader("run")           # run dir (follows `latest`) or a step dir
    reader.manifest.world_size, reader.training_state, reader.aliases
    piece = reader.read_range("h.0.attn.weight", ElementRange(4096, 8192))   # 1-D tensor
    whole = reader.read_tensor("wte.weight")  # shaped; aliases resolve to the stored tensor

Construction validates everything before any weight is used: manifest schema, safe file
names, every file's size and safetensors header against the manifest, fragment coverage
(`sharded.open_sharded`); errors are `DataCheckError` (exit 3) naming the file.
`read_range` opens only the files holding overlapping fragments (`safe_open(...).get_slice`).
The first time a fragment is touched it is read whole and its crc32 checked; later reads of
the same fragment take just the slice they need. So a rank that loads its own chunk at the
saved world size reads and verifies exactly its own bytes; at another world size it reads
each overlapping fragment once in full.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import DataCheckError
from ..layout import ElementRange
from .manifest import Manifest, TensorEntry
from .sharded import open_sharded
from .writer import SAFETENSORS_TO_TORCH, tensor_bytes


class CheckpointReader:
    def __init__(self, path: str | Path):
        self._checkpoint = open_sharded(path)
        self._entries = self._checkpoint.manifest.tensor_map()
        self._handles: dict[str, object] = {}
        self._verified: set[tuple[str, str]] = set()

    @property
    def step_dir(self) -> Path:
        return self._checkpoint.step_dir

    @property
    def manifest(self) -> Manifest:
        return self._checkpoint.manifest

    @property
    def training_state(self) -> dict:
        return self.manifest.training_state

    @property
    def aliases(self) -> dict[str, str]:
        return self.manifest.aliases

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.manifest.tensors]

    def tensor(self, name: str) -> TensorEntry:
        """The manifest entry of `name` (an alias resolves to its stored tensor)."""
        entry = self._entries.get(self.manifest.aliases.get(name, name))
        if entry is None:
            raise KeyError(f"{self.step_dir}: no tensor {name!r} in the checkpoint")
        return entry

    def _file(self, name: str):
        if name not in self._handles:
            self._handles[name] = safe_open(str(self._checkpoint.headers[name].path), framework="pt")
        return self._handles[name]

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        entry = self.tensor(name)
        if wanted.end > entry.numel:
            raise ValueError(f"range [{wanted.start}, {wanted.end}) outside {entry.name!r} of {entry.numel} elements")
        out = torch.empty(wanted.size, dtype=SAFETENSORS_TO_TORCH[entry.dtype])
        for frag in entry.fragments:
            piece = frag.range.intersect(wanted)
            if not piece.size:
                continue
            handle = self._file(frag.file)
            local = piece.shift(-frag.start)
            if (frag.file, frag.key) in self._verified:
                data = handle.get_slice(frag.key)[local.start:local.end]
            else:
                whole = handle.get_slice(frag.key)[:]
                crc = zlib.crc32(tensor_bytes(whole))
                if crc != frag.crc32:
                    raise DataCheckError(f"{self.step_dir / frag.file}: checksum mismatch in key {frag.key!r} "
                                         f"[{frag.start}, {frag.end}): stored crc32 {frag.crc32:08x}, data gives {crc:08x}")
                self._verified.add((frag.file, frag.key))
                data = whole[local.start:local.end]
            out[piece.start - wanted.start: piece.end - wanted.start] = data
        return out

    def read_tensor(self, name: str) -> torch.Tensor:
        entry = self.tensor(name)
        return self.read_range(entry.name, ElementRange(0, entry.numel)).reshape(entry.shape)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
