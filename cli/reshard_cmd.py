"""`fsdpkit reshard SRC DST --world-size M`: a checkpoint laid out for M ranks, in its own format."""

from __future__ import annotations

import typer

from fsdpkit import log
from fsdpkit.checkpoint.offline.formats import RESHARD_LABELS

from .checkpoint_options import CHUNK_HELP, chunk_bytes, print_written, required_world_size
from .common import byte_progress, handle_errors

command_app = typer.Typer(add_completion=False)


@command_app.command("reshard")
@handle_errors
def reshard(
    src: str = typer.Argument(..., help=f"A checkpoint: {RESHARD_LABELS} (an fsdpkit run or step directory), written in its format."),
    dst: str = typer.Argument(..., help="Destination directory (must not exist, unless --overwrite)."),
    world_size: int | None = typer.Option(None, "--world-size", help="Number of ranks of the new layout."),
    chunk_size: str = typer.Option("512K", "--chunk-size", help=CHUNK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
) -> None:
    """Lay a checkpoint out for another world size, offline, in its own format (model and optimizer state)."""
    from dataclasses import replace

    from fsdpkit.checkpoint.core.request import ReshardRequest
    from fsdpkit.checkpoint.offline.locations import reshard_at

    request = ReshardRequest(required_world_size(world_size))  # --world-size is checked before --chunk-size
    request = replace(request, chunk_size=chunk_bytes(chunk_size), overwrite=overwrite, warn=log.warn)
    with byte_progress("reshard") as progress:
        result = reshard_at(src, dst, replace(request, progress=progress))
    print_written(result, as_json)
