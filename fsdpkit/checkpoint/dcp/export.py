"""DCP output chunked as FSDP2 at N ranks, staged and renamed when complete: `convert SRC OUT
--to dcp` (any checkpoint's tensors in FSDP2's `{"model", "optimizer"}` layout, the param
groups in both of `get_state_dict`'s layouts: `param_groups`) and `reshard DCP OUT
--world-size N` (every item kept, bytes items byte for byte). A model tensor `name` is
`model.<name>` (tied aliases too: FSDP2's state dict holds every name), `optim.<state>.<param>`
is `optimizer.state.<param>.<state>`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..core.bytecopy import DEFAULT_CHUNK_SIZE, SourceTensor
from ..core.names import DATA_SOURCE_PATH, split_optim_tensor_name
from ..core.report import WriteReport
from ..core.staging import staged_output
from .param_groups import param_group_items
from .table import open_dcp
from .writer import OutBytes, OutTensor, torch_saved, write_dcp


@dataclass(frozen=True)
class DcpOutput:
    """How a DCP checkpoint is written: chunked as FSDP2 at `world_size` ranks."""

    world_size: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overwrite: bool = False


def _write(src: Path, dst: Path, tensors: list[OutTensor], items: list[OutBytes], output: DcpOutput, counts: dict) -> WriteReport:
    total = sum(t.source.nbytes for t in tensors)
    needed = total + (output.world_size + len(tensors)) * 4096
    with staged_output(dst, src=src, overwrite=output.overwrite, needed_bytes=needed) as tmp:
        files = write_dcp(tmp, tensors, items, world_size=output.world_size, chunk_size=output.chunk_size)
    details = {"to": "dcp", "world_size": output.world_size, **counts}
    return WriteReport(str(src), str(dst), files, len(tensors), total, [], details)


def dcp_entries(
    sources: list[SourceTensor], *, aliases: dict[str, str], groups: list[dict], data_source: str | None
) -> tuple[list[OutTensor], list[OutBytes]]:
    """The tensors and bytes items `sources_to_dcp` writes (see there)."""
    tensors, by_name = [], {s.name: s for s in sources}
    for source in sources:
        optim = split_optim_tensor_name(source.name)
        tensors.append(OutTensor(("optimizer", "state", optim[1], optim[0]) if optim else ("model", source.name), source))
    tensors += [
        OutTensor(("model", alias), by_name[stored]) for alias, stored in aliases.items() if alias not in by_name and stored in by_name
    ]
    items = [OutBytes(path, read) for path, read in param_group_items(groups, torch_saved)]
    if data_source is not None:
        items.append(OutBytes(DATA_SOURCE_PATH, partial(torch_saved, data_source)))
    return tensors, items


def sources_to_dcp(
    sources: list[SourceTensor],
    src: Path,
    dst: Path,
    *,
    aliases: dict[str, str],
    groups: list[dict],
    output: DcpOutput,
    data_source: str | None = None,
) -> WriteReport:
    """Model and optimizer sources and param groups, in fsdpkit's names and form, as DCP at `dst`;
    and the data source the run trained on, when known (DATA_SOURCE_PATH: a resume on other data says so)."""
    tensors, items = dcp_entries(sources, aliases=aliases, groups=groups, data_source=data_source)
    return _write(src, dst, tensors, items, output, {"param_groups": len(groups)})


def reshard_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    world_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
) -> WriteReport:
    """A DCP checkpoint chunked as FSDP2 at `world_size` ranks; every item kept."""
    output = DcpOutput(world_size, chunk_size, overwrite)
    with open_dcp(src) as checkpoint:
        metadata = checkpoint.metadata
        tensors = [OutTensor(metadata.paths.get(key) or (key,), checkpoint.source(key)) for key in metadata.tensors]
        items = [OutBytes(metadata.paths.get(key) or (key,), partial(checkpoint.read_bytes_item, key)) for key in metadata.bytes_items]
        return _write(Path(src), Path(dst), tensors, items, output, {"bytes_items": len(items)})
