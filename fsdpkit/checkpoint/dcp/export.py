"""DCP output: `convert SRC OUT --to dcp` (any checkpoint's tensor table -> FSDP2's
`{"model", "optimizer"}` layout) and `reshard DCP OUT --world-size N` (DCP -> DCP chunked as
FSDP2 at N ranks, every item kept, bytes items byte for byte).

Names: a model tensor `name` is `model.<name>` (tied aliases too: FSDP2's state dict holds
every name), `optim.<state>.<param>` is `optimizer.state.<param>.<state>`, and the optimizer's
param groups the source records become `optimizer.param_groups.<i>.<setting>`
items, as `get_state_dict` gives them, nested by group index and flattened per parameter
(`optimizer.param_groups.<fqn>.<setting>`), so either `flatten_optimizer_state_dict` setting loads.
Written under a temporary name, renamed when complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError
from ..format.bytecopy import DEFAULT_CHUNK_SIZE, SourceTensor
from ..format.files import open_regular, read_exactly
from ..format.names import split_optim_tensor_name
from ..format.storage import staged_output
from .metadata import DcpMetadata, Location
from .param_groups import param_group_items
from .table import open_dcp
from .writer import OutBytes, OutTensor, torch_saved, write_dcp


def _out_tensors(sources: list[SourceTensor], aliases: dict[str, str]) -> list[OutTensor]:
    out, by_name = [], {s.name: s for s in sources}
    for source in sources:
        optim = split_optim_tensor_name(source.name)
        out.append(OutTensor(("optimizer", "state", optim[1], optim[0]) if optim else ("model", source.name), source))
    for alias, stored in aliases.items():
        if alias not in by_name and stored in by_name:
            out.append(OutTensor(("model", alias), by_name[stored]))
    return out


@dataclass(frozen=True)
class DcpOutput:
    """How a DCP checkpoint is written: chunked as FSDP2 at `world_size` ranks."""

    world_size: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overwrite: bool = False


def sources_to_dcp(
    sources: list[SourceTensor], src: Path, dst: Path, *, aliases: dict[str, str], groups: list[dict], output: DcpOutput
) -> dict:
    """Model and optimizer sources (fsdpkit's names) and the optimizer's param groups
    (fsdpkit's form) as a DCP checkpoint at `dst`, staged and renamed when complete."""
    if output.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {output.world_size}")
    tensors = _out_tensors(sources, aliases)
    items = [OutBytes(path, read) for path, read in param_group_items(groups, torch_saved)]
    total = sum(t.source.nbytes for t in tensors)
    needed = total + (output.world_size + len(tensors)) * 4096
    with staged_output(dst, src=src, overwrite=output.overwrite, needed_bytes=needed) as tmp:
        files = write_dcp(tmp, tensors, items, world_size=output.world_size, chunk_size=output.chunk_size)
    return {
        "src": str(src),
        "dst": str(dst),
        "to": "dcp",
        "world_size": output.world_size,
        "files": files,
        "tensors": len(tensors),
        "param_groups": len(groups),
        "bytes": total,
    }


def _carried(directory: Path, location: Location):
    def read() -> bytes:
        fd, _ = open_regular(directory / location.file)
        try:
            return read_exactly(fd, location.length, location.offset, directory / location.file)
        finally:
            os.close(fd)

    return read


def _path(metadata: DcpMetadata, key: str) -> tuple[str | int, ...]:
    return metadata.paths.get(key) or (key,)


def reshard_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    world_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
) -> dict:
    """A DCP checkpoint chunked as FSDP2 at `world_size` ranks; every item kept."""
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    with open_dcp(src) as checkpoint:
        metadata = checkpoint.metadata
        tensors = [OutTensor(_path(metadata, key), checkpoint.source(key)) for key in metadata.tensors]
        items = [OutBytes(_path(metadata, key), _carried(metadata.directory, b.location)) for key, b in metadata.bytes_items.items()]
        total = sum(t.source.nbytes for t in tensors)
        with staged_output(Path(dst), src=Path(src), overwrite=overwrite, needed_bytes=total + (world_size + len(tensors)) * 4096) as tmp:
            files = write_dcp(tmp, tensors, items, world_size=world_size, chunk_size=chunk_size)
    return {
        "src": str(src),
        "dst": str(dst),
        "to": "dcp",
        "world_size": world_size,
        "files": files,
        "tensors": len(tensors),
        "bytes_items": len(items),
        "bytes": total,
    }
