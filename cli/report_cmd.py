"""`fsdpkit report FILE [--out PNG]`: draw a training run's metrics or a benchmark. Parse, call
fsdpkit.report.plots, say where the picture is."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fsdpkit.errors import UsageError, install_hint

from .common import handle_errors

command_app = typer.Typer(add_completion=False)


REPORT_HELP = (
    "Draw loss (train and eval), tokens/s, learning rate and memory against step from train --metrics; busbw against "
    "size per collective, and list against flat all-gather, from bench --json; or predicted TFLOPS per device against "
    f"world size from plan --scaling --json. Needs matplotlib: {install_hint('plot')}."
)


@command_app.command(
    "report",
    short_help="Draw train --metrics, bench --json (busbw) or plan --scaling --json (TFLOPS/device) as a PNG.",
    help=REPORT_HELP,
)
@handle_errors
def report(
    source: Annotated[
        Path,
        typer.Argument(help="A train --metrics file (JSON lines), a bench --json or a plan --scaling --json document.", metavar="FILE"),
    ],
    out: Annotated[Path | None, typer.Option("--out", help="The PNG to write (default: FILE with .png).", metavar="PNG")] = None,
) -> None:
    from fsdpkit.report.plots import plot_bench, plot_metrics, plot_scaling, read_report_input

    if not source.is_file():
        raise UsageError(f"{str(source)!r} is not a file")
    target = out if out is not None else source.with_suffix(".png")
    if target.is_dir() or not target.resolve().parent.is_dir():
        raise UsageError(f"--out {str(target)!r} must be a file in an existing directory")
    kind, data = read_report_input(source)
    {"bench": plot_bench, "scaling": plot_scaling, "metrics": plot_metrics}[kind](data, target)
    typer.echo(f"wrote {target}")
