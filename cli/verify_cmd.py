"""`fsdpkit verify CKPT`: every check a checkpoint's format allows; exit 3 when anything is wrong."""

from __future__ import annotations

from pathlib import Path

import typer

from fsdpkit.checkpoint.offline.formats import READ_LABELS, detect_format
from fsdpkit.sizes import count, format_size

from .common import byte_progress, handle_errors, print_json

command_app = typer.Typer(add_completion=False)


@command_app.command("verify")
@handle_errors
def verify(
    ckpt: Path = typer.Argument(..., help=f"A checkpoint: {READ_LABELS} (an fsdpkit run or step directory)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> None:
    """Check every checksum, file size, header, fragment coverage and path; exit 3 when anything is wrong."""
    with byte_progress("verify") as progress:
        report = detect_format(ckpt).verify(ckpt, progress)
    if as_json:
        print_json(report)
    elif report["ok"]:
        typer.echo(f"ok {report['path']}: {_what_was_checked(report)}")
    if not report["ok"]:
        more = len(report["problems"]) - 1
        typer.echo(f"error: {report['problems'][0]}" + (f" (+{more} more problems, listed by --json)" if more else ""), err=True)
        raise typer.Exit(3)


def _what_was_checked(report: dict) -> str:
    size = format_size(report["bytes"])
    if report["kind"] == "dcp":
        return (
            f"dcp, {count(report['tensors'], 'tensor')}, {count(report['chunks'], 'chunk')}, "
            f"{count(report['bytes_items'], 'bytes item')}, {size}; checked: {'; '.join(report['checked'])}; "
            f"not checked: {'; '.join(report['not_checked'])}"
        )
    if report["kind"] in ("deepspeed", "torch-save-ranks"):
        return f"{report['kind']}, {report['tensors']} tensors, {report['files']} files, {size}; checked: {'; '.join(report['checked'])}"
    if report["kind"] == "full":
        return (
            f"full safetensors, {report['tensors']} tensors in {count(report['files'], 'file')}, {size}: headers, file sizes and the "
            "index checked (this format has no checksums)"
        )
    return (
        f"sharded, {report['tensors']} tensors, {size}: the crc32 of all {report['fragments']} fragments, file sizes, "
        "headers, fragment coverage and file names checked"
    )
