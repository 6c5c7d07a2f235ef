"""`fsdpkit reshard SRC DST --world-size M`: a checkpoint laid out for M ranks, in its own format."""

from __future__ import annotations

from typing import Any

import typer

from fsdpkit import log
from fsdpkit.checkpoint.offline.formats import RESHARD_LABELS
from fsdpkit.progress import byte_progress

from .checkpoint_options import CHUNK_HELP, chunk_bytes, print_written, required_world_size
from .spread_options import DryRun, Restart, launch_options, run_spread_command, spread_command, spreads_from


def reshard(
    ctx: typer.Context,
    src: str = typer.Argument(..., help=f"A checkpoint: {RESHARD_LABELS} (an fsdpkit run or step directory), written in its format."),
    dst: str = typer.Argument(..., help="Destination directory (must not exist, unless --overwrite)."),
    world_size: int | None = typer.Option(None, "--world-size", help="Number of ranks of the new layout."),
    chunk_size: str = typer.Option("512K", "--chunk-size", help=CHUNK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
    dry_run: DryRun = False,
    restart: Restart = False,
    **settings: Any,
) -> None:
    """Lay a checkpoint out for another world size, offline, in its own format (model and optimizer state)."""
    from dataclasses import replace

    from fsdpkit.checkpoint.core.request import ReshardRequest
    from fsdpkit.checkpoint.spread.to_storage import reshard_to

    request = ReshardRequest(required_world_size(world_size))  # --world-size is checked before --chunk-size
    request = replace(request, chunk_size=chunk_bytes(chunk_size), overwrite=overwrite, warn=log.warn)
    options, resumes = launch_options(
        ctx, settings, dry_run=dry_run, restart=restart, spreads=spreads_from("reshard", src), locations=(src, dst), dst=dst
    )
    if options is not None:
        from fsdpkit.checkpoint.spread.runner import SpreadTask  # the spread machinery: imported by a spread run only

        ranks, chunk = request.world_size, request.chunk_size
        task = SpreadTask(
            "reshard", str(src), str(dst), world_size=ranks, chunk_size=chunk, overwrite=overwrite, restart=restart, resumes=resumes
        )
        result = run_spread_command(task, options, dry_run=dry_run, as_json=as_json, early=ctx.obj)
        if result is None:
            return
        for line in result.warnings:
            log.warn(line)
    else:
        with byte_progress("reshard") as progress:
            result = reshard_to(src, dst, replace(request, progress=progress))
    print_written(result, as_json)


command_app = spread_command("reshard", reshard)
