"""`fsdpkit verify CKPT`: every check a checkpoint's format allows; exit 3 when anything is wrong."""

from __future__ import annotations

from typing import Any

import typer

from fsdpkit.checkpoint.core.bytecopy import DEFAULT_CHUNK_SIZE
from fsdpkit.checkpoint.offline.formats import READ_LABELS
from fsdpkit.progress import byte_progress

from .common import print_json
from .spread_options import DryRun, launch_options, run_spread_command, spread_command, spreads_from


def verify(
    ctx: typer.Context,
    ckpt: str = typer.Argument(
        ..., help=f"A checkpoint: {READ_LABELS} (an fsdpkit run or step directory); fsdpkit's and DCP also at s3://, gs://, az://."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
    dry_run: DryRun = False,
    **settings: Any,
) -> None:
    """Check every checksum, file size, header, fragment coverage and path; exit 3 when anything is wrong."""
    from fsdpkit.checkpoint.offline.locations import verify_at

    options = launch_options(ctx, settings, dry_run=dry_run, restart=False, spreads=spreads_from("verify", ckpt), locations=(ckpt,))[0]
    if options is not None:
        from fsdpkit.checkpoint.spread.runner import SpreadTask  # the spread machinery: imported by a spread run only

        report = run_spread_command(
            SpreadTask("verify", str(ckpt), chunk_size=DEFAULT_CHUNK_SIZE), options, dry_run=dry_run, as_json=as_json, early=ctx.obj
        )
        if report is None:
            return
    else:
        with byte_progress("verify") as progress:
            report = verify_at(ckpt, progress)
    if as_json:
        print_json(report.to_json())
    elif report.ok:
        typer.echo(f"ok {report.path}: {report.summary_line()}")
    if not report.ok:
        more = len(report.problems) - 1
        typer.echo(f"error: {report.problems[0]}" + (f" (+{more} more problems, listed by --json)" if more else ""), err=True)
        raise typer.Exit(3)


command_app = spread_command("verify", verify)
