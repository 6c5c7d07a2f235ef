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
from functools import partial
from pathlib import Path

from ...errors import UsageError
from ..format.bytecopy import DEFAULT_CHUNK_SIZE, SourceTensor
from ..format.names import split_optim_tensor_name
from ..format.storage import staged_output
from .metadata import DcpMetadata, DcpPath
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

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"--world-size must be >= 1, got {self.world_size}")


def _write(src: Path, dst: Path, tensors: list[OutTensor], items: list[OutBytes], output: DcpOutput, counts: dict) -> dict:
    """The checkpoint staged at `dst` and renamed when complete; what was written, with `counts`."""
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
        **counts,
        "bytes": total,
    }


def sources_to_dcp(
    sources: list[SourceTensor], src: Path, dst: Path, *, aliases: dict[str, str], groups: list[dict], output: DcpOutput
) -> dict:
    """Model and optimizer sources (fsdpkit's names) and the optimizer's param groups
    (fsdpkit's form) as a DCP checkpoint at `dst`."""
    items = [OutBytes(path, read) for path, read in param_group_items(groups, torch_saved)]
    return _write(src, dst, _out_tensors(sources, aliases), items, output, {"param_groups": len(groups)})


def _path(metadata: DcpMetadata, key: str) -> DcpPath:
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
    output = DcpOutput(world_size, chunk_size, overwrite)
    with open_dcp(src) as checkpoint:
        metadata = checkpoint.metadata
        tensors = [OutTensor(_path(metadata, key), checkpoint.source(key)) for key in metadata.tensors]
        items = [OutBytes(_path(metadata, key), partial(checkpoint.read_bytes_item, key)) for key in metadata.bytes_items]
        return _write(Path(src), Path(dst), tensors, items, output, {"bytes_items": len(items)})
