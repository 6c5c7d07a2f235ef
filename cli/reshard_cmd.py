"""`fsdpkit reshard SRC DST --world-size M`: a sharded or DCP checkpoint laid out for M ranks."""

from __future__ import annotations

from pathlib import Path

import typer

from fsdpkit import log
from fsdpkit.checkpoint.dcp.metadata import is_dcp_checkpoint

from .checkpoint_options import CHUNK_HELP, chunk_bytes, print_written, required_world_size
from .common import byte_progress, handle_errors

command_app = typer.Typer(add_completion=False)


@command_app.command("reshard")
@handle_errors
def reshard(
    src: Path = typer.Argument(..., help="Sharded checkpoint (run or step directory)."),
    dst: Path = typer.Argument(..., help="Destination directory (must not exist, unless --overwrite)."),
    world_size: int | None = typer.Option(None, "--world-size", help="Number of ranks of the new layout."),
    chunk_size: str = typer.Option("512K", "--chunk-size", help=CHUNK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
) -> None:
    """Lay a sharded checkpoint out for another world size, offline (model and optimizer state)."""
    from fsdpkit.checkpoint.offline.convert import reshard as reshard_checkpoint

    ranks, chunk = required_world_size(world_size), chunk_bytes(chunk_size)
    if is_dcp_checkpoint(src):
        from fsdpkit.checkpoint.dcp.export import reshard_dcp

        print_written(reshard_dcp(src, dst, world_size=ranks, chunk_size=chunk, overwrite=overwrite), as_json)
        return
    with byte_progress("reshard") as progress:
        result = reshard_checkpoint(src, dst, world_size=ranks, chunk_size=chunk, overwrite=overwrite, progress=progress, warn=log.warn)
    print_written(result, as_json)
