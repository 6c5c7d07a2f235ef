"""`fsdpkit verify CKPT`: every check a checkpoint's format allows; exit 3 when anything is wrong."""

from __future__ import annotations

import typer

from fsdpkit.checkpoint.offline.formats import READ_LABELS

from .common import byte_progress, handle_errors, print_json

command_app = typer.Typer(add_completion=False)


@command_app.command("verify")
@handle_errors
def verify(
    ckpt: str = typer.Argument(
        ..., help=f"A checkpoint: {READ_LABELS} (an fsdpkit run or step directory); fsdpkit's and DCP also at s3://, gs://, az://."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> None:
    """Check every checksum, file size, header, fragment coverage and path; exit 3 when anything is wrong."""
    from fsdpkit.checkpoint.offline.locations import verify_at

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
